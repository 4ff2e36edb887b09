// The allocator on real GPUs: one allocator stack (alloc/stack.h) per CUDA
// device, over the driver backend (device/cuda), created at the device's
// first allocation. PyTorch reaches it through the C entry points
// (pytorch_abi.h); Python holds the same stack as a waterwave._C.AllocatorStack
// (bindings/bind_stack.cpp), through shared_stack().
//
// May include: core/, alloc/, device/cuda/.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../alloc/stack.h"
#include "../core/errors.h"
#include "../device/cuda/cuda_device.h"
#include "private_pools.h"
#include "thread_accounts.h"

namespace waterwave::cuda {

// A cudaStream_t as the core's opaque stream handle, and back.
inline StreamId stream_id(void* stream) {
  return static_cast<StreamId>(reinterpret_cast<std::uintptr_t>(stream));
}
inline void* stream_handle(StreamId stream) {
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(stream));
}

// Process-wide state behind the entry points.
class CudaRuntime {
 public:
  static CudaRuntime& get();

  // Policy, configuration and driver library for stacks created from now
  // on. Refused once any device has one (reset() first).
  void configure(PolicyKind policy, const AllocatorConfig& config, const std::string& driver);
  // Drops every device's stack, giving cached memory and arenas back.
  // Refused while any allocation is live. For tests and for re-configuring.
  void reset();

  // The device's stack, created on first use; it lives until reset().
  AllocatorStack& stack(int device);
  // The device's stack if it has one already (nothing allocated there yet:
  // nullptr), never creating one.
  AllocatorStack* stack_if_made(int device) {
    PerDevice* d = find(device);
    return d ? d->stack.get() : nullptr;
  }
  // The same stack, shared: a holder keeps it (and its device) alive past a
  // reset(), after which the device gets a new stack of its own.
  std::shared_ptr<AllocatorStack> shared_stack(int device);

  // The allocation path, as PyTorch's hooks call it. A sharing member's
  // allocation may wait for the others' frees, past its budget or where the
  // device runs out (then only after the error: off the hot path), or fail
  // (thread_accounts.h).
  Addr allocate(std::size_t bytes, int device, StreamId stream) {
    if (!accounts_.before_allocate(bytes)) throw OutOfMemoryError(ThreadAccounts::why());
    AllocatorStack& s = stack(device);
    const Addr ptr = allocate_or_wait(s, bytes, stream);
    accounts_.allocated_on(stream, ptr, [&] { return s.allocation_size(ptr); });
    return ptr;
  }
  void deallocate(Addr ptr, int device);

  // ---- Private pools (private_pools.h): CUDA graphs, torch.cuda.MemPool. ----
  PrivatePools& pools(int device) { return *stack_owner(device).pools; }
  Addr allocate_in_pool(PoolId pool, std::size_t bytes, int device, StreamId stream) {
    if (!accounts_.before_allocate(bytes)) throw OutOfMemoryError(ThreadAccounts::why());
    PrivatePools& p = pools(device);
    const Addr ptr = p.allocate(pool, bytes, stream);
    accounts_.allocated_on(stream, ptr, [&] { return p.owner(ptr)->allocation_size(ptr); });
    return ptr;
  }
  // beginAllocateToPool; the first window on the device first makes the
  // device's own cache synced (no stream may be left owing an event that
  // would have to be recorded while it captures).
  void begin_pool_window(int device, PoolId pool);
  // endAllocateToPool; the last window's end runs the frees it deferred.
  void end_pool_window(int device, PoolId pool);
  // setCheckpointPoolState (PrivatePools::restore), with thread accounts kept.
  void restore_pool(int device, PoolId pool, const std::vector<PrivatePools::LiveBlock>& live,
                    std::vector<Addr>& freed);
  // The hook names no device: the pointer belongs to the one stack that
  // holds it.
  void record_stream(Addr ptr, StreamId stream);
  // A free that names no device (PyTorch's DataPtr deleter): the stack that
  // holds the pointer frees it. With one device in use (the common case) no
  // search: that stack frees it or says the pointer is not its.
  void deallocate_owned(Addr ptr);
  // The stack holding the live allocation `ptr`; PointerError (`what` the
  // call) if none does.
  AllocatorStack& owner(Addr ptr, const char* what);
  void empty_cache();

  // Memory history on every device, those created later included.
  void record_history(bool enabled, std::size_t max_entries);
  bool history_enabled();

  // What each tagged thread allocates (thread_accounts.h).
  ThreadAccounts& accounts() { return accounts_; }

  std::vector<int> devices();  // devices with a stack, in order
  PolicyKind policy();
  AllocatorConfig config();
  std::string driver_path();

  // Problems the free hook met (it may not throw): count and the last one.
  std::pair<long long, std::string> free_errors();
  void note_free_error(const std::string& what);

 private:
  static constexpr int kMaxDevices = 64;
  struct PerDevice {
    std::unique_ptr<CudaDevice> device;
    std::unique_ptr<AllocatorStack> stack;  // destroyed before its device
    std::unique_ptr<PrivatePools> pools;    // likewise
    ~PerDevice() {
      pools.reset();
      stack.reset();
    }
    // Frees ptr if this device's stack or one of its pools holds it
    // (deferred while a pool window is open, if it must be); false if none.
    bool free_if_held(Addr ptr);
  };
  PerDevice* find(int device) const;  // nullptr if none yet
  PerDevice& create(int device);
  // s.allocate, and where it runs out of memory and the calling thread is
  // a sharing member, the wait for the others' frees (thread_accounts.h).
  Addr allocate_or_wait(AllocatorStack& s, std::size_t bytes, StreamId stream);
  PerDevice& stack_owner(int device) {
    if (PerDevice* d = find(device)) return *d;
    return create(device);
  }
  // The free of a pointer when pools are in play, or its device is unknown.
  void deallocate_slow(Addr ptr, PerDevice* first);

  std::mutex mu_;  // configuration and device creation, never the hot path
  PolicyKind policy_ = PolicyKind::kWaterwave;
  AllocatorConfig config_;
  std::string driver_;
  // The hot path reads devices_ (a relaxed lookup); owners_ (under mu_)
  // owns them, shared with the Python handles of shared_stack().
  std::array<std::atomic<PerDevice*>, kMaxDevices> devices_{};
  std::array<std::shared_ptr<PerDevice>, kMaxDevices> owners_{};
  // The device whose stack is the only one (-1: none or several), updated
  // under mu_ as stacks are made and dropped, read on the free path.
  std::atomic<int> sole_device_{-1};
  ThreadAccounts accounts_;
  std::atomic<long long> free_errors_{0};
  std::string last_free_error_;  // under mu_
  bool history_on_ = false;       // under mu_: applied to stacks as they are made
  std::size_t history_max_ = 0;
};

}  // namespace waterwave::cuda
