// Basic vocabulary shared by every layer of the allocator.
//
// csrc/core is the vocabulary every layer shares: types, errors, the
// configuration grammar, statistics, and the device interface. It knows no
// allocator, no CUDA and no Python.
//
// May include: the standard library only (and this folder).
#pragma once

#include <cstddef>
#include <cstdint>

namespace waterwave {

// Opaque handles: a CUDA backend stores cudaStream_t / cudaEvent_t bit patterns,
// the simulator stores small integers. The core never interprets them.
using StreamId = std::uint64_t;
using EventId = std::uint64_t;
using Addr = std::uintptr_t;

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * kKiB;
constexpr std::size_t kGiB = 1024 * kMiB;

// PyTorch 2.14's constants (docs/design/pytorch-policy.md, Constants): both policies share them so
// that comparisons measure policy, not rounding.
constexpr std::size_t kMinBlockSize = 512;         // sizes round to multiples of this
constexpr std::size_t kSmallSize = 1 * kMiB;       // rounded size <= this: small pool
constexpr std::size_t kSmallBuffer = 2 * kMiB;     // small-pool segment size
constexpr std::size_t kMinLargeAlloc = 10 * kMiB;  // below: share a large segment
constexpr std::size_t kRoundLarge = 2 * kMiB;      // above: round segment to this
constexpr int kRoundupSlots = 16;

enum PoolKind : int { kSmallPool = 0, kLargePool = 1 };

// Requests at or above this (1 EiB) are corrupt sizes, refused up front.
constexpr std::size_t kMaxRequest = std::size_t{1} << 60;

// The allocation granularity: every block is a multiple of kMinBlockSize.
constexpr std::size_t round_to_block(std::size_t bytes) {
  return (bytes + kMinBlockSize - 1) / kMinBlockSize * kMinBlockSize;
}

}  // namespace waterwave
