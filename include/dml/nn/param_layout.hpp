// SPDX-License-Identifier: Apache-2.0
// dml/nn/param_layout.hpp — where a sequential's parameters live in one flat buffer (slots, 64-byte aligned, padded
// for sharding), layer ranges, and the kernels that give a parameter, or any range of it, its initial values.
// Sits on nn/sequential.hpp and core/rng.hpp; nn/network.hpp allocates by it, parallel/ buckets and shards it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dml/core/config.hpp"
#include "dml/core/error.hpp"
#include "dml/core/rng.hpp"
#include "dml/nn/sequential.hpp"

namespace dml::nn {

// Where each parameter lives in the flat buffer. Gradients and optimizer states use the same offsets.
struct param_slot {
  std::string name;
  dml::shape shape;
  std::size_t layer = 0;
  std::int64_t offset = 0;
  param_spec spec;
  std::size_t id = 0;       // index among all the model's parameters
  std::size_t init_id = 0;  // its initial values follow (seed, init_id): its own id, or a tied parameter's
};

// Layers [first, end) of a sequential: a pipeline stage, or one chunk of an interleaved one.
struct layer_range {
  std::size_t first = 0, end = 0;
  bool contains(std::size_t l) const { return first <= l && l < end; }
  friend bool operator==(const layer_range&, const layer_range&) = default;
};

struct param_layout {
  // Each parameter starts on a 64-byte boundary, so a bucket or shard boundary never splits a vector lane.
  static constexpr std::int64_t alignment = 16;
  std::int64_t padding_unit = alignment;  // what each slot was rounded to
  std::vector<param_slot> slots;
  std::vector<std::size_t> first_slot;  // per layer, plus one past the end
  std::int64_t total = 0;               // floats, padding included
  std::int64_t numel = 0;               // floats, padding excluded

  const param_slot& find(std::string_view name) const {
    for (const auto& s : slots)
      if (s.name == name) return s;
    std::string have;
    for (const auto& s : slots) have += (have.empty() ? "" : ", ") + s.name;
    fail<invalid_argument>("dml::nn::param_layout: no parameter named '", name, "'; the model has: ", have);
  }
};

// alignment: floats each parameter's start and the total are rounded to (a multiple of 16; sharded
// trainers pass 16·ranks so every parameter splits into equal, aligned per-rank parts).
// held: the layers whose parameters the layout holds (a pipeline stage's); empty means all of them.
template <class... Layers>
param_layout make_layout(const sequential<Layers...>& model, std::int64_t alignment = param_layout::alignment,
                         std::span<const layer_range> held = {}) {
  if (alignment <= 0 || alignment % param_layout::alignment != 0)
    fail<invalid_argument>("dml::nn::make_layout: expected an alignment that is a positive multiple of ",
                           param_layout::alignment, ", found ", alignment);
  auto holds = [&](std::size_t l) {
    return held.empty() || std::ranges::any_of(held, [&](const layer_range& r) { return r.contains(l); });
  };
  param_layout out;
  const std::size_t depth = model.depth();
  out.first_slot.assign(depth + 1, 0);
  std::int64_t offset = 0;
  std::size_t id = 0;
  const auto all = model.parameters();
  auto id_of = [&](const std::string& name, const std::string& tied) {
    for (std::size_t i = 0; i < all.size(); ++i)
      if (all[i].second.name == tied) return i;
    fail<invalid_argument>("dml::nn::make_layout: parameter '", name, "' is tied to '", tied, "', which the model lacks");
  };
  for (auto& [layer, spec] : all) {
    if (!holds(layer)) {
      ++id;
      continue;
    }
    const std::int64_t n = spec.shape.numel();
    const std::size_t init_id = spec.tied_to.empty() ? id : id_of(spec.name, spec.tied_to);
    out.slots.push_back({spec.name, spec.shape, layer, offset, spec, id++, init_id});
    offset += (n + alignment - 1) / alignment * alignment;
    out.numel += n;
  }
  out.total = offset;
  out.padding_unit = alignment;
  for (std::size_t l = 0, s = 0; l <= depth; ++l) {
    while (s < out.slots.size() && out.slots[s].layer < l) ++s;
    out.first_slot[l] = s;
  }
  return out;
}

// The parameters without their padding, slot after slot: what layouts of every alignment (world size, sharding)
// hold alike. `padded` has l.total floats; unpack() is the inverse, into another layout of the same model.
inline std::vector<float> pack(const param_layout& l, std::span<const float> padded) {
  if (static_cast<std::int64_t>(padded.size()) != l.total)
    fail<invalid_argument>("dml::nn::pack: expected ", l.total, " floats (padding included), found ", padded.size());
  std::vector<float> out;
  out.reserve(static_cast<std::size_t>(l.numel));
  for (const auto& s : l.slots)
    out.insert(out.end(), padded.begin() + s.offset, padded.begin() + s.offset + s.shape.numel());
  return out;
}
inline std::vector<float> unpack(const param_layout& l, std::span<const float> packed) {
  if (static_cast<std::int64_t>(packed.size()) != l.numel)
    fail<invalid_argument>("dml::nn::unpack: expected ", l.numel, " floats (no padding), found ", packed.size());
  std::vector<float> out(static_cast<std::size_t>(l.total), 0.f);
  std::size_t at = 0;
  for (const auto& s : l.slots) {
    const auto n = static_cast<std::size_t>(s.shape.numel());
    std::copy_n(packed.begin() + static_cast<std::ptrdiff_t>(at), n, out.begin() + s.offset);
    at += n;
  }
  return out;
}

namespace kernels {
template <class T = float>
struct init_param {
  rng_stream rng;
  init_kind kind;
  float a, b;
  T* w;
  param_shard shard;  // element i of a tensor-parallel part draws the whole parameter's element
  DML_HOST_DEVICE static float value(const rng_stream& rng, init_kind kind, float a, float b, std::uint64_t k) {
    switch (kind) {
      case init_kind::ones: return 1.f;
      case init_kind::uniform: return rng.uniform(k, a, b);
      case init_kind::normal: return rng.normal(k, a, b);
      case init_kind::zeros: break;
    }
    return 0.f;
  }
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    w[i] = T(value(rng, kind, a, b, static_cast<std::uint64_t>(shard.whole_index(i))));
  }
};
// Elements [first, first + n) of a parameter, written to out[0, n).
struct init_param_range {
  rng_stream rng;
  init_kind kind;
  float a, b;
  float* out;
  std::int64_t first;
  param_shard shard;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    out[i] = init_param<>::value(rng, kind, a, b, static_cast<std::uint64_t>(shard.whole_index(first + i)));
  }
};
}  // namespace kernels

}  // namespace dml::nn
