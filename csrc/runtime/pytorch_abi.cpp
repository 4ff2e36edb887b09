#include "pytorch_abi.h"

#include <cstring>

#include "../core/errors.h"
#include "cuda_runtime.h"

using waterwave::Addr;
using waterwave::cuda::CudaRuntime;
using waterwave::cuda::stream_id;

void* waterwave_cuda_malloc(std::size_t size, int device, void* stream) {
  return reinterpret_cast<void*>(CudaRuntime::get().allocate(size, device, stream_id(stream)));
}

int waterwave::cuda::abi_failure(int kind, const char* what, char* message,
                                 std::size_t capacity) {
  if (message && capacity > 0) {
    std::strncpy(message, what, capacity - 1);
    message[capacity - 1] = '\0';
  }
  return kind;
}

int waterwave_cuda_try_malloc(std::size_t size, int device, void* stream, void** out, char* message,
                              std::size_t capacity) {
  return waterwave::cuda::try_allocation(out, message, capacity, [&] {
    return CudaRuntime::get().allocate(size, device, stream_id(stream));
  });
}

int waterwave_cuda_try_malloc_abi() { return kWaterwaveTryMallocAbi; }

void waterwave_cuda_free(void* ptr, std::size_t, int device, void*) {
  if (!ptr) return;
  try {
    CudaRuntime::get().deallocate(reinterpret_cast<Addr>(ptr), device);
  } catch (const std::exception& e) {
    CudaRuntime::get().note_free_error(e.what());
  } catch (...) {
    CudaRuntime::get().note_free_error("free of an unknown pointer failed");
  }
}

void waterwave_cuda_record_stream(void* ptr, void* stream) {
  CudaRuntime::get().record_stream(reinterpret_cast<Addr>(ptr), stream_id(stream));
}

void waterwave_cuda_empty_cache() { CudaRuntime::get().empty_cache(); }

void waterwave_cuda_set_memory_fraction(double fraction, int device) {
  try {
    CudaRuntime::get().stack(device).set_memory_fraction(fraction);
  } catch (const std::exception& e) {
    CudaRuntime::get().note_free_error(std::string("set_per_process_memory_fraction: ") + e.what());
  }
}
