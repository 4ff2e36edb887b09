// Blocks and segments: the address-ordered chains the allocator carves.
//
// May include: core/stats.h, core/types.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <vector>

#include "../core/stats.h"
#include "../core/types.h"

namespace waterwave {

class FreeSet;
struct Segment;
struct Block;

// A minimal node-recycling allocator for std::set. Each FreeSet owns its
// arena, so there is no shared state between sets or threads.
class NodeArena {
 public:
  NodeArena() = default;
  NodeArena(const NodeArena&) = delete;
  NodeArena& operator=(const NodeArena&) = delete;
  ~NodeArena() {
    for (void* p : free_) ::operator delete(p);
  }
  void* take(std::size_t bytes) {
    if (bytes != node_bytes_ || free_.empty()) {
      if (node_bytes_ == 0) node_bytes_ = bytes;
      return ::operator new(bytes);
    }
    void* p = free_.back();
    free_.pop_back();
    return p;
  }
  void give(void* p, std::size_t bytes) {
    if (bytes == node_bytes_) {
      free_.push_back(p);
    } else {
      ::operator delete(p);
    }
  }

 private:
  std::size_t node_bytes_ = 0;
  std::vector<void*> free_;
};

template <typename T>
struct ArenaAllocator {
  using value_type = T;
  NodeArena* arena;
  explicit ArenaAllocator(NodeArena* a) noexcept : arena(a) {}
  template <typename U>
  ArenaAllocator(const ArenaAllocator<U>& o) noexcept : arena(o.arena) {}
  T* allocate(std::size_t n) { return static_cast<T*>(arena->take(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { arena->give(p, n * sizeof(T)); }
  template <typename U>
  bool operator==(const ArenaAllocator<U>& o) const noexcept { return arena == o.arena; }
  template <typename U>
  bool operator!=(const ArenaAllocator<U>& o) const noexcept { return arena != o.arena; }
};


// Free sets order blocks by (size, address): best fit is a lower_bound. A
// set *by owner* orders them first by the stream that reserved their
// segment (owner_of), so that the best fit among one stream's segments is a
// lower_bound too (the waterwave policy's own_segments_first).
struct BySizeThenAddr {
  bool by_owner = false;
  inline bool operator()(const Block* a, const Block* b) const;
};
using FreeTree = std::set<Block*, BySizeThenAddr, ArenaAllocator<Block*>>;

struct Block {
  Addr addr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;  // caller's size while allocated
  StreamId stream = 0;        // stream the block was allocated on / freed into
  Segment* segment = nullptr;
  Block* prev = nullptr;  // address neighbours inside the same segment
  Block* next = nullptr;
  FreeSet* set = nullptr;  // the free set holding this block, if any
  FreeTree::iterator pos;  // its node in that set: erase without a search
  bool allocated = false;
  // Expandable segments: free address space with no memory behind it, and
  // pages being given back (out of every set, not yet unmapped).
  bool mapped = true;
  bool unmapping = false;
  // Global order of the free that put this block in an unsynced set; a merged
  // block keeps the newest, so an event covering it covers every part.
  std::uint64_t free_seq = 0;
  // Streams that used the block besides its own (record_stream).
  std::vector<StreamId> stream_uses;
  // Events recorded on those streams at free time: the block may be reused
  // only after they complete or the taker's stream waits on them.
  std::vector<EventId> events;
  int event_count = 0;  // pytorch policy: outstanding events
  std::uint64_t gc_count_base = 0;

  bool is_split() const { return prev != nullptr || next != nullptr; }
  Addr end() const { return addr + size; }
};


struct Segment {
  Addr addr = 0;
  std::size_t size = 0;
  PoolKind pool = kLargePool;
  StreamId stream = 0;  // stream that reserved it
  Block* head = nullptr;  // lowest-address block; stable for the segment's life
  // An expandable segment reserves address space for all of the device and
  // maps pages where its blocks need them; `size` is the address space.
  bool expandable = false;
  // An expandable segment's page: the unit it maps and unmaps, one physical
  // allocation each (2 MiB for the small pool, large_segment_size for the
  // large one, as PyTorch: mapping costs per allocation, not per byte).
  std::size_t page = 0;
  // The reserving stream's entry in the allocator's statistics
  // (AllocatorStats::own_segments), which its blocks' bytes are added to.
  OwnSegments* own = nullptr;
};

// The stream that reserved a block's segment; a search key (no segment) names
// it in `stream`.
inline StreamId owner_of(const Block* b) { return b->segment ? b->segment->stream : b->stream; }

bool BySizeThenAddr::operator()(const Block* a, const Block* b) const {
  if (by_owner) {
    const StreamId oa = owner_of(a), ob = owner_of(b);
    if (oa != ob) return oa < ob;
  }
  if (a->size != b->size) return a->size < b->size;
  return a->addr < b->addr;
}

// Recycles Block objects so the hot path does not call malloc for splits.
class BlockPool {
 public:
  BlockPool() = default;
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;
  ~BlockPool() {
    for (Block* b : free_) delete b;
  }
  Block* make() {
    if (free_.empty()) return new Block();
    Block* b = free_.back();
    free_.pop_back();
    return b;
  }
  void recycle(Block* b) {
    std::vector<StreamId> uses = std::move(b->stream_uses);
    std::vector<EventId> events = std::move(b->events);
    uses.clear();
    events.clear();
    *b = Block();
    b->stream_uses = std::move(uses);  // keep capacity
    b->events = std::move(events);
    free_.push_back(b);
  }

 private:
  std::vector<Block*> free_;
};

}  // namespace waterwave
