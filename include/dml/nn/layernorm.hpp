// SPDX-License-Identifier: Apache-2.0
// dml/nn/layernorm.hpp — layer normalisation over the last dimension with affine weight and bias.
// Sits on core/algorithm.hpp; statistics are recomputed in backward, so the layer keeps no state (nn::gpt's
// layers keep them instead, through the same kernels).
#pragma once

#include <cmath>

#include "dml/core/algorithm.hpp"
#include "dml/nn/layer.hpp"

namespace dml::nn {

namespace kernels {
struct row_stats {
  float mean, rstd;
};
// Per-element arithmetic shared by the functors below and the CUDA kernels of nn/detail/layernorm.cuh.
DML_HOST_DEVICE float layernorm_rstd(float squared_deviations, std::int64_t n, float eps) {
  return 1.f / sqrtf(squared_deviations / static_cast<float>(n) + eps);  // biased variance, as PyTorch
}
DML_HOST_DEVICE float layernorm_affine(float x, row_stats s, float w, float b) { return (x - s.mean) * s.rstd * w + b; }
DML_HOST_DEVICE float layernorm_xhat(float x, row_stats s) { return (x - s.mean) * s.rstd; }
// dx = rstd · (dy·w − mean(dy·w) − x̂ · mean(dy·w·x̂)), given the two row sums and 1/n.
DML_HOST_DEVICE float layernorm_dx(float dy, float w, float xhat, float rstd, float sum_g, float sum_gx, float inv_n) {
  return rstd * (dy * w - sum_g * inv_n - xhat * sum_gx * inv_n);
}
template <class T>
DML_HOST_DEVICE row_stats layernorm_stats(const T* x, std::int64_t n, float eps) {
  float sum = 0.f;
  DML_SIMD_SUM(sum)
  for (std::int64_t j = 0; j < n; ++j) sum += static_cast<float>(x[j]);
  const float mean = sum / static_cast<float>(n);
  float var = 0.f;
  DML_SIMD_SUM(var)
  for (std::int64_t j = 0; j < n; ++j) var += (static_cast<float>(x[j]) - mean) * (static_cast<float>(x[j]) - mean);
  return {mean, layernorm_rstd(var, n, eps)};
}

// T: the working type of activations and parameters; arithmetic in float. b may be null (no bias); stats,
// when not null, keeps each row's mean and 1/σ for backward.
template <class T>
struct layernorm_forward {
  const T *x, *w, *b;
  T* y;
  row_stats* stats;
  std::int64_t n;
  float eps;
  DML_HOST_DEVICE void operator()(std::int64_t row) const {
    const T* xr = x + row * n;
    T* yr = y + row * n;
    const row_stats s = layernorm_stats(xr, n, eps);
    if (stats) stats[row] = s;
    DML_SIMD
    for (std::int64_t j = 0; j < n; ++j)
      yr[j] = round_to<T>(layernorm_affine(static_cast<float>(xr[j]), s, static_cast<float>(w[j]), b ? static_cast<float>(b[j]) : 0.f));
  }
};

// dx = add + rstd · (dy·w − mean(dy·w) − x̂ · mean(dy·w·x̂)), from each row's statistics; add (a residual
// path's gradient) may be null.
template <class T>
struct layernorm_backward_input {
  const T *x, *w, *dy, *add;
  const row_stats* stats;
  T* dx;
  std::int64_t n;
  DML_HOST_DEVICE void operator()(std::int64_t row) const {
    const T* xr = x + row * n;
    const T* dyr = dy + row * n;
    const row_stats s = stats[row];
    float sum_g = 0.f, sum_gx = 0.f;  // two loops: a vectorised reduction takes one variable
    DML_SIMD_SUM(sum_g)
    for (std::int64_t j = 0; j < n; ++j) sum_g += static_cast<float>(dyr[j]) * static_cast<float>(w[j]);
    DML_SIMD_SUM(sum_gx)
    for (std::int64_t j = 0; j < n; ++j)
      sum_gx += static_cast<float>(dyr[j]) * static_cast<float>(w[j]) * layernorm_xhat(static_cast<float>(xr[j]), s);
    const float inv_n = 1.f / static_cast<float>(n);
    DML_SIMD
    for (std::int64_t j = 0; j < n; ++j) {
      const float d = layernorm_dx(static_cast<float>(dyr[j]), static_cast<float>(w[j]),
                                   layernorm_xhat(static_cast<float>(xr[j]), s), s.rstd, sum_g, sum_gx, inv_n);
      dx[row * n + j] = round_to<T>(d + (add ? static_cast<float>(add[row * n + j]) : 0.f));
    }
  }
};

template <class T>
struct layernorm_row_stats {
  const T* x;
  row_stats* stats;
  std::int64_t n;
  float eps;
  DML_HOST_DEVICE void operator()(std::int64_t row) const { stats[row] = layernorm_stats(x + row * n, n, eps); }
};

// dw[j] (+)= Σ_rows dy·x̂, db[j] (+)= Σ_rows dy (db may be null); one column per call, so writers never collide.
template <class T>
struct layernorm_backward_params {
  const T *x, *dy;
  const row_stats* stats;
  T *dw, *db;
  std::int64_t rows, n;
  bool accumulate;
  DML_HOST_DEVICE void operator()(std::int64_t j) const {
    float gw = 0.f, gb = 0.f;
    for (std::int64_t r = 0; r < rows; ++r) {
      const float d = static_cast<float>(dy[r * n + j]);
      gw += d * layernorm_xhat(static_cast<float>(x[r * n + j]), stats[r]);
      gb += d;
    }
    dw[j] = T(accumulate ? static_cast<float>(dw[j]) + gw : gw);
    if (db) db[j] = T(accumulate ? static_cast<float>(db[j]) + gb : gb);
  }
};
}  // namespace kernels

// The row functors above (forward, row statistics, backward input) run one row per call: on the host a thread takes a
// row and its inner loops vectorise (for_each_row), on the device a thread runs a row. The parameter gradients sum
// each column over the rows: one column per device thread; on the host by column blocks (for_each_column_block).
template <execution_space S, class T>
void layernorm_params_grad(const T* x, const T* dy, const kernels::row_stats* stats, T* dw, T* db, std::int64_t rows,
                           std::int64_t n, bool accumulate) {
  if constexpr (!std::same_as<S, host>) {
    for_each_index<S>(n, kernels::layernorm_backward_params<T>{x, dy, stats, dw, db, rows, n, accumulate});
  } else {
    for_each_column_block(n, rows, [=](std::int64_t j0, std::int64_t width) {
      float gw[column_block], gb[column_block];
      for (std::int64_t j = 0; j < width; ++j) gw[j] = gb[j] = 0.f;
      for (std::int64_t r = 0; r < rows; ++r) {
        const T* xr = x + r * n + j0;
        const T* dyr = dy + r * n + j0;
        const kernels::row_stats st = stats[r];
        DML_SIMD
        for (std::int64_t j = 0; j < width; ++j) {
          const float d = static_cast<float>(dyr[j]);
          gw[j] += d * kernels::layernorm_xhat(static_cast<float>(xr[j]), st);
          gb[j] += d;
        }
      }
      for (std::int64_t j = 0; j < width; ++j) {
        dw[j0 + j] = T(accumulate ? static_cast<float>(dw[j0 + j]) + gw[j] : gw[j]);
        if (db) db[j0 + j] = T(accumulate ? static_cast<float>(db[j0 + j]) + gb[j] : gb[j]);
      }
    });
  }
}

}  // namespace dml::nn

