// SPDX-License-Identifier: Apache-2.0
// dml/comm/detail/gloo_impl.hpp — comm::gloo's parts: the shared state with its error latch, the rendezvous with a
// deadline, the prefix store of a split, the reduce functions Gloo calls, and the requests of isend/irecv.
// Sits on comm/communicator.hpp and comm/detail/reduce.hpp; used by comm/gloo.hpp.
#pragma once

#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <deque>
#include <cstdint>
#include <exception>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/comm/detail/reduce.hpp"

namespace dml::comm::detail::gloo_impl {

// A PrefixStore that keeps the store it prefixes alive (Gloo's holds a reference).
class owned_prefix_store final : public ::gloo::rendezvous::PrefixStore {
 public:
  owned_prefix_store(const std::string& prefix, std::shared_ptr<::gloo::rendezvous::Store> base)
      : PrefixStore(prefix, *base), base_(std::move(base)) {}

 private:
  std::shared_ptr<::gloo::rendezvous::Store> base_;
};

// The store as the rendezvous sees it: every get and wait ends at one deadline (Gloo's own gets wait 30 s, or not
// at all), and the key waited for last is kept, so that an error can name the rank that did not come.
class deadline_store final : public ::gloo::rendezvous::Store {
 public:
  deadline_store(::gloo::rendezvous::Store& inner, std::chrono::steady_clock::time_point deadline)
      : inner_(inner), deadline_(deadline) {}
  void set(const std::string& key, const std::vector<char>& data) override { inner_.set(key, data); }
  std::vector<char> get(const std::string& key) override {
    wait({key});
    return inner_.get(key);
  }
  void wait(const std::vector<std::string>& keys) override {
    using namespace std::chrono;
    const auto left = duration_cast<milliseconds>(deadline_ - steady_clock::now());
    wait(keys, std::max(left, milliseconds(1)));
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    waiting_ = keys.empty() ? std::string() : keys.front();
    inner_.wait(keys, timeout);
    waiting_.clear();
  }
  // "rank 2 (store key 'rank_2')", or "" when nothing was awaited.
  std::string waiting_for() const {
    if (waiting_.empty()) return {};
    const auto digits = waiting_.find_first_of("0123456789");
    const std::string r = digits == std::string::npos ? "?" : waiting_.substr(digits);
    return dml::detail::cat("rank ", r, " (store key '", waiting_, "')");
  }

 private:
  ::gloo::rendezvous::Store& inner_;
  std::chrono::steady_clock::time_point deadline_;
  std::string waiting_;
};

// Gloo's reduce function: c[i] = a[i] op b[i] (c may be a).
template <reducible T, class Op>
void reduce_fn(void* c, const void* a, const void* b, std::size_t n) {
  const T* src[2] = {static_cast<const T*>(a), static_cast<const T*>(b)};
  T* dst[1] = {static_cast<T*>(c)};
  reduce_into(src, 2, dst, 1, n, Op{}, 1);
}
template <reducible T>
void (*reduce_function(reduce_op op))(void*, const void*, const void*, std::size_t) {
  switch (op) {
    case reduce_op::max: return &reduce_fn<T, max_fn>;
    case reduce_op::min: return &reduce_fn<T, min_fn>;
    case reduce_op::prod: return &reduce_fn<T, prod_fn>;
    case reduce_op::sum:
    case reduce_op::avg: break;  // avg: sum, then divide
  }
  return &reduce_fn<T, sum_fn>;
}

// Point-to-point messages use slots of their own, apart from those of Gloo's collectives (prefixes 1 to 8 in the
// top byte): the tag is the low 32 bits.
inline std::uint64_t p2p_slot(int tag) { return (std::uint64_t(0x40) << 56) | std::uint32_t(tag); }
// The ring reduce-scatter's messages, one at a time per pair.
inline constexpr std::uint64_t ring_slot = std::uint64_t(0x41) << 56;

// What every copy of a communicator and every request of it share: the context and the latch.
struct state {
  std::shared_ptr<::gloo::rendezvous::Store> store;
  int rank, size;
  std::chrono::milliseconds timeout;  // gloo_options
  std::string hostname;
  std::shared_ptr<::gloo::Context> ctx;
  int splits = 0;  // split() calls so far: every rank counts the same

  state(std::shared_ptr<::gloo::rendezvous::Store> s, int r, int n, std::chrono::milliseconds t, std::string host)
      : store(std::move(s)), rank(r), size(n), timeout(t), hostname(std::move(host)) {}

  bool broken() const {
    std::lock_guard lk(m_);
    return !first_error_.empty();
  }

