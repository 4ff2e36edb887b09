#include "buffer_search.h"

#include <limits>
#include <tuple>

namespace waterwave::planner {
namespace {

constexpr std::int64_t kUnplaced = -1;

// Preorders, tried in turn with growing node budgets (MiniMalloc's "WAT",
// "TAW", "TWA"): lifetime length, area, and the fullest section the buffer
// lives in, each the biggest first. As in MiniMalloc, every sub-problem is
// ranked afresh, its sections' fullness counting only unplaced buffers:
// MiniMalloc's benchmark I (374 buffers) went from unsettled in 100 s to
// settled in under 2 s.
enum class Key { kLength, kArea, kTotal };
const std::vector<std::vector<Key>> kPreorders = {
    {Key::kLength, Key::kArea, Key::kTotal},
    {Key::kTotal, Key::kArea, Key::kLength},
    {Key::kTotal, Key::kLength, Key::kArea},
};

class BufferSearch {
 public:
  BufferSearch(const std::vector<PackBuffer>& bufs, const Sweep& sweep, std::int64_t capacity,
               const Limits& limits)
      : bufs_(bufs), sweep_(sweep), capacity_(capacity), limits_(limits) {
    const int n = static_cast<int>(bufs.size());
    twin_class_ = twin_classes(bufs);
    fullest_.assign(n, 0);
    rank_.assign(n, 0);
    twin_before_.assign(n, -1);
    last_of_class_.assign(n, -1);
  }

  SearchResult run() {
    SearchResult result;
    const int n = static_cast<int>(bufs_.size());
    if (over_capacity(sweep_, capacity_)) {
      result.status = SearchStatus::kInfeasible;
      return result;
    }
    offset_.assign(n, kUnplaced);
    solution_.assign(n, kUnplaced);
    top_.assign(sweep_.sections(), 0);
    unplaced_total_ = sweep_.total;
    lowest_.assign(sweep_.sections(), 0);
    scratch_.resize(static_cast<std::size_t>(n) + 2);  // one list per depth; depth <= n + 1
    std::int64_t budget = 2 * static_cast<std::int64_t>(n) + 64;
    for (std::size_t attempt = 0;; ++attempt) {
      if (attempt > 0 && attempt % kPreorders.size() == 0) budget *= 2;
      keys_ = &kPreorders[attempt % kPreorders.size()];
      node_budget_ = budget;
      const Outcome outcome = solve_parts(0, sweep_.sections());
      result.nodes = nodes_;
      if (outcome == Outcome::kAborted) continue;
      if (outcome == Outcome::kFound) {
        result.status = SearchStatus::kFound;
        result.offsets = solution_;
      } else {
        result.status = outcome == Outcome::kNotFound ? SearchStatus::kInfeasible : SearchStatus::kTimeout;
      }
      return result;
    }
  }

 private:
  // Ranks a part's buffers by the current preorder, with the fullness of
  // the part's sections as it is now; the ranks of the buffers of the part
  // being split are kept in ``saved`` and put back by restore_ranks.
  struct SavedRank {
    int buffer, rank, twin_before;
  };
  void rank_part(std::vector<int>& part, int lo, int hi, std::vector<SavedRank>& saved) {
    for (int x : part) {
      saved.push_back({x, rank_[x], twin_before_[x]});
      std::int64_t fullest = 0;
      for (int s = std::max(sweep_.first[x], lo); s < std::min(sweep_.last[x], hi); ++s)
        fullest = std::max(fullest, unplaced_total_[s]);
      fullest_[x] = fullest;
    }
    const std::vector<Key>& keys = *keys_;
    sort_biggest_first(part, static_cast<int>(keys.size()), [&](int k, int x) -> std::int64_t {
      const auto& b = bufs_[x];
      switch (keys[k]) {
        case Key::kLength: return b.upper - b.lower;
        case Key::kArea: return b.size * (b.upper - b.lower);
        case Key::kTotal: return fullest_[x];
      }
      return 0;
    });
    // Twins (same lifetime, so always in the same part) are interchangeable:
    // each may be placed only after its twin of the next lower rank.
    for (std::size_t r = 0; r < part.size(); ++r) {
      const int x = part[r];
      rank_[x] = static_cast<int>(r);
      twin_before_[x] = last_of_class_[twin_class_[x]];
      last_of_class_[twin_class_[x]] = x;
    }
    for (int x : part) last_of_class_[twin_class_[x]] = -1;
  }

  void restore_ranks(const std::vector<SavedRank>& saved) {
    for (const auto& r : saved) {
      rank_[r.buffer] = r.rank;
      twin_before_[r.buffer] = r.twin_before;
    }
  }

