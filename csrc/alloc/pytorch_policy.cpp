// A re-implementation of PyTorch 2.14's native CUDACachingAllocator policy
// (docs/design/pytorch-policy.md), the baseline every comparison uses.
//
// Free blocks are reusable only by the stream that allocated their segment:
// best fit on (stream, size, address) in a small (<= 1 MiB) or large pool.
// record_stream makes a free wait for events recorded on the other streams
// at free time; they are polled only at the start of the next malloc. When
// no cached block fits: garbage collection (fraction + threshold), a new
// segment, releasing oversize cached blocks (max_split_size), and finally
// synchronizing all events, freeing every unsplit cached segment and retrying.
//
// May include: core/ and this folder.
#include <algorithm>
#include <deque>
#include <memory>
#include <unordered_map>
#include <unordered_set>

#include "allocator.h"

namespace waterwave {
namespace {


class PytorchPolicy final : public Allocator {
 public:
  PytorchPolicy(Device& device, const AllocatorConfig& config)
      : Allocator(PolicyKind::kPytorch, device, config) {}

  ~PytorchPolicy() override {
    for (auto& [id, s] : streams_) {
      for (auto& [e, b] : s->events) release_event(e);
    }
  }

 private:
  // PyTorch's malloc, as its || chain: a cached block of the stream's pool;
  // else garbage collection, a new segment, releasing oversize cached blocks
  // then a new segment, and last releasing every cached block (after
  // synchronizing their events) then a new segment.
  Block* find_block_locked(Lock& lock, const Request& r, Served& how) override {
    process_events();
    if (Block* b = get_free_block(r.stream, r.pool, r.size)) {
      how = Served::kSynced;
      return b;
    }
    if (allowed_max_ != SIZE_MAX && cfg_.garbage_collection_threshold > 0) {
      garbage_collect_locked(lock);
    }
    how = Served::kNewSegment;
    Block* b = new_memory_locked(lock, r, r.stream);
    if (cfg_.keep_segments_on_oom) return b;
    if (!b && release_available_cached_blocks_locked(lock, r.stream, r.pool, r.size)) {
      b = new_memory_locked(lock, r, r.stream);
    }
    if (!b) {
      release_cached_blocks_locked(lock);
      stats_.num_alloc_retries++;
      how = Served::kAfterSync;
      b = new_memory_locked(lock, r, r.stream);
    }
    return b;
  }

  // Expandable segments are the stream's own (one per stream and pool):
  // any of its cached blocks may grow into new pages.
  bool joins_growth(const Block* b, const Request&) const override { return b->set != nullptr; }

  void file_remainder(Block* remainder, FreeSet*, const Request& r) override {
    insert_pool(pools(r.stream)->sets[r.pool], remainder);
  }

  // A block used on other streams waits for their events; the others are
  // cached at once.
  void on_free(Block* b) override {
    if (!b->stream_uses.empty()) {
      insert_events(b);
    } else {
      free_block(b);
    }
  }

  // PyTorch has no SyncAndCoalesce; the closest operation retires every
  // pending cross-stream free after synchronizing its events.
  void sync_and_coalesce_locked(Lock& lock) override {
    stats_.num_sync_and_coalesce++;  // counts calls of this API under both policies
    synchronize_and_free_events_locked(lock);
  }

  void empty_cache_locked(Lock& lock) override { release_cached_blocks_locked(lock); }

  void describe_free(AllocatorStats& out) const override {
    std::size_t cached = 0;
    for_each_free_set([&](const FreeSet& s) { cached += s.bytes(); });
    out.synced_free_bytes = static_cast<std::int64_t>(cached);
    out.pending_free_bytes = static_cast<std::int64_t>(pending_bytes_);
  }

