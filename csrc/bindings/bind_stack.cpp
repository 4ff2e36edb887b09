// waterwave._C.AllocatorStack: the one Python face of the allocator stack
// (alloc/stack.h). A simulator's allocator (over a SimDevice) and the CUDA
// runtime's stack of one device (runtime/cuda_runtime.h) are both instances;
// waterwave.Allocator subclasses it in Python, and waterwave.cuda's
// torch-named functions call the device's instance.
#include <memory>
#include <optional>

#include "../device/sim/sim_device.h"
#include "../runtime/cuda_runtime.h"
#include "bindings.h"

namespace waterwave::bindings {
namespace {

using cuda::CudaRuntime;
using namespace pybind11::literals;
using OptStream = std::optional<StreamId>;
using Slots = std::vector<std::pair<std::size_t, std::size_t>>;

// An allocator stack that owns its simulated device's share: the device
// outlives the stack, which holds a reference to it.
struct SimOwned {
  SimOwned(std::shared_ptr<SimDevice> d, PolicyKind policy, const AllocatorConfig& config)
      : device(std::move(d)), stack(*device, policy, config) {}
  std::shared_ptr<SimDevice> device;
  AllocatorStack stack;
};

class BoundStack {
 public:
  // Over a simulated GPU: a stack of its own, every hand-out reported to the
  // device's hazard detector.
  BoundStack(std::shared_ptr<SimDevice> device, PolicyKind policy, const AllocatorConfig& config)
      : sim_(device) {
    auto owned = std::make_shared<SimOwned>(std::move(device), policy, config);
    stack_ = std::shared_ptr<AllocatorStack>(owned, &owned->stack);
  }
  // Over a CUDA device: the runtime's stack, the one PyTorch's hooks reach.
  explicit BoundStack(int cuda_device)
      : stack_(CudaRuntime::get().shared_stack(cuda_device)), cuda_device_(cuda_device) {}

  AllocatorStack& stack() { return *stack_; }
  Addr allocate(std::size_t nbytes, StreamId stream) {
    const Addr p = stack_->allocate(nbytes, stream);
    if (p && sim_) sim_->note_handout(p, stack_->allocation_size(p), stream);
    return p;
  }
  std::uint64_t launch(StreamId stream, double duration_us, const std::vector<Addr>& uses,
                       double sm_share, double bw_share) {
    std::vector<Range> ranges;
    ranges.reserve(uses.size());
    for (Addr p : uses) ranges.push_back({p, stack_->allocation_size(p)});
    return simulated("launch").launch(stream, duration_us, ranges, sm_share, bw_share);
  }
  SimDevice& simulated(const char* what) {
    if (!sim_) {
      throw ConfigError(std::string(what) + " needs a simulated device; this allocator serves "
                        "CUDA device " + std::to_string(cuda_device_));
    }
    return *sim_;
  }
  py::object device() const {
    if (sim_) return py::cast(sim_);
    return py::none();
  }
  std::optional<int> cuda_device() const {
    if (cuda_device_ < 0) return std::nullopt;
    return cuda_device_;
  }

