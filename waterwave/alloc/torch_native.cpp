// The native registration: a full c10::cuda::CUDACachingAllocator::
// CUDAAllocator over Waterwave's CUDA runtime, installed in PyTorch's place
// as its own caching allocator is, so that PyTorch's memory functions
// (torch.cuda.memory_stats, max_memory_allocated, memory_summary,
// reset_peak_memory_stats, _record_memory_history, _snapshot), cuDNN's
// benchmark mode (cacheInfo) and the rest work unchanged.
//
// torch's pluggable allocator (CUDAPluggableAllocator) refuses most of
// these; this class answers them from Waterwave's statistics, snapshot and
// history through the C ABI of native_abi.h, handed over as function
// pointers by waterwave_native_init (waterwave._C hides its C++ symbols, and
// builds without torch). It is compiled against the torch in use, with
// c10_cuda's headers and the CUDA runtime's (torch_native.py next door).
//
// Private pools (CUDA graphs, torch.cuda.MemPool) are Waterwave stacks of
// their own (csrc/runtime/private_pools.h): while a pool's window is open,
// an allocation whose stream passes PyTorch's filter goes to the pool, and
// every allocator call runs in relaxed capture mode, so that Waterwave's
// own device calls never count as a capture's. What has no safe meaning
// here is refused with a TORCH_CHECK naming it and the fix (IPC handles,
// allocating at a given address), never silently wrong.
//
// May include: c10, c10/cuda, torch/headeronly/version.h, the CUDA runtime's
// headers, native_abi.h.
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/headeronly/version.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "native_abi.h"

#define WATERWAVE_NATIVE_EXPORT extern "C" __attribute__((visibility("default")))

// The project pins torch 2.14, but the GPU machines that check this file
// have had torch 2.11, whose CUDAAllocator lacks three members: a pointer's
// recorded context and the OOM-rejection observers (added in 2.12), and
// allocating at a given address (2.13). Built against an older torch they
// are left out, as nothing there calls them. (Built against the headers of
// 2.11.0, 2.12.1 and 2.14.1 and linked against their c10 libraries; when each
// member arrived, read in 2.12.1's and 2.13.0's CUDACachingAllocator.h.)
#define WATERWAVE_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||            \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;

constexpr int kOk = 0;
constexpr int kOutOfMemory = 1;
constexpr int kTryMallocAbi = 1;  // csrc/runtime/pytorch_abi.h
constexpr std::size_t kMessage = 2048;

// waterwave._C's entry points (csrc/runtime/pytorch_abi.h, native_abi.h).
struct Core {
  int (*try_malloc)(std::size_t, int, void*, void**, char*, std::size_t);
  void (*free_owned)(void*);
  void (*record_stream)(void*, void*);
  void (*empty_cache)();
  int (*device_stats)(int, WaterwaveDeviceStats*, char*, std::size_t);
  int (*reset_stats)(int, int, char*, std::size_t);
  int (*memory_fraction)(int, double, double*, char*, std::size_t);
  int (*mem_info)(int, std::size_t*, std::size_t*, char*, std::size_t);
  int (*allocation_size)(void*, std::size_t*, char*, std::size_t);
  int (*visit_segments)(void*, WaterwaveSegmentVisitor, char*, std::size_t);
  int (*record_history)(int, std::size_t, char*, std::size_t);
  int (*history_enabled)();
  int (*visit_history)(void*, WaterwaveTraceVisitor, char*, std::size_t);
  int (*pool_create)(int, std::uint64_t, std::uint64_t, char*, std::size_t);
  int (*pool_begin)(int, std::uint64_t, std::uint64_t, char*, std::size_t);
  int (*pool_end)(int, std::uint64_t, std::uint64_t, char*, std::size_t);
  int (*pool_release)(int, std::uint64_t, std::uint64_t, char*, std::size_t);
  int (*pool_use_count)(int, std::uint64_t, std::uint64_t);
  int (*pool_malloc)(int, std::uint64_t, std::uint64_t, std::size_t, void*, void**, char*,
                     std::size_t);
  int (*pools_empty)(char*, std::size_t);
  int (*pool_restore)(int, std::uint64_t, std::uint64_t, const WaterwaveLiveBlock*, std::size_t,
                      void*, WaterwaveAddrVisitor, char*, std::size_t);
};
Core core{};

