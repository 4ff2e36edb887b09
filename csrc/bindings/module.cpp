// Python bindings: waterwave._C. Thin on purpose: policy lives in csrc/core,
// the simulator in csrc/device/sim, conveniences in waterwave/*.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "../bench/alloc_bench.h"
#include "../core/allocator.h"
#include "../core/plan_allocator.h"
#include "../device/sim/sim_device.h"
#include "cuda_hooks.h"
#include "../planner/offset_search.h"

namespace py = pybind11;
using namespace waterwave;

namespace {

py::dict plan_stats_dict(PlanAllocator& plan) {
  PlanStats s = plan.plan_stats();
  py::dict d;
  d["steps"] = s.steps;
  d["planned"] = s.planned;
  d["deviations"] = s.deviations;
  d["fallback"] = s.fallback;
  d["arena_bytes"] = s.arena_bytes;
  d["planned_live_bytes"] = s.planned_live_bytes;
  d["last_deviation_index"] = s.last_deviation_index;
  d["last_deviation"] = s.last_deviation;
  d["arena"] = plan.arena();
  return d;
}

std::vector<PlanSlot> to_slots(const std::vector<std::pair<std::size_t, std::size_t>>& slots) {
  std::vector<PlanSlot> ps;
  ps.reserve(slots.size());
  for (auto& [size, offset] : slots) ps.push_back({size, offset});
  return ps;
}

// An allocator bound to its device; keeps the device alive and, on the
// simulated device, reports every hand-out to the hazard detector.
class BoundAllocator {
 public:
  BoundAllocator(const std::string& policy, std::shared_ptr<SimDevice> device,
                 const std::string& config)
      : device_(std::move(device)),
        allocator_(make_allocator(policy, *device_, AllocatorConfig::parse(config))) {}

  // A plan allocator over an online fallback policy.
  BoundAllocator(std::shared_ptr<SimDevice> device, const std::vector<std::pair<std::size_t, std::size_t>>& slots,
                 std::size_t arena, StreamId stream, const std::string& fallback,
                 const std::string& config)
      : device_(std::move(device)) {
    auto plan = std::make_unique<PlanAllocator>(
        *device_, to_slots(slots), arena, stream,
        make_allocator(fallback, *device_, AllocatorConfig::parse(config)));
    plan_ = plan.get();
    allocator_ = std::move(plan);
  }
  PlanAllocator* plan() {
    if (!plan_) throw ConfigError("this allocator does not replay a plan");
    return plan_;
  }

  Addr alloc(std::size_t nbytes, StreamId stream) {
    Addr p = allocator_->allocate(nbytes, stream);
    if (p) device_->note_handout(p, allocator_->allocation_size(p), stream);
    return p;
  }
  void free(Addr ptr) {
    if (ptr == 0) return;
    allocator_->deallocate(ptr);
  }
  std::uint64_t launch(StreamId stream, double duration_us, const std::vector<Addr>& uses) {
    std::vector<Range> ranges;
    ranges.reserve(uses.size());
    for (Addr p : uses) ranges.push_back({p, allocator_->allocation_size(p)});
    return device_->launch(stream, duration_us, ranges);
  }
  Allocator& core() { return *allocator_; }
  std::shared_ptr<SimDevice> device() { return device_; }

