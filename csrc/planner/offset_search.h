// A complete search for buffer offsets under a fixed capacity (dynamic
// storage allocation as a decision problem), after MiniMalloc (Moffitt,
// ASPLOS'23). Knows nothing of graphs, tensors or Python: buffers in, offsets
// out.
//
// It builds only bottom-justified layouts (every buffer rests on another or
// on zero; any layout can be pushed down into one). Time is cut into
// sections; each keeps a floor below which it is settled. A node takes the
// lowest floor and, among the sections there, the one with the fewest
// choices (as exact-cover solvers do), then branches on which buffer rests
// on that spot, or on leaving the spot empty: the floor then rises to the
// next height anything could rest at, which only sections with slack can
// afford. Identical buffers are tried once, and wherever no unplaced buffer
// crosses a time boundary the two sides are solved independently (MiniMalloc's
// dynamic decomposition). On zero-slack instances no spot may stay empty,
// so it is an exact-cover search. Being complete, "infeasible" is a proof.
#pragma once

#include <cstdint>
#include <vector>

namespace waterwave::planner {

// Live on the half-open step range [lower, upper); size > 0.
struct PackBuffer {
  std::int64_t lower = 0;
  std::int64_t upper = 0;
  std::int64_t size = 0;
};

enum class SearchStatus {
  kFound,       // offsets hold a layout within the capacity
  kInfeasible,  // proven: no layout fits the capacity
  kTimeout,     // ran out of time (or, on huge instances, of stack depth) first; proves nothing
};

struct SearchResult {
  SearchStatus status = SearchStatus::kTimeout;
  std::vector<std::int64_t> offsets;  // by buffer index, when found
  std::int64_t nodes = 0;             // search nodes visited
};

// Throws std::invalid_argument on a malformed buffer (empty lifetime,
// non-positive size) or a negative capacity.
SearchResult search_offsets(const std::vector<PackBuffer>& buffers, std::int64_t capacity,
                            double seconds);

}  // namespace waterwave::planner
