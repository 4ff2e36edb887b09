// Blocks and segments: the address-ordered chains the allocator carves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "types.h"

namespace waterwave {

class FreeSet;
struct Segment;

struct Block {
  Addr addr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;  // caller's size while allocated
  StreamId stream = 0;        // stream the block was allocated on / freed into
  Segment* segment = nullptr;
  Block* prev = nullptr;  // address neighbours inside the same segment
  Block* next = nullptr;
  FreeSet* set = nullptr;  // the free set holding this block, if any
  bool allocated = false;
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
};

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
