// The online caching allocator: the narrow interface both faces call, and the
// caching machinery every policy shares (segments, splitting and merging
// blocks, the live-pointer map, statistics, snapshots, invariant checks).
//
// In RMM's manner, the public calls are non-virtual: they check their
// arguments, take the lock, do the shared part and call a few private hooks
// that a policy (waterwave_policy.cpp, pytorch_policy.cpp) overrides. A policy
// is chosen by its kind through one factory (policies.h).
//
// Lock discipline. One mutex, mu_, guards every field. Public calls take it
// and never call one another. A function named *_locked is called with mu_
// held through the `Lock&` it receives; it may drop the lock around a device
// call that can block (reserving, releasing, synchronizing) and holds it again
// when it returns, so the caller must re-read any state it cached.
//
// May include: core/ (vocabulary, device interface) and this folder.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "../core/config.h"
#include "../core/device.h"
#include "../core/errors.h"
#include "../core/stats.h"
#include "block.h"
#include "free_set.h"
#include "history.h"
#include "policies.h"
#include "ptr_map.h"

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
  bool expandable = false;  // one mapped run of an expandable segment
};

class Allocator {
 public:
  using Lock = std::unique_lock<std::mutex>;

  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;
  virtual ~Allocator();

  // Returns a device address for `bytes` usable on `stream`; 0 for 0 bytes.
  // Throws OutOfMemoryError with the statistics when nothing can be found.
  Addr allocate(std::size_t bytes, StreamId stream);
  // Hands out exactly [addr, addr + size) with `requested` bytes asked for:
  // a private pool restored to a checkpoint (PyTorch's setCheckpointPoolState)
  // gets its live blocks back where they were. The range must lie inside one
  // cached free block of a segment, waiting on no event; else ConfigError and
  // nothing changes. The block keeps its segment's stream.
  Addr allocate_at(Addr addr, std::size_t size, std::size_t requested);
  // Frees a pointer returned by allocate. Throws PointerError for an unknown
  // pointer, a double free, or a pointer into the middle of an allocation.
  void deallocate(Addr ptr);
  // The block at `ptr` is also used on `stream` (PyTorch's record_stream).
  void record_stream(Addr ptr, StreamId stream);
  // Synchronize the device, then make every free block reusable by any stream
  // and coalesce (the pytorch policy: retire pending cross-stream frees).
  void sync_and_coalesce();
  // Return every wholly free cached segment to the device.
  void empty_cache();

  AllocatorStats stats();
  void reset_peak_stats();
  void reset_accumulated_stats();
  // torch.cuda.set_per_process_memory_fraction: from now on, new segments
  // keep reserved memory within `fraction` of the device (in (0, 1]; 1: no
  // cap). Memory already reserved above it stays until freed and released.
  void set_memory_fraction(double fraction);
  double memory_fraction();
  // max_split_size_mb changed while the allocator runs, as PyTorch's
  // torch.cuda.memory._set_allocator_settings changes it: from now on blocks
  // of at least `bytes` are never split, and a request takes a cached block
  // that large only when it nearly fills it; blocks split before stay split
  // until they coalesce. SIZE_MAX: no limit. ConfigError (nothing changed)
  // below the large segment size.
  void set_max_split_size(std::size_t bytes);
  // Whether a limit was chosen: in the config, or by set_max_split_size
  // (SIZE_MAX included), so that a default set later leaves it alone.
  bool max_split_size_chosen();
  // own_segments_first (config.h) changed while the allocator runs: from now
  // on, under the waterwave policy, a stream takes other streams' free
  // large-pool memory only once the device is out. ConfigError (nothing
  // changed) with expandable segments. Inert under the pytorch policy. The
  // user's choice: runs (below) leave it as it is.
  void set_own_segments_first(bool on);
  // Whether it was chosen: in the config, or by set_own_segments_first.
  bool own_segments_first_chosen();
  // A captured session's run holds own_segments_first on while it trains
  // (waterwave/alloc/own_segments.py), unless it was chosen or segments are
  // expandable; the last of overlapping runs to let go turns it off again.
  // hold returns whether it is on.
  bool hold_own_segments_first();
  void release_own_segments_first();
  // Memory history for PyTorch's snapshot format: while enabled, the newest
  // `max_entries` allocator events (alloc, free_requested, free_completed,
  // segment_alloc/free, segment_map/unmap, oom). Disabling drops them.
  void record_history(bool enabled, std::size_t max_entries);
  std::vector<HistoryEntry> history();
  std::vector<SegmentInfo> snapshot();
  // Throws InvariantError describing the first broken invariant.
  void check_invariants();
  // Size of the live allocation starting at ptr (PointerError otherwise).
  std::size_t allocation_size(Addr ptr);
  // Whether ptr is a live allocation of this allocator; never throws.
  bool owns(Addr ptr);
  // The live allocation at ptr: the stream it was allocated on and whether
  // other streams use it too (record_stream), so that its free records
  // events. nullopt when ptr is not live here; never throws.
  struct LiveStreams {
    StreamId stream;
    bool shared;
  };
  std::optional<LiveStreams> live_streams(Addr ptr);

