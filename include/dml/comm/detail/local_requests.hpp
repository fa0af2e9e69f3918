// SPDX-License-Identifier: Apache-2.0
// dml/comm/detail/local_requests.hpp — how comm::local runs non-blocking operations: the progress thread that
// runs a rank's collectives in order, and the request states that wait on a task or on a posted receive.
// Sits on comm/detail/local_group.hpp and core/algorithm.hpp; used by comm/local.hpp.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
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

}  // namespace detail::local_impl

}  // namespace dml::comm
