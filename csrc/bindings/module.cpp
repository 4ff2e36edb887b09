// waterwave._C: the module, its exceptions, and the layers bound in turn.
#include "../runtime/sigint_relay.h"
#include "bindings.h"

namespace waterwave::bindings {

void bind_errors(py::module_& m) {
  static py::exception<OutOfMemoryError> oom(m, "OutOfMemoryError", PyExc_MemoryError);
  static py::exception<PointerError> bad_ptr(m, "PointerError", PyExc_ValueError);
  static py::exception<ConfigError> bad_cfg(m, "ConfigError", PyExc_ValueError);
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
}

}  // namespace waterwave::bindings

PYBIND11_MODULE(_C, m) {
  using namespace waterwave::bindings;
  m.doc() = "Waterwave allocator stack, simulated GPU, CUDA runtime, planner search and benchmarks";
  bind_errors(m);
  bind_settings(m);
  bind_sim(m);
  bind_stack(m);
  bind_cuda(m);
  bind_accounts(m);
  bind_sharing(m);
  bind_planner(m);
  bind_bench(m);
  // Ctrl-C for threads that train off the main thread (waterwave/exec/ctrl_c.py).
  m.def("relay_sigint", &waterwave::relay_sigint, py::arg("write_fd"),
        "Put a C-level SIGINT relay in front of the process's handler: each SIGINT writes a "
        "byte to write_fd, then reaches the previous handler; where one is in place, only "
        "write_fd changes. False where there is no handler to relay to.");
  m.def("detach_sigint_relay", &waterwave::detach_sigint_relay,
        "The relay writes nowhere from now on (a forked child, before closing its pipe).");
  m.def("sigints_relayed", &waterwave::sigints_relayed, "SIGINTs the relay has seen.");
}
