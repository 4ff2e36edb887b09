// What the two offset searches share: the time sections, the limits that
// stop them, and the outcome of a (sub)search.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

#include "offset_search.h"

namespace waterwave::planner {

enum class Outcome { kFound, kNotFound, kAborted, kTimeout };

// A search stops at its deadline or when the other search has finished.
// The clock is read once every `check_every` nodes: every 256 on small
// instances, where a node costs far less than a clock read, and every node on
// large ones, where a node's pass over thousands of buffers costs
// milliseconds and 256 of them would overrun a time limit by seconds.
struct Limits {
  std::chrono::steady_clock::time_point deadline;
  const std::atomic<bool>* stop = nullptr;
  std::int64_t check_mask = 255;  // a power of two less one

  bool reached() const {
    return stop->load(std::memory_order_relaxed) || std::chrono::steady_clock::now() > deadline;
  }
  bool due(std::int64_t nodes) const { return (nodes & check_mask) == 0 && reached(); }

  static std::int64_t mask_for(std::size_t buffers) { return buffers >= 2048 ? 0 : buffers >= 256 ? 15 : 255; }
};

// The searches recurse once per placement (and the spot search once per spot
// left empty), which on real training steps runs tens of thousands deep:
// each runs on its own thread with a large stack, and a depth guard below
// what that stack holds, past which the answer is "unknown".
constexpr int kMaxDepth = 400000;

// Time is cut into sections at every distinct lifetime end; a buffer covers
// the half-open section range [first, last).
struct Sweep {
  std::vector<int> first, last;
  std::vector<std::vector<int>> section_buffers;
  std::vector<std::int64_t> total;  // bytes live in each section
  std::vector<int> crossing;        // buffers covering sections k and k+1

  explicit Sweep(const std::vector<PackBuffer>& bufs);
  int sections() const { return static_cast<int>(total.size()); }
};

// MiniMalloc's dynamic decomposition: per boundary between sections k and
// k+1, how many unplaced buffers cross it. Where none does, the two sides
// are independent sub-problems ("parts").
class Cuts {
 public:
  explicit Cuts(const Sweep& sweep) : sweep_(sweep), crossing_(sweep.crossing) {}

  // Buffer x is placed: whether a boundary it crossed is now crossed by none.
  bool place(int x) {
    bool freed = false;
    for (int k = sweep_.first[x]; k + 1 < sweep_.last[x]; ++k)
      if (--crossing_[k] == 0) freed = true;
    return freed;
  }
  void unplace(int x) {
    for (int k = sweep_.first[x]; k + 1 < sweep_.last[x]; ++k) ++crossing_[k];
  }
  // The end of the part of sections [start, hi) that begins at start.
  int part_end(int start, int hi) const {
    int k = start;
    while (k + 1 < hi && crossing_[k] > 0) ++k;
    return k + 1;
  }

 private:
  const Sweep& sweep_;
  std::vector<int> crossing_;
};

// Whether some section holds more bytes at once than the capacity: then no
// layout fits, and either search can say so at once.
bool over_capacity(const Sweep& sweep, std::int64_t capacity);

// Buffers with the same lifetime and size are interchangeable ("twins"):
// each buffer's class is the lowest index of its twins.
std::vector<int> twin_classes(const std::vector<PackBuffer>& bufs);

// Sorts buffer indices by keys 0..keys-1 (value(key, i)), the biggest
// first, ties by index: the searches' preorders.
template <class Value>
void sort_biggest_first(std::vector<int>& items, int keys, Value value) {
  std::sort(items.begin(), items.end(), [&](int a, int b) {
    for (int k = 0; k < keys; ++k) {
      const std::int64_t va = value(k, a), vb = value(k, b);
      if (va != vb) return va > vb;
    }
    return a < b;
  });
}

// The rank of each of n buffers in that order.
template <class Value>
std::vector<int> rank_biggest_first(int n, int keys, Value value) {
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  sort_biggest_first(order, keys, value);
  std::vector<int> rank(n);
  for (int r = 0; r < n; ++r) rank[order[r]] = r;
  return rank;
}

// Counts a search's recursion depth for the depth guard.
class DepthGuard {
 public:
  explicit DepthGuard(int& depth) : depth_(depth) { ++depth_; }
  ~DepthGuard() { --depth_; }
  DepthGuard(const DepthGuard&) = delete;
  DepthGuard& operator=(const DepthGuard&) = delete;

 private:
  int& depth_;
};

// Luby's restart sequence: 1 1 2 1 1 2 4 1 1 2 ...
std::int64_t luby(std::uint64_t i);

std::uint64_t mix64(std::uint64_t x);

}  // namespace waterwave::planner
