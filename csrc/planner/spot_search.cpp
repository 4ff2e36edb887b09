#include "spot_search.h"

#include <limits>

namespace waterwave::planner {
namespace {

constexpr std::int64_t kUnplaced = -1;

// Orders in which the buffers that may rest on a spot are tried. Which one
// suits an instance is unknown, so they take turns with growing budgets.
enum class Key { kSize, kLength, kArea };
const std::vector<std::vector<Key>> kPreorders = {
    {Key::kSize, Key::kLength},
    {Key::kLength, Key::kSize},
    {Key::kArea, Key::kSize},
};

class SpotSearch {
 public:
  SpotSearch(const std::vector<PackBuffer>& bufs, const Sweep& sweep, std::int64_t capacity,
             const Limits& limits)
      : bufs_(bufs), sweep_(sweep), capacity_(capacity), limits_(limits) {
    const int n = static_cast<int>(bufs.size());
    twin_class_ = twin_classes(bufs);
    by_size_.resize(n);
    for (int i = 0; i < n; ++i) by_size_[i] = i;
    std::sort(by_size_.begin(), by_size_.end(), [&](int a, int b) { return bufs[a].size < bufs[b].size; });
    // Twins share their hash keys: swapping them gives the same state.
    zobrist_.resize(n);
    for (int i = 0; i < n; ++i)
      zobrist_[i] = {mix64(2 * twin_class_[i] + 1), mix64(~static_cast<std::uint64_t>(twin_class_[i]))};
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
    floor_.assign(sweep_.total.size(), 0);
    unplaced_total_ = sweep_.total;
    unplaced_in_ = sweep_.section_buffers;
    slot_begin_.assign(n + 1, 0);
    for (int i = 0; i < n; ++i) slot_begin_[i + 1] = slot_begin_[i] + (sweep_.last[i] - sweep_.first[i]);
    slot_.assign(static_cast<std::size_t>(slot_begin_[n]), 0);
    for (std::size_t sec = 0; sec < unplaced_in_.size(); ++sec)
      for (std::size_t k = 0; k < unplaced_in_[sec].size(); ++k)
        slot_of(unplaced_in_[sec][k], static_cast<int>(sec)) = static_cast<int>(k);
    unplaced_hash_.assign(sweep_.total.size(), {0, 0});
    for (int i = 0; i < n; ++i)
      for (int s = sweep_.first[i]; s < sweep_.last[i]; ++s) toggle(s, i);

    // Restarts: the fixed orders first, then random ones, on Luby's
    // sequence of budgets. Failed states carry over, so restarts are cheap.
    for (std::uint64_t attempt = 1;; ++attempt) {
      rank_ = attempt <= kPreorders.size() ? preorder(kPreorders[attempt - 1]) : shuffled(attempt);
      node_budget_ = luby(attempt) * (4 * static_cast<std::int64_t>(n) + 256);
      const Outcome outcome = solve_parts(0, static_cast<int>(sweep_.total.size()));
      result.nodes = nodes_;
      if (outcome == Outcome::kAborted) continue;
      if (outcome == Outcome::kTimeout) {
        result.status = SearchStatus::kTimeout;
      } else if (outcome == Outcome::kFound) {
        result.status = SearchStatus::kFound;
        result.offsets = solution_;
      } else {
        result.status = SearchStatus::kInfeasible;  // the search was complete
      }
      return result;
    }
  }

 private:
  std::vector<int> shuffled(std::uint64_t seed) const {
    const int n = static_cast<int>(bufs_.size());
    std::vector<int> rank(n);
    for (int i = 0; i < n; ++i) rank[i] = i;
    std::uint64_t state = mix64(seed);
    for (int i = n - 1; i > 0; --i) {
      state = mix64(state);
      std::swap(rank[i], rank[static_cast<int>(state % static_cast<std::uint64_t>(i + 1))]);
    }
    return rank;
  }

  std::vector<int> preorder(const std::vector<Key>& keys) const {
    return rank_biggest_first(static_cast<int>(bufs_.size()), static_cast<int>(keys.size()),
                              [&](int k, int i) -> std::int64_t {
                                const auto& b = bufs_[i];
                                switch (keys[k]) {
                                  case Key::kSize: return b.size;
                                  case Key::kLength: return b.upper - b.lower;
                                  case Key::kArea: return b.size * (b.upper - b.lower);
                                }
                                return 0;
                              });
  }

  // Sections [lo, hi) split wherever no unplaced buffer crosses a boundary;
  // each part is solved on its own.
  Outcome solve_parts(int lo, int hi) {
    for (int start = lo; start < hi;) {
      const int end = cuts_.part_end(start, hi);
      const Outcome outcome = dfs(start, end);
      if (outcome != Outcome::kFound) return outcome;
      start = end;
    }
    return Outcome::kFound;
  }

