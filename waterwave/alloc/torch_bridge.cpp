// The torch bridge: PyTorch's allocation entry points in front of waterwave._C,
// raising torch's own exception types.
//
// PyTorch's pluggable allocator lets whatever malloc throws pass through, and
// its Python bindings turn only c10::OutOfMemoryError into
// torch.cuda.OutOfMemoryError, the type training code catches; anything else
// becomes a RuntimeError. Throwing c10's type needs c10's headers and
// libc10.so, which waterwave._C must not depend on (it builds without torch).
// So this small library is compiled separately, against the torch the user
// has, at install time or at first use (torch_bridge.py next door), and it
// lives in the package so that an installed wheel can still build it.
//
// It reaches _C through C function pointers handed over by
// waterwave_torch_bridge_init: no C++ type crosses between the two libraries
// (_C hides its symbols, so its exception types could not be caught here).
//
// May include: c10 headers only.
#include <c10/util/Exception.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <string>
#include <utility>

#define WATERWAVE_BRIDGE_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// Must agree with csrc/runtime/pytorch_abi.h (checked at init).
constexpr int kTryMallocAbi = 1;
constexpr int kMallocOk = 0;
constexpr int kMallocOutOfMemory = 1;

using TryMalloc = int (*)(std::size_t, int, void*, void**, char*, std::size_t);
using Free = void (*)(void*, std::size_t, int, void*);
using AbiVersion = int (*)();

std::atomic<TryMalloc> try_malloc{nullptr};
std::atomic<Free> free_fn{nullptr};

}  // namespace

// 0 on success; otherwise the ABI _C speaks (the two builds disagree: the
// bridge must be rebuilt).
WATERWAVE_BRIDGE_EXPORT int waterwave_torch_bridge_init(void* try_malloc_fn, void* free_function,
                                                       void* abi_fn) {
  const int abi = reinterpret_cast<AbiVersion>(abi_fn)();
  if (abi != kTryMallocAbi) return abi;
  try_malloc.store(reinterpret_cast<TryMalloc>(try_malloc_fn));
  free_fn.store(reinterpret_cast<Free>(free_function));
  return 0;
}

WATERWAVE_BRIDGE_EXPORT void* waterwave_torch_malloc(std::size_t size, int device, void* stream) {
  TryMalloc fn = try_malloc.load(std::memory_order_relaxed);
  if (fn == nullptr) {
    C10_THROW_ERROR(Error, "the Waterwave torch bridge was loaded but not initialized: call "
                           "waterwave.install_allocator() instead of loading it by hand");
  }
  void* out = nullptr;
  char message[2048];
  const int result = fn(size, device, stream, &out, message, sizeof message);
  if (result == kMallocOk) return out;
  if (result == kMallocOutOfMemory) {
    // Torch's messages start "CUDA out of memory."; code that matches on it
    // keeps working. Ours say "out of memory: tried to allocate ...".
    std::string what(message);
    const std::string ours = "out of memory: t";
    if (what.compare(0, ours.size(), ours) == 0) what = "T" + what.substr(ours.size());
    C10_THROW_ERROR(OutOfMemoryError, "CUDA out of memory (Waterwave allocator). " + what);
  }
  C10_THROW_ERROR(Error, std::string("Waterwave allocator: ") + message);
}

// The pluggable allocator's hook for CUDA graphs' private pools: Waterwave
// has none, and a capture that went on without one would let memory the
// graph writes on every replay be handed out again. So it refuses, before
// the capture begins. (cudaStream_t spelled as the CUDA headers spell it:
// the bridge builds without them.)
struct CUstream_st;
WATERWAVE_BRIDGE_EXPORT void waterwave_torch_begin_allocate_to_pool(
    int /*device*/, std::pair<unsigned long long, unsigned long long> /*pool*/,
    std::function<bool(CUstream_st*)> /*filter*/) {
  C10_THROW_ERROR(Error, "CUDA graphs and torch.cuda.MemPool need private memory pools, which "
                         "the Waterwave allocator does not provide yet: capture graphs "
                         "(torch.cuda.graph, torch.compile with mode='reduce-overhead') in a "
                         "process without waterwave.install_allocator(), or use torch.compile's "
                         "default mode");
}

// PyTorch calls free from destructors: _C's free never throws.
WATERWAVE_BRIDGE_EXPORT void waterwave_torch_free(void* ptr, std::size_t size, int device, void* stream) {
  Free fn = free_fn.load(std::memory_order_relaxed);
  if (fn != nullptr) fn(ptr, size, device, stream);
}
