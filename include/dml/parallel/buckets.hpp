// SPDX-License-Identifier: Apache-2.0
// dml/parallel/buckets.hpp — gradient buckets over a flat parameter layout, and the piece of each that a rank owns.
// Sits on nn/network.hpp (param_layout); the data-parallel and ZeRO code in train/ reduces, gathers and updates by them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "dml/nn/network.hpp"

namespace dml::parallel {

// Whole layers, contiguous in the flat buffers. Each bucket splits into one equal part per rank
// (the layout pads every parameter so it does); a rank's shard is its part of every bucket.
struct bucket {
  std::size_t first_layer = 0, last_layer = 0;  // inclusive range of layers
  std::size_t first_slot = 0, end_slot = 0;     // slots of those layers
  std::int64_t lo = 0, hi = 0;                   // flat range
  std::int64_t part = 0;                         // (hi − lo) / ranks
  std::int64_t shard_offset = 0;                 // where this bucket's part lives in shard buffers
};

struct bucket_plan {
  std::vector<bucket> buckets;    // in backward order: bucket 0 holds the last layers
  std::vector<int> layer_bucket;  // per layer of the model; −1 for layers without parameters here
};

// Buckets of whole layers from the last layer backwards, each at least `target` floats (the last may
// be smaller); layers without parameters join the bucket being filled. A bucket never spans two of
// `ranges` (a pipeline rank's chunks), so each is complete when its chunk's last backward is.
inline bucket_plan make_buckets(const nn::param_layout& L, std::size_t layers, std::int64_t target, int ranks,
                                std::span<const nn::layer_range> ranges = {}) {
  bucket_plan out;
  out.layer_bucket.assign(layers, -1);
  std::optional<bucket> open;
  auto close = [&] {
    if (open && open->hi > open->lo) {
      open->part = (open->hi - open->lo) / ranks;
      out.buckets.push_back(*open);
    }
    open.reset();
  };
  for (std::size_t l = layers; l-- > 0;) {
    const std::size_t s0 = L.first_slot[l], s1 = L.first_slot[l + 1];
    if (s0 != s1) {
      const std::int64_t lo = L.slots[s0].offset;
      const std::int64_t hi = s1 < L.slots.size() ? L.slots[s1].offset : L.total;
      if (!open) open = bucket{.first_layer = l, .last_layer = l, .first_slot = s0, .end_slot = s1, .lo = lo, .hi = hi};
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
  std::vector<std::size_t> by_offset(out.buckets.size());
  for (std::size_t i = 0; i < by_offset.size(); ++i) by_offset[i] = i;
  std::ranges::sort(by_offset, [&](auto a, auto b) { return out.buckets[a].lo < out.buckets[b].lo; });
  std::int64_t off = 0;
  for (auto b : by_offset) {
    out.buckets[b].shard_offset = off;
    off += out.buckets[b].part;
  }
  return out;
}

// The elements [begin, end) of a slot that lie in rank r's part of its bucket, at `flat` in the
// full buffers and at `shard` in shard buffers.
struct owned_piece {
  std::size_t slot;
  std::int64_t begin, end, flat, shard;
};

inline std::vector<owned_piece> owned_pieces(const nn::param_layout& L, std::span<const bucket> buckets, int r) {
  std::vector<owned_piece> out;
  for (const auto& bk : buckets) {
    const std::int64_t p0 = bk.lo + r * bk.part, p1 = p0 + bk.part;
    for (std::size_t s = bk.first_slot; s < bk.end_slot; ++s) {
      const std::int64_t o = L.slots[s].offset, b = std::max(o, p0), e = std::min(o + L.slots[s].shape.numel(), p1);
      if (b < e) out.push_back({s, b - o, e - o, b, bk.shard_offset + (b - p0)});
    }
  }
  std::ranges::sort(out, [](const auto& a, const auto& b) { return a.flat < b.flat; });
  return out;
}

}  // namespace dml::parallel
