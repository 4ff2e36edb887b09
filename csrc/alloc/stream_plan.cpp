#include "stream_plan.h"

#include <algorithm>

#include "../core/errors.h"

namespace waterwave {
namespace {

const std::vector<PlanSlot>& checked(const std::vector<PlanSlot>& slots, std::size_t arena_bytes) {
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const PlanSlot& s = slots[i];
    // offset + size could wrap past 2^64 and pass a plain sum's check, putting
    // the slot before the arena, over other memory: compare without the sum.
    if (s.size == 0) {
      throw ConfigError("plan slot " + std::to_string(i) + " (offset " + std::to_string(s.offset) +
                        ") is empty: an allocation of 0 bytes takes no slot, so every slot "
                        "holds at least one byte; the plan is corrupt");
    }
    if (s.offset > arena_bytes || s.size > arena_bytes - s.offset) {
      throw ConfigError("plan slot " + std::to_string(i) + " (offset " + std::to_string(s.offset) +
                        ", size " + std::to_string(s.size) + ") does not lie inside the " +
                        std::to_string(arena_bytes) + "-byte arena: the plan is corrupt");
    }
    if (s.offset % kMinBlockSize != 0) {
      throw ConfigError("plan slot " + std::to_string(i) + " has offset " +
                        std::to_string(s.offset) + ", not a multiple of " +
                        std::to_string(kMinBlockSize) + " bytes (blocks are aligned so): the " +
                        "plan is corrupt");
    }
  }
  return slots;
}

}  // namespace

StreamPlan::StreamPlan(Device& device, std::vector<PlanSlot> slots, std::size_t arena_bytes,
                       StreamId stream, PlanScope scope)
    : device_(device),
      slots_(checked(slots, arena_bytes)),
      arena_bytes_(arena_bytes),
      stream_(stream),
      scope_(scope) {
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
  stats_.arena = arena_;
}

StreamPlan::~StreamPlan() {
  for (const Fence& f : fences_) {
    try {
      device_.destroy_event(f.event);
    } catch (...) {
    }
  }
  if (arena_) {
    try {
      device_.release(arena_, arena_bytes_);
    } catch (...) {
    }
  }
}

bool StreamPlan::overlaps_live_locked(Addr addr, std::size_t size) const {
  auto it = live_.lower_bound(addr);
  if (it != live_.end() && it->first < addr + size) return true;
  if (it != live_.begin()) {
    --it;
    if (it->first + it->second.size > addr) return true;
  }
  return false;
}

void StreamPlan::pass_fences_locked(Addr addr, std::size_t size) {
  if (fences_.empty()) return;
  std::vector<Fence> kept;
  for (const Fence& f : fences_) {
    if (f.addr < addr + size && addr < f.addr + f.size) {
      device_.stream_wait_event(stream_, f.event);  // asynchronous: no host blocking
      device_.destroy_event(f.event);
    } else {
      kept.push_back(f);
    }
  }
  fences_ = std::move(kept);
}

void StreamPlan::deviate_locked(const std::string& why) {
  if (!deviated_) {
    deviated_ = true;
    stats_.deviations++;
    stats_.last_deviation_index = static_cast<std::int64_t>(k_);
    stats_.last_deviation = why;
  }
}

void StreamPlan::end_step_locked() {
  if (k_ > 0 && k_ < slots_.size()) {
    deviate_locked("the step ended after " + std::to_string(k_) + " of the plan's " +
                   std::to_string(slots_.size()) + " allocations");
  }
}

void StreamPlan::begin_step() {
  std::lock_guard<std::mutex> g(mu_);
  end_step_locked();
  k_ = 0;
  deviated_ = false;
  stats_.steps++;
}

std::optional<Addr> StreamPlan::try_allocate(std::size_t bytes) {
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
      deviate_locked("more allocations than the plan has");
    } else if (slots_[k_].size != rounded) {
      deviate_locked("allocation " + std::to_string(k_) + " asks for " + std::to_string(rounded) +
                     " bytes, the plan has " + std::to_string(slots_[k_].size));
    } else {
      const Addr addr = arena_ + slots_[k_].offset;
      if (overlaps_live_locked(addr, slots_[k_].size)) {
        deviate_locked("planned slot " + std::to_string(k_) + " is still occupied");
      } else {
        pass_fences_locked(addr, slots_[k_].size);
        live_[addr] = Planned{slots_[k_].size, {}};
        stats_.planned++;
        stats_.planned_live_bytes += static_cast<std::int64_t>(slots_[k_].size);
        ++k_;
        return addr;
      }
    }
  }
  stats_.fallback++;
  return std::nullopt;
}

void StreamPlan::note_other_stream(StreamId stream) {
  if (scope_ != PlanScope::kDevice) return;
  std::lock_guard<std::mutex> g(mu_);
  stats_.fallback++;
  deviate_locked("allocation on stream " + std::to_string(stream) + ", the plan is for stream " +
                 std::to_string(stream_));
}

bool StreamPlan::try_deallocate(Addr ptr) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = live_.find(ptr);
  if (it != live_.end()) {
    const Planned& b = it->second;
    for (StreamId other : b.other_streams) {
      const EventId e = device_.create_event();
      device_.record_event(e, other);
      fences_.push_back({ptr, b.size, e});
    }
    stats_.planned_live_bytes -= static_cast<std::int64_t>(b.size);
    live_.erase(it);
    return true;  // the arena slot is reused by the plan
  }
  if (ptr >= arena_ && ptr < arena_ + arena_bytes_) {
    throw PointerError("double free or unknown pointer " + format_addr(ptr) +
                       " inside the plan's arena: it is not a live planned block");
  }
  return false;
}

bool StreamPlan::try_record_stream(Addr ptr, StreamId stream) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) return false;
  if (stream == stream_) return true;
  deviate_locked("record_stream of a planned block on another stream");
  std::vector<StreamId>& uses = it->second.other_streams;
  if (std::find(uses.begin(), uses.end(), stream) == uses.end()) uses.push_back(stream);
  return true;
}

std::optional<std::size_t> StreamPlan::planned_size(Addr ptr) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) return std::nullopt;
  return it->second.size;
}

void StreamPlan::add_to(AllocatorStats& s) {
  std::lock_guard<std::mutex> g(mu_);
  // The arena is reserved memory; planned blocks are allocated memory.
  const auto arena = static_cast<std::int64_t>(arena_bytes_);
  s.reserved_bytes.s[0].current += arena;
  s.reserved_bytes.s[0].peak += arena;
  s.allocated_bytes.s[0].current += stats_.planned_live_bytes;
}

std::size_t StreamPlan::live_blocks() {
  std::lock_guard<std::mutex> g(mu_);
  return live_.size();
}

PlanStats StreamPlan::stats() {
  std::lock_guard<std::mutex> g(mu_);
  return stats_;
}

void StreamPlan::check_invariants() {
  std::lock_guard<std::mutex> g(mu_);
  Addr last_end = 0;
  std::int64_t bytes = 0;
  for (auto& [addr, block] : live_) {
    const std::size_t size = block.size;
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