  PolicyKind kind() const { return kind_; }
  const char* policy() const { return policy_info(kind_).name; }
  // A copy: max_split_size may change under the lock (set_max_split_size).
  AllocatorConfig config();

 protected:
  Allocator(PolicyKind kind, Device& device, const AllocatorConfig& config);

  // What the policy's search is asked for: `size` is the rounded request.
  struct Request {
    std::size_t bytes;
    std::size_t size;
    PoolKind pool;
    StreamId stream;
  };

  // ---- Shared machinery, for the policies. Every call needs mu_ held. ----

  // A new free block of at least r.size bytes, in no set, or nullptr when
  // the device (or the memory fraction) has no room: a new segment; with
  // expandable segments, pages mapped (or moved) into the expandable segment
  // of `owner` for the pool (see grow_locked).
  Block* new_memory_locked(Lock& lock, const Request& r, StreamId owner);
  // Reserve a segment (mu_ dropped around the device call). Returns the new
  // segment's single free block, in no set, or nullptr when the device is out
  // of memory.
  Block* reserve_segment_locked(Lock& lock, std::size_t bytes, PoolKind pool, StreamId stream);
  // Expandable segments: give back the whole pages inside `blocks` (free,
  // mapped, in a set, holding no events), with mu_ dropped while the device
  // synchronizes (unless the caller knows the pages `idle`) and unmaps them.
  // Their partial pages stay in their sets. Returns the bytes given back.
  std::size_t unmap_free_pages_locked(Lock& lock, const std::vector<Block*>& blocks, bool idle);
  // Unlink wholly free segments (their blocks are taken out of their sets)
  // and give them back to the device with mu_ dropped. Returns the bytes.
  std::size_t release_segments_locked(Lock& lock, const std::vector<Block*>& whole);

  // Split `b` so it keeps the front `size` bytes; returns the remainder.
  Block* split(Block* b, std::size_t size);
  // Merge `b` with its address neighbours that are free in a set and pass
  // `joins`, taking them out of their sets. Returns the merged block (in no
  // set).
  template <typename Joins>
  Block* merge_neighbours_if(Block* b, Joins joins) {
    if (b->prev && b->prev->set && joins(b->prev)) {
      Block* lo = b->prev;
      erase_free(lo);
      b = merge(lo, b);
    }
    if (b->next && b->next->set && joins(b->next)) {
      Block* hi = b->next;
      erase_free(hi);
      b = merge(b, hi);
    }
    return b;
  }
  Block* merge_neighbours_in(FreeSet& set, Block* b) {
    return merge_neighbours_if(b, [&set](const Block* n) { return n->set == &set; });
  }

  // `lo` absorbs its next neighbour `hi`; hi is recycled. Returns lo.
  Block* merge(Block* lo, Block* hi);
  // inactive_split statistics for a split block entering (+1) or leaving (-1) a set.
  void note_split_free(const Block* b, int sign);

  // Account the free request (allocated_bytes drop) and the free completing
  // (active/requested drop: later for blocks that wait on events).
  void account_free_complete(Block* b);

  // inactive_split bookkeeping rides on every entry to and exit from a set
  // (as PyTorch's, it leaves expandable segments out). Inline: the fast
  // paths enter and leave sets on every call.
  void insert_free(FreeSet& set, Block* b) {
    set.insert(b);
    if (counts_as_split(b)) note_split_free(b, 1);
  }
  void erase_free(Block* b) {
    b->set->erase(b);
    if (counts_as_split(b)) note_split_free(b, -1);
  }
  static bool counts_as_split(const Block* b) { return b->is_split() && !b->segment->expandable; }

  // Events are pooled and reference-counted: a split block's remainder keeps
  // depending on the events of its parent.
  EventId take_event();  // a fresh reference, count 1
  void retain_event(EventId e) { ++event_refs_[e]; }
  void release_event(EventId e);

  [[noreturn]] void fail_invariant(const std::string& what) const;

  Device& device_;
  AllocatorConfig cfg_;  // fixed but for max_split_size and own_segments_first (their setters)
  const SizeRules rules_;  // reads cfg_
  bool max_split_chosen_ = false;  // under mu_
  bool own_first_chosen_ = false;  // under mu_
  int own_first_runs_ = 0;          // runs holding it (hold_own_segments_first), under mu_
  bool own_first_by_runs_ = false;  // the runs turned it on, under mu_
  std::mutex mu_;
  AllocatorStats stats_;
  std::map<Addr, Segment*> segments_;
  std::size_t reserved_total_ = 0;      // == stats_.reserved_bytes.all().current + reserving_
  std::size_t reserving_ = 0;           // bytes of segments whose device call is in flight
  std::size_t allowed_max_ = SIZE_MAX;  // from per_process_memory_fraction
  double fraction_ = 1.0;               // the fraction now (set_memory_fraction)
  std::unordered_map<EventId, int> event_refs_;

