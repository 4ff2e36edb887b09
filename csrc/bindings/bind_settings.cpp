// The settings grammar and the list of policies, for waterwave.alloc.settings.
#include "bindings.h"

namespace waterwave::bindings {

void bind_settings(py::module_& m) {
  m.def("policies", [] {
        py::list out;
        for (const PolicyInfo& p : policies()) out.append(py::make_tuple(p.name, p.summary));
        return out;
      }, "Every allocation policy as (name, summary), the default first.");
  m.def("parse_policy", [](const std::string& name) { return policy_info(parse_policy(name)).name; },
        py::arg("name"), "Validate a policy name (ConfigError naming the choices).");
  m.def("parse_config", [](const std::string& text) { return AllocatorConfig::parse(text).to_string(); },
        py::arg("text"), "Validate a config string; returns its canonical form.");
  m.def("round_size", [](std::size_t n, const std::string& config) {
        const AllocatorConfig cfg = AllocatorConfig::parse(config);
        return SizeRules{cfg}.round_size(n);
      }, py::arg("nbytes"), py::arg("config") = "");
  m.def("segment_size", [](std::size_t rounded, const std::string& config) {
        const AllocatorConfig cfg = AllocatorConfig::parse(config);
        return SizeRules{cfg}.segment_size(rounded);
      }, py::arg("rounded"), py::arg("config") = "");
}

}  // namespace waterwave::bindings
