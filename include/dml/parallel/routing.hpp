// SPDX-License-Identifier: Apache-2.0
// dml/parallel/routing.hpp — a step's routing summary: what the mixture-of-experts layers recorded, summed over
// micro-batches and layers, then over the pipeline's stages; and loss-free balancing's bias update after a step.
// Sits on nn/ (routing_log) and comm/; the trainer fills step_result::routing with it and moves the biases.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/core/algorithm.hpp"
#include "dml/nn/layer.hpp"

namespace dml::parallel {

// The most unevenly loaded layer's busiest expert over its mean, of per-layer token counts (empty layers skipped; 1:
// perfectly even; 0: no tokens).
inline double worst_imbalance(const std::vector<std::vector<std::int64_t>>& layer_tokens) {
  double worst = 0;
  for (const auto& l : layer_tokens) {
    std::int64_t most = 0, sum = 0;
    for (auto t : l) most = std::max(most, t), sum += t;
    if (sum > 0) worst = std::max(worst, static_cast<double>(most) * static_cast<double>(l.size()) / static_cast<double>(sum));
  }
  return worst;
}

// What the mixture-of-experts layers did in a step: summed over the step's micro-batches and MoE layers (over
// every pipeline stage), the same on every rank. Empty for a model without one.
struct routing_summary {
  double aux_loss = 0, z_loss = 0;  // unweighted by their loss weights; each micro-batch's by its share of the batch
  std::vector<std::int64_t> tokens{}, dropped{};  // per expert: top-k assignments routed to it, and those dropped
  std::int64_t a2a_bytes = 0;                 // this rank's all-to-all payload sent in forward
  // Per layer of the whole model (its flat index; empty for a layer without experts): top-k assignments per expert,
  // summed over the step's micro-batches. worst_imbalance(layer_tokens) of a step, or summed over steps.
  std::vector<std::vector<std::int64_t>> layer_tokens{};
  double worst_layer_imbalance() const { return worst_imbalance(layer_tokens); }
  // Load imbalance of the counts summed over layers: the busiest expert's tokens over the mean (1: perfectly even).
  double imbalance() const {
    std::int64_t most = 0, sum = 0;
    for (auto t : tokens) most = t > most ? t : most, sum += t;
    return sum > 0 ? static_cast<double>(most) * static_cast<double>(tokens.size()) / static_cast<double>(sum) : 0.0;
  }
};

// Sums a step's records. `experts` is the model's expert count per MoE layer (0: none, and nothing is
// summed); pp (null: one stage) sums over the stages, each of which holds its own layers' records (every rank
// of a stage holds the same).
template <class Space, comm::communicator Comm>
routing_summary summarise_routing(const nn::routing_log& log, std::int64_t experts, Comm* pp) {
  routing_summary out;
  if (experts == 0) return out;
  // [aux, z, tokens..., dropped...] as doubles: exact for counts below 2^53.
  std::vector<double> v(static_cast<std::size_t>(2 + 2 * experts), 0.0);
  std::int64_t bytes = 0;
  std::map<std::uint64_t, std::vector<double>> by_layer;
  for (const auto& [key, r] : log.records) {
    auto& l = by_layer[key.first];
    l.resize(r.tokens.size(), 0.0);
    for (std::size_t e = 0; e < r.tokens.size(); ++e) l[e] += static_cast<double>(r.tokens[e]);
    v[0] += r.share * r.aux_loss;
    v[1] += r.share * r.z_loss;
    for (std::size_t e = 0; e < r.tokens.size(); ++e) {
      v[2 + e] += static_cast<double>(r.tokens[e]);
      v[2 + static_cast<std::size_t>(experts) + e] += static_cast<double>(r.dropped[e]);
    }
    bytes += r.a2a_bytes;
  }
  // Each stage holds its own layers: per-layer counts as one [layers, experts] array summed over the stages.
  double layers = by_layer.empty() ? 0 : static_cast<double>(by_layer.rbegin()->first + 1);
  const bool stages = pp && pp->size() > 1;
  if (stages) comm::all_reduce_host(*pp, std::span<double>(&layers, 1), comm::reduce_op::max);
  const auto L = static_cast<std::size_t>(layers), E = static_cast<std::size_t>(experts);
  std::vector<double> per_layer(L * E, 0.0);
  for (const auto& [layer, l] : by_layer)
    for (std::size_t e = 0; e < l.size() && e < E; ++e) per_layer[layer * E + e] = l[e];
  if (stages) {
    comm::all_reduce_host(*pp, std::span<double>(v), comm::reduce_op::sum);
    comm::all_reduce_host(*pp, std::span<double>(per_layer), comm::reduce_op::sum);
  }
  out.layer_tokens.resize(L);
  for (std::size_t l = 0; l < L; ++l) {
    double sum = 0;
    for (std::size_t e = 0; e < E; ++e) sum += per_layer[l * E + e];
    if (sum > 0)
      for (std::size_t e = 0; e < E; ++e) out.layer_tokens[l].push_back(static_cast<std::int64_t>(per_layer[l * E + e]));
  }
  out.aux_loss = v[0];
  out.z_loss = v[1];
  for (std::int64_t e = 0; e < experts; ++e) {
    out.tokens.push_back(static_cast<std::int64_t>(v[static_cast<std::size_t>(2 + e)]));
    out.dropped.push_back(static_cast<std::int64_t>(v[static_cast<std::size_t>(2 + experts + e)]));
  }
  out.a2a_bytes = bytes;
  return out;
}

// The model's expert count per MoE layer, from one step's records: the most over the pipeline's stages (a
// stage may hold no MoE layer). One collective; the trainer asks once.
template <class Space, comm::communicator Comm>
std::int64_t count_experts(const nn::routing_log& log, Comm* pp) {
  std::int64_t e = 0;
  for (const auto& [key, r] : log.records) e = std::max<std::int64_t>(e, static_cast<std::int64_t>(r.tokens.size()));
  if (!pp || pp->size() == 1) return e;
  comm::all_reduce_host(*pp, std::span<std::int64_t>(&e, 1), comm::reduce_op::max);
  return e;
}

// Loss-free balancing (DeepSeek-V3) after a step: each layer that recorded a bias rate moves its selection bias
// by that rate toward equal load, up for an expert that took fewer of the step's assignments than the mean and
// down for one that took more. Every rank of a data group recorded the same counts, so their biases stay equal.
inline void update_router_bias(nn::routing_log& log) {
  std::map<std::uint64_t, std::pair<float, std::vector<double>>> load;  // by layer: rate, assignments per expert
  for (const auto& [key, r] : log.records) {
    if (r.bias_rate <= 0.f) continue;
    auto& [rate, sum] = load[key.first];
    rate = r.bias_rate;
    sum.resize(r.tokens.size(), 0.0);
    for (std::size_t e = 0; e < r.tokens.size(); ++e) sum[e] += static_cast<double>(r.tokens[e]);
  }
  for (auto& [layer, rl] : load) {
    const auto& [rate, sum] = rl;
    double mean = 0;
    for (double x : sum) mean += x;
    mean /= static_cast<double>(sum.size());
    auto& b = log.router_bias[layer];
    b.resize(sum.size(), 0.f);
    for (std::size_t e = 0; e < sum.size(); ++e) b[e] += sum[e] < mean ? rate : sum[e] > mean ? -rate : 0.f;
  }
}

}  // namespace dml::parallel
