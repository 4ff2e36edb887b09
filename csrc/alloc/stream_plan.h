// A plan over one stream's allocations: the adaptor the stack (stack.h) puts
// between a stream and the online policy.
//
// One arena sized by the plan; the k-th allocation of a step gets its planned
// offset; frees of planned blocks are no-ops. Any deviation (another size, an
// extra allocation, a planned slot still occupied, a step that ends before its
// plan does, and for a plan of the whole device an allocation on another
// stream) sends the rest of the step to the online policy, and is counted. On
// a GPU the plan comes from a recorded step (stream_recorder.h), so library
// workspaces are planned allocations like any other. A planned block is
// handed out only if no live block overlaps it, so a plan that does not match
// the program can cost memory but never corrupt it. A planned block also used
// on another stream (record_stream) leaves a fence when freed: an event on
// that stream, which the plan's stream waits on before its bytes are handed
// out again.
//
// May include: core/ and this folder.
#pragma once

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "../core/device.h"
#include "../core/stats.h"

namespace waterwave {

struct PlanSlot {
  std::size_t size;    // bytes, as the plan recorded them (rounded to 512)
  std::size_t offset;  // within the arena
};

// What a plan answers for. kStream: its stream's allocations only (several
// jobs' plans over one allocator). kDevice: it is the whole device's step, so
// an allocation on another stream leaves the plan for the step, as it would
// shift the program's sequence (one trainer's plan).
enum class PlanScope { kStream, kDevice };

struct PlanStats {
  std::int64_t steps = 0;
  std::int64_t planned = 0;     // allocations served from the plan
  std::int64_t deviations = 0;  // steps that left the plan
  std::int64_t fallback = 0;    // allocations served by the online policy
  std::int64_t arena_bytes = 0;
  std::int64_t planned_live_bytes = 0;
  std::int64_t last_deviation_index = -1;  // k at the last deviation
  std::string last_deviation;              // why
  Addr arena = 0;
};

class StreamPlan {
 public:
  // Checks the slots (ConfigError for a corrupt plan), then reserves the
  // arena from `device` (OutOfMemoryError if it does not fit).
  StreamPlan(Device& device, std::vector<PlanSlot> slots, std::size_t arena_bytes,
             StreamId stream, PlanScope scope);
  ~StreamPlan();
  StreamPlan(const StreamPlan&) = delete;
  StreamPlan& operator=(const StreamPlan&) = delete;

  // The planned address for this allocation on the plan's stream, or nullopt
  // when the step is off-plan (the online policy serves it).
  std::optional<Addr> try_allocate(std::size_t bytes);
  // An allocation on another stream: for a device-wide plan, a deviation.
  void note_other_stream(StreamId stream);
  // Whether `ptr` was a live planned block, now free. PointerError for a
  // pointer inside the arena that is not a live planned block.
  bool try_deallocate(Addr ptr);
  // A planned block used on another stream: the step leaves the plan, and the
  // block's free fences its bytes (see above). Whether ptr is a live planned
  // block.
  bool try_record_stream(Addr ptr, StreamId stream);
  // The size of a live planned block, or nullopt.
  std::optional<std::size_t> planned_size(Addr ptr);

  // A new training step starts: the next allocation is the plan's first.
  void begin_step();
  PlanStats stats();
  // Planned blocks still in use: the arena cannot go while any is.
  std::size_t live_blocks();
  // Adds the arena to reserved bytes and planned blocks to allocated bytes.
  void add_to(AllocatorStats& s);
  void check_invariants();
  StreamId stream() const { return stream_; }

 private:
  struct Planned {
    std::size_t size;
    std::vector<StreamId> other_streams;  // record_stream uses
  };
  struct Fence {
    Addr addr;
    std::size_t size;
    EventId event;  // recorded on a stream that used those bytes
  };
  bool overlaps_live_locked(Addr addr, std::size_t size) const;
  // The plan's stream waits on every fence over [addr, addr+size); they go.
  void pass_fences_locked(Addr addr, std::size_t size);
  void deviate_locked(const std::string& why);
  // The step is over: a deviation if it left planned slots unused.
  void end_step_locked();

  Device& device_;
  const std::vector<PlanSlot> slots_;
  const std::size_t arena_bytes_;
  const StreamId stream_;
  const PlanScope scope_;
  Addr arena_ = 0;
  std::mutex mu_;
  std::size_t k_ = 0;
  bool deviated_ = false;
  std::map<Addr, Planned> live_;  // planned blocks in use, by address
  std::vector<Fence> fences_;      // few: only blocks used on other streams
  PlanStats stats_;
};

}  // namespace waterwave
