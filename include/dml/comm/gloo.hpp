// SPDX-License-Identifier: Apache-2.0
// dml/comm/gloo.hpp — communicator over Gloo's TCP transport: one rank per process (or thread), met through a
// rendezvous store, with a deadline on every operation and errors that latch.
// Sits on comm/communicator.hpp; how dml runs ranks without mpirun, and survives a lost rank by building a new
// communicator with the survivors. See DESIGN.md §4. Its helpers are in comm/detail/gloo_impl.hpp.
#pragma once

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/reduce.h>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/comm/detail/checks.hpp"
#include "dml/comm/detail/gloo_impl.hpp"
#include "dml/comm/detail/reduce.hpp"

namespace dml::comm {

// Outside the class so that `options opt = {}` works as a default argument inside it.
struct gloo_options {
  // The deadline of the rendezvous and of every operation: past it the operation throws comm_error and the
  // communicator is broken.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // The interface the TCP transport binds to (a host name or address); loopback by default.
  std::string hostname = "127.0.0.1";
};

// Failure semantics: any error of Gloo (a peer that closed its connection, a deadline passed, a broken
// invariant) becomes a comm_error naming the operation, this rank, the size and Gloo's message; from then on the
// communicator is broken() and every operation throws comm_error at once. Recovery builds a new communicator
// (over a PrefixStore of a fresh prefix) with the ranks that are left.
//
// Gloo's TCP transport writes to its sockets without MSG_NOSIGNAL: a write to a peer that died would raise SIGPIPE
// and end this process. The first communicator therefore ignores SIGPIPE when its disposition is still the default
// (the write then fails with EPIPE, a comm_error); a handler the program installed is left alone.
//
// Blocking: iall_reduce, ireduce_scatter, iall_gather and ibroadcast run at the call and return a completed
// request. isend and irecv are truly non-blocking: they post an unbound buffer, and a thread of their own waits for
// it with the deadline; a rank may post a receive and a send in either order. Gloo cannot withdraw a posted
// receive, so request::cancel() waits (an unmatched receive breaks the communicator at the deadline).
//
// The class shares its name with Gloo's namespace: inside dml::comm, or after `using dml::comm::gloo`, write Gloo's
// as ::gloo.
class gloo {
 public:
  using space = dml::host;
  using options = gloo_options;
  using store_ptr = std::shared_ptr<::gloo::rendezvous::Store>;

  // Collective over the size ranks that use this store: each sets its address in it and connects to every other
  // rank. A rank that does not join within options::timeout makes the others throw comm_error naming what they
  // waited for. The store's keys are those of one world: a new world over the same store takes a PrefixStore.
  gloo(store_ptr store, int rank, int size, options opt = {}) {
    if (!store) fail<invalid_argument>("dml::comm::gloo: expected a store, found none");
    if (size < 1 || rank < 0 || rank >= size)
      fail<invalid_argument>("dml::comm::gloo: expected 0 <= rank < size, found rank ", rank, " and size ", size);
    if (opt.timeout.count() <= 0)
      fail<invalid_argument>("dml::comm::gloo: expected a timeout > 0 ms, found ", opt.timeout.count());
    ignore_sigpipe();
    s_ = std::make_shared<detail::gloo_impl::state>(std::move(store), rank, size, opt.timeout,
                                                   std::move(opt.hostname));
    s_->connect();
  }

  int rank() const noexcept { return s_->rank; }
  int size() const noexcept { return s_->size; }
  // True after an operation failed: every later one throws comm_error.
  bool broken() const { return s_->broken(); }
  options opts() const { return {s_->timeout, s_->hostname}; }
  const std::shared_ptr<::gloo::Context>& native() const noexcept { return s_->ctx; }

