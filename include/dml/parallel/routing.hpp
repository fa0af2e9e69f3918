// SPDX-License-Identifier: Apache-2.0
// dml/parallel/routing.hpp — a step's routing summary: what the mixture-of-experts layers recorded, summed over
// micro-batches and layers, then over the pipeline's stages. Sits on nn/ (routing_log) and comm/;
// the trainer fills step_result::routing with it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/core/algorithm.hpp"
#include "dml/nn/layer.hpp"

namespace dml::parallel {

// What the mixture-of-experts layers did in a step: summed over the step's micro-batches and MoE layers (over
// every pipeline stage), the same on every rank. Empty for a model without one.
struct routing_summary {
  double aux_loss = 0, z_loss = 0;  // unweighted by their loss weights; each micro-batch's by its share of the batch
  std::vector<std::int64_t> tokens{}, dropped{};  // per expert: top-k assignments routed to it, and those dropped
  std::int64_t a2a_bytes = 0;                 // this rank's all-to-all payload sent in forward
  // Load imbalance: the busiest expert's tokens over the mean (1: perfectly even).
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
  for (const auto& [key, r] : log.records) {
    v[0] += r.share * r.aux_loss;
    v[1] += r.share * r.z_loss;
    for (std::size_t e = 0; e < r.tokens.size(); ++e) {
      v[2 + e] += static_cast<double>(r.tokens[e]);
      v[2 + static_cast<std::size_t>(experts) + e] += static_cast<double>(r.dropped[e]);
    }
    bytes += r.a2a_bytes;
  }
  if (pp && pp->size() > 1) comm::all_reduce_host(*pp, std::span<double>(v), comm::reduce_op::sum);
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

}  // namespace dml::parallel
