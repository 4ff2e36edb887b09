// waterwave._C, the Python face: thin on purpose. Each bind_*.cpp binds one
// layer; this header declares them and the conversions they share.
// Policy lives in csrc/alloc, the simulator in csrc/device/sim, the CUDA
// runtime in csrc/runtime, conveniences in waterwave/.
//
// May include: every other csrc folder (bindings sit on top of them all).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <utility>
#include <vector>

#include "../alloc/stack.h"

namespace waterwave::bindings {

namespace py = pybind11;

void bind_errors(py::module_& m);    // module.cpp
void bind_settings(py::module_& m);  // bind_settings.cpp
void bind_sim(py::module_& m);       // bind_sim.cpp
void bind_stack(py::module_& m);     // bind_stack.cpp
void bind_cuda(py::module_& m);      // bind_cuda.cpp
void bind_accounts(py::module_& m);  // bind_accounts.cpp
void bind_sharing(py::module_& m);   // bind_sharing.cpp
void bind_planner(py::module_& m);   // bind_planner.cpp
void bind_bench(py::module_& m);     // bind_bench.cpp

// Conversions (convert.cpp).
// PyTorch's memory_stats() keys and ours; by pool where the policy keeps pools.
py::dict stats_dict(const AllocatorStats& s, PolicyKind policy);
py::dict plan_stats_dict(const PlanStats& s);
py::list segments_list(const std::vector<SegmentInfo>& segments);
// The memory history as PyTorch's device_traces entries.
py::list history_list(const std::vector<HistoryEntry>& entries);
std::vector<PlanSlot> to_slots(const std::vector<std::pair<std::size_t, std::size_t>>& slots);
// The settings with keyword settings applied on top, then validated
// (bind_settings.cpp).
AllocatorConfig with_keywords(AllocatorConfig config, const py::kwargs& settings);
// "device" or "stream" (stream_plan.h's PlanScope); ConfigError otherwise.
PlanScope parse_scope(const std::string& scope);

}  // namespace waterwave::bindings
