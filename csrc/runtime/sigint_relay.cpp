#include "sigint_relay.h"

#include <errno.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

namespace waterwave {

namespace {

struct sigaction previous_action;
std::atomic<int> relay_fd{-1};
std::atomic<unsigned long> relayed{0};

// Async-signal-safe: an atomic add, write(2), and the previous handler
// (Python's sets a flag and writes its own wakeup byte).
void on_sigint(int signum, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  relayed.fetch_add(1, std::memory_order_relaxed);
  const int fd = relay_fd.load(std::memory_order_relaxed);
  if (fd >= 0) {
    const char byte = 1;
    [[maybe_unused]] const ssize_t written = write(fd, &byte, 1);  // full pipe: one is there
  }
  errno = saved_errno;
  if (previous_action.sa_flags & SA_SIGINFO) {
    previous_action.sa_sigaction(signum, info, context);
  } else {
    previous_action.sa_handler(signum);
  }
}

}  // namespace

bool relay_sigint(int write_fd) {
  struct sigaction current;
  if (sigaction(SIGINT, nullptr, &current) != 0) return false;
  if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == &on_sigint) {
    relay_fd.store(write_fd);  // in place already (a forked child re-arming it)
    return true;
  }
  const bool has_handler = (current.sa_flags & SA_SIGINFO)
                               ? current.sa_sigaction != nullptr
                               : current.sa_handler != SIG_DFL && current.sa_handler != SIG_IGN;
  if (!has_handler) return false;
  // The handler in place is not ours, so nothing reads this meanwhile.
  previous_action = current;
  relay_fd.store(write_fd);
  struct sigaction relay;
  std::memset(&relay, 0, sizeof relay);
  relay.sa_sigaction = &on_sigint;
  relay.sa_mask = current.sa_mask;
  // The previous handler's flags (Python's: SA_ONSTACK), taking siginfo.
  relay.sa_flags = (current.sa_flags & ~SA_RESETHAND) | SA_SIGINFO;
  if (sigaction(SIGINT, &relay, nullptr) != 0) {
    relay_fd.store(-1);
    return false;
  }
  return true;
}

void detach_sigint_relay() { relay_fd.store(-1); }

unsigned long sigints_relayed() { return relayed.load(); }

}  // namespace waterwave
