// The Waterwave multi-stream caching allocator (Waterwave paper, section 4.2).
//
// Free blocks live in per-stream *unsynced* sets (freed on that stream, its
// kernels may still be queued) and one *synced* set (no pending work; memory
// never used is synced). A request on stream S tries, in order:
//   1-2. best fit in S's unsynced set (stream order makes reuse safe) or in
//      the synced set, whichever fits tighter (S's own on a tie);
//   3. promotion: record (lazily) an event per stream covering its frees, query
//      the events without blocking, move covered blocks to the synced set and
//      coalesce; then the synced set again; failing that, S's own unsynced
//      blocks absorb their synced neighbours, and S's set again;
//   4. another stream's unsynced block: S waits on that stream's event
//      asynchronously (no host blocking) and takes the block;
//   5. a new segment from the device (with expandable segments: S's own
//      segment grows, idle synced pages of any segment moving there first,
//      new pages mapped for the rest);
//   6. on device out-of-memory: SyncAndCoalesce, release empty segments, retry
//      (with expandable segments: retry first, since every free page is now
//      idle and may move; release free pages only if that fails);
//   7. OutOfMemoryError with the statistics.
// With own_segments_first (config.h; off by default) a stream keeps to its
// own large-pool memory until the device is out, as PyTorch's per-stream
// pools do: for a request of the large pool, steps 1-3 look only at synced
// blocks of segments S reserved, step 5 comes before step 4, and other
// streams' memory (their segments' synced blocks, then their unsynced ones)
// is taken only after step 6's SyncAndCoalesce and release, where PyTorch's
// policy would raise. Small-pool requests (2 MiB segments) go on as by
// default: packed across streams they leave more room under a cap, and their
// pieces are too small to strand much. Taking another stream's large free
// memory whenever it fits, the default, packs tighter still but splits that
// stream's large blocks for smaller requests and lets long-lived blocks pin
// its segments (docs/design/waterwave-policy.md, "Own memory first"). The
// large pool's synced set is then ordered by segment owner first, so each
// search stays a lower_bound (block.h).
//
// Frees coalesce only with neighbours in the same unsynced set; merging with
// synced neighbours is deferred until promotion, SyncAndCoalesce, or a
// request that nothing else serves (3), so a free never turns synced memory
// into unsynced memory.
//
// May include: core/ and this folder.
#include <algorithm>
#include <deque>
#include <memory>
#include <unordered_map>

#include "allocator.h"

namespace waterwave {
namespace {

constexpr std::size_t kMaxMarkers = 16;  // pending markers kept per stream

class WaterwavePolicy final : public Allocator {
 public:
  WaterwavePolicy(Device& device, const AllocatorConfig& config)
      : Allocator(PolicyKind::kWaterwave, device, config),
        synced_(config.own_segments_first ? synced_by_owner_ : synced_flat_) {}

  ~WaterwavePolicy() override {
    for (auto& [id, s] : streams_) {
      for (Marker& m : s->markers) release_event(m.event);
    }
  }

 private:
  // Steps 1-7 of the file's opening, in order; steps 6-7 when the device is
  // out of memory (7: nullptr, and the base raises OutOfMemoryError).
  Block* find_block_locked(Lock& lock, const Request& r, Served& how) override {
    if (Block* b = find_cached_or_new_locked(lock, r, how)) return b;
    if (cfg_.keep_segments_on_oom) return nullptr;
    return find_after_sync_locked(lock, r, how);
  }

  // Out of device memory: make every free block synced and coalesced, give
  // wholly free segments back, and try once more. The slow path: kept out of
  // line, so that the fast one above inlines its search.
  [[gnu::noinline, gnu::cold]] Block* find_after_sync_locked(Lock& lock, const Request& r,
                                                            Served& how) {
    stats_.num_oom_retries++;
    sync_and_coalesce_locked(lock);
    Block* b = nullptr;
    // With expandable segments every free page is now idle and growth moves
    // as many as it needs: unmapping them all first would cost a device
    // call per page twice over (unmap now, map again at once).
    if (cfg_.expandable_segments) b = find_cached_or_new_locked(lock, r, how, true);
    if (!b) {
      release_free_segments_locked(lock);
      b = find_cached_or_new_locked(lock, r, how, true);
    }
    how = Served::kAfterSync;
    return b;
  }

