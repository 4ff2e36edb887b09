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
// A field of AllocatorStats with the name flatten() gives it: each field
// named once, for every function that walks them.
template <typename T>
struct Field {
  const char* name;
  T AllocatorStats::*member;
};
using S = AllocatorStats;

// Every Stat of PyTorch's kind: the nine StatArrays' three each, and the two
// oversize counts.
constexpr Field<StatArray> kStatArrays[] = {
    {"allocation", &S::allocation}, {"allocated_bytes", &S::allocated_bytes},
    {"requested_bytes", &S::requested_bytes}, {"active", &S::active},
    {"active_bytes", &S::active_bytes}, {"segment", &S::segment},
    {"reserved_bytes", &S::reserved_bytes}, {"inactive_split", &S::inactive_split},
    {"inactive_split_bytes", &S::inactive_split_bytes}};
constexpr Field<Stat> kStats[] = {{"oversize_allocations", &S::oversize_allocations},
                                  {"oversize_segments", &S::oversize_segments}};
// PyTorch's accumulated counts: add() sums them, reset_accumulated() zeroes them.
constexpr Field<std::int64_t> kAccumulated[] = {
    {"num_alloc_retries", &S::num_alloc_retries}, {"num_ooms", &S::num_ooms},
    {"num_sync_all_streams", &S::num_sync_all_streams},
    {"num_device_alloc", &S::num_device_alloc}, {"num_device_free", &S::num_device_free}};
// The other figures flatten() reports as they stand.
constexpr Field<std::int64_t> kFigures[] = {
    {"num_page_moves", &S::num_page_moves}, {"max_split_size", &S::max_split_size},
    {"num_sync_and_coalesce", &S::num_sync_and_coalesce},
    {"num_stream_waits", &S::num_stream_waits}, {"num_events_recorded", &S::num_events_recorded},
    {"num_event_queries", &S::num_event_queries},
    {"num_host_event_syncs", &S::num_host_event_syncs}, {"num_oom_retries", &S::num_oom_retries},
    {"allocated_bytes.at_peak_reserved", &S::allocated_at_peak_reserved},
    {"largest_free_block", &S::largest_free_block}, {"synced_free_bytes", &S::synced_free_bytes},
    {"pending_free_bytes", &S::pending_free_bytes}};

template <typename Visit>
void for_each_stat(AllocatorStats& s, const AllocatorStats& t, Visit visit) {
  for (const auto& field : kStatArrays) {
    for (int i = 0; i < 3; ++i) visit((s.*field.member).s[i], (t.*field.member).s[i]);
  }
  for (const auto& field : kStats) visit(s.*field.member, t.*field.member);
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
  for (const auto& field : kAccumulated) this->*field.member += other.*field.member;
  for (const auto& [stream, own] : other.own_segments) {
    for (auto [x, y] : {std::pair{&own_segments[stream].reserved, &own.reserved},
                        std::pair{&own_segments[stream].allocated, &own.allocated}}) {
      for (std::size_t i = 0; i < x->s.size(); ++i) {
        x->s[i].current += y->s[i].current;
        x->s[i].peak += y->s[i].peak;
        x->s[i].allocated += y->s[i].allocated;
        x->s[i].freed += y->s[i].freed;
      }
    }
  }
}

void AllocatorStats::reset_peaks() {
  for_each_stat(*this, [](Stat& x) { x.reset_peak(); });
  for (auto& [stream, own] : own_segments) {
    own.reserved.reset_peak();
    own.allocated.reset_peak();
  }
  allocated_at_peak_reserved = allocated_bytes.all().current;
}

void AllocatorStats::reset_accumulated() {
  for_each_stat(*this, [](Stat& x) { x.reset_accumulated(); });
  for (auto& [stream, own] : own_segments) {
    own.reserved.reset_accumulated();
    own.allocated.reset_accumulated();
  }
  for (const auto& field : kAccumulated) this->*field.member = 0;
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
  for (const auto& field : kStatArrays) put_array(field.name, this->*field.member);
  for (const auto& field : kStats) put_stat(field.name, this->*field.member);
  for (const auto& field : kAccumulated) out[field.name] = this->*field.member;
  for (const auto& field : kFigures) out[field.name] = this->*field.member;
  for (int i = 0; i < static_cast<int>(Served::kCount); ++i) {
    out[std::string("served.") + served_name(static_cast<Served>(i))] = served[i];
  }
  out["fragmentation.at_peak_reserved"] = fragmentation_at_peak();
  out["fragmentation.peak"] = peak_fragmentation();
  std::int64_t unsynced_total = 0;
  for (const auto& [stream, bytes] : unsynced_free_bytes) unsynced_total += bytes;
  out["unsynced_free_bytes"] = unsynced_total;
  return out;
}

}  // namespace waterwave
