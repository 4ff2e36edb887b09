// Conversions between the allocator stack's structures and Python objects.
#include "bindings.h"

#include <string_view>

namespace waterwave::bindings {

using namespace pybind11::literals;

py::dict stats_dict(const AllocatorStats& s, PolicyKind policy) {
  py::dict d;
  for (const auto& [k, v] : s.flatten(policy_info(policy).pool_stats)) {
    // Counters are integral; fractions stay floats.
    if (k.rfind("fragmentation.", 0) == 0) {
      d[py::str(k)] = v;
    } else {
      d[py::str(k)] = static_cast<long long>(v);
    }
  }
  py::dict per_stream;
  for (const auto& [stream, bytes] : s.unsynced_free_bytes) per_stream[py::int_(stream)] = bytes;
  d["unsynced_free_bytes_by_stream"] = per_stream;
  py::dict own;
  for (const auto& [stream, o] : s.own_segments) {
    py::dict figures;
    const char* pools[] = {"all", "small_pool", "large_pool"};
    for (std::size_t i = 0; i < 3; ++i) {
      // PyTorch's keys for the whole stream ("reserved_bytes.peak"), and
      // its pools' ("reserved_bytes.small_pool.peak").
      const std::string pool = i == 0 ? "" : std::string(pools[i]) + ".";
      figures[py::str("reserved_bytes." + pool + "current")] = o.reserved.s[i].current;
      figures[py::str("reserved_bytes." + pool + "peak")] = o.reserved.s[i].peak;
      figures[py::str("allocated_bytes." + pool + "current")] = o.allocated.s[i].current;
      figures[py::str("allocated_bytes." + pool + "peak")] = o.allocated.s[i].peak;
    }
    own[py::int_(stream)] = figures;
  }
  d["own_segments_by_stream"] = own;
  return d;
}

py::dict plan_stats_dict(const PlanStats& s) {
  return py::dict("steps"_a = s.steps, "planned"_a = s.planned, "deviations"_a = s.deviations,
                  "fallback"_a = s.fallback, "arena_bytes"_a = s.arena_bytes,
                  "planned_live_bytes"_a = s.planned_live_bytes,
                  "last_deviation_index"_a = s.last_deviation_index,
                  "last_deviation"_a = s.last_deviation, "arena"_a = s.arena);
}

py::list segments_list(const std::vector<SegmentInfo>& segments) {
  py::list segs;
  for (const SegmentInfo& s : segments) {
    py::list blocks;
    for (const BlockInfo& b : s.blocks) {
      blocks.append(py::dict("addr"_a = b.addr, "size"_a = b.size, "requested"_a = b.requested,
                             "stream"_a = b.stream, "state"_a = b.state));
    }
    segs.append(py::dict("addr"_a = s.addr, "size"_a = s.size,
                         "pool"_a = s.pool == kSmallPool ? "small" : "large",
                         "stream"_a = s.stream, "expandable"_a = s.expandable,
                         "blocks"_a = blocks));
  }
  return segs;
}

std::vector<PlanSlot> to_slots(const std::vector<std::pair<std::size_t, std::size_t>>& slots) {
  std::vector<PlanSlot> ps;
  ps.reserve(slots.size());
  for (auto& [size, offset] : slots) ps.push_back({size, offset});
  return ps;
}

PlanScope parse_scope(const std::string& scope) {
  if (scope == "device") return PlanScope::kDevice;
  if (scope == "stream") return PlanScope::kStream;
  throw ConfigError("unknown plan scope '" + scope +
                    "': 'device' (the plan is the whole device's step) or 'stream' (its stream's "
                    "allocations only)");
}

py::list history_list(const std::vector<HistoryEntry>& entries) {
  py::list out;
  for (const HistoryEntry& e : entries) {
    if (std::string_view(e.action) == "oom") {  // its addr holds the device's free bytes
      out.append(py::dict("action"_a = e.action, "size"_a = e.size, "device_free"_a = e.addr,
                          "stream"_a = e.stream, "time_us"_a = e.time_us));
    } else {
      out.append(py::dict("action"_a = e.action, "addr"_a = e.addr, "size"_a = e.size,
                          "stream"_a = e.stream, "time_us"_a = e.time_us));
    }
  }
  return out;
}

}  // namespace waterwave::bindings