  // Steps 1-5, inlined into both callers; `after_sync`: in step 6's retry,
  // where own memory first takes other streams' memory too. (A parameter,
  // not a member: the retry lets the lock go for its sync, and another
  // thread's request meanwhile is not in its retry.)
  [[gnu::always_inline]] Block* find_cached_or_new_locked(Lock& lock, const Request& r, Served& how,
                                                          bool after_sync = false) {
    StreamState* s = stream_state(r.stream);
    // Own memory first: only S's segments' synced blocks until the device
    // is out (the file's opening).
    const StreamState* only = own_first() && r.pool == kLargePool ? s : nullptr;
    Block* b = fit(s->unsynced[r.pool], r.size);
    // An exact fit of the stream's own is the tighter one: the synced set
    // cannot beat it, so the fast path skips that search (training repeats
    // its sizes step after step, so this is the common case).
    if (!(b && b->size == r.size)) b = tighter(b, fit_synced(r.pool, r.size, only));
    if (b) {
      how = b->set == &synced_[r.pool] ? Served::kSynced : Served::kSameStream;
    } else if (promote_by_query() && (b = fit_synced(r.pool, r.size, only))) {
      how = Served::kPromoted;
    } else if (absorb_synced_neighbours(s, r.pool) && (b = fit(s->unsynced[r.pool], r.size))) {
      how = Served::kSameStream;
    } else if (only && (b = new_memory_locked(lock, r, r.stream))) {
      how = Served::kNewSegment;
    } else if (only && !after_sync) {
      return nullptr;  // step 6 next: SyncAndCoalesce, release, then others' memory
    } else if (only && (b = fit_synced(r.pool, r.size, nullptr))) {
      how = Served::kSynced;
    } else if ((b = take_from_other_stream(s, r.pool, r.size))) {
      how = Served::kCrossStreamWait;
    } else if ((b = new_memory_locked(lock, r, r.stream))) {
      how = Served::kNewSegment;
    }
    return b;
  }

  // Set at run time (Allocator::set_own_segments_first): the synced blocks
  // move to the set ordered the new way.
  void own_segments_first_changed_locked(bool on) override {
    FreeSet* to = on ? synced_by_owner_ : synced_flat_;
    if (to == synced_) return;
    for (int p = 0; p < 2; ++p) {
      scratch_.assign(synced_[p].begin(), synced_[p].end());
      for (Block* b : scratch_) {
        erase_free(b);
        insert_free(to[p], b);
      }
    }
    synced_ = to;
  }
  bool own_first() const { return synced_ == synced_by_owner_; }

  // With expandable segments each stream grows its own segment per pool, so
  // that its layout repeats step after step as under PyTorch; idle (synced)
  // pages anywhere move to where a stream grows, so memory still flows
  // between streams, and reserved follows the joint peak, not the sum of
  // the streams' peaks.
  bool joins_growth(const Block* b, const Request& r) const override {
    return b->set == &synced_[r.pool];
  }
  FreeSet* idle_set(PoolKind pool) override { return &synced_[pool]; }
  std::size_t expandable_page(PoolKind) const override { return kSmallBuffer; }

  // A new segment's remainder was never used: it is synced.
  void file_remainder(Block* remainder, FreeSet* origin, const Request& r) override {
    insert_free(origin ? *origin : synced_[r.pool], remainder);
  }

  void on_free(Block* b) override {
    account_free_complete(b);
    StreamState* s = stream_state(b->stream);
    // Other streams that used the block: record an event on each now, so the
    // block is reusable once their work queued up to this free has finished.
    for (StreamId u : b->stream_uses) {
      EventId e = take_event();
      device_.record_event(e, u);
      stats_.num_events_recorded++;
      b->events.push_back(e);
    }
    b->stream_uses.clear();
    b->free_seq = ++free_counter_;
    s->latest_free_seq = b->free_seq;
    FreeSet& set = s->unsynced[b->segment->pool];
    b = merge_neighbours_in(set, b);
    // A synced neighbour this stream freed last joins it at once: the memory
    // stays with the stream that uses it, whole.
    FreeSet& syn = synced_[b->segment->pool];
    auto ours = [&syn, s](const Block* n) { return n->set == &syn && n->stream == s->id; };
    if ((b->prev && ours(b->prev)) || (b->next && ours(b->next))) {
      const std::uint64_t seq = b->free_seq;  // the synced parts have no pending work
      b = merge_neighbours_if(b, ours);
      b->free_seq = seq;
      b->stream = s->id;
      b = merge_neighbours_in(set, b);
    }
    insert_free(set, b);
  }

