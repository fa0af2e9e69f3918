// SPDX-License-Identifier: Apache-2.0
// dml/parallel/master_weights.hpp — the float weights an optimizer updates: whole, or a rank's part of each bucket.
// Sits on nn/network.hpp and parallel/buckets.hpp; replicate keeps them whole under mixed precision, ZeRO as a shard.
#pragma once

#include <cstdint>

#include "dml/core/algorithm.hpp"
#include "dml/nn/network.hpp"
#include "dml/parallel/buckets.hpp"

namespace dml::parallel {

// Every parameter's initial float values at its offset in the flat layout (padding zero): the values
// the network's own init gives, so every layout and precision starts from the same weights.
template <class Net>
void init_master(const Net& net, std::uint64_t seed, float* out) {
  using Space = typename Net::space;
  const auto& L = net.layout();
  fill_n<Space>(out, L.total, 0.f);
  for (std::size_t s = 0; s < L.slots.size(); ++s) net.init_range(seed, s, 0, L.slots[s].shape.numel(), out + L.slots[s].offset);
}

// A rank's part of run rn's initial float values (r: its index in the run's group), written where the
// part lives in a shard.
template <class Net>
void init_master_part(const Net& net, std::uint64_t seed, const run& rn, int r, float* shard) {
  using Space = typename Net::space;
  const auto& L = net.layout();
  buffer<float, Space> tmp(static_cast<std::size_t>(rn.hi - rn.lo));
  fill_n<Space>(tmp.data(), rn.hi - rn.lo, 0.f);
  for (std::size_t s = rn.first_slot; s < rn.end_slot; ++s)
    net.init_range(seed, s, 0, L.slots[s].shape.numel(), tmp.data() + (L.slots[s].offset - rn.lo));
  dml::copy_n(tmp.data() + r * rn.part, static_cast<std::size_t>(rn.part), shard + rn.shard_offset);
}

}  // namespace dml::parallel
