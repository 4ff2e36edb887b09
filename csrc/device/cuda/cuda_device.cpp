#include "cuda_device.h"

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

std::size_t CudaDevice::free_memory() const {
  ContextScope scope(*this);
  std::size_t free = 0, total = 0;
  api_.check(api_.cuMemGetInfo(&free, &total), "cuMemGetInfo");
  return free;
}

}  // namespace waterwave::cuda