// Open pool windows (beginAllocateToPool without its end yet), any device.
// Zero on the fast path: one relaxed load per call.
std::atomic<int> windows_open{0};

// While a window is open, Waterwave's device calls run in relaxed capture
// mode: a capture in PyTorch's default (global) mode would otherwise refuse
// them from any thread, and none of them touches the capturing stream.
class RelaxedDuringWindows {
 public:
  RelaxedDuringWindows() {
    if (windows_open.load(std::memory_order_acquire) != 0) guard_.emplace(cudaStreamCaptureModeRelaxed);
  }

 private:
  std::optional<c10::cuda::CUDAStreamCaptureModeGuard> guard_;
};

// A call into _C that failed: a c10::Error carrying its message.
void check(int result, const char* message, const char* what) {
  TORCH_CHECK(result == kOk, "Waterwave allocator: ", what, ": ", message);
}

void copy(const WaterwaveStat& from, c10::CachingAllocator::Stat& to) {
  to.current = from.current;
  to.peak = from.peak;
  to.allocated = from.allocated;
  to.freed = from.freed;
}

void copy(const WaterwaveStat (&from)[3], c10::CachingAllocator::StatArray& to) {
  for (int i = 0; i < 3; ++i) copy(from[i], to[static_cast<std::size_t>(i)]);
}

void deleter(void* ptr) {
  RelaxedDuringWindows relaxed;
  core.free_owned(ptr);
}

// A checkpoint of a private pool (getCheckpointState): the pool and its
// allocated blocks then, which setCheckpointPoolState hands out again.
struct PoolCheckpoint final : cca::AllocatorState {
  c10::DeviceIndex device = 0;
  c10::MempoolId_t pool{0, 0};
  std::vector<WaterwaveLiveBlock> live;
};

