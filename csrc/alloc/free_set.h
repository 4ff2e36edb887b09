// A set of free blocks ordered by (size, address): best fit in O(log n).
//
// The std::set nodes come from a private free list, so inserting and erasing
// on the hot path does not go to malloc once the set has warmed up.
//
// May include: block.h.
#pragma once

#include <cstddef>

#include "block.h"

namespace waterwave {

class FreeSet {
 public:
  using Tree = FreeTree;
  using iterator = Tree::iterator;

  FreeSet() : tree_(BySizeThenAddr(), ArenaAllocator<Block*>(&arena_)) {}
  FreeSet(const FreeSet&) = delete;
  FreeSet& operator=(const FreeSet&) = delete;

  void insert(Block* b) {
    b->pos = tree_.insert(b).first;
    b->set = this;
    bytes_ += b->size;
  }
  void erase(Block* b) {
    tree_.erase(b->pos);  // O(1) amortized: no search
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
