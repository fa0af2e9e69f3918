// SPDX-License-Identifier: Apache-2.0
// dml/comm/detail/local_ops.hpp — how comm::local moves data: the bodies of its collectives (each rank reads its
// peers' published slots between two barriers) and of send, which copies into a posted receive or queues a copy.
// Sits on comm/local.hpp, which declares these members; used by comm/local.hpp, which includes it at its end (included
// alone, it includes comm/local.hpp first).
#pragma once

#include <algorithm>
#include <cstring>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "dml/comm/local.hpp"

namespace dml::comm {

template <reducible T>
void local::all_reduce_impl(std::span<const T> send, std::span<T> recv, reduce_op op) {
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
  if (n == 1) {  // the identity: no pass through the accumulator type (a bf16 round trip costs one)
    if (send.data() != recv.data()) std::memcpy(recv.data(), send.data(), send.size_bytes());
    return;
  }
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
void local::reduce_scatter_impl(std::span<const T> send, std::span<T> recv, reduce_op op) {
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
void local::all_gather_impl(std::span<const T> send, std::span<T> recv) {
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
void local::all_gatherv_impl(std::span<const T> send, std::span<T> recv, std::span<const std::size_t> counts) {
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
void local::broadcast_impl(std::span<T> data, int root) {
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
void local::reduce_impl(std::span<const T> send, std::span<T> recv, reduce_op op, int root) {
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
void local::all_to_all_impl(std::span<const T> send, std::span<T> recv) {
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
void local::all_to_allv_impl(std::span<const T> send, std::span<const std::size_t> send_counts,
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
inline void local::deliver(detail::local_impl::posted_recv& p, const void* type, const void* bytes,
                           std::size_t n) {
  if (type != p.type || n != p.bytes)
    p.error = cat("dml::comm::local::recv: expected ", p.bytes, " bytes from rank ", p.src,
                  " with tag ", p.tag, ", the message has ", n, " bytes",
                  type != p.type ? " of another element type" : "");
  else if (n)
    std::memcpy(p.data, bytes, n);
}

// Takes the first receive the peer posted for (this rank, tag) off its list, under the lock.
inline detail::local_impl::posted_recv* local::claim(int peer, int tag) {
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
void local::fill(detail::local_impl::posted_recv* p, const void* bytes, std::size_t n) {
  deliver(*p, &detail::local_impl::type_tag<T>, bytes, n);
  std::lock_guard lk(g_->m);
  p->done = true;
  g_->cv.notify_all();
}

// Copies go outside the group's lock, so one rank's large message does not stall the others' polls.
template <class T>
void local::send_impl(std::span<const T> data, int peer, int tag) {
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
  detail::local_impl::message msg{rank_, tag, &detail::local_impl::type_tag<T>, nullptr, n, 0, nullptr, nullptr};
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

template <class T>
request local::issend_impl(std::span<const T> data, int peer, int tag) {
  check_peer(peer, "issend");
  const std::size_t n = data.size_bytes();
  std::unique_lock lk(g_->m);
  if (g_->w->aborted.load()) g_->fail_aborted(lk, "issend", rank_);
  if (auto* p = claim(peer, tag)) {
    lk.unlock();
    fill<T>(p, data.data(), n);
    return request{};
  }
  auto sent = std::make_shared<detail::local_impl::ssend_state>();
  detail::local_impl::message msg{rank_, tag, &detail::local_impl::type_tag<T>, nullptr, n, 0, nullptr, nullptr};
  msg.ref = reinterpret_cast<const std::byte*>(data.data());
  msg.sent = sent;
  g_->inbox[peer].push_back(std::move(msg));
  g_->cv.notify_all();
  return request(std::make_unique<detail::local_impl::ssend_request>(g_, rank_, peer, std::move(sent)));
}

inline local::borrowed local::recv_borrowed(int peer, int tag) {
  check_peer(peer, "recv");
  std::unique_lock lk(g_->m);
  if (g_->w->aborted.load()) g_->fail_aborted(lk, "recv", rank_);
  auto& box = g_->inbox[rank_];
  auto match = [&] { return std::find_if(box.begin(), box.end(), [&](const auto& m) { return m.src == peer && m.tag == tag; }); };
  g_->wait(lk, [&] { return match() != box.end(); }, "recv", rank_);
  const auto it = match();
  const bool bytes = it->type == &detail::local_impl::type_tag<std::byte>;
  borrowed b(g_, std::move(*it));
  box.erase(it);
  lk.unlock();
  if (!bytes)
    fail<invalid_argument>("dml::comm::local::recv_borrowed: expected a message of bytes from rank ", peer, " with tag ",
                           tag, ", found one of another element type");
  return b;
}

}  // namespace dml::comm