class WaterwaveAllocator final : public cca::CUDAAllocator {
 public:
  // ---- Allocation ----
  c10::DataPtr allocate(std::size_t size) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    if (size == 0) return {nullptr, nullptr, &deleter, c10::Device(c10::DeviceType::CUDA, device)};
    void* ptr = malloc(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
    return {ptr, ptr, &deleter, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &deleter; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }
  void* raw_alloc(std::size_t nbytes) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  void* raw_alloc_with_stream(std::size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    return malloc(nbytes, c10::cuda::current_device(), stream);
  }
  void raw_delete(void* ptr) override { deleter(ptr); }

  // ---- The allocator as a whole ----
  void init(int /*device_count*/) override { initialized_.store(true); }
  bool initialized() override { return initialized_.load(); }
  double getMemoryFraction(c10::DeviceIndex device) override {
    return fraction(device, 0.0);
  }
  void setMemoryFraction(double value, c10::DeviceIndex device) override {
    TORCH_CHECK(value > 0.0 && value <= 1.0, "set_per_process_memory_fraction: the fraction must "
                "be in (0, 1], got ", value);
    fraction(device, value);
  }
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};
  }
  void enable(bool value) override {
    TORCH_CHECK(value, "the Waterwave allocator cannot be switched off in a process that "
                "installed it: start the process without waterwave.install_allocator() to use "
                "cudaMalloc directly");
  }
  bool isEnabled() const override { return true; }
  // A private pool's cache goes back once the pool is released (its use
  // count at zero), as PyTorch's MemPool does on destruction.
  void emptyCache(c10::MempoolId_t mempool_id) override {
    RelaxedDuringWindows relaxed;
    if (is_private(mempool_id)) {
      char message[kMessage];
      check(core.pools_empty(message, sizeof message), message, "emptyCache of a private pool");
      return;
    }
    core.empty_cache();
  }
  // cuDNN's benchmark mode asks how large a workspace could be: the largest
  // cached free block, or the device's free memory if that is larger (as
  // PyTorch's caching allocator answers when *largest starts at 0).
  void cacheInfo(c10::DeviceIndex device, std::size_t* largest) override {
    const WaterwaveDeviceStats s = stats(device);
    if (*largest == 0) {
      std::size_t free = 0, total = 0;
      char message[kMessage];
      check(core.mem_info(device, &free, &total, message, sizeof message), message,
            "reading the device's free memory");
      *largest = free;
    }
    *largest = std::max<std::size_t>(*largest, static_cast<std::size_t>(s.largest_free_block));
  }
  void* getBaseAllocation(void* ptr, std::size_t* size) override {
    char message[kMessage];
    check(core.allocation_size(ptr, size, message, sizeof message), message,
          "getBaseAllocation");
    return ptr;
  }
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (ptr.get() == nullptr) return;
    RelaxedDuringWindows relaxed;
    core.record_stream(ptr.get(), stream.stream());
  }

  // ---- Statistics ----
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    const WaterwaveDeviceStats s = stats(device);
    DeviceStats out;
    copy(s.allocation, out.allocation);
    copy(s.segment, out.segment);
    copy(s.active, out.active);
    copy(s.inactive_split, out.inactive_split);
    copy(s.allocated_bytes, out.allocated_bytes);
    copy(s.reserved_bytes, out.reserved_bytes);
    copy(s.active_bytes, out.active_bytes);
    copy(s.inactive_split_bytes, out.inactive_split_bytes);
    copy(s.requested_bytes, out.requested_bytes);
    copy(s.oversize_allocations, out.oversize_allocations);
    copy(s.oversize_segments, out.oversize_segments);
    out.num_alloc_retries = s.num_alloc_retries;
    out.num_ooms = s.num_ooms;
    out.num_sync_all_streams = s.num_sync_all_streams;
    out.num_device_alloc = s.num_device_alloc;
    out.num_device_free = s.num_device_free;
    out.max_split_size = s.max_split_size;
    return out;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override { reset(device, 1); }
  void resetPeakStats(c10::DeviceIndex device) override { reset(device, 0); }

  // ---- Snapshot and history ----
  // {0, 0}: every segment, private pools' included (each names its pool);
  // a private pool: its segments only.
  cca::SnapshotInfo snapshot(c10::MempoolId_t mempool_id, bool include_traces) override {
    cca::SnapshotInfo info;
    SnapshotVisit visit{this, &info, mempool_id};
    char message[kMessage];
    check(core.visit_segments(&visit, &WaterwaveAllocator::add_segment, message, sizeof message),
          message, "snapshot");
    info.device_traces.resize(static_cast<std::size_t>(c10::cuda::device_count()));
    if (include_traces) {
      check(core.visit_history(&visit, &WaterwaveAllocator::add_trace, message, sizeof message),
            message, "snapshot's history");
    }
    info.config_metadata.last_allocator_settings = "waterwave";
    return info;
  }
  bool isHistoryEnabled() override { return core.history_enabled() != 0; }
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder,
                     std::size_t alloc_trace_max_entries, cca::RecordContext when,
                     bool clear_history, const std::vector<std::string>& /*skip_actions*/) override {
    char message[kMessage];
    if (clear_history || !enabled) {  // Waterwave's history drops what it had when stopped
      check(core.record_history(0, 0, message, sizeof message), message, "recordHistory");
    }
    if (enabled) {
      check(core.record_history(1, alloc_trace_max_entries, message, sizeof message), message,
            "recordHistory");
    }
    recorder_.store(enabled && when != cca::RecordContext::NEVER ? context_recorder : nullptr);
    std::lock_guard<std::mutex> g(mu_);
    if (!enabled) contexts_.clear();
  }
  // The context recorded when ``ptr`` was allocated (history on), for
  // snapshots and, from torch 2.12, PyTorch's own lookups.
  std::shared_ptr<c10::GatheredContext> context_of(const void* ptr) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = contexts_.find(ptr);
    return it == contexts_.end() ? nullptr : it->second;
  }
