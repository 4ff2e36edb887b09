// A SIGINT relay that any thread can put in place: a C-level handler in
// front of the one the process has, which writes a byte to a pipe (the only
// thing it does besides handing the signal on) and then calls the previous
// handler, so that Python's own still trips and the main thread still gets
// its KeyboardInterrupt. Python lets only the main thread set a handler;
// Optuna's n_jobs runs trials on worker threads, so the thread that first
// trains there may be any (waterwave/exec/ctrl_c.py reads the pipe).
//
// May include: the standard library and POSIX.
#pragma once

namespace waterwave {

// Puts the relay in front of the process's SIGINT handler, writing to
// `write_fd` (which should not block); where it is in place already (a
// forked child re-arming it), only the file descriptor changes. Returns
// false, changing nothing, where there is no handler to relay to (SIGINT
// ignored or at its default). Not async-signal-safe; call from one thread
// at a time.
bool relay_sigint(int write_fd);

// The relay writes nowhere from now on; it still hands every SIGINT on. A
// forked child calls it before closing the pipe it inherited, so that a
// file later given that descriptor never receives the relay's bytes.
void detach_sigint_relay();

// SIGINTs the relay has seen since it was put in place.
unsigned long sigints_relayed();

}  // namespace waterwave
