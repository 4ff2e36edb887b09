#include "sim_device.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include "../../core/errors.h"

namespace waterwave {

std::string Hazard::describe() const {
  std::ostringstream os;
  if (unmapped) {
    os << "pages " << format_addr(addr) << " (" << size << " bytes) unmapped at host time "
       << host_time_us << " us while kernel " << kernel << " on stream " << other_stream
       << " that touches them is still pending";
    return os.str();
  }
  os << "block " << format_addr(addr) << " (" << size << " bytes) handed to stream " << stream
     << " at host time " << host_time_us << " us while kernel " << kernel << " on stream "
     << other_stream << " that touches it is still pending and not ordered before it";
  return os.str();
}

SimDevice::SimDevice(std::size_t capacity, double launch_overhead_us, bool shared_compute)
    : capacity_(capacity),
      launch_overhead_us_(launch_overhead_us),
      shared_compute_(shared_compute),
      base_(0x7f0000000000ULL) {
  if (capacity == 0) throw std::invalid_argument("SimDevice capacity must be positive");
  if (capacity > kMaxCapacity) {
    throw std::invalid_argument("SimDevice capacity of " + std::to_string(capacity) +
                                " bytes is more than the simulator's address space holds: give "
                                "at most 2**56 bytes (64 PiB)");
  }
  if (!(launch_overhead_us >= 0 && std::isfinite(launch_overhead_us))) {
    throw std::invalid_argument("launch_overhead_us must be finite and >= 0, got " +
                                std::to_string(launch_overhead_us));
  }
  // Address space well beyond the capacity: a GPU maps physical pages into
  // its virtual addresses, so free memory is never too scattered to serve a
  // reservation; only the total is bounded.
  const std::size_t span = std::max<std::size_t>(4 * capacity, std::size_t{1} << 40);
  free_ranges_[base_] = span;
  // Addresses for reserve_address, after those: room for many segments each
  // spanning the device (a GPU has 256 TiB of them), however large it is.
  const std::size_t va_span = std::max<std::size_t>(64 * capacity, std::size_t{1} << 48);
  va_free_[(base_ + span + kPage) / kPage * kPage] = va_span / kPage * kPage;
}

namespace {

// First fit in a coalesced map of free ranges; returns the start or nullopt.
std::optional<Addr> take_range(std::map<Addr, std::size_t>& free, std::size_t bytes) {
  for (auto it = free.begin(); it != free.end(); ++it) {
    if (it->second < bytes) continue;
    const Addr addr = it->first;
    const std::size_t left = it->second - bytes;
    free.erase(it);
    if (left) free[addr + bytes] = left;
    return addr;
  }
  return std::nullopt;
}

void give_range(std::map<Addr, std::size_t>& free, Addr addr, std::size_t bytes) {
  auto next = free.lower_bound(addr);
  if (next != free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == addr) {
      addr = prev->first;
      bytes += prev->second;
      free.erase(prev);
    }
  }
  if (next != free.end() && addr + bytes == next->first) {
    bytes += next->second;
    free.erase(next);
  }
  free[addr] = bytes;
}

}  // namespace

std::optional<Addr> SimDevice::reserve(std::size_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  if (bytes == 0) throw std::invalid_argument("SimDevice::reserve of 0 bytes");
  if (bytes > capacity_ - used_) return std::nullopt;
  std::optional<Addr> addr = take_range(free_ranges_, bytes);
  if (addr) {
    reserved_[*addr] = bytes;
    used_ += bytes;
  }
  return addr;
}

void SimDevice::release(Addr addr, std::size_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = reserved_.find(addr);
  if (it == reserved_.end() || it->second != bytes) {
    throw std::invalid_argument("SimDevice::release of " + format_addr(addr) + " (" +
                                std::to_string(bytes) + " bytes): no such reserved segment");
  }
  // cudaFree synchronizes the device before giving memory back.
  sync_all_locked();
  reserved_.erase(it);
  used_ -= bytes;
  give_range(free_ranges_, addr, bytes);
}

// Virtual memory --------------------------------------------------------------


std::optional<Addr> SimDevice::reserve_address(std::size_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  if (bytes == 0 || bytes % kPage) {
    throw std::invalid_argument("SimDevice::reserve_address of " + std::to_string(bytes) +
                                " bytes: not a positive multiple of the 2 MiB granularity");
  }
  std::optional<Addr> addr = take_range(va_free_, bytes);
  if (addr) va_reserved_[*addr] = bytes;
  return addr;
}