#if WATERWAVE_TORCH_AT_LEAST(2, 12)
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* ptr) override {
    return context_of(ptr);
  }
#endif

  // ---- Observers ----
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> g(mu_);
    oom_observers_.push_back(std::move(observer));
  }
#if WATERWAVE_TORCH_AT_LEAST(2, 12)
  void attachOomRejectionObserver(cca::OomRejectionObserver /*observer*/) override {
    // Waterwave never rejects a request before trying the device
    // (PyTorch's throw_on_cudamalloc_oom policy): nothing to report.
  }
#endif
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker /*tracker*/) override {
    TORCH_CHECK(false, "the Waterwave allocator does not report segment events to trace "
                "trackers (NCCL's buffer registration): unset "
                "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK, or run without "
                "waterwave.install_allocator()");
  }

  // ---- Private pools: CUDA graphs and torch.cuda.MemPool ----
  // Called before cudaStreamBeginCapture (and by use_mem_pool): from now
  // on, allocations on `device` whose stream passes `filter` go to the pool.
  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    char message[kMessage];
    check(core.pool_begin(device, mempool_id.first, mempool_id.second, message, sizeof message),
          message, "beginAllocateToPool");
    std::lock_guard<std::mutex> g(mu_);
    auto routes = std::make_shared<std::vector<Route>>(*routes_);
    routes->push_back({device, mempool_id, std::move(filter)});
    routes_ = std::move(routes);
    windows_open.fetch_add(1, std::memory_order_acq_rel);
  }
  // Called after cudaStreamEndCapture: the frees held during the window run.
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    {
      std::lock_guard<std::mutex> g(mu_);
      auto routes = std::make_shared<std::vector<Route>>(*routes_);
      auto it = std::find_if(routes->begin(), routes->end(), [&](const Route& r) {
        return r.device == device && r.pool == mempool_id;
      });
      TORCH_CHECK(it != routes->end(), "endAllocateToPool: allocations on device ", int(device),
                  " do not go to memory pool (", mempool_id.first, ", ", mempool_id.second, ")");
      routes->erase(it);
      routes_ = std::move(routes);
    }
    windows_open.fetch_sub(1, std::memory_order_acq_rel);
    char message[kMessage];
    check(core.pool_end(device, mempool_id.first, mempool_id.second, message, sizeof message),
          message, "endAllocateToPool");
  }
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    RelaxedDuringWindows relaxed;
    char message[kMessage];
    check(core.pool_release(device, mempool_id.first, mempool_id.second, message,
                            sizeof message),
          message, "releasePool");
  }
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    TORCH_CHECK(allocator == nullptr, "torch.cuda.MemPool with an allocator of its own is not "
                "supported under the Waterwave allocator (its pools are Waterwave's): create "
                "the MemPool without `allocator`, or run without waterwave.install_allocator()");
    char message[kMessage];
    check(core.pool_create(device, mempool_id.first, mempool_id.second, message, sizeof message),
          message, "createOrIncrefPool");
  }
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    return core.pool_use_count(device, mempool_id.first, mempool_id.second);
  }
  void setUseOnOOM(c10::DeviceIndex, c10::MempoolId_t, bool use_on_oom) override {
    TORCH_CHECK(!use_on_oom, "torch.cuda.MemPool(use_on_oom=True) is not supported under the "
                "Waterwave allocator: a pool's memory is never lent to other allocations; "
                "create the pool without use_on_oom");
  }
  void setNoSplit(c10::DeviceIndex, c10::MempoolId_t) override {
    TORCH_CHECK(false, "torch.cuda.MemPool(no_split=True) is not supported under the Waterwave "
                "allocator: create the pool without no_split, or set max_split_size_mb in "
                "waterwave.install_allocator(config=...) to keep large blocks whole");
  }
  // cudagraph trees (torch.compile's reduce-overhead mode) check that a
  // pool's live blocks are exactly the tensors they expect.
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected) override {
    std::size_t live = 0;
    bool all_expected = true;
    for_each_live_block(device, mempool_id, [&](const WaterwaveBlockView& b) {
      ++live;
      all_expected = all_expected && expected.count(reinterpret_cast<void*>(b.addr)) != 0;
    });
    return all_expected && live == expected.size();
  }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          c10::MempoolId_t mempool_id) override {
    auto state = std::make_shared<PoolCheckpoint>();
    state->device = device;
    state->pool = mempool_id;
    for_each_live_block(device, mempool_id, [&](const WaterwaveBlockView& b) {
      state->live.push_back({b.addr, b.size, b.requested});
    });
    return state;
  }
  // CUDA graph trees (torch.compile's reduce-overhead mode), before they
  // record a new graph in the middle of a replayed path: the pool's blocks
  // become the checkpoint's again. PyTorch's binding then strips the
  // deleters of stale tensors and gives the returned DataPtrs to the live.
  cca::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device, std::shared_ptr<cca::AllocatorState> as) override {
    auto state = std::dynamic_pointer_cast<PoolCheckpoint>(as);
    TORCH_CHECK(state, "setCheckpointPoolState: the state was not taken by the Waterwave "
                "allocator (getCheckpointState of this process)");
    TORCH_CHECK(state->device == device, "setCheckpointPoolState: the state is device ",
                int(state->device), "'s, not device ", int(device), "'s");
    cca::CheckpointDelta delta;
    char message[kMessage];
    check(core.pool_restore(
              device, state->pool.first, state->pool.second, state->live.data(),
              state->live.size(), &delta.ptrs_freed,
              [](void* context, std::uintptr_t addr) {
                static_cast<std::vector<void*>*>(context)->push_back(reinterpret_cast<void*>(addr));
              },
              message, sizeof message),
          message, "setCheckpointPoolState");
    for (const WaterwaveLiveBlock& b : state->live) {
      void* ptr = reinterpret_cast<void*>(b.addr);
      delta.dataptrs_allocd.emplace_back(ptr, ptr, &deleter,
                                         c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  // ---- What has no meaning here ----
#if WATERWAVE_TORCH_AT_LEAST(2, 13)
  c10::DataPtr allocateWithAddress(std::size_t, void*) override {
    TORCH_CHECK(false, "allocating at a given address is not supported by the Waterwave "
                "allocator: run without waterwave.install_allocator() for code that needs it");
  }
#endif
  cca::ShareableHandle shareIpcHandle(void*) override { refuse_ipc(); }
  std::shared_ptr<void> getIpcDevPtr(std::string) override { refuse_ipc(); }
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    const cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();  // already on: clear the error
    } else {
      C10_CUDA_CHECK(err);
    }
  }
  cudaError_t memcpyAsync(void* dst, int /*dstDevice*/, const void* src, int /*srcDevice*/,
                          std::size_t count, cudaStream_t stream, bool /*p2p_enabled*/) override {
    // Waterwave's memory comes from cuMemAlloc or cuMemMap with access set
    // for its own device; a plain copy serves both.
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  }
  std::string name() override { return "waterwave"; }

 private:
  struct Route {
    c10::DeviceIndex device;
    c10::MempoolId_t pool;
    std::function<bool(cudaStream_t)> filter;
  };

  // The pool an allocation on (device, stream) goes to, if a window routes it.
  std::optional<c10::MempoolId_t> route(c10::DeviceIndex device, cudaStream_t stream) {
    std::shared_ptr<const std::vector<Route>> open;
    {
      std::lock_guard<std::mutex> g(mu_);
      open = routes_;  // a reference: windows replace the list, never change it
    }
    for (const Route& r : *open) {  // filters run unlocked: they call CUDA
      if (r.device == device && r.filter(stream)) return r.pool;
    }
    return std::nullopt;
  }

  void* malloc(std::size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    void* out = nullptr;
    char message[kMessage];
    int result;
    if (windows_open.load(std::memory_order_acquire) == 0) {  // the fast path
      result = core.try_malloc(size, device, stream, &out, message, sizeof message);
    } else {
      c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
      if (const auto pool = route(device, stream)) {
        result = core.pool_malloc(device, pool->first, pool->second, size, stream, &out, message,
                                  sizeof message);
      } else {
        result = core.try_malloc(size, device, stream, &out, message, sizeof message);
      }
    }
    if (result == kOk) {
      note_context(out);
      return out;
    }
    if (result == kOutOfMemory) {
      notify_oom(device);
      // Torch's messages start "CUDA out of memory."; code that matches on
      // it keeps working. Ours say "out of memory: tried to allocate ...".
      std::string what(message);
      const std::string ours = "out of memory: t";
      if (what.compare(0, ours.size(), ours) == 0) what = "T" + what.substr(ours.size());
      C10_THROW_ERROR(OutOfMemoryError, "CUDA out of memory (Waterwave allocator). " + what);
    }
    C10_THROW_ERROR(Error, std::string("Waterwave allocator: ") + message);
  }

  // With history recorded with stacks, the context of each live allocation.
  void note_context(void* ptr) {
    const cca::CreateContextFn recorder = recorder_.load(std::memory_order_relaxed);
    if (!recorder) return;  // the fast path: no history with stacks
    std::shared_ptr<c10::GatheredContext> context = recorder();
    std::lock_guard<std::mutex> g(mu_);
    if (contexts_.size() > 1'000'000) contexts_.clear();  // bounded: frees go unseen here
    contexts_[ptr] = std::move(context);
  }

  void notify_oom(c10::DeviceIndex device) {
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> g(mu_);
      observers = oom_observers_;
    }
    if (observers.empty()) return;
    const WaterwaveDeviceStats s = stats(device);
    std::size_t free = 0, total = 0;
    char message[kMessage];
    if (core.mem_info(device, &free, &total, message, sizeof message) != kOk) free = total = 0;
    for (const auto& observer : observers) {
      observer(device, static_cast<std::size_t>(s.allocated_bytes[0].current), total, free);
    }
  }

  WaterwaveDeviceStats stats(c10::DeviceIndex device) {
    WaterwaveDeviceStats s{};
    char message[kMessage];
    check(core.device_stats(device, &s, message, sizeof message), message, "memory statistics");
    return s;
  }

  void reset(c10::DeviceIndex device, int which) {
    char message[kMessage];
    check(core.reset_stats(device, which, message, sizeof message), message,
          which ? "resetting accumulated statistics" : "resetting peak statistics");
  }

  double fraction(c10::DeviceIndex device, double value) {
    double out = 0.0;
    char message[kMessage];
    check(core.memory_fraction(device, value, &out, message, sizeof message), message,
          "the per-process memory fraction");
    return out;
  }

  static bool is_private(c10::MempoolId_t id) { return id.first != 0 || id.second != 0; }

  // The live blocks of one private pool on one device.
  void for_each_live_block(c10::DeviceIndex device, c10::MempoolId_t pool,
                           const std::function<void(const WaterwaveBlockView&)>& fn) {
    struct Visit {
      c10::DeviceIndex device;
      c10::MempoolId_t pool;
      const std::function<void(const WaterwaveBlockView&)>* fn;
    } visit{device, pool, &fn};
    char message[kMessage];
    check(core.visit_segments(
              &visit,
              [](void* context, const WaterwaveSegmentView* view) {
                auto* v = static_cast<Visit*>(context);
                if (view->device != v->device || view->pool_first != v->pool.first ||
                    view->pool_second != v->pool.second) {
                  return;
                }
                for (std::size_t i = 0; i < view->num_blocks; ++i) {
                  if (view->blocks[i].allocated) (*v->fn)(view->blocks[i]);
                }
              },
              message, sizeof message),
          message, "a private pool's live blocks");
  }

  struct SnapshotVisit {
    WaterwaveAllocator* self;
    cca::SnapshotInfo* info;
    c10::MempoolId_t pool;  // {0, 0}: every segment
  };

  static void add_segment(void* context, const WaterwaveSegmentView* view) {
    auto* v = static_cast<SnapshotVisit*>(context);
    if (is_private(v->pool) &&
        (view->pool_first != v->pool.first || view->pool_second != v->pool.second)) {
      return;
    }
    c10::CachingDeviceAllocator::SegmentInfo seg;
    seg.owner_private_pool_id = {view->pool_first, view->pool_second};
    seg.device = static_cast<c10::DeviceIndex>(view->device);
    seg.address = view->addr;
    seg.total_size = view->size;
    seg.stream = view->stream;
    seg.is_large = view->is_large != 0;
    seg.is_expandable = view->is_expandable != 0;
    for (std::size_t i = 0; i < view->num_blocks; ++i) {
      const WaterwaveBlockView& b = view->blocks[i];
      c10::CachingDeviceAllocator::BlockInfo block;
      block.size = b.size;
      block.requested_size = b.requested;
      block.allocated = b.allocated != 0;
      block.active = b.active != 0;
      if (block.allocated) {
        block.context_when_allocated = v->self->context_of(reinterpret_cast<void*>(b.addr));
        seg.allocated_size += b.size;
      }
      if (block.active) {
        seg.active_size += b.size;
        seg.requested_size += b.requested;
      }
      seg.blocks.push_back(std::move(block));
    }
    v->info->segments.push_back(std::move(seg));
  }

  static void add_trace(void* context, const WaterwaveTraceView* view) {
    auto* v = static_cast<SnapshotVisit*>(context);
    using Action = c10::CachingDeviceAllocator::TraceEntry::Action;
    const std::string action(view->action);
    Action kind = Action::ALLOC;
    if (action == "free_requested") kind = Action::FREE_REQUESTED;
    else if (action == "free_completed") kind = Action::FREE_COMPLETED;
    else if (action == "segment_alloc") kind = Action::SEGMENT_ALLOC;
    else if (action == "segment_free") kind = Action::SEGMENT_FREE;
    else if (action == "segment_map") kind = Action::SEGMENT_MAP;
    else if (action == "segment_unmap") kind = Action::SEGMENT_UNMAP;
    else if (action == "oom") kind = Action::OOM;
    auto& traces = v->info->device_traces;
    const auto device = static_cast<std::size_t>(view->device);
    if (traces.size() <= device) traces.resize(device + 1);
    std::shared_ptr<c10::GatheredContext> context_when =
        kind == Action::ALLOC ? v->self->context_of(reinterpret_cast<void*>(view->addr))
                              : nullptr;
    c10::CachingDeviceAllocator::TraceEntry entry(kind, static_cast<c10::DeviceIndex>(view->device),
                                                 view->addr, view->size, view->stream, {0, 0},
                                                 0, std::move(context_when));
    entry.time_.t_ = static_cast<time_t>(unix_us(view->time_us));
    traces[device].push_back(std::move(entry));
  }

  // The history's steady-clock microseconds as Unix microseconds, the unit
  // PyTorch's snapshot reports.
  static double unix_us(double steady_us) {
    using namespace std::chrono;
    const double now_steady = duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
    const double now_unix = duration<double, std::micro>(system_clock::now().time_since_epoch()).count();
    return steady_us - now_steady + now_unix;
  }

  [[noreturn]] static void refuse_ipc() {
    TORCH_CHECK(false, "sharing CUDA memory with another process (IPC handles) is not supported "
                "by the Waterwave allocator: pass tensors between processes through the host, "
                "or run the sharing process without waterwave.install_allocator()");
  }

  std::atomic<bool> initialized_{false};
  std::mutex mu_;
  std::atomic<cca::CreateContextFn> recorder_{nullptr};
  std::unordered_map<const void*, std::shared_ptr<c10::GatheredContext>> contexts_;  // under mu_
  std::vector<cca::OutOfMemoryObserver> oom_observers_;                      // under mu_
  // The open windows; replaced whole under mu_, so an allocation reads them
  // unlocked from the reference it took.
  std::shared_ptr<const std::vector<Route>> routes_ = std::make_shared<std::vector<Route>>();
};

}  // namespace

