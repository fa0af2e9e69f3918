// SPDX-License-Identifier: Apache-2.0
// dml/nn/dropout.hpp — inverted dropout whose mask comes from a counter-based RNG.
// Sits on core/rng.hpp; an element's mask bit depends on (seed, step, layer, global row, column)
// only, so backward recomputes it, and a rank or micro-batch that holds rows [r, r + n) of the
// global batch draws exactly the bits one rank would draw for those rows.
#pragma once

#include "dml/core/algorithm.hpp"
#include "dml/core/rng.hpp"
#include "dml/nn/layer.hpp"

namespace dml::nn {

namespace kernels {
template <class T>
struct dropout_apply {
  rng_stream rng;
  float keep;           // probability of keeping an element
  std::uint64_t first;  // counter of element 0: its global row times the row's width
  const T* in;
  T* out;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    out[i] = T(rng.uniform(first + static_cast<std::uint64_t>(i)) < keep ? static_cast<float>(in[i]) / keep : 0.f);
  }
};
}  // namespace kernels

struct dropout {
  static constexpr std::int64_t static_in = dynamic;
  static constexpr std::int64_t static_out = dynamic;
  static constexpr bool preserves_width = true;
  static constexpr bool uses_row_index = true;  // reads context::row_offset (see layer.hpp)
  static constexpr const char* kind = "dropout";

  float p = 0.5f;

  explicit dropout(float probability = 0.5f) : p(probability) {
    if (!(p >= 0.f && p < 1.f)) fail<invalid_argument>("dml::nn::dropout: expected 0 <= p < 1, found ", p);
  }
  std::vector<param_spec> parameters() const { return {}; }
  dml::shape output_shape(dml::shape x) const { return x; }

  // One stream per (step, layer): masks differ across steps and layers, never across ranks.
  static rng_stream stream(const context& c) { return {c.seed, (c.step << 16) ^ c.layer}; }

  // Element (row, j) of the global batch, rows counted along dimension 0 (the one the trainer splits),
  // draws counter row * width + j: the local element i draws row_offset * width + i. Computed on
  // the host in 64-bit integers, so host and device agree bit for bit.
  static std::uint64_t first_counter(const context& c, const dml::shape& x) {
    const std::int64_t rows = x.rank ? x[0] : 1;
    const std::int64_t width = rows > 0 ? x.numel() / rows : 0;
    return static_cast<std::uint64_t>(c.row_offset) * static_cast<std::uint64_t>(width);
  }

  template <execution_space S, class T>
  void forward(const context& c, layer_params<T>, tensor_view<const T, S> x, tensor_view<T, S> y) const {
    const float keep = c.training ? 1.f - p : 1.f;
    for_each_index<S>(x.numel(), kernels::dropout_apply<T>{stream(c), keep, first_counter(c, x.shape), x.data, y.data});
  }
  template <execution_space S, class T>
  void backward(const context& c, layer_params<T>, tensor_view<const T, S>, tensor_view<const T, S>,
                tensor_view<const T, S> dy, tensor_view<T, S> dx) const {
    const float keep = c.training ? 1.f - p : 1.f;
    if (dx.data)
      for_each_index<S>(dy.numel(),
                        kernels::dropout_apply<T>{stream(c), keep, first_counter(c, dy.shape), dy.data, dx.data});
  }
};

}  // namespace dml::nn
