// The allocator on real GPUs: one allocator per CUDA device over the driver
// backend, reached by PyTorch through the C entry points below
// (torch.cuda.memory.CUDAPluggableAllocator) and by Python through _C.
//
// The entry points are exported from waterwave._C itself, so the Python
// bindings and PyTorch share one allocator state.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "../core/allocator.h"
#include "../core/plan_allocator.h"
#include "../core/trace_recorder.h"
#include "../device/cuda/cuda_device.h"

#define WATERWAVE_EXPORT extern "C" __attribute__((visibility("default")))

// PyTorch's pluggable allocator ABI (torch 2.14: CUDAPluggableAllocator.h).
// malloc throws on failure (PyTorch turns it into a RuntimeError); free never
// throws (PyTorch calls it from destructors) and reports problems on stderr.
WATERWAVE_EXPORT void* waterwave_cuda_malloc(std::size_t size, int device, void* stream);
WATERWAVE_EXPORT void waterwave_cuda_free(void* ptr, std::size_t size, int device, void* stream);
// Optional hooks: Tensor.record_stream and torch.cuda.empty_cache().
WATERWAVE_EXPORT void waterwave_cuda_record_stream(void* ptr, void* stream);
WATERWAVE_EXPORT void waterwave_cuda_empty_cache();

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

  // Policy, config string and driver library for allocators created from
  // now on. Refused once any device has an allocator (reset() first).
  void configure(const std::string& policy, const std::string& config, const std::string& driver);
  // Drops every device's allocator, giving cached memory back. Refused while
  // any allocation is live. For tests and for re-configuring.
  void reset();

  Addr allocate(std::size_t bytes, int device, StreamId stream);
  void deallocate(Addr ptr, int device);
  void record_stream(Addr ptr, StreamId stream);
  void empty_cache();

  // Calls fn(Allocator&) on the device's allocator (created on first use;
  // the plan if one is installed), which stays in place during the call.
  template <typename Fn>
  auto with_allocator(int device, Fn fn) {
    PerDevice& d = slot(device);
    std::shared_lock<std::shared_mutex> g(d.swap);
    return fn(*d.active);
  }
  // Serve the device's allocations from a plan, over the online allocator.
  void set_plan(int device, std::vector<PlanSlot> slots, std::size_t arena, StreamId stream);
  void clear_plan(int device);
  // Calls fn(PlanAllocator&); ConfigError if the device has no plan.
  template <typename Fn>
  auto with_plan(int device, Fn fn) {
    PerDevice& d = slot(device);
    std::shared_lock<std::shared_mutex> g(d.swap);
    if (!d.plan) no_plan(device);
    return fn(*d.plan);
  }
  bool has_plan(int device);
  // Record `stream`'s allocations on the device (removing any plan, whose
  // blocks must be free) until stop_recording, which returns them.
  void start_recording(int device, StreamId stream);
  std::vector<TracedBlock> stop_recording(int device);

  std::vector<int> devices();  // devices with an allocator, in order
  std::string policy();
  std::string config();
  std::string driver_path();

  // Problems the free hook met (it may not throw): count and the last one.
  std::pair<long long, std::string> free_errors();
  void note_free_error(const std::string& what);

 private:
  static constexpr int kMaxDevices = 64;
  // One device: its driver handle, the online allocator, and optionally a
  // plan over it. `active` is what allocations go to; the shared lock keeps
  // a plan alive while any call uses it.
  struct PerDevice {
    std::unique_ptr<CudaDevice> device;
    std::shared_ptr<Allocator> online;
    std::unique_ptr<PlanAllocator> plan;
    std::unique_ptr<TraceRecorder> recorder;
    Allocator* active = nullptr;
    std::shared_mutex swap;
  };
  [[noreturn]] static void no_plan(int device);
  // Drops the plan (refused while its blocks live); caller holds d.swap.
  static void drop_plan(PerDevice& d, int device, const char* why);
  PerDevice& slot(int device);            // created on first use
  PerDevice* find(int device) const;      // nullptr if none yet

  std::mutex mu_;  // configuration and device creation, never the hot path
  std::string policy_ = "waterwave";
  std::string config_;
  std::string driver_;
  std::array<std::atomic<PerDevice*>, kMaxDevices> devices_{};
  std::atomic<long long> free_errors_{0};
  std::string last_free_error_;  // under mu_
};

}  // namespace waterwave::cuda