  void check_policy_invariants() override {
    std::unordered_map<const Block*, int> queued;
    std::size_t pending = 0;
    for (auto& [id, s] : streams_) {
      for (auto& [e, b] : s->events) queued[b]++;
      for (int p = 0; p < 2; ++p) {
        for (Block* b : s->sets[p]) {
          if (b->stream != id) fail_invariant("cached block filed under another stream");
          if (b->segment->pool != p) fail_invariant("cached block in the wrong pool");
          if (b->next && b->next->set) {
            fail_invariant("adjacent cached free blocks at " + format_addr(b->addr) +
                           " were not merged");
          }
        }
      }
    }
    for (const auto& [addr, seg] : segments_) {
      for (Block* b = seg->head; b; b = b->next) {
        if (b->stream != seg->stream) fail_invariant("block stream differs from its segment's");
        if (!b->allocated && !b->set && b->mapped && !b->unmapping) {
          auto it = queued.find(b);
          if (it == queued.end() || it->second != b->event_count || b->event_count <= 0) {
            fail_invariant("pending block's event count disagrees with the event queues");
          }
          pending += b->size;
        }
      }
    }
    if (pending != pending_bytes_) fail_invariant("pending_bytes_ drifted");
    std::size_t queued_events = 0;
    for (auto& [id, s] : streams_) queued_events += s->events.size();
    if (queued_events != outstanding_events_) fail_invariant("outstanding_events_ drifted");
  }

  const char* free_state(const Block* b) const override {
    return b->set ? "free" : "pending_free";
  }
  bool is_pending(const Block* b) const override { return !b->allocated && b->event_count > 0; }
  void for_each_free_set(const std::function<void(const FreeSet&)>& fn) const override {
    for (const auto& [id, s] : streams_) {
      fn(s->sets[0]);
      fn(s->sets[1]);
    }
  }

  struct StreamPools {
    FreeSet sets[2];  // small, large
    std::deque<std::pair<EventId, Block*>> events;  // events recorded on this stream
  };

  StreamPools* pools(StreamId id) {
    if (last_id_valid_ && last_id_ == id) return last_pools_;
    auto it = streams_.find(id);
    if (it == streams_.end()) it = streams_.emplace(id, std::make_unique<StreamPools>()).first;
    last_id_ = id;
    last_id_valid_ = true;
    last_pools_ = it->second.get();
    return last_pools_;
  }

  void insert_pool(FreeSet& set, Block* b) {
    b->gc_count_base = gc_calls_[b->segment->pool];
    insert_free(set, b);
  }

  Block* get_free_block(StreamId stream, PoolKind pool, std::size_t size) {
    if (allowed_max_ != SIZE_MAX && cfg_.garbage_collection_threshold > 0) ++gc_calls_[pool];
    Block* b = pools(stream)->sets[pool].best_fit(size);
    if (!b || !rules_.may_take(b->size, size)) return nullptr;
    return b;
  }

  void free_block(Block* b) {
    account_free_complete(b);
    FreeSet& set = pools(b->stream)->sets[b->segment->pool];
    insert_pool(set, merge_neighbours_in(set, b));
  }

  void insert_events(Block* b) {
    for (StreamId u : b->stream_uses) {
      EventId e = take_event();
      device_.record_event(e, u);
      stats_.num_events_recorded++;
      b->event_count++;
      pools(u)->events.emplace_back(e, b);
      outstanding_events_++;
    }
    b->stream_uses.clear();
    pending_bytes_ += b->size;
  }

  void retire_event(Block* b) {
    if (--b->event_count == 0) {
      pending_bytes_ -= b->size;
      free_block(b);
    }
  }

  // Pop completed events per stream, stopping at each stream's first pending.
  // Runs at every malloc, so it returns at once when nothing is outstanding.
  void process_events() {
    if (outstanding_events_ == 0) return;
    for (auto& [id, s] : streams_) {
      while (!s->events.empty()) {
        auto [e, b] = s->events.front();
        stats_.num_event_queries++;
        if (!device_.query_event(e)) break;
        s->events.pop_front();
        outstanding_events_--;
        release_event(e);
        retire_event(b);
      }
    }
  }

  // Wait on every outstanding event (host-blocking, outside the lock), then
  // retire the blocks. The events are retained while we wait, so another
  // thread retiring one cannot recycle it under us.
  void synchronize_and_free_events_locked(Lock& lock) {
    std::vector<EventId> waiting;
    for (auto& [id, s] : streams_) {
      for (auto& [e, b] : s->events) {
        retain_event(e);
        waiting.push_back(e);
      }
    }
    stats_.num_sync_all_streams++;
    if (waiting.empty()) return;
    lock.unlock();
    for (EventId e : waiting) device_.synchronize_event(e);
    lock.lock();
    stats_.num_host_event_syncs += static_cast<std::int64_t>(waiting.size());
    std::unordered_set<EventId> done(waiting.begin(), waiting.end());
    for (auto& [id, s] : streams_) {
      while (!s->events.empty() && done.count(s->events.front().first)) {
        auto [e, b] = s->events.front();
        s->events.pop_front();
        outstanding_events_--;
        release_event(e);
        retire_event(b);
      }
    }
    for (EventId e : waiting) release_event(e);
  }

