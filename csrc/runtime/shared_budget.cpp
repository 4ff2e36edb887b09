// The shared budget of waterwave.sharing's members (thread_accounts.h): the
// rule at gates, the waits, and the tie-break that keeps them from hanging.
//
// A member's *hold* is its base (bytes it holds untagged: its parameters)
// plus the larger of its live bytes and its *claim*, the bytes its current
// region was admitted up to. Members that left their blocks hold their live
// bytes and base; `outside` is what the session holds beside them. A gate
// admits a region when
//   - the member's new claim fits: everyone's holds <= the budget, and
//   - the state is *safe*, as the banker's algorithm keeps a system safe and
//     as MemoryPairing keeps its rounds safe (waterwave/pipeline/pairing.py):
//     some order lets every member in a pass finish it, each in turn finding
//     room for the most it will hold (its need) beside the others' holds, a
//     finished member holding what its pass ends with.
// So some member can always finish its pass: members at pass boundaries
// hold no activations, and never block one another. A pass with no
// prediction (a member's first) runs alone: it waits until every other
// member is at a boundary, the others' boundaries wait while it runs, and
// its claim is all the room there is.
//
// Predictions can be wrong (a shape not seen before). An allocation past
// the member's claim goes on if it fits; otherwise it waits for the others'
// frees. When every active member waits and none fits, the tie is broken:
// a member waiting to allocate fails (its allocation raises out of memory,
// naming the budget; its thread unwinds and frees), else a gate goes on with
// the room there is. So nothing hangs, and the members' bytes never pass a
// budget the user set.
//
// A *measured* budget (a GPU session with no memory_limit) is not the
// user's: it is 95% of what the allocator could still give when it was
// last measured, the rest kept for the cache's pieces. There the tie lets
// the waiting allocation go on to the device instead (overdrawn), which
// is the limit then: it gives the bytes, or refuses them and the member
// waits for frees as below. (On an H200, four resnet50 trials under a 12
// GiB cap lost 2 of 8 to this tie failing allocations of 24.5-49 MiB, with
// the members holding exactly the budget and the device not full.)
//
// The device itself can run out before the budget does (the cache holds
// memory no member counts, or something outside the members took it). A
// member's allocation then waits as one past its budget does, for the
// members' frees (wait_for_frees), in the same tie-break: a member never
// waits there alone, and a thread that is no member never waits. Meanwhile,
// while another member's pass is in flight, the others' next passes wait at
// their boundaries: the room the ledger saw is in the cache, and what that
// pass frees must reach the member the device refused before their next
// pass takes it again.
//
// May include: core/.
#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "../core/errors.h"
#include "thread_accounts.h"

namespace waterwave {

namespace {

thread_local std::string t_why;
thread_local bool t_why_interrupted = false;  // t_why says training was interrupted
ThreadAccounts::ReleaseHook g_release = nullptr;
ThreadAccounts::AcquireHook g_acquire = nullptr;
// Passes per active member that others may start while a member waits at
// its boundary before they are held back for it (no member starves).
constexpr std::uint64_t kPatience = 2;
// How often a waiting allocation looks again without a wake-up (it also
// wakes at every free of a member's).
constexpr auto kAllocationPoll = std::chrono::milliseconds(100);

std::size_t add_sat(std::size_t a, std::size_t b) {
  return a > std::numeric_limits<std::size_t>::max() - b ? std::numeric_limits<std::size_t>::max()
                                                         : a + b;
}
std::size_t sub_floor(std::size_t a, std::size_t b) { return a > b ? a - b : 0; }

// Around a wait under `lk`: Python's GIL given up (if the thread holds it)
// with `lk` let go meanwhile, so that no thread waits for one while holding
// the other; and taken back once `lk` is let go for good.
void* release_gil(std::unique_lock<std::mutex>& lk) {
  if (g_release == nullptr) return nullptr;
  lk.unlock();
  void* gil = g_release();
  lk.lock();
  return gil;
}
void take_gil(std::unique_lock<std::mutex>& lk, void* gil) {
  lk.unlock();
  if (gil != nullptr && g_acquire != nullptr) g_acquire(gil);
}

}  // namespace

const std::string& ThreadAccounts::why() { return t_why; }
bool ThreadAccounts::why_is_interrupt() { return t_why_interrupted; }

void ThreadAccounts::set_wait_hooks(ReleaseHook release, AcquireHook acquire) {
  g_release = release;
  g_acquire = acquire;
}

void ThreadAccounts::changed_locked() {
  ++epoch_;
  if (waiters_ != 0) cv_.notify_all();
}

void ThreadAccounts::set_budget(std::size_t budget, std::size_t outside, bool measured) {
  std::lock_guard<std::mutex> g(mu_);
  budget_ = budget;
  outside_ = outside;
  measured_ = measured;
  budget_on_.store(budget != 0 ? 1 : 0, std::memory_order_relaxed);
  changed_locked();
}

void ThreadAccounts::join(std::int64_t id, std::size_t base) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = accounts_.find(id);
  if (it == accounts_.end()) {
    throw ConfigError("thread account " + std::to_string(id) + " is not open");
  }
  Account& a = it->second;
  members_live_ = a.member ? members_live_ - a.base + base
                           : members_live_ + a.usage.allocated + base;
  members_peak_ = std::max(members_peak_, members_live_);
  a.member = a.active = true;
  a.base = base;
  a.in_pass = a.alone = a.forced = a.fail = a.overdraw = false;
  a.claim = a.need = a.end = 0;
  a.waiting = Waiting::kNone;
  changed_locked();
}

