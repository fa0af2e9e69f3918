// SPDX-License-Identifier: Apache-2.0
// dml/comm/detail/local_group.hpp — what the ranks of one comm::local group share: the world's abort flag and
// timeout, the slots a collective publishes, queued messages and posted receives, and the barrier.
// Sits on comm/communicator.hpp; used by comm/local.hpp and comm/detail/local_requests.hpp.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"

namespace dml::comm {

namespace detail::local_impl {

struct group;

// What every group of one run() shares: the abort flag that reaches all waiters and the timeout.
struct world {
  std::chrono::milliseconds timeout;
  std::atomic<bool> aborted{false};
  std::mutex m;
  std::string reason;
  std::vector<std::weak_ptr<group>> groups;

  explicit world(std::chrono::milliseconds t) : timeout(t) {}
  void abort(const std::string& why);
  std::string why() {
    std::lock_guard lk(m);
    return reason;
  }
};

// What a rank publishes for one collective; peers read it between the two barriers.
struct slot {
  const void* src = nullptr;
  void* dst = nullptr;
  std::size_t count = 0;   // elements of src
  std::size_t rcount = 0;  // elements of dst
  const std::size_t* counts = nullptr;   // v-forms: per-rank counts (send counts for all_to_allv)
  const std::size_t* rcounts = nullptr;  // all_to_allv: receive counts
  const void* type = nullptr;
  int op = 0;
  int root = 0;
  int color = 0;
  int key = 0;
  std::shared_ptr<group>* out = nullptr;  // split: where the leader leaves the new group
};

// A receive posted before its message arrived; the sender copies straight into it. A sender claims it
// (takes it off the posted list) under the group's lock, copies without the lock, and sets done under it.
struct posted_recv {
  int src = 0;
  int tag = 0;
  void* data = nullptr;
  std::size_t bytes = 0;
  const void* type = nullptr;
  bool claimed = false;
  bool done = false;
  std::string error;
};
// Whether a synchronous send (issend) has been received; guarded by the group's lock.
struct ssend_state {
  bool done = false;
};
// A message sent before its receive was posted: a copy, made without the group's lock, or, from issend, the
// sender's own memory (`ref`), valid until the receiver sets `sent->done`.
struct message {
  int src;
  int tag;
  const void* type;
  std::unique_ptr<std::byte[]> data;
  std::size_t size = 0, capacity = 0;
  const std::byte* ref = nullptr;
  std::shared_ptr<ssend_state> sent;
  const std::byte* bytes() const { return ref ? ref : data.get(); }
};

template <class T>
inline constexpr char type_tag = 0;  // its address identifies T across ranks

struct group : std::enable_shared_from_this<group> {
  int n;
  std::shared_ptr<world> w;
  std::mutex m;
  std::condition_variable cv;
  int arrived = 0;
  std::atomic<std::uint64_t> generation{0};  // written under m; read without it while a rank spins in barrier
  // Ranks that fit on the cores poll the barrier this long before they sleep on cv: a peer arriving on another core
  // is seen within a microsecond, where a condition variable's wake-up took 40-45 us on the 2-core VMs dml is tested on
  // (a collective's two barriers cost 85-90 us). Ranks that outnumber the cores sleep at once, leaving the cores to
  // the peers they wait for.
  static constexpr std::chrono::microseconds spin_for{50};
  bool spins = n <= static_cast<int>(std::thread::hardware_concurrency());
  std::vector<slot> slots;
  std::vector<std::deque<message>> inbox;              // per destination rank
  std::vector<std::list<posted_recv*>> posted;         // per destination rank, in posting order
  // Buffers of large queued messages, kept for the next ones so steady traffic maps no fresh pages.
  static constexpr std::size_t keep_from = std::size_t(64) << 10;
  static constexpr std::size_t kept_at_most = 4;
  std::vector<message> spare;

  // A message taken off an inbox is done with: an issend completes, a large copy's buffer is kept.
  void release(message& msg) {
    if (!msg.sent && msg.capacity < keep_from) return;
    std::lock_guard lk(m);
    if (msg.sent) {
      msg.sent->done = true;
      cv.notify_all();
    } else if (spare.size() < kept_at_most) {
      spare.push_back(std::move(msg));
    }
  }

  group(int size, std::shared_ptr<world> wd)
      : n(size), w(std::move(wd)), slots(size), inbox(size), posted(size) {}

