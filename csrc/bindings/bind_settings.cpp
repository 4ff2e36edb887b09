// Settings as typed values: AllocatorConfig bound as a class, parsed once at
// the edge (a config string, WATERWAVE_ALLOC_CONF, keyword arguments), and
// the list of policies.
#include <pybind11/operators.h>

#include "bindings.h"

namespace waterwave::bindings {
namespace {

std::string type_name(py::handle v) { return py::str(py::type::handle_of(v).attr("__name__")); }

std::size_t whole_number(const std::string& key, py::handle v) {
  if (py::isinstance<py::bool_>(v) || !py::isinstance<py::int_>(v)) {
    throw ConfigError("allocator config: " + key + " takes a whole number, got " + type_name(v) +
                      " " + std::string(py::repr(v)));
  }
  const auto n = v.cast<py::int_>();
  if (n < py::int_(0)) {
    throw ConfigError("allocator config: " + key + " must not be negative, got " +
                      std::string(py::repr(v)));
  }
  try {
    return n.cast<std::size_t>();
  } catch (const py::cast_error&) {
    throw ConfigError("allocator config: " + key + " value " + std::string(py::repr(v)) +
                      " is too large");
  }
}

double number(const std::string& key, py::handle v) {
  if (py::isinstance<py::bool_>(v) || !(py::isinstance<py::int_>(v) || py::isinstance<py::float_>(v))) {
    throw ConfigError("allocator config: " + key + " takes a number, got " + type_name(v) + " " +
                      std::string(py::repr(v)));
  }
  return v.cast<double>();
}

bool flag(const std::string& key, py::handle v) {
  if (!py::isinstance<py::bool_>(v)) {
    throw ConfigError("allocator config: " + key + " takes True or False, got " +
                      std::string(py::repr(v)));
  }
  return v.cast<bool>();
}

void set_roundup(AllocatorConfig& c, const std::string& key, py::handle v) {
  if (py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v)) {
    return c.set_roundup_power2_divisions(whole_number(key, v));
  }
  py::object items = py::reinterpret_borrow<py::object>(v);
  if (py::isinstance<py::dict>(v)) items = v.attr("items")();
  std::vector<std::pair<std::string, std::size_t>> intervals;
  try {
    for (py::handle item : items) {
      auto pair = item.cast<py::tuple>();
      if (pair.size() != 2) throw py::cast_error();
      intervals.emplace_back(py::str(pair[0]), whole_number(key, pair[1]));
    }
  } catch (const py::error_already_set&) {
    intervals.clear();
    throw ConfigError("allocator config: " + key + " takes an int or a mapping of interval (MiB) "
                      "to divisions, e.g. {256: 1, '>': 4}; got " + std::string(py::repr(v)));
  } catch (const py::cast_error&) {
    throw ConfigError("allocator config: " + key + " takes an int or a mapping of interval (MiB) "
                      "to divisions, e.g. {256: 1, '>': 4}; got " + std::string(py::repr(v)));
  }
  c.set_roundup_power2_divisions(intervals);
}

// One keyword setting, by PyTorch's key name, as a typed value.
void set_keyword(AllocatorConfig& c, const std::string& key, py::handle v) {
  switch (AllocatorConfig::kind_of(key)) {
    case AllocatorConfig::KeyKind::kMiB: return c.set_mib(key, whole_number(key, v));
    case AllocatorConfig::KeyKind::kFraction: return c.set_fraction(key, number(key, v));
    case AllocatorConfig::KeyKind::kFlag: return c.set_flag(key, flag(key, v));
    case AllocatorConfig::KeyKind::kDivisions: return set_roundup(c, key, v);
    case AllocatorConfig::KeyKind::kUnknown: break;
  }
  throw ConfigError("allocator config: unrecognized keyword '" + key + "'. Known: " +
                    AllocatorConfig::known_keys());
}

}  // namespace

AllocatorConfig with_keywords(AllocatorConfig config, const py::kwargs& settings) {
  for (auto [key, value] : settings) set_keyword(config, py::str(key), value);
  config.validate();
  return config;
}