void ThreadAccounts::leave(std::int64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = accounts_.find(id);
  if (it == accounts_.end() || !it->second.member) return;
  Account& a = it->second;
  a.active = a.in_pass = a.alone = a.forced = a.fail = a.overdraw = false;
  a.claim = a.need = a.end = 0;
  a.waiting = Waiting::kNone;
  if (std::none_of(accounts_.begin(), accounts_.end(),
                   [](const auto& kv) { return kv.second.active; })) {
    interrupted_ = false;  // the next block starts afresh
  }
  changed_locked();
}

void ThreadAccounts::interrupt() {
  std::lock_guard<std::mutex> g(mu_);
  if (std::any_of(accounts_.begin(), accounts_.end(),
                  [](const auto& kv) { return kv.second.active; })) {
    interrupted_ = true;
  }
  changed_locked();
}

std::size_t ThreadAccounts::hold_locked(const Account& a) const {
  if (!a.member) return 0;
  const std::size_t live = a.active ? std::max(a.usage.allocated, a.claim) : a.usage.allocated;
  return add_sat(a.base, live);
}

std::size_t ThreadAccounts::held_locked() const {
  std::size_t held = outside_;
  for (const auto& [id, a] : accounts_) held = add_sat(held, hold_locked(a));
  return held;
}

bool ThreadAccounts::boundary_blocked_locked(std::int64_t id, const Account& a) const {
  std::size_t active = 0;
  for (const auto& [other, b] : accounts_) active += b.active ? 1 : 0;
  for (const auto& [other, b] : accounts_) {
    if (other == id || !b.active) continue;
    if (b.alone && b.in_pass) return true;  // a pass runs alone
    // The device refused it what the budget admits (its cache held the
    // room): while a third member's pass runs, and will free, the next
    // passes wait, so that what it frees goes to the refused member, not to
    // their own next pass, which would take it again. With no pass but the
    // refused one's in flight they go on, as before: nothing a member holds
    // at its boundary would come free, and memory held outside the blocks
    // (a trial's evaluation) may.
    if (b.waiting == Waiting::kAllocation && b.device &&
        std::any_of(accounts_.begin(), accounts_.end(), [&](const auto& kv) {
          return kv.first != id && kv.first != other && kv.second.active && kv.second.in_pass;
        })) {
      return true;
    }
    if (b.waiting != Waiting::kBoundary || b.arrived > a.arrived) continue;
    // One that came first waits to run alone: let the passes drain. Or it
    // has waited while others started more than their share of passes,
    // unless draining them could not give it its room.
    if (b.request.rise == kUnknownRise) {
      if (!beyond_drained_locked(b, b.request.least)) return true;
      continue;
    }
    if (passes_ - b.ticket > kPatience * active &&
        !beyond_drained_locked(b, std::max(b.request.rise, b.request.least))) {
      return true;
    }
  }
  return false;
}

