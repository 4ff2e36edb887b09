// The planner's offset search (csrc/planner), for waterwave.planner.offsets.
#include "../planner/offset_search.h"
#include "bindings.h"

namespace waterwave::bindings {

void bind_planner(py::module_& m) {
  m.def("search_offsets", [](const std::vector<std::int64_t>& lower, const std::vector<std::int64_t>& upper,
                             const std::vector<std::int64_t>& size, std::int64_t capacity, double seconds,
                             const std::string& strategy) {
        if (lower.size() != upper.size() || lower.size() != size.size())
          throw py::value_error("lower, upper and size must have the same length");
        planner::SearchStrategy which;
        if (strategy == "both") which = planner::SearchStrategy::kBoth;
        else if (strategy == "spot") which = planner::SearchStrategy::kSpot;
        else if (strategy == "buffer") which = planner::SearchStrategy::kBuffer;
        else throw py::value_error("unknown strategy '" + strategy + "': use 'both', 'spot' or 'buffer'");
        std::vector<planner::PackBuffer> bufs(lower.size());
        for (std::size_t i = 0; i < bufs.size(); ++i) bufs[i] = {lower[i], upper[i], size[i]};
        planner::SearchResult r;
        {
          py::gil_scoped_release release;
          r = planner::search_offsets(bufs, capacity, seconds, which);
        }
        const char* status = r.status == planner::SearchStatus::kFound        ? "found"
                             : r.status == planner::SearchStatus::kInfeasible ? "infeasible"
                                                                              : "timeout";
        return py::make_tuple(status, r.offsets, r.nodes);
      }, py::arg("lower"), py::arg("upper"), py::arg("size"), py::arg("capacity"), py::arg("seconds"),
      py::arg("strategy") = "both",
      "Complete search for offsets within `capacity` (see csrc/planner/offset_search.h): the spot "
      "and the buffer search side by side ('both'), or one alone ('spot', 'buffer'). "
      "Returns (status, offsets, nodes): status is 'found', 'infeasible' (proven) or 'timeout'.");
}

}  // namespace waterwave::bindings