 private:
  std::shared_ptr<SimDevice> device_;
  std::unique_ptr<Allocator> allocator_;
  PlanAllocator* plan_ = nullptr;
};

py::dict stats_dict(const AllocatorStats& s, bool with_pools) {
  py::dict d;
  for (const auto& [k, v] : s.flatten(with_pools)) {
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

py::dict hazard_dict(const Hazard& h) {
  py::dict d;
  d["addr"] = h.addr;
  d["size"] = h.size;
  d["stream"] = h.stream;
  d["other_stream"] = h.other_stream;
  d["kernel"] = h.kernel;
  d["host_time_us"] = h.host_time_us;
  d["message"] = h.describe();
  return d;
}

// The allocator on real GPUs (cuda_hooks.h): what PyTorch reaches through the
// exported C entry points, Python reaches here.
void bind_cuda(py::module_& m) {
  using cuda::stream_handle;
  cuda::CudaRuntime& rt = cuda::CudaRuntime::get();  // never destroyed
  m.def("cuda_configure", [&rt](const std::string& policy, const std::string& config,
                               const std::string& driver) { rt.configure(policy, config, driver); },
        py::arg("policy"), py::arg("config") = "", py::arg("driver") = "");
  m.def("cuda_reset", [&rt]() { rt.reset(); }, py::call_guard<py::gil_scoped_release>());
  m.def("cuda_devices", [&rt]() { return rt.devices(); });
  m.def("cuda_settings", [&rt]() {
    py::dict d;
    d["policy"] = rt.policy();
    d["config"] = rt.config();
    d["driver"] = rt.driver_path();
    return d;
  });
  m.def("cuda_stats", [&rt](int device) {
    return rt.with_allocator(device, [](Allocator& a) {
      return stats_dict(a.stats(), a.policy() == "pytorch");
    });
  }, py::arg("device"));
  m.def("cuda_reset_peak_stats", [&rt](int device) {
    rt.with_allocator(device, [](Allocator& a) { a.reset_peak_stats(); });
  }, py::arg("device"));
  m.def("cuda_check_invariants", [&rt](int device) {
    rt.with_allocator(device, [](Allocator& a) { a.check_invariants(); });
  }, py::arg("device"));
  m.def("cuda_sync_and_coalesce", [&rt](int device) {
    rt.with_allocator(device, [](Allocator& a) { a.sync_and_coalesce(); });
  }, py::arg("device"), py::call_guard<py::gil_scoped_release>());
  m.def("cuda_empty_cache", [&rt]() { rt.empty_cache(); }, py::call_guard<py::gil_scoped_release>());
  m.def("cuda_set_plan", [&rt](int device, const std::vector<std::pair<std::size_t, std::size_t>>& slots,
                             std::size_t arena, StreamId stream) {
    rt.set_plan(device, to_slots(slots), arena, stream);
  }, py::arg("device"), py::arg("slots"), py::arg("arena"), py::arg("stream"),
     py::call_guard<py::gil_scoped_release>());
  m.def("cuda_clear_plan", [&rt](int device) { rt.clear_plan(device); }, py::arg("device"),
        py::call_guard<py::gil_scoped_release>());
  m.def("cuda_start_recording", [&rt](int device, StreamId stream) { rt.start_recording(device, stream); },
        py::arg("device"), py::arg("stream"));
  m.def("cuda_stop_recording", [&rt](int device) {
    py::list out;
    for (const TracedBlock& b : rt.stop_recording(device))
      out.append(py::make_tuple(b.size, b.allocated, b.freed));
    return out;
  }, py::arg("device"), "The recorded blocks in allocation order: (size, allocated, freed or -1).");
  m.def("cuda_has_plan", [&rt](int device) { return rt.has_plan(device); }, py::arg("device"));
  m.def("cuda_begin_step", [&rt](int device) {
    rt.with_plan(device, [](PlanAllocator& p) { p.begin_step(); });
  }, py::arg("device"));
  m.def("cuda_plan_stats", [&rt](int device) {
    return rt.with_plan(device, [](PlanAllocator& p) { return plan_stats_dict(p); });
  }, py::arg("device"));
  // The entry points PyTorch calls, callable from Python too (errors become
  // exceptions here, where through PyTorch they become RuntimeError).
  m.def("cuda_malloc", [](std::size_t size, int device, StreamId stream) {
    return reinterpret_cast<Addr>(waterwave_cuda_malloc(size, device, stream_handle(stream)));
  }, py::arg("size"), py::arg("device"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());
  m.def("cuda_free", [](Addr ptr, std::size_t size, int device, StreamId stream) {
    waterwave_cuda_free(reinterpret_cast<void*>(ptr), size, device, stream_handle(stream));
  }, py::arg("ptr"), py::arg("size"), py::arg("device"), py::arg("stream"),
     py::call_guard<py::gil_scoped_release>());
  m.def("cuda_record_stream", [](Addr ptr, StreamId stream) {
    waterwave_cuda_record_stream(reinterpret_cast<void*>(ptr), stream_handle(stream));
  }, py::arg("ptr"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());
  m.def("cuda_free_errors", [&rt]() { return rt.free_errors(); },
        "(count, last message) of problems the free hook met; it cannot raise into PyTorch.");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Waterwave allocator core, simulated GPU and benchmarks (C++)";

  auto base_memory_error = py::handle(PyExc_MemoryError);
  auto base_value_error = py::handle(PyExc_ValueError);
  static py::exception<OutOfMemoryError> oom(m, "OutOfMemoryError", base_memory_error);
  static py::exception<PointerError> bad_ptr(m, "PointerError", base_value_error);
  static py::exception<ConfigError> bad_cfg(m, "ConfigError", base_value_error);
  static py::exception<InvariantError> bad_inv(m, "InvariantError", PyExc_AssertionError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OutOfMemoryError& e) {
      py::set_error(oom, e.what());
    } catch (const PointerError& e) {
      py::set_error(bad_ptr, e.what());
    } catch (const ConfigError& e) {
      py::set_error(bad_cfg, e.what());
    } catch (const InvariantError& e) {
      py::set_error(bad_inv, e.what());
    }
  });

  py::class_<SimDevice, std::shared_ptr<SimDevice>>(m, "SimDevice")
      .def(py::init<std::size_t, double>(), py::arg("capacity"), py::arg("launch_overhead_us") = 2.0)
      .def_property_readonly("capacity", &SimDevice::total_memory)
      .def("free_memory", &SimDevice::free_memory)
      .def("reserved_bytes", &SimDevice::reserved_bytes)
      .def("num_segments", &SimDevice::num_segments)
      .def("now", &SimDevice::now, "Host clock in microseconds.")
      .def("gpu_busy_until", &SimDevice::gpu_busy_until)
      .def("stream_completion", &SimDevice::stream_completion, py::arg("stream"))
      .def("advance_host", &SimDevice::advance_host, py::arg("us"))
      .def("synchronize", &SimDevice::synchronize_device,
           py::call_guard<py::gil_scoped_release>())
      .def("kernels_launched", &SimDevice::kernels_launched)
      .def("hazards", [](const SimDevice& d) {
        py::list out;
        for (const Hazard& h : d.hazards()) out.append(hazard_dict(h));
        return out;
      })
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

  py::class_<BoundAllocator>(m, "_Allocator")
      .def(py::init<const std::string&, std::shared_ptr<SimDevice>, const std::string&>(),
           py::arg("policy"), py::arg("device"), py::arg("config") = "")
      .def(py::init<std::shared_ptr<SimDevice>, const std::vector<std::pair<std::size_t, std::size_t>>&,
                    std::size_t, StreamId, const std::string&, const std::string&>(),
           py::arg("device"), py::arg("slots"), py::arg("arena"), py::arg("stream"),
           py::arg("fallback"), py::arg("config") = "")
      .def("begin_step", [](BoundAllocator& a) { a.plan()->begin_step(); })
      .def("plan_stats", [](BoundAllocator& a) { return plan_stats_dict(*a.plan()); })
      .def("alloc", &BoundAllocator::alloc, py::arg("nbytes"), py::arg("stream") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("free", &BoundAllocator::free, py::arg("ptr"), py::call_guard<py::gil_scoped_release>())
      .def("record_stream", [](BoundAllocator& a, Addr p, StreamId s) { a.core().record_stream(p, s); },
           py::arg("ptr"), py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("sync_and_coalesce", [](BoundAllocator& a) { a.core().sync_and_coalesce(); },
           py::call_guard<py::gil_scoped_release>())
      .def("empty_cache", [](BoundAllocator& a) { a.core().empty_cache(); },
           py::call_guard<py::gil_scoped_release>())
      .def("launch", &BoundAllocator::launch, py::arg("stream"), py::arg("duration_us"),
           py::arg("uses") = std::vector<Addr>{})
      .def("stats", [](BoundAllocator& a) {
        return stats_dict(a.core().stats(), a.core().policy() == "pytorch");
      })
      .def("reset_peak_stats", [](BoundAllocator& a) { a.core().reset_peak_stats(); })
      .def("check_invariants", [](BoundAllocator& a) { a.core().check_invariants(); })
      .def("allocation_size", [](BoundAllocator& a, Addr p) { return a.core().allocation_size(p); },
           py::arg("ptr"))
      .def_property_readonly("policy", [](BoundAllocator& a) { return a.core().policy(); })
      .def_property_readonly("config", [](BoundAllocator& a) { return a.core().config().to_string(); })
      .def_property_readonly("device", &BoundAllocator::device)
      .def("snapshot", [](BoundAllocator& a) {
        py::list segs;
        for (const SegmentInfo& s : a.core().snapshot()) {
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
      });

  bind_cuda(m);

  m.def("parse_config", [](const std::string& text) { return AllocatorConfig::parse(text).to_string(); },
        py::arg("text"), "Validate a config string; returns its canonical form.");
  m.def("round_size", [](std::size_t n, const std::string& config) {
        AllocatorConfig cfg = AllocatorConfig::parse(config);
        return SizeRules{cfg}.round_size(n);
      }, py::arg("nbytes"), py::arg("config") = "");
  m.def("segment_size", [](std::size_t rounded, const std::string& config) {
        AllocatorConfig cfg = AllocatorConfig::parse(config);
        return SizeRules{cfg}.segment_size(rounded);
      }, py::arg("rounded"), py::arg("config") = "");

  m.def("bench_alloc", [](std::size_t pairs, std::uint64_t seed, int repeats) {
        std::vector<BenchCase> cases;
        {
          py::gil_scoped_release release;
          cases = run_alloc_benchmarks(pairs, seed, repeats);
        }
        py::list out;
        for (const BenchCase& c : cases) {
          py::dict d;
          d["name"] = c.name;
          d["policy"] = c.policy;
          d["ns_per_pair"] = c.ns_per_pair;
          d["pairs"] = c.pairs;
          d["free_blocks"] = c.free_blocks;
          d["min_ns"] = c.min_ns;
          d["max_ns"] = c.max_ns;
          d["repeats"] = c.repeats;
          py::dict served;
          for (const auto& [k, v] : c.served) served[py::str(k)] = v;
          d["served"] = served;
          out.append(d);
        }
        return out;
      }, py::arg("pairs") = 200000, py::arg("seed") = 1, py::arg("repeats") = 5);

  m.def("search_offsets", [](const std::vector<std::int64_t>& lower, const std::vector<std::int64_t>& upper,
                             const std::vector<std::int64_t>& size, std::int64_t capacity, double seconds,
                             const std::string& strategy) {
        if (lower.size() != upper.size() || lower.size() != size.size())
          throw py::value_error("lower, upper and size must have the same length");
        planner::SearchStrategy which;
        if (strategy == "both") which = planner::SearchStrategy::kBoth;
        else if (strategy == "spot") which = planner::SearchStrategy::kSpot;
        else if (strategy == "buffer") which = planner::SearchStrategy::kBuffer;
        else throw py::value_error("unknown strategy '" + strategy + "': use 'both', 'spot' or 'buffer'");
        std::vector<planner::PackBuffer> bufs(lower.size());
        for (std::size_t i = 0; i < bufs.size(); ++i) bufs[i] = {lower[i], upper[i], size[i]};
        planner::SearchResult r;
        {
          py::gil_scoped_release release;
          r = planner::search_offsets(bufs, capacity, seconds, which);
        }
        const char* status = r.status == planner::SearchStatus::kFound        ? "found"
                             : r.status == planner::SearchStatus::kInfeasible ? "infeasible"
                                                                              : "timeout";
        return py::make_tuple(status, r.offsets, r.nodes);
      }, py::arg("lower"), py::arg("upper"), py::arg("size"), py::arg("capacity"), py::arg("seconds"),
      py::arg("strategy") = "both",
      "Complete search for offsets within `capacity` (see csrc/planner/offset_search.h): the spot "
      "and the buffer search side by side ('both'), or one alone ('spot', 'buffer'). "
      "Returns (status, offsets, nodes): status is 'found', 'infeasible' (proven) or 'timeout'.");
}
