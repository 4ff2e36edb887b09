// The device interface: everything the allocator policies need from a GPU.
//
// Implementations: csrc/device/sim (a simulated GPU with a hazard detector) and
// a CUDA driver backend. The policies never call CUDA directly, so every rule
// can be exercised and checked on a machine without a GPU.
//
// May include: types.h.
#pragma once

#include <chrono>
#include <cstddef>
#include <exception>
#include <optional>
#include <stdexcept>

#include "types.h"

namespace waterwave {

class Device {
 public:
  virtual ~Device() = default;

  // Reserve a segment of device memory. Returns nullopt when the device is out
  // of memory; any other failure throws. May block (cudaMalloc does).
  virtual std::optional<Addr> reserve(std::size_t bytes) = 0;
  // Give a segment back. May block: cudaFree synchronizes the device.
  virtual void release(Addr addr, std::size_t bytes) = 0;

  // Events. Create/destroy are cheap and non-blocking; record, query and
  // stream_wait_event are asynchronous; synchronize_event blocks the host.
  virtual EventId create_event() = 0;
  virtual void destroy_event(EventId event) = 0;
  virtual void record_event(EventId event, StreamId stream) = 0;
  virtual bool query_event(EventId event) = 0;
  virtual void synchronize_event(EventId event) = 0;
  // Work queued on `stream` after this call starts only once `event` (as
  // recorded at the time of this call) has completed. Does not block the host.
  virtual void stream_wait_event(StreamId stream, EventId event) = 0;
  // Block the host until all work on all streams has completed.
  virtual void synchronize_device() = 0;
  // Whether work on `stream` is being captured into a CUDA graph now (no
  // event of it may then be waited on or queried). Devices without graphs:
  // never.
  virtual bool stream_capturing(StreamId /*stream*/) { return false; }

  virtual std::size_t total_memory() const = 0;
  virtual std::size_t free_memory() const = 0;
  // The host clock in microseconds, for the memory history's time stamps
  // (a real device: the steady clock; the simulator: its virtual clock).
  virtual double time_us() const {
    using namespace std::chrono;
    return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
  }

  // Virtual memory management (CUDA's VMM API), for expandable segments.
  // A device without it answers false, and the allocator refuses
  // expandable_segments:True with a clear error.
  virtual bool supports_vmm() const { return false; }
  // The page size mappings come in (cuMemGetAllocationGranularity).
  virtual std::size_t vmm_granularity() const { return 2 * kMiB; }
  // Reserve virtual addresses, no memory behind them (cuMemAddressReserve);
  // nullopt when the address space is exhausted. `bytes` is a multiple of
  // the granularity.
  virtual std::optional<Addr> reserve_address(std::size_t) { throw_no_vmm(); }
  virtual void release_address(Addr, std::size_t) { throw_no_vmm(); }
  // Back [addr, addr+bytes) with one new physical allocation, readable and
  // writable (cuMemCreate, cuMemMap, cuMemSetAccess). False when the device
  // is out of memory: then nothing is left mapped.
  virtual bool map(Addr, std::size_t) { throw_no_vmm(); }
  // Back `count` pages of `page` bytes from `addr` on, each its own physical
  // allocation (unmapped or moved later one by one), in order. `mapped`:
  // how many were, all unless the device ran out of memory or a call failed
  // (`error`, the driver's exception); the first `mapped` stay mapped either
  // way. A device that can map a run in one step (the simulator) overrides
  // it, so a huge growth is not a loop of driver calls.
  struct MappedPages {
    std::size_t mapped = 0;
    std::exception_ptr error;
  };
  virtual MappedPages map_pages(Addr addr, std::size_t page, std::size_t count) {
    MappedPages out;
    try {
      while (out.mapped < count && map(addr + out.mapped * page, page)) ++out.mapped;
    } catch (...) {
      out.error = std::current_exception();
    }
    return out;
  }
  // unmap() of `count` pages of `page` bytes from `addr` on, each mapped by
  // one map() or map_pages().
  virtual void unmap_pages(Addr addr, std::size_t page, std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) unmap(addr + i * page, page);
  }
  // Give back the physical allocation mapped at [addr, addr+bytes) by one
  // map() (cuMemUnmap, cuMemRelease). No kernel may still touch it: the
  // caller synchronizes first, or knows the pages idle.
  virtual void unmap(Addr, std::size_t) { throw_no_vmm(); }
  // Move the physical allocation mapped at `from` (one map(), idle) to the
  // unmapped addresses at `to` (cuMemUnmap, then cuMemMap of the same handle
  // and cuMemSetAccess): memory changes address without going back to the
  // driver, so no other process can take it meanwhile.
  virtual void remap(Addr /*from*/, Addr /*to*/, std::size_t) { throw_no_vmm(); }

 private:
  [[noreturn]] static void throw_no_vmm() {
    throw std::logic_error("this device has no virtual memory management (supports_vmm())");
  }
};

}  // namespace waterwave
