// A set of free blocks ordered by (size, address): best fit in O(log n).
//
// The std::set nodes come from a private free list, so inserting and erasing
// on the hot path does not go to malloc once the set has warmed up.
#pragma once

#include <cstddef>
#include <set>
#include <vector>

#include "block.h"

namespace waterwave {

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

struct BySizeThenAddr {
  bool operator()(const Block* a, const Block* b) const {
    if (a->size != b->size) return a->size < b->size;
    return a->addr < b->addr;
  }
};

class FreeSet {
 public:
  using Tree = std::set<Block*, BySizeThenAddr, ArenaAllocator<Block*>>;
  using iterator = Tree::iterator;

  FreeSet() : tree_(BySizeThenAddr(), ArenaAllocator<Block*>(&arena_)) {}
  FreeSet(const FreeSet&) = delete;
  FreeSet& operator=(const FreeSet&) = delete;

  void insert(Block* b) {
    tree_.insert(b);
    b->set = this;
    bytes_ += b->size;
  }
  void erase(Block* b) {
    tree_.erase(b);
    b->set = nullptr;
    bytes_ -= b->size;
  }
  // Smallest block with size >= bytes (lowest address on ties), or nullptr.
  Block* best_fit(std::size_t bytes) const {
    Block key;
    key.size = bytes;
    key.addr = 0;
    auto it = tree_.lower_bound(&key);
    return it == tree_.end() ? nullptr : *it;
  }
  iterator lower_bound(std::size_t bytes) const {
    Block key;
    key.size = bytes;
    key.addr = 0;
    return tree_.lower_bound(&key);
  }
  Block* largest() const { return tree_.empty() ? nullptr : *tree_.rbegin(); }
  std::size_t bytes() const { return bytes_; }
  std::size_t count() const { return tree_.size(); }
  bool empty() const { return tree_.empty(); }
  iterator begin() const { return tree_.begin(); }
  iterator end() const { return tree_.end(); }

 private:
  NodeArena arena_;  // declared first: the tree's nodes live in it
  Tree tree_;
  std::size_t bytes_ = 0;
};

}  // namespace waterwave