bool ThreadAccounts::beyond_drained_locked(const Account& a, std::size_t rise) const {
  if (budget_ == 0 || rise == 0 || rise == kUnknownRise) return false;
  std::size_t rest = outside_;
  for (const auto& [other, b] : accounts_) {
    if (!b.member) continue;
    // A pass in flight ends at its prediction, or below what it holds now.
    const bool flying = b.active && b.in_pass && &b != &a;
    rest = add_sat(rest, add_sat(b.base, flying ? std::min(b.usage.allocated, b.end)
                                                : b.usage.allocated));
  }
  return add_sat(rest, rise) > budget_;
}

bool ThreadAccounts::safe_locked(std::int64_t id, std::size_t claim, std::size_t need,
                                 std::size_t end) const {
  struct Running {
    std::size_t hold, need, end;
  };
  std::vector<Running> running;
  std::size_t total = outside_;
  for (const auto& [other, b] : accounts_) {
    if (!b.member) continue;
    if (other == id) {
      const std::size_t hold = add_sat(b.base, std::max(b.usage.allocated, claim));
      const std::size_t most = std::max(hold, add_sat(b.base, need));
      total = add_sat(total, hold);
      running.push_back({hold, most, std::min(add_sat(b.base, end), most)});
      continue;
    }
    const std::size_t hold = hold_locked(b);
    total = add_sat(total, hold);
    if (b.active && b.in_pass) {
      std::size_t want = b.need;
      if (b.waiting == Waiting::kAllocation) want = std::max(want, add_sat(b.usage.allocated, b.want));
      const std::size_t most = std::max(hold, add_sat(b.base, want));
      running.push_back({hold, most, std::min(add_sat(b.base, b.end), most)});
    }
  }
  if (total > budget_) return false;
  std::size_t avail = budget_ - total;
  while (!running.empty()) {
    // Of those that can finish now, the one that gives back most first.
    auto best = running.end();
    for (auto r = running.begin(); r != running.end(); ++r) {
      if (r->need - r->hold > avail) continue;
      if (best == running.end() || r->hold - std::min(r->hold, r->end) >
                                       best->hold - std::min(best->hold, best->end)) {
        best = r;
      }
    }
    if (best == running.end()) return false;
    avail = avail + best->hold - best->end;  // >= 0: end <= need <= hold + avail
    running.erase(best);
  }
  return true;
}

bool ThreadAccounts::try_gate_locked(std::int64_t id, Account& a) {
  const GateRequest& r = a.request;
  const std::size_t live = a.usage.allocated;
  const bool alone = r.rise == kUnknownRise;
  std::size_t claim, need, end;
  if (budget_ == 0) {
    claim = need = end = live;
  } else {
    const std::size_t others = held_locked() - hold_locked(a);
    const std::size_t room = sub_floor(budget_, add_sat(others, a.base));
    if (a.forced) {
      claim = alone ? std::max(live, room) : std::clamp(add_sat(live, r.rise), live,
                                                        std::max(live, room));
    } else {
      if (r.boundary && boundary_blocked_locked(id, a)) return false;
      if (alone) {
        for (const auto& [other, b] : accounts_) {
          if (other != id && b.active && b.in_pass) return false;
        }
        if (room < add_sat(live, r.least)) return false;
        claim = room;
      } else {
        claim = add_sat(live, r.rise);
        if (claim > room || room < add_sat(live, r.least)) return false;
      }
    }
    need = alone ? claim : std::max(claim, add_sat(live, std::max(r.rest, r.rise)));
    end = alone ? claim : std::min(r.end, need);
    if (!a.forced && !alone && !safe_locked(id, claim, need, end)) return false;
  }
  a.claim = claim;
  a.need = need;
  a.end = end;
  a.alone = alone;
  a.in_pass = true;
  a.forced = false;
  a.waiting = Waiting::kNone;
  if (r.boundary) ++passes_;
  changed_locked();  // a boundary admitted may unblock the others'
  return true;
}

bool ThreadAccounts::try_allocation_locked(std::int64_t id, Account& a) {
  (void)id;
  const std::size_t bytes = a.want;
  const std::size_t live = a.usage.allocated;
  if (budget_ == 0 || add_sat(live, bytes) <= a.claim) return true;
  const std::size_t others = held_locked() - hold_locked(a);
  const std::size_t room = sub_floor(budget_, add_sat(others, a.base));
  if (add_sat(live, bytes) > room) return false;
  if (a.in_pass && !a.alone) ++counts_.overshoots;
  a.claim = live + bytes;
  a.need = std::max(a.need, a.claim);
  return true;
}

