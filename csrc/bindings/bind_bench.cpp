// The benchmarks (csrc/bench), for `waterwave bench alloc` and `waterwave
// bench step`.
#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include "../bench/alloc_bench.h"
#include "../bench/step_bench.h"
#include "../device/cuda/cuda_device.h"
#include "../device/sim/sim_device.h"
#include "bindings.h"

namespace waterwave::bindings {

using namespace pybind11::literals;

namespace {

// Runs `work(stop)` on a thread of its own while this one waits without the
// GIL and, every 50 ms, lets Python see its signals: Ctrl-C stops the
// benchmark at its next check (KeyboardInterrupt here), where it would
// otherwise wait for every case to end.
template <typename Result, typename Work>
Result run_interruptibly(Work work) {
  std::atomic<bool> stop{false};
  std::packaged_task<Result()> task([&] { return work(&stop); });
  std::future<Result> done = task.get_future();
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
  return done.get();
}

std::vector<StepOp> step_ops(const py::list& ops) {
  std::vector<StepOp> out;
  out.reserve(ops.size());
  for (const py::handle& h : ops) {
    auto t = h.cast<std::tuple<bool, std::uint32_t, std::size_t, StreamId>>();
    out.push_back({std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t)});
  }
  return out;
}

}  // namespace

void bind_bench(py::module_& m) {
  m.def("bench_alloc", [](std::size_t pairs, std::uint64_t seed, int repeats) {
        std::vector<BenchCase> cases = run_interruptibly<std::vector<BenchCase>>(
            [&](const std::atomic<bool>* stop) {
              return run_alloc_benchmarks(pairs, seed, repeats, stop);
            });
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

  m.def("bench_step", [](const std::string& device_kind, const std::string& driver,
                         const std::vector<std::string>& policies, const AllocatorConfig& config,
                         const py::list& ops, int steps, int warmup) {
        std::vector<StepOp> replayed = step_ops(ops);
        std::vector<StepBenchResult> results = run_interruptibly<std::vector<StepBenchResult>>(
            [&](const std::atomic<bool>* stop) {
              if (device_kind == "sim") {
                SimDevice device(std::size_t{1} << 44, /*launch_overhead_us=*/0.0);
                return run_step_bench(device, policies, config, replayed, steps, warmup, stop);
              }
              cuda::CudaDevice device(cuda::DriverApi::load(driver), 0);
              return run_step_bench(device, policies, config, replayed, steps, warmup, stop);
            });
        py::dict out;
        for (const StepBenchResult& r : results) {
          out[py::str(r.policy)] = py::dict(
              "steps"_a = r.steps, "host_ns_per_step"_a = r.host_ns_per_step,
              "min_ns"_a = r.min_ns, "max_ns"_a = r.max_ns,
              "driver_calls_per_step"_a = r.calls_per_step, "calls"_a = r.calls,
              "peak_reserved"_a = r.peak_reserved, "device_segments"_a = r.device_segments);
        }
        return out;
      }, py::arg("device"), py::arg("driver"), py::arg("policies"), py::arg("config"),
      py::arg("ops"), py::arg("steps"), py::arg("warmup") = 2,
      "A recorded step replayed `steps` times (after `warmup`) through each of `policies`, "
      "taking turns, over the simulated device ('sim') or the CUDA driver `driver` ('cuda', "
      "device 0): per policy, host ns per step and device calls per step by kind.");
}

}  // namespace waterwave::bindings
