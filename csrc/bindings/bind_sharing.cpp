// waterwave._C.PassBoundary: a waterwave.sharing member's forward pre-hook on
// its model, where each pass begins (waterwave/exec/sharing.py, Member).
//
// Why in C++: a small model's step is short (a digits MLP's about 250 µs on
// the CPU), its pass boundary runs at every step, and after a step's torch
// work each line of Python costs several times what it costs warm. The
// common case, a steady pass (one region, no gate inside, the same
// signature and size) that ended with nothing to learn, is taken here: read
// the member's account, check the prediction, ask the same at its gate. It
// is sharing.py's steady path under Member._single_region_ended's rule
// (exactly as predicted; or within it, fewer than `recent` such passes in a
// row); every other case is the member's own Python (Member._pass_begins),
// called with what was read here. The member's state
// stays in its Python attributes, read and written here by name.
//
// May include: bindings.h, runtime/.
#include <Python.h>

#include <cstdint>
#include <utility>

#include "../runtime/thread_accounts.h"
#include "bindings.h"

namespace waterwave::bindings {

namespace {

// The attribute names the hook reads and writes, interned once and kept for
// the process's life (used until exit).
enum Attr {
  kDepth, kRootReturn, kPasses, kCarriedPeak, kMost, kSteady, kRecorder, kAfterStep,
  kRegions, kStart, kLevel, kTraining, kNumel, kAsPredicted, kAttrs
};
constexpr const char* kAttrNames[kAttrs] = {
    "_depth", "_root_return", "passes", "_carried_peak", "most", "_steady", "_recorder",
    "_after_step", "regions", "start", "_level", "training", "numel", "_as_predicted"};

py::handle name(Attr a) {
  static PyObject** const interned = [] {
    auto** names = new PyObject*[kAttrs];
    for (int i = 0; i < kAttrs; ++i) names[i] = PyUnicode_InternFromString(kAttrNames[i]);
    return names;
  }();
  return interned[a];
}

std::int64_t as_int(const py::handle& h) { return h.cast<std::int64_t>(); }

class PassBoundary {
 public:
  PassBoundary(py::object member, ThreadAccounts& ledger, std::int64_t account,
               unsigned long thread, py::object root, bool gating, bool on_cuda,
               py::object grad_enabled, py::object tensor_type, py::object elements,
               std::int64_t recent)
      : member_(std::move(member)), ledger_(ledger), account_(account), thread_(thread),
        root_(std::move(root)), gating_(gating), on_cuda_(on_cuda),
        grad_enabled_(std::move(grad_enabled)), tensor_type_(std::move(tensor_type)),
        elements_(std::move(elements)), recent_(recent) {}

  // The model's forward pre-hook (with_kwargs): (module, args, kwargs) -> None.
  void call(const py::handle& module, const py::tuple& args, const py::dict& kwargs) {
    // Another thread's call, or a copy of the model made inside the block,
    // which carries the hook (copy.deepcopy keeps it): not this member's pass.
    if (module.ptr() != root_.ptr() || PyThread_get_thread_ident() != thread_) return;
    // The model called from its own forward is one pass, where the forward
    // hook counts the depth; where it is not placed, every call starts one.
    const std::int64_t depth = as_int(member_.attr(name(kDepth))) + 1;
    member_.attr(name(kDepth)) = py::int_(depth);
    if (depth == 1) begins(args, kwargs);
    if (member_.attr(name(kRootReturn)).is_none()) member_.attr(name(kDepth)) = py::int_(0);
  }

 private:
  void begins(const py::tuple& args, const py::dict& kwargs) {
    member_.attr(name(kPasses)) = py::int_(as_int(member_.attr(name(kPasses))) + 1);
    // The account's bytes live and most since the last read (Member._read).
    const AccountUsage u = ledger_.take_peak(account_);
    const std::size_t live = u.allocated;
    std::size_t peak = u.peak;
    const std::int64_t carried = as_int(member_.attr(name(kCarriedPeak)));
    if (carried != 0) {
      peak = std::max(peak, static_cast<std::size_t>(carried));
      member_.attr(name(kCarriedPeak)) = py::int_(0);
    }
    if (static_cast<std::int64_t>(peak) > as_int(member_.attr(name(kMost)))) {
      member_.attr(name(kMost)) = py::int_(peak);
    }
    if (!gating_) {  // counted only; Ctrl-C still stops it here
      member_.attr("_wait")(0, 0, 0, true);
      return;
    }
    const bool grad = grad_enabled_().cast<bool>();
    const bool training = PyObject_IsTrue(root_.attr(name(kTraining)).ptr()) == 1;
    std::int64_t size;
    if (kwargs.empty() && args.size() == 1 &&
        Py_TYPE(args[0].ptr()) == reinterpret_cast<PyTypeObject*>(tensor_type_.ptr())) {
      size = as_int(args[0].attr(name(kNumel))());  // the usual call: one tensor
    } else {
      size = as_int(elements_(args)) + (kwargs.empty() ? 0 : as_int(elements_(kwargs)));
    }
    if (steady_nothing_learned(grad, training, size, live, peak)) return;
    member_.attr("_pass_begins")(py::make_tuple(grad, training), size, live, peak);
  }

