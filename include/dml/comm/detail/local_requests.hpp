// SPDX-License-Identifier: Apache-2.0
// dml/comm/detail/local_requests.hpp — how comm::local runs non-blocking operations: the progress thread that
// runs a rank's collectives in order, and the request states that wait on a task or on a posted receive.
// Sits on comm/detail/local_group.hpp and core/algorithm.hpp; used by comm/local.hpp.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <utility>

#include "dml/comm/communicator.hpp"
#include "dml/comm/detail/local_group.hpp"
#include "dml/core/algorithm.hpp"
#include "dml/core/worker_thread.hpp"

namespace dml::comm {

namespace detail::local_impl {

// Runs a rank's non-blocking collectives in order on one thread, so they overlap the caller's
// work; a blocking call first waits for the queue (drain), keeping every rank's collectives in one order.
using progress = dml::detail::worker_thread;

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

// An issend whose message waits in the peer's inbox: done once the peer has received it (copied it out, or
// dropped the borrowed view of it).
struct ssend_request final : request_state {
  std::shared_ptr<group> g;
  int rank, peer;
  std::shared_ptr<ssend_state> s;
  ssend_request(std::shared_ptr<group> gr, int r, int to, std::shared_ptr<ssend_state> st)
      : g(std::move(gr)), rank(r), peer(to), s(std::move(st)) {}
  // Takes the message back if no receiver has it yet; under the lock.
  bool withdraw() {
    auto& box = g->inbox[peer];
    auto it = std::find_if(box.begin(), box.end(), [&](const message& m) { return m.sent == s; });
    if (it == box.end()) return false;
    box.erase(it);
    return true;
  }
  bool cancel() override {
    std::lock_guard lk(g->m);
    return !s->done && withdraw();
  }
  bool test() override {
    std::unique_lock lk(g->m);
    if (!s->done && g->w->aborted.load()) {
      if (!withdraw()) g->cv.wait(lk, [&] { return s->done; });  // a receiver holds it: until it lets go
      g->fail_aborted(lk, "issend", rank);
    }
    return s->done;
  }
  void wait() override {
    std::unique_lock lk(g->m);
    try {
      g->wait(lk, [&] { return s->done; }, "issend", rank);
    } catch (...) {
      if (!lk.owns_lock()) lk.lock();
      if (!withdraw()) g->cv.wait(lk, [&] { return s->done; });
      throw;
    }
  }
};

// A message received where it lies (comm::local::recv_borrowed): the sender's memory after an issend, or the
// queue's copy. Dropping it completes the sender's issend or keeps the copy's buffer for the next message.
class borrowed_message {
 public:
  borrowed_message(std::shared_ptr<group> g, message m) : g_(std::move(g)), m_(std::move(m)) {}
  borrowed_message(borrowed_message&&) noexcept = default;
  borrowed_message& operator=(borrowed_message&&) = delete;
  ~borrowed_message() {
    if (g_) g_->release(m_);
  }
  std::span<const std::byte> bytes() const { return {m_.bytes(), m_.size}; }

 private:
  std::shared_ptr<group> g_;
  message m_;
};

}  // namespace detail::local_impl

}  // namespace dml::comm
