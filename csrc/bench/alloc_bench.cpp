// Allocator micro-benchmarks (alloc_bench.h): the cases and how they are timed.
#include "alloc_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <cstdlib>
#include <memory>
#include <random>

#include "../alloc/stack.h"
#include "../device/sim/sim_device.h"

namespace waterwave {
namespace {

using Clock = std::chrono::steady_clock;

// Log-uniform sizes between 512 B and 64 KiB: small tensors, the ones an
// allocator sees most often; glibc serves them from its own bins too.
std::vector<std::size_t> size_sequence(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(9.0, 16.0);
  std::vector<std::size_t> sizes(n);
  for (auto& s : sizes) s = static_cast<std::size_t>(std::exp2(u(rng)));
  return sizes;
}

// What a benchmark step does on an allocator-like target.
struct Target {
  virtual ~Target() = default;
  virtual std::uintptr_t alloc(std::size_t n, StreamId s) = 0;
  virtual void free(std::uintptr_t p) = 0;
  virtual void sync() {}
  virtual void served(std::map<std::string, std::int64_t>&) {}
};

struct GlibcTarget : Target {
  std::uintptr_t alloc(std::size_t n, StreamId) override {
    void* p = std::malloc(n);
    if (!p) std::abort();
    return reinterpret_cast<std::uintptr_t>(p);
  }
  void free(std::uintptr_t p) override { std::free(reinterpret_cast<void*>(p)); }
};

// A policy as both faces reach it: through the allocator stack, with no
// plan or recorder installed.
struct PolicyTarget : Target {
  SimDevice device;
  std::unique_ptr<AllocatorStack> a;
  explicit PolicyTarget(const std::string& policy)
      : device(std::size_t{1} << 40, /*launch_overhead_us=*/0.0),
        a(std::make_unique<AllocatorStack>(device, parse_policy(policy), AllocatorConfig{})) {}
  std::uintptr_t alloc(std::size_t n, StreamId s) override { return a->allocate(n, s); }
  void free(std::uintptr_t p) override { a->deallocate(p); }
  void sync() override { a->sync_and_coalesce(); }
  void served(std::map<std::string, std::int64_t>& out) override {
    AllocatorStats st = a->stats();
    for (int i = 0; i < static_cast<int>(Served::kCount); ++i) {
      out[served_name(static_cast<Served>(i))] = st.served[i];
    }
    out["device_segments"] = st.num_device_alloc;
    out["stream_waits"] = st.num_stream_waits;
  }
};

std::unique_ptr<Target> make_target(const std::string& policy) {
  if (policy == "glibc") return std::make_unique<GlibcTarget>();
  return std::make_unique<PolicyTarget>(policy);
}

BenchCase new_case(const char* name, const std::string& policy, std::uint64_t pairs,
                   std::uint64_t free_blocks) {
  BenchCase c;
  c.name = name;
  c.policy = policy;
  c.pairs = pairs;
  c.free_blocks = free_blocks;
  return c;
}

// The run's stop flag: one benchmark runs on one thread, and every case
// times its pairs through time_pairs, so the flag is kept here rather than
// passed through every case.
thread_local const std::atomic<bool>* tl_stop = nullptr;

void stop_if_asked() {
  if (tl_stop && tl_stop->load(std::memory_order_relaxed)) throw BenchStopped();
}

template <typename Step>
double time_pairs(std::uint64_t pairs, Step step) {
  // Chunks of 65,536 pairs, the flag read between them (a load outside the
  // measured loop's body, whatever the pair count), the warm-up's included:
  // a tenth of 200 million pairs took seconds to reach a check.
  constexpr std::uint64_t kChunk = 1 << 16;
  const std::uint64_t warm_up = pairs / 10;
  for (std::uint64_t from = 0; from < warm_up; from += kChunk) {
    const std::uint64_t to = std::min(warm_up, from + kChunk);
    for (std::uint64_t i = from; i < to; ++i) step(i);
    stop_if_asked();
  }
  stop_if_asked();
  double ns = 0;
  for (std::uint64_t from = 0; from < pairs; from += kChunk) {
    const std::uint64_t to = std::min(pairs, from + kChunk);
    auto t0 = Clock::now();
    for (std::uint64_t i = from; i < to; ++i) step(i);
    auto t1 = Clock::now();
    ns += std::chrono::duration<double, std::nano>(t1 - t0).count();
    stop_if_asked();
  }
  return ns / static_cast<double>(pairs);
}

// Same stream: a FIFO window of 8 live allocations; each pair frees the
// oldest and allocates the next size.
BenchCase same_stream(const std::string& policy, std::uint64_t pairs,
                      const std::vector<std::size_t>& sizes) {
  auto t = make_target(policy);
  std::uintptr_t window[8] = {};
  for (auto& w : window) w = t->alloc(sizes[0], 0);
  BenchCase c = new_case("same_stream", policy, pairs, 0);
  c.ns_per_pair = time_pairs(pairs, [&](std::uint64_t i) {
    std::uintptr_t& slot = window[i & 7];
    t->free(slot);
    slot = t->alloc(sizes[i % sizes.size()], 0);
  });
  for (auto w : window) t->free(w);
  t->served(c.served);
  return c;
}

// Synced path: 64 streams in turn, SyncAndCoalesce every 32 pairs (its cost
// included), so a stream's own unsynced set is always empty when it asks.
BenchCase synced_path(const std::string& policy, std::uint64_t pairs,
                      const std::vector<std::size_t>& sizes) {
  auto t = make_target(policy);
  BenchCase c = new_case("synced_path", policy, pairs, 0);
  c.ns_per_pair = time_pairs(pairs, [&](std::uint64_t i) {
    std::uintptr_t p = t->alloc(sizes[i % sizes.size()], i & 63);
    t->free(p);
    if ((i & 31) == 31) t->sync();
  });
  t->served(c.served);
  return c;
}

// Cross stream: two streams in turn, each with a kernel that never finishes.
// Every request is 12 MiB, which fills a 12 MiB segment exactly, so the only
// free block is always the one the other stream just freed: the waterwave
// policy must take it through an asynchronous stream wait on an event (the
// pytorch policy keeps one segment per stream instead).
BenchCase cross_stream(const std::string& policy, std::uint64_t pairs,
                       const std::vector<std::size_t>&) {
  auto t = make_target(policy);
  if (auto* pt = dynamic_cast<PolicyTarget*>(t.get())) {
    pt->device.launch(0, 1e18, {});
    pt->device.launch(1, 1e18, {});
  }
  const std::size_t size = 12 * kMiB;
  BenchCase c = new_case("cross_stream", policy, pairs, 0);
  c.ns_per_pair = time_pairs(pairs, [&](std::uint64_t i) {
    std::uintptr_t p = t->alloc(size, i & 1);
    t->free(p);
  });
  t->served(c.served);
  return c;
}

// N free holes between live blocks (they cannot coalesce); each pair takes a
// best fit among them and gives it back.
BenchCase with_free_blocks(const std::string& policy, std::uint64_t pairs,
                           const std::vector<std::size_t>& sizes, std::size_t holes,
                           const std::string& name) {
  auto t = make_target(policy);
  std::vector<std::uintptr_t> blocks(2 * holes);
  for (std::size_t i = 0; i < blocks.size(); ++i) blocks[i] = t->alloc(sizes[i % sizes.size()], 0);
  for (std::size_t i = 0; i < blocks.size(); i += 2) t->free(blocks[i]);
  BenchCase c = new_case(name.c_str(), policy, pairs, holes);
  c.ns_per_pair = time_pairs(pairs, [&](std::uint64_t i) {
    std::uintptr_t p = t->alloc(sizes[(i * 7 + 3) % sizes.size()], 0);
    t->free(p);
  });
  for (std::size_t i = 1; i < blocks.size(); i += 2) t->free(blocks[i]);
  t->served(c.served);
  return c;
}

}  // namespace

std::vector<BenchCase> run_alloc_benchmarks(std::uint64_t pairs, std::uint64_t seed,
                                            int repeats, const std::atomic<bool>* stop) {
  struct StopScope {
    explicit StopScope(const std::atomic<bool>* s) { tl_stop = s; }
    ~StopScope() { tl_stop = nullptr; }
  } scope(stop);
  const std::vector<std::size_t> sizes = size_sequence(4096, seed);
  std::vector<std::string> targets;
  for (const PolicyInfo& p : policies()) targets.push_back(p.name);
  targets.push_back("glibc");
  using Runner = std::function<BenchCase(const std::string&)>;
  std::vector<Runner> runners = {
      [&](const std::string& p) { return same_stream(p, pairs, sizes); },
      [&](const std::string& p) { return synced_path(p, pairs, sizes); },
      [&](const std::string& p) { return cross_stream(p, pairs, sizes); },
      [&](const std::string& p) { return with_free_blocks(p, pairs, sizes, 1024, "free_blocks_1k"); },
      [&](const std::string& p) { return with_free_blocks(p, pairs, sizes, 16384, "free_blocks_16k"); },
      [&](const std::string& p) { return with_free_blocks(p, pairs, sizes, 65536, "free_blocks_64k"); },
  };
  // Policies interleaved within each repetition, so that drift on a shared
  // machine affects all of them alike; the median repetition is reported.
  std::vector<BenchCase> out;
  for (const Runner& run : runners) {
    std::vector<std::vector<BenchCase>> reps(targets.size());
    for (int r = 0; r < repeats; ++r) {
      for (std::size_t t = 0; t < targets.size(); ++t) {
        stop_if_asked();
        reps[t].push_back(run(targets[t]));
      }
    }
    for (auto& runs : reps) {
      std::sort(runs.begin(), runs.end(),
                [](const BenchCase& a, const BenchCase& b) { return a.ns_per_pair < b.ns_per_pair; });
      BenchCase median = runs[runs.size() / 2];
      median.min_ns = runs.front().ns_per_pair;
      median.max_ns = runs.back().ns_per_pair;
      median.repeats = repeats;
      out.push_back(median);
    }
  }
  return out;
}

}  // namespace waterwave
