// Greedy best fit for buffers with fixed lifetimes, as TFLite and XLA lay
// out tensors: buffers are visited in a given order and each goes into the
// smallest gap between already placed buffers that overlap it in time, at
// the lowest such offset, else on top of them. The planner's first layout and
// the upper bound its exact search (offset_search.h) starts from.
//
// Bounded in time: past the deadline, the buffers not yet visited are
// stacked above everything placed (a valid layout, found in O(1) each), and
// the result says the layout is incomplete, so a time limit holds on any
// input size (the full pass is quadratic when every buffer overlaps every
// other).
//
// May include: this folder and the standard library.
#pragma once

#include <cstdint>
#include <vector>

#include "offset_search.h"

namespace waterwave::planner {

struct BestFitResult {
  std::vector<std::int64_t> offsets;  // by buffer index
  std::int64_t arena = 0;             // the highest end of any buffer
  bool complete = true;               // false: the deadline stacked some buffers on top
};

// `visit` is a permutation of the buffers' indices; sizes may be 0 (offset
// 0). Throws std::invalid_argument for a bad visit order, a negative size or
// an empty lifetime, and std::overflow_error if an offset would pass 2^63.
BestFitResult best_fit(const std::vector<PackBuffer>& buffers, const std::vector<std::int64_t>& visit,
                       double seconds);

}  // namespace waterwave::planner
