// The CUDA runtime's process-wide face (csrc/runtime): its settings, its
// devices, and the entry points PyTorch calls. A device's stack is an
// AllocatorStack(cuda_device=N) (bind_stack.cpp); waterwave.cuda calls it.
#include "../runtime/cuda_runtime.h"
#include "../runtime/pytorch_abi.h"
#include "bindings.h"

namespace waterwave::bindings {

using cuda::CudaRuntime;
using cuda::stream_handle;

namespace {

void bind_runtime(py::module_& m, CudaRuntime& rt) {
  const auto release_gil = py::call_guard<py::gil_scoped_release>();
  m.def("cuda_configure", [&rt](const std::string& policy, const AllocatorConfig& config,
                               const std::string& driver) {
    rt.configure(parse_policy(policy), config, driver);
  }, py::arg("policy"), py::arg("config") = AllocatorConfig(), py::arg("driver") = "");
  m.def("cuda_reset", [&rt]() { rt.reset(); }, release_gil);
  m.def("cuda_devices", [&rt]() { return rt.devices(); });
  m.def("cuda_settings", [&rt]() {
    py::dict d;
    d["policy"] = policy_info(rt.policy()).name;
    d["config"] = rt.config();
    d["driver"] = rt.driver_path();
    return d;
  });
  m.def("cuda_empty_cache", [&rt]() { rt.empty_cache(); }, release_gil);
  m.def("cuda_free_errors", [&rt]() { return rt.free_errors(); },
        "(count, last message) of problems the free hook met; it cannot raise into PyTorch.");
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
  bind_entry_points(m);
}

}  // namespace waterwave::bindings
