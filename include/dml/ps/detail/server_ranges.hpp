// SPDX-License-Identifier: Apache-2.0
// dml/ps/detail/server_ranges.hpp — what one parameter server holds: its key ranges' values and optimizer state,
// the vector clocks of pushes applied, bsp steps waiting for pushes, and the workers' membership they count.
// Sits on ps/transport.hpp (options, placement) and optim/adagrad.hpp; ps/server.hpp's request loop calls in.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <span>
#include <vector>

#include "dml/comm/detail/filter_wire.hpp"
#include "dml/core/algorithm.hpp"
#include "dml/optim/adagrad.hpp"
#include "dml/ps/transport.hpp"

namespace dml::ps::detail {

// An entry's values as they lie in a message, 4 bytes each at any address (or a decoded float span's bytes):
// the servers apply dense pushes from the payload itself, with no copy first.
struct wire_floats {
  const std::byte* p = nullptr;
  std::size_t n = 0;
  wire_floats() = default;
  explicit wire_floats(std::span<const std::byte> b) : p(b.data()), n(b.size() / sizeof(float)) {}
  explicit wire_floats(std::span<const float> v) : wire_floats(std::as_bytes(v)) {}
  std::size_t size() const { return n; }
  float operator[](std::size_t i) const { return comm::detail::wire_get<float>(p + sizeof(float) * i); }
  void copy_to(float* d, std::size_t from, std::size_t count) const {
    if (count) std::memcpy(d, p + sizeof(float) * from, sizeof(float) * count);
  }
};

// One key range, held here as primary or replica (or not held).
struct range_state {
  bool held = false, initialised = false;
  std::vector<float> value, accum;
  std::vector<std::int64_t> clock;                  // per worker: pushes applied
  std::vector<std::vector<std::uint64_t>> applied;  // per worker: push sequence numbers received, ascending
  std::map<std::int64_t, std::map<int, std::vector<float>>> pending;  // bsp: step -> worker -> gradient
  std::vector<std::vector<float>> view;             // per worker: what its copy holds (pull filters)
  std::int64_t max_lead = 0;
};

// The state of every key range of the table (those this server holds sized, the others empty) and which
// workers have died or left: the consistency rules wait for live workers only.
class server_ranges {
 public:
  server_ranges(const placement& place, const options& o, int me, int workers)
      : workers_(workers), staleness_(o.staleness), optimizer_(o.optimizer), dead_(workers, false),
        left_(workers, false) {
    const auto ranges = place.table.ranges();
    state_.resize(ranges.size());
    for (std::size_t r = 0; r < ranges.size(); ++r) {
      const auto& ch = place.chains[r];
      if (std::ranges::find(ch, me) == ch.end()) continue;
      auto& s = state_[r];
      s.held = true;
      s.value.assign(std::size_t(ranges[r].length), 0.f);
      if (optimizer_.kind == server_optimizer::adagrad)
        s.accum.assign(std::size_t(ranges[r].length), optimizer_.initial_accumulator);
      s.clock.assign(std::size_t(workers_), 0);
      s.applied.resize(std::size_t(workers_));
      s.view.resize(std::size_t(workers_));
    }
  }

  std::size_t size() const { return state_.size(); }
  range_state& operator[](std::uint32_t r) { return state_[r]; }
  const range_state& operator[](std::uint32_t r) const { return state_[r]; }

  bool dead(int w) const { return dead_[w]; }
  bool left(int w) const { return left_[w]; }
  bool live(int w) const { return !dead_[w] && !left_[w]; }
  // Membership changes; complete_steps() then applies the bsp steps that waited only for that worker.
  void set_dead(int w) { dead_[w] = true; }
  void set_left(int w) { left_[w] = true; }
  // The most pushes any worker has had applied to any range here.
  std::int64_t max_clock() const { return max_clock_; }

  // One decoded entry of worker w's push `seq` to range r: initial values (kind 1; the first to arrive wins) or a
  // gradient (kind 0), applied at once, or under bsp once every live worker's push of that step is in. A retry of
  // a push already applied changes nothing.
  void apply(std::uint32_t r, std::uint8_t kind, int w, std::uint64_t seq, wire_floats g) {
    auto& s = state_[r];
    if (kind == 1) {
      if (!s.initialised) assign(s.value, g);
      s.initialised = true;
      return;
    }
    auto& seen = s.applied[std::size_t(w)];
    auto pos = std::ranges::lower_bound(seen, seq);
    if (pos != seen.end() && *pos == seq) return;  // a retry of what this server already has
    seen.insert(pos, seq);
    if (staleness_ == 0) {
      assign(s.pending[std::int64_t(seq)][w], g);
      complete_steps(s);
    } else {
      step(s, g);
      ++s.clock[std::size_t(w)];
      note_clock(s);
    }
  }

