#include "native_abi.h"

#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "../core/errors.h"
#include "cuda_runtime.h"

using waterwave::Addr;
using waterwave::AllocatorStack;
using waterwave::cuda::CudaRuntime;
using waterwave::cuda::stream_handle;

namespace {

int failed(const char* what, char* message, std::size_t capacity) {
  if (message && capacity > 0) {
    std::strncpy(message, what, capacity - 1);
    message[capacity - 1] = '\0';
  }
  return kWaterwaveMallocFailed;
}

// Runs `body`, turning any exception into the ABI's error code.
template <typename Body>
int guarded(char* message, std::size_t capacity, Body&& body) {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    return failed(e.what(), message, capacity);
  } catch (...) {
    return failed("unknown error", message, capacity);
  }
}

void copy_stat(const waterwave::Stat& from, WaterwaveStat& to) {
  to = {from.current, from.peak, from.allocated, from.freed};
}

void copy_array(const waterwave::StatArray& from, WaterwaveStat (&to)[3]) {
  for (int i = 0; i < 3; ++i) copy_stat(from.s[i], to[i]);
}

}  // namespace

int waterwave_native_abi() { return WATERWAVE_NATIVE_ABI; }

int waterwave_cuda_device_stats(int device, WaterwaveDeviceStats* out, char* message,
                                size_t capacity) {
  return guarded(message, capacity, [&] {
    *out = WaterwaveDeviceStats{};
    AllocatorStack* stack = CudaRuntime::get().stack_if_made(device);
    if (!stack) return;  // nothing allocated there yet: all zero, as torch reports
    const waterwave::AllocatorStats s = stack->stats();
    copy_array(s.allocation, out->allocation);
    copy_array(s.segment, out->segment);
    copy_array(s.active, out->active);
    copy_array(s.inactive_split, out->inactive_split);
    copy_array(s.allocated_bytes, out->allocated_bytes);
    copy_array(s.reserved_bytes, out->reserved_bytes);
    copy_array(s.active_bytes, out->active_bytes);
    copy_array(s.inactive_split_bytes, out->inactive_split_bytes);
    copy_array(s.requested_bytes, out->requested_bytes);
    copy_stat(s.oversize_allocations, out->oversize_allocations);
    copy_stat(s.oversize_segments, out->oversize_segments);
    out->num_alloc_retries = s.num_alloc_retries;
    out->num_ooms = s.num_ooms;
    out->num_sync_all_streams = s.num_sync_all_streams;
    out->num_device_alloc = s.num_device_alloc;
    out->num_device_free = s.num_device_free;
    out->max_split_size = s.max_split_size;
    out->largest_free_block = s.largest_free_block;
  });
}

int waterwave_cuda_reset_stats(int device, int which, char* message, size_t capacity) {
  return guarded(message, capacity, [&] {
    AllocatorStack* stack = CudaRuntime::get().stack_if_made(device);
    if (!stack) return;
    if (which == 0) {
      stack->reset_peak_stats();
    } else {
      stack->reset_accumulated_stats();
    }
  });
}

int waterwave_cuda_memory_fraction(int device, double fraction, double* out, char* message,
                                   size_t capacity) {
  return guarded(message, capacity, [&] {
    AllocatorStack& stack = CudaRuntime::get().stack(device);
    if (fraction > 0) stack.set_memory_fraction(fraction);
    *out = stack.memory_fraction();
  });
}

int waterwave_cuda_mem_info(int device, size_t* free_bytes, size_t* total_bytes, char* message,
                            size_t capacity) {
  return guarded(message, capacity, [&] {
    AllocatorStack& stack = CudaRuntime::get().stack(device);
    *free_bytes = stack.device().free_memory();
    *total_bytes = stack.device().total_memory();
  });
}

void waterwave_cuda_free_owned(void* ptr) {
  if (!ptr) return;
  try {
    CudaRuntime::get().deallocate_owned(reinterpret_cast<Addr>(ptr));
  } catch (const std::exception& e) {
    CudaRuntime::get().note_free_error(e.what());
  } catch (...) {
    CudaRuntime::get().note_free_error("free of an unknown pointer failed");
  }
}

int waterwave_cuda_allocation_size(void* ptr, size_t* out, char* message, size_t capacity) {
  return guarded(message, capacity, [&] {
    const Addr p = reinterpret_cast<Addr>(ptr);
    *out = CudaRuntime::get().owner(p, "getBaseAllocation").allocation_size(p);
  });
}

int waterwave_cuda_visit_segments(void* context, WaterwaveSegmentVisitor visit, char* message,
                                  size_t capacity) {
  return guarded(message, capacity, [&] {
    CudaRuntime& rt = CudaRuntime::get();
    std::vector<WaterwaveBlockView> blocks;
    for (int device : rt.devices()) {
      for (const waterwave::SegmentInfo& seg : rt.stack(device).snapshot()) {
        blocks.clear();
        std::size_t size = 0;
        for (const waterwave::BlockInfo& b : seg.blocks) {
          const bool allocated = b.state == "allocated";
          blocks.push_back({b.addr, b.size, b.requested, allocated,
                            allocated || b.state == "pending_free"});
          size += b.size;
        }
        const WaterwaveSegmentView view{device, seg.addr, size, stream_handle(seg.stream),
                                        seg.pool == waterwave::kLargePool, seg.expandable,
                                        blocks.size(), blocks.data()};
        visit(context, &view);
      }
    }
  });
}

int waterwave_cuda_record_history(int enabled, size_t max_entries, char* message, size_t capacity) {
  return guarded(message, capacity,
                 [&] { CudaRuntime::get().record_history(enabled != 0, max_entries); });
}

int waterwave_cuda_history_enabled() { return CudaRuntime::get().history_enabled() ? 1 : 0; }

int waterwave_cuda_visit_history(void* context, WaterwaveTraceVisitor visit, char* message,
                                 size_t capacity) {
  return guarded(message, capacity, [&] {
    CudaRuntime& rt = CudaRuntime::get();
    for (int device : rt.devices()) {
      for (const waterwave::HistoryEntry& e : rt.stack(device).online().history()) {
        const WaterwaveTraceView view{e.action, device, e.addr, e.size, stream_handle(e.stream),
                                      e.time_us};
        visit(context, &view);
      }
    }
  });
}
