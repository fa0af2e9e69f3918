// SPDX-License-Identifier: Apache-2.0
// dml/parallel/schedule_check.hpp — the checker of pipeline schedule tables and a timing simulator (bubble,
// micro-batches in flight). Sits on parallel/schedule_table.hpp (the tables); schedule.hpp builds on it.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dml/core/error.hpp"
#include "dml/parallel/schedule_table.hpp"

namespace dml::schedule {

// ---------------------------------------------------------------------------------------------
// The checker: runs every rank's list symbolically under the semantics of schedule_table.hpp.

namespace detail {

inline std::string at(const table& t, int rank, std::size_t index) {
  return cat("rank ", rank, " action ", index, " (", to_string(t.ranks[std::size_t(rank)][index], t.virtual_stages),
             ")");
}

// Message identity: (activation or gradient, destination virtual stage, micro-batch).
inline std::size_t message_key(const table& t, int rank, const action& a) {
  const int v = virtual_stage(t.stages, rank, a.chunk);
  const bool grad = a.kind == op::send_gradient || a.kind == op::recv_gradient;
  const int dest = a.kind == op::send_activation ? v + 1 : a.kind == op::send_gradient ? v - 1 : v;
  return (std::size_t(grad) * std::size_t(t.stages * t.virtual_stages) + std::size_t(dest)) *
             std::size_t(t.micro_batches) +
         std::size_t(a.micro);
}

// Per-rank positions of every (micro, chunk)'s actions; -1 where absent.
struct rank_state {
  int micro_batches = 0, chunks = 0;
  std::vector<std::array<std::ptrdiff_t, 8>> pos;  // index by op for the eight per-unit ops
  std::ptrdiff_t reduce = -1, update = -1;
  rank_state(int m, int v) : micro_batches(m), chunks(v), pos(std::size_t(m) * std::size_t(v)) {
    for (auto& p : pos) p.fill(-1);
  }
  std::ptrdiff_t& operator()(int micro, int chunk, op o) {
    return pos[std::size_t(micro) * std::size_t(chunks) + std::size_t(chunk)][std::size_t(o)];
  }
  std::ptrdiff_t operator()(int micro, int chunk, op o) const {
    return pos[std::size_t(micro) * std::size_t(chunks) + std::size_t(chunk)][std::size_t(o)];
  }
  // The backward that produced (micro, chunk)'s input gradient: backward or backward_input.
  std::ptrdiff_t grad_at(int micro, int chunk) const {
    const auto b = (*this)(micro, chunk, op::backward);
    return b >= 0 ? b : (*this)(micro, chunk, op::backward_input);
  }
};

inline std::optional<std::string> check_shape(const table& t) {
  if (t.stages < 1 || t.micro_batches < 1 || t.virtual_stages < 1)
    return cat("stages, micro_batches and virtual_stages must be >= 1, found ", t.stages, ", ", t.micro_batches,
               ", ", t.virtual_stages);
  if (t.ranks.size() != std::size_t(t.stages))
    return cat("the table has ", t.ranks.size(), " rank lists, expected one per stage (", t.stages, ")");
  // Keeps message keys and per-unit arrays small; far beyond any real pipeline.
  constexpr double limit = 1 << 26;
  if (const double units = double(t.stages) * t.virtual_stages * t.micro_batches; units > limit)
    return cat("stages x virtual_stages x micro_batches = ", units, " exceeds ", limit);
  return std::nullopt;
}

// Local rules of one rank's list: ranges, repeats, and each action after what it needs.
inline std::optional<std::string> check_rank(const table& t, int r, rank_state& s) {
  const int k = t.stages, m_count = t.micro_batches, v_count = t.virtual_stages, last = k * v_count - 1;
  const auto& list = t.ranks[std::size_t(r)];
  for (std::size_t i = 0; i < list.size(); ++i) {
    const action& a = list[i];
    const auto here = [&] { return at(t, r, i); };
    const auto ko = static_cast<int>(a.kind);
    if (ko < 0 || ko >= op_count) return cat(here(), ": unknown op ", ko, ", expected 0..", op_count - 1);
    if (s.update >= 0)
      return cat(here(), ": comes after update (action ", s.update, "); update must be the rank's last action");
    if (!has_unit(a.kind)) {
      if (a.micro != -1 || a.chunk != 0)
        return cat(here(), ": ", name(a.kind), " takes no micro-batch or chunk (expected micro -1, chunk 0)");
      if (a.kind == op::reduce_gradients) {
        if (s.reduce >= 0) return cat(here(), ": repeats reduce_gradients (first at action ", s.reduce, ")");
        s.reduce = std::ptrdiff_t(i);
      } else {
        if (s.reduce < 0)
          return cat(here(), ": update before reduce_gradients (reduce this rank's gradients first)");
        s.update = std::ptrdiff_t(i);
      }
      continue;
    }
    if (a.micro < 0 || a.micro >= m_count)
      return cat(here(), ": micro-batch ", a.micro, " out of range [0, ", m_count, ")");
    if (a.chunk < 0 || a.chunk >= v_count)
      return cat(here(), ": chunk ", a.chunk, " out of range [0, ", v_count, ")");
    const int m = a.micro, c = a.chunk, v = virtual_stage(k, r, c);
    auto& self = s(m, c, a.kind);
    if (self >= 0 && a.kind != op::backward && a.kind != op::backward_input)
      return cat(here(), ": repeats ", name(a.kind), " of micro-batch ", m, " chunk ", c, " (first at action ", self,
                 ")");
    if (is_send(a.kind) || is_recv(a.kind)) {
      if (k == 1)
        return cat(here(), ": a single stage sends and receives nothing (chunk c+1 reads chunk c on the same rank)");
      if ((a.kind == op::send_activation || a.kind == op::recv_gradient) && v == last)
        return cat(here(), ": ", name(a.kind), " on the last virtual stage (", v, "); no stage follows it");
      if ((a.kind == op::recv_activation || a.kind == op::send_gradient) && v == 0)
        return cat(here(), ": ", name(a.kind), " on the first virtual stage; no stage precedes it");
    }
    const bool is_backward = a.kind == op::backward || a.kind == op::backward_input || a.kind == op::backward_weight;
    if (is_backward && s.reduce >= 0)
      return cat(here(), ": after reduce_gradients (action ", s.reduce,
                 "); reduce_gradients must follow the rank's last backward");
    switch (a.kind) {
      case op::forward:
        if (v > 0 && k > 1 && s(m, c, op::recv_activation) < 0)
          return cat(here(), ": forward before its recv_activation (its input comes from rank ", place(k, v - 1).rank,
                     ")");
        if (v > 0 && k == 1 && s(m, c - 1, op::forward) < 0)
          return cat(here(), ": forward before the forward of chunk ", c - 1, " (its input)");
        break;
      case op::backward:
      case op::backward_input: {
        if (const auto b = s.grad_at(m, c); b >= 0)
          return cat(here(), ": repeats the backward of micro-batch ", m, " chunk ", c, " (first at action ", b, ")");
        if (s(m, c, op::forward) < 0) return cat(here(), ": ", name(a.kind), " before its forward");
        if (v < last && k > 1 && s(m, c, op::recv_gradient) < 0)
          return cat(here(), ": ", name(a.kind), " before its recv_gradient (its output gradient comes from rank ",
                     place(k, v + 1).rank, ")");
        if (v < last && k == 1 && s.grad_at(m, c + 1) < 0)
          return cat(here(), ": ", name(a.kind), " before the backward of chunk ", c + 1, " (its output gradient)");
        break;
      }
      case op::backward_weight:
        if (s(m, c, op::backward) >= 0)
          return cat(here(), ": backward_weight after a full backward (action ", s(m, c, op::backward),
                     ") already computed these weight gradients");
        if (s(m, c, op::backward_input) < 0) return cat(here(), ": backward_weight before its backward_input");
        break;
      case op::send_activation:
        if (s(m, c, op::forward) < 0) return cat(here(), ": send_activation before its forward");
        break;
      case op::send_gradient:
        if (s.grad_at(m, c) < 0) return cat(here(), ": send_gradient before its backward (or backward_input)");
        break;
      default: break;
    }
    self = std::ptrdiff_t(i);
  }
  return std::nullopt;
}

// After the pairs: every (micro, chunk) of the rank run forward and backward, and the list ends.
inline std::optional<std::string> check_complete(const table& t, int r, const rank_state& s) {
  const int k = t.stages, m_count = t.micro_batches, v_count = t.virtual_stages;
  if (s.update < 0) {
    if (s.reduce < 0) return cat("rank ", r, ": no reduce_gradients and no update; the list must end with them");
    return cat("rank ", r, ": no update; the optimizer step must be the rank's last action");
  }
  for (int m = 0; m < m_count; ++m)
    for (int c = 0; c < v_count; ++c) {
      const int v = virtual_stage(k, r, c);
      if (s(m, c, op::forward) < 0)
        return cat("rank ", r, ": no forward of micro-batch ", m, " chunk ", c, " (virtual stage ", v, ")");
      if (s.grad_at(m, c) < 0)
        return cat("rank ", r, ": no backward of micro-batch ", m, " chunk ", c, " (virtual stage ", v,
                   "; forward at action ", s(m, c, op::forward), ")");
      if (const auto i = s(m, c, op::backward_input); i >= 0 && s(m, c, op::backward_weight) < 0)
        return cat(at(t, r, std::size_t(i)), ": backward_input without its backward_weight");
    }
  return std::nullopt;
}

// Every send has its recv on the peer and every recv its send.
inline std::optional<std::string> check_pairs(const table& t, std::vector<rank_state>& s) {
  for (int r = 0; r < t.stages; ++r) {
    const auto& list = t.ranks[std::size_t(r)];
    for (std::size_t i = 0; i < list.size(); ++i) {
      const action& a = list[i];
      if (!is_send(a.kind) && !is_recv(a.kind)) continue;
      const auto peer = counterpart(t, r, a);  // exists: check_rank refused sends past either end
      if (s[std::size_t(peer->rank)](peer->act.micro, peer->act.chunk, peer->act.kind) >= 0) continue;
      const auto want = to_string(peer->act, t.virtual_stages);
      if (is_send(a.kind))
        return cat(at(t, r, i), ": nobody receives it; rank ", peer->rank, " has no ", name(peer->act.kind), " ",
                   want);
      return cat(at(t, r, i), ": waits for ", name(peer->act.kind), " ", want, " from rank ", peer->rank,
                 ", which rank ", peer->rank, " never posts");
    }
  }
  return std::nullopt;
}

// Runs all lists together; the only thing that can stop a rank now is a recv whose send its peer
// has not reached, so a pass without progress is a deadlock.
inline std::optional<std::string> check_progress(const table& t, const std::vector<rank_state>& s) {
  std::vector<char> posted(2 * std::size_t(t.stages * t.virtual_stages) * std::size_t(t.micro_batches), 0);
  std::vector<std::size_t> pc(std::size_t(t.stages), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < t.stages; ++r) {
      const auto& list = t.ranks[std::size_t(r)];
      auto& i = pc[std::size_t(r)];
      for (; i < list.size(); ++i, progress = true) {
        const action& a = list[i];
        if (is_recv(a.kind) && !posted[message_key(t, r, a)]) break;
        if (is_send(a.kind)) posted[message_key(t, r, a)] = 1;
      }
    }
  }
  std::string msg;
  for (int r = 0; r < t.stages; ++r) {
    const auto i = pc[std::size_t(r)];
    if (i == t.ranks[std::size_t(r)].size()) continue;
    const auto peer = counterpart(t, r, t.ranks[std::size_t(r)][i]);
    const auto& ps = s[std::size_t(peer->rank)];
    msg += cat(msg.empty() ? "deadlock: " : "; ", at(t, r, i), " waits for ",
               to_string(peer->act, t.virtual_stages), " from rank ", peer->rank, " (its action ",
               ps(peer->act.micro, peer->act.chunk, peer->act.kind), ", not reached)");
  }
  if (msg.empty()) return std::nullopt;
  return msg;
}

}  // namespace detail