  void sync_and_coalesce_locked(Lock& lock) override {
    const std::uint64_t covered = free_counter_;
    // The host waits for the device without holding the lock; frees that
    // arrive meanwhile stay unsynced (their work may be queued after the sync).
    lock.unlock();
    device_.synchronize_device();
    lock.lock();
    stats_.num_sync_and_coalesce++;
    for (StreamState* s : stream_list_) {
      while (!s->markers.empty() && s->markers.front().covered <= covered) {
        release_event(s->markers.front().event);
        s->markers.pop_front();
      }
      promote(s, covered, /*events_done=*/true);
    }
  }

  void empty_cache_locked(Lock& lock) override {
    sync_and_coalesce_locked(lock);
    release_free_segments_locked(lock);
  }

  void describe_free(AllocatorStats& out) const override {
    out.synced_free_bytes = static_cast<std::int64_t>(synced_[0].bytes() + synced_[1].bytes());
    // Streams holding unsynced free bytes: a stream the allocator has only
    // seen (an allocation that failed, a stream since synced) is not news.
    for (const StreamState* s : stream_list_) {
      const std::size_t bytes = s->unsynced[0].bytes() + s->unsynced[1].bytes();
      if (bytes) out.unsynced_free_bytes[s->id] = static_cast<std::int64_t>(bytes);
    }
  }

  void check_policy_invariants() override {
    std::unordered_map<EventId, int> refs;
    for (int p = 0; p < 2; ++p) {
      for (Block* b : synced_[p]) {
        if (!b->events.empty()) fail_invariant("a synced block still waits on events");
        if (b->segment->pool != p) fail_invariant("block in the synced set of the wrong pool");
        if ((b->prev && b->prev->set == &synced_[p]) || (b->next && b->next->set == &synced_[p])) {
          fail_invariant("adjacent synced free blocks at " + format_addr(b->addr) +
                         " were not coalesced");
        }
      }
    }
    for (StreamState* s : stream_list_) {
      std::uint64_t last = 0;
      for (const Marker& m : s->markers) {
        if (m.covered < last) fail_invariant("stream markers out of order");
        last = m.covered;
        refs[m.event]++;
      }
      for (int p = 0; p < 2; ++p) {
        const FreeSet& set = s->unsynced[p];
        for (Block* b : set) {
          if (b->stream != s->id) fail_invariant("unsynced block filed under another stream");
          if (b->segment->pool != p) fail_invariant("block in the unsynced set of the wrong pool");
          if (b->free_seq > s->latest_free_seq) fail_invariant("free_seq newer than its stream's");
          if ((b->prev && b->prev->set == &set) || (b->next && b->next->set == &set)) {
            fail_invariant("adjacent free blocks in one unsynced set at " + format_addr(b->addr) +
                           " were not coalesced");
          }
          for (EventId e : b->events) refs[e]++;
        }
      }
    }
    if (refs != event_refs_) fail_invariant("event reference counts disagree with their holders");
  }

  const char* free_state(const Block* b) const override {
    return (b->set == &synced_[0] || b->set == &synced_[1]) ? "synced" : "unsynced";
  }
  bool is_pending(const Block*) const override { return false; }
  void for_each_free_set(const std::function<void(const FreeSet&)>& fn) const override {
    fn(synced_[0]);
    fn(synced_[1]);
    for (const StreamState* s : stream_list_) {
      fn(s->unsynced[0]);
      fn(s->unsynced[1]);
    }
  }

