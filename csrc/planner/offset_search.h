// A complete search for buffer offsets under a fixed capacity (dynamic
// storage allocation as a decision problem), after MiniMalloc (Moffitt,
// ASPLOS'23). Knows nothing of graphs, tensors or Python: buffers in, offsets
// out.
//
// Two complete searches run side by side, one thread each, and the first to
// settle the question answers it: the spot search (spot_search.h), an
// exact-cover search at its best where buffers tile the memory exactly, and
// the buffer search (buffer_search.h), MiniMalloc's own branching, at its
// best where there is slack outside the peak. Neither dominates the other.
// Being complete, "infeasible" is a proof.
//
// May include: this folder and the standard library (no allocator, no CUDA).
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
  std::int64_t nodes = 0;             // search nodes visited (both searches)
};

// Which searches run: both (the default), or one alone (to test each, or to
// keep to one thread).
enum class SearchStrategy { kBoth, kSpot, kBuffer };

// Throws std::invalid_argument on a malformed buffer (empty lifetime,
// non-positive size) or a negative capacity.
SearchResult search_offsets(const std::vector<PackBuffer>& buffers, std::int64_t capacity,
                            double seconds, SearchStrategy strategy = SearchStrategy::kBoth);

}  // namespace waterwave::planner