  // Buffers that can rest on section s at height f: unplaced, covering s,
  // with every section they cover settled exactly up to f; one per twin class.
  void candidates(int s, std::int64_t f, std::vector<int>& out, std::size_t stop_after) const {
    out.clear();
    for (int x : unplaced_in_[s]) {
      if (floor_[sweep_.last[x] - 1] != f || floor_[sweep_.first[x]] != f) continue;
      bool flat = true;
      for (int t = sweep_.first[x]; t < sweep_.last[x] && flat; ++t) flat = floor_[t] == f;
      if (!flat) continue;
      // Of twins, keep the one ranked first, whatever the list order.
      bool twin = false;
      for (int& y : out) {
        if (twin_class_[y] != twin_class_[x]) continue;
        twin = true;
        if (rank_[x] < rank_[y]) y = x;
      }
      if (twin) continue;
      out.push_back(x);
      if (out.size() >= stop_after) return;
    }
  }

  // Different placement orders often reach the same state of a part (its
  // floors and its unplaced buffers); a state that failed once fails again.
  std::pair<std::uint64_t, std::uint64_t> state_key(int lo, int hi) const {
    std::uint64_t a = mix64(static_cast<std::uint64_t>(lo) << 32 | static_cast<std::uint32_t>(hi));
    std::uint64_t b = mix64(a);
    for (int s = lo; s < hi; ++s) {
      const std::uint64_t f = mix64(static_cast<std::uint64_t>(floor_[s]) * 0x100000001b3ULL + s);
      a = mix64(a ^ f ^ unplaced_hash_[s].first);
      b = mix64(b + (f ^ unplaced_hash_[s].second));
    }
    return {a, b};
  }

  void toggle(int s, int x) {
    unplaced_hash_[s].first ^= zobrist_[x].first;
    unplaced_hash_[s].second ^= zobrist_[x].second;
  }

  Outcome dfs(int lo, int hi) {
    if (--node_budget_ < 0) return Outcome::kAborted;
    if (depth_ >= kMaxDepth) return Outcome::kTimeout;
    const DepthGuard deeper(depth_);
    if (limits_.due(++nodes_)) return Outcome::kTimeout;
    const auto key = state_key(lo, hi);
    auto& slot = failed_[key.first & (kFailedSlots - 1)];
    if (slot == key) return Outcome::kNotFound;
    const Outcome outcome = branch(lo, hi);
    if (outcome == Outcome::kNotFound) slot = key;  // the table never grows: slot stays valid
    return outcome;
  }

  Outcome branch(int lo, int hi) {
    constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::max();
    std::int64_t f = kNone;
    for (int s = lo; s < hi; ++s)
      if (unplaced_total_[s] > 0) f = std::min(f, floor_[s]);
    if (f == kNone) return Outcome::kFound;  // everything in this part is placed

    if (hi - lo <= kMaxInferenceSections && !floors_reachable(lo, hi)) return Outcome::kNotFound;

    // The spot at height f with the fewest choices.
    int spot = -1;
    std::size_t fewest = std::numeric_limits<std::size_t>::max();
    std::vector<int> choices, scratch;
    for (int s = lo; s < hi; ++s) {
      if (unplaced_total_[s] == 0 || floor_[s] != f) continue;
      const std::size_t can_skip = floor_[s] + unplaced_total_[s] < capacity_ ? 1 : 0;
      if (fewest <= can_skip) continue;
      candidates(s, f, scratch, fewest - can_skip);
      const std::size_t count = scratch.size() + can_skip;
      if (count == 0) return Outcome::kNotFound;  // nothing can fill it, and no room to leave it
      if (count < fewest) {
        fewest = count;
        spot = s;
        choices.swap(scratch);
        if (fewest == 1) break;  // a forced move: take it without looking further
      }
    }
    const std::size_t skip = floor_[spot] + unplaced_total_[spot] < capacity_ ? 1 : 0;
    if (choices.size() + skip < fewest) candidates(spot, f, choices, fewest);  // refill if cut short
    std::sort(choices.begin(), choices.end(), [&](int a, int b) { return rank_[a] < rank_[b]; });

    for (int x : choices) {
      place(x, f);
      const Outcome outcome = descend(x, lo, hi);
      unplace(x);
      if (outcome != Outcome::kNotFound) return outcome;
    }
    if (!skip) return Outcome::kNotFound;
    // Leave the spot empty. What rests here next sits on some section's
    // current floor, or on a buffer not yet placed (so at least f plus the
    // smallest unplaced size), or at the lowest offset a buffer covering the
    // spot can still take.
    std::int64_t rise = kNone;
    for (int s = lo; s < hi; ++s)
      if (unplaced_total_[s] > 0 && floor_[s] > f) rise = std::min(rise, floor_[s]);
    for (int x : by_size_) {  // the smallest unplaced buffer of this part
      if (offset_[x] == kUnplaced && sweep_.first[x] < hi && lo < sweep_.last[x]) {
        rise = std::min(rise, f + bufs_[x].size);
        break;
      }
    }
    std::int64_t lowest_start = kNone;
    for (int x : unplaced_in_[spot]) lowest_start = std::min(lowest_start, lowest_start_of(x));
    rise = std::max(rise, lowest_start);
    if (rise + unplaced_total_[spot] > capacity_) return Outcome::kNotFound;
    const std::int64_t saved = floor_[spot];
    floor_[spot] = rise;
    const Outcome outcome = dfs(lo, hi);
    floor_[spot] = saved;
    return outcome;
  }

