#include "thread_accounts.h"

#include <iterator>
#include <string>

#include "../core/errors.h"

namespace waterwave::cuda {

thread_local std::int64_t ThreadAccounts::current_ = 0;

std::int64_t ThreadAccounts::open() {
  std::lock_guard<std::mutex> g(mu_);
  const std::int64_t id = next_id_++;
  accounts_.emplace(id, AccountUsage{});
  open_.store(accounts_.size(), std::memory_order_relaxed);
  return id;
}

void ThreadAccounts::close(std::int64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  if (accounts_.erase(id) == 0) return;
  for (auto it = blocks_.begin(); it != blocks_.end();) {
    it = it->second.account == id ? blocks_.erase(it) : std::next(it);
  }
  open_.store(accounts_.size(), std::memory_order_relaxed);
  live_.store(blocks_.size(), std::memory_order_relaxed);
}

std::int64_t ThreadAccounts::set_thread(std::int64_t id) {
  const std::int64_t previous = current_;
  current_ = id;
  return previous;
}

std::int64_t ThreadAccounts::thread_account() { return current_; }

AccountUsage ThreadAccounts::usage(std::int64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = accounts_.find(id);
  if (it == accounts_.end()) {
    throw ConfigError("thread account " + std::to_string(id) + " is not open");
  }
  return it->second;
}

void ThreadAccounts::reset_peak(std::int64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = accounts_.find(id);
  if (it == accounts_.end()) {
    throw ConfigError("thread account " + std::to_string(id) + " is not open");
  }
  it->second.peak = it->second.allocated;
}

void ThreadAccounts::note(std::int64_t id, Addr ptr, std::size_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = accounts_.find(id);
  if (it == accounts_.end()) return;  // closed since the thread was tagged
  // A pointer noted and never seen freed (freed by a path that skips us)
  // is replaced, not counted twice.
  auto [at, inserted] = blocks_.try_emplace(ptr, Noted{id, bytes});
  if (!inserted) {
    auto old = accounts_.find(at->second.account);
    if (old != accounts_.end()) old->second.allocated -= at->second.bytes;
    at->second = Noted{id, bytes};
  }
  AccountUsage& u = it->second;
  u.allocated += bytes;
  if (u.allocated > u.peak) u.peak = u.allocated;
  live_.store(blocks_.size(), std::memory_order_relaxed);
}

void ThreadAccounts::forget(Addr ptr) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = blocks_.find(ptr);
  if (it == blocks_.end()) return;
  auto account = accounts_.find(it->second.account);
  if (account != accounts_.end()) account->second.allocated -= it->second.bytes;
  blocks_.erase(it);
  live_.store(blocks_.size(), std::memory_order_relaxed);
}

}  // namespace waterwave::cuda
