// Allocator micro-benchmarks: nanoseconds per alloc+free pair on the hot
// paths, for every policy (through the allocator stack, as both faces reach
// it) and glibc malloc/free on the same size sequence.
//
// May include: core/, alloc/, device/sim/.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <map>
#include <string>
#include <vector>

namespace waterwave {

struct BenchCase {
  std::string name;    // same_stream, synced_path, cross_stream, free_blocks_1k, ...
  std::string policy;  // waterwave, pytorch, glibc
  double ns_per_pair = 0;
  std::uint64_t pairs = 0;
  std::uint64_t free_blocks = 0;  // free blocks present while measuring
  double min_ns = 0, max_ns = 0;  // over the repetitions; ns_per_pair is the median
  int repeats = 1;
  std::map<std::string, std::int64_t> served;  // how the allocator served them
};

// Thrown by run_alloc_benchmarks when `stop` turned true (the caller's Ctrl-C).
struct BenchStopped : std::exception {
  const char* what() const noexcept override { return "allocator benchmark stopped"; }
};

// `stop`, when given, is read between runs and every 65,536 pairs inside one.
std::vector<BenchCase> run_alloc_benchmarks(std::uint64_t pairs, std::uint64_t seed, int repeats,
                                            const std::atomic<bool>* stop = nullptr);

}  // namespace waterwave