// The entry points _C gives, by name, in the order of Core; its ABI
// versions. 0 on success; else the version _C speaks (rebuild this).
WATERWAVE_NATIVE_EXPORT int waterwave_native_init(void* const* entry_points, int native_abi,
                                                  int try_malloc_abi) {
  if (native_abi != WATERWAVE_NATIVE_ABI) return native_abi;
  if (try_malloc_abi != kTryMallocAbi) return try_malloc_abi;
  void* const* e = entry_points;
  core.try_malloc = reinterpret_cast<decltype(core.try_malloc)>(e[0]);
  core.free_owned = reinterpret_cast<decltype(core.free_owned)>(e[1]);
  core.record_stream = reinterpret_cast<decltype(core.record_stream)>(e[2]);
  core.empty_cache = reinterpret_cast<decltype(core.empty_cache)>(e[3]);
  core.device_stats = reinterpret_cast<decltype(core.device_stats)>(e[4]);
  core.reset_stats = reinterpret_cast<decltype(core.reset_stats)>(e[5]);
  core.memory_fraction = reinterpret_cast<decltype(core.memory_fraction)>(e[6]);
  core.mem_info = reinterpret_cast<decltype(core.mem_info)>(e[7]);
  core.allocation_size = reinterpret_cast<decltype(core.allocation_size)>(e[8]);
  core.visit_segments = reinterpret_cast<decltype(core.visit_segments)>(e[9]);
  core.record_history = reinterpret_cast<decltype(core.record_history)>(e[10]);
  core.history_enabled = reinterpret_cast<decltype(core.history_enabled)>(e[11]);
  core.visit_history = reinterpret_cast<decltype(core.visit_history)>(e[12]);
  core.pool_create = reinterpret_cast<decltype(core.pool_create)>(e[13]);
  core.pool_begin = reinterpret_cast<decltype(core.pool_begin)>(e[14]);
  core.pool_end = reinterpret_cast<decltype(core.pool_end)>(e[15]);
  core.pool_release = reinterpret_cast<decltype(core.pool_release)>(e[16]);
  core.pool_use_count = reinterpret_cast<decltype(core.pool_use_count)>(e[17]);
  core.pool_malloc = reinterpret_cast<decltype(core.pool_malloc)>(e[18]);
  core.pools_empty = reinterpret_cast<decltype(core.pools_empty)>(e[19]);
  core.pool_restore = reinterpret_cast<decltype(core.pool_restore)>(e[20]);
  return 0;
}