  void release_cached_blocks_locked(Lock& lock) {
    synchronize_and_free_events_locked(lock);
    std::vector<Block*> whole, paged;
    for (auto& [id, s] : streams_) {
      for (int p = 0; p < 2; ++p) {
        for (Block* b : s->sets[p]) {
          if (b->segment->expandable) {
            paged.push_back(b);
          } else if (!b->is_split()) {
            whole.push_back(b);
          }
        }
      }
    }
    release_segments_locked(lock, whole);
    // Blocks freed on their own stream carry no event: their kernels may
    // still run, so the device synchronizes first (PyTorch syncs the stream).
    unmap_free_pages_locked(lock, paged, /*idle=*/false);
  }

  // Only with max_split_size set: free one cached oversize block at least as
  // large as max(size, max_split_size), or several, largest first. Oversize
  // blocks are whole segments, except those split before max_split_size was
  // set at run time (set_max_split_size): those stay, skipped.
  bool release_available_cached_blocks_locked(Lock& lock, StreamId stream, PoolKind pool,
                                              std::size_t size) {
    if (!cfg_.max_split_size_set() || cfg_.expandable_segments) return false;
    const std::size_t key = std::max(size, cfg_.max_split_size);
    FreeSet& set = pools(stream)->sets[pool];
    auto it = set.lower_bound(key);
    for (auto up = it; up != set.end(); ++up) {
      if (!(*up)->is_split()) {
        release_segments_locked(lock, {*up});
        return true;
      }
    }
    if (it == set.begin()) return false;
    std::size_t total = 0;
    std::vector<Block*> chosen;
    --it;
    while (total < key && (*it)->size >= cfg_.max_split_size) {
      if (!(*it)->is_split()) {
        chosen.push_back(*it);
        total += (*it)->size;
      }
      if (it == set.begin()) break;
      --it;
    }
    release_segments_locked(lock, chosen);
    return total >= key;
  }

  // Free aged, unsplit blocks of the large pool until reserved memory is back
  // under garbage_collection_threshold * the allowed maximum.
  void garbage_collect_locked(Lock& lock) {
    const auto threshold =
        static_cast<std::size_t>(cfg_.garbage_collection_threshold * static_cast<double>(allowed_max_));
    if (reserved_total_ <= threshold || cfg_.expandable_segments) return;
    const std::size_t target = reserved_total_ - threshold;
    std::size_t reclaimed = 0;
    while (reclaimed < target) {
      double total_age = 0;
      std::size_t freeable = 0;
      for (auto& [id, s] : streams_) {
        for (Block* b : s->sets[kLargePool]) {
          if (!b->is_split()) {
            total_age += static_cast<double>(gc_calls_[kLargePool] - b->gc_count_base);
            ++freeable;
          }
        }
      }
      if (freeable == 0) break;
      const double mean_age = total_age / static_cast<double>(freeable);
      // Like PyTorch, a round frees every old-enough block, even past target.
      std::vector<Block*> old;
      for (auto& [id, s] : streams_) {
        for (Block* b : s->sets[kLargePool]) {
          if (!b->is_split() &&
              static_cast<double>(gc_calls_[kLargePool] - b->gc_count_base) >= mean_age) {
            old.push_back(b);
          }
        }
      }
      const std::size_t freed = release_segments_locked(lock, old);
      if (freed == 0) break;
      reclaimed += freed;
    }
  }

  std::unordered_map<StreamId, std::unique_ptr<StreamPools>> streams_;
  StreamId last_id_ = 0;
  bool last_id_valid_ = false;
  StreamPools* last_pools_ = nullptr;
  std::uint64_t gc_calls_[2] = {0, 0};
  std::size_t pending_bytes_ = 0;
  std::size_t outstanding_events_ = 0;  // entries in all streams' event queues
};

}  // namespace

std::unique_ptr<Allocator> make_pytorch_policy(Device& device, const AllocatorConfig& config) {
  return std::make_unique<PytorchPolicy>(device, config);
}

}  // namespace waterwave