bool ThreadAccounts::everyone_stuck_locked() const {
  std::size_t active = 0;
  for (const auto& [id, a] : accounts_) {
    if (!a.active) continue;
    ++active;
    if (a.waiting == Waiting::kNone || a.stuck_at != epoch_) return false;
  }
  return active != 0;
}

void ThreadAccounts::break_tie_locked() {
  // A member waiting to allocate fails: the one furthest past its claim.
  Account* victim = nullptr;
  std::size_t most = 0;
  for (auto& [id, a] : accounts_) {
    if (!a.active || a.waiting != Waiting::kAllocation) continue;
    const std::size_t over = sub_floor(add_sat(a.usage.allocated, a.want), a.claim);
    if (victim == nullptr || over > most) victim = &a, most = over;
  }
  if (victim != nullptr) {
    // Past a measured budget, the device decides (its refusal is a device
    // wait, whose tie fails); past the user's, the allocation fails.
    if (measured_ && !victim->device) {
      victim->overdraw = true;
      ++counts_.overdrawn;
    } else {
      victim->fail = true;
      ++counts_.failed;
    }
    changed_locked();
    return;
  }
  // Else a gate goes on with the room there is: a pass in progress first
  // (finishing it frees its activations), the one asking least; else the
  // boundary that came first of those whose pass makes no new state, then
  // of the rest. A first pass (run alone, or asking room to go on after
  // it) makes its optimizer's state: forced beside members whose state
  // already leaves none of them room, it adds to what blocks them, and
  // failing it frees only its model. Forcing a member that holds state
  // instead either runs it or, failing it, frees a whole trial's. (Under a
  // user's limit only: past a measured budget a tie asks the device, and
  // the order there stays by arrival, as the simulator's figures were.)
  const auto makes_state = [this](const Account& a) {
    return !measured_ && (a.request.rise == kUnknownRise || a.request.least != 0);
  };
  Account* chosen = nullptr;
  for (auto& [id, a] : accounts_) {
    if (!a.active || a.waiting != Waiting::kGate) continue;
    if (chosen == nullptr || a.request.rise < chosen->request.rise) chosen = &a;
  }
  if (chosen == nullptr) {
    for (auto& [id, a] : accounts_) {
      if (!a.active || a.waiting != Waiting::kBoundary) continue;
      if (chosen == nullptr || makes_state(*chosen) > makes_state(a) ||
          (makes_state(*chosen) == makes_state(a) && a.arrived < chosen->arrived)) {
        chosen = &a;
      }
    }
  }
  if (chosen != nullptr) {
    chosen->forced = true;
    ++counts_.forced;
  }
  changed_locked();
}

GateResult ThreadAccounts::gate(std::int64_t id, const GateRequest& request, long timeout_ms) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = accounts_.find(id);
  if (it == accounts_.end()) {
    throw ConfigError("thread account " + std::to_string(id) + " is not open");
  }
  if (!it->second.member || !it->second.active) return GateResult::kAdmitted;
  if (interrupted_) return GateResult::kInterrupted;  // with or without a budget
  // Asking to run alone, its member may ask otherwise once a relook() it
  // did not see was made: still waiting, in its turn, it returns to choose,
  // and is not admitted alone meanwhile.
  const std::uint64_t seen =
      request.relooks_seen == GateRequest::kRelooksNow ? relooks() : request.relooks_seen;
  const auto stale = [&] { return request.rise == kUnknownRise && relooks() != seen; };
  {
    Account& a = it->second;
    if (a.waiting == Waiting::kNone) {  // it arrives (else it calls again after a time-out)
      a.waiting = request.boundary ? Waiting::kBoundary : Waiting::kGate;
      a.arrived = ++arrivals_;
      a.ticket = passes_;
      a.claim = 0;  // the region before the gate has ended: it holds what it holds
      if (request.boundary) a.in_pass = a.alone = false;
      a.request = request;
      changed_locked();
      if (!stale() && try_gate_locked(id, a)) return GateResult::kAdmitted;
      ++counts_.gate_waits;
    }
    a.request = request;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    it = accounts_.find(id);
    if (it == accounts_.end() || !it->second.active) return GateResult::kAdmitted;
    Account& a = it->second;
    if (interrupted_) {
      a.waiting = Waiting::kNone;
      return GateResult::kInterrupted;
    }
    if (stale()) return GateResult::kTimedOut;
    if (try_gate_locked(id, a)) return GateResult::kAdmitted;
    a.stuck_at = epoch_;
    if (everyone_stuck_locked()) {
      break_tie_locked();
      continue;
    }
    if (std::chrono::steady_clock::now() >= deadline) return GateResult::kTimedOut;
    ++waiters_;
    cv_.wait_until(lk, deadline);
    --waiters_;
  }
}