 private:
  // ---- Policy hooks, all called with mu_ held. ----

  // The policy's search for a free block of r.size bytes, down to a new
  // segment and what it tries when the device is out of memory. The block
  // may still sit in a free set. nullptr: nothing could be found.
  virtual Block* find_block_locked(Lock& lock, const Request& r, Served& how) = 0;
  // Where the remainder of a block split for a request goes; `origin` is the
  // set the block came from (nullptr for a new segment).
  virtual void file_remainder(Block* remainder, FreeSet* origin, const Request& r) = 0;
  // A freed block, already out of the live map and allocated_bytes.
  virtual void on_free(Block* b) = 0;
  virtual void sync_and_coalesce_locked(Lock& lock) = 0;
  virtual void empty_cache_locked(Lock& lock) = 0;
  // The free-memory figures of stats(): synced, unsynced and pending bytes.
  virtual void describe_free(AllocatorStats& out) const = 0;
  // Policy-specific invariants, checked after the shared ones.
  virtual void check_policy_invariants() = 0;
  // Expandable segments: may this free mapped block join pages grown for
  // request r? Its memory must be safe for r's stream at once.
  virtual bool joins_growth(const Block* b, const Request& r) const = 0;
  // Expandable segments: the set whose blocks are idle (no kernel may touch
  // them) and free to any stream, whose whole pages may move to where a
  // stream grows; nullptr when pages never move (PyTorch's semantics).
  virtual FreeSet* idle_set(PoolKind) { return nullptr; }
  // own_segments_first was set (set_own_segments_first, under mu_).
  virtual void own_segments_first_changed_locked(bool) {}
  // The page an expandable segment of the pool maps (rounded up to the
  // device's granularity). PyTorch: 2 MiB small, large_segment_size large.
  virtual std::size_t expandable_page(PoolKind pool) const {
    return pool == kSmallPool ? kSmallBuffer : cfg_.large_segment_size;
  }
  // The state name of a free block (for snapshots), whether a free block is
  // waiting on events outside every set, and the policy's sets.
  virtual const char* free_state(const Block* b) const = 0;
  virtual bool is_pending(const Block* b) const = 0;
  virtual void for_each_free_set(const std::function<void(const FreeSet&)>& fn) const = 0;

  // Take a found block out of its set, make the stream wait on any events it
  // carries, split it, and account it as allocated.
  void hand_out(Block* b, const Request& r);
  // Expandable segments: the lowest-address run of unmapped blocks and free
  // blocks that may join (joins_growth) long enough for r.size, mapped where
  // needed and merged into one block. nullptr when there is none or no room.
  // The device maps under mu_: mapping never waits on the GPU.
  Block* grow_locked(const Request& r, StreamId owner);
  Segment* expandable_segment_locked(StreamId owner, PoolKind pool);
  // Up to `want` whole idle pages (of `page` bytes, in expandable segments,
  // outside [skip_lo, skip_hi)) carved out of the policy's idle set, highest
  // address first, each an unmapped block whose page the caller moves away.
  std::vector<Block*> idle_pages_locked(PoolKind pool, std::size_t page, std::size_t want,
                                        Addr skip_lo, Addr skip_hi);
  void release_idle_page_locked(Block* page);  // a carved page that stays
  void settle_unmapped_locked(const std::vector<Block*>& moved);
  Block* join_taken(const std::vector<Block*>& taken, const Request& r);
  // Unmapped address space with nothing in flight: adjacent ones become one.
  static bool vacant(const Block* b) { return b && !b->mapped && !b->unmapping; }
  Block* merge_vacant_neighbours(Block* b);
  void account_mapped(Segment* seg, std::int64_t bytes);
  void account_free_request(Block* b);
  // The live block at ptr, or throws a PointerError that says what ptr is.
  Block* live_block(Addr ptr, const char* action);
  [[noreturn]] void throw_bad_pointer(Addr ptr, const char* action);
  void check_common_invariants();
  std::string oom_message(const Request& r);

  void note(const char* action, Addr addr, std::size_t size, StreamId stream);

  const PolicyKind kind_;
  History history_;
  std::map<std::pair<StreamId, int>, Segment*> expandable_;  // (owner, pool) -> segment
  BlockPool block_pool_;
  PtrMap live_;  // allocated blocks by address
  std::vector<EventId> event_pool_;
};

}  // namespace waterwave
