"""Ctrl-C reaches every thread that trains.

A SIGINT lands on the main thread only, as ``KeyboardInterrupt``; jobs and
sharing members that train on other threads (Optuna's ``n_jobs`` runs
trials on worker threads) would train on. So, the first time anything
trains in a training session or a trainer (``watch()``, from ``Job.train``,
``waterwave.sharing`` and ``ConcurrentTrainer``), Waterwave arranges that a
SIGINT also stops every session and every trainer's run
(``session.interrupt_all``, ``concurrent.interrupt_all``). Importing
waterwave changes nothing.

- On the main thread, where Python lets a handler be set, Python's own
  handler is wrapped: the sessions stop, then the main thread gets its
  ``KeyboardInterrupt`` as before.
- On another thread, where it cannot, a C-level relay goes in front of
  Python's handler (``_C.relay_sigint``): it writes a byte to a pipe and
  hands the signal on, so the main thread still gets its
  ``KeyboardInterrupt``; a daemon thread reading the pipe stops the
  sessions, within milliseconds.

Either way only where the handler in place is Python's own default: a
program that set its own SIGINT handler keeps it, and decides itself. A
forked child (a ``multiprocessing`` worker) keeps the relay in place but
writes nowhere, closes the pipe it shares with its parent, and arranges
Ctrl-C afresh when it first trains.

May import: this package (lazily); waterwave._C.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from .. import _C

_lock = threading.Lock()
_watching: str | None = None  # "python", "relay", "not ours", or None: not yet
_pipe: tuple[int, int] | None = None  # the relay's (read, write) ends


def watch() -> None:
    """Make SIGINT stop every training session, once per process (see the
    module's opening); cheap after the first call."""
    global _watching
    if _watching is not None:
        return
    with _lock:
        if _watching is not None:
            return
        try:
            if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
                _watching = "not ours"  # the program's own handler, or SIGINT ignored
                return
        except ValueError:  # not the main interpreter
            _watching = "not ours"
            return
        if threading.current_thread() is threading.main_thread():
            _wrap_python_handler()
            _watching = "python"
        else:
            _watching = "relay" if _start_relay() else "not ours"


def mode() -> str | None:
    """How SIGINT reaches the sessions: ``"python"`` (Python's handler
    wrapped), ``"relay"`` (the C-level relay), ``"not ours"`` (the program
    handles SIGINT itself), or None before anything trained."""
    return _watching


def _stop_sessions() -> None:
    """Every training session's jobs and members, and every
    ``ConcurrentTrainer``'s run, stop at their next group or gate."""
    for name in ("waterwave.exec.session", "waterwave.exec.concurrent"):
        runs = sys.modules.get(name)  # not imported: nothing of its kind trains
        if runs is not None:
            runs.interrupt_all()


def _wrap_python_handler() -> None:
    previous = signal.getsignal(signal.SIGINT)

    def on_interrupt(signum, frame):
        _stop_sessions()
        previous(signum, frame)

    signal.signal(signal.SIGINT, on_interrupt)


def _start_relay() -> bool:
    global _pipe
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # a signal handler must never block
    if not _C.relay_sigint(write_fd):
        os.close(read_fd)
        os.close(write_fd)
        return False
    _pipe = (read_fd, write_fd)

    def relay() -> None:
        while True:
            try:
                if not os.read(read_fd, 64):
                    return
            except InterruptedError:
                continue
            _stop_sessions()

    threading.Thread(target=relay, name="waterwave Ctrl-C relay", daemon=True).start()
    return True


def _after_fork_in_child() -> None:
    """A forked child has the relay but not the thread reading its pipe,
    whose ends it shares with the parent: the relay writes nowhere and the
    child closes its ends (a file it opens later may take their numbers);
    its first training arranges Ctrl-C afresh."""
    global _watching, _pipe, _lock
    _lock = threading.Lock()  # another thread of the parent's may have held it
    if _pipe is not None:
        _C.detach_sigint_relay()
        for fd in _pipe:
            os.close(fd)
        _pipe = None
        _watching = None


os.register_at_fork(after_in_child=_after_fork_in_child)
