// The CUDA backend and PyTorch's entry points under ASan and UBSan (and
// runnable under TSan), over the fake driver (tests/cpp/fake_cuda.c, host
// memory behind the driver API). Threads on their own streams allocate,
// write a byte pattern through every pointer, check it at free, hand
// pointers to other threads to free (half of them through the free that
// names no device, the native registration's), record streams and empty
// the cache,
// all through the C entry points PyTorch calls. With expandable segments,
// threads also tell the driver to fail a later cuMemCreate, cuMemMap or
// cuMemSetAccess, out of memory or otherwise, so that growths fail partway
// under the sanitizers: an allocation then succeeds (a retry), is out of
// memory, or fails with the driver's error, and nothing it mapped leaks or
// is lost. Odd threads carry thread accounts (runtime/thread_accounts.h),
// whose blocks other threads free too; each account ends at zero. They are
// sharing members: where the device runs out, they wait for each other's
// frees (never alone, never hanging) or fail in a tie-break. Then one
// thread records a step, packs it back to back (the plan
// need not be optimal to be served) and replays it. Invariants and the
// driver's bytes are checked at the end. Last, threads work on private
// pools (CUDA graphs' and MemPools') beside a capturing stream; no call may
// break the capture's rules.
//
//   cuda_backend_run FAKE_DRIVER.so POLICY THREADS OPS_PER_THREAD SEED
#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <iterator>
#include <thread>
#include <vector>

#include "../../csrc/runtime/cuda_runtime.h"
#include "../../csrc/runtime/native_abi.h"
#include "../../csrc/runtime/pytorch_abi.h"

using namespace waterwave;
using waterwave::cuda::CudaRuntime;

namespace {

struct Held {
  void* ptr;
  std::size_t size;
  void* stream;
  unsigned char byte;
};

void* stream_of(int tid) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(0x1000 * (tid + 1))); }

bool intact(const Held& b) {
  const auto* p = static_cast<const unsigned char*>(b.ptr);
  for (std::size_t i = 0; i < b.size; i += 61)
    if (p[i] != b.byte) return false;
  return p[b.size - 1] == b.byte;
}

// A held block chosen at random, taken out of `mine`.
Held take_any(std::vector<Held>& mine, std::mt19937_64& rng) {
  const std::size_t k = rng() % mine.size();
  Held b = mine[k];
  mine[k] = mine.back();
  mine.pop_back();
  return b;
}

