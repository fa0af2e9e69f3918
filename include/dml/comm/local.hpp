// SPDX-License-Identifier: Apache-2.0
// dml/comm/local.hpp — communicator whose ranks are threads of one process.
// Sits on comm/communicator.hpp and core/; the default for tests, examples and one-machine runs.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/comm/detail/reduce.hpp"
#include "dml/core/algorithm.hpp"

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
// A message sent before its receive was posted: a copy, made without the group's lock.
struct message {
  int src;
  int tag;
  const void* type;
  std::unique_ptr<std::byte[]> data;
  std::size_t size = 0, capacity = 0;
};

template <class T>
inline constexpr char type_tag = 0;  // its address identifies T across ranks

struct group : std::enable_shared_from_this<group> {
  int n;
  std::shared_ptr<world> w;
  std::mutex m;
  std::condition_variable cv;
  int arrived = 0;
  std::uint64_t generation = 0;
  std::vector<slot> slots;
  std::vector<std::deque<message>> inbox;              // per destination rank
  std::vector<std::list<posted_recv*>> posted;         // per destination rank, in posting order
  // Buffers of large queued messages, kept for the next ones so steady traffic maps no fresh pages.
  static constexpr std::size_t keep_from = std::size_t(64) << 10;
  static constexpr std::size_t kept_at_most = 4;
  std::vector<message> spare;

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

  // Sleeps until pred() holds; throws comm_error on abort or when the timeout passes.
  template <class Pred>
  void wait(std::unique_lock<std::mutex>& lk, Pred pred, const char* op, int rank) {
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
  void barrier(const char* op, int rank) {
    std::unique_lock lk(m);
    if (w->aborted.load(std::memory_order_acquire)) fail_aborted(lk, op, rank);
    const auto gen = generation;
    if (++arrived == n) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    wait(lk, [&] { return generation != gen; }, op, rank);
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

// Runs a rank's non-blocking collectives in order on one thread, so they overlap the caller's
// work; a blocking call first waits for the queue, keeping every rank's collectives in one order.
class progress {
 public:
  progress() : thread_([this] { loop(); }) {}
  ~progress() {
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void push(std::function<void()> f) {
    {
      std::lock_guard lk(m_);
      queue_.push_back(std::move(f));
    }
    cv_.notify_all();
  }
  void drain() {
    std::unique_lock lk(m_);
    cv_.wait(lk, [&] { return queue_.empty() && !busy_; });
  }

 private:
  void loop() {
    set_thread_budget(1);
    std::unique_lock lk(m_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      auto f = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lk.unlock();
      f();  // tasks catch their own errors
      lk.lock();
      busy_ = false;
      cv_.notify_all();
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread thread_;
};

struct task_state {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr err;
};

struct task_request final : request_state {
  std::shared_ptr<task_state> s;
  explicit task_request(std::shared_ptr<task_state> st) : s(std::move(st)) {}
  bool test() override {
    std::lock_guard lk(s->m);
    if (s->done && s->err) std::rethrow_exception(s->err);
    return s->done;
  }
  void wait() override {
    std::unique_lock lk(s->m);
    s->cv.wait(lk, [&] { return s->done; });  // bounded: the task's own waits time out
    if (s->err) std::rethrow_exception(s->err);
  }
};

struct recv_request final : request_state {
  std::shared_ptr<group> g;
  int rank;
  std::unique_ptr<posted_recv> p;
  recv_request(std::shared_ptr<group> gr, int r, std::unique_ptr<posted_recv> pr)
      : g(std::move(gr)), rank(r), p(std::move(pr)) {}
  ~recv_request() override { unpost(); }
  void unpost() {
    if (!p) return;
    std::lock_guard lk(g->m);
    g->posted[rank].remove(p.get());
  }
  void finish() {
    if (!p->error.empty()) throw invalid_argument(p->error);
  }
  bool cancel() override {
    std::lock_guard lk(g->m);
    if (p->done || p->claimed) return false;  // a sender is copying into it: wait for that instead
    g->posted[rank].remove(p.get());
    p.reset();
    return true;
  }
  bool test() override {
    std::unique_lock lk(g->m);
    if (!p->done && g->w->aborted.load()) g->fail_aborted(lk, "recv", rank);
    if (!p->done) return false;
    lk.unlock();
    finish();
    return true;
  }
  void wait() override {
    {
      std::unique_lock lk(g->m);
      try {
        g->wait(lk, [&] { return p->done; }, "recv", rank);
      } catch (...) {
        if (!lk.owns_lock()) lk.lock();
        g->cv.wait(lk, [&] { return !p->claimed || p->done; });  // a copy in progress ends shortly
        g->posted[rank].remove(p.get());
        p.reset();
        throw;
      }
    }
    finish();
  }
};

}  // namespace detail::local_impl

// Outside the class so that `options opt = {}` works as a default argument inside it.
struct local_options {
  // Every wait (barrier, receive) fails with comm_error after this long.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

class local {
 public:
  using options = local_options;

  // Starts n ranks as threads, calls fn(local&) on each and joins them. If any fn throws, every
  // other rank's pending or next operation throws comm_error, and run rethrows the first error.
  template <class F>
    requires std::invocable<F&, local&>
  static void run(int n, F&& fn, options opt = {}) {
    if (n < 1) fail<invalid_argument>("dml::comm::local::run: expected at least 1 rank, found ", n);
    auto w = std::make_shared<detail::local_impl::world>(opt.timeout);
    auto g = detail::local_impl::group::make(n, w);
    std::mutex em;
    std::exception_ptr first;
    const int budget = std::max(1, int(std::thread::hardware_concurrency()) / n);
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        set_thread_budget(budget);
        try {
          local c(g, r);
          fn(c);
        } catch (...) {
          std::string what = "unknown exception";
          try {
            throw;
          } catch (const std::exception& e) {
            what = e.what();
          } catch (...) {
          }
          {
            std::lock_guard lk(em);
            if (!first) first = std::current_exception();
          }
          w->abort(dml::detail::cat("rank ", r, " failed: ", what));
        }
      });
    }
    for (auto& t : threads) t.join();
    if (first) std::rethrow_exception(first);
  }

  local(local&&) noexcept = default;
  local& operator=(local&&) noexcept = default;
  ~local() = default;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return g_->n; }

  // ---- all_reduce: each rank reduces its 1/n slice from every peer's memory and writes the
  // result into every peer's destination, so each element is read and written once per rank.
  template <reducible T>
  void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    before();
    all_reduce_impl(send, recv, op);
  }
  template <reducible T>
  void all_reduce(std::span<T> data, reduce_op op) {
    all_reduce(std::span<const T>(data), data, op);
  }
  template <reducible T>
  request iall_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    return defer([=](local& c) { c.all_reduce_impl<T>(send, recv, op); });
  }
  template <reducible T>
  request iall_reduce(std::span<T> data, reduce_op op) {
    return iall_reduce(std::span<const T>(data), data, op);
  }

