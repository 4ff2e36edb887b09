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
// What has no safe meaning here is refused with a TORCH_CHECK naming it and
// the fix (IPC handles, private pools for CUDA graphs, checkpointed pool
// state), never silently wrong.
//
// May include: c10, c10/cuda, the CUDA runtime's headers, native_abi.h.
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "native_abi.h"

#define WATERWAVE_NATIVE_EXPORT extern "C" __attribute__((visibility("default")))

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
};
Core core{};

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

void deleter(void* ptr) { core.free_owned(ptr); }

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
  void raw_delete(void* ptr) override { core.free_owned(ptr); }

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
  void emptyCache(c10::MempoolId_t mempool_id) override {
    refuse_pool(mempool_id, "emptyCache");
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
  cca::SnapshotInfo snapshot(c10::MempoolId_t mempool_id, bool include_traces) override {
    refuse_pool(mempool_id, "snapshot");
    cca::SnapshotInfo info;
    SnapshotVisit visit{this, &info};
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
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* ptr) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = contexts_.find(ptr);
    return it == contexts_.end() ? nullptr : it->second;
  }

  // ---- Observers ----
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> g(mu_);
    oom_observers_.push_back(std::move(observer));
  }
  void attachOomRejectionObserver(cca::OomRejectionObserver /*observer*/) override {
    // Waterwave never rejects a request before trying the device
    // (PyTorch's throw_on_cudamalloc_oom policy): nothing to report.
  }
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker /*tracker*/) override {
    TORCH_CHECK(false, "the Waterwave allocator does not report segment events to trace "
                "trackers (NCCL's buffer registration): unset "
                "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK, or run without "
                "waterwave.install_allocator()");
  }

  // ---- What has no meaning here ----
  void beginAllocateToPool(c10::DeviceIndex, c10::MempoolId_t, std::function<bool(cudaStream_t)>)
      override {
    refuse_graphs();
  }
  void endAllocateToPool(c10::DeviceIndex, c10::MempoolId_t) override { refuse_graphs(); }
  void releasePool(c10::DeviceIndex, c10::MempoolId_t) override { refuse_graphs(); }
  void createOrIncrefPool(c10::DeviceIndex, c10::MempoolId_t,
                          std::shared_ptr<cca::CUDAAllocator>) override {
    refuse_graphs();
  }
  int getPoolUseCount(c10::DeviceIndex, c10::MempoolId_t) override { refuse_graphs(); }
  void setUseOnOOM(c10::DeviceIndex, c10::MempoolId_t, bool) override { refuse_graphs(); }
  void setNoSplit(c10::DeviceIndex, c10::MempoolId_t) override { refuse_graphs(); }
  bool checkPoolLiveAllocations(c10::DeviceIndex, c10::MempoolId_t,
                                const std::unordered_set<void*>&) override {
    refuse_graphs();
  }
  c10::DataPtr allocateWithAddress(std::size_t, void*) override { refuse_graphs(); }
  cca::ShareableHandle shareIpcHandle(void*) override { refuse_ipc(); }
  std::shared_ptr<void> getIpcDevPtr(std::string) override { refuse_ipc(); }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex,
                                                          c10::MempoolId_t) override {
    refuse_graphs();
  }
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex,
                                              std::shared_ptr<cca::AllocatorState>) override {
    refuse_graphs();
  }
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
  void* malloc(std::size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    void* out = nullptr;
    char message[kMessage];
    const int result = core.try_malloc(size, device, stream, &out, message, sizeof message);
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

  struct SnapshotVisit {
    WaterwaveAllocator* self;
    cca::SnapshotInfo* info;
  };

  static void add_segment(void* context, const WaterwaveSegmentView* view) {
    auto* v = static_cast<SnapshotVisit*>(context);
    c10::CachingDeviceAllocator::SegmentInfo seg;
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
        block.context_when_allocated = v->self->getContextForPointer(reinterpret_cast<void*>(b.addr));
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
        kind == Action::ALLOC ? v->self->getContextForPointer(reinterpret_cast<void*>(view->addr))
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

  static void refuse_pool(c10::MempoolId_t id, const char* what) {
    TORCH_CHECK(id.first == 0 && id.second == 0, what, " of a private memory pool: the Waterwave "
                "allocator has no private pools (torch.cuda.MemPool, CUDA graphs)");
  }

  [[noreturn]] static void refuse_graphs() {
    TORCH_CHECK(false, "CUDA graphs and torch.cuda.MemPool need private memory pools, which the "
                "Waterwave allocator does not provide yet: capture graphs (torch.cuda.graph, "
                "torch.compile with mode='reduce-overhead') in a process without "
                "waterwave.install_allocator(), or use torch.compile's default mode");
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
