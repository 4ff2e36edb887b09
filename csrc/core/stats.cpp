#include "stats.h"

#include <algorithm>

namespace waterwave {

const char* served_name(Served s) {
  switch (s) {
    case Served::kSameStream: return "same_stream";
    case Served::kSynced: return "synced";
    case Served::kPromoted: return "promoted";
    case Served::kCrossStreamWait: return "cross_stream_wait";
    case Served::kNewSegment: return "new_segment";
    case Served::kAfterSync: return "after_sync";
    default: return "?";
  }
}

void AllocatorStats::note_reserved_change() {
  const Stat& r = reserved_bytes.all();
  if (r.current == r.peak) {
    // Reserved just rose to (or sits at) its peak: start measuring anew when
    // it is a new peak, so that the figure belongs to the highest level.
    allocated_at_peak_reserved = allocated_bytes.all().current;
  }
}

void AllocatorStats::note_allocated_change() {
  const Stat& r = reserved_bytes.all();
  if (r.current == r.peak && r.peak > 0) {
    allocated_at_peak_reserved =
        std::max(allocated_at_peak_reserved, allocated_bytes.all().current);
  }
}

namespace {
// Every Stat of PyTorch's kind: the nine StatArrays' three each, and the two
// oversize counts.
constexpr StatArray AllocatorStats::*kStatArrays[] = {
    &AllocatorStats::allocation,   &AllocatorStats::allocated_bytes,
    &AllocatorStats::requested_bytes, &AllocatorStats::active,
    &AllocatorStats::active_bytes, &AllocatorStats::segment,
    &AllocatorStats::reserved_bytes, &AllocatorStats::inactive_split,
    &AllocatorStats::inactive_split_bytes};
constexpr Stat AllocatorStats::*kStats[] = {&AllocatorStats::oversize_allocations,
                                            &AllocatorStats::oversize_segments};

// visit(Stat& in s, const Stat& the same one in t) for each of them.
template <typename Visit>
void for_each_stat(AllocatorStats& s, const AllocatorStats& t, Visit visit) {
  for (auto member : kStatArrays) {
    for (int i = 0; i < 3; ++i) visit((s.*member).s[i], (t.*member).s[i]);
  }
  for (auto member : kStats) visit(s.*member, t.*member);
}

template <typename Visit>
void for_each_stat(AllocatorStats& s, Visit visit) {
  for_each_stat(s, s, [&](Stat& x, const Stat&) { visit(x); });
}
}  // namespace

void AllocatorStats::add(const AllocatorStats& other) {
  for_each_stat(*this, other, [](Stat& x, const Stat& y) {
    x.current += y.current;
    x.peak += y.peak;
    x.allocated += y.allocated;
    x.freed += y.freed;
  });
  num_alloc_retries += other.num_alloc_retries;
  num_ooms += other.num_ooms;
  num_sync_all_streams += other.num_sync_all_streams;
  num_device_alloc += other.num_device_alloc;
  num_device_free += other.num_device_free;
}

void AllocatorStats::reset_peaks() {
  for_each_stat(*this, [](Stat& x) { x.reset_peak(); });
  allocated_at_peak_reserved = allocated_bytes.all().current;
}

void AllocatorStats::reset_accumulated() {
  for_each_stat(*this, [](Stat& x) { x.reset_accumulated(); });
  num_alloc_retries = num_ooms = num_sync_all_streams = num_device_alloc = num_device_free = 0;
}

double AllocatorStats::fragmentation_at_peak() const {
  const double peak = static_cast<double>(reserved_bytes.all().peak);
  if (peak <= 0) return 0.0;
  return (peak - static_cast<double>(allocated_at_peak_reserved)) / peak;
}

double AllocatorStats::peak_fragmentation() const {
  const double peak = static_cast<double>(reserved_bytes.all().peak);
  if (peak <= 0) return 0.0;
  return 1.0 - static_cast<double>(allocated_bytes.all().peak) / peak;
}

std::map<std::string, double> AllocatorStats::flatten(bool with_pools) const {
  std::map<std::string, double> out;
  auto put_stat = [&](const std::string& prefix, const Stat& s) {
    out[prefix + ".current"] = static_cast<double>(s.current);
    out[prefix + ".peak"] = static_cast<double>(s.peak);
    out[prefix + ".allocated"] = static_cast<double>(s.allocated);
    out[prefix + ".freed"] = static_cast<double>(s.freed);
  };
  auto put_array = [&](const std::string& name, const StatArray& a) {
    put_stat(name + ".all", a.s[0]);
    if (with_pools) {
      put_stat(name + ".small_pool", a.s[1]);
      put_stat(name + ".large_pool", a.s[2]);
    }
  };
  put_array("allocation", allocation);
  put_array("allocated_bytes", allocated_bytes);
  put_array("requested_bytes", requested_bytes);
  put_array("active", active);
  put_array("active_bytes", active_bytes);
  put_array("segment", segment);
  put_array("reserved_bytes", reserved_bytes);
  put_array("inactive_split", inactive_split);
  put_array("inactive_split_bytes", inactive_split_bytes);
  put_stat("oversize_allocations", oversize_allocations);
  put_stat("oversize_segments", oversize_segments);
  out["num_alloc_retries"] = num_alloc_retries;
  out["num_ooms"] = num_ooms;
  out["num_sync_all_streams"] = num_sync_all_streams;
  out["num_device_alloc"] = num_device_alloc;
  out["num_device_free"] = num_device_free;
  out["num_page_moves"] = num_page_moves;
  out["max_split_size"] = max_split_size;
  for (int i = 0; i < static_cast<int>(Served::kCount); ++i) {
    out[std::string("served.") + served_name(static_cast<Served>(i))] = served[i];
  }
  out["num_sync_and_coalesce"] = num_sync_and_coalesce;
  out["num_stream_waits"] = num_stream_waits;
  out["num_events_recorded"] = num_events_recorded;
  out["num_event_queries"] = num_event_queries;
  out["num_host_event_syncs"] = num_host_event_syncs;
  out["num_oom_retries"] = num_oom_retries;
  out["fragmentation.at_peak_reserved"] = fragmentation_at_peak();
  out["fragmentation.peak"] = peak_fragmentation();
  out["allocated_bytes.at_peak_reserved"] = allocated_at_peak_reserved;
  out["largest_free_block"] = largest_free_block;
  out["synced_free_bytes"] = synced_free_bytes;
  out["pending_free_bytes"] = pending_free_bytes;
  std::int64_t unsynced_total = 0;
  for (const auto& [stream, bytes] : unsynced_free_bytes) unsynced_total += bytes;
  out["unsynced_free_bytes"] = unsynced_total;
  return out;
}

}  // namespace waterwave