// The first problem of the table, or nullopt when every rank's list runs to its end under the
// semantics of schedule_table.hpp: no deadlock, every send received and every recv sent, every
// (micro-batch, virtual stage) run forward once and backward once (backward, or backward_input then
// backward_weight), each after its inputs exist, reduce_gradients after the rank's last backward
// and update last. The message names the rank, the index in its list and the action.
inline std::optional<std::string> verify(const table& t) {
  if (auto e = detail::check_shape(t)) return e;
  std::vector<detail::rank_state> states(std::size_t(t.stages), detail::rank_state(t.micro_batches, t.virtual_stages));
  for (int r = 0; r < t.stages; ++r)
    if (auto e = detail::check_rank(t, r, states[std::size_t(r)])) return e;
  if (auto e = detail::check_pairs(t, states)) return e;
  for (int r = 0; r < t.stages; ++r)
    if (auto e = detail::check_complete(t, r, states[std::size_t(r)])) return e;
  return detail::check_progress(t, states);
}

// verify(), throwing dml::invalid_argument with its message.
inline void check(const table& t) {
  if (auto e = verify(t)) fail<invalid_argument>("dml::schedule::check: ", *e);
}

// ---------------------------------------------------------------------------------------------
// In order. A communicator without message tags (comm::nccl) matches the messages between two ranks in the
// order they are sent, not by identity: a table runs on it only if, for every pair of ranks, the sends from
// one come in the order the other receives them. nullopt if so; else the first pair and message that differ.
inline std::optional<std::string> verify_in_order(const table& t) {
  const auto k = static_cast<std::size_t>(t.stages);
  // Per (from, to): the messages as sent, and as received, each named by its receive action.
  std::vector<std::vector<action>> sent(k * k), received(k * k);
  for (int r = 0; r < t.stages; ++r)
    for (const auto& a : t.ranks[std::size_t(r)]) {
      const auto other = counterpart(t, r, a);
      if (!other || other->rank == r) continue;
      if (a.kind == op::send_activation || a.kind == op::send_gradient)
        sent[std::size_t(r) * k + std::size_t(other->rank)].push_back(other->act);
      else if (a.kind == op::recv_activation || a.kind == op::recv_gradient)
        received[std::size_t(other->rank) * k + std::size_t(r)].push_back(a);
    }
  for (std::size_t from = 0; from < k; ++from)
    for (std::size_t to = 0; to < k; ++to) {
      const auto& s = sent[from * k + to];
      const auto& q = received[from * k + to];
      for (std::size_t i = 0; i < std::min(s.size(), q.size()); ++i)
        if (!(s[i] == q[i]))
          return detail::cat("rank ", from, " sends ", to_string(s[i], t.virtual_stages), "'s message as its ", i + 1,
                             "th to rank ", to, ", which receives ", to_string(q[i], t.virtual_stages), " there");
    }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Simulation. Costs are per micro-batch per stage, that is for all V chunks of a rank together:
// one chunk's forward takes forward / V, and so on, so a rank's work per micro-batch is the same
// for every V and interleaving shows up as a smaller bubble (Megatron's (K-1)/(V·M + K-1)).
// comm is the latency of one message. backward is the full backward; backward_input and
// backward_weight are its halves in a split (zero-bubble) schedule.
struct costs {
  double forward = 1, backward = 2, backward_input = 1, backward_weight = 1, comm = 0;
};

struct timeline {
  std::vector<std::vector<double>> start, end;  // per rank, per action of its list
  double makespan = 0;
  std::vector<double> busy;  // compute time per rank
  double bubble = 0;         // mean over ranks of (makespan - busy) / makespan
};

inline double duration(op o, const costs& c, int virtual_stages) {
  switch (o) {
    case op::forward: return c.forward / virtual_stages;
    case op::backward: return c.backward / virtual_stages;
    case op::backward_input: return c.backward_input / virtual_stages;
    case op::backward_weight: return c.backward_weight / virtual_stages;
    default: return 0;
  }
}

// Each action starts when its rank is free; compute takes its cost, rank r's from per_rank[r] (stages of
// unequal work), times micro_scale[m] for micro-batch m where given (micro-batches of unequal rows); sends,
// reduce_gradients and update take no time; a recv ends when its message arrives (the send's time + the
// receiver's comm) or at once if it already has. Checks the table first.
inline timeline simulate(const table& t, std::span<const costs> per_rank, std::span<const double> micro_scale = {}) {
  check(t);
  const auto k = std::size_t(t.stages);
  if (per_rank.size() != k)
    fail<invalid_argument>("dml::schedule::simulate: expected costs for each of the ", k, " ranks, found ", per_rank.size());
  if (!micro_scale.empty() && std::ssize(micro_scale) != t.micro_batches)
    fail<invalid_argument>("dml::schedule::simulate: expected a scale for each of the ", t.micro_batches,
                           " micro-batches, found ", micro_scale.size());
  for (double x : micro_scale)
    if (!(x >= 0) || !std::isfinite(x))
      fail<invalid_argument>("dml::schedule::simulate: micro-batch scales must be finite and >= 0, found ", x);
  for (const auto& c : per_rank)
    for (double x : {c.forward, c.backward, c.backward_input, c.backward_weight, c.comm})
      if (!(x >= 0) || !std::isfinite(x))
        fail<invalid_argument>("dml::schedule::simulate: costs must be finite and >= 0, found ", x);
  timeline tl;
  tl.start.resize(k);
  tl.end.resize(k);
  tl.busy.assign(k, 0.0);
  for (std::size_t r = 0; r < k; ++r) {
    tl.start[r].assign(t.ranks[r].size(), 0.0);
    tl.end[r].assign(t.ranks[r].size(), 0.0);
  }
  std::vector<double> sent(2 * k * std::size_t(t.virtual_stages) * std::size_t(t.micro_batches), -1.0);
  std::vector<std::size_t> pc(k, 0);
  std::vector<double> free(k, 0.0);
  for (bool progress = true; progress;) {
    progress = false;
    for (std::size_t r = 0; r < k; ++r) {
      const auto& list = t.ranks[r];
      for (auto& i = pc[r]; i < list.size(); ++i, progress = true) {
        const action& a = list[i];
        double finish = free[r];
        if (is_recv(a.kind)) {
          const double s = sent[detail::message_key(t, int(r), a)];
          if (s < 0) break;
          finish = std::max(free[r], s + per_rank[r].comm);
        } else if (is_send(a.kind)) {
          sent[detail::message_key(t, int(r), a)] = free[r];
        } else {
          // reduce_gradients and update carry no micro-batch (micro == -1) and take no time
          const bool scaled = !micro_scale.empty() && a.micro >= 0;
          const double d = duration(a.kind, per_rank[r], t.virtual_stages) *
                           (scaled ? micro_scale[static_cast<std::size_t>(a.micro)] : 1.0);
          finish += d;
          tl.busy[r] += d;
        }
        tl.start[r][i] = free[r];
        tl.end[r][i] = finish;
        free[r] = finish;
      }
    }
  }
  tl.makespan = *std::max_element(free.begin(), free.end());
  if (tl.makespan > 0) {
    for (std::size_t r = 0; r < k; ++r) tl.bubble += (tl.makespan - tl.busy[r]) / tl.makespan;
    tl.bubble /= double(k);
  }
  return tl;
}
// Every rank at the same costs.
inline timeline simulate(const table& t, const costs& c = {}) {
  return simulate(t, std::vector<costs>(std::size_t(std::max(t.stages, 0)), c));
}

// The most (micro-batch, chunk) forwards of `rank` whose activations are held at once: counted
// from the forward to the backward that frees them, which is backward or backward_input (a split
// backward keeps only what backward_weight needs, the stage's inputs and output gradients, which
// ZB-H1 accounts separately). With V chunks each chunk counts once and holds about 1/V of the
// stage's activations.
inline std::int64_t peak_in_flight(const table& t, int rank) {
  if (rank < 0 || std::size_t(rank) >= t.ranks.size())
    fail<invalid_argument>("dml::schedule::peak_in_flight: rank ", rank, " out of range [0, ", t.ranks.size(), ")");
  std::int64_t now = 0, peak = 0;
  for (const action& a : t.ranks[std::size_t(rank)]) {
    if (a.kind == op::forward) peak = std::max(peak, ++now);
    if (a.kind == op::backward || a.kind == op::backward_input) --now;
  }
  return peak;
}

}  // namespace dml::schedule
