// Allocator configuration, parsed from a PYTORCH_CUDA_ALLOC_CONF-style string
// ("max_split_size_mb:200,roundup_power2_divisions:[256:1,>:4]").
//
// May include: types.h, errors.h.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

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
  bool release_lock_on_device_alloc = true;   // the lock is always dropped around reserve

  // Parse a whole configuration string on top of the defaults. Throws
  // ConfigError naming the key, the bad value and what is accepted.
  static AllocatorConfig parse(const std::string& text);
  // Apply more "key:value" pairs on top of this configuration.
  void apply(const std::string& text);
  // The configuration as a canonical string that parse() accepts.
  std::string to_string() const;
  bool max_split_size_set() const { return max_split_size != SIZE_MAX; }
};

// Size rules both policies share (reference sections 2.4-2.7).
struct SizeRules {
  const AllocatorConfig& cfg;
  std::size_t round_size(std::size_t bytes) const;
  static PoolKind pool_for(std::size_t rounded) {
    return rounded <= kSmallSize ? kSmallPool : kLargePool;
  }
  std::size_t segment_size(std::size_t rounded) const;
  bool should_split(PoolKind pool, std::size_t block_size, std::size_t request) const;
  // Oversize rules: may a request of `request` bytes take a free block of
  // `block_size` bytes? (Inert while max_split_size is unlimited.)
  bool may_take(std::size_t block_size, std::size_t request) const;
};

}  // namespace waterwave
