// The simulated GPU: SimDevice (an AllocatorStack is made over one in
// bind_stack.cpp).
#include <memory>

#include "../device/sim/sim_device.h"
#include "bindings.h"

namespace waterwave::bindings {
namespace {

using namespace pybind11::literals;

py::dict hazard_dict(const Hazard& h) {
  return py::dict("addr"_a = h.addr, "size"_a = h.size, "stream"_a = h.stream,
                  "other_stream"_a = h.other_stream, "kernel"_a = h.kernel,
                  "host_time_us"_a = h.host_time_us, "message"_a = h.describe());
}

namespace {

// The constructor's arguments checked here, so a wrong one is named with
// what it takes, not answered with pybind's list of C++ signatures.
std::size_t capacity_arg(const py::object& value) {
  if (PyBool_Check(value.ptr()) || !PyIndex_Check(value.ptr())) {
    throw py::type_error("SimDevice capacity must be a whole number of bytes, got " +
                         py::repr(value).cast<std::string>());
  }
  const py::int_ n(value);
  if (n < py::int_(1) || n > py::int_(SimDevice::kMaxCapacity)) {
    throw py::value_error("SimDevice capacity must be 1 to 2**56 bytes (64 PiB), got " +
                          py::str(n).cast<std::string>());
  }
  return n.cast<std::size_t>();
}

double overhead_arg(const py::object& value) {
  if (PyBool_Check(value.ptr()) || !(PyFloat_Check(value.ptr()) || PyIndex_Check(value.ptr()))) {
    throw py::type_error("SimDevice launch_overhead_us must be a number of microseconds, got " +
                         py::repr(value).cast<std::string>());
  }
  return value.cast<double>();  // finite and >= 0 is the device's own check
}

}  // namespace

void bind_sim_device(py::module_& m) {
  py::class_<SimDevice, std::shared_ptr<SimDevice>>(m, "SimDevice")
      .def(py::init([](const py::object& capacity, const py::object& launch_overhead_us,
                       bool shared_compute) {
             return std::make_shared<SimDevice>(capacity_arg(capacity),
                                                overhead_arg(launch_overhead_us), shared_compute);
           }),
           py::arg("capacity"), py::arg("launch_overhead_us") = 2.0,
           py::arg("shared_compute") = false)
      .def_readonly_static("max_capacity", &SimDevice::kMaxCapacity)
      .def_property_readonly("capacity", &SimDevice::total_memory)
      .def("free_memory", &SimDevice::free_memory)
      .def("reserved_bytes", &SimDevice::reserved_bytes)
      .def("mapped_bytes", &SimDevice::mapped_bytes, "Bytes of physical memory mapped (VMM).")
      .def("num_segments", &SimDevice::num_segments)
      .def("now", &SimDevice::now, "Host clock in microseconds.")
      .def("gpu_busy_until", &SimDevice::gpu_busy_until)
      .def("stream_completion", &SimDevice::stream_completion, py::arg("stream"))
      .def("advance_host", &SimDevice::advance_host, py::arg("us"))
      .def("synchronize", &SimDevice::synchronize_device, py::call_guard<py::gil_scoped_release>())
      .def("kernels_launched", &SimDevice::kernels_launched)
      .def("set_concurrent_kernels", &SimDevice::set_concurrent_kernels, py::arg("on"),
           "Kernels of different streams run at once while their SM and bandwidth shares fit "
           "(set before the first launch).")
      .def_property_readonly("concurrent_kernels", &SimDevice::concurrent_kernels)
      .def("sm_busy_us", &SimDevice::sm_busy_us,
           "Sum over launched kernels of duration x SM share (x 1 without concurrent kernels).")
      .def("hazards", [](const SimDevice& d) {
        py::list out;
        for (const Hazard& h : d.hazards()) out.append(hazard_dict(h));
        return out;
      })
      // Raw virtual memory API, for tests of the simulator itself.
      .def("reserve_address", &SimDevice::reserve_address, py::arg("nbytes"))
      .def("release_address", &SimDevice::release_address, py::arg("addr"), py::arg("nbytes"))
      .def("map", &SimDevice::map, py::arg("addr"), py::arg("nbytes"))
      .def("map_pages",
           [](SimDevice& d, Addr addr, std::size_t page, std::size_t count) {
             return d.map_pages(addr, page, count).mapped;
           },
           py::arg("addr"), py::arg("page"), py::arg("count"),
           "Map `count` pages of `page` bytes from `addr` on; returns how many fit.")
      .def("unmap", &SimDevice::unmap, py::arg("addr"), py::arg("nbytes"))
      .def("unmap_pages", &SimDevice::unmap_pages, py::arg("addr"), py::arg("page"),
           py::arg("count"))
      .def("remap", &SimDevice::remap, py::arg("src"), py::arg("dst"), py::arg("nbytes"))
      // Raw event API, for tests of the simulator itself.
      .def("create_event", &SimDevice::create_event)
      .def("record_event", &SimDevice::record_event, py::arg("event"), py::arg("stream"))
      .def("query_event", &SimDevice::query_event, py::arg("event"))
      .def("synchronize_event", &SimDevice::synchronize_event, py::arg("event"))
      .def("stream_wait_event", &SimDevice::stream_wait_event, py::arg("stream"), py::arg("event"))
      .def("launch_ranges",
           [](SimDevice& d, StreamId s, double dur, const std::vector<std::pair<Addr, std::size_t>>& r,
              double sm_share, double bw_share) {
             std::vector<Range> ranges;
             for (auto& [a, n] : r) ranges.push_back({a, n});
             return d.launch(s, dur, ranges, sm_share, bw_share);
           },
           py::arg("stream"), py::arg("duration_us"), py::arg("ranges"), py::arg("sm_share") = 1.0,
           py::arg("bw_share") = 1.0)
      .def("note_handout", &SimDevice::note_handout, py::arg("addr"), py::arg("size"),
           py::arg("stream"));
}

}  // namespace

void bind_sim(py::module_& m) { bind_sim_device(m); }

}  // namespace waterwave::bindings
