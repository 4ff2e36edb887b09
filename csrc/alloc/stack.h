// The allocator stack: what both faces drive (the simulator's Python face in
// csrc/bindings, and the CUDA runtime behind PyTorch's hooks in csrc/runtime).
//
//   stream ──► [plan | recorder of that stream] ──► online policy ──► Device
//
// One online policy (policies.h) over one device, and per stream at most one
// adaptor: a plan (stream_plan.h) or a recorder (stream_recorder.h). Several
// streams' plans sit over one policy at once: several jobs, each planned.
//
// Hot path: with no adaptor installed, allocate and deallocate go straight to
// the policy (one relaxed atomic load). With adaptors, a shared lock keeps
// them in place during the call; installing or removing one takes it
// exclusively. Lock order: the stack's, then a plan's, then the policy's.
//
// May include: core/ and this folder.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <vector>

#include "allocator.h"
#include "stream_plan.h"
#include "stream_recorder.h"

namespace waterwave {

class AllocatorStack {
 public:
  AllocatorStack(Device& device, PolicyKind policy, const AllocatorConfig& config);
  ~AllocatorStack();
  AllocatorStack(const AllocatorStack&) = delete;
  AllocatorStack& operator=(const AllocatorStack&) = delete;

  // ---- The allocation path (Allocator's contract). ----
  Addr allocate(std::size_t bytes, StreamId stream) {
    if (!adapted_.load(std::memory_order_acquire)) return online_->allocate(bytes, stream);
    return allocate_adapted(bytes, stream);
  }
  void deallocate(Addr ptr) {
    if (!adapted_.load(std::memory_order_acquire)) return online_->deallocate(ptr);
    deallocate_adapted(ptr);
  }
  void record_stream(Addr ptr, StreamId stream);
  std::size_t allocation_size(Addr ptr);
  bool owns(Addr ptr);  // never throws

  // ---- The whole stack. ----
  void sync_and_coalesce() { online_->sync_and_coalesce(); }
  void empty_cache() { online_->empty_cache(); }
  // The policy's statistics; plans' arenas count as reserved, their live
  // blocks as allocated.
  AllocatorStats stats();
  void reset_peak_stats() { online_->reset_peak_stats(); }
  void reset_accumulated_stats() { online_->reset_accumulated_stats(); }
  void set_memory_fraction(double fraction) { online_->set_memory_fraction(fraction); }
  double memory_fraction() { return online_->memory_fraction(); }
  void set_max_split_size(std::size_t bytes) { online_->set_max_split_size(bytes); }
  bool max_split_size_chosen() { return online_->max_split_size_chosen(); }
  void set_own_segments_first(bool on) { online_->set_own_segments_first(on); }
  bool own_segments_first_chosen() { return online_->own_segments_first_chosen(); }
  bool hold_own_segments_first() { return online_->hold_own_segments_first(); }
  void release_own_segments_first() { online_->release_own_segments_first(); }
  std::vector<SegmentInfo> snapshot() { return online_->snapshot(); }
  void check_invariants();
  Allocator& online() { return *online_; }
  Device& device() { return device_; }
  // Allocated bytes, planned blocks included: nothing may be reset while > 0.
  std::size_t live_bytes();

  // ---- Adaptors. `stream` nullopt means "the one plan (recorder) there
  // is": a ConfigError when there is none, or several. ----

  // Serve `stream`'s allocations from a plan, replacing its plan or recorder
  // (refused while the old plan's blocks live). With give_back_cache the
  // policy's cache is released first, so the arena takes its place.
  void set_plan(StreamId stream, std::vector<PlanSlot> slots, std::size_t arena_bytes,
                PlanScope scope, bool give_back_cache);
  // Removes the plan (every plan, for nullopt); refused while its blocks live,
  // and for a stream named that has none (ConfigError).
  void clear_plan(std::optional<StreamId> stream);
  bool has_plan(std::optional<StreamId> stream);
  void begin_step(std::optional<StreamId> stream);
  PlanStats plan_stats(std::optional<StreamId> stream);
  // Record `stream`'s allocations (replacing its plan, whose blocks must be
  // free) until stop_recording, which returns them.
  void start_recording(StreamId stream);
  std::vector<TracedBlock> stop_recording(std::optional<StreamId> stream);

 private:
  struct StreamAdaptor {
    StreamId stream;
    std::unique_ptr<StreamPlan> plan;          // at most one of the two
    std::unique_ptr<StreamRecorder> recorder;
  };

  Addr allocate_adapted(std::size_t bytes, StreamId stream);
  void deallocate_adapted(Addr ptr);
  // Callers hold mu_: exclusively to add, drop or prune adaptors, shared
  // at least to find or pick one.
  StreamAdaptor& adaptor_locked(StreamId stream);  // created if missing
  StreamAdaptor* find_locked(StreamId stream);
  // The adaptor with a plan (want_plan) or a recorder for `stream`; nullopt:
  // the only one. ConfigError if none, or several for nullopt.
  StreamAdaptor& pick_locked(std::optional<StreamId> stream, bool want_plan);
  void drop_plan_locked(StreamAdaptor& a, const char* why);
  // Removes empty adaptors and publishes whether any is left.
  void prune_locked();

  Device& device_;
  std::unique_ptr<Allocator> online_;
  std::shared_mutex mu_;
  std::vector<StreamAdaptor> adaptors_;  // few streams: a scan beats a map
  std::atomic<bool> adapted_{false};     // !adaptors_.empty()
};

}  // namespace waterwave