  // ---- all_reduce (in place when send and recv are the same memory)
  template <reducible T>
  void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    checks().all_reduce<T>(send, recv, op);
    s_->guard("all_reduce", [&] {
      if (recv.empty()) return;
      ::gloo::AllreduceOptions o(s_->ctx);
      if (send.data() != recv.data()) o.setInput(const_cast<T*>(send.data()), send.size());
      o.setOutput(recv.data(), recv.size());
      o.setReduceFunction(detail::gloo_impl::reduce_function<T>(op));
      o.setTimeout(s_->timeout);
      ::gloo::allreduce(o);
    });
    if (op == reduce_op::avg) detail::divide(recv, size());
  }
  template <reducible T>
  void all_reduce(std::span<T> data, reduce_op op) {
    all_reduce(std::span<const T>(data), data, op);
  }
  // Runs at the call; the request is complete.
  template <reducible T>
  request iall_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    all_reduce(send, recv, op);
    return {};
  }
  template <reducible T>
  request iall_reduce(std::span<T> data, reduce_op op) {
    all_reduce(data, op);
    return {};
  }

  // ---- reduce_scatter: send holds size() blocks of recv's size.
  template <reducible T>
  void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    checks().reduce_scatter<T>(send, recv, op);
    ring_reduce_scatter(send, recv, op);
  }
  // In place: the result lands in block rank() of data (returned); other blocks are left with unspecified values.
  template <reducible T>
  std::span<T> reduce_scatter(std::span<T> data, reduce_op op) {
    const auto mine = checks().own_block(data, "reduce_scatter");
    checks().reduce_scatter<T>(std::span<const T>(data), mine, op);
    ring_reduce_scatter(std::span<const T>(data), mine, op);
    return mine;
  }
  // Runs at the call; the request is complete.
  template <reducible T>
  request ireduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    reduce_scatter(send, recv, op);
    return {};
  }

  // ---- all_gather: recv holds size() blocks of send's size.
  template <transferable T>
  void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    checks().all_gather(send, recv);
    s_->guard("all_gather", [&] {
      if (recv.empty()) return;
      ::gloo::AllgatherOptions o(s_->ctx);
      if (send.data() != recv.data() + send.size() * rank())
        o.setInput(bytes(send.data()), send.size_bytes());
      o.setOutput(bytes(recv.data()), recv.size_bytes());
      o.setTimeout(s_->timeout);
      ::gloo::allgather(o);
    });
  }
  template <transferable T>
  void all_gather(std::span<T> data) {
    auto mine = checks().own_block(data, "all_gather");
    all_gather(std::span<const T>(mine), data);
  }
  // Runs at the call; the request is complete.
  template <transferable T>
  request iall_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    all_gather(send, recv);
    return {};
  }
  template <transferable T>
  void all_gatherv(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                   std::span<const std::size_t> counts) {
    const auto off = checks().all_gatherv(send, recv, counts);
    s_->guard("all_gatherv", [&] {
      if (recv.empty()) return;
      std::vector<std::size_t> n(counts.begin(), counts.end());
      for (auto& c : n) c *= sizeof(T);
      ::gloo::AllgathervOptions o(s_->ctx);
      if (send.data() != recv.data() + off[rank()]) o.setInput(bytes(send.data()), send.size_bytes());
      o.setOutput(bytes(recv.data()), std::move(n));
      o.setTimeout(s_->timeout);
      ::gloo::allgatherv(o);
    });
  }

  // ---- broadcast
  template <transferable T>
  void broadcast(std::span<T> data, int root) {
    checks().rank_in_range(root, "broadcast", "root");
    s_->guard("broadcast", [&] {
      if (data.empty()) return;
      ::gloo::BroadcastOptions o(s_->ctx);
      o.setOutput(bytes(data.data()), data.size_bytes());
      o.setRoot(root);
      o.setTimeout(s_->timeout);
      ::gloo::broadcast(o);
    });
  }
  // Runs at the call; the request is complete.
  template <transferable T>
  request ibroadcast(std::span<T> data, int root) {
    broadcast(data, root);
    return {};
  }

  // ---- reduce to root (recv is read at the root only)
  template <reducible T>
  void reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op, int root) {
    checks().reduce<T>(send, recv, op, root);
    s_->guard("reduce", [&] {
      if (send.empty()) return;
      std::vector<T> scratch(rank() == root ? 0 : send.size());  // Gloo writes the output on every rank
      T* out = rank() == root ? recv.data() : scratch.data();
      ::gloo::ReduceOptions o(s_->ctx);
      if (send.data() != out) o.setInput(const_cast<T*>(send.data()), send.size());
      o.setOutput(out, send.size());
      o.setRoot(root);
      o.setReduceFunction(detail::gloo_impl::reduce_function<T>(op));
      o.setTimeout(s_->timeout);
      ::gloo::reduce(o);
    });
    if (op == reduce_op::avg && rank() == root) detail::divide(recv, size());
  }
  template <reducible T>
  void reduce(std::span<T> data, reduce_op op, int root) {
    reduce(std::span<const T>(data), rank() == root ? data : std::span<T>{}, op, root);
  }

  // ---- all_to_all: block p of send to rank p, block p of recv from rank p.
  template <transferable T>
  void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    checks().all_to_all(send, recv);
    s_->guard("all_to_all", [&] {
      if (recv.empty()) return;
      std::vector<T> copy;  // Gloo reads send while it writes recv
      if (send.data() == recv.data()) copy.assign(send.begin(), send.end()), send = copy;
      ::gloo::AlltoallOptions o(s_->ctx);
      o.setInput(bytes(send.data()), send.size_bytes());
      o.setOutput(bytes(recv.data()), recv.size_bytes());
      o.setTimeout(s_->timeout);
      ::gloo::alltoall(o);
    });
  }
  template <transferable T>
  void all_to_allv(std::span<const std::type_identity_t<T>> send, std::span<const std::size_t> send_counts,
                   std::span<T> recv, std::span<const std::size_t> recv_counts) {
    checks().all_to_allv(send, send_counts, recv, recv_counts);
    s_->guard("all_to_allv", [&] {
      std::vector<T> copy;
      if (!send.empty() && send.data() == recv.data()) copy.assign(send.begin(), send.end()), send = copy;
      std::vector<std::int64_t> sc(send_counts.begin(), send_counts.end()), rc(recv_counts.begin(), recv_counts.end());
      for (auto& c : sc) c *= sizeof(T);
      for (auto& c : rc) c *= sizeof(T);
      char dummy = 0;  // Gloo wants a buffer even when this rank moves nothing
      ::gloo::AlltoallvOptions o(s_->ctx);
      o.setInput(send.empty() ? &dummy : bytes(send.data()), std::move(sc));
      o.setOutput(recv.empty() ? &dummy : bytes(recv.data()), std::move(rc));
      o.setTimeout(s_->timeout);
      ::gloo::alltoallv(o);
    });
  }

  // ---- point to point: the tag picks Gloo's slot; messages on one (peer, tag) arrive in the order sent, and a
  // receive must name the size that was sent.
  template <transferable T>
  void send(std::span<const T> data, int peer, int tag) {
    checks().rank_in_range(peer, "send", "peer");
    s_->guard("send", [&] {
      if (peer == rank()) return s_->send_self(bytes(data.data()), data.size_bytes(), tag);
      auto buf = s_->ctx->createUnboundBuffer(bytes(data.data()), data.size_bytes());
      buf->send(peer, detail::gloo_impl::p2p_slot(tag));
      buf->waitSend(s_->timeout);
    });
  }
  template <transferable T>
  void send(std::span<T> data, int peer, int tag) {
    send(std::span<const T>(data), peer, tag);
  }
  template <transferable T>
  request isend(std::span<const T> data, int peer, int tag) {
    checks().rank_in_range(peer, "send", "peer");
    return post(bytes(data.data()), data.size_bytes(), peer, tag, false);
  }
  template <transferable T>
  request isend(std::span<T> data, int peer, int tag) {
    return isend(std::span<const T>(data), peer, tag);
  }
  template <transferable T>
  void recv(std::span<T> data, int peer, int tag) {
    checks().rank_in_range(peer, "recv", "peer");
    if (peer == rank()) return post(bytes(data.data()), data.size_bytes(), peer, tag, true).wait();
    s_->guard("recv", [&] {
      auto buf = s_->ctx->createUnboundBuffer(bytes(data.data()), data.size_bytes());
      buf->recv(peer, detail::gloo_impl::p2p_slot(tag));
      buf->waitRecv(s_->timeout);
    });
  }
  template <transferable T>
  request irecv(std::span<T> data, int peer, int tag) {
    checks().rank_in_range(peer, "recv", "peer");
    return post(bytes(data.data()), data.size_bytes(), peer, tag, true);
  }

  void barrier() {
    s_->guard("barrier", [&] {
      ::gloo::BarrierOptions o(s_->ctx);
      o.setTimeout(s_->timeout);
      ::gloo::barrier(o);
    });
  }

  // Ranks with the same color form a group, ordered by (key, rank). Collective. The group meets in the store
  // under a prefix made of this communicator's split count and the color, so splits never collide.
  gloo split(int color, int key) const {
    if (color < 0) fail<invalid_argument>("dml::comm::gloo::split: expected a color >= 0, found ", color);
    const std::int64_t mine[2] = {color, key};
    std::vector<std::int64_t> all(2 * std::size_t(size()));
    s_->guard("split", [&] {
      ::gloo::AllgatherOptions o(s_->ctx);
      o.setInput(const_cast<std::int64_t*>(mine), 2);
      o.setOutput(all.data(), all.size());
      o.setTimeout(s_->timeout);
      ::gloo::allgather(o);
    });
    std::vector<std::pair<std::int64_t, int>> members;  // (key, rank) of my color
    for (int p = 0; p < size(); ++p)
      if (all[2 * p] == color) members.emplace_back(all[2 * p + 1], p);
    std::sort(members.begin(), members.end());
    const int me = int(std::find(members.begin(), members.end(), std::pair{std::int64_t(key), rank()}) -
                       members.begin());
    auto store = std::make_shared<detail::gloo_impl::owned_prefix_store>(
        dml::detail::cat("split-", s_->splits++, "-", color), s_->store);
    return gloo(std::move(store), me, int(members.size()), opts());
  }

 private:
  static void ignore_sigpipe() {
    struct sigaction now {};
    if (::sigaction(SIGPIPE, nullptr, &now) == 0 && now.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
  }

  // Ring reduce-scatter (Gloo has no new-style one): at step k rank r sends its partial sum of block r - 1 - k to
  // the next rank and adds its own part of block r - 2 - k to what the previous rank sent; after size() - 1 steps
  // block r is complete. recv may be block rank() of send.
  template <reducible T>
  void ring_reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
    const int n = size(), r = rank();
    const std::size_t m = recv.size();
    s_->guard("reduce_scatter", [&] {
      if (m == 0) return;
      if (n == 1) return void(std::copy_n(send.begin(), m, recv.begin()));
      const auto fn = detail::gloo_impl::reduce_function<T>(op);
      const auto slot = detail::gloo_impl::ring_slot;
      std::vector<T> a(m), b(m);
      auto whole = s_->ctx->createUnboundBuffer(bytes(send.data()), send.size_bytes());
      auto ua = s_->ctx->createUnboundBuffer(a.data(), m * sizeof(T));
      auto ub = s_->ctx->createUnboundBuffer(b.data(), m * sizeof(T));
      auto* out = ua.get();  // the partial sum sent next
      auto* in = ub.get();
      const auto block = [&](int k) { return std::size_t((k % n + n) % n) * m; };
      for (int k = 0; k < n - 1; ++k) {
        in->recv((r + n - 1) % n, slot);
        if (k == 0) whole->send((r + 1) % n, slot, block(r - 1) * sizeof(T), m * sizeof(T));
        else out->send((r + 1) % n, slot);
        in->waitRecv(s_->timeout);
        if (k == 0) whole->waitSend(s_->timeout);
        else out->waitSend(s_->timeout);
        T* sum = k == n - 2 ? recv.data() : static_cast<T*>(in->ptr);
        fn(sum, in->ptr, send.data() + block(r - 2 - k), m);
        std::swap(in, out);
      }
    });
    if (op == reduce_op::avg) detail::divide(recv, size());
  }

  detail::arg_checks checks() const { return {"dml::comm::gloo", rank(), size()}; }
  template <class T>
  static char* bytes(const T* p) {
    return reinterpret_cast<char*>(const_cast<std::remove_const_t<T>*>(p));
  }
  request post(char* p, std::size_t n, int peer, int tag, bool receive) {
    return request(detail::gloo_impl::post(s_, p, n, peer, tag, receive));
  }

  std::shared_ptr<detail::gloo_impl::state> s_;
};

static_assert(diagnose_communicator<gloo>());

}  // namespace dml::comm