void bind_settings(py::module_& m) {
  py::class_<AllocatorConfig>(m, "AllocatorConfig",
      "The allocator's settings as typed values. Made from a PYTORCH_CUDA_ALLOC_CONF-style "
      "string, keyword settings by the same names, or both (keywords last):\n\n"
      "    AllocatorConfig('max_split_size_mb:200', expandable_segments=True)\n\n"
      "A bad value raises ConfigError naming the key and what it accepts.")
      .def(py::init([](const std::string& text, const py::kwargs& settings) {
             return with_keywords(AllocatorConfig::parse(text), settings);
           }), py::arg("text") = "")
      .def("replace", [](const AllocatorConfig& c, const py::kwargs& settings) {
             return with_keywords(c, settings);
           }, "A copy with the keyword settings applied.")
      .def_static("parse", [](const std::string& text) { return AllocatorConfig::parse(text); },
                  py::arg("text"))
      .def_property_readonly("max_split_size", [](const AllocatorConfig& c) -> py::object {
             if (!c.max_split_size_set()) return py::none();
             return py::int_(c.max_split_size);
           }, "Bytes; blocks this large are never split. None: no limit.")
      .def_readonly("max_non_split_rounding_size", &AllocatorConfig::max_non_split_rounding_size)
      .def_readonly("large_segment_size", &AllocatorConfig::large_segment_size)
      .def_property_readonly("roundup_power2_divisions", [](const AllocatorConfig& c) {
             return std::vector<std::size_t>(c.roundup_power2_divisions.begin(),
                                             c.roundup_power2_divisions.end());
           }, "Divisions per power-of-2 interval, from 1 MiB up (0: none).")
      .def_readonly("garbage_collection_threshold", &AllocatorConfig::garbage_collection_threshold)
      .def_readonly("per_process_memory_fraction", &AllocatorConfig::per_process_memory_fraction)
      .def_readonly("expandable_segments", &AllocatorConfig::expandable_segments)
      .def_readonly("own_segments_first", &AllocatorConfig::own_segments_first)
      .def("round_size", [](const AllocatorConfig& c, std::size_t n) { return SizeRules{c}.round_size(n); },
           py::arg("nbytes"), "The block size a request of nbytes is rounded to.")
      .def("segment_size", [](const AllocatorConfig& c, std::size_t rounded) {
             return SizeRules{c}.segment_size(rounded);
           }, py::arg("rounded"), "The segment reserved for a rounded request that finds no block.")
      .def(py::self == py::self)
      .def("__str__", &AllocatorConfig::to_string)
      .def("__repr__", [](const AllocatorConfig& c) {
             return "AllocatorConfig('" + c.to_string() + "')";
           })
      .def(py::pickle([](const AllocatorConfig& c) { return c.to_string(); },
                      [](const std::string& text) { return AllocatorConfig::parse(text); }));
  // A str where an AllocatorConfig is taken is parsed there, once.
  py::implicitly_convertible<py::str, AllocatorConfig>();

  m.def("policies", [] {
        py::list out;
        for (const PolicyInfo& p : policies()) out.append(py::make_tuple(p.name, p.summary));
        return out;
      }, "Every allocation policy as (name, summary), the default first.");
  m.def("parse_policy", [](const std::string& name) { return policy_info(parse_policy(name)).name; },
        py::arg("name"), "Validate a policy name (ConfigError naming the choices).");
  m.def("parse_settings", [](const std::string& text) {
        std::string policy;
        AllocatorConfig config = AllocatorConfig::parse(text, &policy);
        py::object name = py::none();
        if (!policy.empty()) name = py::str(policy_info(parse_policy(policy)).name);
        return py::make_tuple(name, config);
      }, py::arg("text"),
      "A WATERWAVE_ALLOC_CONF string: (the policy it names or None, its AllocatorConfig).");
  m.def("round_size", [](std::size_t n, const AllocatorConfig& c) { return SizeRules{c}.round_size(n); },
        py::arg("nbytes"), py::arg("config") = AllocatorConfig());
  m.def("segment_size", [](std::size_t rounded, const AllocatorConfig& c) {
        return SizeRules{c}.segment_size(rounded);
      }, py::arg("rounded"), py::arg("config") = AllocatorConfig());
  m.def("footprint", [](std::size_t n, const AllocatorConfig& c) { return SizeRules{c}.footprint(n); },
        py::arg("nbytes"), py::arg("config") = AllocatorConfig(),
        "What a request of nbytes costs the cache (SizeRules::footprint).");
}

}  // namespace waterwave::bindings