  // ---- reduce_scatter: send holds size() blocks; rank r receives the reduction of block r.
  template <reducible T>
  void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    before();
    reduce_scatter_impl(send, recv, op);
  }
  // In place: the result lands in block rank() of data, which is returned.
  template <reducible T>
  std::span<T> reduce_scatter(std::span<T> data, reduce_op op) {
    auto mine = own_block(data, "reduce_scatter");
    reduce_scatter(std::span<const T>(data), mine, op);
    return mine;
  }
  template <reducible T>
  request ireduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    return defer([=](local& c) { c.reduce_scatter_impl<T>(send, recv, op); });
  }

  // ---- all_gather: recv holds size() blocks of send's size, block p from rank p.
  template <transferable T>
  void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    before();
    all_gather_impl(send, recv);
  }
  // In place: block rank() of data is this rank's contribution.
  template <transferable T>
  void all_gather(std::span<T> data) {
    auto mine = own_block(data, "all_gather");
    all_gather(std::span<const T>(mine), data);
  }
  template <transferable T>
  request iall_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    return defer([=](local& c) { c.all_gather_impl<T>(send, recv); });
  }
  // counts[p] elements from rank p, packed in rank order; every rank passes the same counts.
  template <transferable T>
  void all_gatherv(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                   std::span<const std::size_t> counts) {
    before();
    all_gatherv_impl(send, recv, counts);
  }

  // ---- broadcast: root's data to every rank.
  template <transferable T>
  void broadcast(std::span<T> data, int root) {
    before();
    broadcast_impl(data, root);
  }
  template <transferable T>
  request ibroadcast(std::span<T> data, int root) {
    return defer([=](local& c) { c.broadcast_impl<T>(data, root); });
  }

  // ---- reduce: the reduction lands in root's recv (others may pass an empty recv); each rank
  // reduces its own slice straight into root's memory.
  template <reducible T>
  void reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op, int root) {
    before();
    reduce_impl(send, recv, op, root);
  }
  template <reducible T>
  void reduce(std::span<T> data, reduce_op op, int root) {
    reduce(std::span<const T>(data), rank_ == root ? data : std::span<T>{}, op, root);
  }
  template <reducible T>
  request ireduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op, int root) {
    return defer([=](local& c) { c.reduce_impl<T>(send, recv, op, root); });
  }

  // ---- all_to_all: block p of send goes to rank p, block p of recv came from rank p.
  template <transferable T>
  void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    before();
    all_to_all_impl(send, recv);
  }
  template <transferable T>
  request iall_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    return defer([=](local& c) { c.all_to_all_impl<T>(send, recv); });
  }
  // send_counts[p] elements to rank p and recv_counts[p] from it, packed in rank order.
  template <transferable T>
  void all_to_allv(std::span<const std::type_identity_t<T>> send, std::span<const std::size_t> send_counts,
                   std::span<T> recv, std::span<const std::size_t> recv_counts) {
    before();
    all_to_allv_impl(send, send_counts, recv, recv_counts);
  }

  // ---- point to point. send copies into the peer's posted receive, or queues a copy, and
  // returns at once; receives match (peer, tag) in posting order.
  template <transferable T>
  void send(std::span<const T> data, int peer, int tag) {
    send_impl<T>(data, peer, tag);
  }
  template <transferable T>
  void send(std::span<T> data, int peer, int tag) {
    send_impl<T>(data, peer, tag);
  }
  template <transferable T>
  request isend(std::span<const T> data, int peer, int tag) {
    send_impl<T>(data, peer, tag);
    return request{};
  }
  template <transferable T>
  request isend(std::span<T> data, int peer, int tag) {
    send_impl<T>(data, peer, tag);
    return request{};
  }
  template <transferable T>
  void recv(std::span<T> data, int peer, int tag) {
    irecv(data, peer, tag).wait();
  }
  template <transferable T>
  request irecv(std::span<T> data, int peer, int tag) {
    check_peer(peer, "recv");
    auto p = std::make_unique<detail::local_impl::posted_recv>();
    p->src = peer;
    p->tag = tag;
    p->data = data.data();
    p->bytes = data.size_bytes();
    p->type = &detail::local_impl::type_tag<T>;
    std::optional<detail::local_impl::message> queued;
    {
      std::unique_lock lk(g_->m);
      if (g_->w->aborted.load()) g_->fail_aborted(lk, "recv", rank_);
      auto& box = g_->inbox[rank_];
      auto it = std::find_if(box.begin(), box.end(),
                             [&](const auto& msg) { return msg.src == peer && msg.tag == tag; });
      if (it != box.end()) {
        queued = std::move(*it);
        box.erase(it);
      } else {
        g_->posted[rank_].push_back(p.get());
      }
    }
    if (queued) {  // p is this thread's alone: copy without the lock
      deliver(*p, queued->type, queued->data.get(), queued->size);
      p->done = true;
      if (queued->capacity >= detail::local_impl::group::keep_from) {
        std::lock_guard lk(g_->m);
        if (g_->spare.size() < detail::local_impl::group::kept_at_most) g_->spare.push_back(std::move(*queued));
      }
    }
    return request(std::make_unique<detail::local_impl::recv_request>(g_, rank_, std::move(p)));
  }

  void barrier() {
    before();
    g_->barrier("barrier", rank_);
  }

  // Ranks with the same color form a group, ordered by (key, rank). Collective on this group.
  local split(int color, int key) {
    before();
    if (color < 0)
      fail<invalid_argument>("dml::comm::local::split: expected a color >= 0, found ", color);
    std::shared_ptr<detail::local_impl::group> mine;
    auto& s = publish("split");
    s.color = color;
    s.key = key;
    s.out = &mine;
    g_->barrier("split", rank_);
    std::vector<int> members;
    for (int p = 0; p < g_->n; ++p)
      if (g_->slots[p].color == color) members.push_back(p);
    std::stable_sort(members.begin(), members.end(),
                     [&](int a, int b) { return g_->slots[a].key < g_->slots[b].key; });
    if (members.front() == rank_) {
      auto ng = detail::local_impl::group::make(int(members.size()), g_->w);
      for (int p : members) *g_->slots[p].out = ng;
    }
    g_->barrier("split", rank_);
    const int r = int(std::find(members.begin(), members.end(), rank_) - members.begin());
    return local(std::move(mine), r);
  }

 private:
  local(std::shared_ptr<detail::local_impl::group> g, int r) : g_(std::move(g)), rank_(r) {}

  // A blocking call runs after every non-blocking one this rank issued earlier.
  void before() {
    if (progress_) progress_->drain();
  }

  // The task runs on a second handle of this rank, so moving *this meanwhile is harmless.
  request defer(std::function<void(local&)> f) {
    if (!progress_) progress_ = std::make_unique<detail::local_impl::progress>();
    auto st = std::make_shared<detail::local_impl::task_state>();
    auto shadow = std::shared_ptr<local>(new local(g_, rank_));
    progress_->push([st, shadow, f = std::move(f)] {
      std::exception_ptr err;
      try {
        f(*shadow);
      } catch (...) {
        err = std::current_exception();
      }
      std::lock_guard lk(st->m);
      st->done = true;
      st->err = err;
      st->cv.notify_all();
    });
    return request(std::make_unique<detail::local_impl::task_request>(std::move(st)));
  }

  detail::local_impl::slot& publish(const char* op) {
    if (g_->w->aborted.load(std::memory_order_acquire)) {
      std::unique_lock lk(g_->m);
      g_->fail_aborted(lk, op, rank_);
    }
    auto& s = g_->slots[rank_];
    s = {};
    return s;
  }

  // Every rank runs the same checks on the same published slots, so all of them throw together;
  // the closing barrier keeps the slots alive until every rank has looked.
  void agree(const char* op, const std::string& err) {
    if (err.empty()) return;
    g_->barrier(op, rank_);
    throw invalid_argument(cat("dml::comm::local::", op, ": ", err));
  }

  template <class T>
  std::string same_everywhere(const char* what_count, bool check_count = true) const {
    const auto& s0 = g_->slots[0];
    for (int p = 1; p < g_->n; ++p) {
      const auto& s = g_->slots[p];
      if (s.type != s0.type)
        return cat("expected the same element type on every rank; rank ", p, " differs from rank 0");
      if (check_count && s.count != s0.count)
        return cat("expected the same ", what_count, " on every rank; rank 0 has ", s0.count,
                   ", rank ", p, " has ", s.count);
      if (s.op != s0.op)
        return cat("expected the same reduce_op on every rank; rank 0 has ",
                   name(reduce_op(s0.op)), ", rank ", p, " has ", name(reduce_op(s.op)));
      if (s.root != s0.root)
        return cat("expected the same root on every rank; rank 0 has ", s0.root, ", rank ", p,
                   " has ", s.root);
    }
    return {};
  }

  void check_peer(int peer, const char* op) const {
    if (peer < 0 || peer >= g_->n)
      fail<invalid_argument>("dml::comm::local::", op, ": expected a peer in [0, ", g_->n,
                             "), found ", peer);
  }
  void check_root(int root, const char* op) const {
    if (root < 0 || root >= g_->n)
      fail<invalid_argument>("dml::comm::local::", op, ": expected a root in [0, ", g_->n,
                             "), found ", root);
  }
  template <class T>
  std::span<T> own_block(std::span<T> data, const char* op) const {
    if (data.size() % g_->n != 0)
      fail<invalid_argument>("dml::comm::local::", op, ": expected a size divisible by the group size ",
                             g_->n, ", found ", data.size());
    const std::size_t m = data.size() / g_->n;
    return data.subspan(m * rank_, m);
  }

  template <reducible T>
  void all_reduce_impl(std::span<const T> send, std::span<T> recv, reduce_op op) {
    check_reduce<T>(op, "dml::comm::local::all_reduce");
    if (send.size() != recv.size())
      fail<invalid_argument>("dml::comm::local::all_reduce: expected recv of send's size ",
                             send.size(), ", found ", recv.size());
    auto& s = publish("all_reduce");
    s.src = send.data();
    s.dst = recv.data();
    s.count = send.size();
    s.type = &detail::local_impl::type_tag<T>;
    s.op = int(op);
    g_->barrier("all_reduce", rank_);
    agree("all_reduce", same_everywhere<T>("count"));
    const int n = g_->n;
    auto [lo, hi] = detail::local_impl::share(send.size(), n, rank_, sizeof(T));
    std::vector<const T*> src(n);
    std::vector<T*> dst(n);
    for (int p = 0; p < n; ++p) {
      src[p] = static_cast<const T*>(g_->slots[p].src) + lo;
      dst[p] = static_cast<T*>(g_->slots[p].dst) + lo;
    }
    detail::reduce_into(src.data(), n, dst.data(), n, hi - lo, op);
    g_->barrier("all_reduce", rank_);
  }

  template <reducible T>
  void reduce_scatter_impl(std::span<const T> send, std::span<T> recv, reduce_op op) {
    check_reduce<T>(op, "dml::comm::local::reduce_scatter");
    const int n = g_->n;
    if (send.size() != recv.size() * n)
      fail<invalid_argument>("dml::comm::local::reduce_scatter: expected send of group size ", n,
                             " x recv size ", recv.size(), " = ", recv.size() * n,
                             " elements, found ", send.size());
    auto& s = publish("reduce_scatter");
    s.src = send.data();
    s.count = recv.size();
    s.type = &detail::local_impl::type_tag<T>;
    s.op = int(op);
    g_->barrier("reduce_scatter", rank_);
    agree("reduce_scatter", same_everywhere<T>("recv count"));
    const std::size_t m = recv.size();
    std::vector<const T*> src(n);
    for (int p = 0; p < n; ++p) src[p] = static_cast<const T*>(g_->slots[p].src) + m * rank_;
    T* dst[1] = {recv.data()};
    detail::reduce_into(src.data(), n, dst, 1, m, op);
    g_->barrier("reduce_scatter", rank_);
  }

  template <class T>
  void all_gather_impl(std::span<const T> send, std::span<T> recv) {
    const int n = g_->n;
    if (recv.size() != send.size() * n)
      fail<invalid_argument>("dml::comm::local::all_gather: expected recv of group size ", n,
                             " x send size ", send.size(), " = ", send.size() * n,
                             " elements, found ", recv.size());
    auto& s = publish("all_gather");
    s.src = send.data();
    s.count = send.size();
    s.type = &detail::local_impl::type_tag<T>;
    g_->barrier("all_gather", rank_);
    agree("all_gather", same_everywhere<T>("send count"));
    const std::size_t m = send.size();
    for (int p = 0; p < n; ++p) {
      const T* from = static_cast<const T*>(g_->slots[p].src);
      T* to = recv.data() + m * p;
      if (from != to && m) std::memcpy(to, from, m * sizeof(T));
    }
    g_->barrier("all_gather", rank_);
  }

  template <class T>
  void all_gatherv_impl(std::span<const T> send, std::span<T> recv, std::span<const std::size_t> counts) {
    const int n = g_->n;
    if (counts.size() != std::size_t(n))
      fail<invalid_argument>("dml::comm::local::all_gatherv: expected ", n, " counts, found ",
                             counts.size());
    if (send.size() != counts[rank_])
      fail<invalid_argument>("dml::comm::local::all_gatherv: expected send of counts[", rank_,
                             "] = ", counts[rank_], " elements, found ", send.size());
    const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t(0));
    if (recv.size() != total)
      fail<invalid_argument>("dml::comm::local::all_gatherv: expected recv of sum(counts) = ",
                             total, " elements, found ", recv.size());
    auto& s = publish("all_gatherv");
    s.src = send.data();
    s.counts = counts.data();
    s.type = &detail::local_impl::type_tag<T>;
    g_->barrier("all_gatherv", rank_);
    std::string err = same_everywhere<T>("", false);
    for (int p = 1; p < n && err.empty(); ++p)
      if (!std::equal(counts.begin(), counts.end(), g_->slots[p].counts))
        err = cat("expected the same counts on every rank; rank ", p, " differs from rank 0");
    agree("all_gatherv", err);
    std::size_t off = 0;
    for (int p = 0; p < n; ++p) {
      const T* from = static_cast<const T*>(g_->slots[p].src);
      if (from != recv.data() + off && counts[p])
        std::memcpy(recv.data() + off, from, counts[p] * sizeof(T));
      off += counts[p];
    }
    g_->barrier("all_gatherv", rank_);
  }

  template <class T>
  void broadcast_impl(std::span<T> data, int root) {
    check_root(root, "broadcast");
    auto& s = publish("broadcast");
    s.src = data.data();
    s.count = data.size();
    s.type = &detail::local_impl::type_tag<T>;
    s.root = root;
    g_->barrier("broadcast", rank_);
    agree("broadcast", same_everywhere<T>("count"));
    if (rank_ != root && !data.empty())
      std::memcpy(data.data(), g_->slots[root].src, data.size_bytes());
    g_->barrier("broadcast", rank_);
  }

  template <reducible T>
  void reduce_impl(std::span<const T> send, std::span<T> recv, reduce_op op, int root) {
    check_reduce<T>(op, "dml::comm::local::reduce");
    check_root(root, "reduce");
    if (rank_ == root && recv.size() != send.size())
      fail<invalid_argument>("dml::comm::local::reduce: expected recv of send's size ",
                             send.size(), " at the root, found ", recv.size());
    auto& s = publish("reduce");
    s.src = send.data();
    s.dst = recv.data();
    s.count = send.size();
    s.type = &detail::local_impl::type_tag<T>;
    s.op = int(op);
    s.root = root;
    g_->barrier("reduce", rank_);
    agree("reduce", same_everywhere<T>("count"));
    const int n = g_->n;
    auto [lo, hi] = detail::local_impl::share(send.size(), n, rank_, sizeof(T));
    std::vector<const T*> src(n);
    for (int p = 0; p < n; ++p) src[p] = static_cast<const T*>(g_->slots[p].src) + lo;
    T* dst[1] = {static_cast<T*>(g_->slots[root].dst) + lo};
    detail::reduce_into(src.data(), n, dst, 1, hi - lo, op);
    g_->barrier("reduce", rank_);
  }

  template <class T>
  void all_to_all_impl(std::span<const T> send, std::span<T> recv) {
    const int n = g_->n;
    if (send.size() % n != 0 || recv.size() != send.size())
      fail<invalid_argument>("dml::comm::local::all_to_all: expected send and recv of equal size "
                             "divisible by the group size ", n, ", found ", send.size(), " and ",
                             recv.size());
    // In place, peers would read blocks this rank is overwriting: they read a copy instead.
    std::vector<T> staged;
    if (!send.empty() && send.data() == recv.data()) {
      staged.assign(send.begin(), send.end());
      send = staged;
    }
    auto& s = publish("all_to_all");
    s.src = send.data();
    s.count = send.size();
    s.type = &detail::local_impl::type_tag<T>;
    g_->barrier("all_to_all", rank_);
    agree("all_to_all", same_everywhere<T>("count"));
    const std::size_t m = send.size() / n;
    for (int p = 0; p < n && m; ++p)
      std::memcpy(recv.data() + m * p, static_cast<const T*>(g_->slots[p].src) + m * rank_,
                  m * sizeof(T));
    g_->barrier("all_to_all", rank_);
  }

  template <class T>
  void all_to_allv_impl(std::span<const T> send, std::span<const std::size_t> send_counts,
                        std::span<T> recv, std::span<const std::size_t> recv_counts) {
    const int n = g_->n;
    if (send_counts.size() != std::size_t(n) || recv_counts.size() != std::size_t(n))
      fail<invalid_argument>("dml::comm::local::all_to_allv: expected ", n,
                             " send and receive counts, found ", send_counts.size(), " and ",
                             recv_counts.size());
    const auto sum = [](auto c) { return std::accumulate(c.begin(), c.end(), std::size_t(0)); };
    if (send.size() != sum(send_counts) || recv.size() != sum(recv_counts))
      fail<invalid_argument>("dml::comm::local::all_to_allv: expected send of ", sum(send_counts),
                             " and recv of ", sum(recv_counts), " elements, found ", send.size(),
                             " and ", recv.size());
    std::vector<T> staged;
    if (!send.empty() && send.data() == recv.data()) {
      staged.assign(send.begin(), send.end());
      send = staged;
    }
    auto& s = publish("all_to_allv");
    s.src = send.data();
    s.counts = send_counts.data();
    s.rcounts = recv_counts.data();
    s.type = &detail::local_impl::type_tag<T>;
    g_->barrier("all_to_allv", rank_);
    std::string err = same_everywhere<T>("", false);
    for (int p = 0; p < n && err.empty(); ++p)
      for (int q = 0; q < n && err.empty(); ++q)
        if (g_->slots[p].counts[q] != g_->slots[q].rcounts[p])
          err = cat("rank ", p, " sends ", g_->slots[p].counts[q], " elements to rank ", q,
                    ", which expects ", g_->slots[q].rcounts[p]);
    agree("all_to_allv", err);
    std::size_t off = 0;
    for (int p = 0; p < n; ++p) {
      const auto& sp = g_->slots[p];
      const std::size_t from = std::accumulate(sp.counts, sp.counts + rank_, std::size_t(0));
      if (recv_counts[p])
        std::memcpy(recv.data() + off, static_cast<const T*>(sp.src) + from, recv_counts[p] * sizeof(T));
      off += recv_counts[p];
    }
    g_->barrier("all_to_allv", rank_);
  }

  // Copies a message into a receive, or records why it does not fit; the caller then marks it done.
  static void deliver(detail::local_impl::posted_recv& p, const void* type, const void* bytes,
                      std::size_t n) {
    if (type != p.type || n != p.bytes)
      p.error = cat("dml::comm::local::recv: expected ", p.bytes, " bytes from rank ", p.src,
                    " with tag ", p.tag, ", the message has ", n, " bytes",
                    type != p.type ? " of another element type" : "");
    else if (n)
      std::memcpy(p.data, bytes, n);
  }

  // Takes the first receive the peer posted for (this rank, tag) off its list, under the lock.
  detail::local_impl::posted_recv* claim(int peer, int tag) {
    auto& posted = g_->posted[peer];
    auto it = std::find_if(posted.begin(), posted.end(),
                           [&](const auto* p) { return p->src == rank_ && p->tag == tag; });
    if (it == posted.end()) return nullptr;
    auto* p = *it;
    posted.erase(it);
    p->claimed = true;
    return p;
  }
  // Copies into a claimed receive without the lock, then marks it done under the lock.
  template <class T>
  void fill(detail::local_impl::posted_recv* p, const void* bytes, std::size_t n) {
    deliver(*p, &detail::local_impl::type_tag<T>, bytes, n);
    std::lock_guard lk(g_->m);
    p->done = true;
    g_->cv.notify_all();
  }

  // Copies go outside the group's lock, so one rank's large message does not stall the others' polls.
  template <class T>
  void send_impl(std::span<const T> data, int peer, int tag) {
    check_peer(peer, "send");
    const std::size_t n = data.size_bytes();
    {
      std::unique_lock lk(g_->m);
      if (g_->w->aborted.load()) g_->fail_aborted(lk, "send", rank_);
      if (auto* p = claim(peer, tag)) {
        lk.unlock();
        fill<T>(p, data.data(), n);
        return;
      }
    }
    detail::local_impl::message msg{rank_, tag, &detail::local_impl::type_tag<T>, nullptr, n, 0};
    if (n >= detail::local_impl::group::keep_from) {
      std::lock_guard lk(g_->m);
      auto& spare = g_->spare;
      auto it = std::find_if(spare.begin(), spare.end(), [&](const auto& b) { return b.capacity >= n; });
      if (it != spare.end()) {
        msg.data = std::move(it->data);
        msg.capacity = it->capacity;
        spare.erase(it);
      }
    }
    if (!msg.data) {
      msg.data.reset(new std::byte[n ? n : 1]);
      msg.capacity = n;
    }
    if (n) std::memcpy(msg.data.get(), data.data(), n);
    std::unique_lock lk(g_->m);
    if (g_->w->aborted.load()) g_->fail_aborted(lk, "send", rank_);
    if (auto* p = claim(peer, tag)) {  // posted while the copy was made
      lk.unlock();
      fill<T>(p, msg.data.get(), n);
      return;
    }
    g_->inbox[peer].push_back(std::move(msg));
    g_->cv.notify_all();
  }

  template <class... Args>
  static std::string cat(const Args&... args) {
    return dml::detail::cat(args...);
  }

  std::shared_ptr<detail::local_impl::group> g_;
  int rank_ = 0;
  std::unique_ptr<detail::local_impl::progress> progress_;
};

static_assert(diagnose_communicator<local>());

}  // namespace dml::comm
