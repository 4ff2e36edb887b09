// A simulated GPU: the test oracle and the simulator.
//
// Memory is a virtual address range (no real memory behind it) handed out
// first fit, larger than the capacity: as on a GPU, whose driver maps pages,
// a reservation fails only when the reserved total would pass the capacity.
// Each stream is an ordered queue of kernels on a virtual GPU clock; the
// host has its own clock, advanced by launch overhead and by blocking waits.
// Events and stream waits have CUDA's semantics.
//
// Hazard detection uses happens-before, not timing: each stream and event
// carries a vector clock of the kernels known to finish before it. When the
// allocator hands a block to stream S, every kernel on another stream that
// touched those bytes must be ordered before S's next work (by an event wait,
// a host synchronization, or an observed event completion); otherwise the
// block could be overwritten while that kernel still reads or writes it, and
// a hazard is reported even if the virtual clock happens not to overlap.
//
// May include: core/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "../../core/device.h"

namespace waterwave {

struct Range {
  Addr addr;
  std::size_t size;
};

struct Hazard {
  Addr addr;            // start of the block handed out
  std::size_t size;
  StreamId stream;      // the stream it was handed to
  StreamId other_stream;  // stream of the kernel still pending on it
  std::uint64_t kernel;   // that kernel's id
  double host_time_us;
  bool unmapped = false;  // the pages were unmapped or moved, not handed out
  std::string describe() const;
};

class SimDevice final : public Device {
 public:
  // capacity: bytes of device memory; launch_overhead_us: host time each
  // kernel launch costs (the GPU runs behind the host, as in the paper's
  // Figure 1). shared_compute: kernels of all streams take turns on the GPU
  // in launch order, as kernels that each fill the GPU do; otherwise each
  // stream runs as if it had the GPU to itself.
  explicit SimDevice(std::size_t capacity, double launch_overhead_us = 2.0,
                     bool shared_compute = false);
  // The largest capacity simulated (64 PiB): its address arithmetic (a
  // physical span of 4x the capacity, a virtual one of 64x, above the base)
  // stays within 64 bits.
  static constexpr std::size_t kMaxCapacity = std::size_t{1} << 56;

  // Device interface.
  std::optional<Addr> reserve(std::size_t bytes) override;
  void release(Addr addr, std::size_t bytes) override;
  EventId create_event() override;
  void destroy_event(EventId event) override;
  void record_event(EventId event, StreamId stream) override;
  bool query_event(EventId event) override;
  void synchronize_event(EventId event) override;
  void stream_wait_event(StreamId stream, EventId event) override;
  void synchronize_device() override;
  std::size_t total_memory() const override { return capacity_; }
  std::size_t free_memory() const override;
  double time_us() const override { return now(); }
  // Virtual memory: addresses from a range of their own; each map() makes
  // one physical allocation that counts against the capacity and that
  // unmap() gives back whole (remap() moves it); each call costs host time
  // (per allocation, as on a GPU). Unmapping or moving pages that a kernel
  // the host has not seen finish may still touch is a hazard.
  bool supports_vmm() const override { return true; }
  std::size_t vmm_granularity() const override { return kPage; }
  std::optional<Addr> reserve_address(std::size_t bytes) override;
  void release_address(Addr addr, std::size_t bytes) override;
  bool map(Addr addr, std::size_t bytes) override;
  MappedPages map_pages(Addr addr, std::size_t page, std::size_t count) override;
  void unmap(Addr addr, std::size_t bytes) override;
  void unmap_pages(Addr addr, std::size_t page, std::size_t count) override;
  void remap(Addr from, Addr to, std::size_t bytes) override;
  std::size_t mapped_bytes() const;

  // Simulation.
  // Queue a kernel of `duration_us` on `stream` touching `uses`; returns its
  // id. `sm_share` and `bw_share` (in (0, 1]) are the shares of the GPU's SMs
  // and of its memory bandwidth the kernel takes while it runs; they matter
  // only with concurrent kernels.
  std::uint64_t launch(StreamId stream, double duration_us, const std::vector<Range>& uses,
                       double sm_share = 1.0, double bw_share = 1.0);
  // Concurrent kernels: a kernel starts at the first time after its stream's
  // work and the host's launch when, for all its duration, the kernels
  // running beside it leave it its SM share and its bandwidth share (both
  // summed over running kernels stay within 1), as a GPU runs the kernels of
  // several streams at once while their blocks fit. Its duration is its time
  // alone. With every share 1, kernels of different streams still fill idle
  // gaps; one stream alone runs exactly as without. Off: shared_compute's
  // turns, or each stream on its own GPU.
  void set_concurrent_kernels(bool on);
  bool concurrent_kernels() const;
  // Time-weighted SM occupancy of the kernels launched, in microseconds
  // (sum of duration x sm_share): the GPU's busy time, at most the span.
  double sm_busy_us() const;
  // The allocator handed [addr, addr+size) to `stream`: check for hazards.
  void note_handout(Addr addr, std::size_t size, StreamId stream);
  void advance_host(double us);  // the host spends time on other work
  double now() const;            // host clock, microseconds
  double stream_completion(StreamId stream) const;  // when its queued work ends
  double gpu_busy_until() const;                    // when all queued work ends
  std::vector<Hazard> hazards() const;
  std::uint64_t kernels_launched() const;
  std::size_t reserved_bytes() const;
  std::size_t num_segments() const;

