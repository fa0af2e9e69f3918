// SPDX-License-Identifier: Apache-2.0
// dml/parallel/events.hpp — the event log: when backward, bucket communication and pipeline compute began and ended,
// and, for a trace (trainer_options::trace), named slices on a compute and a communication track and counter samples.
// Sits on core/ and nn/rank_group.hpp; the sharding policies and the trainer record into it, tests and benchmarks
// read it, parallel/trace.hpp writes it.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dml/nn/rank_group.hpp"

namespace dml::parallel {

// What the event log records, in the order it happened on this rank. compute_begin/compute_end
// bracket every forward and backward action of a schedule (bucket: the action's index).
// norm_reduce: the one reduction of per-tensor sums a layer-wise optimizer's step takes under sharded state.
enum class event_kind {
  backward_begin, bucket_launch, backward_end, comm_done, step_end, compute_begin, compute_end, norm_reduce
};
struct event {
  event_kind kind;
  int bucket = -1;
  double t = 0;  // seconds since the log was made
};

// A trace's named interval on one of a rank's tracks, and a sample of one of its counters.
enum class track : std::uint8_t { compute, communication };
struct slice {
  std::string name;
  double begin = 0, end = 0;  // seconds since the log's start
  track on = track::compute;
  int micro = -1, chunk = -1;    // a schedule action's; -1: none
  std::int64_t bytes = -1;       // a transfer's or collective's payload; -1: none
  const char* group = nullptr;   // the group it ran over ("tp", "pp", "dp"); null: none
};
struct sample {
  const char* name;  // the counter ("memory allocated")
  double t = 0, value = 0;
};

// Records only when asked to (trainer_options::record_events; trace also keeps slices and samples), so an
// untraced step pays one branch per record. As a group observer it makes each call of a layer's group a slice.
class event_log final : public nn::group_observer {
 public:
  explicit event_log(bool on = false, bool tracing = false) : on_(on || tracing), tracing_(tracing) {}
  bool on() const { return on_; }
  bool tracing() const { return tracing_; }
  double now() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - born_).count(); }
  // Time zero again: every rank right after one collective, so that their traces line up. Before any record.
  void restart() { born_ = std::chrono::steady_clock::now(); }
  void operator()(event_kind k, int bucket = -1) {
    if (on_) events_.push_back({k, bucket, now()});
  }
  const std::vector<event>& events() const { return events_; }

  // Tracing only (the caller checks tracing(), so that an untraced run builds no slice).
  void add(slice s) { slices_.push_back(std::move(s)); }
  void count(const char* counter, double value) {
    if (tracing_) samples_.push_back({counter, now(), value});
  }
  const std::vector<slice>& slices() const { return slices_; }
  const std::vector<sample>& samples() const { return samples_; }
  void began(const char* group, nn::group_op op, std::int64_t bytes) override {
    open_ = {.name = nn::name(op), .begin = now(), .on = track::communication, .bytes = bytes, .group = group};
  }
  void ended() override {
    open_.end = now();
    slices_.push_back(open_);
  }

 private:
  bool on_, tracing_;
  std::vector<event> events_;
  std::vector<slice> slices_;
  std::vector<sample> samples_;
  slice open_;
  std::chrono::steady_clock::time_point born_ = std::chrono::steady_clock::now();
};

// Share of gradient communication that ran during backward, skipping the first `skip_steps` steps:
// each bucket's communication lasts from its launch to the first moment it was seen complete (polled
// after every layer's backward, so the estimate errs by at most one layer); what lasted past
// backward's end is exposed. Returns 1 − exposed / total, or −1 when the log has no communication.
inline double hidden_communication(std::span<const event> log, std::int64_t skip_steps = 0) {
  double total = 0, exposed = 0;
  std::int64_t steps = 0;
  double backward_end = 0;
  std::vector<double> launched;
  for (const auto& e : log) {
    if (e.kind == event_kind::step_end) ++steps;
    if (steps < skip_steps) continue;
    const auto b = static_cast<std::size_t>(e.bucket);
    switch (e.kind) {
      case event_kind::backward_begin: launched.clear(); break;
      case event_kind::bucket_launch:
        if (e.bucket >= 0) {
          launched.resize(std::max(launched.size(), b + 1), -1.0);
          launched[b] = e.t;
        }
        break;
      case event_kind::backward_end: backward_end = e.t; break;
      case event_kind::comm_done:
        if (e.bucket >= 0 && b < launched.size() && launched[b] >= 0) {
          total += e.t - launched[b];
          exposed += std::max(0.0, e.t - std::max(backward_end, launched[b]));
        }
        break;
      default: break;
    }
  }
  return total > 0 ? 1.0 - exposed / total : -1.0;
}

// Idle share of the steps on this rank: 1 − (time inside compute_begin/compute_end) / (step time),
// over the steps after the first `skip_steps` (a step runs from the previous step_end to its own, so
// the first step is never counted).
inline double bubble(std::span<const event> log, std::int64_t skip_steps = 1) {
  double busy = 0, span = 0, begin = -1, opened = 0;
  std::int64_t steps = 0;
  const auto counted = [&] { return begin >= 0 && steps >= skip_steps; };
  for (const auto& e : log) {
    if (e.kind == event_kind::compute_begin) {
      opened = e.t;
    } else if (e.kind == event_kind::compute_end) {
      if (counted()) busy += e.t - opened;
    } else if (e.kind == event_kind::step_end) {
      if (counted()) span += e.t - begin;
      ++steps;
      begin = e.t;
    }
  }
  return span > 0 ? 1.0 - busy / span : -1.0;
}

}  // namespace dml::parallel
