#include "private_pools.h"

#include "../core/errors.h"

namespace waterwave::cuda {

namespace {

using SharedLock = std::shared_lock<std::shared_mutex>;
using UniqueLock = std::unique_lock<std::shared_mutex>;

std::string describe(PoolId id) {
  return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

}  // namespace

PrivatePools::PrivatePools(Device& device, const AllocatorConfig& config)
    : device_(device), config_(config) {
  config_.expandable_segments = false;  // a graph's pages never move
  config_.per_process_memory_fraction = 1.0;
  config_.garbage_collection_threshold = 0.0;
  config_.keep_segments_on_oom = true;
}

void PrivatePools::publish_locked() {
  std::lock_guard<std::mutex> g(deferred_mu_);
  const bool any = !pools_.empty() || windows_.load() != 0 || !deferred_.empty();
  active_.store(any ? 1 : 0, std::memory_order_release);
}

PrivatePools::Pool& PrivatePools::create_or_incref_locked(PoolId id) {
  auto it = pools_.find(id);
  if (it != pools_.end()) {
    ++it->second.uses;
    return it->second;
  }
  Pool& p = pools_[id];
  p.stack = std::make_unique<AllocatorStack>(device_, PolicyKind::kPytorch, config_);
  if (history_on_) p.stack->online().record_history(true, history_max_);
  publish_locked();
  return p;
}

void PrivatePools::create_or_incref(PoolId id) {
  UniqueLock g(mu_);
  create_or_incref_locked(id);
}

bool PrivatePools::begin_window(PoolId id) {
  UniqueLock g(mu_);
  Pool& p = create_or_incref_locked(id);
  if (p.windows > 0) {
    // PyTorch refuses it too: two routings into one pool at once would
    // leave the second's end ambiguous.
    --p.uses;
    throw ConfigError("beginAllocateToPool: allocations already go to memory pool " +
                      describe(id) + "; end that first (endAllocateToPool)");
  }
  ++p.windows;
  const bool first = windows_.fetch_add(1) == 0;
  publish_locked();
  return first;
}

std::vector<Addr> PrivatePools::end_window(PoolId id) {
  UniqueLock g(mu_);
  auto it = pools_.find(id);
  if (it == pools_.end() || it->second.windows == 0) {
    throw ConfigError("endAllocateToPool: allocations do not go to memory pool " + describe(id) +
                      " (no beginAllocateToPool for it is open)");
  }
  --it->second.windows;
  std::vector<Addr> due;
  if (windows_.fetch_sub(1) == 1) {
    {
      std::lock_guard<std::mutex> d(deferred_mu_);
      due.swap(deferred_);
    }
    sweep_locked();
  }
  publish_locked();
  return due;
}

void PrivatePools::release(PoolId id) {
  UniqueLock g(mu_);
  auto it = pools_.find(id);
  if (it == pools_.end() || it->second.uses == 0) {
    throw ConfigError("releasePool: memory pool " + describe(id) + " has no use left to release");
  }
  --it->second.uses;
  if (windows_.load() == 0) sweep_locked();
  publish_locked();
}

int PrivatePools::use_count(PoolId id) {
  SharedLock g(mu_);
  auto it = pools_.find(id);
  return it == pools_.end() ? 0 : it->second.uses;
}

Addr PrivatePools::allocate(PoolId id, std::size_t bytes, StreamId stream) {
  SharedLock g(mu_);
  auto it = pools_.find(id);
  if (it == pools_.end()) {
    throw ConfigError("allocation into memory pool " + describe(id) + ", which does not exist");
  }
  return it->second.stack->allocate(bytes, stream);
}

bool PrivatePools::deallocate(Addr ptr) {
  bool retire_check = false;
  {
    SharedLock g(mu_);
    Pool* holder = nullptr;
    for (auto& [pid, p] : pools_) {
      if (p.stack->owns(ptr)) {
        holder = &p;
        break;
      }
    }
    if (!holder) return false;
    if (windows_open()) {
      // Its free would record events on the streams that used it, one of
      // which may be capturing: after the capture.
      const auto use = holder->stack->online().live_streams(ptr);
      if (use && use->shared) {
        defer_free(ptr);
        return true;
      }
    }
    holder->stack->deallocate(ptr);
    retire_check = holder->uses == 0 && !windows_open();
  }
  if (retire_check) {
    UniqueLock g(mu_);
    if (windows_.load() == 0) sweep_locked();
    publish_locked();
  }
  return true;
}

void PrivatePools::defer_free(Addr ptr) {
  std::lock_guard<std::mutex> d(deferred_mu_);
  deferred_.push_back(ptr);
  active_.store(1, std::memory_order_release);
}

AllocatorStack* PrivatePools::owner(Addr ptr) {
  SharedLock g(mu_);
  for (auto& [pid, p] : pools_) {
    if (p.stack->owns(ptr)) return p.stack.get();
  }
  return nullptr;
}

void PrivatePools::sweep_locked() {
  for (auto it = pools_.begin(); it != pools_.end();) {
    Pool& p = it->second;
    if (p.uses > 0 || p.windows > 0) {
      ++it;
    } else if (p.stack->live_bytes() == 0) {
      it = pools_.erase(it);  // its segments go back to the device
    } else {
      p.stack->empty_cache();
      ++it;
    }
  }
}

void PrivatePools::empty_retired() {
  UniqueLock g(mu_);
  if (windows_.load() != 0) return;
  sweep_locked();
  publish_locked();
}

void PrivatePools::restore(PoolId id, const std::vector<LiveBlock>& live,
                           std::vector<Addr>& freed) {
  UniqueLock g(mu_);
  auto it = pools_.find(id);
  if (it == pools_.end() || it->second.uses == 0) {
    throw ConfigError("cannot restore memory pool " + describe(id) + " to a checkpoint: it is " +
                      (it == pools_.end() ? "not there" : "released"));
  }
  if (windows_.load() != 0) {
    throw ConfigError("cannot restore memory pool " + describe(id) +
                      " to a checkpoint while allocations are routed to a pool (end the capture "
                      "or use_mem_pool first)");
  }
  AllocatorStack& stack = *it->second.stack;
  for (const SegmentInfo& seg : stack.snapshot()) {
    for (const BlockInfo& b : seg.blocks) {
      if (b.state == "allocated") freed.push_back(b.addr);
    }
  }
  for (Addr p : freed) stack.deallocate(p);
  for (const LiveBlock& b : live) stack.online().allocate_at(b.addr, b.size, b.requested);
}

void PrivatePools::for_each(const std::function<void(PoolId, AllocatorStack&)>& fn) {
  SharedLock g(mu_);
  for (auto& [pid, p] : pools_) fn(pid, *p.stack);
}

bool PrivatePools::visit(PoolId id, const std::function<void(AllocatorStack&)>& fn) {
  SharedLock g(mu_);
  auto it = pools_.find(id);
  if (it == pools_.end()) return false;
  fn(*it->second.stack);
  return true;
}

std::size_t PrivatePools::live_bytes() {
  SharedLock g(mu_);
  std::size_t total = 0;
  for (auto& [pid, p] : pools_) total += p.stack->live_bytes();
  return total;
}

std::size_t PrivatePools::deferred_count() {
  std::lock_guard<std::mutex> d(deferred_mu_);
  return deferred_.size();
}

void PrivatePools::record_history(bool enabled, std::size_t max_entries) {
  UniqueLock g(mu_);
  history_on_ = enabled && max_entries > 0;
  history_max_ = max_entries;
  for (auto& [pid, p] : pools_) p.stack->online().record_history(enabled, max_entries);
}

}  // namespace waterwave::cuda
