#include "plan_allocator.h"

#include <algorithm>

namespace waterwave {

PlanAllocator::PlanAllocator(Device& device, std::vector<PlanSlot> slots, std::size_t arena_bytes,
                             StreamId stream, std::shared_ptr<Allocator> fallback)
    : device_(device),
      slots_(std::move(slots)),
      arena_bytes_(arena_bytes),
      stream_(stream),
      fallback_(std::move(fallback)) {
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    const PlanSlot& s = slots_[i];
    if (s.size == 0 || s.offset + s.size > arena_bytes_) {
      throw ConfigError("plan slot " + std::to_string(i) + " (offset " + std::to_string(s.offset) +
                        ", size " + std::to_string(s.size) + ") does not lie inside the " +
                        std::to_string(arena_bytes_) + "-byte arena: the plan is corrupt");
    }
  }
  if (arena_bytes_ > 0) {
    auto a = device_.reserve(arena_bytes_);
    if (!a) {
      throw OutOfMemoryError("out of memory: the plan's arena of " + format_bytes(arena_bytes_) +
                             " does not fit on the device (" + format_bytes(device_.free_memory()) +
                             " free); plan for a smaller batch or free memory first");
    }
    arena_ = *a;
  }
  stats_.arena_bytes = static_cast<std::int64_t>(arena_bytes_);
}

PlanAllocator::~PlanAllocator() {
  fallback_.reset();
  if (arena_) {
    try {
      device_.release(arena_, arena_bytes_);
    } catch (...) {
    }
  }
}

bool PlanAllocator::overlaps_live(Addr addr, std::size_t size) const {
  auto it = live_.lower_bound(addr);
  if (it != live_.end() && it->first < addr + size) return true;
  if (it != live_.begin()) {
    --it;
    if (it->first + it->second > addr) return true;
  }
  return false;
}

void PlanAllocator::deviate(const std::string& why) {
  if (!deviated_) {
    deviated_ = true;
    stats_.deviations++;
    stats_.last_deviation_index = static_cast<std::int64_t>(k_);
    stats_.last_deviation = why;
  }
}

void PlanAllocator::end_step() {
  if (k_ > 0 && k_ < slots_.size()) {
    deviate("the step ended after " + std::to_string(k_) + " of the plan's " +
            std::to_string(slots_.size()) + " allocations");
  }
}

void PlanAllocator::begin_step() {
  std::lock_guard<std::mutex> g(mu_);
  end_step();
  k_ = 0;
  deviated_ = false;
  stats_.steps++;
}

Addr PlanAllocator::allocate(std::size_t bytes, StreamId stream) {
  if (bytes == 0) return 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!deviated_ && k_ == slots_.size() && !slots_.empty()) {
      // The plan's allocations are used up: the next one starts a new step
      // (the paper maps the k-th request to slot k mod |plan|).
      k_ = 0;
      stats_.steps++;
    }
    if (!deviated_) {
      const std::size_t rounded = round_to_block(bytes);
      if (k_ >= slots_.size()) {
        deviate("more allocations than the plan has");
      } else if (stream != stream_) {
        deviate("allocation on stream " + std::to_string(stream) + ", the plan is for stream " +
                std::to_string(stream_));
      } else if (slots_[k_].size != rounded) {
        deviate("allocation " + std::to_string(k_) + " asks for " + std::to_string(rounded) +
                " bytes, the plan has " + std::to_string(slots_[k_].size));
      } else {
        const Addr addr = arena_ + slots_[k_].offset;
        if (overlaps_live(addr, slots_[k_].size)) {
          deviate("planned slot " + std::to_string(k_) + " is still occupied");
        } else {
          live_[addr] = slots_[k_].size;
          stats_.planned++;
          stats_.planned_live_bytes += static_cast<std::int64_t>(slots_[k_].size);
          ++k_;
          return addr;
        }
      }
    }
    stats_.fallback++;
  }
  return fallback_->allocate(bytes, stream);
}

void PlanAllocator::deallocate(Addr ptr) {
  if (ptr == 0) return;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = live_.find(ptr);
    if (it != live_.end()) {
      stats_.planned_live_bytes -= static_cast<std::int64_t>(it->second);
      live_.erase(it);
      return;  // the arena slot is reused by the plan; nothing to do
    }
    if (ptr >= arena_ && ptr < arena_ + arena_bytes_) {
      throw PointerError("double free or unknown pointer " + format_addr(ptr) +
                         " inside the plan's arena: it is not a live planned block");
    }
  }
  fallback_->deallocate(ptr);
}

void PlanAllocator::record_stream(Addr ptr, StreamId stream) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (live_.count(ptr)) {
      // A planned block used on another stream could be reused by the plan
      // while that stream still works on it: leave the plan for this step.
      if (stream != stream_) deviate("record_stream of a planned block on another stream");
      return;
    }
  }
  fallback_->record_stream(ptr, stream);
}

std::size_t PlanAllocator::allocation_size(Addr ptr) {
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = live_.find(ptr);
    if (it != live_.end()) return it->second;
  }
  return fallback_->allocation_size(ptr);
}

AllocatorStats PlanAllocator::stats() {
  AllocatorStats s = fallback_->stats();
  std::lock_guard<std::mutex> g(mu_);
  // The arena is reserved memory; planned blocks are allocated memory.
  const auto arena = static_cast<std::int64_t>(arena_bytes_);
  s.reserved_bytes.s[0].current += arena;
  s.reserved_bytes.s[0].peak += arena;
  s.allocated_bytes.s[0].current += stats_.planned_live_bytes;
  return s;
}

std::size_t PlanAllocator::live_planned_blocks() {
  std::lock_guard<std::mutex> g(mu_);
  return live_.size();
}

PlanStats PlanAllocator::plan_stats() {
  std::lock_guard<std::mutex> g(mu_);
  return stats_;
}

void PlanAllocator::check_invariants() {
  fallback_->check_invariants();
  std::lock_guard<std::mutex> g(mu_);
  Addr last_end = 0;
  std::int64_t bytes = 0;
  for (auto& [addr, size] : live_) {
    if (addr < last_end) throw InvariantError("planned blocks overlap at " + format_addr(addr));
    if (addr < arena_ || addr + size > arena_ + arena_bytes_) {
      throw InvariantError("planned block outside the arena");
    }
    last_end = addr + size;
    bytes += static_cast<std::int64_t>(size);
  }
  if (bytes != stats_.planned_live_bytes) throw InvariantError("planned_live_bytes drifted");
}

}  // namespace waterwave