 private:
  struct Stream {
    StreamId id;
    std::uint64_t count = 0;       // kernels launched
    std::vector<std::uint64_t> vc;  // per stream index: kernels known done before next work
    double tail = 0;               // GPU time when queued work (incl. waits) completes
  };
  // A piece of address space and, per stream index, the latest kernel (its
  // position in that stream, and its id) that touched it. Stream order makes
  // the latest the only one that matters: if it is ordered before a hand-out,
  // every earlier kernel of that stream is too.
  struct Touch {
    Addr end;
    std::vector<std::uint64_t> seq;
    std::vector<std::uint64_t> kernel;
  };
  void split_touch_at(Addr x);
  void touch(Addr addr, Addr end, std::size_t stream_idx, std::uint64_t seq, std::uint64_t kernel);
  struct Event {
    bool recorded = false;
    std::vector<std::uint64_t> vc;
    double time = 0;
  };

  Stream& stream(StreamId id);
  std::size_t index_of(StreamId id);
  static void join(std::vector<std::uint64_t>& into, const std::vector<std::uint64_t>& from);
  std::vector<std::uint64_t> frontier(Stream& s);  // s.vc joined with host knowledge
  void host_learns(const std::vector<std::uint64_t>& vc);
  void sync_all_locked();
  Event& event(EventId id);

  static constexpr std::size_t kPage = 2 * kMiB;
  static constexpr double kMapUs = 10.0;  // cuMemCreate + cuMemMap + cuMemSetAccess
  static constexpr double kUnmapUs = 10.0;  // cuMemUnmap + cuMemRelease
  // Mapped memory in runs: `bytes` from the key on, physical allocations of
  // `page` bytes each (a run made by map_pages is one entry, however many
  // pages, and is split where a page of it is unmapped or moved).
  struct Run {
    std::size_t bytes;
    std::size_t page;
  };
  // The entry for the `count` physical allocations of `page` bytes from
  // `addr` on, split out of their runs; throws naming `what` unless they
  // are mapped, of that size, contiguous.
  std::map<Addr, Run>::iterator pages_locked(Addr addr, std::size_t page, std::size_t count,
                                             const char* what);
  void split_run_at(Addr x);
  void check_unmapped_locked(Addr addr, std::size_t bytes, const char* what) const;
  void check_idle_locked(Addr addr, std::size_t bytes);

  // Concurrent kernels: the SM and bandwidth shares in use from each time
  // on, up to the next key (past the last key: none). Keys before the host's
  // clock are dropped, since no kernel starts before its launch.
  struct Load {
    double sm = 0, bw = 0;
  };
  double first_fit_locked(double earliest, double duration, double sm, double bw) const;
  void occupy_locked(double start, double end, double sm, double bw);
  std::map<double, Load>::iterator breakpoint_locked(double t);

  mutable std::mutex mu_;
  std::size_t capacity_;
  double launch_overhead_us_;
  bool shared_compute_;
  bool concurrent_ = false;
  std::map<double, Load> load_;
  double sm_busy_us_ = 0;
  double gpu_tail_ = 0;  // shared_compute: when the last queued kernel ends
  double now_ = 0;
  Addr base_;
  std::map<Addr, std::size_t> free_ranges_;  // addr -> size, coalesced
  std::map<Addr, std::size_t> reserved_;     // addr -> size
  std::map<Addr, std::size_t> va_free_;      // virtual addresses free to reserve, coalesced
  std::map<Addr, std::size_t> va_reserved_;  // reserved virtual ranges: addr -> size
  std::map<Addr, Run> handles_;              // physical allocations mapped, in runs
  std::size_t used_ = 0;
  std::vector<Stream> streams_;
  std::unordered_map<StreamId, std::size_t> stream_index_;
  std::vector<std::uint64_t> host_vc_;
  std::unordered_map<EventId, Event> events_;
  EventId next_event_ = 1;
  std::uint64_t next_kernel_ = 1;
  std::vector<Hazard> hazards_;
  std::map<Addr, Touch> touches_;  // disjoint pieces, by start address
};

}  // namespace waterwave