  // An event recorded on a stream when the global free counter stood at
  // `covered`: once it completes, every block that stream freed up to then
  // is free of pending work on that stream.
  struct Marker {
    EventId event;
    std::uint64_t covered;
  };
  struct StreamState {
    StreamId id = 0;
    FreeSet unsynced[2];
    std::uint64_t latest_free_seq = 0;
    std::deque<Marker> markers;
  };

  StreamState* stream_state(StreamId id) {
    if (last_stream_ && last_stream_->id == id) return last_stream_;
    auto it = streams_.find(id);
    if (it == streams_.end()) {
      auto s = std::make_unique<StreamState>();
      s->id = id;
      stream_list_.push_back(s.get());
      it = streams_.emplace(id, std::move(s)).first;
    }
    last_stream_ = it->second.get();
    return last_stream_;
  }

  // The smaller of two fits (the stream's own first on a tie): both are safe
  // for the stream, and the tighter leaves the larger block whole.
  static Block* tighter(Block* own, Block* synced) {
    if (!own) return synced;
    if (!synced) return own;
    return synced->size < own->size ? synced : own;
  }

  Block* fit(const FreeSet& set, std::size_t size) const {
    Block* b = set.best_fit(size);
    return (b && rules_.may_take(b->size, size)) ? b : nullptr;
  }

  // Best fit in the synced set; with own memory first, among the segments
  // `only` reserved, or (nullptr) among every stream's: the tightest of
  // each stream's best fits, O(streams log n), only once the device is out.
  Block* fit_synced(PoolKind pool, std::size_t size, const StreamState* only) const {
    const FreeSet& set = synced_[pool];
    if (!set.by_owner()) return fit(set, size);
    auto fit_of = [&](StreamId owner) {
      Block* b = set.best_fit_of(owner, size);
      return (b && rules_.may_take(b->size, size)) ? b : nullptr;
    };
    if (only) return fit_of(only->id);
    Block* best = nullptr;
    for (const StreamState* v : stream_list_) {
      Block* b = fit_of(v->id);
      if (b && (!best || b->size < best->size || (b->size == best->size && b->addr < best->addr))) {
        best = b;
      }
    }
    return best;
  }

  // Record a marker on `s` if its newest free is not yet covered by one.
  // Markers that never complete must not pile up: keep the oldest (they
  // complete first and drive promotion) and the newest. Dropping one in
  // between is safe, since a newer marker covers every earlier free; a taker
  // may merely wait a little longer than it had to.
  void ensure_marker(StreamState* s, std::uint64_t seq) {
    if (!s->markers.empty() && s->markers.back().covered >= seq) return;
    EventId e = take_event();
    device_.record_event(e, s->id);
    stats_.num_events_recorded++;
    s->markers.push_back({e, free_counter_});
    if (s->markers.size() > kMaxMarkers) {
      auto victim = s->markers.end() - 2;
      release_event(victim->event);
      s->markers.erase(victim);
    }
  }

  // The oldest marker covering a free of sequence `seq` (markers are sorted).
  const Marker& covering_marker(const StreamState* s, std::uint64_t seq) const {
    auto it = std::lower_bound(s->markers.begin(), s->markers.end(), seq,
                               [](const Marker& m, std::uint64_t v) { return m.covered < v; });
    return *it;
  }

  // Step 3: promote every block whose covering events have completed, asking
  // the device without blocking. Returns whether anything was promoted.
  bool promote_by_query() {
    bool any = false;
    for (StreamState* s : stream_list_) {
      if (s->unsynced[0].empty() && s->unsynced[1].empty()) continue;
      ensure_marker(s, s->latest_free_seq);
      std::uint64_t done = 0;
      while (!s->markers.empty()) {
        stats_.num_event_queries++;
        if (!device_.query_event(s->markers.front().event)) break;
        done = s->markers.front().covered;
        release_event(s->markers.front().event);
        s->markers.pop_front();
      }
      if (done > 0) any |= promote(s, done, /*events_done=*/false);
    }
    return any;
  }

