// The offset searches and best fit on many random instances, under ASan and
// UBSan (built by `make test`). Every layout either returns is checked for
// overlaps and for staying under the capacity (best fit's under its own
// arena, with and without a deadline that cuts it short); zero-slack
// tilings must be found.
//
//   offset_search_run INSTANCES SEED
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "../../csrc/planner/best_fit.h"
#include "../../csrc/planner/offset_search.h"

using waterwave::planner::PackBuffer;
using waterwave::planner::search_offsets;
using waterwave::planner::SearchStatus;
using waterwave::planner::SearchStrategy;

namespace {

// A steps x units rectangle cut into pieces by guillotine cuts.
std::vector<PackBuffer> tiling(std::mt19937_64& rng, int pieces, int steps, int units) {
  struct Rect { int t0, t1, a0, a1; };
  std::vector<Rect> rects = {{0, steps, 0, units}};
  while (static_cast<int>(rects.size()) < pieces) {
    auto largest = std::max_element(rects.begin(), rects.end(), [](const Rect& a, const Rect& b) {
      return (a.t1 - a.t0) * (a.a1 - a.a0) < (b.t1 - b.t0) * (b.a1 - b.a0);
    });
    Rect r = *largest;
    if (r.t1 - r.t0 < 2 && r.a1 - r.a0 < 2) break;
    rects.erase(largest);
    const bool cut_time = r.t1 - r.t0 >= 2 && (r.a1 - r.a0 < 2 || rng() % 2 == 0);
    if (cut_time) {
      const int c = r.t0 + 1 + static_cast<int>(rng() % static_cast<unsigned>(r.t1 - r.t0 - 1));
      rects.push_back({r.t0, c, r.a0, r.a1});
      rects.push_back({c, r.t1, r.a0, r.a1});
    } else {
      const int c = r.a0 + 1 + static_cast<int>(rng() % static_cast<unsigned>(r.a1 - r.a0 - 1));
      rects.push_back({r.t0, r.t1, r.a0, c});
      rects.push_back({r.t0, r.t1, c, r.a1});
    }
  }
  std::shuffle(rects.begin(), rects.end(), rng);
  std::vector<PackBuffer> bufs;
  for (const Rect& r : rects) bufs.push_back({r.t0, r.t1, r.a1 - r.a0});
  return bufs;
}

std::vector<PackBuffer> random_buffers(std::mt19937_64& rng, int n) {
  std::vector<PackBuffer> bufs;
  for (int i = 0; i < n; ++i) {
    const std::int64_t lower = static_cast<std::int64_t>(rng() % 30);
    bufs.push_back({lower, lower + 1 + static_cast<std::int64_t>(rng() % 10),
                    1 + static_cast<std::int64_t>(rng() % 9)});
  }
  return bufs;
}

std::int64_t max_live(const std::vector<PackBuffer>& bufs) {
  std::int64_t best = 0;
  for (const auto& b : bufs) {
    std::int64_t live = 0;
    for (const auto& o : bufs)
      if (o.lower <= b.lower && b.lower < o.upper) live += o.size;
    best = std::max(best, live);
  }
  return best;
}

std::string check(const std::vector<PackBuffer>& bufs, const std::vector<std::int64_t>& offs,
                  std::int64_t capacity) {
  if (offs.size() != bufs.size()) return "wrong number of offsets";
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    if (offs[i] < 0 || offs[i] + bufs[i].size > capacity) return "layout exceeds the capacity";
    for (std::size_t j = 0; j < i; ++j) {
      const bool together = bufs[i].lower < bufs[j].upper && bufs[j].lower < bufs[i].upper;
      const bool apart = offs[i] + bufs[i].size <= offs[j] || offs[j] + bufs[j].size <= offs[i];
      if (together && !apart) return "buffers " + std::to_string(i) + " and " + std::to_string(j) + " overlap";
    }
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s INSTANCES SEED\n", argv[0]);
    return 2;
  }
  const int instances = std::atoi(argv[1]);
  std::mt19937_64 rng(std::strtoull(argv[2], nullptr, 10));
  int found = 0, infeasible = 0, timeouts = 0;
  for (int k = 0; k < instances; ++k) {
    const bool tile = k % 2 == 0;
    const auto bufs = tile ? tiling(rng, 10 + static_cast<int>(rng() % 50), 20, 32)
                           : random_buffers(rng, 5 + static_cast<int>(rng() % 40));
    const std::int64_t bound = max_live(bufs);
    std::vector<std::int64_t> visit(bufs.size());
    for (std::size_t i = 0; i < visit.size(); ++i) visit[i] = static_cast<std::int64_t>(i);
    std::shuffle(visit.begin(), visit.end(), rng);
    for (double seconds : {10.0, 0.0}) {
      const auto fit = waterwave::planner::best_fit(bufs, visit, seconds);
      const std::string err = check(bufs, fit.offsets, fit.arena);
      if (!err.empty() || fit.arena < bound) {
        std::fprintf(stderr, "FAILED instance %d: best fit (%.0f s): %s\n", k, seconds,
                     err.empty() ? "below the max-live bound" : err.c_str());
        return 1;
      }
    }
    // Each search alone, then both side by side (threads racing to answer).
    const SearchStrategy strategy = k % 3 == 0 ? SearchStrategy::kSpot
                                    : k % 3 == 1 ? SearchStrategy::kBuffer
                                                 : SearchStrategy::kBoth;
    for (std::int64_t capacity = bound - 1; capacity <= bound + 2; ++capacity) {
      const auto r = search_offsets(bufs, capacity, 2.0, strategy);
      if (capacity < bound && r.status != SearchStatus::kInfeasible) {
        std::fprintf(stderr, "FAILED instance %d: a layout under the max-live bound\n", k);
        return 1;
      }
      if (r.status == SearchStatus::kFound) {
        const std::string err = check(bufs, r.offsets, capacity);
        if (!err.empty()) {
          std::fprintf(stderr, "FAILED instance %d at capacity %lld: %s\n", k,
                       static_cast<long long>(capacity), err.c_str());
          return 1;
        }
        ++found;
        break;
      }
      if (tile && capacity == bound && r.status == SearchStatus::kInfeasible) {
        std::fprintf(stderr, "FAILED instance %d: a tiling called infeasible\n", k);
        return 1;
      }
      if (capacity >= bound) (r.status == SearchStatus::kInfeasible ? infeasible : timeouts) += 1;
    }
  }
  std::printf("offset_search_run: %d instances, %d found, %d proven infeasible above the bound, %d timeouts\n",
              instances, found, infeasible, timeouts);
  return 0;
}
