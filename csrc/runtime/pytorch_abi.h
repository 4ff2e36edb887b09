// The C entry points PyTorch calls (torch.cuda.memory.CUDAPluggableAllocator,
// torch 2.14's CUDAPluggableAllocator.h), over the CUDA runtime next door.
//
// They are exported from waterwave._C itself, so the Python bindings and
// PyTorch share one allocator state. malloc throws on failure (PyTorch turns
// it into a RuntimeError); free never throws (PyTorch calls it from
// destructors) and reports problems on stderr and in free_errors().
//
// waterwave_cuda_try_malloc is the same allocation without exceptions, for
// the torch bridge (waterwave/alloc/torch_bridge.cpp): a library built
// against torch's c10 that throws c10::OutOfMemoryError, which PyTorch turns
// into torch.cuda.OutOfMemoryError. _C itself never links torch.
//
// May include: core/errors.h, cuda_runtime.h.
#pragma once

#include <cstddef>
#include <exception>

#include "../core/errors.h"

#define WATERWAVE_EXPORT extern "C" __attribute__((visibility("default")))

WATERWAVE_EXPORT void* waterwave_cuda_malloc(std::size_t size, int device, void* stream);
WATERWAVE_EXPORT void waterwave_cuda_free(void* ptr, std::size_t size, int device, void* stream);
// What waterwave_cuda_try_malloc returns; the bridge's copy must agree
// (it passes kWaterwaveTryMallocAbi to its init and is refused otherwise).
enum WaterwaveMallocResult { kWaterwaveMallocOk = 0, kWaterwaveMallocOutOfMemory = 1, kWaterwaveMallocFailed = 2 };
constexpr int kWaterwaveTryMallocAbi = 1;
// On failure, message gets the error (truncated to capacity, NUL-terminated).
WATERWAVE_EXPORT int waterwave_cuda_try_malloc(std::size_t size, int device, void* stream, void** out,
                                               char* message, std::size_t capacity);
WATERWAVE_EXPORT int waterwave_cuda_try_malloc_abi();

namespace waterwave::cuda {
// An ABI call's failure: `what` into message (truncated to capacity,
// NUL-terminated); returns `kind`.
int abi_failure(int kind, const char* what, char* message, std::size_t capacity);
// An allocation as the try_malloc entry points report it: *out gets
// allocate()'s address, or the result says out of memory or failed.
template <typename Allocate>
int try_allocation(void** out, char* message, std::size_t capacity, Allocate allocate) {
  try {
    *out = reinterpret_cast<void*>(allocate());
    return kWaterwaveMallocOk;
  } catch (const OutOfMemoryError& e) {
    return abi_failure(kWaterwaveMallocOutOfMemory, e.what(), message, capacity);
  } catch (const std::exception& e) {
    return abi_failure(kWaterwaveMallocFailed, e.what(), message, capacity);
  } catch (...) {
    return abi_failure(kWaterwaveMallocFailed, "allocation failed with an unknown error", message,
                       capacity);
  }
}
}  // namespace waterwave::cuda
// Optional hooks: Tensor.record_stream, torch.cuda.empty_cache() and
// torch.cuda.set_per_process_memory_fraction (which cannot raise through
// the hook: a refused fraction is reported as free_errors() are).
WATERWAVE_EXPORT void waterwave_cuda_record_stream(void* ptr, void* stream);
WATERWAVE_EXPORT void waterwave_cuda_empty_cache();
WATERWAVE_EXPORT void waterwave_cuda_set_memory_fraction(double fraction, int device);
