// The planner's offset search (csrc/planner), for waterwave.planner.offsets.
#include "../planner/best_fit.h"
#include "../planner/offset_search.h"
#include "bindings.h"

namespace waterwave::bindings {

namespace {

std::vector<planner::PackBuffer> pack_buffers(const std::vector<std::int64_t>& lower,
                                              const std::vector<std::int64_t>& upper,
                                              const std::vector<std::int64_t>& size) {
  if (lower.size() != upper.size() || lower.size() != size.size())
    throw py::value_error("lower, upper and size must have the same length");
  std::vector<planner::PackBuffer> bufs(lower.size());
  for (std::size_t i = 0; i < bufs.size(); ++i) bufs[i] = {lower[i], upper[i], size[i]};
  return bufs;
}

}  // namespace

void bind_planner(py::module_& m) {
  m.def("best_fit", [](const std::vector<std::int64_t>& lower, const std::vector<std::int64_t>& upper,
                       const std::vector<std::int64_t>& size, const std::vector<std::int64_t>& visit,
                       double seconds) {
        const std::vector<planner::PackBuffer> bufs = pack_buffers(lower, upper, size);
        planner::BestFitResult r;
        try {
          py::gil_scoped_release release;
          r = planner::best_fit(bufs, visit, seconds);
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        } catch (const std::overflow_error& e) {
          throw py::value_error(e.what());
        }
        return py::make_tuple(r.offsets, r.arena, r.complete);
      }, py::arg("lower"), py::arg("upper"), py::arg("size"), py::arg("visit"), py::arg("seconds"),
      "Greedy best fit in the visiting order given (see csrc/planner/best_fit.h). Returns "
      "(offsets, arena, complete): complete is False when the time ran out and the buffers not "
      "yet visited were stacked on top.");
  m.def("search_offsets", [](const std::vector<std::int64_t>& lower, const std::vector<std::int64_t>& upper,
                             const std::vector<std::int64_t>& size, std::int64_t capacity, double seconds,
                             const std::string& strategy) {
        const std::vector<planner::PackBuffer> bufs = pack_buffers(lower, upper, size);
        planner::SearchStrategy which;
        if (strategy == "both") which = planner::SearchStrategy::kBoth;
        else if (strategy == "spot") which = planner::SearchStrategy::kSpot;
        else if (strategy == "buffer") which = planner::SearchStrategy::kBuffer;
        else throw py::value_error("unknown strategy '" + strategy + "': use 'both', 'spot' or 'buffer'");
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
