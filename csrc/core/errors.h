// Exceptions every layer raises, and how messages spell sizes and addresses.
// The bindings map them to Python types: ConfigError -> ValueError,
// OutOfMemoryError -> waterwave.OutOfMemoryError (a MemoryError),
// PointerError -> ValueError, InvariantError -> AssertionError.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace waterwave {

struct ConfigError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct OutOfMemoryError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Unknown pointer, double free, pointer into the middle of an allocation.
struct PointerError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// An internal invariant does not hold: a bug in the allocator, never user error.
struct InvariantError : std::logic_error {
  using std::logic_error::logic_error;
};

// "1.50 MiB", "512 bytes": sizes in messages (errors.cpp).
std::string format_bytes(std::size_t bytes);
// "0x7f00c0000000": addresses in messages.
std::string format_addr(unsigned long long addr);

}  // namespace waterwave