bool ThreadAccounts::admit_allocation(std::int64_t id, std::size_t bytes) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = accounts_.find(id);
  if (it == accounts_.end() || !it->second.member || !it->second.active) return true;
  it->second.want = bytes;
  if (try_allocation_locked(id, it->second)) {
    it->second.want = 0;
    return true;
  }
  ++counts_.allocation_waits;
  it->second.waiting = Waiting::kAllocation;
  it->second.device = false;
  changed_locked();
  void* gil = release_gil(lk);  // others must run to free memory
  bool ok = true;
  for (;;) {
    it = accounts_.find(id);
    if (it == accounts_.end() || !it->second.active) break;  // it left: nothing to share
    Account& a = it->second;
    if (interrupted_ || a.fail) {
      t_why = refusal_locked(a, bytes, interrupted_);
      t_why_interrupted = interrupted_;
      ok = false;
      break;
    }
    if (a.overdraw) {  // a tie past a measured budget: the device decides
      a.claim = add_sat(a.usage.allocated, bytes);
      a.need = std::max(a.need, a.claim);
      break;
    }
    if (try_allocation_locked(id, a)) break;
    a.stuck_at = epoch_;
    if (everyone_stuck_locked()) {
      break_tie_locked();
      continue;
    }
    ++waiters_;
    cv_.wait_for(lk, kAllocationPoll);
    --waiters_;
  }
  it = accounts_.find(id);
  if (it != accounts_.end()) {
    it->second.waiting = Waiting::kNone;
    it->second.want = 0;
    it->second.fail = it->second.overdraw = false;
    changed_locked();
  }
  take_gil(lk, gil);
  return ok;
}

bool ThreadAccounts::wait_for_frees(std::size_t bytes) {
  t_why.clear();
  t_why_interrupted = false;
  const std::int64_t id = current_;
  if (id == 0) return false;
  std::unique_lock<std::mutex> lk(mu_);
  auto it = accounts_.find(id);
  if (it == accounts_.end() || !it->second.member || !it->second.active) return false;
  if (!others_active_locked(id)) return false;  // alone: no one will free for it
  if (it->second.waiting == Waiting::kNone) {  // this allocation's first wait
    it->second.waiting = Waiting::kAllocation;
    it->second.device = true;
    it->second.want = bytes;
    ++counts_.device_waits;
    changed_locked();
  }
  const std::uint64_t frees = member_frees_;
  void* gil = release_gil(lk);  // others must run to free memory
  bool retry = false;
  for (;;) {
    it = accounts_.find(id);
    if (it == accounts_.end() || !it->second.active) break;  // it left: the device's error
    Account& a = it->second;
    if (interrupted_ || a.fail) {
      t_why = device_refusal_locked(a, bytes, interrupted_);
      t_why_interrupted = interrupted_;
      a.waiting = Waiting::kNone;
      a.want = 0;
      a.fail = false;
      changed_locked();
      break;
    }
    if (member_frees_ != frees) {  // a member gave memory back: try again
      retry = true;
      break;
    }
    if (!others_active_locked(id)) {  // the others left: the device's error, as it is
      a.waiting = Waiting::kNone;
      a.want = 0;
      changed_locked();
      break;
    }
    a.stuck_at = epoch_;
    if (everyone_stuck_locked()) {
      break_tie_locked();
      continue;
    }
    ++waiters_;
    const std::cv_status woke = cv_.wait_for(lk, kAllocationPoll);
    --waiters_;
    // Memory a thread that is no member freed wakes no one: try again
    // after each poll. The thread stays waiting meanwhile (nothing moves
    // the epoch), so a tie among members is still seen and broken.
    if (woke == std::cv_status::timeout) {
      retry = true;
      break;
    }
  }
  take_gil(lk, gil);
  return retry;
}