#if DML_HAS_CUDA
#  include "dml/nn/detail/layernorm.cuh"
#endif

namespace dml::nn {

struct layernorm {
  static constexpr std::int64_t static_in = dynamic;
  static constexpr std::int64_t static_out = dynamic;
  static constexpr bool preserves_width = true;
  static constexpr const char* kind = "layernorm";

  std::int64_t features = 0;
  float eps = 1e-5f;

  explicit layernorm(std::int64_t n, float epsilon = 1e-5f) : features(n), eps(epsilon) {
    if (n <= 0) fail<invalid_argument>("dml::nn::layernorm: features must be positive, found ", n);
  }

  std::vector<param_spec> parameters() const {
    return {{"weight", {features}, init_kind::ones}, {"bias", {features}, init_kind::zeros}};
  }
  dml::shape output_shape(dml::shape x) const {
    detail::expect_cols(kind, features, x);
    return x;
  }
  // Floats of scratch backward needs: a mean and a 1/σ per row.
  std::int64_t workspace_size(dml::shape x) const { return 2 * x.rows(); }

  template <execution_space S, class T>
  void forward(const context&, layer_params<T> p, tensor_view<const T, S> x, tensor_view<T, S> y) const {
#if DML_HAS_CUDA
    if constexpr (std::same_as<S, cuda> && std::same_as<T, float>) {  // one block per row instead of one thread
      detail::layernorm_forward_cuda(x.data, p.w[0], p.w[1], y.data, x.rows(), features, eps);
      return;
    }
#endif
    for_each_row<S>(x.rows(), kernels::layernorm_forward<T>{x.data, p.w[0], p.w[1], y.data, nullptr, features, eps}, features);
  }
  template <execution_space S, class T>
  void backward(const context& c, layer_params<T> p, tensor_view<const T, S> x, tensor_view<const T, S>,
                tensor_view<const T, S> dy, tensor_view<T, S> dx) const {
    auto* stats = reinterpret_cast<kernels::row_stats*>(c.workspace);
#if DML_HAS_CUDA
    if constexpr (std::same_as<S, cuda> && std::same_as<T, float>) {
      detail::layernorm_backward_cuda(x.data, p.w[0], dy.data, dx.data, stats, p.g[0], p.g[1], x.rows(), features,
                                      eps, c.accumulate);
      return;
    }
#endif
    for_each_row<S>(x.rows(), kernels::layernorm_row_stats<T>{x.data, stats, features, eps}, features);
    layernorm_params_grad<S>(x.data, dy.data, stats, p.g[0], p.g[1], x.rows(), features, c.accumulate);
    if (dx.data)
      for_each_row<S>(x.rows(), kernels::layernorm_backward_input<T>{x.data, p.w[0], dy.data, nullptr, stats, dx.data,
                                                                      features},
                      features);
  }
};

}  // namespace dml::nn