  // MiniMalloc's unallocated-floor inference: nothing can start in a section
  // below the lowest height at which one of its unplaced buffers can start
  // (the highest floor across that buffer's lifetime), so the space under
  // it is lost, and what remains must still fit.
  bool floors_reachable(int lo, int hi) {
    lowest_.assign(static_cast<std::size_t>(hi), std::numeric_limits<std::int64_t>::max());
    for (int s = lo; s < hi; ++s) {
      for (int x : unplaced_in_[s]) {
        if (std::max(sweep_.first[x], lo) != s) continue;
        const std::int64_t start = lowest_start_of(x);
        for (int t = sweep_.first[x]; t < sweep_.last[x]; ++t) lowest_[t] = std::min(lowest_[t], start);
      }
    }
    for (int s = lo; s < hi; ++s)
      if (unplaced_total_[s] > 0 && std::max(floor_[s], lowest_[s]) + unplaced_total_[s] > capacity_)
        return false;
    return true;
  }

  // The lowest offset an unplaced buffer can still take: the highest floor
  // across its lifetime.
  std::int64_t lowest_start_of(int x) const {
    std::int64_t start = 0;
    for (int t = sweep_.first[x]; t < sweep_.last[x]; ++t) start = std::max(start, floor_[t]);
    return start;
  }

  // Continue below a placement, splitting where the buffer just placed was
  // the last unplaced one crossing a section boundary.
  Outcome descend(int x, int lo, int hi) {
    const Outcome outcome = cuts_.place(x) ? solve_parts(lo, hi) : dfs(lo, hi);
    cuts_.unplace(x);
    return outcome;
  }

  // Placing at the floor keeps floor + unplaced bytes of each section as it
  // was, so no capacity check is needed here; only leaving a spot empty adds.
  void place(int x, std::int64_t f) {
    offset_[x] = f;
    solution_[x] = f;
    for (int s = sweep_.first[x]; s < sweep_.last[x]; ++s) {
      floor_[s] = f + bufs_[x].size;
      unplaced_total_[s] -= bufs_[x].size;
      toggle(s, x);
      // Swap x out of the section's unplaced list.
      std::vector<int>& list = unplaced_in_[s];
      const int k = slot_of(x, s);
      const int moved = list.back();
      list[k] = moved;
      slot_of(moved, s) = k;
      list.pop_back();
    }
  }

  int& slot_of(int x, int s) { return slot_[slot_begin_[x] + (s - sweep_.first[x])]; }

  void unplace(int x) {
    const std::int64_t f = offset_[x];
    for (int s = sweep_.first[x]; s < sweep_.last[x]; ++s) {
      floor_[s] = f;
      unplaced_total_[s] += bufs_[x].size;
      toggle(s, x);
      slot_of(x, s) = static_cast<int>(unplaced_in_[s].size());
      unplaced_in_[s].push_back(x);
    }
    offset_[x] = kUnplaced;
  }

  const std::vector<PackBuffer>& bufs_;
  const Sweep& sweep_;
  const std::int64_t capacity_;
  const Limits& limits_;

  std::vector<int> rank_, twin_class_;
  std::vector<std::int64_t> offset_, solution_, floor_, unplaced_total_;
  Cuts cuts_{sweep_};
  std::vector<std::pair<std::uint64_t, std::uint64_t>> zobrist_, unplaced_hash_;
  // Failed part states (two independent 64-bit hashes) in a direct-mapped
  // table, newest wins; kept across restarts.
  static constexpr std::size_t kFailedSlots = 1 << 18;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> failed_ =
      std::vector<std::pair<std::uint64_t, std::uint64_t>>(kFailedSlots);

  std::vector<std::int64_t> lowest_;
  std::vector<int> by_size_;
  // Each section's unplaced buffers, and where each buffer sits in them.
  std::vector<std::vector<int>> unplaced_in_;
  std::vector<std::int64_t> slot_begin_;
  std::vector<int> slot_;
  // The unallocated-floor inference walks every lifetime in the part; on
  // long parts (real training steps have thousands of sections) that costs
  // far more per node than the pruning it buys.
  static constexpr int kMaxInferenceSections = 512;
  std::int64_t nodes_ = 0;
  std::int64_t node_budget_ = 0;
  int depth_ = 0;
};

}  // namespace

SearchResult search_by_spot(const std::vector<PackBuffer>& bufs, const Sweep& sweep,
                            std::int64_t capacity, const Limits& limits) {
  return SpotSearch(bufs, sweep, capacity, limits).run();
}

}  // namespace waterwave::planner
