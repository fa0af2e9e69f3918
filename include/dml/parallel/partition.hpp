// SPDX-License-Identifier: Apache-2.0
// dml/parallel/partition.hpp — cutting a sequence of layers into pipeline stages: balanced by cost, or at given cuts.
// Sits on core/error.hpp alone (pure functions); the trainer's pipeline asks it where each stage starts.
#pragma once

#include <charconv>
#include <cmath>
#include <cstddef>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dml/core/error.hpp"

namespace dml::parallel {

// A partition is given by the first layer of each stage: first[0] == 0, strictly increasing, one
// entry per stage; stage s holds layers [first[s], first[s + 1]) and the last stage runs to the end.
//
// can_cut_before[i] == false forbids a stage boundary right before layer i (a relu fused into the
// linear before it must stay on that linear's stage). An empty span allows every cut; otherwise it
// has one entry per layer, and entry 0 is ignored (the first stage always starts at layer 0).

namespace detail::partition_impl {

inline void check_mask(std::span<const bool> can_cut_before, std::size_t layers, const char* where) {
  if (!can_cut_before.empty() && can_cut_before.size() != layers)
    fail<invalid_argument>(where, ": expected can_cut_before to be empty or have one entry per layer (", layers,
                           "), found ", can_cut_before.size());
}

inline bool cuttable(std::span<const bool> can_cut_before, std::size_t i) {
  return can_cut_before.empty() || can_cut_before[i];
}

// A span over a copy of a std::vector<bool> (which has no contiguous bools to view).
struct mask_copy {
  std::unique_ptr<bool[]> data;
  std::size_t size;
  explicit mask_copy(const std::vector<bool>& v) : data(new bool[v.size()]), size(v.size()) {
    for (std::size_t i = 0; i < size; ++i) data[i] = v[i];
  }
  std::span<const bool> span() const { return {data.get(), size}; }
};

}  // namespace detail::partition_impl

// The cost of each stage of a partition, summed layer by layer.
inline std::vector<double> stage_costs(std::span<const double> cost, std::span<const std::size_t> first_layers) {
  std::vector<double> out;
  out.reserve(first_layers.size());
  for (std::size_t s = 0; s < first_layers.size(); ++s) {
    const std::size_t end = s + 1 < first_layers.size() ? first_layers[s + 1] : cost.size();
    if (first_layers[s] > end || end > cost.size())
      fail<invalid_argument>("dml::parallel::stage_costs: stage ", s, " spans layers [", first_layers[s], ", ", end,
                             ") of ", cost.size());
    double c = 0;
    for (std::size_t l = first_layers[s]; l < end; ++l) c += cost[l];
    out.push_back(c);
  }
  return out;
}

// The partition of `cost.size()` layers into `stages` non-empty stages, cut only where
// can_cut_before allows, whose most expensive stage costs least (a pipeline runs at the pace of
// its slowest stage). Exact: a dynamic programme over the allowed cut positions, O(stages · n²)
// at worst for n layers. Among the partitions with that least maximum it takes the one with the
// least sum of squared stage costs, so no stage is left needlessly light; among those, the one
// with the earliest cuts.
//
// Throws invalid_argument for stages < 1, a cost that is negative or not finite, or more stages
// than the layers and allowed cuts can fill (a stage would be empty).
inline std::vector<std::size_t> balance_stages(std::span<const double> cost, int stages,
                                               std::span<const bool> can_cut_before = {}) {
  namespace impl = detail::partition_impl;
  constexpr const char* where = "dml::parallel::balance_stages";
  const std::size_t n = cost.size();
  if (stages < 1) fail<invalid_argument>(where, ": expected stages >= 1, found ", stages);
  impl::check_mask(can_cut_before, n, where);
  for (std::size_t l = 0; l < n; ++l)
    if (!(std::isfinite(cost[l]) && cost[l] >= 0))
      fail<invalid_argument>(where, ": expected every layer's cost to be finite and >= 0, found ", cost[l],
                             " for layer ", l);

  // Where a stage may start (0 and the allowed cuts), then the end.
  std::vector<std::size_t> pos{0};
  for (std::size_t i = 1; i < n; ++i)
    if (impl::cuttable(can_cut_before, i)) pos.push_back(i);
  const std::size_t starts = n == 0 ? 0 : pos.size();
  if (static_cast<std::size_t>(stages) > starts)
    fail<invalid_argument>(where, ": ", stages, " stages over ", n, " layers would leave an empty stage: at most ",
                           starts, " fit (", starts == 0 ? 0 : starts - 1, " places to cut)");
  pos.push_back(n);
  const std::size_t m = pos.size();  // positions; pos[m - 1] == n

  std::vector<double> prefix(n + 1, 0.0);
  for (std::size_t l = 0; l < n; ++l) prefix[l + 1] = prefix[l] + cost[l];
  // Cost of layers [pos[a], pos[b]); costs are >= 0, so it grows as a falls.
  const auto seg = [&](std::size_t a, std::size_t b) { return prefix[pos[b]] - prefix[pos[a]]; };
  const std::size_t S = static_cast<std::size_t>(stages);
  constexpr double inf = std::numeric_limits<double>::infinity();

  // Pass 1: f[s][b], the least maximum over s + 1 stages covering [0, pos[b]).
  std::vector<std::vector<double>> f(S, std::vector<double>(m, inf));
  for (std::size_t b = 1; b < m; ++b) f[0][b] = seg(0, b);
  for (std::size_t s = 1; s < S; ++s)
    for (std::size_t b = s + 1; b < m; ++b) {
      double best = inf;
      for (std::size_t a = b - 1; a >= s; --a) {
        const double c = seg(a, b);
        if (c >= best) break;  // earlier a only costs more
        best = std::min(best, std::max(f[s - 1][a], c));
      }
      f[s][b] = best;
    }
  const double limit = f[S - 1][m - 1];

  // Pass 2: g[s][b], the least sum of squares with every stage at most `limit`; from[s][b] the
  // start of the last stage.
  std::vector<std::vector<double>> g(S, std::vector<double>(m, inf));
  std::vector<std::vector<std::size_t>> from(S, std::vector<std::size_t>(m, 0));
  for (std::size_t b = 1; b < m; ++b)
    if (seg(0, b) <= limit) g[0][b] = seg(0, b) * seg(0, b);
  for (std::size_t s = 1; s < S; ++s)
    for (std::size_t b = s + 1; b < m; ++b)
      for (std::size_t a = b - 1; a >= s; --a) {
        const double c = seg(a, b);
        if (c > limit) break;
        if (g[s - 1][a] == inf) continue;
        if (g[s - 1][a] + c * c <= g[s][b]) {  // <=: a falls, so ties go to the earliest cut
          g[s][b] = g[s - 1][a] + c * c;
          from[s][b] = a;
        }
      }

  std::vector<std::size_t> first(S, 0);
  std::size_t b = m - 1;
  for (std::size_t s = S - 1; s > 0; --s) {
    b = from[s][b];
    first[s] = pos[b];
  }
  return first;
}

inline std::vector<std::size_t> balance_stages(std::span<const double> cost, int stages,
                                               const std::vector<bool>& can_cut_before) {
  const detail::partition_impl::mask_copy mask(can_cut_before);
  return balance_stages(cost, stages, mask.span());
}

// Checks cut points given by a user and returns the first layer of every stage. `cuts` lists the
// first layer of each stage after the first: "--cuts 3,5" over 8 layers gives stages starting at
// 0, 3 and 5, so {3, 5} returns {0, 3, 5}; no cuts, one stage. Each cut must lie in [1, layers),
// exceed the one before (else a stage would be empty) and be allowed by can_cut_before. The error
// for a forbidden cut says "the cut before layer i " followed by `reason`, which by default is
// "is not allowed: layer i cannot start a stage"; a caller that knows why passes its own (e.g.
// "separates a relu from the linear it is fused into").
inline std::vector<std::size_t> check_cuts(std::span<const std::size_t> cuts, std::size_t layers,
                                           std::span<const bool> can_cut_before = {},
                                           std::string_view reason = {}) {
  namespace impl = detail::partition_impl;
  constexpr const char* where = "dml::parallel::check_cuts";
  if (layers == 0) fail<invalid_argument>(where, ": expected at least one layer to cut into stages, found 0");
  impl::check_mask(can_cut_before, layers, where);
  std::vector<std::size_t> first{0};
  for (std::size_t k = 0; k < cuts.size(); ++k) {
    const std::size_t c = cuts[k];
    if (c == 0)
      fail<invalid_argument>(where, ": cut ", k + 1, " is 0, expected a layer in [1, ", layers,
                             "): list the first layer of each stage after the first (the first starts at 0)");
    if (c >= layers)
      fail<invalid_argument>(where, ": cut ", k + 1, " is ", c, ", expected a layer in [1, ", layers,
                             ") (there are ", layers, " layers)");
    if (c <= first.back())
      fail<invalid_argument>(where, ": cut ", k + 1, " is ", c, " after ", first.back(),
                             ", expected increasing cuts: stage ", k, " would be empty");
    if (!impl::cuttable(can_cut_before, c)) {
      if (reason.empty())
        fail<invalid_argument>(where, ": the cut before layer ", c, " is not allowed: layer ", c,
                               " cannot start a stage");
      fail<invalid_argument>(where, ": the cut before layer ", c, " ", reason);
    }
    first.push_back(c);
  }
  return first;
}

inline std::vector<std::size_t> check_cuts(std::span<const std::size_t> cuts, std::size_t layers,
                                           const std::vector<bool>& can_cut_before, std::string_view reason = {}) {
  const detail::partition_impl::mask_copy mask(can_cut_before);
  return check_cuts(cuts, layers, mask.span(), reason);
}

// Parses "3,5" (a --cuts flag) into {3, 5}; an empty text gives no cuts. Only parsing: check_cuts
// judges the values.
inline std::vector<std::size_t> parse_cuts(std::string_view text) {
  std::vector<std::size_t> out;
  if (text.empty()) return out;
  std::size_t at = 0;
  while (true) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    const std::string_view item = text.substr(at, comma - at);
    std::size_t v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc{} || end != item.data() + item.size())
      fail<invalid_argument>("dml::parallel::parse_cuts: expected layer numbers separated by commas (\"3,5\"), found '",
                             item, "' in '", text, "'");
    out.push_back(v);
    if (comma == text.size()) return out;
    at = comma + 1;
  }
}

}  // namespace dml::parallel
