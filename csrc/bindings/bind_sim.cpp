// The simulator's face: SimDevice, and _Allocator, an allocator stack bound
// to a simulated device (waterwave.alloc.Allocator wraps it).
#include <memory>
#include <optional>

#include "../device/sim/sim_device.h"
#include "bindings.h"

namespace waterwave::bindings {
namespace {

// An allocator stack on a simulated device. Keeps the device alive, and
// reports every hand-out to the device's hazard detector.
class SimStack {
 public:
  SimStack(const std::string& policy, std::shared_ptr<SimDevice> device, const std::string& config)
      : device_(std::move(device)),
        stack_(*device_, parse_policy(policy), AllocatorConfig::parse(config)) {}

  Addr alloc(std::size_t nbytes, StreamId stream) {
    const Addr p = stack_.allocate(nbytes, stream);
    if (p) device_->note_handout(p, stack_.allocation_size(p), stream);
    return p;
  }
  std::uint64_t launch(StreamId stream, double duration_us, const std::vector<Addr>& uses) {
    std::vector<Range> ranges;
    ranges.reserve(uses.size());
    for (Addr p : uses) ranges.push_back({p, stack_.allocation_size(p)});
    return device_->launch(stream, duration_us, ranges);
  }
  AllocatorStack& stack() { return stack_; }
  std::shared_ptr<SimDevice> device() { return device_; }

