// Replays an offline memory plan: one arena sized by the plan; the k-th
// allocation of a step gets its planned offset; frees are no-ops for planned
// blocks. Any deviation (another size, an extra allocation, another stream,
// a planned slot still occupied, a step that ends before its plan does)
// sends the rest of the step to an online allocator, and is counted. On a GPU
// the plan comes from a recorded step (TraceRecorder), so library workspaces
// are planned allocations like any other. A planned block is handed out only if no live
// block overlaps it, so a plan that does not match the program can cost
// memory but never corrupt it.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "allocator.h"

namespace waterwave {

struct PlanSlot {
  std::size_t size;    // bytes, as the plan recorded them (rounded to 512)
  std::size_t offset;  // within the arena
};

struct PlanStats {
  std::int64_t steps = 0;
  std::int64_t planned = 0;     // allocations served from the plan
  std::int64_t deviations = 0;  // steps that left the plan
  std::int64_t fallback = 0;    // allocations served by the online allocator
  std::int64_t arena_bytes = 0;
  std::int64_t planned_live_bytes = 0;
  std::int64_t last_deviation_index = -1;  // k at the last deviation
  std::string last_deviation;              // why
};

class PlanAllocator final : public Allocator {
 public:
  // Reserves the arena from `device` (OutOfMemoryError if it does not fit).
  // The fallback is shared: on a GPU the online allocator outlives the plans
  // installed over it.
  PlanAllocator(Device& device, std::vector<PlanSlot> slots, std::size_t arena_bytes,
                StreamId stream, std::shared_ptr<Allocator> fallback);
  ~PlanAllocator() override;

  Addr allocate(std::size_t bytes, StreamId stream) override;
  void deallocate(Addr ptr) override;
  void record_stream(Addr ptr, StreamId stream) override;
  void sync_and_coalesce() override { fallback_->sync_and_coalesce(); }
  void empty_cache() override { fallback_->empty_cache(); }
  AllocatorStats stats() override;
  void reset_peak_stats() override { fallback_->reset_peak_stats(); }
  std::vector<SegmentInfo> snapshot() override { return fallback_->snapshot(); }
  void check_invariants() override;
  std::size_t allocation_size(Addr ptr) override;
  std::string policy() const override { return "plan"; }
  const AllocatorConfig& config() const override { return fallback_->config(); }

  // A new training step starts: the next allocation is the plan's first.
  void begin_step();
  PlanStats plan_stats();
  // Planned blocks still in use: the arena cannot go while any is.
  std::size_t live_planned_blocks();
  Addr arena() const { return arena_; }

 private:
  bool overlaps_live(Addr addr, std::size_t size) const;
  void deviate(const std::string& why);
  // The step is over: a deviation if it left planned slots unused.
  void end_step();

  Device& device_;
  std::vector<PlanSlot> slots_;
  std::size_t arena_bytes_;
  StreamId stream_;
  std::shared_ptr<Allocator> fallback_;
  Addr arena_ = 0;
  std::mutex mu_;
  std::size_t k_ = 0;
  bool deviated_ = false;
  std::map<Addr, std::size_t> live_;  // planned blocks in use: addr -> size
  PlanStats stats_;
};

}  // namespace waterwave