  // After a worker died or left: the bsp steps that waited only for it.
  void complete_steps() {
    for (auto& s : state_)
      if (s.held) {
        if (staleness_ == 0) complete_steps(s);
      }
  }

  // Whether a pull of `ranges` by a worker at clock `seq` may be answered under the staleness bound.
  bool ready(std::span<const std::uint32_t> ranges, std::int64_t seq) const {
    if (staleness_ < 0) return true;
    for (auto r : ranges)
      if (min_live_clock(state_[r]) < seq - staleness_) return false;
    return true;
  }

  // The stats reply: per held range, its id, max_lead, and per worker its clock and the pushes applied.
  void stats(std::vector<std::byte>& out) const {
    for (std::uint32_t r = 0; r < state_.size(); ++r) {
      const auto& s = state_[r];
      if (!s.held) continue;
      put(out, r);
      put(out, s.max_lead);
      for (int w = 0; w < workers_; ++w) {
        const auto& seen = s.applied[std::size_t(w)];
        put(out, s.clock[std::size_t(w)]);
        put(out, std::uint32_t(seen.size()));
        put_bytes(out, seen.data(), seen.size() * sizeof(std::uint64_t));
      }
    }
  }

 private:
  std::int64_t min_live_clock(const range_state& s) const {
    std::int64_t m = std::numeric_limits<std::int64_t>::max();
    for (int w = 0; w < workers_; ++w)
      if (live(w)) m = std::min(m, s.clock[w]);
    return m;
  }

  static void assign(std::vector<float>& v, wire_floats g) {
    v.resize(g.size());
    g.copy_to(v.data(), 0, g.size());
  }

  void step(range_state& s, wire_floats g) {
    const auto n = g.size();
    float* v = s.value.data();
    if (optimizer_.kind == server_optimizer::sgd) {
      const float lr = optimizer_.lr;
      DML_SIMD
      for (std::size_t i = 0; i < n; ++i) v[i] -= lr * g[i];
    } else {
      // Through a block that stays in cache, for the kernel's aligned gradient pointer.
      constexpr std::size_t block = std::size_t(1) << 16;
      block_.resize(std::min(block, n));
      for (std::size_t at = 0; at < n; at += block) {
        const auto m = std::min(block, n - at);
        g.copy_to(block_.data(), at, m);
        for_each_index<host>(std::int64_t(m), optim::kernels::adagrad_update<float>{
            v + at, block_.data(), s.accum.data() + at, optimizer_.lr, optimizer_.eps, 0.f, 1.f});
      }
    }
  }

  // bsp: step t is applied when every live worker's push of it is in, summed in worker order.
  void complete_steps(range_state& s) {
    while (!s.pending.empty()) {
      auto it = s.pending.begin();
      bool all = true;
      for (int w = 0; w < workers_; ++w)
        if (live(w) && !it->second.contains(w)) all = false;
      if (!all) return;
      std::vector<float> sum(s.value.size(), 0.f);
      for (auto& [w, g] : it->second) {
        for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += g[i];
        ++s.clock[std::size_t(w)];
      }
      step(s, wire_floats(std::span<const float>(sum)));
      s.pending.erase(it);
      note_clock(s);
    }
  }

  void note_clock(range_state& s) {
    const std::int64_t lo = min_live_clock(s);
    for (int w = 0; w < workers_; ++w) {
      max_clock_ = std::max(max_clock_, s.clock[std::size_t(w)]);
      if (live(w) && lo != std::numeric_limits<std::int64_t>::max())
        s.max_lead = std::max(s.max_lead, s.clock[std::size_t(w)] - lo);
    }
  }

  int workers_, staleness_;
  server_optimizer optimizer_;
  std::vector<range_state> state_;
  std::vector<bool> dead_, left_;  // per worker
  std::vector<float> block_;       // step's gradient block (adagrad)
  std::int64_t max_clock_ = 0;
};

}  // namespace dml::ps::detail
