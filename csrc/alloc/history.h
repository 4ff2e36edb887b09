// The allocator's memory history: what torch.cuda.memory._record_memory_history
// records, for PyTorch's snapshot format (`device_traces`) and its memory
// viewer. A bounded ring: the newest `max_entries` events are kept.
//
// The allocator adds entries under its lock; when recording is off the cost
// on the hot path is one branch.
//
// May include: core/.
#pragma once

#include <cstddef>
#include <deque>
#include <vector>

#include "../core/types.h"

namespace waterwave {

// PyTorch's trace actions (docs/design/pytorch-policy.md, Trace actions): alloc, free_requested,
// free_completed, segment_alloc, segment_free, segment_map, segment_unmap,
// oom.
struct HistoryEntry {
  const char* action;  // a string literal
  Addr addr;
  std::size_t size;
  StreamId stream;
  double time_us;
};

class History {
 public:
  bool on() const { return on_; }
  // Start (or go on) recording, keeping the newest `max_entries`; or stop
  // and drop what was recorded.
  void record(bool enabled, std::size_t max_entries) {
    on_ = enabled && max_entries > 0;
    max_ = max_entries;
    if (!on_) entries_.clear();
    while (entries_.size() > max_) entries_.pop_front();
  }
  void add(const char* action, Addr addr, std::size_t size, StreamId stream, double time_us) {
    if (entries_.size() == max_) entries_.pop_front();
    entries_.push_back({action, addr, size, stream, time_us});
  }
  std::vector<HistoryEntry> entries() const { return {entries_.begin(), entries_.end()}; }

 private:
  bool on_ = false;
  std::size_t max_ = 0;
  std::deque<HistoryEntry> entries_;
};

}  // namespace waterwave
