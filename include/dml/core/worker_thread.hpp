// SPDX-License-Identifier: Apache-2.0
// dml/core/worker_thread.hpp — one thread that runs the jobs given to it in order: comm::local's non-blocking
// collectives and the offloaded optimizer state's file reads and writes (parallel/offload.hpp).
// Sits on core/algorithm.hpp.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "dml/core/algorithm.hpp"

namespace dml::detail {

// Jobs run one at a time in the order pushed, overlapping the caller's work; a job catches its own errors.
// push() returns the job's ticket: wait(ticket) returns once that job and all before it have run.
class worker_thread {
 public:
  worker_thread() : thread_([this] { loop(); }) {}
  worker_thread(const worker_thread&) = delete;
  worker_thread& operator=(const worker_thread&) = delete;
  ~worker_thread() {
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  std::int64_t push(std::function<void()> f) {
    std::int64_t ticket = 0;
    {
      std::lock_guard lk(m_);
      queue_.push_back(std::move(f));
      ticket = ++pushed_;
    }
    cv_.notify_all();
    return ticket;
  }
  void wait(std::int64_t ticket) {
    std::unique_lock lk(m_);
    cv_.wait(lk, [&] { return done_ >= ticket; });
  }
  void drain() {
    std::unique_lock lk(m_);
    cv_.wait(lk, [&] { return done_ == pushed_; });
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
      lk.unlock();
      f();
      lk.lock();
      ++done_;
      cv_.notify_all();
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::int64_t pushed_ = 0, done_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dml::detail
