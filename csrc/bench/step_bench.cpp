// The step benchmark (step_bench.h): a recorded step replayed and timed.
#include "step_bench.h"

#include <algorithm>
#include <memory>
#include <chrono>
#include <stdexcept>
#include <unordered_map>

#include "../alloc/policies.h"
#include "../alloc/stack.h"
#include "../device/counting_device.h"
#include "alloc_bench.h"

namespace waterwave {
namespace {

using Clock = std::chrono::steady_clock;

// One replay: the step's allocations and frees in order, then what it left
// allocated freed (the timed part ends before that).
double replay(AllocatorStack& a, const std::vector<StepOp>& ops,
              std::unordered_map<std::uint32_t, Addr>& live) {
  auto t0 = Clock::now();
  for (const StepOp& op : ops) {
    if (op.alloc) {
      live[op.block] = a.allocate(op.bytes, op.stream);
    } else {
      auto it = live.find(op.block);
      if (it == live.end()) {
        throw std::invalid_argument("the recording frees block " + std::to_string(op.block) +
                                    " before allocating it");
      }
      a.deallocate(it->second);
      live.erase(it);
    }
  }
  auto t1 = Clock::now();
  for (auto& [block, addr] : live) a.deallocate(addr);
  live.clear();
  return std::chrono::duration<double, std::nano>(t1 - t0).count();
}

}  // namespace

std::vector<StepBenchResult> run_step_bench(Device& device,
                                            const std::vector<std::string>& policies,
                                            const AllocatorConfig& config,
                                            const std::vector<StepOp>& ops, int steps, int warmup,
                                            const std::atomic<bool>* stop) {
  if (steps < 1 || warmup < 0) throw std::invalid_argument("steps must be at least 1");
  struct Run {
    CountingDevice counted;
    AllocatorStack stack;
    std::unordered_map<std::uint32_t, Addr> live;
    std::vector<double> times;
    Run(Device& d, const std::string& policy, const AllocatorConfig& config)
        : counted(d), stack(counted, parse_policy(policy), config) {}
  };
  std::vector<std::unique_ptr<Run>> runs;
  for (const std::string& policy : policies) {
    runs.push_back(std::make_unique<Run>(device, policy, config));
  }
  for (int i = 0; i < warmup + steps; ++i) {
    if (i == warmup) {
      for (auto& r : runs) r->counted.reset();
    }
    for (auto& r : runs) {
      if (stop && stop->load()) throw BenchStopped();
      const double ns = replay(r->stack, ops, r->live);
      if (i >= warmup) r->times.push_back(ns);
    }
  }
  std::vector<StepBenchResult> out;
  for (std::size_t k = 0; k < runs.size(); ++k) {
    Run& r = *runs[k];
    StepBenchResult res;
    res.policy = policies[k];
    res.steps = steps;
    std::int64_t total = 0;
    for (auto& [kind, n] : r.counted.calls()) {  // the frees after each step included
      res.calls[kind] = static_cast<double>(n) / steps;
      total += n;
    }
    res.calls_per_step = static_cast<double>(total) / steps;
    AllocatorStats st = r.stack.stats();
    res.peak_reserved = st.reserved_bytes.s[0].peak;
    res.device_segments = st.num_device_alloc;
    std::sort(r.times.begin(), r.times.end());
    res.host_ns_per_step = r.times[r.times.size() / 2];
    res.min_ns = r.times.front();
    res.max_ns = r.times.back();
    r.stack.empty_cache();
    out.push_back(std::move(res));
  }
  return out;
}

}  // namespace waterwave
