// Thread accounts: the bytes each calling thread allocates while it is
// tagged with an account. The allocator's counters cover the whole device;
// only the thread that allocates knows whose the memory is. Two users:
//
// - a training session measures what a job's thread allocates between its
//   train() calls (evaluation, metrics) while other threads train beside it;
// - waterwave.sharing: each member (one eager training loop, on its own
//   thread) is an account, and the accounts of one device share a budget
//   (shared_budget.cpp): a member passes a *gate* (a point inside its step)
//   when the rise predicted for the region after it fits beside what the
//   others hold, and an allocation that would pass the budget waits for the
//   others' frees.
//
// One ThreadAccounts serves the CUDA runtime's devices (cuda_runtime.h) and
// one the CPU (cpu_accounts.h, for PyTorch's CPU allocator). A thread
// carries one account id (0: none); ids are unique in the process, so a tag
// means one account whichever ledger sees it. An allocation made under an
// open account is noted with its block's size; its free, from any thread,
// takes it off again. Cost when no thread is tagged and nothing noted is
// live: one thread-local read per allocation and one relaxed atomic load per
// free; otherwise a short lock and a hash lookup, off the policy's lock.
//
// May include: core/.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../core/types.h"

namespace waterwave {

struct AccountUsage {
  std::size_t allocated = 0;  // bytes noted under the account and still live
  std::size_t peak = 0;       // the most `allocated` reached since the last reset
};

// A gate's rise when nothing predicts it: the member's pass runs alone.
constexpr std::size_t kUnknownRise = std::numeric_limits<std::size_t>::max();

enum class GateResult : int { kAdmitted = 0, kTimedOut = 1, kInterrupted = 2 };

// What a sharing member asks at a gate (shared_budget.cpp). Levels are the
// account's bytes (its `allocated`), rises are above its bytes now.
struct GateRequest {
  std::size_t rise = 0;     // the most the region after the gate rises (kUnknownRise: alone)
  std::size_t rest = 0;     // the most it rises before its pass ends (>= rise)
  std::size_t end = 0;      // its predicted bytes once the pass ends
  bool boundary = false;    // the gate starts a pass (the member holds no activations)
  // A first pass: the room it is admitted with at least (what such a pass
  // rose and left held, measured or guessed; 0: none asked).
  std::size_t least = 0;
  // Asking to run alone: relook() calls its member has seen (relooks()
  // before it chose what to ask); one since returns the gate at once.
  // kRelooksNow: those made by the time it arrives.
  std::uint64_t relooks_seen = kRelooksNow;
  static constexpr std::uint64_t kRelooksNow = std::numeric_limits<std::uint64_t>::max();
};

// The budget's figures, for a session's stats().
struct ShareStats {
  std::size_t budget = 0;        // 0: none
  bool measured = false;         // the budget estimates the device's room (set_budget)
  std::size_t outside = 0;       // held beside the members (set by the session)
  std::size_t members_live = 0;  // the members' bytes now, bases included
  std::size_t peak = 0;          // the most members_live reached since reset_peak
  std::size_t held = 0;          // what the rule counts held: claims, bases and outside
  std::size_t active = 0;        // members inside their sharing blocks
  std::size_t waiting = 0;       // of them, waiting at a gate or for an allocation
  long long gate_waits = 0;      // gates that did not admit at once
  long long allocation_waits = 0;
  long long overshoots = 0;      // allocations past a region's prediction that fitted
  long long forced = 0;          // gates admitted to break a tie (every member waiting)
  long long failed = 0;          // allocations failed to break a tie
  long long overdrawn = 0;       // allocations let past a measured budget to break a tie
  long long device_waits = 0;    // allocations that waited after the device ran out
};

class ThreadAccounts {
 public:
  // ---- Accounts (thread_accounts.cpp) ----
  // A new account; ids are never reused.
  std::int64_t open();
  // Forgets the account and its live blocks (they stay allocated). Unknown
  // ids are ignored.
  void close(std::int64_t id);
  // Tags the calling thread (0: untag); returns its previous tag.
  static std::int64_t set_thread(std::int64_t id);
  static std::int64_t thread_account();
  // ConfigError for an account not open.
  AccountUsage usage(std::int64_t id);
  void reset_peak(std::int64_t id);
  // The usage, and the peak reset to the bytes live now, at once.
  AccountUsage take_peak(std::int64_t id);

