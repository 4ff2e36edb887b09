// Allocator configuration: typed settings, parsed once at the edge from a
// PYTORCH_CUDA_ALLOC_CONF-style string
// ("max_split_size_mb:200,roundup_power2_divisions:[256:1,>:4]") or set one
// by one through the typed setters (Python's keyword arguments). Both paths
// check a value the same way, in its setter.
//
// May include: types.h, errors.h.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "types.h"

namespace waterwave {

struct AllocatorConfig {
  std::size_t max_split_size = SIZE_MAX;               // blocks >= this never split
  std::size_t max_non_split_rounding_size = 20 * kMiB;  // oversize reuse slack
  std::size_t large_segment_size = 20 * kMiB;          // segment for 1-10 MiB requests
  std::array<std::size_t, kRoundupSlots> roundup_power2_divisions{};
  double garbage_collection_threshold = 0.0;  // 0: off
  double per_process_memory_fraction = 1.0;   // 1: no limit
  bool expandable_segments = false;           // grow segments by mapping pages (VMM)
  // Not a PyTorch key (Waterwave's own, as `policy`): under the waterwave
  // policy a stream takes other streams' free memory only once the device
  // is out (waterwave_policy.cpp). Inert under the pytorch policy, whose
  // streams never share blocks; exclusive with expandable_segments, whose
  // growth keeps each stream in its own segment already.
  bool own_segments_first = false;
  bool own_segments_first_set = false;  // given (True or False): chosen, not a default
  bool release_lock_on_device_alloc = true;   // the lock is always dropped around reserve
  bool max_non_split_rounding_set = false;    // PyTorch checks its floor only when given
  // Not a PyTorch key, never parsed: a private pool's (CUDA graphs,
  // torch.cuda.MemPool) cached segments stay when the device is out of
  // memory, because a captured graph replays into its pool's free blocks.
  bool keep_segments_on_oom = false;

  // Parse a whole configuration string on top of the defaults. Throws
  // ConfigError naming the key, the bad value and what is accepted. With
  // `policy`, the string may also hold Waterwave's `policy:NAME` entry
  // (WATERWAVE_ALLOC_CONF), whose name is stored there unchecked (the
  // policies live above core/: alloc/policies.h checks it).
  static AllocatorConfig parse(const std::string& text, std::string* policy = nullptr);
  // Apply more "key:value" pairs on top of this configuration; a bad
  // string changes nothing.
  void apply(const std::string& text, std::string* policy = nullptr);

  // Typed settings, by PyTorch's key names: a key's kind says which setter
  // takes it (one list of keys, kKeys in config.cpp, serves the string
  // parser and keyword arguments alike). Each setter checks its value and
  // throws ConfigError; validate() checks the settings against each other.
  enum class KeyKind { kMiB, kFraction, kFlag, kDivisions, kUnknown };
  static KeyKind kind_of(const std::string& key);
  static std::string known_keys();  // for messages: "max_split_size_mb, ..."
  void set_mib(const std::string& key, std::size_t mb);       // the *_mb keys
  void set_fraction(const std::string& key, double value);    // thresholds and fractions
  void set_flag(const std::string& key, bool on);             // True/False keys
  void set_max_split_size_mb(std::size_t mb);
  void set_max_non_split_rounding_mb(std::size_t mb);
  void set_large_segment_size_mb(std::size_t mb);
  void set_roundup_power2_divisions(std::size_t divisions);  // every interval
  // Per interval: (upper bound in MiB, a power of 2, or ">" for the rest;
  // divisions), in increasing order, as in "[64:8,256:4,>:1]".
  void set_roundup_power2_divisions(
      const std::vector<std::pair<std::string, std::size_t>>& intervals);
  void set_garbage_collection_threshold(double threshold);
  void set_per_process_memory_fraction(double fraction);
  void set_expandable_segments(bool on) { expandable_segments = on; }
  void set_own_segments_first(bool on) {
    own_segments_first = on;
    own_segments_first_set = true;
  }
  void validate() const;
  bool operator==(const AllocatorConfig& other) const { return to_string() == other.to_string(); }
  // The configuration as a canonical string that parse() accepts.
  std::string to_string() const;
  bool max_split_size_set() const { return max_split_size != SIZE_MAX; }
};

// Size rules both policies share (docs/design/pytorch-policy.md, Size rounding to Splitting).
struct SizeRules {
  const AllocatorConfig& cfg;
  std::size_t round_size(std::size_t bytes) const;
  static PoolKind pool_for(std::size_t rounded) {
    return rounded <= kSmallSize ? kSmallPool : kLargePool;
  }
  std::size_t segment_size(std::size_t rounded) const;
  // What a request of `bytes` costs the cache: its rounded block, which
  // shares a segment, or from kMinLargeAlloc up the segment of its own it
  // gets. The planner and the pipeline count tensors at this (bound for
  // Python as waterwave._C.footprint).
  std::size_t footprint(std::size_t bytes) const {
    const std::size_t rounded = round_size(bytes);
    return rounded < kMinLargeAlloc ? rounded : segment_size(rounded);
  }
  bool should_split(PoolKind pool, std::size_t block_size, std::size_t request) const;
  // Oversize rules: may a request of `request` bytes take a free block of
  // `block_size` bytes? (Inert while max_split_size is unlimited.)
  bool may_take(std::size_t block_size, std::size_t request) const;
};

}  // namespace waterwave
