// SPDX-License-Identifier: Apache-2.0
// dml/parallel/ownership.hpp — one rule for what a rank owns, which checkpoints write and gradient norms count:
// its part of each run of every bucket, less the copies another rank counts. Sits on parallel/buckets.hpp; the
// shardings report their pieces by it (owned_pieces), and the engine leaves out what it marks uncounted.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "dml/parallel/buckets.hpp"

namespace dml::parallel {

// The elements [begin, end) of a slot that lie in a rank's part of its run, at `flat` in the full buffers
// and at `shard` in shard buffers.
struct owned_piece {
  std::size_t slot;
  std::int64_t begin, end, flat, shard;
};

// A rank's pieces: in each run, the part of the rank's index in that run's group (rank[axis]).
inline std::vector<owned_piece> owned_pieces(const nn::param_layout& L, std::span<const bucket> buckets, shard_ranks rank) {
  std::vector<owned_piece> out;
  for (const auto& bk : buckets)
    for (const auto& run : bk.runs) {
      const std::int64_t p0 = run.lo + rank[run.axis] * run.part, p1 = p0 + run.part;
      for (std::size_t s = run.first_slot; s < run.end_slot; ++s) {
        const std::int64_t o = L.slots[s].offset, b = std::max(o, p0), e = std::min(o + L.slots[s].shape.numel(), p1);
        if (b < e) out.push_back({s, b - o, e - o, b, run.shard_offset + (b - p0)});
      }
    }
  std::ranges::sort(out, [](const auto& a, const auto& b) { return a.flat < b.flat; });
  return out;
}

// Per slot of this rank: left out of the gradient norm because another rank counts it. Tensor ranks other
// than 0 leave out the copies the tensor group shares (layers without a tensor-parallel form, and replicated
// parts such as biases after a row split); a tied parameter leaves it to the parameter it is tied to.
// (Replicas other than the first own nothing: their shardings report it, see writes_checkpoint.)
inline std::vector<bool> uncounted_slots(const nn::param_layout& L, int tp_rank) {
  std::vector<bool> out;
  out.reserve(L.slots.size());
  for (const auto& s : L.slots) out.push_back((tp_rank > 0 && !s.spec.shard.tensor_sharded()) || !s.spec.tied_to.empty());
  return out;
}

}  // namespace dml::parallel
