// Private memory pools on one CUDA device: PyTorch's CUDA graph pools and
// torch.cuda.MemPool, behind the native registration's beginAllocateToPool,
// endAllocateToPool, releasePool and createOrIncrefPool.
//
// Each pool is an allocator stack of its own over the device (PyTorch's
// policy: a graph replays its kernels in the order they were captured, so a
// block freed during capture may serve the same stream's next request at
// once, and never another's). A pool keeps its cached segments when the
// device is out of memory and gives them back only once retired (no use
// left: PyTorch's releasePool brought its count to zero): a captured graph
// writes into its pool's free blocks on every replay.
//
// A window is one beginAllocateToPool..endAllocateToPool; a capture happens
// inside one. While any window is open on the device, nothing that could
// touch a capturing stream's events runs: a free that would record events
// (a block used on other streams, record_stream) or sync a capturing
// stream is deferred (defer_free) until the last window closes, and no
// segment goes back to the device. Deferring a free only holds memory a
// little longer; it never hands memory out twice.
//
// Locking: mu_ (shared) for the allocation and free paths, exclusive to add,
// retire or drop a pool. A pool is dropped only with no live block and no
// window open, so no free of its can be in flight.
//
// May include: core/, alloc/.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <tuple>
#include <vector>

#include "../alloc/stack.h"

namespace waterwave::cuda {

// PyTorch's MempoolId_t: (graph's capture id, 0) or (0, user pool's id).
struct PoolId {
  std::uint64_t first = 0;
  std::uint64_t second = 0;
  bool operator<(const PoolId& o) const {
    return std::tie(first, second) < std::tie(o.first, o.second);
  }
  bool operator==(const PoolId& o) const { return first == o.first && second == o.second; }
};

class PrivatePools {
 public:
  // `config`: the device's; a pool takes its sizes, without expandable
  // segments, memory fraction or garbage collection.
  PrivatePools(Device& device, const AllocatorConfig& config);

  // Whether any pool, window or deferred free exists; when none does, the
  // free path never looks here (one acquire load).
  bool active() const { return active_.load(std::memory_order_acquire) != 0; }
  bool windows_open() const { return windows_.load(std::memory_order_acquire) != 0; }

  // PyTorch's createOrIncrefPool: a new pool has one use; a known one gains one.
  void create_or_incref(PoolId id);
  // beginAllocateToPool: one more use (created if new) and one more window.
  // True when this opens the device's first window.
  bool begin_window(PoolId id);
  // endAllocateToPool. ConfigError if no window is open for `id`. When it
  // closes the last one, the deferred frees come back for the caller to run
  // (now outside any capture), and retired pools give their cache back.
  std::vector<Addr> end_window(PoolId id);
  // releasePool: one use fewer. At none the pool is retired; it is dropped
  // once its last block is freed.
  void release(PoolId id);
  int use_count(PoolId id);  // 0: no such pool

  // A pool's allocation; ConfigError if there is no pool `id`.
  Addr allocate(PoolId id, std::size_t bytes, StreamId stream);
  // Frees ptr if a pool holds it (deferred while a window is open, if it
  // would record events); false if none does.
  bool deallocate(Addr ptr);
  // Hold the free of ptr until the last window closes.
  void defer_free(Addr ptr);
  AllocatorStack* owner(Addr ptr);  // the pool stack holding ptr, or nullptr

  // empty_cache: retired pools give back their free segments, and those
  // with no live block are dropped; nothing while a window is open.
  void empty_retired();
  // Restore pool `id` to a checkpoint (PyTorch's setCheckpointPoolState):
  // every block allocated in it now is freed (its address joins `freed`),
  // then each of `live` ((address, size, requested) of the checkpoint's
  // allocated blocks) is handed out again where it was. Refused (ConfigError)
  // for a pool that is not in use or while a window is open.
  struct LiveBlock {
    Addr addr;
    std::size_t size;
    std::size_t requested;
  };
  void restore(PoolId id, const std::vector<LiveBlock>& live, std::vector<Addr>& freed);
  // Visit each pool (shared lock held: fn must not call back here).
  void for_each(const std::function<void(PoolId, AllocatorStack&)>& fn);
  // Visit one pool; false if there is none.
  bool visit(PoolId id, const std::function<void(AllocatorStack&)>& fn);
  std::size_t live_bytes();
  std::size_t deferred_count();
  // Memory history in every pool, those made later included.
  void record_history(bool enabled, std::size_t max_entries);

 private:
  struct Pool {
    std::unique_ptr<AllocatorStack> stack;
    int uses = 1;
    int windows = 0;
  };
  using Map = std::map<PoolId, Pool>;

  Pool& create_or_incref_locked(PoolId id);
  // Drop retired pools with no live block; the others give back free
  // segments. Exclusive lock held, no window open.
  void sweep_locked();
  void publish_locked();

  Device& device_;
  AllocatorConfig config_;
  std::shared_mutex mu_;
  Map pools_;
  std::atomic<int> windows_{0};  // changed under mu_ (exclusive)
  std::mutex deferred_mu_;       // after mu_ when both are held
  std::vector<Addr> deferred_;   // under deferred_mu_
  std::atomic<int> active_{0};   // pools, windows and deferred frees, any
  bool history_on_ = false;      // under mu_
  std::size_t history_max_ = 0;
};

}  // namespace waterwave::cuda