  // Runs f, Gloo's call; a Gloo error latches and becomes comm_error. Throws at once when already broken.
  template <class F>
  void guard(const char* op, F&& f) {
    {
      std::lock_guard lk(m_);
      if (!first_error_.empty())
        fail<comm_error>(where(op), "broken by an earlier error: ", first_error_);
    }
    try {
      f();
    } catch (const dml::error&) {
      throw;
    } catch (const std::exception& e) {
      latch(op, e.what());
    }
  }
  [[noreturn]] void latch(const char* op, const std::string& what) {
    const std::string msg = dml::detail::cat(where(op), what);
    {
      std::lock_guard lk(m_);
      if (first_error_.empty()) first_error_ = msg;
    }
    throw comm_error(msg);
  }
  std::string where(const char* op) const {
    return dml::detail::cat("dml::comm::gloo::", op, ": rank ", rank, " of ", size, ": ");
  }

  // The rendezvous: every rank sets its address in the store and connects to every other, by the deadline.
  void connect();

  // Messages to this rank itself (Gloo has no pair to self): a send is copied here and completes at once; a
  // receive takes the oldest message of its tag, waiting for it until the deadline.
  void send_self(const char* p, std::size_t n, int tag) {
    {
      std::lock_guard lk(m_);
      self_box_[tag].emplace_back(p, p + n);
    }
    self_cv_.notify_all();
  }
  // False when no message has come yet; waits for one up to `wait`.
  bool recv_self(char* p, std::size_t n, int tag, std::chrono::milliseconds wait) {
    std::unique_lock lk(m_);
    auto& q = self_box_[tag];
    if (!self_cv_.wait_for(lk, wait, [&] { return !q.empty(); })) return false;
    if (q.front().size() != n)
      fail<invalid_argument>("dml::comm::gloo::recv: expected ", n, " bytes from rank ", rank, " (itself) with tag ",
                             tag, ", the message has ", q.front().size());
    if (n) std::memcpy(p, q.front().data(), n);
    q.pop_front();
    return true;
  }

 private:
  mutable std::mutex m_;
  std::string first_error_;
  std::condition_variable self_cv_;
  std::map<int, std::deque<std::vector<char>>> self_box_;
};

// A receive from this rank itself.
struct self_request final : request_state {
  std::shared_ptr<state> s;
  char* p;
  std::size_t n;
  int tag;
  self_request(std::shared_ptr<state> st, char* ptr, std::size_t bytes, int t)
      : s(std::move(st)), p(ptr), n(bytes), tag(t) {}
  bool test() override { return s->recv_self(p, n, tag, std::chrono::milliseconds(0)); }
  void wait() override {
    if (!s->recv_self(p, n, tag, s->timeout))
      s->latch("recv", dml::detail::cat("no message from this rank itself with tag ", tag, " within ",
                                        s->timeout.count(), " ms"));
  }
  bool cancel() override { return true; }  // nothing was posted anywhere
};

inline void state::connect() {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  deadline_store meet(*store, deadline);
  try {
    ::gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    auto device = ::gloo::transport::tcp::CreateDevice(attr);
    auto c = std::make_shared<::gloo::rendezvous::Context>(rank, size);
    c->setTimeout(timeout);
    c->connectFullMesh(meet, device);
    ctx = std::move(c);
  } catch (const std::exception& e) {
    const std::string who = meet.waiting_for();
    fail<comm_error>(where("rendezvous"), "no connection within ", timeout.count(), " ms",
                     who.empty() ? std::string() : dml::detail::cat(" (waited for ", who, ")"), ": ", e.what());
  }
}

// isend/irecv: the buffer is posted at the call; a thread waits for it with the deadline, so that test() can
// look without blocking.
struct p2p_request final : request_state {
  std::shared_ptr<state> s;
  std::unique_ptr<::gloo::transport::UnboundBuffer> buf;
  std::future<void> done;  // after buf: joined before buf goes

  bool test() override {
    if (done.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
    done.get();
    return true;
  }
  void wait() override { done.get(); }
};

inline std::unique_ptr<request_state> post(const std::shared_ptr<state>& s, char* p, std::size_t n, int peer, int tag,
                                           bool receive) {
  const char* op = receive ? "irecv" : "isend";
  if (peer == s->rank) {
    std::unique_ptr<request_state> self;
    s->guard(op, [&] {
      if (receive) self = std::make_unique<self_request>(s, p, n, tag);
      else s->send_self(p, n, tag);
    });
    return self;
  }
  auto r = std::make_unique<p2p_request>();
  r->s = s;
  s->guard(op, [&] {
    r->buf = s->ctx->createUnboundBuffer(p, n);
    if (receive) r->buf->recv(peer, p2p_slot(tag));
    else r->buf->send(peer, p2p_slot(tag));
  });
  r->done = std::async(std::launch::async, [s, b = r->buf.get(), op, receive] {
    s->guard(op, [&] {
      if (receive) b->waitRecv(s->timeout);
      else b->waitSend(s->timeout);
    });
  });
  return r;
}

}  // namespace dml::comm::detail::gloo_impl
