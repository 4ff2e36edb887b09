// Waterwave's CPU allocator: c10's CPU allocator with Waterwave's CPU thread
// accounts in front (csrc/runtime/cpu_accounts.h), so that what each
// waterwave.sharing member's thread allocates on the CPU is counted, and an
// allocation that would pass the training session's budget waits for the
// other members' frees, or fails with c10::OutOfMemoryError (torch's
// torch.OutOfMemoryError, which torch.cuda.OutOfMemoryError also names). Members on
// the CPU are gated by the same rules as on a GPU, so tests and small
// searches run them for real.
//
// The allocator it wraps keeps doing the allocating: each pointer is that
// allocator's, handed out with this library's deleter, which tells the
// accounts and then calls the wrapped deleter. A DataPtr's context stays its
// data pointer, as PyTorch's raw_allocate and is_simple_data_ptr expect.
// An allocation the wrapped allocator hands out otherwise (another deleter,
// another context) is passed on untouched, and not counted.
//
// Compiled against the user's torch (torch_bridge.py's TorchLibrary; loaded
// by cpu_allocator.py); it reaches waterwave._C through C function pointers
// handed over by waterwave_cpu_allocator_init.
//
// May include: c10 headers only.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <string>

#define WATERWAVE_CPU_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// Must agree with csrc/runtime/cpu_accounts.h (checked at init).
constexpr int kCpuAccountsAbi = 1;

using AbiVersion = int (*)();
using BeforeAllocate = int (*)(std::size_t, char*, std::size_t);
using Allocated = void (*)(void*, std::size_t);
using Freed = void (*)(void*);

BeforeAllocate before_allocate = nullptr;
Allocated allocated = nullptr;
Freed freed = nullptr;
c10::Allocator* wrapped = nullptr;
c10::DeleterFnPtr wrapped_deleter = nullptr;

void delete_counted(void* ptr) {
  freed(ptr);
  wrapped_deleter(ptr);
}

struct AccountedCPUAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (n != 0) {
      char message[2048];
      if (before_allocate(n, message, sizeof message) != 0) {
        C10_THROW_ERROR(OutOfMemoryError, message);
      }
    }
    c10::DataPtr data = wrapped->allocate(n);
    void* ptr = data.get();
    if (ptr == nullptr || data.get_context() != ptr || data.get_deleter() != wrapped_deleter) {
      return data;
    }
    const c10::Device device = data.device();
    data.release_context();  // ours to delete now
    allocated(ptr, n);
    return {ptr, ptr, &delete_counted, device};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return wrapped->raw_deleter() == wrapped_deleter ? &delete_counted : nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    wrapped->copy_data(dest, src, count);
  }
};

AccountedCPUAllocator accounted;
std::mutex install_mu;

int fail(const std::string& what, char* message, std::size_t capacity) {
  if (message != nullptr && capacity != 0) {
    const std::size_t n = std::min(what.size(), capacity - 1);
    std::memcpy(message, what.data(), n);
    message[n] = '\0';
  }
  return 1;
}

}  // namespace

// 0 on success; otherwise the ABI _C speaks (the two builds disagree: this
// library must be rebuilt).
WATERWAVE_CPU_EXPORT int waterwave_cpu_allocator_init(void* abi_fn, void* before_fn,
                                                      void* allocated_fn, void* freed_fn) {
  const int abi = reinterpret_cast<AbiVersion>(abi_fn)();
  if (abi != kCpuAccountsAbi) return abi;
  std::lock_guard<std::mutex> g(install_mu);
  before_allocate = reinterpret_cast<BeforeAllocate>(before_fn);
  allocated = reinterpret_cast<Allocated>(allocated_fn);
  freed = reinterpret_cast<Freed>(freed_fn);
  return 0;
}

// Puts the accounted allocator in front of PyTorch's CPU allocator (once;
// again is a no-op). 0 on success; 1 with the reason in message.
WATERWAVE_CPU_EXPORT int waterwave_cpu_allocator_install(char* message, std::size_t capacity) {
  std::lock_guard<std::mutex> g(install_mu);
  if (before_allocate == nullptr) {
    return fail("waterwave's CPU allocator was loaded but not initialized", message, capacity);
  }
  if (c10::GetCPUAllocator() == &accounted) return 0;
  c10::Allocator* current = c10::GetCPUAllocator();
  c10::DeleterFnPtr deleter = nullptr;
  {
    c10::DataPtr probe = current->allocate(64);
    if (probe.get() == nullptr || probe.get_context() != probe.get() ||
        probe.get_deleter() == nullptr) {
      return fail("PyTorch's CPU allocator in use hands out pointers with contexts of their own "
                  "(another allocator was installed in its place); waterwave cannot count "
                  "them: remove that allocator to share memory on the CPU",
                  message, capacity);
    }
    deleter = probe.get_deleter();
  }
  wrapped = current;
  wrapped_deleter = deleter;
  c10::SetCPUAllocator(&accounted, /*priority=*/0);
  if (c10::GetCPUAllocator() != &accounted) {
    return fail("PyTorch kept another CPU allocator registered with a higher priority; "
                "waterwave cannot count CPU memory beside it",
                message, capacity);
  }
  return 0;
}

WATERWAVE_CPU_EXPORT int waterwave_cpu_allocator_installed() {
  return c10::GetCPUAllocator() == &accounted ? 1 : 0;
}