void SimDevice::release_address(Addr addr, std::size_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = va_reserved_.find(addr);
  if (it == va_reserved_.end() || it->second != bytes) {
    throw std::invalid_argument("SimDevice::release_address of " + format_addr(addr) +
                                ": no such reserved range");
  }
  auto h = handles_.lower_bound(addr);
  if (h != handles_.end() && h->first - addr < bytes) {
    throw std::invalid_argument("SimDevice::release_address of " + format_addr(addr) +
                                ": pages in it are still mapped");
  }
  va_reserved_.erase(it);
  give_range(va_free_, addr, bytes);
}

void SimDevice::check_unmapped_locked(Addr addr, std::size_t bytes, const char* what) const {
  if (bytes == 0 || bytes % kPage || addr % kPage || bytes > ~Addr{0} - addr) {
    throw std::invalid_argument(std::string("SimDevice::") + what + " to " + format_addr(addr) +
                                ": not whole 2 MiB pages");
  }
  auto r = va_reserved_.upper_bound(addr);
  if (r == va_reserved_.begin() || std::prev(r)->first + std::prev(r)->second - addr < bytes) {
    throw std::invalid_argument(std::string("SimDevice::") + what + " to " + format_addr(addr) +
                                ": outside every reserved address range");
  }
  auto h = handles_.lower_bound(addr);
  const bool overlaps_next = h != handles_.end() && h->first - addr < bytes;
  const bool overlaps_prev =
      h != handles_.begin() && std::prev(h)->first + std::prev(h)->second.bytes > addr;
  if (overlaps_next || overlaps_prev) {
    throw std::invalid_argument(std::string("SimDevice::") + what + " to " + format_addr(addr) +
                                ": already mapped");
  }
}

void SimDevice::split_run_at(Addr x) {
  auto it = handles_.upper_bound(x);
  if (it == handles_.begin()) return;
  --it;
  const Addr start = it->first;
  Run& run = it->second;
  if (start < x && x - start < run.bytes && (x - start) % run.page == 0) {
    const Run upper{run.bytes - (x - start), run.page};
    run.bytes = x - start;
    handles_.emplace(x, upper);
  }
}

std::map<Addr, SimDevice::Run>::iterator SimDevice::pages_locked(Addr addr, std::size_t page,
                                                                 std::size_t count,
                                                                 const char* what) {
  auto refuse = [&] {
    return std::invalid_argument(std::string("SimDevice::") + what + " of " + format_addr(addr) +
                                 ": not whole mappings made by map()");
  };
  if (page == 0 || count == 0 || count > (~Addr{0} - addr) / page) throw refuse();
  const Addr end = addr + count * page;
  // Every byte of [addr, end) mapped in allocations of `page` bytes, aligned
  // to addr: checked before anything is split.
  auto it = handles_.upper_bound(addr);
  if (it == handles_.begin()) throw refuse();
  --it;
  for (Addr cursor = addr; cursor < end; ++it) {
    if (it == handles_.end() || it->first > cursor) throw refuse();
    const Run& run = it->second;
    if (run.page != page || (cursor - it->first) % page || it->first + run.bytes <= cursor) {
      throw refuse();
    }
    cursor = it->first + run.bytes;
    if (cursor > end && (cursor - end) % page) throw refuse();
  }
  split_run_at(addr);
  split_run_at(end);
  // Join the runs in between into one entry.
  auto first = handles_.find(addr);
  first->second.bytes = end - addr;
  handles_.erase(std::next(first), handles_.lower_bound(end));
  return first;
}

// Every kernel that touched the pages must be known finished by the host.
void SimDevice::check_idle_locked(Addr addr, std::size_t bytes) {
  const Addr end = addr + bytes;
  auto it = touches_.upper_bound(addr);
  if (it != touches_.begin() && std::prev(it)->second.end > addr) --it;
  std::vector<bool> reported(streams_.size(), false);
  for (; it != touches_.end() && it->first < end; ++it) {
    const Touch& t = it->second;
    for (std::size_t k = 0; k < t.seq.size(); ++k) {
      if (t.seq[k] > host_vc_[k] && !reported[k]) {
        reported[k] = true;
        hazards_.push_back(Hazard{addr, bytes, 0, streams_[k].id, t.kernel[k], now_, true});
      }
    }
  }
  // The memory at these addresses is gone: what touched it can race no more.
  split_touch_at(addr);
  split_touch_at(end);
  touches_.erase(touches_.lower_bound(addr), touches_.lower_bound(end));
}

