// SPDX-License-Identifier: Apache-2.0
// dml/comm/local.hpp — communicator whose ranks are threads of one process.
// Sits on comm/communicator.hpp and core/; the default for tests, examples and one-machine runs.
// Its parts, in comm/detail/: local_group.hpp (what a group's ranks share), local_requests.hpp (the progress
// thread, requests) and local_ops.hpp (the bodies of the collectives and of send).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/comm/detail/local_group.hpp"
#include "dml/comm/detail/local_requests.hpp"
#include "dml/comm/detail/reduce.hpp"
#include "dml/core/algorithm.hpp"

namespace dml::comm {

// Outside the class so that `options opt = {}` works as a default argument inside it.
struct local_options {
  // Every wait (barrier, receive) fails with comm_error after this long.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

class local {
 public:
  using options = local_options;
  using space = dml::host;  // the memory it moves (comm/communicator.hpp)

  // Runs n ranks, rank 0 on the calling thread and the others on threads of their own, calls fn(local&) on each
  // and joins them. If any fn throws, every other rank's pending or next operation throws comm_error, and run
  // rethrows the first error.
  template <class F>
    requires std::invocable<F&, local&>
  static void run(int n, F&& fn, options opt = {}) {
    if (n < 1) fail<invalid_argument>("dml::comm::local::run: expected at least 1 rank, found ", n);
    auto w = std::make_shared<detail::local_impl::world>(opt.timeout);
    auto g = detail::local_impl::group::make(n, w);
    std::mutex em;
    std::exception_ptr first;
    const int budget = thread_budget(n);
    auto rank = [&](int r) {
      const thread_budget_scope scope(budget);
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
    };
    // Rank 0 runs on the calling thread. OpenMP (libgomp) keeps a team of idle threads for each thread that has
    // run a parallel region; once the process holds more of them than there are cores, every team's threads sleep
    // between regions instead of spinning, and each region waits for them to wake. A caller that had run one (a
    // calibration, a data loader) beside one rank thread of its own made that rank's small products 1.8x slower.
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(n - 1));
    for (int r = 1; r < n; ++r) threads.emplace_back(rank, r);
    rank(0);
    for (auto& t : threads) t.join();
    if (first) std::rethrow_exception(first);
  }

  // The threads each of n ranks gets for its own work (set_thread_budget): the host's share, at least one.
  static int thread_budget(int n) { return std::max(1, int(std::thread::hardware_concurrency()) / std::max(n, 1)); }

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
  // A synchronous send (MPI_Issend): nothing is copied until the receive, which reads the caller's memory,
  // so data must stay unchanged until the request completes, once the peer has received the message.
  // Waiting on it before the peer posts its receive waits for the peer: send, not issend, where that matters.
  template <transferable T>
  request issend(std::span<const T> data, int peer, int tag) {
    return issend_impl<T>(data, peer, tag);
  }

  // A blocking receive of bytes that copies nothing: the message stays where it lies (the sender's memory
  // after an issend) until the returned view is dropped, which completes the sender's issend. Waits, as recv
  // does, until the message arrives, the group is aborted or the timeout passes.
  using borrowed = detail::local_impl::borrowed_message;
  borrowed recv_borrowed(int peer, int tag);

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
      deliver(*p, queued->type, queued->bytes(), queued->size);
      p->done = true;
      g_->release(*queued);
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
    // By key, ties by rank (what stable_sort gave: libstdc++ 12's warns under clang 18 and later).
    std::sort(members.begin(), members.end(), [&](int a, int b) {
      return std::pair(g_->slots[a].key, a) < std::pair(g_->slots[b].key, b);
    });
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

  // The bodies of the collectives and of send: comm/detail/local_ops.hpp.
  template <reducible T>
  void all_reduce_impl(std::span<const T> send, std::span<T> recv, reduce_op op);
  template <reducible T>
  void reduce_scatter_impl(std::span<const T> send, std::span<T> recv, reduce_op op);
  template <class T>
  void all_gather_impl(std::span<const T> send, std::span<T> recv);
  template <class T>
  void all_gatherv_impl(std::span<const T> send, std::span<T> recv, std::span<const std::size_t> counts);
  template <class T>
  void broadcast_impl(std::span<T> data, int root);
  template <reducible T>
  void reduce_impl(std::span<const T> send, std::span<T> recv, reduce_op op, int root);
  template <class T>
  void all_to_all_impl(std::span<const T> send, std::span<T> recv);
  template <class T>
  void all_to_allv_impl(std::span<const T> send, std::span<const std::size_t> send_counts,
                        std::span<T> recv, std::span<const std::size_t> recv_counts);
  static void deliver(detail::local_impl::posted_recv& p, const void* type, const void* bytes, std::size_t n);
  detail::local_impl::posted_recv* claim(int peer, int tag);
  template <class T>
  void fill(detail::local_impl::posted_recv* p, const void* bytes, std::size_t n);
  template <class T>
  void send_impl(std::span<const T> data, int peer, int tag);
  template <class T>
  request issend_impl(std::span<const T> data, int peer, int tag);

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

// The members declared above and defined out of the class.
#include "dml/comm/detail/local_ops.hpp"