std::string ThreadAccounts::backward_refusal(StreamId stream, std::size_t bytes) {
  if (current_ != 0 || streams_on_.load(std::memory_order_relaxed) == 0) return {};
  std::lock_guard<std::mutex> g(mu_);
  const auto owner = streams_.find(stream);
  if (owner == streams_.end()) return {};
  const auto it = accounts_.find(owner->second);
  if (it == accounts_.end() || !it->second.member || !it->second.active) return {};
  return "the allocation of " + format_bytes(bytes) +
         " was a sharing trial's backward, which PyTorch runs on its autograd thread, shared by "
         "every trial, where nothing waits: the device held less than the trials were admitted "
         "for (memory taken outside the sharing blocks, such as a trial's model and data made "
         "while others trained, or the allocator's cache). Give the session a memory_limit "
         "below the device's memory, or make each trial's GPU data inside its block";
}

bool ThreadAccounts::others_active_locked(std::int64_t id) const {
  return std::any_of(accounts_.begin(), accounts_.end(),
                     [id](const auto& kv) { return kv.first != id && kv.second.active; });
}

void ThreadAccounts::done_waiting() {
  const std::int64_t id = current_;
  if (id == 0) return;
  std::lock_guard<std::mutex> g(mu_);
  auto it = accounts_.find(id);
  if (it == accounts_.end() || it->second.waiting != Waiting::kAllocation) return;
  it->second.waiting = Waiting::kNone;
  it->second.want = 0;
  it->second.fail = false;
  changed_locked();
}

std::string ThreadAccounts::device_refusal_locked(const Account& a, std::size_t bytes,
                                                  bool interrupted) const {
  if (interrupted) {
    return "training was interrupted (Ctrl-C) while an allocation of " + format_bytes(bytes) +
           " waited for the other trials' memory";
  }
  return "every trial sharing the device was waiting for another's memory, so this one (" +
         format_bytes(hold_locked(a)) + " held, asking " + format_bytes(bytes) +
         ") fails and the others go on. Train fewer trials at once, use smaller batches, or "
         "give the session a memory_limit below what the device holds, so that the trials "
         "wait at their gates rather than on the device";
}

std::string ThreadAccounts::refusal_locked(const Account& a, std::size_t bytes,
                                           bool interrupted) const {
  if (interrupted) {
    return "training was interrupted (Ctrl-C) while an allocation of " + format_bytes(bytes) +
           " waited for memory under the session's budget";
  }
  const std::size_t mine = hold_locked(a);
  const std::size_t others = sub_floor(held_locked() - mine, outside_);
  return "out of memory under the training session's budget: an allocation of " +
         format_bytes(bytes) + " would take this trial past memory_limit=" +
         format_bytes(budget_) + " (this trial holds " + format_bytes(mine) +
         ", the other trials " + format_bytes(others) + ", jobs outside them " +
         format_bytes(outside_) +
         "), and every trial was waiting for another's memory. Raise the session's "
         "memory_limit (waterwave.training_session(device, memory_limit=...)), train fewer "
         "trials at once, or use smaller batches";
}

std::size_t ThreadAccounts::room_beside_live(std::int64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  if (accounts_.find(id) == accounts_.end()) {
    throw ConfigError("thread account " + std::to_string(id) + " is not open");
  }
  if (budget_ == 0) return std::numeric_limits<std::size_t>::max();
  std::size_t live = outside_;
  for (const auto& [other, a] : accounts_) {
    if (a.member) live = add_sat(live, add_sat(a.base, a.usage.allocated));
  }
  return sub_floor(budget_, live);
}

void ThreadAccounts::relook() {
  std::lock_guard<std::mutex> g(mu_);
  relooks_.fetch_add(1, std::memory_order_acq_rel);
  if (waiters_ != 0) cv_.notify_all();
}

ShareStats ThreadAccounts::share_stats() {
  std::lock_guard<std::mutex> g(mu_);
  ShareStats s = counts_;
  s.budget = budget_;
  s.measured = measured_;
  s.outside = outside_;
  s.members_live = members_live_;
  s.peak = members_peak_;
  s.held = held_locked();
  for (const auto& [id, a] : accounts_) {
    if (!a.active) continue;
    ++s.active;
    s.waiting += a.waiting != Waiting::kNone ? 1 : 0;
  }
  return s;
}

void ThreadAccounts::reset_share_peak() {
  std::lock_guard<std::mutex> g(mu_);
  members_peak_ = members_live_;
}

}  // namespace waterwave
