// The allocator interface both policies implement, and the shared machinery
// they are built on: segments, block splitting/merging, the live-pointer map,
// snapshots and invariant checks.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "block.h"
#include "config.h"
#include "device.h"
#include "errors.h"
#include "free_set.h"
#include "ptr_map.h"
#include "stats.h"

namespace waterwave {

struct BlockInfo {
  Addr addr;
  std::size_t size;
  std::size_t requested;
  StreamId stream;
  std::string state;  // "allocated", "pending_free", "unsynced", "synced", "free"
};

struct SegmentInfo {
  Addr addr;
  std::size_t size;
  PoolKind pool;
  StreamId stream;
  std::vector<BlockInfo> blocks;
};

class Allocator {
 public:
  virtual ~Allocator() = default;

  // Returns a device address for `bytes` usable on `stream`; 0 for 0 bytes.
  // Throws OutOfMemoryError with the statistics when nothing can be found.
  virtual Addr allocate(std::size_t bytes, StreamId stream) = 0;
  // Frees a pointer returned by allocate. Throws PointerError for an unknown
  // pointer, a double free, or a pointer into the middle of an allocation.
  virtual void deallocate(Addr ptr) = 0;
  // The block at `ptr` is also used on `stream` (PyTorch's record_stream).
  virtual void record_stream(Addr ptr, StreamId stream) = 0;
  // Synchronize the device, then mark every free block synced and coalesce.
  virtual void sync_and_coalesce() = 0;
  // Return every wholly free cached segment to the device.
  virtual void empty_cache() = 0;

  virtual AllocatorStats stats() = 0;
  virtual void reset_peak_stats() = 0;
  virtual std::vector<SegmentInfo> snapshot() = 0;
  // Throws InvariantError describing the first broken invariant.
  virtual void check_invariants() = 0;
  // Size of the live allocation starting at ptr (PointerError otherwise).
  virtual std::size_t allocation_size(Addr ptr) = 0;
  virtual std::string policy() const = 0;
  virtual const AllocatorConfig& config() const = 0;
};

// policy: "waterwave" or "pytorch".
std::unique_ptr<Allocator> make_allocator(const std::string& policy, Device& device,
                                          const AllocatorConfig& config);

// Shared machinery. Every method assumes the caller holds mu_ unless noted.
class CachingAllocatorBase : public Allocator {
 public:
  CachingAllocatorBase(Device& device, const AllocatorConfig& config);
  ~CachingAllocatorBase() override;

  std::size_t allocation_size(Addr ptr) override;
  // Both policies note other streams' uses the same way; they differ in
  // what a free then does with them.
  void record_stream(Addr ptr, StreamId stream) override;
  std::vector<SegmentInfo> snapshot() override;
  void reset_peak_stats() override;
  const AllocatorConfig& config() const override { return cfg_; }

 protected:
  // Policy hooks: the state name of a free block (for snapshots), whether a
  // free block is waiting on events outside every set, and the policy's sets.
  virtual std::string free_state(const Block* b) const = 0;
  virtual bool is_pending(const Block* b) const = 0;
  virtual void for_each_free_set(const std::function<void(const FreeSet&)>& fn) const = 0;

  // Reserve a segment with mu_ released around the device call (it may
  // block). Returns the new segment's single free block, not in any set, or
  // nullptr when the device is out of memory. `lock` must hold mu_.
  Block* reserve_segment(std::unique_lock<std::mutex>& lock, std::size_t bytes, PoolKind pool,
                         StreamId stream);
  // Unlink a wholly free segment (its block must be out of every set); the
  // caller releases it to the device with release_unlinked() outside mu_.
  Segment* unlink_segment(Block* whole);
  void release_unlinked(const std::vector<Segment*>& segments);

  // Split `b` so it keeps the front `size` bytes; returns the remainder.
  Block* split(Block* b, std::size_t size);
  // `lo` absorbs its next neighbour `hi`; hi is recycled. Returns lo.
  Block* merge(Block* lo, Block* hi);

  // Refuse a corrupt request size (>= 1 EiB) before touching any state.
  static void check_request(std::size_t bytes);
  // Account a block handed out; the free request (allocated_bytes drop); the
  // free completing (active/requested drop: later for pending blocks).
  void mark_allocated(Block* b, std::size_t requested, StreamId stream);
  void account_free_request(Block* b);
  void account_free_complete(Block* b);
  // The live block at ptr, or throws a PointerError that says what ptr is.
  Block* live_block(Addr ptr);
  [[noreturn]] void throw_bad_pointer(Addr ptr, const char* action);

  // inactive_split bookkeeping: call when a block enters / leaves a free set.
  void on_free_set_insert(const Block* b);
  void on_free_set_erase(const Block* b);
  void insert_free(FreeSet& set, Block* b) {
    set.insert(b);
    on_free_set_insert(b);
  }
  void erase_free(Block* b) {
    on_free_set_erase(b);
    b->set->erase(b);
  }

  // Invariants common to both policies: segment chains, set membership, map,
  // byte accounting. Policy-specific checks call this first.
  void check_common_invariants();
  [[noreturn]] void fail_invariant(const std::string& what) const;
  std::string oom_message(std::size_t requested, std::size_t rounded, std::size_t segment_bytes);

  Device& device_;
  AllocatorConfig cfg_;
  SizeRules rules_;
  std::mutex mu_;
  AllocatorStats stats_;
  BlockPool block_pool_;
  PtrMap live_;  // allocated blocks by address
  std::map<Addr, Segment*> segments_;
  std::size_t reserved_total_ = 0;  // == stats_.reserved_bytes.all().current
  std::size_t allowed_max_ = SIZE_MAX;  // from per_process_memory_fraction
  // Events are pooled and reference-counted: a split block's remainder keeps
  // depending on the events of its parent.
  std::vector<EventId> event_pool_;
  std::unordered_map<EventId, int> event_refs_;
  EventId take_event();  // a fresh reference, count 1
  void retain_event(EventId e) { ++event_refs_[e]; }
  void release_event(EventId e);
};

}  // namespace waterwave
