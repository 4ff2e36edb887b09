// The allocator micro-benchmarks (csrc/bench), for `waterwave bench alloc`.
#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include "../bench/alloc_bench.h"
#include "bindings.h"

namespace waterwave::bindings {

using namespace pybind11::literals;

void bind_bench(py::module_& m) {
  m.def("bench_alloc", [](std::size_t pairs, std::uint64_t seed, int repeats) {
        // The benchmark runs on a thread of its own while this one waits
        // without the GIL and, every 50 ms, lets Python see its signals:
        // Ctrl-C stops the benchmark at its next check (KeyboardInterrupt
        // here), where it would otherwise wait for every case to end.
        std::atomic<bool> stop{false};
        std::packaged_task<std::vector<BenchCase>()> task(
            [&] { return run_alloc_benchmarks(pairs, seed, repeats, &stop); });
        std::future<std::vector<BenchCase>> done = task.get_future();
        std::thread worker(std::move(task));
        bool interrupted = false;
        for (;;) {
          {
            py::gil_scoped_release release;
            if (done.wait_for(std::chrono::milliseconds(50)) == std::future_status::ready) break;
          }
          if (PyErr_CheckSignals() != 0) {
            stop = true;
            interrupted = true;
            break;
          }
        }
        {
          py::gil_scoped_release release;
          worker.join();
        }
        if (interrupted) {
          try {
            done.get();
          } catch (...) {  // stopped (BenchStopped): the interrupt is what to report
          }
          throw py::error_already_set();
        }
        std::vector<BenchCase> cases = done.get();
        py::list out;
        for (const BenchCase& c : cases) {
          out.append(py::dict("name"_a = c.name, "policy"_a = c.policy,
                              "ns_per_pair"_a = c.ns_per_pair, "pairs"_a = c.pairs,
                              "free_blocks"_a = c.free_blocks, "min_ns"_a = c.min_ns,
                              "max_ns"_a = c.max_ns, "repeats"_a = c.repeats,
                              "served"_a = c.served));
        }
        return out;
      }, py::arg("pairs") = 200000, py::arg("seed") = 1, py::arg("repeats") = 5);

}

}  // namespace waterwave::bindings