// One step of a fixed program, as the planned trainer runs it.
void program_step(std::vector<void*>& live, void* stream) {
  static const std::size_t sizes[] = {4096, 3 * kMiB, 512, 2 * kMiB, 700 * kKiB, 3 * kMiB, 64 * kKiB};
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    live.push_back(waterwave_cuda_malloc(sizes[i], 0, stream));
    std::memset(live.back(), static_cast<int>(i), sizes[i]);
    if (i % 2 == 1) {  // free the one before: lifetimes overlap in a chain
      waterwave_cuda_free(live[live.size() - 2], sizes[i - 1], 0, stream);
      live.erase(live.end() - 2);
    }
  }
  for (void* p : live) waterwave_cuda_free(p, 0, 0, stream);
  live.clear();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6 && argc != 7) {
    std::fprintf(stderr, "usage: %s FAKE_DRIVER.so POLICY THREADS OPS_PER_THREAD SEED [CONFIG]\n",
                 argv[0]);
    return 2;
  }
  const std::string driver = argv[1], policy = argv[2];
  const int threads = std::atoi(argv[3]);
  const std::uint64_t ops = std::strtoull(argv[4], nullptr, 10);
  const std::uint64_t seed = std::strtoull(argv[5], nullptr, 10);
  CudaRuntime& rt = CudaRuntime::get();
  const std::string config = argc == 7 ? argv[6] : "";
  rt.configure(parse_policy(policy), AllocatorConfig::parse(config), driver);

  // Map failures, injected where the driver maps pages (expandable segments).
  void* fake_driver = dlopen(driver.c_str(), RTLD_NOW);  // the handle the runtime gets too
  auto fail_vmm = fake_driver && config.find("expandable_segments:True") != std::string::npos
                      ? reinterpret_cast<void (*)(const char*, int, int)>(dlsym(fake_driver, "fake_cuda_fail_vmm"))
                      : nullptr;
  // A device smaller than the threads' blocks together, so that it runs
  // out and the members wait for each other; the whole GiB again after.
  auto set_capacity = fake_driver ? reinterpret_cast<void (*)(std::size_t)>(
                                        dlsym(fake_driver, "fake_cuda_set_capacity"))
                                  : nullptr;
  if (set_capacity) set_capacity(96 * kMiB);
  std::atomic<std::uint64_t> injected{0}, driver_errors{0};
  // An allocation that failed with the driver's error: allowed only for an
  // injected failure, and it must name the call.
  auto driver_error = [&](const std::string& message) {
    if (fail_vmm && message.find("cuMem") != std::string::npos) {
      ++driver_errors;
      return true;
    }
    return false;
  };

  std::mutex handoff_mu;
  std::vector<Held> handoff;
  std::atomic<bool> failed{false};
  std::atomic<std::uint64_t> ooms{0};
  auto fail = [&](const std::string& why) {
    if (!failed.exchange(true)) std::fprintf(stderr, "FAILED: %s\n", why.c_str());
  };

  // Odd threads are sharing members: an allocation the device cannot serve
  // waits for another member's free and tries again, or fails in their
  // tie-break; each leaves when it is done, as a sharing block ends. With
  // an even seed they also share a measured budget, as a GPU session with
  // no memory_limit sets it (95% of the device): an allocation past it
  // waits for their frees, and a tie lets it ask the device.
  std::vector<std::int64_t> accounts;
  for (int t = 0; t < threads; ++t) accounts.push_back(t % 2 ? rt.accounts().open() : 0);
  for (std::int64_t id : accounts) {
    if (id != 0) rt.accounts().join(id, 0);
  }
  if (seed % 2 == 0) rt.accounts().set_budget(96 * kMiB / 100 * 95, 0, /*measured=*/true);

  auto worker = [&](int tid) {
    std::mt19937_64 rng(seed * 7919 + tid);
    ThreadAccounts::set_thread(accounts[tid]);
    std::vector<Held> mine;
    void* stream = stream_of(tid);
    try {
      for (std::uint64_t i = 0; i < ops && !failed; ++i) {
        const std::uint64_t r = rng() % 1000;
        if (r < 450 && mine.size() < 48) {
          const std::size_t size = 1 + rng() % ((rng() % 10 == 0) ? 12 * kMiB : 256 * kKiB);
          void* p = nullptr;
          if (rng() % 2 == 0) {  // the entry point PyTorch calls directly
            try {
              p = waterwave_cuda_malloc(size, 0, stream);
            } catch (const OutOfMemoryError&) {
              ++ooms;
            } catch (const std::runtime_error& e) {
              if (!driver_error(e.what())) throw;
            }
          } else {  // the one the torch bridge calls: codes, not exceptions
            char message[256];
            const int result = waterwave_cuda_try_malloc(size, 0, stream, &p, message, sizeof message);
            if (result == kWaterwaveMallocOutOfMemory) {
              ++ooms;
              if (std::strncmp(message, "out of memory", 13) != 0) fail(std::string("OOM said: ") + message);
            } else if ((result != kWaterwaveMallocOk || p == nullptr) && !driver_error(message)) {
              fail(std::string("try_malloc failed: ") + message);
            }
          }
          if (p != nullptr) {
            const auto byte = static_cast<unsigned char>(rng());
            std::memset(p, byte, size);
            mine.push_back({p, size, stream, byte});
          }
        } else if (r < 850 && !mine.empty()) {
          Held b = take_any(mine, rng);
          if (!intact(b)) fail("a live block was overwritten");
          if (rng() % 4 == 0) {
            std::lock_guard<std::mutex> g(handoff_mu);
            handoff.push_back(b);  // another thread frees it
          } else {
            waterwave_cuda_free(b.ptr, b.size, 0, b.stream);
          }
        } else if (r < 900 && !mine.empty()) {
          waterwave_cuda_record_stream(mine[rng() % mine.size()].ptr, stream_of(static_cast<int>(rng() % threads)));
        } else if (r < 990) {
          std::vector<Held> take;
          {
            std::lock_guard<std::mutex> g(handoff_mu);
            take.swap(handoff);
          }
          for (const Held& b : take) {
            if (!intact(b)) fail("a handed-off block was overwritten");
            if (rng() % 2) {
              waterwave_cuda_free(b.ptr, b.size, 0, b.stream);
            } else {  // the native registration's deleter: no device named
              waterwave_cuda_free_owned(b.ptr);
            }
          }
        } else if (r < 995 && fail_vmm) {
          static const char* calls[] = {"cuMemCreate", "cuMemMap", "cuMemSetAccess"};
          fail_vmm(calls[rng() % 3], static_cast<int>(rng() % 3), rng() % 2 ? 2 : 999);
          ++injected;
        } else {
          waterwave_cuda_empty_cache();
        }
      }
    } catch (const std::exception& e) {
      fail(e.what());
    }
    for (const Held& b : mine) waterwave_cuda_free(b.ptr, b.size, 0, b.stream);
    if (accounts[tid] != 0) rt.accounts().leave(accounts[tid]);
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker, t);
  for (auto& t : pool) t.join();
  for (const Held& b : handoff) waterwave_cuda_free(b.ptr, b.size, 0, b.stream);
  handoff.clear();
  for (std::int64_t id : accounts) {
    if (id == 0) continue;
    if (rt.accounts().usage(id).allocated != 0) fail("a thread account kept bytes after every free");
    rt.accounts().close(id);
  }
  const long long overdrawn = rt.accounts().share_stats().overdrawn;
  rt.accounts().set_budget(0, 0);

  if (fail_vmm) fail_vmm("", 0, 0);  // disarm what no call took
  if (set_capacity) set_capacity(1024 * kMiB);
  const long long device_waits = rt.accounts().share_stats().device_waits;
  {
    AllocatorStack& stack = rt.stack(0);
    stack.check_invariants();
  }

  // A recorded step becomes a plan (offsets back to back: simple, and
  // correct whatever the lifetimes) and serves the next steps.
  void* stream = stream_of(0);
  std::vector<void*> live;
  rt.stack(0).start_recording(cuda::stream_id(stream));
  program_step(live, stream);
  std::vector<TracedBlock> trace = rt.stack(0).stop_recording(std::nullopt);
  std::vector<PlanSlot> slots;
  std::size_t arena = 0;
  for (const TracedBlock& b : trace) {
    slots.push_back({b.size, arena});
    arena += b.size;
  }
  AllocatorStack& stack = rt.stack(0);
  stack.set_plan(cuda::stream_id(stream), slots, arena, PlanScope::kDevice, true);
  for (int step = 0; step < 3; ++step) {
    stack.begin_step(std::nullopt);
    program_step(live, stream);
  }
  const PlanStats ps = stack.plan_stats(std::nullopt);
  if (ps.planned != 3 * static_cast<std::int64_t>(trace.size()) || ps.fallback || ps.deviations)
    fail("the recorded plan was not followed");
  stack.check_invariants();
  stack.clear_plan(std::nullopt);
  // Private pools, as CUDA graphs and torch.cuda.MemPool use them: each
  // thread owns a pool and opens windows on it round after round (thread
  // 0's stream captures meanwhile, in global mode, as torch.cuda.graph's
  // does); threads allocate into their pool and into the device's stack,
  // record the capturing stream on their blocks, and free across threads
  // while windows are open. Every call runs in relaxed capture mode, as the
  // native registration's do; the fake driver counts any call a real
  // capture would refuse.
  using BeginCapture = unsigned long long (*)(void*, int);
  using EndCapture = int (*)(void*);
  using Exchange = int (*)(int*);
  using Violations = long long (*)();
  auto begin_capture = reinterpret_cast<BeginCapture>(dlsym(fake_driver, "fake_cuda_begin_capture"));
  auto end_capture = reinterpret_cast<EndCapture>(dlsym(fake_driver, "fake_cuda_end_capture"));
  auto exchange = reinterpret_cast<Exchange>(dlsym(fake_driver, "cuThreadExchangeStreamCaptureMode"));
  auto violations = reinterpret_cast<Violations>(dlsym(fake_driver, "fake_cuda_capture_violations"));
  if (!begin_capture || !end_capture || !exchange || !violations) fail("the fake driver has no captures");
  std::atomic<std::uint64_t> pool_allocs{0}, captures{0};
  void* capturing = stream_of(100);
  auto pool_worker = [&](int tid) {
    std::mt19937_64 rng(seed * 104729 + tid);
    int relaxed = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED
    exchange(&relaxed);
    const std::uint64_t pool_id = static_cast<std::uint64_t>(tid) + 1;
    void* pool_stream = tid == 0 ? capturing : stream_of(100 + tid);
    void* own_stream = stream_of(200 + tid);
    char message[256];
    auto ok = [&](int result, const char* what) {
      if (result != kWaterwaveMallocOk) fail(std::string(what) + ": " + message);
    };
    ok(waterwave_cuda_pool_create(0, 0, pool_id, message, sizeof message), "pool_create");
    std::vector<Held> mine;
    try {
      for (int round = 0; round < 20 && !failed; ++round) {
        ok(waterwave_cuda_pool_begin(0, 0, pool_id, message, sizeof message), "pool_begin");
        const bool capture = tid == 0 && begin_capture(capturing, 0) != 0;
        for (std::uint64_t i = 0; i < ops / 200 && !failed; ++i) {
          const std::uint64_t r = rng() % 100;
          if (r < 45 && mine.size() < 32) {
            const std::size_t size = 1 + rng() % (rng() % 8 == 0 ? 4 * kMiB : 128 * kKiB);
            const bool in_pool = rng() % 2 == 0;
            void* stream = in_pool ? pool_stream : own_stream;
            void* p = nullptr;
            const int result = in_pool ? waterwave_cuda_pool_malloc(0, 0, pool_id, size, stream, &p,
                                                                    message, sizeof message)
                                       : waterwave_cuda_try_malloc(size, 0, stream, &p, message,
                                                                   sizeof message);
            if (result == kWaterwaveMallocOutOfMemory) {
              ++ooms;
            } else if (result != kWaterwaveMallocOk || !p) {
              fail(std::string("allocation beside a pool window failed: ") + message);
            } else {
              if (in_pool) ++pool_allocs;
              const auto byte = static_cast<unsigned char>(rng());
              std::memset(p, byte, size);
              mine.push_back({p, size, stream, byte});
              if (!in_pool && rng() % 3 == 0) waterwave_cuda_record_stream(p, capturing);
            }
          } else if (r < 90 && !mine.empty()) {
            Held b = take_any(mine, rng);
            if (!intact(b)) fail("a block beside a pool window was overwritten");
            if (rng() % 4 == 0) {
              std::lock_guard<std::mutex> g(handoff_mu);
              handoff.push_back(b);
            } else {
              waterwave_cuda_free_owned(b.ptr);
            }
          } else {
            std::vector<Held> take;
            {
              std::lock_guard<std::mutex> g(handoff_mu);
              take.swap(handoff);
            }
            for (const Held& b : take) {
              if (!intact(b)) fail("a handed-off pool block was overwritten");
              waterwave_cuda_free_owned(b.ptr);
            }
          }
        }
        if (capture) {
          ++captures;
          if (end_capture(capturing) != 0) fail("a capture was invalidated by an allocator call");
        }
        ok(waterwave_cuda_pool_end(0, 0, pool_id, message, sizeof message), "pool_end");
        ok(waterwave_cuda_pool_release(0, 0, pool_id, message, sizeof message), "pool_release");
      }
    } catch (const std::exception& e) {
      fail(e.what());
    }
    for (const Held& b : mine) waterwave_cuda_free_owned(b.ptr);
    ok(waterwave_cuda_pool_release(0, 0, pool_id, message, sizeof message), "pool_release");
  };
  std::vector<std::thread> pool_threads;
  for (int t = 0; t < threads; ++t) pool_threads.emplace_back(pool_worker, t);
  for (auto& t : pool_threads) t.join();
  for (const Held& b : handoff) waterwave_cuda_free_owned(b.ptr);
  handoff.clear();
  // A pool restored to a checkpoint (setCheckpointPoolState), as CUDA graph
  // trees do: its blocks then come back where they were, the others go.
  {
    char message[256];
    const std::uint64_t id = 1000;
    void* stream = stream_of(0);
    waterwave_cuda_pool_create(0, 0, id, message, sizeof message);
    std::vector<WaterwaveLiveBlock> checkpoint;
    std::vector<void*> later;
    waterwave_cuda_pool_begin(0, 0, id, message, sizeof message);
    for (std::size_t size : {4096ul, 3 * kMiB, 512ul, 700 * kKiB}) {
      void* p = nullptr;
      waterwave_cuda_pool_malloc(0, 0, id, size, stream, &p, message, sizeof message);
      std::size_t block = 0;
      waterwave_cuda_allocation_size(p, &block, message, sizeof message);
      checkpoint.push_back({reinterpret_cast<std::uintptr_t>(p), block, size});
    }
    waterwave_cuda_free_owned(reinterpret_cast<void*>(checkpoint[1].addr));
    for (std::size_t size : {kMiB, 2 * kMiB}) {
      void* p = nullptr;
      waterwave_cuda_pool_malloc(0, 0, id, size, stream, &p, message, sizeof message);
      later.push_back(p);
    }
    waterwave_cuda_pool_end(0, 0, id, message, sizeof message);
    waterwave_cuda_pool_release(0, 0, id, message, sizeof message);
    std::vector<std::uintptr_t> freed;
    const int restored = waterwave_cuda_pool_restore(
        0, 0, id, checkpoint.data(), checkpoint.size(), &freed,
        [](void* context, std::uintptr_t addr) {
          static_cast<std::vector<std::uintptr_t>*>(context)->push_back(addr);
        },
        message, sizeof message);
    if (restored != 0) fail(std::string("restoring a pool failed: ") + message);
    if (freed.size() != checkpoint.size() - 1 + later.size()) fail("a restore freed the wrong blocks");
    for (const WaterwaveLiveBlock& b : checkpoint) {
      std::size_t block = 0;
      if (waterwave_cuda_allocation_size(reinterpret_cast<void*>(b.addr), &block, message,
                                         sizeof message) != 0 || block != b.size) {
        fail("a restored block is not where it was");
      }
      waterwave_cuda_free_owned(reinterpret_cast<void*>(b.addr));
    }
    waterwave_cuda_pool_release(0, 0, id, message, sizeof message);
  }
  if (violations && violations() != 0) fail("allocator calls broke a capture's rules");
  if (rt.pools(0).active()) fail("pools, windows or deferred frees were left behind");
  rt.stack(0).check_invariants();

  const auto errors = rt.free_errors();
  if (errors.first) fail("bad frees: " + errors.second);
  rt.reset();
  // Everything went back to the driver (the fake counts its bytes).
  auto counter = fake_driver ? reinterpret_cast<long long (*)(const char*)>(dlsym(fake_driver, "fake_cuda_counter"))
                             : nullptr;
  if (!counter) fail("cannot read the fake driver's counters");
  else if (counter("bytes_in_use") != 0) fail("driver memory leaked");
  std::printf("cuda_backend_run %s%s%s: %d threads x %llu ops, %llu OOMs, %lld device waits "
              "of sharing members, %lld allocations past their measured budget, "
              "%llu map failures injected "
              "(%llu allocations failed with the driver's error), plan of %zu slots served %lld "
              "allocations, %llu pool allocations in %llu captures, %s\n",
              policy.c_str(), config.empty() ? "" : " ", config.c_str(), threads,
              static_cast<unsigned long long>(ops),
              static_cast<unsigned long long>(ooms.load()), device_waits, overdrawn,
              static_cast<unsigned long long>(injected.load()),
              static_cast<unsigned long long>(driver_errors.load()), trace.size(),
              static_cast<long long>(ps.planned),
              static_cast<unsigned long long>(pool_allocs.load()),
              static_cast<unsigned long long>(captures.load()), failed ? "FAILED" : "invariants held");
  return failed ? 1 : 0;
}