bool SimDevice::map(Addr addr, std::size_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  check_unmapped_locked(addr, bytes, "map");
  if (bytes > capacity_ - used_) return false;
  handles_[addr] = Run{bytes, bytes};
  used_ += bytes;
  now_ += kMapUs;
  return true;
}

Device::MappedPages SimDevice::map_pages(Addr addr, std::size_t page, std::size_t count) {
  std::lock_guard<std::mutex> g(mu_);
  if (count == 0) return {};
  if (page == 0 || count > (~Addr{0} - addr) / page) {
    throw std::invalid_argument("SimDevice::map_pages to " + format_addr(addr) + ": " +
                                std::to_string(count) + " pages of " + std::to_string(page) +
                                " bytes pass the end of the address space");
  }
  check_unmapped_locked(addr, count * page, "map_pages");
  const std::size_t fits = std::min(count, (capacity_ - used_) / page);
  if (fits) {
    handles_[addr] = Run{fits * page, page};
    used_ += fits * page;
  }
  // One call per page on a GPU; on a failing one too.
  now_ += kMapUs * static_cast<double>(fits + (fits < count ? 1 : 0));
  return MappedPages{fits, nullptr};
}

void SimDevice::unmap(Addr addr, std::size_t bytes) { unmap_pages(addr, bytes, 1); }

void SimDevice::unmap_pages(Addr addr, std::size_t page, std::size_t count) {
  std::lock_guard<std::mutex> g(mu_);
  auto h = pages_locked(addr, page, count, "unmap");
  const std::size_t bytes = h->second.bytes;
  check_idle_locked(addr, bytes);
  handles_.erase(h);
  used_ -= bytes;
  now_ += kUnmapUs * static_cast<double>(count);
}

void SimDevice::remap(Addr from, Addr to, std::size_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  check_unmapped_locked(to, bytes, "remap");
  auto h = pages_locked(from, bytes, 1, "remap");
  check_idle_locked(from, bytes);
  handles_.erase(h);
  handles_[to] = Run{bytes, bytes};
  now_ += kUnmapUs + kMapUs;
}

std::size_t SimDevice::mapped_bytes() const {
  std::lock_guard<std::mutex> g(mu_);
  std::size_t total = 0;
  for (const auto& [addr, run] : handles_) total += run.bytes;
  return total;
}

std::size_t SimDevice::free_memory() const {
  std::lock_guard<std::mutex> g(mu_);
  return capacity_ - used_;
}

std::size_t SimDevice::index_of(StreamId id) {
  auto it = stream_index_.find(id);
  if (it != stream_index_.end()) return it->second;
  std::size_t idx = streams_.size();
  stream_index_[id] = idx;
  Stream fresh;
  fresh.id = id;
  fresh.tail = now_;
  streams_.push_back(std::move(fresh));
  host_vc_.resize(streams_.size(), 0);
  return idx;
}

SimDevice::Stream& SimDevice::stream(StreamId id) { return streams_[index_of(id)]; }

