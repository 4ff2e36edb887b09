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
  return *create(device).stack;
}

std::shared_ptr<AllocatorStack> CudaRuntime::shared_stack(int device) {
  stack(device);  // created if missing
  std::lock_guard<std::mutex> g(mu_);
  const std::shared_ptr<PerDevice>& owner = owners_[device];
  return std::shared_ptr<AllocatorStack>(owner, owner->stack.get());
}

CudaRuntime::PerDevice& CudaRuntime::create(int device) {
  if (device < 0 || device >= kMaxDevices) {
    throw ConfigError("CUDA device index " + std::to_string(device) + " is out of range");
  }
  std::lock_guard<std::mutex> g(mu_);
  if (PerDevice* d = find(device)) return *d;
  auto d = std::make_shared<PerDevice>();
  d->device = std::make_unique<CudaDevice>(DriverApi::load(driver_), device);
  d->stack = std::make_unique<AllocatorStack>(*d->device, policy_, config_);
  d->pools = std::make_unique<PrivatePools>(*d->device, config_);
  if (history_on_) {
    d->stack->online().record_history(true, history_max_);
    d->pools->record_history(true, history_max_);
  }
  owners_[device] = d;
  devices_[device].store(d.get(), std::memory_order_release);
  const std::vector<int> made = devices();
  sole_device_.store(made.size() == 1 ? made[0] : -1, std::memory_order_release);
  return *d;
}

void CudaRuntime::configure(PolicyKind policy, const AllocatorConfig& config,
                            const std::string& driver) {
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
    if (const std::size_t live = d->stack->live_bytes() + d->pools->live_bytes()) {
      throw ConfigError("cannot reset the CUDA allocator: device " + std::to_string(i) + " has " +
                        format_bytes(live) + " allocated; free every tensor first");
    }
  }
  sole_device_.store(-1, std::memory_order_release);
  for (int i = 0; i < kMaxDevices; ++i) {
    devices_[i].store(nullptr);
    owners_[i].reset();  // a Python handle may keep its stack a while longer
  }
}

namespace {
const char* const kFixedSegmentsHint =
    ". Where what the process reserves is capped (per_process_memory_fraction), turn on "
    "expandable segments (waterwave.install_allocator(expandable_segments=True)), whose "
    "freed pages other trials can take";
}  // namespace

Addr CudaRuntime::allocate_or_wait(AllocatorStack& s, std::size_t bytes, StreamId stream) {
  // However the allocation ends after a wait (served, or another error on a
  // retry), the thread waits no more: the members' tie-break must not count
  // a running thread as stuck.
  struct Waited {
    ThreadAccounts& accounts;
    bool yes = false;
    ~Waited() {
      if (yes) accounts.done_waiting();
    }
  } waited{accounts_};
  for (;;) {
    try {
      return s.allocate(bytes, stream);
    } catch (const OutOfMemoryError& e) {
      if (accounts_.wait_for_frees(bytes)) {
        waited.yes = true;
        continue;
      }
      std::string why = ThreadAccounts::why();
      if (why.empty()) {  // no member's thread: the device's error
        why = accounts_.backward_refusal(stream, bytes);
        if (why.empty()) throw;
      }
      // Trials sharing fixed segments leave the memory one frees cut into
      // pieces the next cannot use: a cap the members fit in counted bytes
      // was still too small so for resnet18 trials on an H200, which
      // trained under it with expandable segments (docs/design/sharing.md).
      if (!ThreadAccounts::why_is_interrupt() && !s.online().config().expandable_segments) {
        why += kFixedSegmentsHint;
      }
      throw OutOfMemoryError(std::string(e.what()) + "; " + why);
    }
  }
}

void CudaRuntime::deallocate(Addr ptr, int device) {
  PerDevice* d = find(device);
  if (!d) {
    throw PointerError("free of " + format_addr(ptr) + " on CUDA device " + std::to_string(device) +
                       ", which has no Waterwave allocator: the pointer was not allocated here");
  }
  if (d->pools->active()) return deallocate_slow(ptr, d);
  d->stack->deallocate(ptr);
  accounts_.freed(ptr);
}

