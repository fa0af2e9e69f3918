// SPDX-License-Identifier: Apache-2.0
// dml/parallel/buckets.hpp — gradient buckets over a flat parameter layout, and their runs. Sits on
// nn/network.hpp (param_layout); the shardings reduce, gather and update by them; parallel/ownership.hpp says
// which piece of each run a rank owns.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dml/nn/network.hpp"

namespace dml::parallel {

// The group a run of slots reduces over: the dense data-parallel (shard) group, or, for experts split over
// an expert group, the ranks that hold the same experts (the expert-data-parallel shard group).
enum class shard_axis : std::uint8_t { dense, expert };
inline constexpr int shard_axes = 2;

inline shard_axis axis_of(const nn::param_slot& s) {
  return s.spec.shard.expert_sharded() ? shard_axis::expert : shard_axis::dense;
}

// Slots of one bucket that reduce over one group and split into equal parts over its ranks. A bucket has
// several runs when it mixes expert and dense slots (a mixture-of-experts layer) or holds a tied parameter:
// a tied parameter and the parameter it is tied to are each a run alone, so rank r owns the same elements of
// both copies and their gradients sum shard by shard.
struct run {
  std::size_t first_slot = 0, end_slot = 0;
  std::int64_t lo = 0, hi = 0;        // flat range, padding included
  shard_axis axis = shard_axis::dense;
  std::int64_t part = 0;              // (hi − lo) / ranks of its group
  std::int64_t shard_offset = 0;      // where this run's part lives in shard buffers
};

// Whole layers, contiguous in the flat buffers.
struct bucket {
  std::size_t first_layer = 0, last_layer = 0;  // inclusive range of layers
  std::size_t first_slot = 0, end_slot = 0;     // slots of those layers
  std::int64_t lo = 0, hi = 0;                   // flat range
  std::vector<run> runs;                         // in flat order
};

struct bucket_plan {
  std::vector<bucket> buckets;    // in backward order: bucket 0 holds the last layers
  std::vector<int> layer_bucket;  // per layer of the model; −1 for layers without parameters here
  std::int64_t shard = 0;         // floats of a rank's shard: the sum of its runs' parts
};

// The ranks of each shard group, indexed by shard_axis.
struct shard_ranks {
  int dense = 1, expert = 1;
  int operator[](shard_axis a) const { return a == shard_axis::expert ? expert : dense; }
};

// alone[s]: slot s is a run by itself (a tied parameter, or one that another parameter is tied to).
inline std::vector<bool> tied_slots(const nn::param_layout& L, std::span<const std::string> tie_targets) {
  std::vector<bool> out(L.slots.size(), false);
  for (std::size_t s = 0; s < L.slots.size(); ++s)
    out[s] = !L.slots[s].spec.tied_to.empty() || std::ranges::find(tie_targets, L.slots[s].name) != tie_targets.end();
  return out;
}

// Buckets of whole layers from the last layer backwards, each at least `target` floats (the last may
// be smaller); layers without parameters join the bucket being filled. A bucket never spans two of
// `ranges` (a pipeline rank's chunks), so each is complete when its chunk's last backward is.
inline bucket_plan make_buckets(const nn::param_layout& L, std::size_t layers, std::int64_t target, shard_ranks ranks,
                                std::span<const nn::layer_range> ranges = {}, const std::vector<bool>& alone = {}) {
  bucket_plan out;
  out.layer_bucket.assign(layers, -1);
  std::optional<bucket> open;
  auto end_of = [&](std::size_t s) { return s < L.slots.size() ? L.slots[s].offset : L.total; };
  auto close = [&] {
    if (open && open->hi > open->lo) {
      for (std::size_t s = open->first_slot; s < open->end_slot;) {
        const auto axis = axis_of(L.slots[s]);
        const bool single = !alone.empty() && alone[s];
        std::size_t e = s + 1;
        while (!single && e < open->end_slot && axis_of(L.slots[e]) == axis && !(!alone.empty() && alone[e])) ++e;
        const std::int64_t lo = L.slots[s].offset, hi = end_of(e);
        open->runs.push_back({.first_slot = s, .end_slot = e, .lo = lo, .hi = hi, .axis = axis,
                              .part = (hi - lo) / ranks[axis], .shard_offset = 0});
        s = e;
      }
      out.buckets.push_back(*open);
    }
    open.reset();
  };
  for (std::size_t l = layers; l-- > 0;) {
    const std::size_t s0 = L.first_slot[l], s1 = L.first_slot[l + 1];
    if (s0 != s1) {
      const std::int64_t lo = L.slots[s0].offset, hi = end_of(s1);
      if (!open) open = bucket{.first_layer = l, .last_layer = l, .first_slot = s0, .end_slot = s1, .lo = lo, .hi = hi, .runs = {}};
      else {
        open->first_layer = l;
        open->first_slot = s0;
        open->lo = lo;
      }
      if (open->hi - open->lo >= target) close();
    }
    if (std::ranges::any_of(ranges, [&](const nn::layer_range& r) { return r.first == l; })) close();
  }
  close();
  for (std::size_t b = 0; b < out.buckets.size(); ++b)
    for (std::size_t l = out.buckets[b].first_layer; l <= out.buckets[b].last_layer; ++l)
      out.layer_bucket[l] = static_cast<int>(b);
  // Shard layout follows the flat order, so a shard is the concatenation of its parts by offset.
  std::vector<run*> by_offset;
  for (auto& bk : out.buckets)
    for (auto& r : bk.runs) by_offset.push_back(&r);
  std::ranges::sort(by_offset, [](const run* a, const run* b) { return a->lo < b->lo; });
  for (run* r : by_offset) {
    r->shard_offset = out.shard;
    out.shard += r->part;
  }
  return out;
}

}  // namespace dml::parallel
