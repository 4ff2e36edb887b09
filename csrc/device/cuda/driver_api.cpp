#include "driver_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <type_traits>

namespace waterwave::cuda {

namespace {

template <typename Fn>
void resolve(void* lib, const std::string& path, const char* name, Fn*& out) {
  out = reinterpret_cast<Fn*>(dlsym(lib, name));
  if (!out) {
    throw DriverError("the CUDA driver library " + path + " has no symbol " + name +
                      ": it is too old or not a CUDA driver (set WATERWAVE_CUDA_DRIVER to "
                      "the right libcuda.so)");
  }
}

// All of the virtual memory entry points, or none: a driver with only some
// is treated as one without them.
void resolve_vmm(void* lib, DriverApi& a) {
  auto opt = [lib](const char* name, auto*& out) {
    out = reinterpret_cast<std::remove_reference_t<decltype(out)>>(dlsym(lib, name));
    return out != nullptr;
  };
  const bool all = opt("cuMemGetAllocationGranularity", a.cuMemGetAllocationGranularity) &
                   opt("cuMemAddressReserve", a.cuMemAddressReserve) &
                   opt("cuMemAddressFree", a.cuMemAddressFree) &
                   opt("cuMemCreate", a.cuMemCreate) & opt("cuMemRelease", a.cuMemRelease) &
                   opt("cuMemMap", a.cuMemMap) & opt("cuMemUnmap", a.cuMemUnmap) &
                   opt("cuMemSetAccess", a.cuMemSetAccess);
  if (!all) a.cuMemSetAccess = nullptr;  // has_vmm() is false
}

}  // namespace

const DriverApi& DriverApi::load(const std::string& requested) {
  static std::mutex mu;
  static DriverApi* api = nullptr;
  std::lock_guard<std::mutex> g(mu);
  std::string path = requested;
  if (path.empty()) {
    const char* env = std::getenv("WATERWAVE_CUDA_DRIVER");
    path = env && *env ? env : "libcuda.so.1";
  }
  if (api) {
    if (api->path != path) {
      throw DriverError("the CUDA driver " + api->path + " is already loaded in this process; "
                        "cannot switch to " + path);
    }
    return *api;
  }
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    throw DriverError("cannot load the CUDA driver " + path + " (" + (why ? why : "unknown") +
                      "): is an NVIDIA driver installed? Set WATERWAVE_CUDA_DRIVER to its "
                      "libcuda.so to use another one");
  }
  auto* a = new DriverApi();
  a->path = path;
  try {
    resolve(lib, path, "cuInit", a->cuInit);
    resolve(lib, path, "cuDeviceGetCount", a->cuDeviceGetCount);
    resolve(lib, path, "cuDeviceGet", a->cuDeviceGet);
    // The _v2 entry points are the 64-bit ones cuda.h maps the plain names to.
    resolve(lib, path, "cuDeviceTotalMem_v2", a->cuDeviceTotalMem);
    resolve(lib, path, "cuDevicePrimaryCtxRetain", a->cuDevicePrimaryCtxRetain);
    resolve(lib, path, "cuCtxGetCurrent", a->cuCtxGetCurrent);
    resolve(lib, path, "cuCtxSetCurrent", a->cuCtxSetCurrent);
    resolve(lib, path, "cuCtxSynchronize", a->cuCtxSynchronize);
    resolve(lib, path, "cuMemAlloc_v2", a->cuMemAlloc);
    resolve(lib, path, "cuMemFree_v2", a->cuMemFree);
    resolve(lib, path, "cuMemGetInfo_v2", a->cuMemGetInfo);
    resolve(lib, path, "cuEventCreate", a->cuEventCreate);
    resolve(lib, path, "cuEventDestroy_v2", a->cuEventDestroy);
    resolve(lib, path, "cuEventRecord", a->cuEventRecord);
    resolve(lib, path, "cuEventQuery", a->cuEventQuery);
    resolve(lib, path, "cuEventSynchronize", a->cuEventSynchronize);
    resolve(lib, path, "cuStreamWaitEvent", a->cuStreamWaitEvent);
    resolve(lib, path, "cuGetErrorName", a->cuGetErrorName);
    resolve_vmm(lib, *a);
    a->cuStreamIsCapturing = reinterpret_cast<decltype(a->cuStreamIsCapturing)>(
        dlsym(lib, "cuStreamIsCapturing"));
    a->check(a->cuInit(0), "cuInit");
  } catch (...) {
    delete a;
    dlclose(lib);
    throw;
  }
  api = a;  // kept for the life of the process
  return *api;
}

std::string DriverApi::error_name(CUresult r) const {
  const char* name = nullptr;
  if (cuGetErrorName && cuGetErrorName(r, &name) == CUDA_SUCCESS && name) return name;
  return "CUDA error";
}

void DriverApi::check(CUresult r, const char* what) const {
  if (r == CUDA_SUCCESS) return;
  throw DriverError(std::string(what) + " failed: " + error_name(r) + " (" + std::to_string(r) +
                    ")");
}

}  // namespace waterwave::cuda
