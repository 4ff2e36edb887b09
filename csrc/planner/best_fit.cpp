// Greedy best fit (best_fit.h). The placed buffers overlapping a new one in
// time are found in O(log n + k) for k of them, not by a scan of all placed
// buffers (which made a pass quadratic even on a chain): a placed buffer
// overlaps [lower, upper) if it is live at `lower` (a stabbing query on a
// segment tree over the distinct step values, each buffer stored at the
// O(log n) tree nodes that cover its lifetime) or if it starts inside
// (lower, upper) (an ordered set of the steps where placed buffers start).
// The two sets are disjoint. The deadline is read once every kCheckEvery
// placements.
#include "best_fit.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

namespace waterwave::planner {
namespace {

constexpr std::size_t kCheckEvery = 16;
constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

// The placed buffers, by time.
class PlacedByTime {
 public:
  explicit PlacedByTime(const std::vector<PackBuffer>& buffers) : buffers_(buffers) {
    for (const PackBuffer& b : buffers) {
      steps_.push_back(b.lower);
      steps_.push_back(b.upper);
    }
    std::sort(steps_.begin(), steps_.end());
    steps_.erase(std::unique(steps_.begin(), steps_.end()), steps_.end());
    leaves_ = 1;
    while (leaves_ < steps_.size()) leaves_ *= 2;
    covering_.resize(2 * leaves_);
    starting_.resize(steps_.size());
  }

  void add(int i) {
    const std::size_t lo = index(buffers_[i].lower), up = index(buffers_[i].upper);
    for (std::size_t l = lo + leaves_, r = up + leaves_; l < r; l /= 2, r /= 2) {
      if (l & 1) covering_[l++].push_back(i);
      if (r & 1) covering_[--r].push_back(i);
    }
    starting_[lo].push_back(i);
    started_.insert(lo);
  }

  // Calls f(j) once for every placed buffer j overlapping [lower, upper).
  template <typename F>
  void overlapping(const PackBuffer& b, F&& f) const {
    const std::size_t lo = index(b.lower), up = index(b.upper);
    for (std::size_t node = lo + leaves_; node >= 1; node /= 2)
      for (int j : covering_[node]) f(j);
    for (auto it = started_.upper_bound(lo); it != started_.end() && *it < up; ++it)
      for (int j : starting_[*it]) f(j);
  }

 private:
  std::size_t index(std::int64_t step) const {
    return static_cast<std::size_t>(std::lower_bound(steps_.begin(), steps_.end(), step) - steps_.begin());
  }

  const std::vector<PackBuffer>& buffers_;
  std::vector<std::int64_t> steps_;              // distinct lowers and uppers, sorted
  std::size_t leaves_ = 1;
  std::vector<std::vector<int>> covering_;       // segment tree nodes: buffers covering the node whole
  std::vector<std::vector<int>> starting_;       // by step index: buffers starting there
  std::set<std::size_t> started_;                // step indices where some placed buffer starts
};

std::int64_t end_of(std::int64_t offset, std::int64_t size) {
  if (offset > kMax - size) throw std::overflow_error("best fit: an offset would pass 2^63 bytes");
  return offset + size;
}

}  // namespace

BestFitResult best_fit(const std::vector<PackBuffer>& buffers, const std::vector<std::int64_t>& visit,
                       double seconds) {
  const std::size_t n = buffers.size();
  if (n > static_cast<std::size_t>(std::numeric_limits<int>::max()))
    throw std::invalid_argument("best fit: more than 2^31 buffers");
  if (visit.size() != n) throw std::invalid_argument("best fit: the visiting order must name every buffer once");
  std::vector<char> seen(n, 0);
  for (std::int64_t i : visit) {
    if (i < 0 || static_cast<std::size_t>(i) >= n || seen[i])
      throw std::invalid_argument("best fit: the visiting order must name every buffer once");
    seen[i] = 1;
  }
  for (const PackBuffer& b : buffers) {
    if (b.size < 0) throw std::invalid_argument("best fit: a buffer has a negative size");
    if (b.upper <= b.lower) throw std::invalid_argument("best fit: a buffer has an empty lifetime");
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(std::max(0.0, seconds)));
  BestFitResult r;
  r.offsets.assign(n, 0);
  PlacedByTime placed(buffers);
  std::vector<std::pair<std::int64_t, std::int64_t>> busy;
  std::size_t k = 0;
  for (; k < n; ++k) {
    if (k % kCheckEvery == 0 && std::chrono::steady_clock::now() > deadline) break;
    const PackBuffer& b = buffers[visit[k]];
    if (b.size == 0) continue;
    busy.clear();
    placed.overlapping(b, [&](int j) { busy.emplace_back(r.offsets[j], r.offsets[j] + buffers[j].size); });
    std::sort(busy.begin(), busy.end());
    std::int64_t cursor = 0, best_gap = -1, best_offset = -1;
    for (const auto& [lo, hi] : busy) {
      const std::int64_t gap = lo - cursor;
      if (gap >= b.size && (best_gap < 0 || gap < best_gap)) {
        best_gap = gap;
        best_offset = cursor;
      }
      cursor = std::max(cursor, hi);
    }
    const std::int64_t offset = best_offset >= 0 ? best_offset : cursor;
    const std::int64_t end = end_of(offset, b.size);
    r.offsets[visit[k]] = offset;
    placed.add(static_cast<int>(visit[k]));
    r.arena = std::max(r.arena, end);
  }
  r.complete = k == n;
  for (; k < n; ++k) {  // past the deadline: on top of everything
    const PackBuffer& b = buffers[visit[k]];
    if (b.size == 0) continue;
    r.offsets[visit[k]] = r.arena;
    r.arena = end_of(r.arena, b.size);
  }
  return r;
}

}  // namespace waterwave::planner
