// The C entry points PyTorch calls (torch.cuda.memory.CUDAPluggableAllocator,
// torch 2.14's CUDAPluggableAllocator.h), over the CUDA runtime next door.
//
// They are exported from waterwave._C itself, so the Python bindings and
// PyTorch share one allocator state. malloc throws on failure (PyTorch turns
// it into a RuntimeError); free never throws (PyTorch calls it from
// destructors) and reports problems on stderr and in free_errors().
//
// May include: cuda_runtime.h.
#pragma once

#include <cstddef>

#define WATERWAVE_EXPORT extern "C" __attribute__((visibility("default")))

WATERWAVE_EXPORT void* waterwave_cuda_malloc(std::size_t size, int device, void* stream);
WATERWAVE_EXPORT void waterwave_cuda_free(void* ptr, std::size_t size, int device, void* stream);
// Optional hooks: Tensor.record_stream and torch.cuda.empty_cache().
WATERWAVE_EXPORT void waterwave_cuda_record_stream(void* ptr, void* stream);
WATERWAVE_EXPORT void waterwave_cuda_empty_cache();
