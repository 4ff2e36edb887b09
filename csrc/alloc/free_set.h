// A set of free blocks ordered by (size, address): best fit in O(log n). A
// set by owner (block.h) orders them by their segment's stream first: best
// fit among one stream's segments in O(log n).
//
// The std::set nodes come from a private free list, so inserting and erasing
// on the hot path does not go to malloc once the set has warmed up.
//
// May include: block.h.
#pragma once

#include <cstddef>
#include <iterator>

#include "block.h"

namespace waterwave {

class FreeSet {
 public:
  using Tree = FreeTree;
  using iterator = Tree::iterator;

  explicit FreeSet(bool by_owner = false)
      : tree_(BySizeThenAddr{by_owner}, ArenaAllocator<Block*>(&arena_)) {}
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
  bool by_owner() const { return tree_.key_comp().by_owner; }
  // Smallest block with size >= bytes (lowest address on ties), or nullptr.
  // Not in a set by owner: best_fit_of there.
  Block* best_fit(std::size_t bytes) const {
    Block key;
    key.size = bytes;
    key.addr = 0;
    auto it = tree_.lower_bound(&key);
    return it == tree_.end() ? nullptr : *it;
  }
  // In a set by owner: the smallest block with size >= bytes of a segment
  // `owner` reserved, or nullptr.
  Block* best_fit_of(StreamId owner, std::size_t bytes) const {
    Block key;
    key.size = bytes;
    key.addr = 0;
    key.stream = owner;  // no segment: owner_of reads the stream
    auto it = tree_.lower_bound(&key);
    return it == tree_.end() || owner_of(*it) != owner ? nullptr : *it;
  }
  iterator lower_bound(std::size_t bytes) const {
    Block key;
    key.size = bytes;
    key.addr = 0;
    return tree_.lower_bound(&key);
  }
  // In a set by owner, the largest of each owner's largest: O(owners log n).
  Block* largest() const {
    if (!by_owner()) return tree_.empty() ? nullptr : *tree_.rbegin();
    Block* best = nullptr;
    for (auto end = tree_.end(); end != tree_.begin();) {
      Block* last = *std::prev(end);  // its owner's largest
      if (!best || last->size > best->size) best = last;
      Block key;
      key.stream = owner_of(last);  // size 0, address 0: that owner's first
      end = tree_.lower_bound(&key);
    }
    return best;
  }
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
