// Conversions between the allocator stack's structures and Python objects.
#include "bindings.h"

namespace waterwave::bindings {

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
  return d;
}

py::dict plan_stats_dict(const PlanStats& s) {
  py::dict d;
  d["steps"] = s.steps;
  d["planned"] = s.planned;
  d["deviations"] = s.deviations;
  d["fallback"] = s.fallback;
  d["arena_bytes"] = s.arena_bytes;
  d["planned_live_bytes"] = s.planned_live_bytes;
  d["last_deviation_index"] = s.last_deviation_index;
  d["last_deviation"] = s.last_deviation;
  d["arena"] = s.arena;
  return d;
}

py::list segments_list(const std::vector<SegmentInfo>& segments) {
  py::list segs;
  for (const SegmentInfo& s : segments) {
    py::list blocks;
    for (const BlockInfo& b : s.blocks) {
      py::dict bd;
      bd["addr"] = b.addr;
      bd["size"] = b.size;
      bd["requested"] = b.requested;
      bd["stream"] = b.stream;
      bd["state"] = b.state;
      blocks.append(bd);
    }
    py::dict sd;
    sd["addr"] = s.addr;
    sd["size"] = s.size;
    sd["pool"] = s.pool == kSmallPool ? "small" : "large";
    sd["stream"] = s.stream;
    sd["blocks"] = blocks;
    segs.append(sd);
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

}  // namespace waterwave::bindings
