#include "cuda_hooks.h"

#include <cstdio>

namespace waterwave::cuda {

CudaRuntime& CudaRuntime::get() {
  // Never destroyed: PyTorch frees tensors during interpreter exit, after
  // static destructors would have run.
  static auto* runtime = new CudaRuntime();
  return *runtime;
}

CudaRuntime::PerDevice* CudaRuntime::find(int device) const {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return devices_[device].load(std::memory_order_acquire);
}

CudaRuntime::PerDevice& CudaRuntime::slot(int device) {
  if (PerDevice* d = find(device)) return *d;
  if (device < 0 || device >= kMaxDevices) {
    throw ConfigError("CUDA device index " + std::to_string(device) + " is out of range");
  }
  std::lock_guard<std::mutex> g(mu_);
  if (PerDevice* d = find(device)) return *d;
  auto d = std::make_unique<PerDevice>();
  d->device = std::make_unique<CudaDevice>(DriverApi::load(driver_), device);
  d->online = make_allocator(policy_, *d->device, AllocatorConfig::parse(config_));
  d->active = d->online.get();
  devices_[device].store(d.get(), std::memory_order_release);
  return *d.release();  // owned by devices_ until reset()
}

void CudaRuntime::configure(const std::string& policy, const std::string& config,
                            const std::string& driver) {
  if (policy != "waterwave" && policy != "pytorch") {
    throw ConfigError("unknown allocator policy '" + policy + "': choose waterwave or pytorch");
  }
  AllocatorConfig::parse(config);  // refuse a bad string before changing anything
  std::lock_guard<std::mutex> g(mu_);
  for (auto& d : devices_) {
    if (d.load()) {
      throw ConfigError("the CUDA allocator is already in use; configure it before the first "
                        "allocation (or reset() it when nothing is allocated)");
    }
  }
  policy_ = policy;
  config_ = config;
  driver_ = driver;
}

void CudaRuntime::reset() {
  std::lock_guard<std::mutex> g(mu_);
  for (int i = 0; i < kMaxDevices; ++i) {
    PerDevice* d = devices_[i].load();
    if (!d) continue;
    if (d->plan && d->plan->live_planned_blocks() > 0) {
      throw ConfigError("cannot reset the CUDA allocator: device " + std::to_string(i) +
                        " still has planned blocks in use");
    }
    const auto live = d->online->stats().allocated_bytes.all().current;
    if (live > 0) {
      throw ConfigError("cannot reset the CUDA allocator: device " + std::to_string(i) + " has " +
                        format_bytes(static_cast<std::size_t>(live)) +
                        " allocated; free every tensor first");
    }
  }
  // Destroying a device's state gives its arena and segments back.
  for (auto& slot : devices_) delete slot.exchange(nullptr);
}

Addr CudaRuntime::allocate(std::size_t bytes, int device, StreamId stream) {
  PerDevice& d = slot(device);
  std::shared_lock<std::shared_mutex> g(d.swap);
  return d.active->allocate(bytes, stream);
}

void CudaRuntime::deallocate(Addr ptr, int device) {
  PerDevice* d = find(device);
  if (!d) {
    throw PointerError("free of " + format_addr(ptr) + " on CUDA device " + std::to_string(device) +
                       ", which has no Waterwave allocator: the pointer was not allocated here");
  }
  std::shared_lock<std::shared_mutex> g(d->swap);
  d->active->deallocate(ptr);
}

void CudaRuntime::record_stream(Addr ptr, StreamId stream) {
  // The hook names no device: the pointer belongs to the one allocator that
  // knows it.
  for (int i = 0; i < kMaxDevices; ++i) {
    PerDevice* d = find(i);
    if (!d) continue;
    std::shared_lock<std::shared_mutex> g(d->swap);
    try {
      d->active->allocation_size(ptr);
    } catch (const PointerError&) {
      continue;
    }
    d->active->record_stream(ptr, stream);
    return;
  }
  throw PointerError("record_stream of " + format_addr(ptr) +
                     ": no Waterwave allocator holds this pointer");
}

void CudaRuntime::empty_cache() {
  for (int i = 0; i < kMaxDevices; ++i) {
    if (PerDevice* d = find(i)) {
      std::shared_lock<std::shared_mutex> g(d->swap);
      d->active->empty_cache();
    }
  }
}

void CudaRuntime::drop_plan(PerDevice& d, int device, const char* why) {
  if (!d.plan) return;
  if (d.plan->live_planned_blocks() > 0) {
    throw ConfigError(std::string("cannot ") + why + " on CUDA device " + std::to_string(device) +
                      ": " + std::to_string(d.plan->live_planned_blocks()) +
                      " planned blocks are still in use (drop the last step's tensors first)");
  }
  d.active = d.online.get();
  d.plan.reset();  // the arena goes back to the driver
}

void CudaRuntime::set_plan(int device, std::vector<PlanSlot> slots, std::size_t arena,
                           StreamId stream) {
  PerDevice& d = slot(device);
  std::unique_lock<std::shared_mutex> g(d.swap);
  drop_plan(d, device, "replace the plan");
  d.recorder.reset();
  // The cache the unplanned steps built goes back first: the arena takes
  // its place rather than adding to it.
  d.online->empty_cache();
  d.plan = std::make_unique<PlanAllocator>(*d.device, std::move(slots), arena, stream, d.online);
  d.active = d.plan.get();
}

void CudaRuntime::clear_plan(int device) {
  PerDevice* d = find(device);
  if (!d) return;
  std::unique_lock<std::shared_mutex> g(d->swap);
  drop_plan(*d, device, "remove the plan");
}

void CudaRuntime::start_recording(int device, StreamId stream) {
  PerDevice& d = slot(device);
  std::unique_lock<std::shared_mutex> g(d.swap);
  drop_plan(d, device, "record over the plan");
  d.recorder = std::make_unique<TraceRecorder>(d.online, stream);
  d.active = d.recorder.get();
}

std::vector<TracedBlock> CudaRuntime::stop_recording(int device) {
  PerDevice& d = slot(device);
  std::unique_lock<std::shared_mutex> g(d.swap);
  if (!d.recorder) {
    throw ConfigError("CUDA device " + std::to_string(device) + " is not recording");
  }
  std::vector<TracedBlock> out = d.recorder->trace();
  d.active = d.online.get();
  d.recorder.reset();
  return out;
}

bool CudaRuntime::has_plan(int device) {
  PerDevice* d = find(device);
  if (!d) return false;
  std::shared_lock<std::shared_mutex> g(d->swap);
  return d->plan != nullptr;
}

void CudaRuntime::no_plan(int device) {
  throw ConfigError("CUDA device " + std::to_string(device) + " has no plan installed");
}

std::vector<int> CudaRuntime::devices() {
  std::vector<int> out;
  for (int i = 0; i < kMaxDevices; ++i)
    if (find(i)) out.push_back(i);
  return out;
}

std::string CudaRuntime::policy() {
  std::lock_guard<std::mutex> g(mu_);
  return policy_;
}

std::string CudaRuntime::config() {
  std::lock_guard<std::mutex> g(mu_);
  return AllocatorConfig::parse(config_).to_string();
}

std::string CudaRuntime::driver_path() {
  std::lock_guard<std::mutex> g(mu_);
  return driver_;
}

std::pair<long long, std::string> CudaRuntime::free_errors() {
  std::lock_guard<std::mutex> g(mu_);
  return {free_errors_.load(), last_free_error_};
}

void CudaRuntime::note_free_error(const std::string& what) {
  const long long n = ++free_errors_;
  {
    std::lock_guard<std::mutex> g(mu_);
    last_free_error_ = what;
  }
  // The first few go to stderr: a free cannot raise into PyTorch.
  if (n <= 10) std::fprintf(stderr, "waterwave: %s\n", what.c_str());
}

}  // namespace waterwave::cuda

using waterwave::Addr;
using waterwave::cuda::CudaRuntime;
using waterwave::cuda::stream_id;

void* waterwave_cuda_malloc(std::size_t size, int device, void* stream) {
  return reinterpret_cast<void*>(CudaRuntime::get().allocate(size, device, stream_id(stream)));
}

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
