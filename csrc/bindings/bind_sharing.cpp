// waterwave._C.PassBoundary: a waterwave.sharing member's pass boundary, where
// each pass begins: its model's forward pre-hook, or called by the block's
// caller before each call of the model (job.train's steps)
// (waterwave/exec/sharing.py, Member).
//
// Why in C++: a small model's step is short (a digits MLP's 250-450 µs on
// the CPU), its pass boundary runs at every step, and after a step's torch
// work every object the boundary touches is out of the caches: each costs a
// miss, and what it evicts the step's next operators miss in turn. The
// common case, a steady pass (one region, no gate inside, the same
// signature and size) that ended with nothing to learn, is taken here: read
// the member's account, check the prediction, ask the same at its gate. It
// is sharing.py's steady path under Member._single_region_ended's rule
// (exactly as predicted; or within it, fewer than `recent` such passes in a
// row); every other case is the member's own Python (Member._pass_begins),
// called with what was read here.
//
// The numbers the steady path reads and writes are the member's *pass
// state*: one array of int64 (Python's array('q')), whose slots
// (PASS_STATE_SLOTS, in this order) the member's Python reads and writes by
// name and this hook by index. One source for both, in two cache lines: the
// hook touches no Python attribute on its common case. (Reading them as the
// member's attributes, the hook took 6.8 µs a call in situ; reading the pass
// state, 4.4 µs: 2026-12-02, 128x2 MLP on the CPU.)
//
// May include: bindings.h, runtime/.
#include <Python.h>

#include <cstdint>
#include <string>
#include <utility>

#include "../runtime/thread_accounts.h"
#include "bindings.h"

namespace waterwave::bindings {

namespace {

// The pass state's slots. Names as Python sees them, in this order.
enum Slot {
  kDepth,           // nested calls of the model in the running pass
  kPasses,          // passes begun
  kCarriedPeak,     // a peak read after an optimizer's step, for the next read
  kMost,            // the most the account held, as far as its points saw
  kAfterStep,       // the most held just after an optimizer's step in this pass
  kAsPredicted,     // single-region passes in a row within their prediction
  kRootReturn,      // 1 while the model's forward hook is placed (it counts the depth)
  kSteady,          // 1 while the running pass is a steady one (Member._steady)
  kSteadyGrad,      // its signature: gradients on
  kSteadyTraining,  //   and training mode
  kSteadySize,      // its size
  kSteadyRise,      // its prediction: the rise,
  kSteadyNet,       //   the net change,
  kSteadyRest,      //   and the rest, with slack
  kRecorderStart,   // the running pass's recorder: where it started
  kRecorderLevel,   //   and the level of its last point
  kSlots
};
constexpr const char* kSlotNames[kSlots] = {
    "depth", "passes", "carried_peak", "most", "after_step", "as_predicted", "root_return",
    "steady", "steady_grad", "steady_training", "steady_size", "steady_rise", "steady_net",
    "steady_rest", "recorder_start", "recorder_level"};

py::handle interned(const char* text) {
  return PyUnicode_InternFromString(text);  // kept for the process's life
}

class PassBoundary {
 public:
  PassBoundary(py::object member, py::buffer state, ThreadAccounts& ledger,
               std::int64_t account, unsigned long thread, py::object root, bool gating,
               bool on_cuda, py::object grad_enabled, py::object tensor_type,
               py::object elements, std::int64_t recent)
      : member_(std::move(member)), ledger_(ledger), account_(account), thread_(thread),
        root_(std::move(root)), gating_(gating), on_cuda_(on_cuda),
        grad_enabled_(std::move(grad_enabled)), tensor_type_(std::move(tensor_type)),
        elements_(std::move(elements)), recent_(recent) {
    state_ = state.request(/*writable=*/true);
    if (state_.ndim != 1 || state_.itemsize != sizeof(std::int64_t) ||
        state_.size != kSlots || (state_.format != "q" && state_.format != "l")) {
      throw py::value_error("a pass state is an array('q') of " + std::to_string(kSlots) +
                            " slots (PASS_STATE_SLOTS)");
    }
    s_ = static_cast<std::int64_t*>(state_.ptr);
  }

  // (module, args, kwargs) -> None: the model's forward pre-hook (with_kwargs),
  // or the block's caller before it calls the model.
  void call(const py::handle& module, const py::tuple& args, const py::dict& kwargs) {
    // Another thread's call, or a copy of the model made inside the block,
    // which carries the hook (copy.deepcopy keeps it): not this member's pass.
    if (module.ptr() != root_.ptr() || PyThread_get_thread_ident() != thread_) return;
    // The model called from its own forward is one pass, where the forward
    // hook counts the depth; where it is not placed, every call starts one.
    if (++s_[kDepth] == 1) begins(args, kwargs);
    if (s_[kRootReturn] == 0) s_[kDepth] = 0;
  }

