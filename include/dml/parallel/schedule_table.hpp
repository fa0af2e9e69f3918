// SPDX-License-Identifier: Apache-2.0
// dml/parallel/schedule_table.hpp — pipeline schedules as data: actions, their names, per-rank lists (tables), where
// a virtual stage lives and which action on another rank a send or recv pairs with.
// Sits on core/; parallel/schedule_check.hpp checks and simulates tables, schedule.hpp builds them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dml/core/error.hpp"

namespace dml {

// Policy family tag of the pipeline schedules (schedule.hpp), as sharding_family is for sharding.
struct schedule_family {};

namespace schedule {
namespace detail {
using ::dml::detail::cat;
}

// A step is a list of actions per pipeline rank. Execution semantics, which the checker and the
// simulator assume and a runtime must provide:
//  - actions of one rank run in list order;
//  - sends are non-blocking: posted at once (as isend) and buffered, so a send never waits;
//  - a recv blocks until its matching send has been posted;
//  - messages match by identity (kind, micro-batch, virtual stage), not by FIFO order, so two
//    messages between the same pair of ranks may be received in either order.
// Compute actions never wait on another rank: their inputs must have arrived through an earlier
// recv of the same rank (or, with one rank, an earlier action of that rank).
enum class op : std::uint8_t {
  forward,           // run chunk `chunk` of this rank on micro-batch `micro` (the last virtual stage also computes the loss and its gradient)
  backward,          // full backward of (micro, chunk): input gradient and weight gradients
  backward_input,    // input gradient only (split backward, zero bubble)
  backward_weight,   // weight gradients of a (micro, chunk) whose backward_input ran
  send_activation,   // send the output of forward(micro, chunk) to the rank holding the next virtual stage
  recv_activation,   // receive the input of forward(micro, chunk) from the rank holding the previous virtual stage
  send_gradient,     // send the input gradient of backward(micro, chunk) to the previous virtual stage's rank
  recv_gradient,     // receive the output gradient for backward(micro, chunk) from the next virtual stage's rank
  reduce_gradients,  // data-parallel reduction of this rank's gradients; after its last backward
  update             // the optimizer step; last
};
inline constexpr int op_count = 10;

// reduce_gradients and update carry micro = -1, chunk = 0. Send and recv actions name the *local*
// (micro, chunk) they belong to: send_activation(m, c) on rank r sends the output of forward(m, c)
// on r; its match is recv_activation(m, c') on the rank r' with c'*K + r' = c*K + r + 1.
struct action {
  op kind = op::forward;
  int micro = -1;
  int chunk = 0;
  friend bool operator==(const action&, const action&) = default;
};

// Every pipeline rank's list. Rank r, chunk c is virtual stage v = c*stages + r (Megatron's
// interleaving); virtual stage v+1 lives on rank (v+1) % stages, chunk (v+1) / stages.
// micro is in [0, micro_batches), chunk in [0, virtual_stages). With stages == 1 there are no
// sends or receives: chunk c+1 reads chunk c's output on the same rank.
struct table {
  int stages = 1, micro_batches = 1, virtual_stages = 1;  // K, M, V
  std::vector<std::vector<action>> ranks;                 // ranks.size() == stages
  friend bool operator==(const table&, const table&) = default;
};

constexpr int virtual_stage(int stages, int rank, int chunk) noexcept { return chunk * stages + rank; }

// Where a virtual stage lives.
struct placement {
  int rank = 0, chunk = 0;
  friend bool operator==(const placement&, const placement&) = default;
};
constexpr placement place(int stages, int virtual_stage) noexcept {
  return {virtual_stage % stages, virtual_stage / stages};
}

// ---------------------------------------------------------------------------------------------
// Names. Long names (CSV, messages) and short ones (F3.1, B, I, W, SA, RA, SG, RG, R, U).

constexpr std::string_view name(op o) {
  switch (o) {
    case op::forward: return "forward";
    case op::backward: return "backward";
    case op::backward_input: return "backward_input";
    case op::backward_weight: return "backward_weight";
    case op::send_activation: return "send_activation";
    case op::recv_activation: return "recv_activation";
    case op::send_gradient: return "send_gradient";
    case op::recv_gradient: return "recv_gradient";
    case op::reduce_gradients: return "reduce_gradients";
    case op::update: return "update";
  }
  return "?";
}

constexpr std::string_view short_name(op o) {
  switch (o) {
    case op::forward: return "F";
    case op::backward: return "B";
    case op::backward_input: return "I";
    case op::backward_weight: return "W";
    case op::send_activation: return "SA";
    case op::recv_activation: return "RA";
    case op::send_gradient: return "SG";
    case op::recv_gradient: return "RG";
    case op::reduce_gradients: return "R";
    case op::update: return "U";
  }
  return "?";
}

inline std::string to_string(op o) { return std::string(short_name(o)); }

// The long or the short name, as written by name() and short_name().
constexpr std::optional<op> parse_op(std::string_view s) {
  for (int i = 0; i < op_count; ++i) {
    const auto o = static_cast<op>(i);
    if (s == name(o) || s == short_name(o)) return o;
  }
  return std::nullopt;
}

constexpr bool is_compute(op o) { return o <= op::backward_weight; }
constexpr bool is_send(op o) { return o == op::send_activation || o == op::send_gradient; }
constexpr bool is_recv(op o) { return o == op::recv_activation || o == op::recv_gradient; }
// Actions about one (micro, chunk); reduce_gradients and update are about the whole rank.
constexpr bool has_unit(op o) { return o < op::reduce_gradients; }

// F3.1: forward of micro-batch 3, chunk 1. The chunk is shown when virtual_stages > 1 (or the
// chunk is not 0); reduce_gradients and update are R and U.
inline std::string to_string(const action& a, int virtual_stages = 1) {
  const auto i = static_cast<int>(a.kind);
  std::string s = i >= 0 && i < op_count ? std::string(short_name(a.kind)) : detail::cat("op", i, ":");
  if (has_unit(a.kind) || a.micro != -1 || a.chunk != 0) {
    s += std::to_string(a.micro);
    if (virtual_stages > 1 || a.chunk != 0) {
      s += '.';
      s += std::to_string(a.chunk);
    }
  }
  return s;
}

// The action on another rank that a send or recv pairs with: send_activation(m, c) on rank r
// pairs with recv_activation on the rank of virtual stage c*K + r + 1, and so on. nullopt for
// other actions, for one stage, and where no such stage exists (a send past the last stage).
struct endpoint {
  int rank = 0;
  action act;
};
inline std::optional<endpoint> counterpart(const table& t, int rank, const action& a) {
  const int k = t.stages, n = t.stages * t.virtual_stages;
  const int v = virtual_stage(k, rank, a.chunk);
  if (k <= 1) return std::nullopt;
  int to = -1;
  op kind{};
  switch (a.kind) {
    case op::send_activation: to = v + 1, kind = op::recv_activation; break;
    case op::recv_activation: to = v - 1, kind = op::send_activation; break;
    case op::send_gradient: to = v - 1, kind = op::recv_gradient; break;
    case op::recv_gradient: to = v + 1, kind = op::send_gradient; break;
    default: return std::nullopt;
  }
  if (to < 0 || to >= n) return std::nullopt;
  const auto p = place(k, to);
  return endpoint{p.rank, action{kind, a.micro, p.chunk}};
}

// When rank `rank` knows that a send of its own has been received: once it has received a message that the
// receiving rank sends it after its matching recv (a recv completes only after its send was posted, and one rank
// runs its actions in order). Per send of `kind` on `rank` with such a message: {the recv on `rank` after which it
// is known received, the send}. A send with none (the step's last messages) is known received at the step's end.
inline std::vector<std::pair<action, action>> known_received(const table& t, int rank, op kind) {
  // Each rank's first position of each action, indexed once per rank looked at: a scan per lookup made this
  // quadratic in a rank's actions (half a minute of dml-plan's 175B search, at 1,536 micro-batches).
  std::vector<std::unordered_map<std::uint64_t, std::ptrdiff_t>> positions(t.ranks.size());
  auto key = [](const action& a) {
    return std::uint64_t{static_cast<std::uint8_t>(a.kind)} << 56 | std::uint64_t{static_cast<std::uint32_t>(a.chunk)} << 32 |
           static_cast<std::uint32_t>(a.micro);
  };
  auto index = [&](int r, const action& a) -> std::ptrdiff_t {
    const auto& list = t.ranks.at(static_cast<std::size_t>(r));
    auto& at = positions[static_cast<std::size_t>(r)];
    if (at.empty())
      for (std::size_t i = 0; i < list.size(); ++i) at.emplace(key(list[i]), static_cast<std::ptrdiff_t>(i));
    const auto found = at.find(key(a));
    return found == at.end() ? -1 : found->second;
  };
  std::vector<std::pair<action, action>> out;
  const auto& mine = t.ranks.at(static_cast<std::size_t>(rank));
  for (std::size_t i = 0; i < mine.size(); ++i) {
    if (mine[i].kind != kind) continue;
    const auto to = counterpart(t, rank, mine[i]);
    const std::ptrdiff_t at = to ? index(to->rank, to->act) : -1;
    if (at < 0) continue;
    const auto& theirs = t.ranks[static_cast<std::size_t>(to->rank)];
    for (auto j = static_cast<std::size_t>(at) + 1; j < theirs.size(); ++j) {
      if (!is_send(theirs[j].kind)) continue;
      const auto back = counterpart(t, to->rank, theirs[j]);
      if (!back || back->rank != rank) continue;
      if (index(rank, back->act) > static_cast<std::ptrdiff_t>(i)) out.emplace_back(back->act, mine[i]);
      break;
    }
  }
  return out;
}

}  // namespace schedule
}  // namespace dml
