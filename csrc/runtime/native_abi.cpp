#include "native_abi.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "../core/errors.h"
#include "cuda_runtime.h"

using waterwave::Addr;
using waterwave::AllocatorStack;
using waterwave::cuda::CudaRuntime;
using waterwave::cuda::PoolId;
using waterwave::cuda::stream_handle;
using waterwave::cuda::stream_id;

namespace {

int failed(const char* what, char* message, std::size_t capacity) {
  return waterwave::cuda::abi_failure(kWaterwaveMallocFailed, what, message, capacity);
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
    waterwave::AllocatorStats s = stack->stats();
    CudaRuntime::get().pools(device).for_each(
        [&](PoolId, AllocatorStack& pool) { s.add(pool.stats()); });
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
    auto visit_stack = [&](int device, AllocatorStack& stack, PoolId pool) {
      for (const waterwave::SegmentInfo& seg : stack.snapshot()) {
        blocks.clear();
        std::size_t size = 0;
        for (const waterwave::BlockInfo& b : seg.blocks) {
          const bool allocated = b.state == "allocated";
          blocks.push_back({b.addr, b.size, b.requested, allocated,
                            allocated || b.state == "pending_free"});
          size += b.size;
        }
        const WaterwaveSegmentView view{device,
                                        seg.addr,
                                        size,
                                        stream_handle(seg.stream),
                                        seg.pool == waterwave::kLargePool,
                                        seg.expandable,
                                        pool.first,
                                        pool.second,
                                        blocks.size(),
                                        blocks.data()};
        visit(context, &view);
      }
    };
    for (int device : rt.devices()) {
      visit_stack(device, rt.stack(device), PoolId{});
      rt.pools(device).for_each(
          [&](PoolId pool, AllocatorStack& stack) { visit_stack(device, stack, pool); });
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
      // The device's own stack and its private pools, merged in time order.
      std::vector<waterwave::HistoryEntry> entries = rt.stack(device).online().history();
      rt.pools(device).for_each([&](PoolId, AllocatorStack& pool) {
        const std::vector<waterwave::HistoryEntry> more = pool.online().history();
        entries.insert(entries.end(), more.begin(), more.end());
      });
      std::stable_sort(entries.begin(), entries.end(),
                       [](const waterwave::HistoryEntry& a, const waterwave::HistoryEntry& b) {
                         return a.time_us < b.time_us;
                       });
      for (const waterwave::HistoryEntry& e : entries) {
        const WaterwaveTraceView view{e.action, device, e.addr, e.size, stream_handle(e.stream),
                                      e.time_us};
        visit(context, &view);
      }
    }
  });
}

// ---- Private pools. ----

int waterwave_cuda_pool_create(int device, uint64_t first, uint64_t second, char* message,
                               size_t capacity) {
  return guarded(message, capacity,
                 [&] { CudaRuntime::get().pools(device).create_or_incref({first, second}); });
}

int waterwave_cuda_pool_begin(int device, uint64_t first, uint64_t second, char* message,
                              size_t capacity) {
  return guarded(message, capacity,
                 [&] { CudaRuntime::get().begin_pool_window(device, {first, second}); });
}

int waterwave_cuda_pool_end(int device, uint64_t first, uint64_t second, char* message,
                            size_t capacity) {
  return guarded(message, capacity,
                 [&] { CudaRuntime::get().end_pool_window(device, {first, second}); });
}

int waterwave_cuda_pool_release(int device, uint64_t first, uint64_t second, char* message,
                                size_t capacity) {
  return guarded(message, capacity,
                 [&] { CudaRuntime::get().pools(device).release({first, second}); });
}

int waterwave_cuda_pool_use_count(int device, uint64_t first, uint64_t second) {
  try {
    return CudaRuntime::get().pools(device).use_count({first, second});
  } catch (...) {
    return 0;
  }
}

int waterwave_cuda_pool_malloc(int device, uint64_t first, uint64_t second, size_t size,
                               void* stream, void** out, char* message, size_t capacity) {
  return waterwave::cuda::try_allocation(out, message, capacity, [&] {
    try {
      return CudaRuntime::get().allocate_in_pool({first, second}, size, device, stream_id(stream));
    } catch (const waterwave::OutOfMemoryError& e) {
      throw waterwave::OutOfMemoryError(
          std::string(e.what()) + " (in a private memory pool: a CUDA graph's or "
          "torch.cuda.MemPool's, which keeps its cache; free memory before the capture, e.g. "
          "torch.cuda.empty_cache())");
    }
  });
}

int waterwave_cuda_pools_empty(char* message, size_t capacity) {
  return guarded(message, capacity, [&] {
    CudaRuntime& rt = CudaRuntime::get();
    for (int device : rt.devices()) rt.pools(device).empty_retired();
  });
}

int waterwave_cuda_pool_restore(int device, uint64_t first, uint64_t second,
                                const WaterwaveLiveBlock* live, size_t count, void* context,
                                WaterwaveAddrVisitor freed, char* message, size_t capacity) {
  return guarded(message, capacity, [&] {
    std::vector<waterwave::cuda::PrivatePools::LiveBlock> blocks;
    for (size_t i = 0; i < count; ++i) blocks.push_back({live[i].addr, live[i].size, live[i].requested});
    std::vector<Addr> gone;
    CudaRuntime::get().restore_pool(device, {first, second}, blocks, gone);
    for (Addr p : gone) freed(context, p);
  });
}