 private:
  void begins(const py::tuple& args, const py::dict& kwargs) {
    ++s_[kPasses];
    // The account's bytes live and most since the last read (Member._read).
    const AccountUsage u = ledger_.take_peak(account_);
    const std::int64_t live = static_cast<std::int64_t>(u.allocated);
    std::int64_t peak = std::max(static_cast<std::int64_t>(u.peak), s_[kCarriedPeak]);
    s_[kCarriedPeak] = 0;
    s_[kMost] = std::max(s_[kMost], peak);
    if (!gating_) {  // counted only; Ctrl-C still stops it here
      member_.attr("_wait")(0, 0, 0, true);
      return;
    }
    const bool grad = PyObject_IsTrue(grad_enabled_().ptr()) == 1;
    static const py::handle training_name = interned("training");
    const bool training = PyObject_IsTrue(root_.attr(training_name).ptr()) == 1;
    std::int64_t size;
    if (kwargs.empty() && args.size() == 1 &&
        Py_TYPE(args[0].ptr()) == reinterpret_cast<PyTypeObject*>(tensor_type_.ptr())) {
      static const py::handle numel = interned("numel");
      PyObject* n = PyObject_CallMethodNoArgs(args[0].ptr(), numel.ptr());
      if (n == nullptr) throw py::error_already_set();
      size = py::reinterpret_steal<py::object>(n).cast<std::int64_t>();  // the usual call: one tensor
    } else {
      size = elements_(args).cast<std::int64_t>() +
             (kwargs.empty() ? 0 : elements_(kwargs).cast<std::int64_t>());
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
  bool steady_nothing_learned(bool grad, bool training, std::int64_t size, std::int64_t live,
                              std::int64_t peak) {
    std::int64_t* s = s_;
    if (s[kSteady] == 0 || (s[kSteadyGrad] != 0) != grad ||
        (s[kSteadyTraining] != 0) != training || s[kSteadySize] != size) {
      return false;
    }
    const std::int64_t start = s[kRecorderStart];
    const std::int64_t rise = s[kSteadyRise], net = s[kSteadyNet], rest = s[kSteadyRest];
    const std::int64_t risen = std::max<std::int64_t>(0, peak - start);
    const std::int64_t ended = std::max(live, s[kAfterStep]) - start;
    if (risen != rise || ended != net) {
      if (risen > rise || ended > net) return false;
      if (s[kAsPredicted] + 1 >= recent_) return false;  // learned: the Python's case
      ++s[kAsPredicted];
    }
    if (on_cuda_) member_.attr("session").attr("probe_sharing_budget")();
    const std::int64_t end = live + net;
    const GateRequest request{static_cast<std::size_t>(rise),
                              static_cast<std::size_t>(std::max<std::int64_t>(0, rest)),
                              static_cast<std::size_t>(std::max<std::int64_t>(0, end)), true};
    if (ledger_.gate(account_, request, 0) != GateResult::kAdmitted) {
      member_.attr("_wait")(rise, rest, end, true);  // it waits: Python's loop, the GIL given up
    }
    s[kRecorderStart] = s[kRecorderLevel] = live;  // PassRecorder.restart(live)
    s[kAfterStep] = 0;
    return true;
  }

  py::object member_;
  py::buffer_info state_;
  std::int64_t* s_ = nullptr;
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
  py::tuple slots(static_cast<std::size_t>(kSlots));
  for (int i = 0; i < kSlots; ++i) slots[i] = py::str(kSlotNames[i]);
  m.attr("PASS_STATE_SLOTS") = slots;
  py::class_<PassBoundary>(m, "PassBoundary",
                           "A sharing member's pass boundary, where each pass begins "
                           "(waterwave/exec/sharing.py): its model's forward pre-hook, or "
                           "called before each call of the model.")
      .def(py::init<py::object, py::buffer, ThreadAccounts&, std::int64_t, unsigned long,
                    py::object, bool, bool, py::object, py::object, py::object,
                    std::int64_t>(),
           py::arg("member"), py::arg("state"), py::arg("ledger"), py::arg("account"),
           py::arg("thread"), py::arg("root"), py::arg("gating"), py::arg("on_cuda"),
           py::arg("grad_enabled"), py::arg("tensor_type"), py::arg("elements"),
           py::arg("recent"), py::keep_alive<1, 4>())
      .def("__call__", &PassBoundary::call, py::arg("module"), py::arg("args"),
           py::arg("kwargs"))
      // A model copied inside its block (a best-so-far snapshot) keeps the
      // hook as it is, as a Python function hook would be kept.
      .def("__copy__", [](const py::object& self) { return self; })
      .def("__deepcopy__", [](const py::object& self, const py::object&) { return self; },
           py::arg("memo"));
}

}  // namespace waterwave::bindings
