// The offset search that branches on spots, an exact-cover search. It builds
// only bottom-justified layouts (every buffer rests on another or on zero;
// any layout can be pushed down into one). Each section keeps a floor below
// which it is settled. A node takes the lowest floor and, among the sections
// there, the one with the fewest choices (as exact-cover solvers do), then
// branches on which buffer rests on that spot, or on leaving the spot empty:
// the floor then rises to the next height anything could rest at, which only
// sections with slack can afford. Identical buffers are tried once, failed
// part states are remembered, and wherever no unplaced buffer crosses a time
// boundary the two sides are solved independently (MiniMalloc's dynamic
// decomposition). On zero-slack instances no spot may stay empty, and it is
// at its best there.
#pragma once

#include "search_common.h"

namespace waterwave::planner {

SearchResult search_by_spot(const std::vector<PackBuffer>& bufs, const Sweep& sweep,
                            std::int64_t capacity, const Limits& limits);

}  // namespace waterwave::planner