  // ---- The allocation path ----
  // Before an allocation of `bytes` by the calling thread: true to go on.
  // Waits while the thread is a sharing member whose allocation would pass
  // the budget; false when it was chosen to fail (every member waiting) or
  // the session was interrupted: `why()` then says so. Off the hot path
  // unless a budget is set and the thread is tagged.
  bool before_allocate(std::size_t bytes) {
    const std::int64_t id = current_;
    if (id == 0 || budget_on_.load(std::memory_order_relaxed) == 0 || bytes == 0) return true;
    return admit_allocation(id, bytes);
  }
  // After the device itself (or its per-process cap) ran out of memory for
  // the calling thread's allocation of `bytes`: where the thread is an
  // active sharing member beside others, waits until a member frees or a
  // poll passes (true: try the allocation again; the thread counts as
  // waiting until done_waiting), or until it is chosen to fail because
  // every member waits, or training is interrupted (false, `why()` saying
  // so). Any other thread gets false at once, `why()` empty: PyTorch's
  // autograd thread, which runs every member's backward, must never wait.
  bool wait_for_frees(std::size_t bytes);
  // The calling thread no longer waits for the device (its allocation went
  // through, or failed otherwise); nothing if it did not wait.
  void done_waiting();
  // Where an untagged thread's allocation on `stream` failed and the stream
  // is an active sharing member's (its backward, on PyTorch's autograd
  // thread): why it could not wait and what to do, for the device's error;
  // else empty. Off the hot path (after an out of memory).
  std::string backward_refusal(StreamId stream, std::size_t bytes);
  // The message of the calling thread's last refused allocation.
  static const std::string& why();
  // Whether that refusal was training's interruption (Ctrl-C).
  static bool why_is_interrupt();
  // `size` is asked for only when the block is noted; a zero-byte request
  // (cuDNN's empty workspaces) gets a null pointer, no block, and nothing
  // to note.
  template <typename SizeOf>
  void allocated(Addr ptr, SizeOf&& size_of) {
    const std::int64_t id = current_;
    if (ptr == 0 || id == 0 || open_.load(std::memory_order_relaxed) == 0) return;
    note(id, ptr, size_of());
  }
  // The same, for an allocation on `stream`: an untagged thread's counts to
  // the account the stream is given to (set_stream_account), if any. PyTorch
  // runs a CUDA backward on its own device thread, shared by every member:
  // a member's backward is known by its stream, and never waits.
  template <typename SizeOf>
  void allocated_on(StreamId stream, Addr ptr, SizeOf&& size_of) {
    std::int64_t id = current_;
    if (ptr == 0 || open_.load(std::memory_order_relaxed) == 0) return;
    if (id == 0 && streams_on_.load(std::memory_order_relaxed) != 0) id = stream_account(stream);
    if (id != 0) note(id, ptr, size_of());
  }
  // An allocation told by its owner rather than seen on a tagged thread
  // (the simulator's jobs, all on one thread): counted, never waits.
  void count(std::int64_t id, Addr ptr, std::size_t bytes) {
    if (ptr != 0 && id != 0) note(id, ptr, bytes);
  }
  // Allocations on `stream` by untagged threads count to account `id` (0:
  // to none again).
  void set_stream_account(StreamId stream, std::int64_t id);
  void freed(Addr ptr) {
    if (live_.load(std::memory_order_relaxed) == 0) return;
    forget(ptr);
  }

  // ---- The shared budget (shared_budget.cpp) ----
  // `budget` bytes for the members' holdings beside `outside` bytes held by
  // others (0: no budget, nothing waits). `measured`: the budget is an
  // estimate of what the device can still give (a GPU session with no
  // memory_limit), not a limit the user set; where a tie would fail an
  // allocation waiting for it, the allocation goes on to the device
  // instead, which is the limit then (shared_budget.cpp).
  void set_budget(std::size_t budget, std::size_t outside, bool measured = false);
  // The account becomes an active member; `base`: bytes it holds that it
  // did not allocate tagged (its model's parameters).
  void join(std::int64_t id, std::size_t base);
  // The member leaves its block: what it holds stays counted (its
  // gradients, its optimizer's state) until the account closes.
  void leave(std::int64_t id);
  // A gate: waits until the region fits (or `timeout_ms` passes; the
  // member stays waiting and calls again). Members that are not active
  // pass at once.
  GateResult gate(std::int64_t id, const GateRequest& request, long timeout_ms);
  // Every waiting member returns kInterrupted, every waiting allocation
  // fails, until the last active member leaves.
  void interrupt();
  ShareStats share_stats();
  // The budget less what every member holds live (bases, and `outside`),
  // regions in flight left out: how plentiful memory is, for a member
  // choosing what to ask at a gate. The largest size_t with no budget;
  // ConfigError for an account not open.
  std::size_t room_beside_live(std::int64_t id);
  // Every gate waiting to run its pass alone returns kTimedOut now, so that
  // its member may ask otherwise: a first pass of its kind was just
  // measured (sharing.py's borrowed asks). relooks(): how many so far.
  void relook();
  std::uint64_t relooks() const { return relooks_.load(std::memory_order_acquire); }
  void reset_share_peak();

