// The entry points of the native registration (waterwave/alloc/
// native_abi.h has their types and what they return), over the CUDA
// runtime next door. Exported from waterwave._C, as pytorch_abi.h's are.
//
// May include: cuda_runtime.h, pytorch_abi.h, waterwave/alloc/native_abi.h.
#pragma once

#include "../../waterwave/alloc/native_abi.h"
#include "pytorch_abi.h"

WATERWAVE_EXPORT int waterwave_native_abi();
WATERWAVE_EXPORT int waterwave_cuda_device_stats(int device, WaterwaveDeviceStats* out,
                                                 char* message, size_t capacity);
// which: 0 the peaks, 1 the accumulated counts.
WATERWAVE_EXPORT int waterwave_cuda_reset_stats(int device, int which, char* message,
                                                size_t capacity);
// fraction > 0: set it; then *out gets the fraction in force.
WATERWAVE_EXPORT int waterwave_cuda_memory_fraction(int device, double fraction, double* out,
                                                    char* message, size_t capacity);
// The device's free and total memory, as the driver reports them.
WATERWAVE_EXPORT int waterwave_cuda_mem_info(int device, size_t* free_bytes, size_t* total_bytes,
                                             char* message, size_t capacity);
// A free naming no device (a DataPtr's deleter); never throws.
WATERWAVE_EXPORT void waterwave_cuda_free_owned(void* ptr);
WATERWAVE_EXPORT int waterwave_cuda_allocation_size(void* ptr, size_t* out, char* message,
                                                    size_t capacity);
WATERWAVE_EXPORT int waterwave_cuda_visit_segments(void* context, WaterwaveSegmentVisitor visit,
                                                   char* message, size_t capacity);
WATERWAVE_EXPORT int waterwave_cuda_record_history(int enabled, size_t max_entries,
                                                   char* message, size_t capacity);
WATERWAVE_EXPORT int waterwave_cuda_history_enabled();
WATERWAVE_EXPORT int waterwave_cuda_visit_history(void* context, WaterwaveTraceVisitor visit,
                                                  char* message, size_t capacity);

// ---- Private pools (private_pools.h), named by PyTorch's MempoolId_t. ----
// createOrIncrefPool.
WATERWAVE_EXPORT int waterwave_cuda_pool_create(int device, uint64_t first, uint64_t second,
                                                char* message, size_t capacity);
// beginAllocateToPool and endAllocateToPool: open and close a window.
WATERWAVE_EXPORT int waterwave_cuda_pool_begin(int device, uint64_t first, uint64_t second,
                                               char* message, size_t capacity);
WATERWAVE_EXPORT int waterwave_cuda_pool_end(int device, uint64_t first, uint64_t second,
                                             char* message, size_t capacity);
// releasePool: one use fewer.
WATERWAVE_EXPORT int waterwave_cuda_pool_release(int device, uint64_t first, uint64_t second,
                                                 char* message, size_t capacity);
// The pool's use count (0: no such pool).
WATERWAVE_EXPORT int waterwave_cuda_pool_use_count(int device, uint64_t first, uint64_t second);
// An allocation in the pool; returns kWaterwaveMalloc* as try_malloc does.
WATERWAVE_EXPORT int waterwave_cuda_pool_malloc(int device, uint64_t first, uint64_t second,
                                                size_t size, void* stream, void** out,
                                                char* message, size_t capacity);
// emptyCache of a private pool: retired pools on every device give their
// cache back (PyTorch's MemPool does this as it is destroyed).
WATERWAVE_EXPORT int waterwave_cuda_pools_empty(char* message, size_t capacity);
// setCheckpointPoolState: the pool's allocated blocks are freed (each address
// goes to `freed`), then `live` are handed out again where they were.
WATERWAVE_EXPORT int waterwave_cuda_pool_restore(int device, uint64_t first, uint64_t second,
                                                 const WaterwaveLiveBlock* live, size_t count,
                                                 void* context, WaterwaveAddrVisitor freed,
                                                 char* message, size_t capacity);
