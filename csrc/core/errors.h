// Exceptions the allocator raises. The bindings map them to Python types:
// ConfigError -> ValueError, OutOfMemoryError -> waterwave.OutOfMemoryError
// (a MemoryError), PointerError -> ValueError.
#pragma once

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

std::string format_bytes(std::size_t bytes);
std::string format_addr(unsigned long long addr);

}  // namespace waterwave
