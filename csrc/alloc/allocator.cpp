// The shared machinery of allocator.h: the public calls and what every
// policy's hooks build on.
#include "allocator.h"

#include <algorithm>
#include <array>
#include <exception>
#include <iterator>
#include <sstream>

namespace waterwave {

Allocator::Allocator(PolicyKind kind, Device& device, const AllocatorConfig& config)
    : device_(device), cfg_(config), rules_{cfg_}, kind_(kind) {
  fraction_ = cfg_.per_process_memory_fraction;
  if (cfg_.per_process_memory_fraction < 1.0) {
    allowed_max_ = static_cast<std::size_t>(cfg_.per_process_memory_fraction *
                                            static_cast<double>(device_.total_memory()));
  }
  stats_.max_split_size =
      cfg_.max_split_size == SIZE_MAX ? -1 : static_cast<std::int64_t>(cfg_.max_split_size);
  max_split_chosen_ = cfg_.max_split_size_set();
  own_first_chosen_ = cfg_.own_segments_first_set;
  if (cfg_.expandable_segments && !device_.supports_vmm()) {
    throw ConfigError("allocator config: expandable_segments:True needs a device with virtual "
                      "memory management (CUDA's VMM API), which this device lacks; set "
                      "expandable_segments:False");
  }
}

Allocator::~Allocator() {
  // Give every segment back; live allocations die with the allocator, as
  // they do when a CUDA context is destroyed.
  for (auto& [addr, seg] : segments_) {
    Block* b = seg->head;
    Addr run = 0;  // start of the mapped run ending here
    while (b) {
      Block* n = b->next;
      if (seg->expandable && b->mapped && !run) run = b->addr;
      if (seg->expandable && run && (!n || !n->mapped)) {
        try {
          device_.unmap_pages(run, seg->page, (b->end() - run) / seg->page);
        } catch (...) {  // page by page, as much as the device takes back
          for (Addr p = run; p < b->end(); p += seg->page) {
            try {
              device_.unmap(p, seg->page);
            } catch (...) {
            }
          }
        }
        run = 0;
      }
      block_pool_.recycle(b);
      b = n;
    }
    try {
      if (seg->expandable) {
        device_.release_address(seg->addr, seg->size);
      } else {
        device_.release(seg->addr, seg->size);
      }
    } catch (...) {
    }
    delete seg;
  }
  for (auto& [e, refs] : event_refs_) event_pool_.push_back(e);
  for (EventId e : event_pool_) {
    try {
      device_.destroy_event(e);
    } catch (...) {
    }
  }
}


// ---- The public calls: check, lock, shared part, hooks. ----

Addr Allocator::allocate(std::size_t bytes, StreamId stream) {
  if (bytes == 0) return 0;
  if (bytes >= kMaxRequest) {  // refused before touching any state
    throw OutOfMemoryError("out of memory: tried to allocate more than 1 EiB (" +
                           std::to_string(bytes) + " bytes); the size is probably corrupt");
  }
  Lock lock(mu_);
  const std::size_t size = rules_.round_size(bytes);
  const Request r{bytes, size, SizeRules::pool_for(size), stream};
  Served how = Served::kSynced;
  Block* b = find_block_locked(lock, r, how);
  if (!b) {
    stats_.num_ooms++;
    if (history_.on()) note("oom", device_.free_memory(), r.bytes, stream);  // addr: device free
    throw OutOfMemoryError(oom_message(r));
  }
  hand_out(b, r);
  stats_.served[static_cast<int>(how)]++;
  if (history_.on()) note("alloc", b->addr, b->size, stream);
  return b->addr;
}

Addr Allocator::allocate_at(Addr addr, std::size_t size, std::size_t requested) {
  Lock lock(mu_);
  auto refuse = [&](const char* why) {
    throw ConfigError("cannot hand out " + format_bytes(size) + " at " + format_addr(addr) +
                      ": " + why);
  };
  // Only PyTorch's policy files a free block under the stream of its
  // segment; the waterwave policy's unsynced blocks belong to the stream
  // that freed them.
  if (kind_ != PolicyKind::kPytorch) refuse("only the pytorch policy restores blocks in place");
  if (size == 0 || requested > size || addr + size < addr) refuse("not a block's size");
  auto it = segments_.upper_bound(addr);
  if (it == segments_.begin()) refuse("no segment holds that address");
  Segment* seg = std::prev(it)->second;
  if (addr + size > seg->addr + seg->size) refuse("it runs past its segment");
  Block* b = seg->head;
  while (b && b->end() <= addr) b = b->next;
  if (!b || !b->set || !b->mapped || !b->events.empty() || b->addr > addr ||
      b->end() < addr + size) {
    refuse("that memory is not one cached free block");
  }
  FreeSet* origin = b->set;
  erase_free(b);
  if (b->addr < addr) {  // the front stays cached where it was
    Block* rest = split(b, addr - b->addr);
    insert_free(*origin, b);
    b = rest;
  }
  if (b->size > size) insert_free(*origin, split(b, size));
  hand_out(b, Request{requested, size, seg->pool, seg->stream});
  if (history_.on()) note("alloc", b->addr, b->size, b->stream);
  return b->addr;
}

void Allocator::deallocate(Addr ptr) {
  if (ptr == 0) return;
  Lock lock(mu_);
  Block* b = live_block(ptr, "free");
  if (history_.on()) note("free_requested", b->addr, b->size, b->stream);
  account_free_request(b);
  on_free(b);
}

void Allocator::record_stream(Addr ptr, StreamId stream) {
  Lock lock(mu_);
  Block* b = live_block(ptr, "record_stream on");
  if (stream == b->stream) return;
  // Both policies note other streams' uses the same way; they differ in what
  // a free then does with them.
  if (std::find(b->stream_uses.begin(), b->stream_uses.end(), stream) == b->stream_uses.end()) {
    b->stream_uses.push_back(stream);
  }
}

void Allocator::sync_and_coalesce() {
  Lock lock(mu_);
  sync_and_coalesce_locked(lock);
}

void Allocator::empty_cache() {
  Lock lock(mu_);
  empty_cache_locked(lock);
}

AllocatorStats Allocator::stats() {
  Lock lock(mu_);
  AllocatorStats out = stats_;
  std::size_t largest = 0;
  for_each_free_set([&](const FreeSet& s) {
    if (Block* b = s.largest()) largest = std::max(largest, b->size);
  });
  out.largest_free_block = static_cast<std::int64_t>(largest);
  describe_free(out);
  return out;
}

void Allocator::record_history(bool enabled, std::size_t max_entries) {
  Lock lock(mu_);
  history_.record(enabled, max_entries);
}

std::vector<HistoryEntry> Allocator::history() {
  Lock lock(mu_);
  return history_.entries();
}

void Allocator::note(const char* action, Addr addr, std::size_t size, StreamId stream) {
  history_.add(action, addr, size, stream, device_.time_us());
}

void Allocator::reset_peak_stats() {
  Lock lock(mu_);
  stats_.reset_peaks();
}

void Allocator::reset_accumulated_stats() {
  Lock lock(mu_);
  stats_.reset_accumulated();
}

void Allocator::set_memory_fraction(double fraction) {
  if (!(fraction > 0.0 && fraction <= 1.0)) {  // NaN fails too
    throw ConfigError("a memory fraction must be in (0, 1], got " + std::to_string(fraction));
  }
  Lock lock(mu_);
  fraction_ = fraction;
  allowed_max_ = fraction < 1.0 ? static_cast<std::size_t>(
                                      fraction * static_cast<double>(device_.total_memory()))
                                : SIZE_MAX;
}

double Allocator::memory_fraction() {
  Lock lock(mu_);
  return fraction_;
}

void Allocator::set_max_split_size(std::size_t bytes) {
  Lock lock(mu_);  // cfg_.max_split_size is read and written under mu_ only
  AllocatorConfig next = cfg_;
  next.max_split_size = bytes;
  next.validate();  // ConfigError: nothing changed
  cfg_.max_split_size = bytes;
  max_split_chosen_ = true;
  stats_.max_split_size = bytes == SIZE_MAX ? -1 : static_cast<std::int64_t>(bytes);
  // The oversize counts now mean the new limit: recount what is live (their
  // peaks stay what they were; a free decreases by the limit it meets).
  std::int64_t segments = 0, allocations = 0;
  for (const auto& [addr, seg] : segments_) {
    if (seg->size >= bytes) ++segments;
    for (const Block* b = seg->head; b; b = b->next) {
      if (b->allocated && b->size >= bytes) ++allocations;
    }
  }
  auto recount = [](Stat& s, std::int64_t now) {
    s.current = now;
    s.peak = std::max(s.peak, now);
  };
  recount(stats_.oversize_segments, segments);
  recount(stats_.oversize_allocations, allocations);
}

bool Allocator::max_split_size_chosen() {
  Lock lock(mu_);
  return max_split_chosen_;
}

void Allocator::set_own_segments_first(bool on) {
  Lock lock(mu_);
  AllocatorConfig next = cfg_;
  next.set_own_segments_first(on);
  next.validate();  // ConfigError: nothing changed
  cfg_ = next;
  own_first_chosen_ = true;
  own_first_by_runs_ = false;  // the user's now: the runs' release leaves it
  own_segments_first_changed_locked(on);
}

bool Allocator::hold_own_segments_first() {
  Lock lock(mu_);
  if (own_first_runs_++ == 0 && !own_first_chosen_ && !cfg_.expandable_segments &&
      !cfg_.own_segments_first) {
    cfg_.own_segments_first = true;
    own_first_by_runs_ = true;
    own_segments_first_changed_locked(true);
  }
  return cfg_.own_segments_first;
}

void Allocator::release_own_segments_first() {
  Lock lock(mu_);
  if (own_first_runs_ == 0 || --own_first_runs_ != 0 || !own_first_by_runs_) return;
  own_first_by_runs_ = false;
  cfg_.own_segments_first = false;
  own_segments_first_changed_locked(false);
}

bool Allocator::own_segments_first_chosen() {
  Lock lock(mu_);
  return own_first_chosen_;
}

AllocatorConfig Allocator::config() {
  Lock lock(mu_);
  return cfg_;
}

std::vector<SegmentInfo> Allocator::snapshot() {
  Lock lock(mu_);
  std::vector<SegmentInfo> out;
  out.reserve(segments_.size());
  for (const auto& [addr, seg] : segments_) {
    // As PyTorch's snapshot: an expandable segment shows as one segment per
    // run of mapped memory; its unmapped address space is left out.
    SegmentInfo si{seg->addr, 0, seg->pool, seg->stream, {}, seg->expandable};
    for (Block* b = seg->head; b; b = b->next) {
      if (b->mapped && !b->unmapping) {
        if (si.blocks.empty()) si.addr = b->addr;  // a plain segment: its head
        si.size += b->size;
        const char* state = b->allocated ? "allocated" : free_state(b);
        si.blocks.push_back({b->addr, b->size, b->requested, b->stream, state});
      }
      const bool run_ends = !b->next || !b->next->mapped || b->next->unmapping;
      if (run_ends && !si.blocks.empty()) {
        out.push_back(std::move(si));
        si = SegmentInfo{0, 0, seg->pool, seg->stream, {}, seg->expandable};
      }
    }
  }
  return out;
}


void Allocator::check_invariants() {
  Lock lock(mu_);
  check_common_invariants();
  check_policy_invariants();
}

std::size_t Allocator::allocation_size(Addr ptr) {
  Lock lock(mu_);
  return live_block(ptr, "look up")->size;
}

bool Allocator::owns(Addr ptr) {
  Lock lock(mu_);
  return live_.find(ptr) != nullptr;
}

std::optional<Allocator::LiveStreams> Allocator::live_streams(Addr ptr) {
  Lock lock(mu_);
  const Block* b = live_.find(ptr);
  if (!b) return std::nullopt;
  return LiveStreams{b->stream, !b->stream_uses.empty()};
}

// ---- Segments. ----

Block* Allocator::reserve_segment_locked(Lock& lock, std::size_t bytes, PoolKind pool,
                                         StreamId stream) {
  if (reserved_total_ + bytes > allowed_max_) return nullptr;
  // Count the bytes before dropping the lock so that concurrent reservations
  // cannot overshoot the memory-fraction limit together.
  reserved_total_ += bytes;
  reserving_ += bytes;  // counted, not yet a segment: check_invariants allows for it
  std::optional<Addr> addr;
  lock.unlock();
  try {
    addr = device_.reserve(bytes);
  } catch (...) {
    lock.lock();
    reserved_total_ -= bytes;
    reserving_ -= bytes;
    throw;
  }
  lock.lock();
  reserving_ -= bytes;
  if (!addr) {
    reserved_total_ -= bytes;
    return nullptr;
  }
  auto* seg = new Segment{*addr, bytes, pool, stream, nullptr};
  seg->own = &stats_.own_segments[stream];
  seg->own->reserved.increase(pool, static_cast<std::int64_t>(bytes));
  Block* b = block_pool_.make();
  b->addr = *addr;
  b->size = bytes;
  b->segment = seg;
  b->stream = stream;
  seg->head = b;
  segments_[*addr] = seg;
  stats_.segment.increase(pool, 1);
  stats_.reserved_bytes.increase(pool, static_cast<std::int64_t>(bytes));
  stats_.num_device_alloc++;
  if (bytes >= cfg_.max_split_size) stats_.oversize_segments.increase(1);
  stats_.note_reserved_change();
  if (history_.on()) note("segment_alloc", *addr, bytes, stream);
  return b;
}

std::size_t Allocator::release_segments_locked(Lock& lock, const std::vector<Block*>& whole) {
  std::vector<Segment*> unlinked;
  std::size_t bytes = 0;
  for (Block* b : whole) {
    Segment* seg = b->segment;
    if (seg->expandable) fail_invariant("release_segments_locked given an expandable segment");
    if (b->set) erase_free(b);
    if (b->prev || b->next || b->allocated || b->addr != seg->addr || b->size != seg->size) {
      fail_invariant("release_segments_locked given a block that is not a whole free segment");
    }
    segments_.erase(seg->addr);
    if (history_.on()) note("segment_free", seg->addr, seg->size, seg->stream);
    reserved_total_ -= seg->size;
    bytes += seg->size;
    stats_.segment.decrease(seg->pool, 1);
    stats_.reserved_bytes.decrease(seg->pool, static_cast<std::int64_t>(seg->size));
    seg->own->reserved.decrease(seg->pool, static_cast<std::int64_t>(seg->size));
    stats_.num_device_free++;
    if (seg->size >= cfg_.max_split_size) stats_.oversize_segments.decrease(1);
    stats_.note_reserved_change();
    for (EventId e : b->events) release_event(e);
    b->events.clear();
    block_pool_.recycle(b);
    seg->head = nullptr;
    unlinked.push_back(seg);
  }
  if (unlinked.empty()) return 0;
  // Releasing may block (cudaFree synchronizes the device): not under mu_.
  lock.unlock();
  for (Segment* seg : unlinked) {
    device_.release(seg->addr, seg->size);
    delete seg;
  }
  lock.lock();
  return bytes;
}

// ---- Expandable segments. ----

Block* Allocator::new_memory_locked(Lock& lock, const Request& r, StreamId owner) {
  if (cfg_.expandable_segments) return grow_locked(r, owner);
  return reserve_segment_locked(lock, rules_.segment_size(r.size), r.pool, r.stream);
}

Segment* Allocator::expandable_segment_locked(StreamId owner, PoolKind pool) {
  auto key = std::make_pair(owner, static_cast<int>(pool));
  auto it = expandable_.find(key);
  if (it != expandable_.end()) return it->second;
  const std::size_t grain = device_.vmm_granularity();
  const std::size_t want = expandable_page(pool);
  const std::size_t page = (want + grain - 1) / grain * grain;
  // Address space for all of the device, and an eighth more (as PyTorch).
  const std::size_t total = device_.total_memory();
  const std::size_t span = (total + total / 8 + page - 1) / page * page;
  std::optional<Addr> addr = device_.reserve_address(span);
  if (!addr) return nullptr;
  auto* seg = new Segment{*addr, span, pool, owner, nullptr, true, page};
  seg->own = &stats_.own_segments[owner];
  Block* b = block_pool_.make();
  b->addr = *addr;
  b->size = span;
  b->segment = seg;
  b->stream = seg->stream;
  b->mapped = false;
  seg->head = b;
  segments_[*addr] = seg;
  expandable_[key] = seg;
  stats_.segment.increase(pool, 1);
  return seg;
}

void Allocator::account_mapped(Segment* seg, std::int64_t bytes) {
  reserved_total_ = static_cast<std::size_t>(static_cast<std::int64_t>(reserved_total_) + bytes);
  // Device calls: one physical allocation per page.
  const auto pages = static_cast<std::int64_t>((bytes < 0 ? -bytes : bytes) / seg->page);
  if (bytes > 0) {
    stats_.reserved_bytes.increase(seg->pool, bytes);
    seg->own->reserved.increase(seg->pool, bytes);
    stats_.num_device_alloc += pages;
  } else {
    stats_.reserved_bytes.decrease(seg->pool, -bytes);
    seg->own->reserved.decrease(seg->pool, -bytes);
    stats_.num_device_free += pages;
  }
  stats_.note_reserved_change();
}

Block* Allocator::grow_locked(const Request& r, StreamId owner) {
  Segment* seg = expandable_segment_locked(owner, r.pool);
  if (!seg) return nullptr;
  const std::size_t page = seg->page;
  // The lowest-address run long enough.
  Block* start = nullptr;
  std::size_t run = 0;
  for (Block* b = seg->head; b; b = b->next) {
    const bool joins = !b->allocated && !b->unmapping &&
                       (!b->mapped || (b->set && joins_growth(b, r)));
    if (!joins) {
      start = nullptr;
      run = 0;
      continue;
    }
    if (!start) start = b;
    run += b->size;
    if (run >= r.size) break;
  }
  if (run < r.size) return nullptr;
  // The pages to fill: idle pages of other blocks move there first (their
  // memory changes address, reserved stays); only the rest is new memory,
  // refused up front when the device or the memory fraction has no room.
  std::size_t pages = 0, covered = 0;
  for (Block* b = start; covered < r.size; b = b->next) {
    const std::size_t take =
        b->mapped ? b->size : std::min(b->size, (r.size - covered + page - 1) / page * page);
    if (!b->mapped) pages += take / page;
    covered += take;
  }
  std::vector<Block*> idle = idle_pages_locked(r.pool, page, pages, start->addr,
                                               start->addr + covered);
  const std::size_t fresh = (pages - idle.size()) * page;
  if (reserved_total_ + fresh > allowed_max_ || device_.free_memory() < fresh) {
    for (Block* m : idle) release_idle_page_locked(m);  // not moved after all
    return nullptr;
  }
  const std::vector<Block*> moved = idle;
  std::vector<Block*> taken;
  covered = 0;
  for (Block* b = start; covered < r.size;) {
    Block* next = b->next;
    if (b->mapped) {
      erase_free(b);
    } else {
      const std::size_t take = std::min(b->size, (r.size - covered + page - 1) / page * page);
      if (take < b->size) next = split(b, take);  // the rest stays unmapped
      // One physical allocation per page: pages can be given back one by one.
      // Idle pages move first, one by one; the rest is mapped in one call
      // (map_pages). A device call that throws is handled as a refusal, then
      // rethrown.
      std::size_t mapped = 0;
      std::exception_ptr error;
      while (mapped < take) {
        try {
          if (!idle.empty()) {
            const Block* m = idle.back();
            device_.remap(m->addr, b->addr + mapped, page);
            // Reserved stays, but it moves to this segment's stream.
            m->segment->own->reserved.decrease(m->segment->pool, static_cast<std::int64_t>(page));
            seg->own->reserved.increase(seg->pool, static_cast<std::int64_t>(page));
            if (history_.on()) {  // the page leaves one segment for another
              note("segment_unmap", m->addr, page, m->segment->stream);
              note("segment_map", b->addr + mapped, page, seg->stream);
            }
            idle.pop_back();
            mapped += page;
            continue;
          }
          const std::size_t want = (take - mapped) / page;
          const Device::MappedPages got = device_.map_pages(b->addr + mapped, page, want);
          if (got.mapped) account_mapped(seg, static_cast<std::int64_t>(got.mapped * page));
          for (std::size_t i = 0; history_.on() && i < got.mapped; ++i) {
            note("segment_map", b->addr + mapped + i * page, page, seg->stream);
          }
          mapped += got.mapped * page;
          if (got.error) {
            error = got.error;
            break;
          }
          if (got.mapped < want) break;  // out of memory
        } catch (...) {
          error = std::current_exception();
          break;
        }
      }
      if (mapped < take) {
        // Another process took the memory meanwhile (or the driver failed).
        // The pages mapped so far join the cache (empty_cache gives them
        // back), idle pages not moved stay where they were, the rest stays
        // unmapped, and the request fails here, leaving nothing half done.
        for (Block* m : idle) release_idle_page_locked(m);
        const std::vector<Block*> gone(moved.begin() + static_cast<std::ptrdiff_t>(idle.size()),
                                       moved.end());
        settle_unmapped_locked(gone);
        if (mapped) {
          Block* rest = split(b, mapped);
          b->mapped = true;
          merge_vacant_neighbours(rest);
          taken.push_back(b);
        } else {
          merge_vacant_neighbours(b);  // rejoin the unmapped rest split off above
        }
        if (!taken.empty()) file_remainder(join_taken(taken, r), nullptr, r);
        if (error) std::rethrow_exception(error);
        return nullptr;
      }
      b->mapped = true;
    }
    covered += b->size;
    taken.push_back(b);
    b = next;
  }
  settle_unmapped_locked(moved);
  return join_taken(taken, r);
}

// The blocks a growth took, contiguous and out of every set, as one block.
// The page mapped last may end where a free block that could have joined
// begins (the run stopped once long enough): it joins too, as free
// neighbours must be one.
Block* Allocator::join_taken(const std::vector<Block*>& taken, const Request& r) {
  Block* joined = taken.front();
  for (std::size_t i = 1; i < taken.size(); ++i) joined = merge(joined, taken[i]);
  Block* n = joined->next;
  if (n && n->mapped && !n->allocated && n->set && joins_growth(n, r)) {
    erase_free(n);
    joined = merge(joined, n);
  }
  return joined;
}

Block* Allocator::merge_vacant_neighbours(Block* b) {
  if (vacant(b->next)) merge(b, b->next);
  if (vacant(b->prev)) b = merge(b->prev, b);
  return b;
}

std::vector<Block*> Allocator::idle_pages_locked(PoolKind pool, std::size_t page,
                                                 std::size_t want, Addr skip_lo, Addr skip_hi) {
  std::vector<std::pair<Block*, Addr>> found;
  const FreeSet* set = idle_set(pool);
  if (!set || !want) return {};
  // Smallest blocks first: large idle blocks serve requests whole, as they are.
  for (auto it = set->lower_bound(page); it != set->end() && found.size() < want; ++it) {
    Block* b = *it;
    const Segment* seg = b->segment;
    if (!seg->expandable || seg->page != page || !b->events.empty()) continue;
    if (b->addr < skip_hi && skip_lo < b->end()) continue;
    const Addr first = seg->addr + (b->addr - seg->addr + page - 1) / page * page;
    for (Addr p = first; p + page <= b->end() && found.size() < want; p += page) {
      found.emplace_back(b, p);
    }
  }
  // Carve from the highest address down: a block's lower pages stay in it.
  std::sort(found.begin(), found.end(),
            [](const auto& x, const auto& y) { return x.second > y.second; });
  std::vector<Block*> out;
  for (auto [b, from] : found) {
    FreeSet* home = b->set;
    erase_free(b);
    if (from + page < b->end()) insert_free(*home, split(b, from + page - b->addr));
    Block* mid = b;
    if (from > b->addr) {
      mid = split(b, from - b->addr);
      insert_free(*home, b);
    }
    mid->mapped = false;  // the caller moves its page away
    out.push_back(mid);
  }
  return out;
}

void Allocator::release_idle_page_locked(Block* mid) {
  mid->mapped = true;
  FreeSet* home = idle_set(mid->segment->pool);
  mid = merge_neighbours_in(*home, mid);
  insert_free(*home, mid);
}

void Allocator::settle_unmapped_locked(const std::vector<Block*>& moved) {
  // `moved` runs from the highest address down: each block may absorb its
  // higher neighbour (done) and be absorbed by its lower one (still to come).
  for (Block* m : moved) {
    stats_.num_page_moves++;
    merge_vacant_neighbours(m);
  }
}

std::size_t Allocator::unmap_free_pages_locked(Lock& lock, const std::vector<Block*>& blocks,
                                              bool idle) {
  std::vector<Block*> going;
  std::size_t bytes = 0;
  for (Block* b : blocks) {
    if (!b->segment->expandable || !b->mapped || b->allocated || !b->set || !b->events.empty()) {
      fail_invariant("unmap_free_pages_locked given a block that is not free cached memory of "
                     "an expandable segment");
    }
    // Whole pages, counted from the segment's base.
    const std::size_t page = b->segment->page;
    const Addr base = b->segment->addr;
    const Addr lo = base + (b->addr - base + page - 1) / page * page;
    const Addr hi = base + (b->end() - base) / page * page;
    if (hi <= lo) continue;
    FreeSet* home = b->set;
    erase_free(b);
    if (lo > b->addr) {
      Block* head = b;
      b = split(head, lo - head->addr);
      insert_free(*home, head);
    }
    if (hi < b->end()) insert_free(*home, split(b, hi - b->addr));
    b->mapped = false;
    b->unmapping = true;
    account_mapped(b->segment, -static_cast<std::int64_t>(b->size));
    if (history_.on()) note("segment_unmap", b->addr, b->size, b->segment->stream);
    bytes += b->size;
    going.push_back(b);
  }
  if (going.empty()) return 0;
  // Unless the caller knows them idle, kernels may still touch pages freed
  // on their own stream: synchronize, not under mu_. The blocks are out of
  // every set meanwhile, and growth passes over them.
  lock.unlock();
  if (!idle) device_.synchronize_device();
  for (Block* b : going) {
    device_.unmap_pages(b->addr, b->segment->page, b->size / b->segment->page);
  }
  lock.lock();
  for (Block* b : going) {
    b->unmapping = false;
    merge_vacant_neighbours(b);
  }
  return bytes;
}

// ---- Events. ----

EventId Allocator::take_event() {
  EventId e;
  if (event_pool_.empty()) {
    e = device_.create_event();
  } else {
    e = event_pool_.back();
    event_pool_.pop_back();
  }
  event_refs_[e] = 1;
  return e;
}

void Allocator::release_event(EventId e) {
  auto it = event_refs_.find(e);
  if (it == event_refs_.end()) fail_invariant("released an event with no references");
  if (--it->second == 0) {
    event_refs_.erase(it);
    event_pool_.push_back(e);
  }
}

// ---- Blocks. ----

Block* Allocator::split(Block* b, std::size_t size) {
  Block* r = block_pool_.make();
  r->addr = b->addr + size;
  r->size = b->size - size;
  r->segment = b->segment;
  r->stream = b->stream;
  r->free_seq = b->free_seq;
  r->mapped = b->mapped;
  r->events = b->events;  // the remainder still depends on the same work
  for (EventId e : r->events) retain_event(e);
  r->prev = b;
  r->next = b->next;
  if (b->next) b->next->prev = r;
  b->next = r;
  b->size = size;
  return r;
}

Block* Allocator::merge(Block* lo, Block* hi) {
  lo->size += hi->size;
  lo->next = hi->next;
  if (hi->next) hi->next->prev = lo;
  lo->free_seq = std::max(lo->free_seq, hi->free_seq);
  for (EventId e : hi->events) {
    if (std::find(lo->events.begin(), lo->events.end(), e) == lo->events.end()) {
      lo->events.push_back(e);  // the reference moves to lo
    } else {
      release_event(e);  // lo already holds one
    }
  }
  hi->events.clear();
  block_pool_.recycle(hi);
  return lo;
}

void Allocator::hand_out(Block* b, const Request& r) {
  FreeSet* origin = b->set;
  if (origin) erase_free(b);
  // Events from record_stream uses: the taking stream waits on them.
  for (EventId e : b->events) {
    device_.stream_wait_event(r.stream, e);
    stats_.num_stream_waits++;
  }
  if (rules_.should_split(r.pool, b->size, r.size)) file_remainder(split(b, r.size), origin, r);
  for (EventId e : b->events) release_event(e);
  b->events.clear();
  b->allocated = true;
  b->requested = r.bytes;
  b->stream = r.stream;
  live_.insert(b->addr, b);
  const PoolKind pool = b->segment->pool;
  const auto size = static_cast<std::int64_t>(b->size);
  stats_.allocation.increase(pool, 1);
  stats_.allocated_bytes.increase(pool, size);
  b->segment->own->allocated.increase(pool, size);
  stats_.requested_bytes.increase(pool, static_cast<std::int64_t>(r.bytes));
  stats_.active.increase(pool, 1);
  stats_.active_bytes.increase(pool, size);
  if (b->size >= cfg_.max_split_size) stats_.oversize_allocations.increase(1);
  stats_.note_allocated_change();
}

void Allocator::account_free_request(Block* b) {
  const PoolKind pool = b->segment->pool;
  b->allocated = false;
  live_.erase(b->addr);
  stats_.allocation.decrease(pool, 1);
  stats_.allocated_bytes.decrease(pool, static_cast<std::int64_t>(b->size));
  b->segment->own->allocated.decrease(pool, static_cast<std::int64_t>(b->size));
  if (b->size >= cfg_.max_split_size) stats_.oversize_allocations.decrease(1);
}

void Allocator::account_free_complete(Block* b) {
  if (history_.on()) note("free_completed", b->addr, b->size, b->stream);
  const PoolKind pool = b->segment->pool;
  stats_.active.decrease(pool, 1);
  stats_.active_bytes.decrease(pool, static_cast<std::int64_t>(b->size));
  stats_.requested_bytes.decrease(pool, static_cast<std::int64_t>(b->requested));
  b->requested = 0;
}

void Allocator::note_split_free(const Block* b, int sign) {
  const auto bytes = static_cast<std::int64_t>(b->size);
  if (sign > 0) {
    stats_.inactive_split.increase(b->segment->pool, 1);
    stats_.inactive_split_bytes.increase(b->segment->pool, bytes);
  } else {
    stats_.inactive_split.decrease(b->segment->pool, 1);
    stats_.inactive_split_bytes.decrease(b->segment->pool, bytes);
  }
}

Block* Allocator::live_block(Addr ptr, const char* action) {
  Block* b = live_.find(ptr);
  if (!b) throw_bad_pointer(ptr, action);
  return b;
}

void Allocator::throw_bad_pointer(Addr ptr, const char* action) {
  const std::string p = format_addr(ptr);
  auto it = segments_.upper_bound(ptr);
  if (it != segments_.begin()) {
    --it;
    Segment* seg = it->second;
    if (ptr < seg->addr + seg->size) {
      for (Block* b = seg->head; b; b = b->next) {
        if (ptr < b->addr || ptr >= b->end()) continue;
        if (b->addr == ptr && !b->allocated) {
          throw PointerError(std::string("double free: cannot ") + action + " pointer " + p +
                             ": it was already freed (the block is free in the cache). Free each "
                             "pointer once.");
        }
        if (b->allocated) {
          throw PointerError(std::string("cannot ") + action + " pointer " + p +
                             ": it points inside the allocation at " + format_addr(b->addr) +
                             " (offset " + std::to_string(ptr - b->addr) +
                             "); pass the pointer that allocate returned");
        }
        throw PointerError(std::string("cannot ") + action + " pointer " + p +
                           ": it points into free cached memory and was never returned by "
                           "allocate (or was freed already)");
      }
    }
  }
  throw PointerError(std::string("unknown pointer: cannot ") + action + " " + p +
                     ": it was not allocated by this allocator (policy '" + policy() + "')");
}

void Allocator::fail_invariant(const std::string& what) const {
  throw InvariantError("allocator invariant broken (policy '" + std::string(policy()) + "'): " + what);
}

void Allocator::check_common_invariants() {
  std::unordered_map<const FreeSet*, std::pair<std::size_t, std::size_t>> in_set;  // count, bytes
  std::size_t reserved = 0, allocated = 0, allocated_count = 0, pending_bytes = 0,
              pending_count = 0, split_free = 0, split_free_bytes = 0;
  Addr last_end = 0;
  // Each stream's own segments by pool: (reserved, allocated).
  std::map<StreamId, std::array<std::pair<std::size_t, std::size_t>, 2>> own;
  for (const auto& [addr, seg] : segments_) {
    if (seg->addr != addr) fail_invariant("segment map key differs from segment address");
    auto found = stats_.own_segments.find(seg->stream);
    if (found == stats_.own_segments.end() || seg->own != &found->second) {
      fail_invariant("segment " + format_addr(seg->addr) + " does not point at its stream's "
                     "own-segment statistics");
    }
    auto& mine = own[seg->stream][seg->pool];
    if (!seg->expandable) mine.first += seg->size;
    if (seg->addr < last_end) fail_invariant("segments overlap at " + format_addr(seg->addr));
    last_end = seg->addr + seg->size;
    if (!seg->expandable) reserved += seg->size;
    if (!seg->head || seg->head->prev) fail_invariant("segment head is missing or has a prev");
    Addr expect = seg->addr;
    for (Block* b = seg->head; b; b = b->next) {
      if (b->segment != seg) fail_invariant("block points to another segment");
      if (b->addr != expect) {
        fail_invariant("blocks do not tile segment " + format_addr(seg->addr) + " at " +
                       format_addr(expect) + " (live blocks overlap or leave a gap)");
      }
      if (b->size == 0 || b->size % kMinBlockSize != 0) {
        fail_invariant("block size " + std::to_string(b->size) + " is not a positive multiple of 512");
      }
      if (b->next && b->next->prev != b) fail_invariant("prev/next links disagree");
      expect = b->end();
      if (!b->mapped || b->unmapping) {
        const std::size_t page = seg->page ? seg->page : 1;
        if (!seg->expandable || b->allocated || b->set || b->mapped ||
            (b->addr - seg->addr) % page || b->size % page) {
          fail_invariant("unmapped block " + format_addr(b->addr) + " is not whole free pages "
                         "of an expandable segment, out of every set");
        }
        continue;
      }
      if (seg->expandable) {
        reserved += b->size;
        mine.first += b->size;
      }
      if (b->allocated) {
        if (b->set) fail_invariant("allocated block is in a free set");
        if (live_.find(b->addr) != b) fail_invariant("allocated block missing from live map");
        allocated += b->size;
        mine.second += b->size;
        ++allocated_count;
      } else if (b->set) {
        auto& e = in_set[b->set];
        e.first++;
        e.second += b->size;
        if (counts_as_split(b)) {
          ++split_free;
          split_free_bytes += b->size;
        }
      } else if (is_pending(b)) {
        pending_bytes += b->size;
        ++pending_count;
      } else {
        fail_invariant("free block " + format_addr(b->addr) + " is in no free set");
      }
    }
    if (expect != seg->addr + seg->size) fail_invariant("blocks do not cover their segment");
  }
  if (live_.size() != allocated_count) fail_invariant("live map holds blocks that are not allocated");
  std::size_t sets_seen = 0;
  for_each_free_set([&](const FreeSet& s) {
    auto it = in_set.find(&s);
    std::size_t count = it == in_set.end() ? 0 : it->second.first;
    std::size_t bytes = it == in_set.end() ? 0 : it->second.second;
    if (count != s.count() || bytes != s.bytes()) {
      fail_invariant("a free set holds " + std::to_string(s.count()) + " blocks / " +
                     std::to_string(s.bytes()) + " bytes but " + std::to_string(count) + " / " +
                     std::to_string(bytes) + " point to it (a block is in two sets or none)");
    }
    for (Block* b : s) {
      if (b->set != &s || b->allocated) fail_invariant("set member does not point back to its set");
    }
    if (it != in_set.end()) ++sets_seen;
  });
  if (sets_seen != in_set.size()) fail_invariant("a block points to a set the policy does not own");
  auto eq = [&](const char* name, std::int64_t got, std::size_t want) {
    if (got != static_cast<std::int64_t>(want)) {
      fail_invariant(std::string("statistic ") + name + " = " + std::to_string(got) +
                     " but the blocks say " + std::to_string(want));
    }
  };
  eq("reserved_bytes", stats_.reserved_bytes.all().current, reserved);
  // Reservations in flight (their device call runs unlocked) are counted in
  // the total before their segment exists.
  if (reserved + reserving_ != reserved_total_) fail_invariant("reserved_total_ drifted");
  eq("segment", stats_.segment.all().current, segments_.size());
  eq("allocated_bytes", stats_.allocated_bytes.all().current, allocated);
  eq("allocation", stats_.allocation.all().current, allocated_count);
  eq("active_bytes", stats_.active_bytes.all().current, allocated + pending_bytes);
  eq("active", stats_.active.all().current, allocated_count + pending_count);
  eq("inactive_split", stats_.inactive_split.all().current, split_free);
  eq("inactive_split_bytes", stats_.inactive_split_bytes.all().current, split_free_bytes);
  for (const auto& [stream, stat] : stats_.own_segments) {
    const auto it = own.find(stream);
    std::size_t all_reserved = 0, all_allocated = 0;
    for (PoolKind pool : {kSmallPool, kLargePool}) {
      const auto [r, a] = it == own.end() ? std::pair<std::size_t, std::size_t>{} : it->second[pool];
      eq("own_segments reserved (pool)", stat.reserved.s[1 + pool].current, r);
      eq("own_segments allocated (pool)", stat.allocated.s[1 + pool].current, a);
      all_reserved += r;
      all_allocated += a;
    }
    eq("own_segments reserved", stat.reserved.all().current, all_reserved);
    eq("own_segments allocated", stat.allocated.all().current, all_allocated);
  }
}

std::string Allocator::oom_message(const Request& r) {
  std::ostringstream os;
  const std::size_t total = device_.total_memory();
  const std::size_t free = device_.free_memory();
  const auto allocated = static_cast<std::size_t>(stats_.allocated_bytes.all().current);
  os << "out of memory: tried to allocate " << format_bytes(r.size) << " (requested "
     << r.bytes << " bytes; needs a new " << format_bytes(rules_.segment_size(r.size)) << " segment). "
     << "The device has a total capacity of " << format_bytes(total) << " of which "
     << format_bytes(free) << " is free.";
  if (allowed_max_ != SIZE_MAX) {
    os << " per_process_memory_fraction allows " << format_bytes(allowed_max_) << ".";
  }
  os << " Of the reserved " << format_bytes(reserved_total_) << ", " << format_bytes(allocated)
     << " is allocated and " << format_bytes(reserved_total_ - allocated)
     << " is cached but unallocated (policy '" << policy() << "', fragmentation at peak "
     << static_cast<int>(stats_.fragmentation_at_peak() * 100 + 0.5) << "%). "
     << "Free tensors you no longer need, reduce the batch size, or set max_split_size_mb to "
     << "limit fragmentation.";
  return os.str();
}

}  // namespace waterwave
