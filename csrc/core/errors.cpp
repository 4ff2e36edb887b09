// How errors print sizes and addresses: one spelling for every message.
#include "errors.h"

#include <cstdio>

#include "types.h"

namespace waterwave {

std::string format_bytes(std::size_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (bytes >= kGiB) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / kGiB);
  } else if (bytes >= kMiB) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / kMiB);
  } else if (bytes >= kKiB) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", b / kKiB);
  } else {
    std::snprintf(buf, sizeof buf, "%zu bytes", bytes);
  }
  return buf;
}

std::string format_addr(unsigned long long addr) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", addr);
  return buf;
}

}  // namespace waterwave
