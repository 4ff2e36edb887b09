// Thread accounts and their shared budget (csrc/runtime/thread_accounts.h),
// bound once as waterwave._C.ThreadAccounts: the CUDA runtime's ledger
// (cuda_accounts()), the CPU's (cpu_accounts()), or a ledger of its own
// (ThreadAccounts(), whose allocations are told to it: allocate/free).
#include <cstdint>
#include <utility>

#include "../core/errors.h"
#include "../runtime/cpu_accounts.h"
#include "../runtime/cuda_runtime.h"
#include "bindings.h"

namespace waterwave::bindings {

namespace {

// The allocation path's waits give up the GIL when the waiting thread holds
// it (a CPU tensor made with the GIL held), so that others can free.
void* release_gil_if_held() { return PyGILState_Check() ? PyEval_SaveThread() : nullptr; }
void acquire_gil(void* state) { PyEval_RestoreThread(static_cast<PyThreadState*>(state)); }

// A gate that admits at once is a short lock: it keeps the GIL, since giving
// it up hands it to another thread for up to its switch interval (5 ms),
// longer than a small model's whole step. Only a gate that must wait gives
// it up (the waits never take the GIL while holding the ledger's lock).
int gate_holding_the_gil_if_it_admits(ThreadAccounts& a, std::int64_t id,
                                      const GateRequest& request, long timeout_ms) {
  const GateResult at_once = a.gate(id, request, 0);
  if (at_once != GateResult::kTimedOut || timeout_ms == 0) return static_cast<int>(at_once);
  py::gil_scoped_release released;
  return static_cast<int>(a.gate(id, request, timeout_ms));
}

std::size_t rise_or_unknown(const py::object& rise) {
  return rise.is_none() ? kUnknownRise : rise.cast<std::size_t>();
}

// share_stats()'s fields by name, each named once: the bytes, then the counts.
using Share = ShareStats;
constexpr std::pair<const char*, std::size_t Share::*> kShareBytes[] = {
    {"budget", &Share::budget}, {"outside", &Share::outside},
    {"members_live", &Share::members_live}, {"peak", &Share::peak}, {"held", &Share::held},
    {"active", &Share::active}, {"waiting", &Share::waiting}};
constexpr std::pair<const char*, long long Share::*> kShareCounts[] = {
    {"gate_waits", &Share::gate_waits}, {"allocation_waits", &Share::allocation_waits},
    {"overshoots", &Share::overshoots}, {"forced", &Share::forced}, {"failed", &Share::failed},
    {"overdrawn", &Share::overdrawn}, {"device_waits", &Share::device_waits}};

}  // namespace

void bind_accounts(py::module_& m) {
  ThreadAccounts::set_wait_hooks(&release_gil_if_held, &acquire_gil);
  const auto release_gil = py::call_guard<py::gil_scoped_release>();
  py::class_<ThreadAccounts>(m, "ThreadAccounts",
                             "Accounts of what tagged threads allocate, and the budget that "
                             "waterwave.sharing's members share (thread_accounts.h).")
      .def(py::init<>())
      .def("open", &ThreadAccounts::open, "A new account's id.")
      .def("close", &ThreadAccounts::close, py::arg("id"))
      .def_static("set_thread", &ThreadAccounts::set_thread, py::arg("id"),
                  "Tag the calling thread (0: none); returns its previous tag.")
      .def_static("thread_account", &ThreadAccounts::thread_account)
      .def("usage", [](ThreadAccounts& a, std::int64_t id) {
        const AccountUsage u = a.usage(id);
        return std::make_pair(u.allocated, u.peak);
      }, py::arg("id"), "(bytes live, most bytes live since the last reset_peak) of an account.")
      .def("reset_peak", &ThreadAccounts::reset_peak, py::arg("id"))
      .def("take_peak", [](ThreadAccounts& a, std::int64_t id) {
        const AccountUsage u = a.take_peak(id);
        return std::make_pair(u.allocated, u.peak);
      }, py::arg("id"), "usage(), and the peak reset to the bytes live now, at once.")
      .def("set_stream_account", &ThreadAccounts::set_stream_account, py::arg("stream"),
           py::arg("id"), "Untagged threads' allocations on `stream` count to account `id` "
           "(0: to none); they never wait.")
      .def("set_budget", &ThreadAccounts::set_budget, py::arg("budget"), py::arg("outside") = 0,
           py::arg("measured") = false,
           "measured: the budget estimates the device's room (no memory_limit): a tie lets "
           "an allocation waiting for it go on to the device rather than fail.")
      .def("join", &ThreadAccounts::join, py::arg("id"), py::arg("base") = 0)
      .def("leave", &ThreadAccounts::leave, py::arg("id"))
      .def("gate", [](ThreadAccounts& a, std::int64_t id, const py::object& rise, std::size_t rest,
                      std::size_t end, bool boundary, long timeout_ms,
                      const py::object& relooks_seen, std::size_t least) {
        GateRequest request{rise_or_unknown(rise), rest, end, boundary};
        if (!relooks_seen.is_none()) request.relooks_seen = relooks_seen.cast<std::uint64_t>();
        request.least = least;
        return gate_holding_the_gil_if_it_admits(a, id, request, timeout_ms);
      }, py::arg("id"), py::arg("rise"), py::arg("rest"), py::arg("end"), py::arg("boundary"),
         py::arg("timeout_ms"), py::arg("relooks_seen") = py::none(), py::arg("least") = 0,
         "0: admitted; 1: timed out (still waiting: call again); 2: interrupted. rise None: "
         "no prediction, the pass runs alone; then a relook() after `relooks_seen` (relooks(), "
         "read before choosing the ask; None: by its arrival) returns it at once. `least`: the "
         "room it is admitted with at least, alone or not (a first pass of a measured kind).")
      .def("relooks", &ThreadAccounts::relooks, "relook() calls so far.")
      .def("read_and_gate", [](ThreadAccounts& a, std::int64_t id, const py::object& rise,
                               std::size_t rest, long long net, bool boundary, long timeout_ms) {
        // A member's point in one call: its bytes read (and its peak reset),
        // then its gate, the pass predicted to end at live + net.
        const AccountUsage u = a.take_peak(id);
        const long long end = static_cast<long long>(u.allocated) + net;
        const GateRequest request{rise_or_unknown(rise), rest,
                                  end > 0 ? static_cast<std::size_t>(end) : 0, boundary};
        const int result = gate_holding_the_gil_if_it_admits(a, id, request, timeout_ms);
        return py::make_tuple(result, u.allocated, u.peak);
      }, py::arg("id"), py::arg("rise"), py::arg("rest"), py::arg("net"), py::arg("boundary"),
         py::arg("timeout_ms"),
         "take_peak() then gate(): (gate's result, bytes live, most since the last read).")
      .def("interrupt", &ThreadAccounts::interrupt, release_gil)
      .def("share_stats", [](ThreadAccounts& a) {
        const ShareStats s = a.share_stats();
        py::dict d;
        for (const auto& [name, field] : kShareBytes) d[name] = s.*field;
        for (const auto& [name, field] : kShareCounts) d[name] = s.*field;
        d["measured"] = s.measured;
        return d;
      })
      .def("reset_share_peak", &ThreadAccounts::reset_share_peak)
      .def("room_beside_live", &ThreadAccounts::room_beside_live, py::arg("id"),
           "The budget less what every member holds live (regions in flight left out).")
      .def("relook", &ThreadAccounts::relook,
           "Gates waiting to run a pass alone return 1 (timed out) now, to ask again.")
      // A ledger of its own is told its allocations (the simulated members
      // of tests): the calling thread's, as the allocation path would.
      .def("allocate", [](ThreadAccounts& a, Addr ptr, std::size_t bytes) {
        bool ok;
        {
          py::gil_scoped_release released;
          ok = a.before_allocate(bytes);
        }
        if (!ok) throw OutOfMemoryError(ThreadAccounts::why());
        a.allocated(ptr, [bytes] { return bytes; });
      }, py::arg("ptr"), py::arg("bytes"))
      .def("wait_for_frees", [](ThreadAccounts& a, std::size_t bytes) {
        bool retry;
        {
          py::gil_scoped_release released;
          retry = a.wait_for_frees(bytes);
        }
        return py::make_tuple(retry, ThreadAccounts::why());
      }, py::arg("bytes"),
         "As the allocation path after the device ran out for `bytes`: (try again, why not).")
      .def("done_waiting", &ThreadAccounts::done_waiting)
      .def("free", [](ThreadAccounts& a, Addr ptr) { a.freed(ptr); }, py::arg("ptr"))
      .def("count", &ThreadAccounts::count, py::arg("id"), py::arg("ptr"), py::arg("bytes"),
           "An allocation of account `id`'s, told by its owner (the simulator): counted, "
           "never waits.");
  m.def("cpu_accounts", &cpu_accounts, py::return_value_policy::reference,
        "The CPU's ledger (what PyTorch's CPU allocator gives tagged threads, once "
        "waterwave's CPU allocator is installed).");
  m.def("cuda_accounts", []() -> ThreadAccounts& { return cuda::CudaRuntime::get().accounts(); },
        py::return_value_policy::reference, "The CUDA runtime's ledger.");
}

}  // namespace waterwave::bindings
