// SPDX-License-Identifier: Apache-2.0
// dml/parallel/program.hpp — a schedule lowered into the program one rank runs: the schedule's compute and
// transfers, and around them the sharding's unshard, reshard and gradient reductions per chunk, the tie sums
// and the update; and a checker of its order. Sits on parallel/schedule_check.hpp; the trainer runs programs.
//
// A rank's program, for each chunk c it holds:
//   unshard(c) · c's forwards and backwards (each backward pass flagged `first` when it is the chunk's first of
//   its kind, and `reduces` when its hooks launch the chunk's reductions) · reshard(c)
// then, after the chunks' reductions (reduce_gradients(c), the chunk's last one `final`), tie_gradients where
// the model ties parameters, and update. Per step, a chunk's last backward (or weight) pass reduces, once;
// per micro-batch, every backward reduces and a reduce_gradients follows it. Every schedule, built in or
// read from CSV, lowers the same way (as PyTorch lowers its compute-only schedules with UNSHARD, RESHARD and
// REDUCE_GRAD, and DeepSpeed ends its pipeline with ReduceTiedGrads, ReduceGrads, OptimizerStep).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dml/core/error.hpp"
#include "dml/parallel/schedule_check.hpp"

namespace dml::parallel {

struct instruction {
  enum class kind : std::uint8_t { run, unshard, reshard, reduce_gradients, tie_gradients, update };
  kind what = kind::run;
  schedule::action a{};  // run: one of the schedule's computes or transfers
  int chunk = 0;         // unshard, reshard, reduce_gradients (run: a.chunk)
  bool first = false;    // run of a backward kind: the chunk's first pass of that kind this step (it writes, not adds)
  bool reduces = false;  // run of a backward kind: its hooks launch the chunk's gradient reductions
  bool final = false;    // reduce_gradients: the chunk's last reduction of the step
  friend bool operator==(const instruction&, const instruction&) = default;
};
using program = std::vector<instruction>;

struct lowering {
  bool per_micro_batch = false;  // every backward reduces (one stage, no split backward: ZeRO-2/3's streaming)
  bool ties = false;             // the model ties parameters: tie_gradients before the update
};

namespace detail {
inline bool is_backward(schedule::op o) {
  return o == schedule::op::backward || o == schedule::op::backward_input || o == schedule::op::backward_weight;
}
}  // namespace detail

inline std::string to_string(const instruction& i) {
  using k = instruction::kind;
  switch (i.what) {
    case k::run:
      return schedule::to_string(i.a) + (i.reduces ? " (reduces)" : "");
    case k::unshard: return dml::detail::cat("unshard(", i.chunk, ")");
    case k::reshard: return dml::detail::cat("reshard(", i.chunk, ")");
    case k::reduce_gradients: return dml::detail::cat("reduce_gradients(", i.chunk, i.final ? ", final)" : ")");
    case k::tie_gradients: return "tie_gradients";
    case k::update: return "update";
  }
  return "?";
}

// Rank `rank`'s program for table t (a checked schedule: its own reduce_gradients and update are replaced).
inline program lower(const schedule::table& t, int rank, lowering o) {
  using schedule::op;
  const auto& list = t.ranks.at(static_cast<std::size_t>(rank));
  const auto chunks = static_cast<std::size_t>(t.virtual_stages);
  constexpr std::ptrdiff_t none = -1;
  std::vector<std::ptrdiff_t> first_compute(chunks, none), last_compute(chunks, none), last_backward(chunks, none);
  for (std::size_t i = 0; i < list.size(); ++i) {
    const auto& a = list[i];
    if (!schedule::is_compute(a.kind)) continue;
    const auto c = static_cast<std::size_t>(a.chunk);
    if (first_compute[c] == none) first_compute[c] = static_cast<std::ptrdiff_t>(i);
    last_compute[c] = static_cast<std::ptrdiff_t>(i);
    if (a.kind == op::backward || a.kind == op::backward_weight) last_backward[c] = static_cast<std::ptrdiff_t>(i);
  }
  program out;
  std::vector<int> passes(chunks, 0), weight_passes(chunks, 0);
  std::vector<std::size_t> done_order;  // chunks in the order their gradients complete
  for (std::size_t i = 0; i < list.size(); ++i) {
    const auto& a = list[i];
    if (a.kind == op::reduce_gradients || a.kind == op::update) continue;
    const auto c = static_cast<std::size_t>(a.chunk);
    const auto at = static_cast<std::ptrdiff_t>(i);
    if (schedule::is_compute(a.kind) && first_compute[c] == at)
      out.push_back({.what = instruction::kind::unshard, .chunk = a.chunk});
    instruction run{.what = instruction::kind::run, .a = a, .chunk = a.chunk};
    if (detail::is_backward(a.kind)) {
      int& n = a.kind == op::backward_weight ? weight_passes[c] : passes[c];
      run.first = n++ == 0;
      run.reduces = o.per_micro_batch ? a.kind == op::backward : last_backward[c] == at;
    }
    out.push_back(run);
    if (o.per_micro_batch && a.kind == op::backward)
      out.push_back({.what = instruction::kind::reduce_gradients, .chunk = a.chunk, .final = last_backward[c] == at});
    if (schedule::is_compute(a.kind) && last_compute[c] == at)
      out.push_back({.what = instruction::kind::reshard, .chunk = a.chunk});
    if (last_backward[c] == at) done_order.push_back(c);
  }
  if (!o.per_micro_batch)
    for (auto c : done_order)
      out.push_back({.what = instruction::kind::reduce_gradients, .chunk = static_cast<int>(c), .final = true});
  if (o.ties) out.push_back({.what = instruction::kind::tie_gradients});
  out.push_back({.what = instruction::kind::update});
  return out;
}

// "" when p is sound, else what is wrong, naming the instruction's index: a chunk computes only between its
// unshard and reshard; its gradient reductions are launched once per step by its last backward (or weight)
// pass, or per micro-batch by every backward, each followed by a reduce_gradients, the last one final; no
// backward after that; tie_gradients after every final reduction and before the update; update last.
inline std::string check(std::span<const instruction> p, int chunks, lowering o) {
  using k = instruction::kind;
  using dml::detail::cat;
  const auto n = static_cast<std::size_t>(chunks);
  std::vector<int> state(n, 0);  // 0: not yet unsharded, 1: resident, 2: resharded
  std::vector<int> launched(n, 0), waiting(n, 0), finals(n, 0), backwards(n, 0);
  bool tied = false, updated = false;
  auto at = [&](std::size_t i) { return cat("instruction ", i, " (", to_string(p[i]), ")"); };
  for (std::size_t i = 0; i < p.size(); ++i) {
    const auto& x = p[i];
    if (updated) return cat(at(i), ": after update; update must be the last instruction");
    if (x.what != k::tie_gradients && x.what != k::update && (x.chunk < 0 || x.chunk >= chunks))
      return cat(at(i), ": chunk ", x.chunk, " outside [0, ", chunks, ")");
    const auto c = static_cast<std::size_t>(x.chunk);
    switch (x.what) {
      case k::unshard:
        if (state[c] != 0) return cat(at(i), ": chunk ", c, " is unsharded twice");
        state[c] = 1;
        break;
      case k::reshard:
        if (state[c] != 1) return cat(at(i), ": chunk ", c, " is resharded without being resident");
        state[c] = 2;
        break;
      case k::run:
        if (schedule::is_compute(x.a.kind) && state[c] != 1)
          return cat(at(i), ": chunk ", c, " computes outside its unshard and reshard");
        if (detail::is_backward(x.a.kind)) {
          if (finals[c]) return cat(at(i), ": a backward of chunk ", c, " after its final reduce_gradients");
          if (o.per_micro_batch && x.a.kind != schedule::op::backward)
            return cat(at(i), ": per micro-batch reduction cannot split backward; reduce per step");
          ++backwards[c];
          if (x.reduces) {
            if (waiting[c]) return cat(at(i), ": launches reductions of chunk ", c, " before the last ones were reduced");
            if (!o.per_micro_batch && launched[c]) return cat(at(i), ": launches chunk ", c, "'s reductions twice in a step");
            ++launched[c];
            waiting[c] = 1;
          } else if (o.per_micro_batch) {
            return cat(at(i), ": per micro-batch, every backward launches its reductions");
          }
        }
        break;
      case k::reduce_gradients:
        if (!waiting[c]) return cat(at(i), ": no reductions of chunk ", c, " were launched since the last one");
        waiting[c] = 0;
        if (x.final) ++finals[c];
        if (finals[c] > 1) return cat(at(i), ": a second final reduction of chunk ", c);
        break;
      case k::tie_gradients:
        if (!o.ties) return cat(at(i), ": the model ties no parameters");
        for (std::size_t d = 0; d < n; ++d)
          if (!finals[d] && backwards[d]) return cat(at(i), ": before chunk ", d, "'s final reduce_gradients");
        tied = true;
        break;
      case k::update:
        for (std::size_t d = 0; d < n; ++d) {
          if (state[d] == 1) return cat(at(i), ": chunk ", d, " is still resident (no reshard)");
          if (backwards[d] && !finals[d]) return cat(at(i), ": chunk ", d, " has no final reduce_gradients");
        }
        if (o.ties && !tied) return cat(at(i), ": the model ties parameters and no tie_gradients came before update");
        updated = true;
        break;
    }
  }
  if (!updated) return "the program does not end with update";
  return {};
}

}  // namespace dml::parallel
