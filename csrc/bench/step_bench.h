// Replaying a recorded training step through a policy, for `waterwave bench
// step`: the allocator's host time per step and the device calls it makes,
// by kind, over any Device (the CUDA driver, a fake of it, the simulator),
// counted by a CountingDevice between the policy and the device.
//
// May include: core/, alloc/, device/.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "../core/config.h"
#include "../core/device.h"

namespace waterwave {

// One allocation or free of a recorded step. Blocks are the recording's
// numbers; a block allocated and not freed within the step is freed after
// it, before the next replay, so every step starts alike.
struct StepOp {
  bool alloc = true;
  std::uint32_t block = 0;
  std::size_t bytes = 0;  // alloc only
  StreamId stream = 0;    // alloc only
};

struct StepBenchResult {
  std::string policy;
  int steps = 0;                     // measured replays
  double host_ns_per_step = 0;       // median over the measured replays
  double min_ns = 0, max_ns = 0;
  double calls_per_step = 0;         // device calls, all kinds
  std::map<std::string, double> calls;  // device calls per step, by kind
  std::int64_t peak_reserved = 0;
  std::int64_t device_segments = 0;  // segments the policy reserved over the run
};

// Runs `warmup` unmeasured replays, then `steps` measured ones, of `ops`
// through each of `policies` over `device`, each policy's allocator over a
// counter of its own. The policies take turns replay by replay, so that
// what the machine does meanwhile (another process, the clock's frequency)
// falls on them alike. `stop`, when given, is read between replays.
std::vector<StepBenchResult> run_step_bench(Device& device,
                                            const std::vector<std::string>& policies,
                                            const AllocatorConfig& config,
                                            const std::vector<StepOp>& ops, int steps, int warmup,
                                            const std::atomic<bool>* stop = nullptr);

}  // namespace waterwave
