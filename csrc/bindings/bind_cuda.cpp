// The CUDA runtime's face (csrc/runtime): what PyTorch reaches through the
// exported C entry points, Python reaches here (waterwave.alloc.cuda).
#include <optional>

#include "../runtime/cuda_runtime.h"
#include "../runtime/pytorch_abi.h"
#include "bindings.h"

namespace waterwave::bindings {

using cuda::CudaRuntime;
using cuda::stream_handle;
using OptStream = std::optional<StreamId>;

namespace {

void bind_runtime(py::module_& m, CudaRuntime& rt) {
  const auto release_gil = py::call_guard<py::gil_scoped_release>();
  m.def("cuda_configure", [&rt](const std::string& policy, const std::string& config,
                               const std::string& driver) { rt.configure(policy, config, driver); },
        py::arg("policy"), py::arg("config") = "", py::arg("driver") = "");
  m.def("cuda_reset", [&rt]() { rt.reset(); }, release_gil);
  m.def("cuda_devices", [&rt]() { return rt.devices(); });
  m.def("cuda_settings", [&rt]() {
    py::dict d;
    d["policy"] = rt.policy();
    d["config"] = rt.config();
    d["driver"] = rt.driver_path();
    return d;
  });
  m.def("cuda_stats", [&rt](int device) {
    AllocatorStack& s = rt.stack(device);
    return stats_dict(s.stats(), s.online().kind());
  }, py::arg("device"));
  m.def("cuda_mem_get_info", [&rt](int device) {
    Device& d = rt.stack(device).device();
    return std::make_pair(d.free_memory(), d.total_memory());
  }, py::arg("device"), "(free, total) bytes of the device, as its driver reports them.");
  m.def("cuda_memory_fraction", [&rt](int device) {
    return rt.stack(device).online().config().per_process_memory_fraction;
  }, py::arg("device"));
  m.def("cuda_snapshot", [&rt](int device) { return segments_list(rt.stack(device).snapshot()); },
        py::arg("device"));
  m.def("cuda_record_history",
        [&rt](int device, bool enabled, std::size_t max_entries) {
          rt.stack(device).online().record_history(enabled, max_entries);
        },
        py::arg("device"), py::arg("enabled"), py::arg("max_entries"));
  m.def("cuda_history", [&rt](int device) { return history_list(rt.stack(device).online().history()); },
        py::arg("device"));
  m.def("cuda_reset_peak_stats", [&rt](int device) { rt.stack(device).reset_peak_stats(); },
        py::arg("device"));
  m.def("cuda_check_invariants", [&rt](int device) { rt.stack(device).check_invariants(); },
        py::arg("device"));
  m.def("cuda_sync_and_coalesce", [&rt](int device) { rt.stack(device).sync_and_coalesce(); },
        py::arg("device"), release_gil);
  m.def("cuda_empty_cache", [&rt]() { rt.empty_cache(); }, release_gil);
  m.def("cuda_free_errors", [&rt]() { return rt.free_errors(); },
        "(count, last message) of problems the free hook met; it cannot raise into PyTorch.");
}

// Plans and recordings, per stream of a device's stack; stream None means
// the one plan (recording) there is.
void bind_plans(py::module_& m, CudaRuntime& rt) {
  const auto release_gil = py::call_guard<py::gil_scoped_release>();
  m.def("cuda_set_plan", [&rt](int device, const std::vector<std::pair<std::size_t, std::size_t>>& slots,
                             std::size_t arena, StreamId stream, const std::string& scope) {
    rt.stack(device).set_plan(stream, to_slots(slots), arena, parse_scope(scope), true);
  }, py::arg("device"), py::arg("slots"), py::arg("arena"), py::arg("stream"),
     py::arg("scope") = "device", release_gil);
  m.def("cuda_clear_plan", [&rt](int device, OptStream stream) { rt.stack(device).clear_plan(stream); },
        py::arg("device"), py::arg("stream") = py::none(), release_gil);
  m.def("cuda_has_plan", [&rt](int device, OptStream stream) {
    return rt.stack(device).has_plan(stream);
  }, py::arg("device"), py::arg("stream") = py::none());
  m.def("cuda_begin_step", [&rt](int device, OptStream stream) { rt.stack(device).begin_step(stream); },
        py::arg("device"), py::arg("stream") = py::none());
  m.def("cuda_plan_stats", [&rt](int device, OptStream stream) {
    return plan_stats_dict(rt.stack(device).plan_stats(stream));
  }, py::arg("device"), py::arg("stream") = py::none());
  m.def("cuda_start_recording", [&rt](int device, StreamId stream) {
    rt.stack(device).start_recording(stream);
  }, py::arg("device"), py::arg("stream"));
  m.def("cuda_stop_recording", [&rt](int device, OptStream stream) {
    py::list out;
    for (const TracedBlock& b : rt.stack(device).stop_recording(stream))
      out.append(py::make_tuple(b.size, b.allocated, b.freed));
    return out;
  }, py::arg("device"), py::arg("stream") = py::none(),
     "The recorded blocks in allocation order: (size, allocated, freed or -1).");
}

// The entry points PyTorch calls, callable from Python too (errors become
// exceptions here, where through PyTorch they become RuntimeError).
void bind_entry_points(py::module_& m) {
  const auto release_gil = py::call_guard<py::gil_scoped_release>();
  m.def("cuda_malloc", [](std::size_t size, int device, StreamId stream) {
    return reinterpret_cast<Addr>(waterwave_cuda_malloc(size, device, stream_handle(stream)));
  }, py::arg("size"), py::arg("device"), py::arg("stream"), release_gil);
  m.def("cuda_free", [](Addr ptr, std::size_t size, int device, StreamId stream) {
    waterwave_cuda_free(reinterpret_cast<void*>(ptr), size, device, stream_handle(stream));
  }, py::arg("ptr"), py::arg("size"), py::arg("device"), py::arg("stream"), release_gil);
  m.def("cuda_record_stream", [](Addr ptr, StreamId stream) {
    waterwave_cuda_record_stream(reinterpret_cast<void*>(ptr), stream_handle(stream));
  }, py::arg("ptr"), py::arg("stream"), release_gil);
}

}  // namespace

void bind_cuda(py::module_& m) {
  CudaRuntime& rt = CudaRuntime::get();  // never destroyed
  bind_runtime(m, rt);
  bind_plans(m, rt);
  bind_entry_points(m);
}

}  // namespace waterwave::bindings
