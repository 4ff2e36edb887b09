// Thread accounts: the bytes each calling thread allocates while it is
// tagged with an account, so that a training session can see what a job's
// own thread allocates between its train() calls (evaluation, metrics)
// while other threads train beside it. The allocator's counters cover the
// whole device; only the thread that allocates knows whose the memory is.
//
// A thread carries one account id (0: none). An allocation made under an
// open account is noted with its block's size; its free, from any thread,
// takes it off again. Cost when no thread is tagged and nothing noted is
// live: one thread-local read per allocation and one relaxed atomic load
// per free; otherwise a short lock and a hash lookup, off the policy's lock.
//
// May include: core/.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "../core/types.h"

namespace waterwave::cuda {

struct AccountUsage {
  std::size_t allocated = 0;  // bytes noted under the account and still live
  std::size_t peak = 0;       // the most `allocated` reached since the last reset
};

class ThreadAccounts {
 public:
  // A new account; ids are never reused.
  std::int64_t open();
  // Forgets the account and its live blocks (they stay allocated). Unknown
  // ids are ignored.
  void close(std::int64_t id);
  // Tags the calling thread (0: untag); returns its previous tag.
  static std::int64_t set_thread(std::int64_t id);
  static std::int64_t thread_account();
  // ConfigError for an account not open.
  AccountUsage usage(std::int64_t id);
  void reset_peak(std::int64_t id);

  // The allocation path. `size` is asked for only when the block is noted;
  // a zero-byte request (cuDNN's empty workspaces) gets a null pointer, no
  // block, and nothing to note.
  template <typename SizeOf>
  void allocated(Addr ptr, SizeOf&& size_of) {
    const std::int64_t id = current_;
    if (ptr == 0 || id == 0 || open_.load(std::memory_order_relaxed) == 0) return;
    note(id, ptr, size_of());
  }
  void freed(Addr ptr) {
    if (live_.load(std::memory_order_relaxed) == 0) return;
    forget(ptr);
  }

 private:
  void note(std::int64_t id, Addr ptr, std::size_t bytes);
  void forget(Addr ptr);

  struct Noted {
    std::int64_t account;
    std::size_t bytes;
  };
  static thread_local std::int64_t current_;
  std::mutex mu_;
  std::int64_t next_id_ = 1;                          // under mu_
  std::unordered_map<std::int64_t, AccountUsage> accounts_;  // under mu_
  std::unordered_map<Addr, Noted> blocks_;            // under mu_
  std::atomic<std::size_t> open_{0};                  // accounts_.size()
  std::atomic<std::size_t> live_{0};                  // blocks_.size()
};

}  // namespace waterwave::cuda
