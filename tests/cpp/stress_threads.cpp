// Threads on different streams allocate, free, hand pointers to each other
// and trigger SyncAndCoalesce/empty_cache concurrently, through the allocator
// stack; thread 0's stream has a plan that it replaces now and then while the
// others allocate, and any thread changes max_split_size now and then. Built
// with ASan and UBSan (and runnable under TSan). Checks invariants and
// hazards at the end.
//
//   stress_threads POLICY THREADS OPS_PER_THREAD SEED
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../../csrc/alloc/stack.h"
#include "../../csrc/device/sim/sim_device.h"

using namespace waterwave;

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    std::fprintf(stderr, "usage: %s POLICY THREADS OPS_PER_THREAD SEED [CONFIG]\n", argv[0]);
    return 2;
  }
  const std::string policy = argv[1];
  const int threads = std::atoi(argv[2]);
  const std::uint64_t ops = std::strtoull(argv[3], nullptr, 10);
  const std::uint64_t seed = std::strtoull(argv[4], nullptr, 10);
  SimDevice device(512 * kMiB, 0.5);
  const std::string config = argc == 6 ? argv[5] : "";
  auto a = std::make_unique<AllocatorStack>(device, parse_policy(policy), AllocatorConfig::parse(config));
  // Thread 0's plan: back-to-back slots of a fixed program it rarely follows.
  std::vector<PlanSlot> slots;
  std::size_t arena = 0;
  for (std::size_t k = 0; k < 16; ++k) {
    slots.push_back({512 * (1 + (k * 37) % 200), arena});
    arena += slots.back().size;
  }
  a->set_plan(0, slots, arena, PlanScope::kStream, false);
  std::mutex handoff_mu;
  std::vector<Addr> handoff;  // pointers freed by a thread other than their allocator
  std::atomic<std::uint64_t> ooms{0}, total{0};
  std::atomic<bool> failed{false};

  auto worker = [&](int tid) {
    std::mt19937_64 rng(seed * 7919 + tid);
    std::vector<Addr> mine;
    int holds = 0;  // own_segments_first runs this thread holds
    const StreamId stream = static_cast<StreamId>(tid);
    try {
      for (std::uint64_t i = 0; i < ops && !failed; ++i) {
        const std::uint64_t r = rng() % 1000;
        if (r < 450 && mine.size() < 64) {
          const std::size_t size = 1 + rng() % ((rng() % 10 == 0) ? 12 * kMiB : 256 * kKiB);
          try {
            Addr p = a->allocate(size, stream);
            device.note_handout(p, a->allocation_size(p), stream);
            device.launch(stream, static_cast<double>(rng() % 20), {{p, size}});
            mine.push_back(p);
          } catch (const OutOfMemoryError&) {
            ++ooms;
          }
        } else if (r < 850 && !mine.empty()) {
          const std::size_t k = rng() % mine.size();
          Addr p = mine[k];
          mine[k] = mine.back();
          mine.pop_back();
          if (rng() % 4 == 0) {
            std::lock_guard<std::mutex> g(handoff_mu);
            handoff.push_back(p);  // another thread frees it
          } else {
            a->deallocate(p);
          }
        } else if (r < 900) {
          Addr p = 0;
          {
            std::lock_guard<std::mutex> g(handoff_mu);
            if (!handoff.empty()) {
              p = handoff.back();
              handoff.pop_back();
            }
          }
          if (p) a->deallocate(p);
        } else if (r < 905) {
          a->sync_and_coalesce();
        } else if (r < 907) {
          a->empty_cache();
        } else if (r < 910) {
          (void)a->stats();
        } else if (r < 915 && tid == 0) {
          a->begin_step(stream);
        } else if (r < 917 && tid == 0) {
          try {
            a->set_plan(stream, slots, arena, PlanScope::kStream, false);
          } catch (const ConfigError&) {
            // Its blocks are still in use (perhaps by other threads): keep it.
          }
        } else if (r < 919) {
          // max_split_size changed while others allocate, as a sharing
          // session's first block changes it (none, 20, 32 or 44 MiB).
          const std::uint64_t k = rng() % 4;
          a->set_max_split_size(k == 0 ? SIZE_MAX : (8 + 12 * k) * kMiB);
        } else if (r < 920 && config.find("expandable") == std::string::npos) {
          // own_segments_first held and let go while others allocate, as
          // captured sessions' runs on threads do (its synced blocks move).
          if (holds < 3 && (holds == 0 || rng() % 2 == 0)) {
            a->hold_own_segments_first();
            ++holds;
          } else {
            a->release_own_segments_first();
            --holds;
          }
        }
        ++total;
      }
      for (Addr p : mine) a->deallocate(p);
      for (; holds > 0; --holds) a->release_own_segments_first();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "thread %d: unexpected exception: %s\n", tid, e.what());
      failed = true;
    }
  };

  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker, t);
  for (auto& t : pool) t.join();
  if (failed) return 1;
  for (Addr p : handoff) a->deallocate(p);
  try {
    a->check_invariants();
    a->clear_plan(std::nullopt);
    a->sync_and_coalesce();
    a->empty_cache();
    a->check_invariants();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: %s\n", e.what());
    return 1;
  }
  const auto hz = device.hazards();
  if (!hz.empty()) {
    std::fprintf(stderr, "FAILED: %zu hazards, first: %s\n", hz.size(), hz.front().describe().c_str());
    return 1;
  }
  if (a->stats().reserved_bytes.all().current != 0) {
    std::fprintf(stderr, "FAILED: memory still reserved after freeing everything and empty_cache\n");
    return 1;
  }
  std::printf("stress_threads %s%s%s: %d threads, %llu ops, %llu OOMs, 0 hazards, invariants held\n",
              policy.c_str(), config.empty() ? "" : " ", config.c_str(), threads, static_cast<unsigned long long>(total.load()),
              static_cast<unsigned long long>(ooms.load()));
  return 0;
}
