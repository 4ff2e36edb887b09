// The step benchmark (step_bench.h): a recorded step replayed and timed.
#include "step_bench.h"

#include <algorithm>
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

StepBenchResult run_step_bench(Device& device, const std::string& policy,
                               const AllocatorConfig& config, const std::vector<StepOp>& ops,
                               int steps, int warmup, const std::atomic<bool>* stop) {
  if (steps < 1 || warmup < 0) throw std::invalid_argument("steps must be at least 1");
  CountingDevice counted(device);
  StepBenchResult out;
  out.policy = policy;
  out.steps = steps;
  std::vector<double> times;
  {
    AllocatorStack a(counted, parse_policy(policy), config);
    std::unordered_map<std::uint32_t, Addr> live;
    for (int i = 0; i < warmup; ++i) {
      if (stop && stop->load()) throw BenchStopped();
      replay(a, ops, live);
    }
    counted.reset();
    for (int i = 0; i < steps; ++i) {
      if (stop && stop->load()) throw BenchStopped();
      times.push_back(replay(a, ops, live));
    }
    std::map<std::string, std::int64_t> calls = counted.calls();  // the frees after each step included
    std::int64_t total = 0;
    for (auto& [kind, n] : calls) {
      out.calls[kind] = static_cast<double>(n) / steps;
      total += n;
    }
    out.calls_per_step = static_cast<double>(total) / steps;
    AllocatorStats st = a.stats();
    out.peak_reserved = st.reserved_bytes.s[0].peak;
    out.device_segments = st.num_device_alloc;
    a.empty_cache();
  }
  std::sort(times.begin(), times.end());
  out.host_ns_per_step = times[times.size() / 2];
  out.min_ns = times.front();
  out.max_ns = times.back();
  return out;
}

}  // namespace waterwave