  // Around a wait on the allocation path: give up Python's GIL if the
  // thread holds it (others must run to free memory), and take it back.
  // Set once by the bindings; null: nothing to give up.
  using ReleaseHook = void* (*)();
  using AcquireHook = void (*)(void*);
  static void set_wait_hooks(ReleaseHook release, AcquireHook acquire);

 private:
  struct Noted {
    std::int64_t account;
    std::size_t bytes;
  };
  enum class Waiting : std::uint8_t { kNone, kBoundary, kGate, kAllocation };
  struct Account {
    AccountUsage usage;
    // Sharing: a member's state (shared_budget.cpp). A plain account (a
    // job's between-calls interval) is no member.
    bool member = false;
    bool active = false;        // inside its sharing block
    bool in_pass = false;       // admitted at a boundary and not back at one
    bool alone = false;         // its pass has no prediction: it runs alone
    std::size_t base = 0;
    std::size_t claim = 0;      // bytes its current region may reach
    std::size_t need = 0;       // bytes it may reach before its pass ends
    std::size_t end = 0;        // bytes once its pass ends
    Waiting waiting = Waiting::kNone;
    GateRequest request;        // while waiting at a gate
    std::size_t want = 0;       // while waiting to allocate: the bytes
    bool device = false;        // that wait is for the device (wait_for_frees)
    std::uint64_t arrived = 0;  // when it began waiting (arrivals_), for its turn
    std::uint64_t ticket = 0;   // passes_ when it began waiting
    std::uint64_t stuck_at = 0; // the epoch at which it last found no room
    bool forced = false;        // admit it, room or not (a tie broken)
    bool fail = false;          // fail its allocation (a tie broken)
    bool overdraw = false;      // let its allocation past a measured budget (a tie broken)
  };

  void note(std::int64_t id, Addr ptr, std::size_t bytes);
  void forget(Addr ptr);
  std::int64_t stream_account(StreamId stream);
  void close_locked(std::int64_t id);

  // shared_budget.cpp, under mu_.
  bool admit_allocation(std::int64_t id, std::size_t bytes);
  bool try_gate_locked(std::int64_t id, Account& a);
  bool try_allocation_locked(std::int64_t id, Account& a);
  bool safe_locked(std::int64_t id, std::size_t claim, std::size_t need, std::size_t end) const;
  std::size_t hold_locked(const Account& a) const;
  std::size_t held_locked() const;
  bool boundary_blocked_locked(std::int64_t id, const Account& a) const;
  // Whether `a`'s pass, asked at its boundary, would not fit even once
  // every pass in flight ended: what it lacks is the others' state, which
  // only a member leaving gives back, so holding their passes back for it
  // (or forcing it in a tie) cannot help it.
  bool beyond_drained_locked(const Account& a, std::size_t rise) const;
  bool everyone_stuck_locked() const;
  bool others_active_locked(std::int64_t id) const;  // another member in its block
  void break_tie_locked();
  void changed_locked();
  std::string refusal_locked(const Account& a, std::size_t bytes, bool interrupted) const;
  std::string device_refusal_locked(const Account& a, std::size_t bytes, bool interrupted) const;

  static thread_local std::int64_t current_;
  static std::atomic<std::int64_t> next_id_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<std::int64_t, Account> accounts_;  // under mu_
  std::unordered_map<Addr, Noted> blocks_;              // under mu_
  std::atomic<std::size_t> open_{0};                    // accounts_.size()
  std::atomic<std::size_t> live_{0};                    // blocks_.size()
  std::unordered_map<StreamId, std::int64_t> streams_;  // under mu_
  std::atomic<std::size_t> streams_on_{0};              // streams_.size()
  // The shared budget, under mu_ (budget_on_ also read without it).
  std::atomic<int> budget_on_{0};
  std::size_t budget_ = 0;
  std::size_t outside_ = 0;
  bool measured_ = false;  // the budget estimates the device's room (set_budget)
  std::size_t members_live_ = 0;
  std::size_t members_peak_ = 0;
  std::uint64_t epoch_ = 1;        // bumped whenever room may have appeared
  std::uint64_t member_frees_ = 0; // frees of members' blocks
  std::uint64_t passes_ = 0;       // passes admitted at boundaries
  std::uint64_t arrivals_ = 0;     // members arrived at gates
  std::atomic<std::uint64_t> relooks_{0};  // relook() calls (changed under mu_)
  std::size_t waiters_ = 0;        // threads blocked on cv_
  bool interrupted_ = false;
  ShareStats counts_;              // the counters of share_stats()
};

}  // namespace waterwave
