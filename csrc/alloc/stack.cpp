#include "stack.h"

#include <mutex>
#include <string>

namespace waterwave {

using SharedLock = std::shared_lock<std::shared_mutex>;
using UniqueLock = std::unique_lock<std::shared_mutex>;

AllocatorStack::AllocatorStack(Device& device, PolicyKind policy, const AllocatorConfig& config)
    : device_(device), online_(make_allocator(policy, device, config)) {}

// Plans give their arenas back before the policy its segments.
AllocatorStack::~AllocatorStack() { adaptors_.clear(); }

// ---- The allocation path. ----

Addr AllocatorStack::allocate_adapted(std::size_t bytes, StreamId stream) {
  if (bytes == 0) return 0;
  SharedLock g(mu_);
  StreamAdaptor* mine = nullptr;
  for (StreamAdaptor& a : adaptors_) {
    if (a.stream == stream) {
      mine = &a;
    } else if (a.plan) {
      a.plan->note_other_stream(stream);
    }
  }
  if (mine && mine->plan) {
    if (std::optional<Addr> p = mine->plan->try_allocate(bytes)) return *p;
  }
  const Addr p = online_->allocate(bytes, stream);
  if (mine && mine->recorder) mine->recorder->note_allocate(p, bytes);
  return p;
}

void AllocatorStack::deallocate_adapted(Addr ptr) {
  if (ptr == 0) return;
  SharedLock g(mu_);
  for (StreamAdaptor& a : adaptors_) {
    if (a.plan && a.plan->try_deallocate(ptr)) return;
    if (a.recorder) a.recorder->note_free(ptr);
  }
  online_->deallocate(ptr);
}

void AllocatorStack::record_stream(Addr ptr, StreamId stream) {
  if (adapted_.load(std::memory_order_acquire)) {
    SharedLock g(mu_);
    for (StreamAdaptor& a : adaptors_) {
      if (a.plan && a.plan->try_record_stream(ptr, stream)) return;
    }
  }
  online_->record_stream(ptr, stream);
}

std::size_t AllocatorStack::allocation_size(Addr ptr) {
  if (adapted_.load(std::memory_order_acquire)) {
    SharedLock g(mu_);
    for (StreamAdaptor& a : adaptors_) {
      if (!a.plan) continue;
      if (std::optional<std::size_t> n = a.plan->planned_size(ptr)) return *n;
    }
  }
  return online_->allocation_size(ptr);
}

bool AllocatorStack::owns(Addr ptr) {
  if (adapted_.load(std::memory_order_acquire)) {
    SharedLock g(mu_);
    for (StreamAdaptor& a : adaptors_) {
      if (a.plan && a.plan->planned_size(ptr)) return true;
    }
  }
  return online_->owns(ptr);
}

// ---- The whole stack. ----

AllocatorStats AllocatorStack::stats() {
  SharedLock g(mu_);
  AllocatorStats s = online_->stats();
  for (StreamAdaptor& a : adaptors_) {
    if (a.plan) a.plan->add_to(s);
  }
  return s;
}

void AllocatorStack::check_invariants() {
  SharedLock g(mu_);
  online_->check_invariants();
  for (StreamAdaptor& a : adaptors_) {
    if (a.plan) a.plan->check_invariants();
  }
}

std::size_t AllocatorStack::live_bytes() {
  return static_cast<std::size_t>(stats().allocated_bytes.all().current);
}

// ---- Adaptors. ----

AllocatorStack::StreamAdaptor& AllocatorStack::adaptor_locked(StreamId stream) {
  if (StreamAdaptor* a = find_locked(stream)) return *a;
  adaptors_.push_back(StreamAdaptor{stream, nullptr, nullptr});
  return adaptors_.back();
}

AllocatorStack::StreamAdaptor* AllocatorStack::find_locked(StreamId stream) {
  for (StreamAdaptor& a : adaptors_) {
    if (a.stream == stream) return &a;
  }
  return nullptr;
}

AllocatorStack::StreamAdaptor& AllocatorStack::pick_locked(std::optional<StreamId> stream,
                                                           bool want_plan) {
  const char* what = want_plan ? "plan" : "recorder";
  auto has = [&](const StreamAdaptor& a) { return want_plan ? a.plan != nullptr : a.recorder != nullptr; };
  if (stream) {
    StreamAdaptor* a = find_locked(*stream);
    if (!a || !has(*a)) {
      throw ConfigError(std::string("stream ") + std::to_string(*stream) + " has no " + what +
                        (want_plan ? " installed" : ": it is not recording"));
    }
    return *a;
  }
  StreamAdaptor* only = nullptr;
  for (StreamAdaptor& a : adaptors_) {
    if (!has(a)) continue;
    if (only) {
      throw ConfigError(std::string("several streams have a ") + what + ": name the stream");
    }
    only = &a;
  }
  if (!only) {
    throw ConfigError(want_plan ? "no plan installed" : "not recording");
  }
  return *only;
}

void AllocatorStack::drop_plan_locked(StreamAdaptor& a, const char* why) {
  if (!a.plan) return;
  if (const std::size_t live = a.plan->live_blocks()) {
    throw ConfigError(std::string("cannot ") + why + " of stream " + std::to_string(a.stream) +
                      ": " + std::to_string(live) +
                      " planned blocks are still in use (drop the last step's tensors first)");
  }
  a.plan.reset();  // the arena goes back to the device
}

void AllocatorStack::prune_locked() {
  std::vector<StreamAdaptor> kept;
  for (StreamAdaptor& a : adaptors_) {
    if (a.plan || a.recorder) kept.push_back(std::move(a));
  }
  adaptors_ = std::move(kept);
  adapted_.store(!adaptors_.empty(), std::memory_order_release);
}

void AllocatorStack::set_plan(StreamId stream, std::vector<PlanSlot> slots,
                              std::size_t arena_bytes, PlanScope scope, bool give_back_cache) {
  UniqueLock g(mu_);
  StreamAdaptor& a = adaptor_locked(stream);
  try {
    drop_plan_locked(a, "replace the plan");
    a.recorder.reset();
    // The cache the unplanned steps built goes back first: the arena takes
    // its place rather than adding to it.
    if (give_back_cache) online_->empty_cache();
    a.plan = std::make_unique<StreamPlan>(device_, std::move(slots), arena_bytes, stream, scope);
  } catch (...) {
    prune_locked();
    throw;
  }
  prune_locked();
}

void AllocatorStack::clear_plan(std::optional<StreamId> stream) {
  UniqueLock g(mu_);
  if (stream) pick_locked(stream, true);  // a stream named without a plan: say so
  for (StreamAdaptor& a : adaptors_) {
    if (!stream || a.stream == *stream) drop_plan_locked(a, "remove the plan");
  }
  prune_locked();
}

bool AllocatorStack::has_plan(std::optional<StreamId> stream) {
  SharedLock g(mu_);
  for (StreamAdaptor& a : adaptors_) {
    if (a.plan && (!stream || a.stream == *stream)) return true;
  }
  return false;
}

void AllocatorStack::begin_step(std::optional<StreamId> stream) {
  SharedLock g(mu_);
  pick_locked(stream, true).plan->begin_step();
}

PlanStats AllocatorStack::plan_stats(std::optional<StreamId> stream) {
  SharedLock g(mu_);
  return pick_locked(stream, true).plan->stats();
}

void AllocatorStack::start_recording(StreamId stream) {
  UniqueLock g(mu_);
  StreamAdaptor& a = adaptor_locked(stream);
  try {
    drop_plan_locked(a, "record over the plan");
  } catch (...) {
    prune_locked();
    throw;
  }
  a.recorder = std::make_unique<StreamRecorder>();
  prune_locked();
}

std::vector<TracedBlock> AllocatorStack::stop_recording(std::optional<StreamId> stream) {
  UniqueLock g(mu_);
  StreamAdaptor& a = pick_locked(stream, false);
  std::vector<TracedBlock> out = a.recorder->trace();
  a.recorder.reset();
  prune_locked();
  return out;
}

}  // namespace waterwave
