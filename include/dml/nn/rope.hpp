// SPDX-License-Identifier: Apache-2.0
// dml/nn/rope.hpp — rotary position embeddings (Hugging Face's rotate-half pairing, Llama 3.1's frequency
// scaling) applied in place to q and k in a fused qkv row, and their gradients. Sits on core/algorithm.hpp and
// nn/detail/rows.hpp; the cos/sin table is built once on the host.
#pragma once

#include <cmath>
#include <concepts>
#include <cstdint>
#include <optional>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"
#include "dml/core/space.hpp"
#include "dml/nn/detail/rows.hpp"

namespace dml::nn {

// Llama 3.1's scaling of the frequencies (Hugging Face's rope_type "llama3"), with Llama 3.1's values as defaults.
// Of a frequency f with wavelength λ = 2π/f: λ < original/high_freq_factor keeps f; λ > original/low_freq_factor
// gives f/factor; between the two, (1 − s)·f/factor + s·f with s = (original/λ − low_freq_factor) /
// (high_freq_factor − low_freq_factor).
struct rope_scaling {
  double factor = 8, low_freq_factor = 1, high_freq_factor = 4;
  double original_max_position_embeddings = 8192;
};
struct rope_config {
  double theta = 10000;
  std::optional<rope_scaling> scaling{};  // none: plain RoPE
};

// head_dim / 2 inverse frequencies f_i = theta^(−2i/head_dim), scaled as c.scaling says; in double.
inline std::vector<double> rope_inverse_frequencies(const rope_config& c, std::int64_t head_dim) {
  constexpr const char* what = "dml::nn::rope_inverse_frequencies";
  if (head_dim <= 0 || head_dim % 2 != 0)
    fail<invalid_argument>(what, ": expected an even head_dim > 0, found head_dim = ", head_dim);
  if (!(c.theta > 0)) fail<invalid_argument>(what, ": expected theta > 0, found theta = ", c.theta);
  std::vector<double> f(static_cast<std::size_t>(head_dim / 2));
  for (std::size_t i = 0; i < f.size(); ++i)
    f[i] = 1.0 / std::pow(c.theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
  if (!c.scaling) return f;
  const rope_scaling& s = *c.scaling;
  if (!(s.factor > 0)) fail<invalid_argument>(what, ": expected scaling factor > 0, found factor = ", s.factor);
  if (!(s.high_freq_factor > s.low_freq_factor && s.low_freq_factor > 0))
    fail<invalid_argument>(what, ": expected 0 < low_freq_factor < high_freq_factor, found low_freq_factor = ",
                           s.low_freq_factor, ", high_freq_factor = ", s.high_freq_factor);
  const double pi = 3.14159265358979323846;
  const double old = s.original_max_position_embeddings;
  const double low_wavelength = old / s.low_freq_factor, high_wavelength = old / s.high_freq_factor;
  for (double& v : f) {
    const double wavelength = 2 * pi / v;
    if (wavelength > low_wavelength) {
      v /= s.factor;
    } else if (wavelength >= high_wavelength) {
      const double smooth = (old / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      v = (1 - smooth) * v / s.factor + smooth * v;
    }
  }
  return f;
}

// What the kernels read: cos(p·f_i) at cos[p·half + i] and sin(p·f_i) at sin[p·half + i], for positions p in
// [0, positions) and i in [0, half), in the space of the call (for cuda, a device copy of a rope_table's values).
struct rope_table_view {
  const float *cos = nullptr, *sin = nullptr;
  std::int64_t positions = 0, half = 0;
};

// The table on the host for positions [0, max_positions) and a head of head_dim: each angle p·f_i and its cos and
// sin in double, rounded once to float; values holds cos [max_positions, half] then sin, as view() points.
struct rope_table {
  std::int64_t positions = 0, half = 0;
  std::vector<float> values;
  rope_table() = default;
  rope_table(const rope_config& c, std::int64_t head_dim, std::int64_t max_positions) {
    if (max_positions <= 0)
      fail<invalid_argument>("dml::nn::rope_table: expected max_positions > 0, found max_positions = ", max_positions);
    const auto f = rope_inverse_frequencies(c, head_dim);
    positions = max_positions;
    half = head_dim / 2;
    values.resize(static_cast<std::size_t>(2 * positions * half));
    for (std::int64_t p = 0; p < positions; ++p)
      for (std::int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(p) * f[static_cast<std::size_t>(i)];
        values[static_cast<std::size_t>(p * half + i)] = static_cast<float>(std::cos(angle));
        values[static_cast<std::size_t>((positions + p) * half + i)] = static_cast<float>(std::sin(angle));
      }
  }
  rope_table_view view() const { return {values.data(), values.data() + positions * half, positions, half}; }
};

// Sizes of one call. qkv rows are tokens (b, t) of row-major [batch, seq], each [q: heads·head_dim | k:
// kv_heads·head_dim | v: kv_heads·head_dim] (grouped-query attention: kv_heads divides heads).
struct rope_shape {
  std::int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  std::int64_t width() const { return (heads + 2 * kv_heads) * head_dim; }  // a qkv row
};

namespace kernels {
// The rotation of one pair (x1, x2) = (x[i], x[i + head_dim/2]) of a head by the angle whose cos and sin are c and
// s: (x1·c − x2·s, x2·c + x1·s), i.e. x·cos + rotate_half(x)·sin. Its transpose (the gradient's) is the rotation
// by −angle: the same with −s.
DML_HOST_DEVICE float rope_first(float x1, float x2, float c, float s) { return x1 * c - x2 * s; }
DML_HOST_DEVICE float rope_second(float x1, float x2, float c, float s) { return x2 * c + x1 * s; }

// An element functor over tokens × (heads + kv_heads)·half pairs: q's heads and k's sit side by side at the start
// of a row, so they are rotated as heads + kv_heads heads alike. row(t) does one token's pairs (the same values),
// its position found once.
template <class T>
struct rope_rotate {
  T* qkv;
  const float *cos, *sin;  // [positions, head_dim/2]
  const std::int64_t* positions;  // null: a token's position is t, its index within its sequence
  std::int64_t seq, ld, head_dim, pairs;  // pairs: (heads + kv_heads)·half per token
  float sign;                              // +1 forward, −1 backward
  DML_HOST_DEVICE std::int64_t position(std::int64_t token) const { return positions ? positions[token] : token % seq; }
  DML_HOST_DEVICE void rotate(T* x, const float* c, const float* s, std::int64_t i) const {
    const std::int64_t half = head_dim / 2;
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]), sn = sign * s[i];
    x[i] = round_to<T>(rope_first(x1, x2, c[i], sn));
    x[i + half] = round_to<T>(rope_second(x1, x2, c[i], sn));
  }
  DML_HOST_DEVICE void operator()(std::int64_t e) const {
    const std::int64_t token = e / pairs, k = e % pairs, half = head_dim / 2, h = k / half, i = k % half;
    const std::int64_t p = position(token);
    rotate(qkv + token * ld + h * head_dim, cos + p * half, sin + p * half, i);
  }
  DML_HOST_DEVICE void row(std::int64_t token) const {
    const std::int64_t half = head_dim / 2, p = position(token);
    const float *c = cos + p * half, *s = sin + p * half;
    for (std::int64_t h = 0; h < pairs / half; ++h) {
      T* x = qkv + token * ld + h * head_dim;
      DML_SIMD
      for (std::int64_t i = 0; i < half; ++i) rotate(x, c, s, i);
    }
  }
};
}  // namespace kernels

namespace detail {
// The checks of rope_forward and rope_backward; positions (in S) are read only on the host.
template <execution_space S>
void check_rope(const char* what, const rope_shape& s, const void* qkv, const rope_table_view& table,
                const std::int64_t* positions) {
  const auto positive = [&](const char* name, std::int64_t v) {
    if (v <= 0) fail<invalid_argument>(what, ": expected ", name, " > 0, found ", name, " = ", v);
  };
  positive("batch", s.batch);
  positive("seq", s.seq);
  positive("heads", s.heads);
  positive("kv_heads", s.kv_heads);
  positive("head_dim", s.head_dim);
  if (s.head_dim % 2 != 0) fail<invalid_argument>(what, ": expected an even head_dim, found head_dim = ", s.head_dim);
  if (s.heads % s.kv_heads != 0)
    fail<invalid_argument>(what, ": expected kv_heads to divide heads, found heads = ", s.heads,
                           ", kv_heads = ", s.kv_heads);
  if (qkv == nullptr) fail<invalid_argument>(what, ": expected a pointer to qkv, found null");
  if (table.cos == nullptr || table.sin == nullptr)
    fail<invalid_argument>(what, ": expected a table's cos and sin, found null");
  if (table.half != s.head_dim / 2)
    fail<invalid_argument>(what, ": expected a table of head_dim / 2 = ", s.head_dim / 2, " frequencies, found ",
                           table.half);
  if (!positions) {
    if (s.seq > table.positions)
      fail<invalid_argument>(what, ": expected seq <= the table's ", table.positions, " positions, found seq = ", s.seq);
  } else if constexpr (std::same_as<S, host>) {
    for (std::int64_t t = 0; t < s.batch * s.seq; ++t)
      if (positions[t] < 0 || positions[t] >= table.positions)
        fail<invalid_argument>(what, ": expected positions in [0, ", table.positions, "), found position ", positions[t],
                               " at token ", t);
  }
}
}  // namespace detail

// Rotates q and k of every token of qkv [batch, seq, width()] in place by its position's angles: for each head and
// i < head_dim/2, (x[i], x[i + head_dim/2]) ← (x[i]·cos − x[i+hd/2]·sin, x[i+hd/2]·cos + x[i]·sin), as Hugging
// Face's apply_rotary_pos_emb; v is left as it is. positions: [batch·seq] int64 in S, or null for t within each
// sequence; on the host each is checked against the table, in device memory none is. table: in S (on the host, a
// rope_table's view()). T is float, bf16 or fp16, the rotation in float.
template <execution_space S, float_like T>
void rope_forward(const rope_shape& s, T* qkv, const rope_table_view& table, const std::int64_t* positions = nullptr) {
  detail::check_rope<S>("dml::nn::rope_forward", s, qkv, table, positions);
  const std::int64_t pairs = (s.heads + s.kv_heads) * (s.head_dim / 2);
  detail::token_rows<S>(s.batch * s.seq, pairs, kernels::rope_rotate<T>{qkv, table.cos, table.sin, positions, s.seq,
                                                                        s.width(), s.head_dim, pairs, 1.f});
}

// The gradient through rope_forward, in place on dqkv [batch, seq, width()]: dq and dk rotated back (the
// rotation's transpose, by −angle); dv is left as it is.
template <execution_space S, float_like T>
void rope_backward(const rope_shape& s, T* dqkv, const rope_table_view& table, const std::int64_t* positions = nullptr) {
  detail::check_rope<S>("dml::nn::rope_backward", s, dqkv, table, positions);
  const std::int64_t pairs = (s.heads + s.kv_heads) * (s.head_dim / 2);
  detail::token_rows<S>(s.batch * s.seq, pairs, kernels::rope_rotate<T>{dqkv, table.cos, table.sin, positions, s.seq,
                                                                        s.width(), s.head_dim, pairs, -1.f});
}

}  // namespace dml::nn
