// Allocator statistics, with PyTorch's Stat semantics (docs/design/pytorch-policy.md, Statistics)
// plus the Waterwave-specific counters: how each request was served, syncs,
// waits, and fragmentation.
//
// May include: types.h.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>

#include "types.h"

namespace waterwave {

struct Stat {
  std::int64_t current = 0, peak = 0, allocated = 0, freed = 0;
  void increase(std::int64_t n) {
    current += n;
    allocated += n;
    if (current > peak) peak = current;
  }
  void decrease(std::int64_t n) {
    current -= n;
    freed += n;
  }
  void reset_peak() { peak = current; }
  void reset_accumulated() { allocated = freed = 0; }
};

// Index 0 = all, 1 = small pool, 2 = large pool.
struct StatArray {
  std::array<Stat, 3> s;
  void increase(PoolKind p, std::int64_t n) {
    s[0].increase(n);
    s[1 + p].increase(n);
  }
  void decrease(PoolKind p, std::int64_t n) {
    s[0].decrease(n);
    s[1 + p].decrease(n);
  }
  void reset_peak() {
    for (auto& x : s) x.reset_peak();
  }
  void reset_accumulated() {
    for (auto& x : s) x.reset_accumulated();
  }
  const Stat& all() const { return s[0]; }
};

// A stream's own segments (those it reserved: Segment::stream), their bytes
// and the bytes allocated in them, each with its peak, in all and by pool.
// The peaks' difference is what the stream's blocks left unused in its
// segments: a trainer measures it of each job's stream with the job alone
// (waterwave/exec/device_segments.py); the small pool's, to tell whether the
// jobs' small blocks need a segment more side by side.
struct OwnSegments {
  StatArray reserved, allocated;
};

// How a request was served; one counter each.
enum class Served : int {
  kSameStream = 0,    // the requesting stream's own unsynced blocks
  kSynced,            // the synced set (pytorch policy: its per-stream pool)
  kPromoted,          // synced set after promoting blocks by event query
  kCrossStreamWait,   // another stream's block, taken by an async stream wait
  kNewSegment,        // a new segment from the device
  kAfterSync,         // only after SyncAndCoalesce / release on out-of-memory
  kCount
};
const char* served_name(Served s);

struct AllocatorStats {
  StatArray allocation, allocated_bytes, requested_bytes, active, active_bytes,
      segment, reserved_bytes, inactive_split, inactive_split_bytes;
  Stat oversize_allocations, oversize_segments;
  std::int64_t num_alloc_retries = 0, num_ooms = 0, num_sync_all_streams = 0,
               num_device_alloc = 0, num_device_free = 0,
               num_page_moves = 0;  // expandable pages moved to another address
  std::array<std::int64_t, static_cast<int>(Served::kCount)> served{};
  std::int64_t num_sync_and_coalesce = 0;  // SyncAndCoalesce calls
  std::int64_t num_stream_waits = 0;       // stream_wait_event calls issued
  std::int64_t num_events_recorded = 0;
  std::int64_t num_event_queries = 0;
  std::int64_t num_host_event_syncs = 0;
  std::int64_t num_oom_retries = 0;  // OOM handled by sync/release then retry
  // Largest allocated bytes seen while reserved stood at its peak.
  std::int64_t allocated_at_peak_reserved = 0;
  std::int64_t max_split_size = -1;

  // Filled by Allocator::stats(), not maintained incrementally.
  std::int64_t largest_free_block = 0;
  std::int64_t synced_free_bytes = 0;
  std::map<StreamId, std::int64_t> unsynced_free_bytes;  // per stream
  // Per stream that reserved segments, kept as they change (a segment points
  // at its stream's entry, which is never erased, so the allocation path
  // adds to it without a search).
  std::map<StreamId, OwnSegments> own_segments;
  std::int64_t pending_free_bytes = 0;  // freed, waiting on events

  void note_reserved_change();   // call after reserved_bytes changes
  void note_allocated_change();  // call after allocated_bytes changes
  void reset_peaks();
  // PyTorch's reset_accumulated_memory_stats: every Stat's allocated and
  // freed, and the counts of retries, OOMs, syncs and device calls.
  void reset_accumulated();
  // Another allocator's figures joined to these (a device's private pools,
  // reported with it as PyTorch reports them): PyTorch's Stats and the
  // accumulated counts add up; a peak adds up to a bound on the joint peak.
  void add(const AllocatorStats& other);
  // (reserved - allocated) / reserved at the peak of reserved.
  double fragmentation_at_peak() const;
  // 1 - peak allocated / peak reserved.
  double peak_fragmentation() const;
  // PyTorch-style flat dict: "allocated_bytes.all.peak" -> value, plus ours.
  std::map<std::string, double> flatten(bool with_pools) const;
};

}  // namespace waterwave
