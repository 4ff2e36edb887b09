// The slice of the CUDA driver API the allocator needs, loaded at run time.
//
// Building needs no CUDA toolkit: the few types are declared here with the
// driver's ABI, and every entry point is looked up with dlsym in the library
// named by WATERWAVE_CUDA_DRIVER (default libcuda.so.1, the driver itself).
// The test suite points it at a fake driver to exercise this backend on a
// machine without a GPU.
//
// May include: core/.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace waterwave::cuda {

// Driver ABI (cuda.h): handles are opaque pointers, device pointers 64-bit.
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;

// Virtual memory management (cuda.h, CUDA 10.2+): the layouts are the driver's ABI.
using CUmemGenericAllocationHandle = unsigned long long;
struct CUmemLocation {
  int type;  // CU_MEM_LOCATION_TYPE_DEVICE
  int id;    // the device ordinal
};
struct CUmemAllocationProp {
  int type;                  // CU_MEM_ALLOCATION_TYPE_PINNED
  int requestedHandleTypes;  // CU_MEM_HANDLE_TYPE_NONE
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;  // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
};
constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 0x1;
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 0x1;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3;
constexpr int CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 0x2;

// A driver call failed for a reason other than out-of-memory or not-ready.
struct DriverError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The loaded library and its entry points. One per process; never unloaded
// (frees can arrive from PyTorch at interpreter exit).
struct DriverApi {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceTotalMem)(std::size_t*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxSynchronize)();
  CUresult (*cuMemAlloc)(CUdeviceptr*, std::size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemGetInfo)(std::size_t*, std::size_t*);
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventQuery)(CUevent);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  // CUDA graphs' stream capture (CUDA 10+): optional, nullptr when the
  // driver lacks it (then no stream is ever capturing).
  CUresult (*cuStreamIsCapturing)(CUstream, int*) = nullptr;
  // Virtual memory management: optional (nullptr when the driver lacks it;
  // then expandable segments are refused with a clear error).
  CUresult (*cuMemGetAllocationGranularity)(std::size_t*, const CUmemAllocationProp*, int) = nullptr;
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr,
                                  unsigned long long) = nullptr;
  CUresult (*cuMemAddressFree)(CUdeviceptr, std::size_t) = nullptr;
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, std::size_t, const CUmemAllocationProp*,
                          unsigned long long) = nullptr;
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*cuMemMap)(CUdeviceptr, std::size_t, std::size_t, CUmemGenericAllocationHandle,
                       unsigned long long) = nullptr;
  CUresult (*cuMemUnmap)(CUdeviceptr, std::size_t) = nullptr;
  CUresult (*cuMemSetAccess)(CUdeviceptr, std::size_t, const CUmemAccessDesc*, std::size_t) = nullptr;
  bool has_vmm() const { return cuMemSetAccess != nullptr; }

  std::string path;

  // Loads `path` (or WATERWAVE_CUDA_DRIVER, or libcuda.so.1) once and calls
  // cuInit. Throws DriverError naming the library and the missing symbol.
  static const DriverApi& load(const std::string& path = "");

  // Throws DriverError("<what> failed: CUDA_ERROR_X (n)") unless r is success.
  void check(CUresult r, const char* what) const;
  std::string error_name(CUresult r) const;
};

}  // namespace waterwave::cuda