bool CudaRuntime::PerDevice::free_if_held(Addr ptr) {
  if (stack->owns(ptr)) {
    if (pools->windows_open()) {
      // A free on a capturing stream, or one that records events on other
      // streams, would touch a capture's events: after the capture.
      const auto use = stack->online().live_streams(ptr);
      if (use && (use->shared || device->stream_capturing(use->stream))) {
        pools->defer_free(ptr);
        return true;
      }
    }
    stack->deallocate(ptr);
    return true;
  }
  return pools->deallocate(ptr);
}

void CudaRuntime::deallocate_slow(Addr ptr, PerDevice* first) {
  if (first && first->free_if_held(ptr)) {
    accounts_.freed(ptr);
    return;
  }
  for (int i : devices()) {
    PerDevice* d = find(i);
    if (d && d != first && d->free_if_held(ptr)) {
      accounts_.freed(ptr);
      return;
    }
  }
  // The stack's own error says what the pointer is (a double free, an
  // address inside a block, one never allocated).
  if (first) first->stack->deallocate(ptr);
  throw PointerError("free of " + format_addr(ptr) + ": no Waterwave allocator holds this pointer");
}

AllocatorStack& CudaRuntime::owner(Addr ptr, const char* what) {
  for (int i : devices()) {
    PerDevice* d = find(i);
    if (d->stack->owns(ptr)) return *d->stack;
    if (d->pools->active()) {
      if (AllocatorStack* pool = d->pools->owner(ptr)) return *pool;
    }
  }
  throw PointerError(std::string(what) + " of " + format_addr(ptr) +
                     ": no Waterwave allocator holds this pointer");
}

void CudaRuntime::begin_pool_window(int device, PoolId pool) {
  PerDevice& d = stack_owner(device);
  if (d.pools->begin_window(pool)) d.stack->sync_and_coalesce();
}

void CudaRuntime::restore_pool(int device, PoolId pool,
                               const std::vector<PrivatePools::LiveBlock>& live,
                               std::vector<Addr>& freed) {
  PrivatePools& p = pools(device);
  p.restore(pool, live, freed);
  for (Addr ptr : freed) accounts_.freed(ptr);
  for (const auto& b : live) accounts_.allocated(b.addr, [&] { return b.size; });
}

void CudaRuntime::end_pool_window(int device, PoolId pool) {
  PerDevice& d = stack_owner(device);
  for (Addr ptr : d.pools->end_window(pool)) {
    try {
      deallocate_slow(ptr, &d);
    } catch (const std::exception& e) {
      note_free_error(e.what());
    }
  }
}

void CudaRuntime::record_stream(Addr ptr, StreamId stream) {
  owner(ptr, "record_stream").record_stream(ptr, stream);
}

void CudaRuntime::deallocate_owned(Addr ptr) {
  const int sole = sole_device_.load(std::memory_order_acquire);
  PerDevice* d = sole >= 0 ? find(sole) : nullptr;
  if (!d || d->pools->active()) return deallocate_slow(ptr, d);
  d->stack->deallocate(ptr);
  accounts_.freed(ptr);
}

void CudaRuntime::record_history(bool enabled, std::size_t max_entries) {
  std::lock_guard<std::mutex> g(mu_);
  history_on_ = enabled && max_entries > 0;
  history_max_ = max_entries;
  for (int i = 0; i < kMaxDevices; ++i) {
    if (PerDevice* d = find(i)) {
      d->stack->online().record_history(enabled, max_entries);
      d->pools->record_history(enabled, max_entries);
    }
  }
}

bool CudaRuntime::history_enabled() {
  std::lock_guard<std::mutex> g(mu_);
  return history_on_;
}

void CudaRuntime::empty_cache() {
  for (int i : devices()) {
    PerDevice* d = find(i);
    d->stack->empty_cache();
    d->pools->empty_retired();
  }
}

std::vector<int> CudaRuntime::devices() {
  std::vector<int> out;
  for (int i = 0; i < kMaxDevices; ++i)
    if (find(i)) out.push_back(i);
  return out;
}

PolicyKind CudaRuntime::policy() {
  std::lock_guard<std::mutex> g(mu_);
  return policy_;
}

AllocatorConfig CudaRuntime::config() {
  std::lock_guard<std::mutex> g(mu_);
  return config_;
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
