// The device interface over a real GPU, through the CUDA driver API.
//
// Streams and events are the driver's handles (a CUstream is PyTorch's
// cudaStream_t); segments come from cuMemAlloc. Every call runs in the
// device's primary context, the one the CUDA runtime (and so PyTorch) uses,
// whichever context the calling thread has current: PyTorch may free from a
// thread whose current device is another.
//
// May include: core/, driver_api.h.
#pragma once

#include <map>
#include <mutex>
#include <utility>

#include "../../core/device.h"
#include "driver_api.h"

namespace waterwave::cuda {

class CudaDevice final : public Device {
 public:
  // Loads the driver if needed; throws DriverError for a bad ordinal.
  CudaDevice(const DriverApi& api, int ordinal);

  std::optional<Addr> reserve(std::size_t bytes) override;
  void release(Addr addr, std::size_t bytes) override;
  EventId create_event() override;
  void destroy_event(EventId event) override;
  void record_event(EventId event, StreamId stream) override;
  bool query_event(EventId event) override;
  void synchronize_event(EventId event) override;
  void stream_wait_event(StreamId stream, EventId event) override;
  void synchronize_device() override;
  bool stream_capturing(StreamId stream) override;
  std::size_t total_memory() const override { return total_; }
  std::size_t free_memory() const override;
  // Virtual memory, when the driver and the device have it: one cuMemCreate
  // per map(), its handle kept by address for unmap() and remap().
  bool supports_vmm() const override { return granularity_ != 0; }
  std::size_t vmm_granularity() const override { return granularity_; }
  std::optional<Addr> reserve_address(std::size_t bytes) override;
  void release_address(Addr addr, std::size_t bytes) override;
  bool map(Addr addr, std::size_t bytes) override;
  void unmap(Addr addr, std::size_t bytes) override;
  void remap(Addr from, Addr to, std::size_t bytes) override;

  int ordinal() const { return ordinal_; }

 private:
  // Makes the primary context current for one call, then restores the
  // caller's.
  class ContextScope {
   public:
    explicit ContextScope(const CudaDevice& d);
    ~ContextScope();

   private:
    const DriverApi& api_;
    CUcontext previous_ = nullptr;
    bool switched_ = false;
  };

  // Maps `handle` at [addr, addr+bytes) readable and writable. Returns the
  // driver's result; on failure nothing stays mapped.
  CUresult map_handle(Addr addr, std::size_t bytes, CUmemGenericAllocationHandle handle);

  const DriverApi& api_;
  int ordinal_;
  std::size_t granularity_ = 0;  // 0: no virtual memory management
  std::mutex handles_mu_;
  std::map<Addr, std::pair<CUmemGenericAllocationHandle, std::size_t>> handles_;
  CUcontext context_ = nullptr;
  std::size_t total_ = 0;
};

}  // namespace waterwave::cuda
