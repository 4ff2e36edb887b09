// A long random run of one allocator policy on the simulated GPU, through the
// allocator stack both faces use, checking every invariant after every step.
// In odd rounds stream 3 has a plan of random slots over the policy: the
// plan's blocks and the policy's must never overlap, whatever the program
// does with them. Built with ASan and UBSan by `make test`.
//
//   random_run POLICY OPS SEED
//
// Exits non-zero on a broken invariant, an overlap of live blocks, a
// cross-stream hazard, or an unexpected exception.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../../csrc/alloc/stack.h"
#include "../../csrc/device/sim/sim_device.h"

using namespace waterwave;

namespace {

const char* kConfigs[] = {
    "",
    "max_split_size_mb:40",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[1:2,64:8,>:4],max_split_size_mb:64,max_non_split_rounding_mb:32",
    "per_process_memory_fraction:0.75,garbage_collection_threshold:0.6,max_split_size_mb:30",
    "expandable_segments:True",
    "expandable_segments:True,per_process_memory_fraction:0.75,max_split_size_mb:30",
    "own_segments_first:True",
    "own_segments_first:True,per_process_memory_fraction:0.75,max_split_size_mb:30",
};
constexpr int kNumConfigs = sizeof(kConfigs) / sizeof(kConfigs[0]);

struct Live {
  std::size_t size;
  StreamId stream;
};

int fail(const std::string& what, std::uint64_t step) {
  std::fprintf(stderr, "FAILED at step %llu: %s\n", static_cast<unsigned long long>(step), what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s POLICY OPS SEED\n", argv[0]);
    return 2;
  }
  const std::string policy = argv[1];
  const std::uint64_t ops = std::strtoull(argv[2], nullptr, 10);
  const std::uint64_t seed = std::strtoull(argv[3], nullptr, 10);
  std::mt19937_64 rng(seed);
  auto uniform = [&](std::uint64_t n) { return std::uniform_int_distribution<std::uint64_t>(0, n - 1)(rng); };

  std::uint64_t ooms = 0, allocs = 0, frees = 0, kernels = 0, planned = 0;
  const int rounds = kNumConfigs;
  for (int round = 0; round < rounds; ++round) {
    const std::string config = kConfigs[round];
    SimDevice device(256 * kMiB, 1.0);
    auto a = std::make_unique<AllocatorStack>(device, parse_policy(policy), AllocatorConfig::parse(config));
    // The plan's slots overlap at random; stream 3 asks for the slot size
    // half the time, so steps follow the plan for a while, then deviate.
    constexpr StreamId kPlanned = 3;
    const std::size_t slot_size = 512 * (1 + uniform(4096));
    if (round % 2 == 1) {
      std::vector<PlanSlot> slots;
      for (int k = 0; k < 12; ++k) slots.push_back({slot_size, 512 * uniform(8192)});
      a->set_plan(kPlanned, slots, 8192 * 512 + slot_size, PlanScope::kStream, false);
    }
    std::map<Addr, Live> live;  // shadow: live allocations by address
    const std::uint64_t steps = ops / rounds;
    for (std::uint64_t i = 0; i < steps; ++i) {
      const std::uint64_t step = round * steps + i;
      const std::uint64_t r = uniform(1000);
      try {
        if (r < 380 && live.size() < 96) {
          std::size_t size;
          const std::uint64_t k = uniform(100);
          if (k < 70) size = 1 + uniform(kMiB);
          else if (k < 95) size = kMiB + uniform(9 * kMiB);
          else if (k < 99) size = 10 * kMiB + uniform(90 * kMiB);
          else size = 200 * kMiB + uniform(200 * kMiB);  // often out of memory
          const StreamId s = uniform(4);
          if (s == kPlanned && uniform(2) == 0) size = slot_size;
          Addr p = 0;
          try {
            p = a->allocate(size, s);
          } catch (const OutOfMemoryError&) {
            ++ooms;
          }
          if (p) {
            const std::size_t got = a->allocation_size(p);
            if (got < size) return fail("allocation smaller than requested", step);
            auto next = live.lower_bound(p);
            if (next != live.end() && next->first < p + got) return fail("live blocks overlap", step);
            if (next != live.begin()) {
              auto prev = std::prev(next);
              if (prev->first + prev->second.size > p) return fail("live blocks overlap", step);
            }
            device.note_handout(p, got, s);
            live[p] = {got, s};
            ++allocs;
          }
        } else if (r < 700 && !live.empty()) {
          auto it = std::next(live.begin(), static_cast<long>(uniform(live.size())));
          a->deallocate(it->first);
          live.erase(it);
          ++frees;
        } else if (r < 760 && !live.empty()) {
          auto it = std::next(live.begin(), static_cast<long>(uniform(live.size())));
          const StreamId s = uniform(4);
          a->record_stream(it->first, s);
          device.launch(s, static_cast<double>(uniform(50)), {{it->first, it->second.size}});
        } else if (r < 960) {
          std::vector<Range> uses;
          const StreamId s = uniform(4);
          for (auto& [p, l] : live) {
            if (l.stream == s && uniform(3) == 0) uses.push_back({p, l.size});
          }
          device.launch(s, static_cast<double>(uniform(100)), uses);
          ++kernels;
        } else if (r < 975) {
          a->sync_and_coalesce();
        } else if (r < 980) {
          a->empty_cache();
        } else if (r < 985) {
          device.advance_host(static_cast<double>(uniform(200)));
        } else if (r < 990) {
          if (a->has_plan(kPlanned)) a->begin_step(kPlanned);
        } else if (r < 996 || config.find("expandable") != std::string::npos) {
          device.synchronize_device();
        } else {  // own_segments_first changed at run time (its synced blocks move)
          a->set_own_segments_first(uniform(2) == 1);
        }
        a->check_invariants();
      } catch (const InvariantError& e) {
        return fail(e.what(), step);
      } catch (const std::exception& e) {
        return fail(std::string("unexpected exception: ") + e.what(), step);
      }
      const auto hz = device.hazards();
      if (!hz.empty()) return fail("hazard: " + hz.front().describe(), step);
    }
    for (auto& [p, l] : live) a->deallocate(p);
    if (a->has_plan(kPlanned)) planned += static_cast<std::uint64_t>(a->plan_stats(kPlanned).planned);
    a->clear_plan(std::nullopt);
    a->sync_and_coalesce();
    a->empty_cache();
    a->check_invariants();
    if (a->stats().reserved_bytes.all().current != 0 || device.reserved_bytes() != 0) {
      return fail("empty_cache left memory reserved after everything was freed", ops);
    }
  }
  std::printf("random_run %s: %llu ops, %llu allocs, %llu frees, %llu kernels, %llu OOMs, %llu planned, "
              "0 hazards, invariants held after every step\n",
              policy.c_str(), static_cast<unsigned long long>(ops),
              static_cast<unsigned long long>(allocs), static_cast<unsigned long long>(frees),
              static_cast<unsigned long long>(kernels), static_cast<unsigned long long>(ooms),
              static_cast<unsigned long long>(planned));
  return 0;
}
