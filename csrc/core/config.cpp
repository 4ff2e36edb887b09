#include "config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <sstream>
#include <vector>

#include "errors.h"

namespace waterwave {
namespace {

using KeyKind = AllocatorConfig::KeyKind;

// Every key PyTorch 2.14 accepts that the allocators read, and its kind (and
// Waterwave's own, marked).
const std::pair<const char*, KeyKind> kKeys[] = {
    {"max_split_size_mb", KeyKind::kMiB},
    {"max_non_split_rounding_mb", KeyKind::kMiB},
    {"large_segment_size_mb", KeyKind::kMiB},
    {"roundup_power2_divisions", KeyKind::kDivisions},
    {"garbage_collection_threshold", KeyKind::kFraction},
    {"per_process_memory_fraction", KeyKind::kFraction},
    {"expandable_segments", KeyKind::kFlag},
    // Waterwave's own (config.h), not PyTorch's.
    {"own_segments_first", KeyKind::kFlag},
    // Accepted for compatibility; waterwave never holds its lock around a
    // device reservation, so both values behave as True.
    {"release_lock_on_cudamalloc", KeyKind::kFlag},
};

// PyTorch's tokenizer: ',' ':' '[' ']' are tokens, whitespace is dropped, other
// characters build words.
std::vector<std::string> tokenize(const std::string& text) {
  std::vector<std::string> tokens;
  std::string word;
  auto flush = [&] {
    if (!word.empty()) tokens.push_back(word);
    word.clear();
  };
  for (char c : text) {
    if (c == ',' || c == ':' || c == '[' || c == ']') {
      flush();
      tokens.emplace_back(1, c);
    } else if (!std::isspace(static_cast<unsigned char>(c))) {
      word.push_back(c);
    } else {
      flush();
    }
  }
  flush();
  return tokens;
}

bool is_power_of_two(std::size_t v) { return v != 0 && (v & (v - 1)) == 0; }

std::size_t parse_size(const std::string& key, const std::string& value) {
  if (value.empty() || !std::all_of(value.begin(), value.end(),
                                    [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
    throw ConfigError("allocator config: " + key + " needs a whole number, got '" + value +
                      "' (example: " + key + ":256)");
  }
  try {
    return std::stoull(value);
  } catch (const std::exception&) {
    throw ConfigError("allocator config: " + key + " value '" + value + "' is too large");
  }
}

double parse_double(const std::string& key, const std::string& value) {
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || value.empty() || !std::isfinite(v)) {
    throw ConfigError("allocator config: " + key + " needs a number, got '" + value + "'");
  }
  return v;
}

bool parse_bool(const std::string& key, const std::string& value) {
  if (value == "True") return true;
  if (value == "False") return false;
  throw ConfigError("allocator config: " + key + " must be True or False (capitalized, as in "
                    "PYTORCH_CUDA_ALLOC_CONF), got '" + value + "'");
}

std::size_t slot_of_mb(std::size_t mb) {
  // Stops at the last slot, so the shift never reaches the word's width
  // (a bound of 2**63 MiB looped forever: 1 << 64 wrapped to 1).
  std::size_t slot = 0;
  while (slot + 1 < static_cast<std::size_t>(kRoundupSlots) && (std::size_t{1} << (slot + 1)) <= mb) ++slot;
  return slot;
}

std::size_t mib_to_bytes(const char* key, std::size_t mb) {
  if (mb > SIZE_MAX / kMiB) {
    throw ConfigError(std::string("allocator config: ") + key + " value " + std::to_string(mb) +
                      " MiB is too large");
  }
  return mb * kMiB;
}

class Parser {
 public:
  Parser(AllocatorConfig& cfg, const std::string& text, std::string* policy)
      : cfg_(cfg), t_(tokenize(text)), policy_(policy) {}

  void run() {
    while (i_ < t_.size()) {
      const std::string key = word("a key");
      if (key == "," ) continue;
      expect(":", "after key '" + key + "' (form key:value)");
      set(key);
      if (i_ < t_.size()) expect(",", "between settings (form key:value,key:value)");
    }
    cfg_.validate();
  }

 private:
  const std::string& peek() const {
    static const std::string kEnd;
    return i_ < t_.size() ? t_[i_] : kEnd;
  }
  std::string word(const std::string& what) {
    if (i_ >= t_.size()) {
      throw ConfigError("allocator config: expected " + what + " at the end of the string");
    }
    const std::string& w = t_[i_++];
    if (w == ":" || w == "[" || w == "]" || (w == "," && what != "a key")) {
      throw ConfigError("allocator config: expected " + what + ", got '" + w + "'");
    }
    return w;
  }
  void expect(const std::string& tok, const std::string& where) {
    if (peek() != tok) {
      throw ConfigError("allocator config: expected '" + tok + "' " + where + ", got '" +
                        (i_ < t_.size() ? t_[i_] : std::string("end of string")) + "'");
    }
    ++i_;
  }
  std::string value(const std::string& key) { return word("a value for " + key); }

  void set(const std::string& key) {
    if (key == "policy" && policy_) {
      *policy_ = value(key);
      return;
    }
    switch (AllocatorConfig::kind_of(key)) {
      case KeyKind::kMiB: return cfg_.set_mib(key, parse_size(key, value(key)));
      case KeyKind::kFraction: return cfg_.set_fraction(key, parse_double(key, value(key)));
      case KeyKind::kFlag: return cfg_.set_flag(key, parse_bool(key, value(key)));
      case KeyKind::kDivisions: return roundup(key);
      case KeyKind::kUnknown: break;
    }
    throw ConfigError("allocator config: unrecognized key '" + key + "'. Known keys: " +
                      AllocatorConfig::known_keys() + (policy_ ? ", policy" : ""));
  }

  void roundup(const std::string& key) {
    if (peek() != "[") {
      cfg_.set_roundup_power2_divisions(parse_size(key, value(key)));
      return;
    }
    ++i_;  // '['
    std::vector<std::pair<std::string, std::size_t>> intervals;
    while (true) {
      std::string bound = word("an interval (MiB, power of 2) or '>'");
      expect(":", "after roundup interval '" + bound + "'");
      intervals.emplace_back(bound, parse_size(key, word("a division count")));
      if (peek() == "]") {
        ++i_;
        break;
      }
      expect(",", "between roundup entries (form [64:8,>:4])");
    }
    cfg_.set_roundup_power2_divisions(intervals);
  }

  AllocatorConfig& cfg_;
  std::vector<std::string> t_;
  std::string* policy_;
  std::size_t i_ = 0;
};

}  // namespace

AllocatorConfig::KeyKind AllocatorConfig::kind_of(const std::string& key) {
  for (const auto& [name, kind] : kKeys) {
    if (key == name) return kind;
  }
  return KeyKind::kUnknown;
}

std::string AllocatorConfig::known_keys() {
  std::string out;
  for (const auto& [name, kind] : kKeys) out += (out.empty() ? "" : ", ") + std::string(name);
  return out;
}

void AllocatorConfig::set_mib(const std::string& key, std::size_t mb) {
  if (key == "max_split_size_mb") return set_max_split_size_mb(mb);
  if (key == "max_non_split_rounding_mb") return set_max_non_split_rounding_mb(mb);
  if (key == "large_segment_size_mb") return set_large_segment_size_mb(mb);
  throw ConfigError("allocator config: '" + key + "' is not a size in MiB");
}

void AllocatorConfig::set_fraction(const std::string& key, double value) {
  if (key == "garbage_collection_threshold") return set_garbage_collection_threshold(value);
  if (key == "per_process_memory_fraction") return set_per_process_memory_fraction(value);
  throw ConfigError("allocator config: '" + key + "' is not a fraction");
}

void AllocatorConfig::set_flag(const std::string& key, bool on) {
  if (key == "expandable_segments") return set_expandable_segments(on);
  if (key == "own_segments_first") return set_own_segments_first(on);
  if (key == "release_lock_on_cudamalloc") return;  // see kKeys
  throw ConfigError("allocator config: '" + key + "' is not a True/False setting");
}

void AllocatorConfig::set_max_split_size_mb(std::size_t mb) {
  max_split_size = mib_to_bytes("max_split_size_mb", mb);
}

void AllocatorConfig::set_max_non_split_rounding_mb(std::size_t mb) {
  max_non_split_rounding_size = mib_to_bytes("max_non_split_rounding_mb", mb);
  max_non_split_rounding_set = true;
}

void AllocatorConfig::set_large_segment_size_mb(std::size_t mb) {
  if (mb <= 10) {
    throw ConfigError("allocator config: large_segment_size_mb must be > 10 (MiB), got " +
                      std::to_string(mb));
  }
  large_segment_size = mib_to_bytes("large_segment_size_mb", mb);
}

void AllocatorConfig::set_roundup_power2_divisions(std::size_t v) {
  if (!is_power_of_two(v)) {
    throw ConfigError("allocator config: roundup_power2_divisions must be a power of 2, got " +
                      std::to_string(v));
  }
  roundup_power2_divisions.fill(v);
}

void AllocatorConfig::set_roundup_power2_divisions(
    const std::vector<std::pair<std::string, std::size_t>>& intervals) {
  const std::string key = "roundup_power2_divisions";
  auto divs = roundup_power2_divisions;  // a bad entry changes nothing
  bool first = true, any = false;
  std::size_t last_slot = 0;
  for (const auto& [bound, v] : intervals) {
    if (v != 0 && !is_power_of_two(v)) {
      throw ConfigError("allocator config: roundup_power2_divisions values must be a power of 2 "
                        "or 0 to disable rounding, got " + std::to_string(v));
    }
    if (bound == ">") {
      std::size_t from = any ? last_slot + 1 : 1;
      for (std::size_t s = from; s < kRoundupSlots; ++s) divs[s] = v;
    } else {
      std::size_t mb = parse_size(key, bound);
      if (!is_power_of_two(mb)) {
        throw ConfigError("allocator config: roundup_power2_divisions intervals must be powers "
                          "of 2 (MiB), got " + bound);
      }
      std::size_t slot = slot_of_mb(mb);
      if (first) {
        for (std::size_t s = 0; s < slot; ++s) divs[s] = v;
      }
      divs[slot] = v;
      last_slot = slot;
      any = true;
    }
    first = false;
  }
  roundup_power2_divisions = divs;
}

void AllocatorConfig::set_garbage_collection_threshold(double v) {
  if (!(v > 0.0 && v < 1.0)) {
    throw ConfigError("allocator config: garbage_collection_threshold must lie in (0.0, 1.0), got " +
                      std::to_string(v));
  }
  garbage_collection_threshold = v;
}

void AllocatorConfig::set_per_process_memory_fraction(double v) {
  if (!(v >= 0.0 && v <= 1.0)) {
    throw ConfigError("allocator config: per_process_memory_fraction must lie in [0.0, 1.0], got " +
                      std::to_string(v));
  }
  per_process_memory_fraction = v;
}

void AllocatorConfig::validate() const {
  const std::size_t seg_mb = large_segment_size / kMiB;
  if (max_split_size != SIZE_MAX && max_split_size < large_segment_size) {
    throw ConfigError("allocator config: max_split_size_mb too small, must be >= " +
                      std::to_string(seg_mb) + " (large_segment_size_mb)");
  }
  if (max_non_split_rounding_set && max_non_split_rounding_size < large_segment_size) {
    throw ConfigError("allocator config: max_non_split_rounding_mb too small, must be >= " +
                      std::to_string(seg_mb) + " (large_segment_size_mb)");
  }
  if (own_segments_first && expandable_segments) {
    throw ConfigError(
        "allocator config: own_segments_first and expandable_segments exclude each other "
        "(expandable segments already grow each stream's own segment): set one of them");
  }
}

AllocatorConfig AllocatorConfig::parse(const std::string& text, std::string* policy) {
  AllocatorConfig cfg;
  cfg.apply(text, policy);
  return cfg;
}

void AllocatorConfig::apply(const std::string& text, std::string* policy) {
  AllocatorConfig copy = *this;  // a bad string changes nothing
  std::string named = policy ? *policy : std::string();
  Parser(copy, text, policy ? &named : nullptr).run();
  *this = copy;
  if (policy) *policy = named;
}

std::string AllocatorConfig::to_string() const {
  std::ostringstream os;
  bool first = true;
  auto sep = [&] {
    if (!first) os << ",";
    first = false;
  };
  if (max_split_size != SIZE_MAX) {
    sep();
    os << "max_split_size_mb:" << max_split_size / kMiB;
  }
  // Only when given: PyTorch checks its floor against large_segment_size_mb
  // only then, so the default written out would not parse back beside a
  // large_segment_size_mb over 20.
  if (max_non_split_rounding_set) {
    sep();
    os << "max_non_split_rounding_mb:" << max_non_split_rounding_size / kMiB;
  }
  sep();
  os << "large_segment_size_mb:" << large_segment_size / kMiB;
  sep();
  os << "roundup_power2_divisions:[";
  for (int s = 0; s < kRoundupSlots; ++s) {
    if (s) os << ",";
    os << (std::size_t{1} << s) << ":" << roundup_power2_divisions[s];
  }
  os << "]";
  if (garbage_collection_threshold > 0) {
    sep();
    os << "garbage_collection_threshold:" << garbage_collection_threshold;
  }
  sep();
  os << "per_process_memory_fraction:" << per_process_memory_fraction;
  if (expandable_segments) os << ",expandable_segments:True";
  if (own_segments_first_set) os << ",own_segments_first:" << (own_segments_first ? "True" : "False");
  return os.str();
}

std::size_t SizeRules::round_size(std::size_t size) const {
  if (size < kMinBlockSize) return kMinBlockSize;
  // slot = clamp(floor(log2 size) - 20, 0, 15)
  int log2 = 63 - __builtin_clzll(static_cast<unsigned long long>(size));
  int slot = log2 - 20;
  if (slot < 0) slot = 0;
  if (slot > kRoundupSlots - 1) slot = kRoundupSlots - 1;
  const std::size_t divs = cfg.roundup_power2_divisions[slot];
  if (divs > 1 && size > kMinBlockSize * divs) {
    const std::size_t floor_pow2 = std::size_t{1} << log2;
    if (floor_pow2 == size) return size;
    const int log2_divs = 63 - __builtin_clzll(static_cast<unsigned long long>(divs));
    const std::size_t step = floor_pow2 >> log2_divs;
    if (step == 0) return floor_pow2 << 1;
    return (size + step - 1) / step * step;
  }
  return round_to_block(size);
}

std::size_t SizeRules::segment_size(std::size_t rounded) const {
  if (rounded <= kSmallSize) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return cfg.large_segment_size;
  return (rounded + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
}

bool SizeRules::should_split(PoolKind pool, std::size_t block_size, std::size_t request) const {
  const std::size_t remaining = block_size - request;
  // Expandable segments split any block (as PyTorch): a remainder is never
  // stranded, since pages map and unmap under it.
  if (pool == kSmallPool || cfg.expandable_segments) return remaining >= kMinBlockSize;
  return request < cfg.max_split_size && remaining > kSmallSize;
}

bool SizeRules::may_take(std::size_t block_size, std::size_t request) const {
  if (request < cfg.max_split_size && block_size >= cfg.max_split_size) return false;
  if (request >= cfg.max_split_size && block_size >= request + cfg.max_non_split_rounding_size) {
    return false;
  }
  return true;
}

}  // namespace waterwave
