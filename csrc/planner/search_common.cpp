#include "search_common.h"

#include <tuple>

namespace waterwave::planner {

Sweep::Sweep(const std::vector<PackBuffer>& bufs) {
  std::vector<std::int64_t> points;
  points.reserve(bufs.size() * 2);
  for (const auto& b : bufs) {
    points.push_back(b.lower);
    points.push_back(b.upper);
  }
  std::sort(points.begin(), points.end());
  points.erase(std::unique(points.begin(), points.end()), points.end());
  const int count = points.empty() ? 0 : static_cast<int>(points.size()) - 1;
  auto index = [&](std::int64_t t) {
    return static_cast<int>(std::lower_bound(points.begin(), points.end(), t) - points.begin());
  };
  const int n = static_cast<int>(bufs.size());
  first.resize(n);
  last.resize(n);
  section_buffers.resize(count);
  total.assign(count, 0);
  crossing.assign(std::max(count - 1, 0), 0);
  std::vector<int> crossing_delta(count + 1, 0);
  for (int i = 0; i < n; ++i) {
    first[i] = index(bufs[i].lower);
    last[i] = index(bufs[i].upper);
    for (int s = first[i]; s < last[i]; ++s) {
      section_buffers[s].push_back(i);
      total[s] += bufs[i].size;
    }
    if (last[i] - first[i] >= 2) {
      ++crossing_delta[first[i]];
      --crossing_delta[last[i] - 1];
    }
  }
  int run = 0;
  for (int k = 0; k + 1 < count; ++k) crossing[k] = run += crossing_delta[k];
}

bool over_capacity(const Sweep& sweep, std::int64_t capacity) {
  return std::any_of(sweep.total.begin(), sweep.total.end(),
                     [&](std::int64_t t) { return t > capacity; });
}

std::vector<int> twin_classes(const std::vector<PackBuffer>& bufs) {
  const int n = static_cast<int>(bufs.size());
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  auto kind = [&](int i) { return std::make_tuple(bufs[i].lower, bufs[i].upper, bufs[i].size); };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return kind(a) < kind(b); });
  std::vector<int> cls(n, 0);
  for (int k = 0; k < n; ++k)
    cls[order[k]] = k > 0 && kind(order[k]) == kind(order[k - 1]) ? cls[order[k - 1]] : order[k];
  return cls;
}

std::int64_t luby(std::uint64_t i) {
  for (std::uint64_t k = 1;; ++k) {
    if (i == (1ULL << k) - 1) return std::int64_t{1} << (k - 1);
    if (i < (1ULL << k) - 1) return luby(i - (1ULL << (k - 1)) + 1);
  }
}

std::uint64_t mix64(std::uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace waterwave::planner
