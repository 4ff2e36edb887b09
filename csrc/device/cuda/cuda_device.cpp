#include "cuda_device.h"

#include "../../core/errors.h"

namespace waterwave::cuda {

namespace {

CUstream as_stream(StreamId s) { return reinterpret_cast<CUstream>(static_cast<std::uintptr_t>(s)); }
CUevent as_event(EventId e) { return reinterpret_cast<CUevent>(static_cast<std::uintptr_t>(e)); }

}  // namespace

CudaDevice::ContextScope::ContextScope(const CudaDevice& d) : api_(d.api_) {
  api_.check(api_.cuCtxGetCurrent(&previous_), "cuCtxGetCurrent");
  if (previous_ != d.context_) {
    api_.check(api_.cuCtxSetCurrent(d.context_), "cuCtxSetCurrent");
    switched_ = true;
  }
}

CudaDevice::ContextScope::~ContextScope() {
  if (switched_) api_.cuCtxSetCurrent(previous_);
}

CudaDevice::CudaDevice(const DriverApi& api, int ordinal) : api_(api), ordinal_(ordinal) {
  int count = 0;
  api_.check(api_.cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (ordinal < 0 || ordinal >= count) {
    throw DriverError("no CUDA device " + std::to_string(ordinal) + ": the driver sees " +
                      std::to_string(count));
  }
  CUdevice dev = 0;
  api_.check(api_.cuDeviceGet(&dev, ordinal), "cuDeviceGet");
  // Retained for the life of the process, like the runtime does: blocks
  // outlive any scope we could release it in.
  api_.check(api_.cuDevicePrimaryCtxRetain(&context_, dev), "cuDevicePrimaryCtxRetain");
  api_.check(api_.cuDeviceTotalMem(&total_, dev), "cuDeviceTotalMem");
  if (api_.has_vmm()) {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = {CU_MEM_LOCATION_TYPE_DEVICE, ordinal_};
    std::size_t g = 0;
    // A device without VMM answers an error: then supports_vmm() is false.
    if (api_.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) ==
            CUDA_SUCCESS) {
      granularity_ = g;
    }
  }
}

std::optional<Addr> CudaDevice::reserve(std::size_t bytes) {
  ContextScope scope(*this);
  CUdeviceptr p = 0;
  CUresult r = api_.cuMemAlloc(&p, bytes);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return std::nullopt;
  api_.check(r, "cuMemAlloc");
  return static_cast<Addr>(p);
}

void CudaDevice::release(Addr addr, std::size_t) {
  ContextScope scope(*this);
  api_.check(api_.cuMemFree(static_cast<CUdeviceptr>(addr)), "cuMemFree");
}

EventId CudaDevice::create_event() {
  ContextScope scope(*this);
  CUevent e = nullptr;
  api_.check(api_.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  return static_cast<EventId>(reinterpret_cast<std::uintptr_t>(e));
}

void CudaDevice::destroy_event(EventId event) {
  ContextScope scope(*this);
  api_.check(api_.cuEventDestroy(as_event(event)), "cuEventDestroy");
}

void CudaDevice::record_event(EventId event, StreamId stream) {
  ContextScope scope(*this);
  api_.check(api_.cuEventRecord(as_event(event), as_stream(stream)), "cuEventRecord");
}

bool CudaDevice::query_event(EventId event) {
  ContextScope scope(*this);
  CUresult r = api_.cuEventQuery(as_event(event));
  if (r == CUDA_ERROR_NOT_READY) return false;
  api_.check(r, "cuEventQuery");
  return true;
}

void CudaDevice::synchronize_event(EventId event) {
  ContextScope scope(*this);
  api_.check(api_.cuEventSynchronize(as_event(event)), "cuEventSynchronize");
}

void CudaDevice::stream_wait_event(StreamId stream, EventId event) {
  ContextScope scope(*this);
  api_.check(api_.cuStreamWaitEvent(as_stream(stream), as_event(event), 0), "cuStreamWaitEvent");
}

void CudaDevice::synchronize_device() {
  ContextScope scope(*this);
  api_.check(api_.cuCtxSynchronize(), "cuCtxSynchronize");
}

bool CudaDevice::stream_capturing(StreamId stream) {
  if (!api_.cuStreamIsCapturing) return false;
  ContextScope scope(*this);
  int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE
  api_.check(api_.cuStreamIsCapturing(as_stream(stream), &status), "cuStreamIsCapturing");
  return status != 0;  // active, or invalidated and not yet ended
}

std::size_t CudaDevice::free_memory() const {
  ContextScope scope(*this);
  std::size_t free = 0, total = 0;
  api_.check(api_.cuMemGetInfo(&free, &total), "cuMemGetInfo");
  return free;
}

// ---- Virtual memory. ----

std::optional<Addr> CudaDevice::reserve_address(std::size_t bytes) {
  ContextScope scope(*this);
  CUdeviceptr p = 0;
  CUresult r = api_.cuMemAddressReserve(&p, bytes, 0, 0, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return std::nullopt;
  api_.check(r, "cuMemAddressReserve");
  return static_cast<Addr>(p);
}

void CudaDevice::release_address(Addr addr, std::size_t bytes) {
  ContextScope scope(*this);
  api_.check(api_.cuMemAddressFree(static_cast<CUdeviceptr>(addr), bytes), "cuMemAddressFree");
}

CUresult CudaDevice::map_handle(Addr addr, std::size_t bytes, CUmemGenericAllocationHandle h) {
  const auto ptr = static_cast<CUdeviceptr>(addr);
  CUresult r = api_.cuMemMap(ptr, bytes, 0, h, 0);
  if (r != CUDA_SUCCESS) return r;
  CUmemAccessDesc access{{CU_MEM_LOCATION_TYPE_DEVICE, ordinal_}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  r = api_.cuMemSetAccess(ptr, bytes, &access, 1);
  if (r != CUDA_SUCCESS) api_.cuMemUnmap(ptr, bytes);
  return r;
}

bool CudaDevice::map(Addr addr, std::size_t bytes) {
  ContextScope scope(*this);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location = {CU_MEM_LOCATION_TYPE_DEVICE, ordinal_};
  CUmemGenericAllocationHandle h = 0;
  CUresult r = api_.cuMemCreate(&h, bytes, &prop, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
  api_.check(r, "cuMemCreate");
  r = map_handle(addr, bytes, h);
  if (r != CUDA_SUCCESS) {
    // Nothing stays behind: the handle goes back before we report.
    api_.cuMemRelease(h);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
    api_.check(r, "cuMemMap/cuMemSetAccess");
  }
  std::lock_guard<std::mutex> g(handles_mu_);
  handles_[addr] = {h, bytes};
  return true;
}

void CudaDevice::unmap(Addr addr, std::size_t bytes) {
  ContextScope scope(*this);
  CUmemGenericAllocationHandle h = 0;
  {
    std::lock_guard<std::mutex> g(handles_mu_);
    auto it = handles_.find(addr);
    if (it == handles_.end() || it->second.second != bytes) {
      throw DriverError("unmap of " + format_addr(addr) + ": not one mapping made by map()");
    }
    h = it->second.first;
    handles_.erase(it);
  }
  api_.check(api_.cuMemUnmap(static_cast<CUdeviceptr>(addr), bytes), "cuMemUnmap");
  api_.check(api_.cuMemRelease(h), "cuMemRelease");
}

void CudaDevice::remap(Addr from, Addr to, std::size_t bytes) {
  ContextScope scope(*this);
  std::lock_guard<std::mutex> g(handles_mu_);
  auto it = handles_.find(from);
  if (it == handles_.end() || it->second.second != bytes) {
    throw DriverError("remap of " + format_addr(from) + ": not one mapping made by map()");
  }
  const CUmemGenericAllocationHandle h = it->second.first;
  api_.check(api_.cuMemUnmap(static_cast<CUdeviceptr>(from), bytes), "cuMemUnmap");
  CUresult r = map_handle(to, bytes, h);
  if (r != CUDA_SUCCESS) {
    // Put the memory back where it was, so the caller's view stays true.
    if (map_handle(from, bytes, h) != CUDA_SUCCESS) {
      handles_.erase(it);
      api_.cuMemRelease(h);
      throw DriverError("remap of " + format_addr(from) + " failed (" + api_.error_name(r) +
                        ") and the page could not be mapped back: its memory is lost");
    }
    api_.check(r, "cuMemMap/cuMemSetAccess (remap)");
  }
  handles_.erase(it);
  handles_[to] = {h, bytes};
}

}  // namespace waterwave::cuda