// cuDNN's question, asked as cuDNN asks it (through PyTorch's allocator
// pointer): how large a workspace could be on `device`. For tests and
// diagnostics; starts from 0, as cuDNN's benchmark does.
WATERWAVE_NATIVE_EXPORT std::size_t waterwave_native_cache_info(int device) {
  std::size_t largest = 0;
  cca::cacheInfo(static_cast<c10::DeviceIndex>(device), &largest);
  return largest;
}

// Make the Waterwave allocator PyTorch's CUDA allocator, as
// torch.cuda.memory.change_current_allocator does for a pluggable one:
// refused (message filled, 1 returned) once PyTorch's current allocator
// has been initialized.
WATERWAVE_NATIVE_EXPORT int waterwave_native_install(char* message, std::size_t capacity) {
  static WaterwaveAllocator* instance = new WaterwaveAllocator();  // never destroyed
  cca::CUDAAllocator* current = cca::allocator.load();
  if (current == instance) return 0;
  if (current != nullptr && current->initialized()) {
    const std::string what = "PyTorch's CUDA allocator (" + current->name() +
                             ") is already in use";
    std::snprintf(message, capacity, "%s", what.c_str());
    return 1;
  }
  cca::allocator.store(instance);
  c10::SetAllocator(c10::DeviceType::CUDA, instance, UINT8_MAX);
  return 0;
}