  // Move s's unsynced blocks freed at or before `covered` to the synced set,
  // coalescing with synced neighbours. Blocks that also wait on record_stream
  // events move only once those have completed (known, or queried now).
  bool promote(StreamState* s, std::uint64_t covered, bool events_done) {
    bool any = false;
    for (int p = 0; p < 2; ++p) {
      scratch_.clear();
      for (Block* b : s->unsynced[p]) {
        if (b->free_seq <= covered) scratch_.push_back(b);
      }
      for (Block* b : scratch_) {
        if (!events_done) {
          bool complete = true;
          for (EventId e : b->events) {
            stats_.num_event_queries++;
            if (!device_.query_event(e)) {
              complete = false;
              break;
            }
          }
          if (!complete) continue;
        }
        for (EventId e : b->events) release_event(e);
        b->events.clear();
        erase_free(b);
        insert_synced(b);
        any = true;
      }
    }
    return any;
  }

  void insert_synced(Block* b) {
    FreeSet& syn = synced_[b->segment->pool];
    insert_free(syn, merge_neighbours_in(syn, b));
  }

  // Step 3b: the stream's own unsynced blocks absorb their synced free
  // neighbours. Both are safe for this stream, and together they may serve a
  // request that neither serves alone; the merged block is the stream's
  // (another stream would wait on its event). Done only here, when the
  // request would otherwise take another stream's block or a new segment,
  // so that synced memory stays free for every stream as long as it can.
  bool absorb_synced_neighbours(StreamState* s, PoolKind pool) {
    FreeSet& own = s->unsynced[pool];
    FreeSet& syn = synced_[pool];
    scratch_.clear();
    for (Block* b : own) {
      if ((b->prev && b->prev->set == &syn) || (b->next && b->next->set == &syn)) {
        scratch_.push_back(b);
      }
    }
    for (Block* b : scratch_) {
      if (b->set != &own) continue;  // merged into an earlier one already
      erase_free(b);
      const std::uint64_t seq = b->free_seq;  // the synced parts have no pending work
      b = merge_neighbours_in(syn, b);
      b->free_seq = seq;
      b = merge_neighbours_in(own, b);  // a synced gap closed between two of ours
      b->stream = s->id;
      insert_free(own, b);
    }
    return !scratch_.empty();
  }

  // Step 4: best fit among the other streams' unsynced blocks; the requesting
  // stream waits (asynchronously) on an event covering the block's free.
  Block* take_from_other_stream(StreamState* s, PoolKind pool, std::size_t size) {
    Block* best = nullptr;
    StreamState* owner = nullptr;
    for (StreamState* v : stream_list_) {
      if (v == s) continue;
      Block* b = fit(v->unsynced[pool], size);
      if (b && (!best || b->size < best->size || (b->size == best->size && b->addr < best->addr))) {
        best = b;
        owner = v;
      }
    }
    if (!best) return nullptr;
    ensure_marker(owner, best->free_seq);
    device_.stream_wait_event(s->id, covering_marker(owner, best->free_seq).event);
    stats_.num_stream_waits++;
    return best;
  }

  // Give wholly free synced segments back to the device, and the free pages
  // of synced blocks in expandable segments.
  void release_free_segments_locked(Lock& lock) {
    std::vector<Block*> whole, paged;
    for (int p = 0; p < 2; ++p) {
      for (Block* b : synced_[p]) {
        if (b->segment->expandable) {
          paged.push_back(b);
        } else if (!b->is_split()) {
          whole.push_back(b);
        }
      }
    }
    release_segments_locked(lock, whole);
    unmap_free_pages_locked(lock, paged, /*idle=*/true);  // synced: no kernel touches them
  }

  std::unordered_map<StreamId, std::unique_ptr<StreamState>> streams_;
  std::vector<StreamState*> stream_list_;
  StreamState* last_stream_ = nullptr;
  // The synced set of each pool, flat or, for the large pool, by owner
  // (own_segments_first); synced_ is the pair in use.
  FreeSet synced_flat_[2];
  FreeSet synced_by_owner_[2] = {FreeSet(false), FreeSet(true)};
  FreeSet* synced_;
  std::uint64_t free_counter_ = 0;
  std::vector<Block*> scratch_;
};

}  // namespace

std::unique_ptr<Allocator> make_waterwave_policy(Device& device, const AllocatorConfig& config) {
  return std::make_unique<WaterwavePolicy>(device, config);
}

}  // namespace waterwave
