#include "cuda_runtime.h"

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

AllocatorStack& CudaRuntime::stack(int device) {
  if (PerDevice* d = find(device)) return *d->stack;
  if (device < 0 || device >= kMaxDevices) {
    throw ConfigError("CUDA device index " + std::to_string(device) + " is out of range");
  }
  std::lock_guard<std::mutex> g(mu_);
  if (PerDevice* d = find(device)) return *d->stack;
  auto d = std::make_unique<PerDevice>();
  d->device = std::make_unique<CudaDevice>(DriverApi::load(driver_), device);
  d->stack = std::make_unique<AllocatorStack>(*d->device, policy_, AllocatorConfig::parse(config_));
  devices_[device].store(d.get(), std::memory_order_release);
  return *d.release()->stack;  // owned by devices_ until reset()
}

void CudaRuntime::configure(const std::string& policy, const std::string& config,
                            const std::string& driver) {
  const PolicyKind kind = parse_policy(policy);
  AllocatorConfig::parse(config);  // refuse a bad string before changing anything
  std::lock_guard<std::mutex> g(mu_);
  for (auto& d : devices_) {
    if (d.load()) {
      throw ConfigError("the CUDA allocator is already in use; configure it before the first "
                        "allocation (or reset() it when nothing is allocated)");
    }
  }
  policy_ = kind;
  config_ = config;
  driver_ = driver;
}

void CudaRuntime::reset() {
  std::lock_guard<std::mutex> g(mu_);
  for (int i = 0; i < kMaxDevices; ++i) {
    PerDevice* d = devices_[i].load();
    if (!d) continue;
    if (const std::size_t live = d->stack->live_bytes()) {
      throw ConfigError("cannot reset the CUDA allocator: device " + std::to_string(i) + " has " +
                        format_bytes(live) + " allocated; free every tensor first");
    }
  }
  for (auto& slot : devices_) delete slot.exchange(nullptr);
}

void CudaRuntime::deallocate(Addr ptr, int device) {
  PerDevice* d = find(device);
  if (!d) {
    throw PointerError("free of " + format_addr(ptr) + " on CUDA device " + std::to_string(device) +
                       ", which has no Waterwave allocator: the pointer was not allocated here");
  }
  d->stack->deallocate(ptr);
}

void CudaRuntime::record_stream(Addr ptr, StreamId stream) {
  for (int i : devices()) {
    AllocatorStack& s = *find(i)->stack;
    if (s.owns(ptr)) return s.record_stream(ptr, stream);
  }
  throw PointerError("record_stream of " + format_addr(ptr) +
                     ": no Waterwave allocator holds this pointer");
}

void CudaRuntime::empty_cache() {
  for (int i : devices()) find(i)->stack->empty_cache();
}

std::vector<int> CudaRuntime::devices() {
  std::vector<int> out;
  for (int i = 0; i < kMaxDevices; ++i)
    if (find(i)) out.push_back(i);
  return out;
}

std::string CudaRuntime::policy() {
  std::lock_guard<std::mutex> g(mu_);
  return policy_info(policy_).name;
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
