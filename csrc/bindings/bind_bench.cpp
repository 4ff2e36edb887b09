// The allocator micro-benchmarks (csrc/bench), for `waterwave bench alloc`.
#include "../bench/alloc_bench.h"
#include "bindings.h"

namespace waterwave::bindings {

void bind_bench(py::module_& m) {
  m.def("bench_alloc", [](std::size_t pairs, std::uint64_t seed, int repeats) {
        std::vector<BenchCase> cases;
        {
          py::gil_scoped_release release;
          cases = run_alloc_benchmarks(pairs, seed, repeats);
        }
        py::list out;
        for (const BenchCase& c : cases) {
          py::dict d;
          d["name"] = c.name;
          d["policy"] = c.policy;
          d["ns_per_pair"] = c.ns_per_pair;
          d["pairs"] = c.pairs;
          d["free_blocks"] = c.free_blocks;
          d["min_ns"] = c.min_ns;
          d["max_ns"] = c.max_ns;
          d["repeats"] = c.repeats;
          py::dict served;
          for (const auto& [k, v] : c.served) served[py::str(k)] = v;
          d["served"] = served;
          out.append(d);
        }
        return out;
      }, py::arg("pairs") = 200000, py::arg("seed") = 1, py::arg("repeats") = 5);

}

}  // namespace waterwave::bindings
