// The allocator micro-benchmarks (csrc/bench), for `waterwave bench alloc`.
#include "../bench/alloc_bench.h"
#include "bindings.h"

namespace waterwave::bindings {

using namespace pybind11::literals;

void bind_bench(py::module_& m) {
  m.def("bench_alloc", [](std::size_t pairs, std::uint64_t seed, int repeats) {
        std::vector<BenchCase> cases;
        {
          py::gil_scoped_release release;
          cases = run_alloc_benchmarks(pairs, seed, repeats);
        }
        py::list out;
        for (const BenchCase& c : cases) {
          out.append(py::dict("name"_a = c.name, "policy"_a = c.policy,
                              "ns_per_pair"_a = c.ns_per_pair, "pairs"_a = c.pairs,
                              "free_blocks"_a = c.free_blocks, "min_ns"_a = c.min_ns,
                              "max_ns"_a = c.max_ns, "repeats"_a = c.repeats,
                              "served"_a = c.served));
        }
        return out;
      }, py::arg("pairs") = 200000, py::arg("seed") = 1, py::arg("repeats") = 5);

}

}  // namespace waterwave::bindings