void SimDevice::join(std::vector<std::uint64_t>& into, const std::vector<std::uint64_t>& from) {
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (std::size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

std::vector<std::uint64_t> SimDevice::frontier(Stream& s) {
  join(s.vc, host_vc_);
  std::vector<std::uint64_t> f = s.vc;
  std::size_t idx = stream_index_[s.id];
  f.resize(std::max(f.size(), streams_.size()), 0);
  f[idx] = s.count;
  return f;
}

void SimDevice::host_learns(const std::vector<std::uint64_t>& vc) { join(host_vc_, vc); }

void SimDevice::sync_all_locked() {
  std::vector<std::uint64_t> all(streams_.size());
  for (std::size_t i = 0; i < streams_.size(); ++i) {
    now_ = std::max(now_, streams_[i].tail);
    all[i] = streams_[i].count;
  }
  host_learns(all);
  touches_.clear();  // every kernel is done: no hand-out can race with one
}

void SimDevice::split_touch_at(Addr x) {
  auto it = touches_.upper_bound(x);
  if (it == touches_.begin()) return;
  --it;
  if (it->first < x && x < it->second.end) {
    Touch upper = it->second;
    it->second.end = x;
    touches_.emplace(x, std::move(upper));
  }
}

void SimDevice::touch(Addr addr, Addr end, std::size_t idx, std::uint64_t seq, std::uint64_t kernel) {
  if (addr >= end) return;
  split_touch_at(addr);
  split_touch_at(end);
  const std::size_t n = streams_.size();
  auto set = [&](Touch& t) {
    if (t.seq.size() < n) {
      t.seq.resize(n, 0);
      t.kernel.resize(n, 0);
    }
    t.seq[idx] = seq;
    t.kernel[idx] = kernel;
  };
  Addr cursor = addr;
  auto it = touches_.lower_bound(addr);
  while (cursor < end) {
    if (it != touches_.end() && it->first == cursor) {
      set(it->second);
      cursor = it->second.end;
      ++it;
    } else {
      const Addr gap_end = (it != touches_.end() && it->first < end) ? it->first : end;
      Touch t{gap_end, {}, {}};
      set(t);
      touches_.emplace_hint(it, cursor, std::move(t));
      cursor = gap_end;
    }
  }
}

SimDevice::Event& SimDevice::event(EventId id) {
  auto it = events_.find(id);
  if (it == events_.end()) {
    throw std::invalid_argument("SimDevice: unknown event " + std::to_string(id));
  }
  return it->second;
}

EventId SimDevice::create_event() {
  std::lock_guard<std::mutex> g(mu_);
  EventId id = next_event_++;
  events_[id] = Event{};
  return id;
}

void SimDevice::destroy_event(EventId id) {
  std::lock_guard<std::mutex> g(mu_);
  if (!events_.erase(id)) {
    throw std::invalid_argument("SimDevice: destroy of unknown event " + std::to_string(id));
  }
}

void SimDevice::record_event(EventId id, StreamId sid) {
  std::lock_guard<std::mutex> g(mu_);
  Event& e = event(id);
  Stream& s = stream(sid);
  e.recorded = true;
  e.vc = frontier(s);
  e.time = std::max(s.tail, now_);
}

bool SimDevice::query_event(EventId id) {
  std::lock_guard<std::mutex> g(mu_);
  Event& e = event(id);
  if (!e.recorded) return true;  // as cudaEventQuery on a never-recorded event
  if (e.time > now_) return false;
  host_learns(e.vc);  // the host observed completion: later work is ordered after
  return true;
}

void SimDevice::synchronize_event(EventId id) {
  std::lock_guard<std::mutex> g(mu_);
  Event& e = event(id);
  if (!e.recorded) return;
  now_ = std::max(now_, e.time);
  host_learns(e.vc);
}

void SimDevice::stream_wait_event(StreamId sid, EventId id) {
  std::lock_guard<std::mutex> g(mu_);
  Event& e = event(id);
  Stream& s = stream(sid);
  if (!e.recorded) return;
  join(s.vc, e.vc);
  s.tail = std::max(s.tail, e.time);
}

void SimDevice::synchronize_device() {
  std::lock_guard<std::mutex> g(mu_);
  sync_all_locked();
}

std::uint64_t SimDevice::launch(StreamId sid, double duration_us, const std::vector<Range>& uses,
                                double sm_share, double bw_share) {
  if (!(duration_us >= 0 && std::isfinite(duration_us))) {
    throw std::invalid_argument("a kernel's duration must be finite and >= 0 microseconds, got " +
                                std::to_string(duration_us));
  }
  if (!(sm_share > 0 && sm_share <= 1 && bw_share > 0 && bw_share <= 1))
    throw std::invalid_argument("a kernel's SM and bandwidth shares must be in (0, 1]");
  std::lock_guard<std::mutex> g(mu_);
  Stream& s = stream(sid);
  join(s.vc, host_vc_);
  now_ += launch_overhead_us_;
  double start = std::max(now_, s.tail);
  if (concurrent_) {
    start = first_fit_locked(start, duration_us, sm_share, bw_share);
    occupy_locked(start, start + duration_us, sm_share, bw_share);
  } else if (shared_compute_) {
    start = std::max(start, gpu_tail_);
  }
  s.tail = start + duration_us;
  if (shared_compute_ && !concurrent_) gpu_tail_ = s.tail;
  sm_busy_us_ += duration_us * (concurrent_ ? sm_share : 1.0);
  s.count++;
  const std::uint64_t id = next_kernel_++;
  const std::size_t idx = stream_index_[sid];
  const std::uint64_t seq = s.count;
  for (const Range& r : uses) touch(r.addr, r.addr + r.size, idx, seq, id);
  return id;
}

// Concurrent kernels -----------------------------------------------------------
// Shares summed over kernels may round past 1 by a hair (three kernels of a
// third each): that still fits.
constexpr double kShareSlack = 1e-9;

void SimDevice::set_concurrent_kernels(bool on) {
  std::lock_guard<std::mutex> g(mu_);
  if (next_kernel_ != 1) throw std::logic_error("concurrent kernels are set before the first launch");
  concurrent_ = on;
}

bool SimDevice::concurrent_kernels() const {
  std::lock_guard<std::mutex> g(mu_);
  return concurrent_;
}

double SimDevice::sm_busy_us() const {
  std::lock_guard<std::mutex> g(mu_);
  return sm_busy_us_;
}

double SimDevice::first_fit_locked(double earliest, double duration, double sm, double bw) const {
  if (duration <= 0) return earliest;
  double t = earliest;
  for (;;) {
    // The piece of the profile in force at t, then every piece up to t + duration.
    auto it = load_.upper_bound(t);
    if (it != load_.begin()) --it;
    bool fits = true;
    for (; it != load_.end() && it->first < t + duration; ++it) {
      const auto next = std::next(it);
      if (next != load_.end() && next->first <= t) continue;  // ends before t
      if (it->second.sm + sm > 1 + kShareSlack || it->second.bw + bw > 1 + kShareSlack) {
        // Too full here: try again where this piece ends (past the last key
        // nothing runs, so the search ends there at the latest).
        if (next == load_.end()) throw std::logic_error("the SM profile does not end idle");
        t = std::max(t, next->first);
        fits = false;
        break;
      }
    }
    if (fits) return t;
  }
}

std::map<double, SimDevice::Load>::iterator SimDevice::breakpoint_locked(double t) {
  auto it = load_.lower_bound(t);
  if (it != load_.end() && it->first == t) return it;
  Load before;
  if (it != load_.begin()) before = std::prev(it)->second;
  return load_.emplace_hint(it, t, before);
}

void SimDevice::occupy_locked(double start, double end, double sm, double bw) {
  // Drop the profile before the host's clock: no kernel starts earlier.
  if (!load_.empty() && load_.begin()->first < now_) {
    auto keep = breakpoint_locked(now_);
    load_.erase(load_.begin(), keep);
  }
  if (end <= start) return;
  auto first = breakpoint_locked(start);
  auto last = breakpoint_locked(end);
  for (auto it = first; it != last; ++it) {
    it->second.sm += sm;
    it->second.bw += bw;
  }
}

void SimDevice::note_handout(Addr addr, std::size_t size, StreamId sid) {
  std::lock_guard<std::mutex> g(mu_);
  Stream& s = stream(sid);
  const std::vector<std::uint64_t> f = frontier(s);
  const std::size_t self = stream_index_[sid];
  const Addr end = addr + size;
  std::vector<bool> reported(streams_.size(), false);
  auto it = touches_.upper_bound(addr);
  if (it != touches_.begin() && std::prev(it)->second.end > addr) --it;
  while (it != touches_.end() && it->first < end) {
    const Touch& t = it->second;
    bool all_known_done = true;
    for (std::size_t k = 0; k < t.seq.size(); ++k) {
      if (t.seq[k] > host_vc_[k]) all_known_done = false;
      // A kernel on another stream after what S's next work is ordered after.
      if (k != self && t.seq[k] > f[k] && !reported[k]) {
        reported[k] = true;
        hazards_.push_back(Hazard{addr, size, sid, streams_[k].id, t.kernel[k], now_});
      }
    }
    // Pieces whose kernels the host knows finished can never race again.
    it = all_known_done ? touches_.erase(it) : std::next(it);
  }
}

void SimDevice::advance_host(double us) {
  if (!(us >= 0 && std::isfinite(us))) {
    throw std::invalid_argument("advance_host needs a finite, non-negative time, got " +
                                std::to_string(us));
  }
  std::lock_guard<std::mutex> g(mu_);
  now_ += us;
}

double SimDevice::now() const {
  std::lock_guard<std::mutex> g(mu_);
  return now_;
}

double SimDevice::stream_completion(StreamId sid) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = stream_index_.find(sid);
  return it == stream_index_.end() ? now_ : streams_[it->second].tail;
}

double SimDevice::gpu_busy_until() const {
  std::lock_guard<std::mutex> g(mu_);
  double t = now_;
  for (const Stream& s : streams_) t = std::max(t, s.tail);
  return t;
}

std::vector<Hazard> SimDevice::hazards() const {
  std::lock_guard<std::mutex> g(mu_);
  return hazards_;
}

std::uint64_t SimDevice::kernels_launched() const {
  std::lock_guard<std::mutex> g(mu_);
  return next_kernel_ - 1;
}

std::size_t SimDevice::reserved_bytes() const {
  std::lock_guard<std::mutex> g(mu_);
  return used_;
}

std::size_t SimDevice::num_segments() const {
  std::lock_guard<std::mutex> g(mu_);
  return reserved_.size();
}

}  // namespace waterwave