 private:
  std::shared_ptr<SimDevice> device_;
  AllocatorStack stack_;  // destroyed before the device it holds a reference to
};

using namespace pybind11::literals;

py::dict hazard_dict(const Hazard& h) {
  return py::dict("addr"_a = h.addr, "size"_a = h.size, "stream"_a = h.stream,
                  "other_stream"_a = h.other_stream, "kernel"_a = h.kernel,
                  "host_time_us"_a = h.host_time_us, "message"_a = h.describe());
}

void bind_sim_device(py::module_& m) {
  py::class_<SimDevice, std::shared_ptr<SimDevice>>(m, "SimDevice")
      .def(py::init<std::size_t, double, bool>(), py::arg("capacity"),
           py::arg("launch_overhead_us") = 2.0, py::arg("shared_compute") = false)
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
      .def("hazards", [](const SimDevice& d) {
        py::list out;
        for (const Hazard& h : d.hazards()) out.append(hazard_dict(h));
        return out;
      })
      // Raw virtual memory API, for tests of the simulator itself.
      .def("reserve_address", &SimDevice::reserve_address, py::arg("nbytes"))
      .def("release_address", &SimDevice::release_address, py::arg("addr"), py::arg("nbytes"))
      .def("map", &SimDevice::map, py::arg("addr"), py::arg("nbytes"))
      .def("unmap", &SimDevice::unmap, py::arg("addr"), py::arg("nbytes"))
      .def("remap", &SimDevice::remap, py::arg("src"), py::arg("dst"), py::arg("nbytes"))
      // Raw event API, for tests of the simulator itself.
      .def("create_event", &SimDevice::create_event)
      .def("record_event", &SimDevice::record_event, py::arg("event"), py::arg("stream"))
      .def("query_event", &SimDevice::query_event, py::arg("event"))
      .def("synchronize_event", &SimDevice::synchronize_event, py::arg("event"))
      .def("stream_wait_event", &SimDevice::stream_wait_event, py::arg("stream"), py::arg("event"))
      .def("launch_ranges",
           [](SimDevice& d, StreamId s, double dur, const std::vector<std::pair<Addr, std::size_t>>& r) {
             std::vector<Range> ranges;
             for (auto& [a, n] : r) ranges.push_back({a, n});
             return d.launch(s, dur, ranges);
           },
           py::arg("stream"), py::arg("duration_us"), py::arg("ranges"))
      .def("note_handout", &SimDevice::note_handout, py::arg("addr"), py::arg("size"),
           py::arg("stream"));
}

using OptStream = std::optional<StreamId>;
using Slots = std::vector<std::pair<std::size_t, std::size_t>>;

void bind_sim_stack(py::module_& m) {
  const auto release_gil = py::call_guard<py::gil_scoped_release>();
  py::class_<SimStack>(m, "_Allocator")
      .def(py::init<const std::string&, std::shared_ptr<SimDevice>, const std::string&>(),
           py::arg("policy"), py::arg("device"), py::arg("config") = "")
      .def("alloc", &SimStack::alloc, py::arg("nbytes"), py::arg("stream") = 0, release_gil)
      .def("free", [](SimStack& a, Addr p) { a.stack().deallocate(p); }, py::arg("ptr"), release_gil)
      .def("record_stream", [](SimStack& a, Addr p, StreamId s) { a.stack().record_stream(p, s); },
           py::arg("ptr"), py::arg("stream"), release_gil)
      .def("sync_and_coalesce", [](SimStack& a) { a.stack().sync_and_coalesce(); }, release_gil)
      .def("empty_cache", [](SimStack& a) { a.stack().empty_cache(); }, release_gil)
      .def("launch", &SimStack::launch, py::arg("stream"), py::arg("duration_us"),
           py::arg("uses") = std::vector<Addr>{})
      .def("stats", [](SimStack& a) { return stats_dict(a.stack().stats(), a.stack().online().kind()); })
      .def("reset_peak_stats", [](SimStack& a) { a.stack().reset_peak_stats(); })
      .def("check_invariants", [](SimStack& a) { a.stack().check_invariants(); })
      .def("allocation_size", [](SimStack& a, Addr p) { return a.stack().allocation_size(p); },
           py::arg("ptr"))
      .def("snapshot", [](SimStack& a) { return segments_list(a.stack().snapshot()); })
      .def("record_history",
           [](SimStack& a, bool enabled, std::size_t max_entries) {
             a.stack().online().record_history(enabled, max_entries);
           },
           py::arg("enabled"), py::arg("max_entries"))
      .def("history", [](SimStack& a) { return history_list(a.stack().online().history()); })
      .def_property_readonly("policy", [](SimStack& a) { return a.stack().online().policy(); })
      .def_property_readonly("config", [](SimStack& a) { return a.stack().online().config().to_string(); })
      .def_property_readonly("device", &SimStack::device)
      // Plans, per stream (stack.h): stream None means the one plan there is.
      .def("set_plan",
           [](SimStack& a, StreamId stream, const Slots& slots, std::size_t arena, const std::string& scope) {
             a.stack().set_plan(stream, to_slots(slots), arena, parse_scope(scope), false);
           },
           py::arg("stream"), py::arg("slots"), py::arg("arena"), py::arg("scope") = "stream")
      .def("clear_plan", [](SimStack& a, OptStream s) { a.stack().clear_plan(s); },
           py::arg("stream") = py::none())
      .def("has_plan", [](SimStack& a, OptStream s) { return a.stack().has_plan(s); },
           py::arg("stream") = py::none())
      .def("begin_step", [](SimStack& a, OptStream s) { a.stack().begin_step(s); },
           py::arg("stream") = py::none())
      .def("plan_stats", [](SimStack& a, OptStream s) { return plan_stats_dict(a.stack().plan_stats(s)); },
           py::arg("stream") = py::none())
      .def("start_recording", [](SimStack& a, StreamId s) { a.stack().start_recording(s); },
           py::arg("stream"))
      .def("stop_recording", [](SimStack& a, OptStream s) {
             py::list out;
             for (const TracedBlock& b : a.stack().stop_recording(s))
               out.append(py::make_tuple(b.size, b.allocated, b.freed));
             return out;
           },
           py::arg("stream") = py::none());
}

}  // namespace

void bind_sim(py::module_& m) {
  bind_sim_device(m);
  bind_sim_stack(m);
}

}  // namespace waterwave::bindings
