// Thread accounts: opening, tagging and the bytes noted under each
// (thread_accounts.h). The shared budget's rule is shared_budget.cpp.
#include "thread_accounts.h"

#include <iterator>
#include <string>

#include "../core/errors.h"

namespace waterwave {

thread_local std::int64_t ThreadAccounts::current_ = 0;
std::atomic<std::int64_t> ThreadAccounts::next_id_{1};

std::int64_t ThreadAccounts::open() {
  std::lock_guard<std::mutex> g(mu_);
  const std::int64_t id = next_id_.fetch_add(1, std::memory_order_relaxed);
  accounts_.emplace(id, Account{});
  open_.store(accounts_.size(), std::memory_order_relaxed);
  return id;
}

void ThreadAccounts::close(std::int64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  close_locked(id);
}

void ThreadAccounts::set_stream_account(StreamId stream, std::int64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  if (id == 0) {
    streams_.erase(stream);
  } else {
    streams_[stream] = id;
  }
  streams_on_.store(streams_.size(), std::memory_order_relaxed);
}

std::int64_t ThreadAccounts::stream_account(StreamId stream) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = streams_.find(stream);
  return it == streams_.end() ? 0 : it->second;
}

void ThreadAccounts::close_locked(std::int64_t id) {
  auto found = accounts_.find(id);
  if (found == accounts_.end()) return;
  for (auto it = streams_.begin(); it != streams_.end();) {
    it = it->second == id ? streams_.erase(it) : std::next(it);
  }
  streams_on_.store(streams_.size(), std::memory_order_relaxed);
  if (found->second.member) {
    members_live_ -= found->second.usage.allocated + found->second.base;
    changed_locked();
  }
  accounts_.erase(found);
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
  return it->second.usage;
}

void ThreadAccounts::reset_peak(std::int64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = accounts_.find(id);
  if (it == accounts_.end()) {
    throw ConfigError("thread account " + std::to_string(id) + " is not open");
  }
  it->second.usage.peak = it->second.usage.allocated;
}

AccountUsage ThreadAccounts::take_peak(std::int64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = accounts_.find(id);
  if (it == accounts_.end()) {
    throw ConfigError("thread account " + std::to_string(id) + " is not open");
  }
  const AccountUsage u = it->second.usage;
  it->second.usage.peak = u.allocated;
  return u;
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
    if (old != accounts_.end()) {
      old->second.usage.allocated -= at->second.bytes;
      if (old->second.member) members_live_ -= at->second.bytes;
    }
    at->second = Noted{id, bytes};
  }
  Account& a = it->second;
  a.usage.allocated += bytes;
  if (a.usage.allocated > a.usage.peak) a.usage.peak = a.usage.allocated;
  if (a.member) {
    members_live_ += bytes;
    if (members_live_ > members_peak_) members_peak_ = members_live_;
  }
  live_.store(blocks_.size(), std::memory_order_relaxed);
}

void ThreadAccounts::forget(Addr ptr) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = blocks_.find(ptr);
  if (it == blocks_.end()) return;
  auto account = accounts_.find(it->second.account);
  if (account != accounts_.end()) {
    account->second.usage.allocated -= it->second.bytes;
    if (account->second.member) {
      members_live_ -= it->second.bytes;
      ++member_frees_;
      changed_locked();  // room for a waiting member, perhaps
    }
  }
  blocks_.erase(it);
  live_.store(blocks_.size(), std::memory_order_relaxed);
}

}  // namespace waterwave
