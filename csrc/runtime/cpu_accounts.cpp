#include "cpu_accounts.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace waterwave {

ThreadAccounts& cpu_accounts() {
  static ThreadAccounts* accounts = new ThreadAccounts();  // outlives every tensor
  return *accounts;
}

}  // namespace waterwave

int waterwave_cpu_accounts_abi() { return kWaterwaveCpuAccountsAbi; }

int waterwave_cpu_before_allocate(std::size_t bytes, char* message, std::size_t capacity) {
  if (waterwave::cpu_accounts().before_allocate(bytes)) return 0;
  if (message != nullptr && capacity != 0) {
    const std::string& why = waterwave::ThreadAccounts::why();
    const std::size_t n = std::min(why.size(), capacity - 1);
    std::memcpy(message, why.data(), n);
    message[n] = '\0';
  }
  return 1;
}

void waterwave_cpu_allocated(void* ptr, std::size_t bytes) {
  waterwave::cpu_accounts().allocated(reinterpret_cast<waterwave::Addr>(ptr),
                                      [bytes] { return bytes; });
}

void waterwave_cpu_freed(void* ptr) {
  waterwave::cpu_accounts().freed(reinterpret_cast<waterwave::Addr>(ptr));
}
