// An adaptor over any Device that counts its calls by kind: what an
// allocator asks of the driver, for `waterwave bench step` (a replayed
// training step's driver calls, per policy). It forwards every call
// unchanged; the counters are plain integers, so one thread drives it.
//
// May include: core/.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>

#include "../core/device.h"

namespace waterwave {

class CountingDevice final : public Device {
 public:
  enum Kind : int {
    kReserve, kRelease, kEventCreate, kEventDestroy, kEventRecord, kEventQuery, kEventSync,
    kStreamWait, kDeviceSync, kCaptureQuery, kFreeMemory, kAddressReserve, kAddressRelease,
    kMap, kUnmap, kRemap, kCount
  };
  static constexpr std::array<const char*, kCount> kNames = {
      "reserve", "release", "event_create", "event_destroy", "event_record", "event_query",
      "event_sync", "stream_wait", "device_sync", "capture_query", "free_memory",
      "address_reserve", "address_release", "map", "unmap", "remap"};

  explicit CountingDevice(Device& inner) : inner_(inner) {}

  std::optional<Addr> reserve(std::size_t bytes) override { return add(kReserve), inner_.reserve(bytes); }
  void release(Addr addr, std::size_t bytes) override { add(kRelease); inner_.release(addr, bytes); }
  EventId create_event() override { return add(kEventCreate), inner_.create_event(); }
  void destroy_event(EventId e) override { add(kEventDestroy); inner_.destroy_event(e); }
  void record_event(EventId e, StreamId s) override { add(kEventRecord); inner_.record_event(e, s); }
  bool query_event(EventId e) override { return add(kEventQuery), inner_.query_event(e); }
  void synchronize_event(EventId e) override { add(kEventSync); inner_.synchronize_event(e); }
  void stream_wait_event(StreamId s, EventId e) override {
    add(kStreamWait);
    inner_.stream_wait_event(s, e);
  }
  void synchronize_device() override { add(kDeviceSync); inner_.synchronize_device(); }
  bool stream_capturing(StreamId s) override { return add(kCaptureQuery), inner_.stream_capturing(s); }
  std::size_t total_memory() const override { return inner_.total_memory(); }
  std::size_t free_memory() const override {
    const_cast<CountingDevice*>(this)->add(kFreeMemory);
    return inner_.free_memory();
  }
  double time_us() const override { return inner_.time_us(); }
  bool supports_vmm() const override { return inner_.supports_vmm(); }
  std::size_t vmm_granularity() const override { return inner_.vmm_granularity(); }
  std::optional<Addr> reserve_address(std::size_t bytes) override {
    return add(kAddressReserve), inner_.reserve_address(bytes);
  }
  void release_address(Addr addr, std::size_t bytes) override {
    add(kAddressRelease);
    inner_.release_address(addr, bytes);
  }
  bool map(Addr addr, std::size_t bytes) override { return add(kMap), inner_.map(addr, bytes); }
  MappedPages map_pages(Addr addr, std::size_t page, std::size_t count) override {
    add(kMap);
    return inner_.map_pages(addr, page, count);
  }
  void unmap(Addr addr, std::size_t bytes) override { add(kUnmap); inner_.unmap(addr, bytes); }
  void unmap_pages(Addr addr, std::size_t page, std::size_t count) override {
    add(kUnmap);
    inner_.unmap_pages(addr, page, count);
  }
  void remap(Addr from, Addr to, std::size_t bytes) override {
    add(kRemap);
    inner_.remap(from, to, bytes);
  }

  // Calls by kind since construction or the last reset (kinds never called omitted).
  std::map<std::string, std::int64_t> calls() const {
    std::map<std::string, std::int64_t> out;
    for (int k = 0; k < kCount; ++k) {
      if (counts_[k]) out[kNames[k]] = counts_[k];
    }
    return out;
  }
  void reset() { counts_.fill(0); }

 private:
  void add(Kind k) { ++counts_[k]; }

  Device& inner_;
  std::array<std::int64_t, kCount> counts_{};
};

}  // namespace waterwave