  static std::shared_ptr<group> make(int size, const std::shared_ptr<world>& wd) {
    auto g = std::make_shared<group>(size, wd);
    std::lock_guard lk(wd->m);
    wd->groups.push_back(g);
    return g;
  }

  [[noreturn]] void fail_aborted(std::unique_lock<std::mutex>& lk, const char* op, int rank) {
    lk.unlock();
    fail<comm_error>("dml::comm::local: rank ", rank, " in ", op,
                     ": the group was aborted (", w->why(), ")");
  }

  // Calls ready() between short pauses until it holds (true), spin_for passes or the group is aborted (false).
  template <class Ready>
  bool spin(Ready ready) {
    const auto until = std::chrono::steady_clock::now() + spin_for;
    for (unsigned i = 1;; ++i) {
      if (ready()) return true;
      if (i % 16 == 0 && (std::chrono::steady_clock::now() >= until || w->aborted.load(std::memory_order_acquire)))
        return false;
      for (int k = 0; k < 8; ++k) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
        __builtin_ia32_pause();
#endif
      }
    }
  }

  // Sleeps until pred() holds, where ranks spin checking it under m between pauses first (a receive waiting for its
  // message); throws comm_error on abort or when the timeout passes.
  template <class Pred>
  void wait(std::unique_lock<std::mutex>& lk, Pred pred, const char* op, int rank) {
    if (spins && !pred()) {
      lk.unlock();
      spin([&] {
        const std::lock_guard held(m);
        return pred();
      });
      lk.lock();
    }
    sleep(lk, pred, op, rank);
  }
  template <class Pred>
  void sleep(std::unique_lock<std::mutex>& lk, Pred& pred, const char* op, int rank) {
    const auto deadline = std::chrono::steady_clock::now() + w->timeout;
    while (!pred()) {
      if (w->aborted.load(std::memory_order_acquire)) fail_aborted(lk, op, rank);
      if (cv.wait_until(lk, deadline) == std::cv_status::timeout && !pred()) {
        if (w->aborted.load(std::memory_order_acquire)) fail_aborted(lk, op, rank);
        lk.unlock();
        const auto secs = std::chrono::duration<double>(w->timeout).count();
        std::string msg = dml::detail::cat("dml::comm::local: rank ", rank, " of ", n, " waited more than ",
                              secs, " s in ", op, " for its peers");
        w->abort(msg);
        throw comm_error(msg);
      }
    }
  }

  // Generation-counted: a rank that leaves and re-enters cannot be mistaken for a late arrival.
  // The last rank to arrive publishes the new generation (release) after taking m from every earlier arrival, so a
  // rank that sees it (acquire), polling or woken, sees what every peer wrote before it arrived.
  void barrier(const char* op, int rank) {
    std::unique_lock lk(m);
    if (w->aborted.load(std::memory_order_acquire)) fail_aborted(lk, op, rank);
    const auto gen = generation.load(std::memory_order_relaxed);
    if (++arrived == n) {
      arrived = 0;
      generation.store(gen + 1, std::memory_order_release);
      cv.notify_all();
      return;
    }
    auto next = [&] { return generation.load(std::memory_order_acquire) != gen; };
    if (spins) {
      lk.unlock();
      if (spin(next)) return;
      lk.lock();
    }
    sleep(lk, next, op, rank);
  }
};

inline void world::abort(const std::string& why) {
  std::vector<std::shared_ptr<group>> gs;
  {
    std::lock_guard lk(m);
    if (!aborted.load()) reason = why;
    aborted.store(true, std::memory_order_release);
    for (auto& g : groups)
      if (auto p = g.lock()) gs.push_back(std::move(p));
  }
  // Notify under each group's mutex so a waiter is either before its predicate check or asleep.
  for (auto& g : gs) {
    std::lock_guard lk(g->m);
    g->cv.notify_all();
  }
}

// Ranks [lo, hi) of `count` that rank r reduces, cut at cache-line multiples so that no two
// ranks write the same line.
inline std::pair<std::size_t, std::size_t> share(std::size_t count, int n, int r, std::size_t elem) {
  const std::size_t line = elem && 64 % elem == 0 ? 64 / elem : 1;
  std::size_t per = (count + n - 1) / n;
  per = (per + line - 1) / line * line;
  const std::size_t lo = std::min(count, per * r);
  return {lo, std::min(count, lo + per)};
}

}  // namespace detail::local_impl

}  // namespace dml::comm
