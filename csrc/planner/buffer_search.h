// The offset search that branches on which buffer goes next, after
// MiniMalloc (Moffitt, ASPLOS'23): buffers are placed at the lowest offset
// they can take, in non-decreasing (offset, preorder rank) order, so each
// layout is built once; a buffer placed at or above the top of another that
// could still go lower would leave a needless gap, and is not tried. It suits
// instances with slack outside their peak, where the spot search wastes its
// time leaving spots empty one by one.
#pragma once

#include "search_common.h"

namespace waterwave::planner {

SearchResult search_by_buffer(const std::vector<PackBuffer>& bufs, const Sweep& sweep,
                              std::int64_t capacity, const Limits& limits);

}  // namespace waterwave::planner