 private:
  std::shared_ptr<AllocatorStack> stack_;
  std::shared_ptr<SimDevice> sim_;  // null over CUDA
  int cuda_device_ = -1;
};

}  // namespace

void bind_stack(py::module_& m) {
  const auto release_gil = py::call_guard<py::gil_scoped_release>();
  py::class_<BoundStack>(m, "AllocatorStack",
      "An allocator stack: an online policy over a device, and per stream at most one plan or "
      "recording over it. Made over a SimDevice, or for a CUDA device (cuda_device=N: the stack "
      "PyTorch's hooks use).")
      .def(py::init([](std::shared_ptr<SimDevice> device, const std::string& policy,
                       const AllocatorConfig& config) {
             return BoundStack(std::move(device), parse_policy(policy), config);
           }), py::arg("device"), py::arg("policy") = "waterwave", py::arg("config") = AllocatorConfig())
      .def(py::init([](int cuda_device) { return BoundStack(cuda_device); }), py::kw_only(),
           py::arg("cuda_device"))
      // The allocation path.
      .def("alloc", &BoundStack::allocate, py::arg("nbytes"), py::arg("stream") = 0, release_gil)
      .def("free", [](BoundStack& a, Addr p) { a.stack().deallocate(p); }, py::arg("ptr"), release_gil)
      .def("_allocate_at",
           [](BoundStack& a, Addr p, std::size_t size, std::size_t requested) {
             return a.stack().online().allocate_at(p, size, requested);
           },
           py::arg("ptr"), py::arg("size"), py::arg("requested"), release_gil,
           "Hand out exactly [ptr, ptr + size) again (a private pool restored to a "
           "checkpoint; the pytorch policy only).")
      .def("record_stream", [](BoundStack& a, Addr p, StreamId s) { a.stack().record_stream(p, s); },
           py::arg("ptr"), py::arg("stream"), release_gil)
      .def("allocation_size", [](BoundStack& a, Addr p) { return a.stack().allocation_size(p); },
           py::arg("ptr"))
      // The whole stack.
      .def("sync_and_coalesce", [](BoundStack& a) { a.stack().sync_and_coalesce(); }, release_gil)
      .def("empty_cache", [](BoundStack& a) { a.stack().empty_cache(); }, release_gil)
      .def("stats", [](BoundStack& a) { return stats_dict(a.stack().stats(), a.stack().online().kind()); })
      .def("reset_peak_memory_stats", [](BoundStack& a) { a.stack().reset_peak_stats(); })
      .def("reset_accumulated_memory_stats",
           [](BoundStack& a) { a.stack().reset_accumulated_stats(); })
      .def("set_per_process_memory_fraction",
           [](BoundStack& a, double fraction) { a.stack().set_memory_fraction(fraction); },
           py::arg("fraction"),
           "From now on, keep reserved memory within this share of the device (0, 1].")
      .def("get_per_process_memory_fraction",
           [](BoundStack& a) { return a.stack().memory_fraction(); })
      .def("set_max_split_size",
           [](BoundStack& a, std::int64_t bytes) {
             if (bytes < -1) throw ConfigError("max_split_size: give bytes, or -1 for no limit");
             a.stack().set_max_split_size(bytes < 0 ? SIZE_MAX : static_cast<std::size_t>(bytes));
           },
           py::arg("bytes"),
           "From now on blocks of at least `bytes` are never split (PyTorch's "
           "max_split_size_mb, changed at run time); -1: no limit. Blocks split before stay "
           "split.")
      .def("max_split_size_chosen", [](BoundStack& a) { return a.stack().max_split_size_chosen(); },
           "Whether a max_split_size was chosen, in the config or by set_max_split_size.")
      .def("set_own_segments_first",
           [](BoundStack& a, bool on) { a.stack().set_own_segments_first(on); }, py::arg("on"),
           "From now on, under the waterwave policy, a stream takes other streams' free "
           "large-pool memory only once the device is out (own_segments_first). ConfigError "
           "with expandable segments.")
      .def("hold_own_segments_first", [](BoundStack& a) { return a.stack().hold_own_segments_first(); },
           "A captured session's run: own_segments_first on while it trains, unless chosen or "
           "with expandable segments; returns whether it is on.")
      .def("release_own_segments_first",
           [](BoundStack& a) { a.stack().release_own_segments_first(); },
           "The run ended: the last of overlapping runs turns the setting off again, unless "
           "it was chosen meanwhile.")
      .def("own_segments_first_chosen",
           [](BoundStack& a) { return a.stack().own_segments_first_chosen(); },
           "Whether own_segments_first was chosen, in the config or by set_own_segments_first.")
      .def("check_invariants", [](BoundStack& a) { a.stack().check_invariants(); })
      .def("snapshot", [](BoundStack& a) { return segments_list(a.stack().snapshot()); },
           "Segments and their blocks, in address order.")
      .def("_record_history",
           [](BoundStack& a, bool enabled, std::size_t max_entries) {
             a.stack().online().record_history(enabled, max_entries);
           },
           py::arg("enabled"), py::arg("max_entries"))
      .def("history", [](BoundStack& a) { return history_list(a.stack().online().history()); })
      .def("mem_get_info", [](BoundStack& a) {
             Device& d = a.stack().device();
             return std::make_pair(d.free_memory(), d.total_memory());
           }, "(free, total) bytes of the device, as its driver reports them.")
      .def_property_readonly("policy", [](BoundStack& a) { return a.stack().online().policy(); })
      .def_property_readonly("config", [](BoundStack& a) { return a.stack().online().config(); })
      .def_property_readonly("device", &BoundStack::device, "The SimDevice; None over CUDA.")
      .def_property_readonly("cuda_device", &BoundStack::cuda_device,
                             "The CUDA device index; None over a SimDevice.")
      // The simulated GPU.
      .def("launch", &BoundStack::launch, py::arg("stream"), py::arg("duration_us"),
           py::arg("uses") = std::vector<Addr>{}, py::arg("sm_share") = 1.0, py::arg("bw_share") = 1.0)
      // Plans and recordings, per stream: stream None names the one there is.
      .def("_set_plan",
           [](BoundStack& a, StreamId stream, const Slots& slots, std::size_t arena,
              const std::string& scope, bool give_back_cache) {
             a.stack().set_plan(stream, to_slots(slots), arena, parse_scope(scope), give_back_cache);
           },
           py::arg("stream"), py::arg("slots"), py::arg("arena"), py::arg("scope"),
           py::arg("give_back_cache"), release_gil)
      .def("clear_plan", [](BoundStack& a, OptStream s) { a.stack().clear_plan(s); },
           py::arg("stream") = py::none(), release_gil,
           "Remove the stream's plan (every plan, by default); refused while its blocks live.")
      .def("has_plan", [](BoundStack& a, OptStream s) { return a.stack().has_plan(s); },
           py::arg("stream") = py::none())
      .def("begin_step", [](BoundStack& a, OptStream s) { a.stack().begin_step(s); },
           py::arg("stream") = py::none(),
           "The next allocation on the stream is its plan's first (stream may be left out "
           "when one stream has a plan).")
      .def("plan_stats", [](BoundStack& a, OptStream s) { return plan_stats_dict(a.stack().plan_stats(s)); },
           py::arg("stream") = py::none(),
           "Planned and fallback allocations, deviations and why the last one happened.")
      .def("start_recording", [](BoundStack& a, StreamId s) { a.stack().start_recording(s); },
           py::arg("stream"),
           "Record the stream's allocations until stop_recording (its plan's blocks must be free).")
      .def("stop_recording", [](BoundStack& a, OptStream s) {
             py::list out;
             for (const TracedBlock& b : a.stack().stop_recording(s))
               out.append(py::make_tuple(b.size, b.allocated, b.freed));
             return out;
           },
           py::arg("stream") = py::none(),
           "The recorded blocks in allocation order: (size, allocated, freed or -1), times "
           "counted in allocations and frees.");
}

}  // namespace waterwave::bindings
