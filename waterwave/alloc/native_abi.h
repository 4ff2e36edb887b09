// The C ABI between waterwave._C and the native registration
// (torch_native.cpp next door): the calls a full PyTorch CUDAAllocator makes
// on Waterwave's CUDA runtime beyond malloc and free (csrc/runtime/
// pytorch_abi.h). Plain C types only: no C++ type crosses between the two
// libraries, which are built apart (_C without torch, the registration
// against the user's torch).
//
// Both sides include this one file (csrc/runtime/native_abi.cpp and
// torch_native.cpp); waterwave_native_abi() returns kWaterwaveNativeAbi as
// _C was built with it, and the registration refuses another.
//
// Every call returns 0 on success, else kWaterwaveMallocFailed (2) with
// the error in `message` (truncated to `capacity`, NUL-terminated).
//
// May include: the C standard headers.
#ifndef WATERWAVE_NATIVE_ABI_H
#define WATERWAVE_NATIVE_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define WATERWAVE_NATIVE_ABI 3

// PyTorch's Stat, and its StatArray: [0] all, [1] small pool, [2] large pool.
typedef struct {
  int64_t current, peak, allocated, freed;
} WaterwaveStat;

typedef struct {
  WaterwaveStat allocation[3], segment[3], active[3], inactive_split[3];
  WaterwaveStat allocated_bytes[3], reserved_bytes[3], active_bytes[3];
  WaterwaveStat inactive_split_bytes[3], requested_bytes[3];
  WaterwaveStat oversize_allocations, oversize_segments;
  int64_t num_alloc_retries, num_ooms, num_sync_all_streams;
  int64_t num_device_alloc, num_device_free, max_split_size;
  int64_t largest_free_block;  // the largest cached free block
} WaterwaveDeviceStats;

typedef struct {
  uintptr_t addr;
  size_t size, requested;
  int allocated;  // handed out and not freed
  int active;     // allocated, or freed and still in use by a stream
} WaterwaveBlockView;

typedef struct {
  int device;
  uintptr_t addr;
  size_t size;
  void* stream;
  int is_large;
  int is_expandable;
  uint64_t pool_first, pool_second;  // the private pool's MempoolId_t; (0, 0): none
  size_t num_blocks;
  const WaterwaveBlockView* blocks;
} WaterwaveSegmentView;

typedef struct {
  const char* action;  // PyTorch's trace action names: "alloc", "free_requested", ...
  int device;
  uintptr_t addr;
  size_t size;
  void* stream;
  double time_us;  // the host's steady clock
} WaterwaveTraceView;

// One allocated block of a private pool's checkpoint.
typedef struct {
  uintptr_t addr;
  size_t size, requested;
} WaterwaveLiveBlock;

typedef void (*WaterwaveAddrVisitor)(void* context, uintptr_t addr);
typedef void (*WaterwaveSegmentVisitor)(void* context, const WaterwaveSegmentView* segment);
typedef void (*WaterwaveTraceVisitor)(void* context, const WaterwaveTraceView* entry);

#ifdef __cplusplus
}
#endif

#endif  // WATERWAVE_NATIVE_ABI_H