  // The steady path where the pass ending taught nothing: exactly as
  // predicted (its rise and its net change the prediction's), or within
  // the prediction with fewer than `recent` such passes in a row (every
  // recent-th is learned, so that a first pass's one-time costs age out).
  // The next pass asks what this one asked. False where the member's
  // Python decides.
  bool steady_nothing_learned(bool grad, bool training, std::int64_t size, std::size_t live,
                      std::size_t peak) {
    const py::object steady = member_.attr(name(kSteady));
    if (steady.is_none()) return false;
    const py::tuple s = steady.cast<py::tuple>();  // _Steady(signature, size, rise, net, rest)
    const py::tuple signature = s[0].cast<py::tuple>();
    if (signature.size() != 2 || PyObject_IsTrue(signature[0].ptr()) != grad ||
        PyObject_IsTrue(signature[1].ptr()) != training || as_int(s[1]) != size) {
      return false;
    }
    const py::object recorder = member_.attr(name(kRecorder));
    if (recorder.is_none() || py::len(recorder.attr(name(kRegions))) != 0) return false;
    const std::int64_t start = as_int(recorder.attr(name(kStart)));
    const std::int64_t after = as_int(member_.attr(name(kAfterStep)));
    const std::int64_t rise = as_int(s[2]), net = as_int(s[3]), rest = as_int(s[4]);
    const std::int64_t risen = std::max<std::int64_t>(0, static_cast<std::int64_t>(peak) - start);
    const std::int64_t ended = std::max<std::int64_t>(static_cast<std::int64_t>(live), after) -
                               start;
    if (risen != rise || ended != net) {
      if (risen > rise || ended > net) return false;
      const std::int64_t in_a_row = as_int(member_.attr(name(kAsPredicted))) + 1;
      if (in_a_row >= recent_) return false;  // learned: the Python's case
      member_.attr(name(kAsPredicted)) = py::int_(in_a_row);
    }
    if (on_cuda_) member_.attr("session").attr("probe_sharing_budget")();
    const std::int64_t end = static_cast<std::int64_t>(live) + net;
    const GateRequest request{static_cast<std::size_t>(rise),
                              static_cast<std::size_t>(std::max<std::int64_t>(0, rest)),
                              static_cast<std::size_t>(std::max<std::int64_t>(0, end)), true};
    if (ledger_.gate(account_, request, 0) != GateResult::kAdmitted) {
      member_.attr("_wait")(rise, rest, end, true);  // it waits: Python's loop, the GIL given up
    }
    recorder.attr(name(kStart)) = py::int_(live);  // PassRecorder.restart(live)
    recorder.attr(name(kLevel)) = py::int_(live);
    member_.attr(name(kAfterStep)) = py::int_(0);
    return true;
  }

  py::object member_;
  ThreadAccounts& ledger_;
  std::int64_t account_;
  unsigned long thread_;
  py::object root_;
  bool gating_, on_cuda_;
  py::object grad_enabled_, tensor_type_, elements_;
  std::int64_t recent_;
};

}  // namespace

void bind_sharing(py::module_& m) {
  py::class_<PassBoundary>(m, "PassBoundary",
                           "A sharing member's forward pre-hook on its model, where each pass "
                           "begins (waterwave/exec/sharing.py).")
      .def(py::init<py::object, ThreadAccounts&, std::int64_t, unsigned long, py::object, bool,
                    bool, py::object, py::object, py::object, std::int64_t>(),
           py::arg("member"), py::arg("ledger"), py::arg("account"), py::arg("thread"),
           py::arg("root"), py::arg("gating"), py::arg("on_cuda"), py::arg("grad_enabled"),
           py::arg("tensor_type"), py::arg("elements"), py::arg("recent"),
           py::keep_alive<1, 3>())
      .def("__call__", &PassBoundary::call, py::arg("module"), py::arg("args"),
           py::arg("kwargs"))
      // A model copied inside its block (a best-so-far snapshot) keeps the
      // hook as it is, as a Python function hook would be kept.
      .def("__copy__", [](const py::object& self) { return self; })
      .def("__deepcopy__", [](const py::object& self, const py::object&) { return self; },
           py::arg("memo"));
}

}  // namespace waterwave::bindings