  // Sections [lo, hi) split wherever no unplaced buffer crosses a boundary;
  // each part is solved on its own, its canonical order starting afresh.
  Outcome solve_parts(int lo, int hi) {
    for (int start = lo; start < hi;) {
      const int end = cuts_.part_end(start, hi);
      std::vector<int> part;
      for (int s = start; s < end; ++s)
        for (int x : sweep_.section_buffers[s])
          if (offset_[x] == kUnplaced && std::max(sweep_.first[x], start) == s) part.push_back(x);
      if (!part.empty()) {
        std::vector<SavedRank> saved;
        rank_part(part, start, end, saved);
        const Outcome outcome = dfs(part, start, end, 0, -1);
        restore_ranks(saved);
        if (outcome != Outcome::kFound) return outcome;
      }
      start = end;
    }
    return Outcome::kFound;
  }

  struct Candidate {
    std::int64_t offset;
    int rank;
    int buffer;
    bool operator<(const Candidate& o) const { return std::tie(offset, rank) < std::tie(o.offset, o.rank); }
  };

  Outcome dfs(const std::vector<int>& part, int lo, int hi, std::int64_t last_offset, int last_rank) {
    if (--node_budget_ < 0) return Outcome::kAborted;
    if (depth_ >= kMaxDepth) return Outcome::kTimeout;
    if (limits_.due(++nodes_)) return Outcome::kTimeout;
    const DepthGuard deeper(depth_);

    // Each unplaced buffer's lowest offset: the highest top across its
    // lifetime (placements in a section only ever stack upwards).
    std::vector<Candidate>& list = scratch_[depth_];
    list.clear();
    constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::max();
    std::int64_t min_height = kNone;
    for (int x : part) {
      if (offset_[x] != kUnplaced) continue;
      std::int64_t start = 0;
      for (int s = sweep_.first[x]; s < sweep_.last[x]; ++s) start = std::max(start, top_[s]);
      list.push_back({start, rank_[x], x});
      min_height = std::min(min_height, start + bufs_[x].size);
    }
    if (list.empty()) return Outcome::kFound;

    // Inference: nothing more goes below the last placement's offset, nor
    // below the lowest offset any of a section's unplaced buffers can take;
    // what a section still holds must fit above that.
    for (int s = lo; s < hi; ++s) lowest_[s] = kNone;
    for (const auto& c : list)
      for (int s = std::max(sweep_.first[c.buffer], lo); s < std::min(sweep_.last[c.buffer], hi); ++s)
        lowest_[s] = std::min(lowest_[s], c.offset);
    for (int s = lo; s < hi; ++s)
      if (unplaced_total_[s] > 0 && std::max(lowest_[s], last_offset) + unplaced_total_[s] > capacity_)
        return Outcome::kNotFound;

    std::sort(list.begin(), list.end());
    for (std::size_t k = 0; k < list.size(); ++k) {
      const Candidate c = list[k];
      if (c.offset < last_offset || (c.offset == last_offset && c.rank < last_rank)) continue;
      if (c.offset >= min_height) break;  // a needless gap below; the list is sorted by offset
      const int x = c.buffer;
      if (twin_before_[x] >= 0 && offset_[twin_before_[x]] == kUnplaced) continue;
      place(x, c.offset);
      const Outcome outcome = descend(x, part, lo, hi, c.offset, c.rank);
      unplace(x);
      if (outcome != Outcome::kNotFound) return outcome;
    }
    return Outcome::kNotFound;
  }

  Outcome descend(int x, const std::vector<int>& part, int lo, int hi, std::int64_t offset, int rank) {
    const Outcome outcome = cuts_.place(x) ? solve_parts(lo, hi) : dfs(part, lo, hi, offset, rank);
    cuts_.unplace(x);
    return outcome;
  }

  void place(int x, std::int64_t offset) {
    offset_[x] = offset;
    solution_[x] = offset;
    saved_tops_.push_back(0);  // marks where x's saved tops begin
    for (int s = sweep_.first[x]; s < sweep_.last[x]; ++s) {
      saved_tops_.push_back(top_[s]);
      top_[s] = offset + bufs_[x].size;
      unplaced_total_[s] -= bufs_[x].size;
    }
  }

  void unplace(int x) {
    for (int s = sweep_.last[x] - 1; s >= sweep_.first[x]; --s) {
      top_[s] = saved_tops_.back();
      saved_tops_.pop_back();
      unplaced_total_[s] += bufs_[x].size;
    }
    saved_tops_.pop_back();
    offset_[x] = kUnplaced;
  }

  const std::vector<PackBuffer>& bufs_;
  const Sweep& sweep_;
  const std::int64_t capacity_;
  const Limits& limits_;

  const std::vector<Key>* keys_ = nullptr;
  std::vector<std::int64_t> fullest_, offset_, solution_, top_, unplaced_total_, lowest_;
  std::vector<std::int64_t> saved_tops_;
  std::vector<int> rank_, twin_class_, twin_before_, last_of_class_;
  Cuts cuts_{sweep_};
  std::vector<std::vector<Candidate>> scratch_;
  std::int64_t nodes_ = 0, node_budget_ = 0;
  int depth_ = 0;
};

}  // namespace

SearchResult search_by_buffer(const std::vector<PackBuffer>& bufs, const Sweep& sweep,
                              std::int64_t capacity, const Limits& limits) {
  return BufferSearch(bufs, sweep, capacity, limits).run();
}

}  // namespace waterwave::planner
