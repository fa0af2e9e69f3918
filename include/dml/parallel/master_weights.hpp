// SPDX-License-Identifier: Apache-2.0
// dml/parallel/master_weights.hpp — the float weights an optimizer updates: whole, or a rank's part of each bucket.
// Sits on nn/network.hpp and parallel/buckets.hpp; replicate keeps them whole under mixed precision, ZeRO as a shard.
#pragma once

#include <algorithm>
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
// part lives in a shard: each parameter's elements in the part straight from init_range, padding zero, so
// no rank ever holds more than its part.
template <class Net>
void init_master_part(const Net& net, std::uint64_t seed, const run& rn, int r, float* shard) {
  using Space = typename Net::space;
  const auto& L = net.layout();
  const std::int64_t lo = rn.lo + r * rn.part, hi = lo + rn.part;  // the part's flat range
  float* out = shard + rn.shard_offset;
  fill_n<Space>(out, rn.part, 0.f);
  for (std::size_t s = rn.first_slot; s < rn.end_slot; ++s) {
    const std::int64_t first = L.slots[s].offset, end = first + L.slots[s].shape.numel();
    const std::int64_t a = std::max(lo, first), b = std::min(hi, end);
    if (a < b) net.init_range(seed, s, a - first, b - first, out + (a - lo));
  }
}

}  // namespace dml::parallel
