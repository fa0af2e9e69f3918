// SPDX-License-Identifier: Apache-2.0
// dml/plan/exact.hpp — dml's own bytes for a model it can build: model states from the flat layout's arithmetic
// and an activation set from the layers' shape rules and saved_bytes, without allocating a parameter.
// Sits on nn/ (sequential, param_layout, network's fusion rule); used by tests and tools/dml-plan. See DESIGN.md §7.
#pragma once

#include <cstdint>
#include <span>
#include <tuple>

#include "dml/nn/network.hpp"
#include "dml/nn/param_layout.hpp"
#include "dml/nn/sequential.hpp"

namespace dml::cost {

// What parallel::replicate and parallel::zero<Stage>'s memory() report, computed before building them.
struct state_bytes {
  std::int64_t numel = 0, padded = 0, params = 0, grads = 0, optimizer = 0;  // optimizer: state + master weights
  friend bool operator==(const state_bytes&, const state_bytes&) = default;
};

// zero: 0 (replicate) to 3; ranks: the data-parallel ranks (every sharding pads each parameter to 16·ranks floats); working_bytes: 4 (fp32) or 2;
// slots: the optimizer's state_slots; streams: ZeRO-2/3 reduce each backward into the shard (one stage,
// whole backward) rather than into whole gradients per step (pipelines).
// The model must carry this rank's tensor-parallel part already (nn::set_tensor_split).
template <class... L>
state_bytes model_states(const nn::sequential<L...>& model, int zero, int ranks, std::int64_t working_bytes, int slots,
                         bool streams = true, std::span<const nn::layer_range> held = {}) {
  if (zero < 0 || zero > 3 || ranks < 1)
    fail<invalid_argument>("dml::cost::model_states: expected zero 0 to 3 and ranks >= 1, found ", zero, " and ", ranks);
  const bool mixed = working_bytes != 4;
  const std::int64_t unit = nn::param_layout::alignment * ranks;  // replicate pads as ZeRO does
  const auto lay = nn::make_layout(model, unit, held);
  const std::int64_t shard = zero > 0 ? lay.total / ranks : lay.total;
  state_bytes s{.numel = lay.numel, .padded = lay.total};
  s.params = (zero == 3 ? shard : lay.total) * working_bytes;
  s.grads = (zero >= 2 && streams ? shard : lay.total) * working_bytes;
  s.optimizer = shard * slots * 4 + (mixed ? shard * 4 : 0);
  return s;
}

// Bytes of one activation set of layers [first, end) (network::activations::bytes()): the layer outputs (a relu
// fused into its linear has none), what each layer keeps for backward rounded up to floats, and the input in
// the working type where the network casts it. x: the range's input shape. As activations::bytes() counts them,
// a tensor left unsized (the float input read in place, the outputs of layers outside the range) is one element:
// tensor's empty shape has rank 0, and a product of no dimensions is 1.
template <class... L>
std::int64_t activation_set_bytes(const nn::sequential<L...>& model, dml::shape x, std::int64_t working_bytes,
                                  nn::layer_range range = {}) {
  using net = nn::basic_network<host, float, L...>;
  const auto absorbed = net::absorbed_layers(model);
  if (range.end == 0) range.end = model.depth();
  std::int64_t values = 0, kept = 0;
  constexpr bool first_takes_float = requires { requires std::tuple_element_t<0, std::tuple<L...>>::float_input; };
  values += range.first > 0 || (working_bytes != 4 && !first_takes_float) ? x.numel() : 1;
  values += static_cast<std::int64_t>(model.depth() - (range.end - range.first));
  model.for_each_layer([&](std::size_t i, const auto& l) {
    if (!range.contains(i)) return;
    const std::int64_t saved = nn::saved_bytes(l, x, static_cast<std::size_t>(working_bytes));
    kept += (saved + 3) / 4 * 4;
    x = l.output_shape(x);
    if (!absorbed[i]) values += x.numel();
  });
  return values * working_bytes + kept;
}

}  // namespace dml::cost
