// SPDX-License-Identifier: Apache-2.0
// dml/nn/rmsnorm.hpp — RMS normalisation over the last dimension with a weight and no bias (Llama's), alone or
// fused with the residual add before it, and its gradients. Sits on core/algorithm.hpp, as nn/layernorm.hpp does.
#pragma once

#include <cmath>
#include <concepts>
#include <cstdint>
#include <type_traits>

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"
#include "dml/core/space.hpp"

namespace dml::nn {

namespace kernels {
// y = x · rrms · w with rrms = 1/√(mean(x²) + eps); the arithmetic in float, one rounding to T per store.
DML_HOST_DEVICE float rmsnorm_rrms(float sum_squares, std::int64_t n, float eps) {
  return 1.f / sqrtf(sum_squares / static_cast<float>(n) + eps);
}
// dx = rrms · (dy·w − x̂ · mean(dy·w·x̂)), x̂ = x · rrms, given the row sum Σ dy·w·x̂ and 1/n.
DML_HOST_DEVICE float rmsnorm_dx(float g, float xhat, float rrms, float sum_gx, float inv_n) {
  return rrms * (g - xhat * sum_gx * inv_n);
}
template <class T>
DML_HOST_DEVICE float rmsnorm_sum_squares(const T* x, std::int64_t n) {
  float s = 0.f;
  DML_SIMD_SUM(s)
  for (std::int64_t j = 0; j < n; ++j) s += static_cast<float>(x[j]) * static_cast<float>(x[j]);
  return s;
}

// One row per call. With r non-null (the fused form), r += x first, rounded to T, and the row normalised is the
// new r: the sum of squares and y read r as stored, so the result is bit for bit the unfused add then norm, and
// the three loops run over a row the first has just brought into cache. rrms, when not null, keeps each row's
// 1/rms for backward.
template <class T>
struct rmsnorm_forward {
  T* r;  // residual stream, updated in place; null: normalise x
  const T *x, *w;
  T* y;
  float* rrms;
  std::int64_t n;
  float eps;
  DML_HOST_DEVICE void operator()(std::int64_t row) const {
    const T* xr = x + row * n;
    if (r) {
      T* rr = r + row * n;
      DML_SIMD
      for (std::int64_t j = 0; j < n; ++j) rr[j] = round_to<T>(static_cast<float>(rr[j]) + static_cast<float>(xr[j]));
      xr = rr;
    }
    const float s = rmsnorm_rrms(rmsnorm_sum_squares(xr, n), n, eps);
    if (rrms) rrms[row] = s;
    T* yr = y + row * n;
    DML_SIMD
    for (std::int64_t j = 0; j < n; ++j) yr[j] = round_to<T>(static_cast<float>(xr[j]) * s * static_cast<float>(w[j]));
  }
};

// dx = add + rrms · (dy·w − x̂ · mean(dy·w·x̂)); add (the residual stream's gradient) may be null, and dx may be add.
template <class T>
struct rmsnorm_backward_input {
  const T *x, *w, *dy, *add;
  const float* rrms;
  T* dx;
  std::int64_t n;
  DML_HOST_DEVICE void operator()(std::int64_t row) const {
    const T* xr = x + row * n;
    const T* dyr = dy + row * n;
    const float s = rrms[row];
    float sum_gx = 0.f;
    DML_SIMD_SUM(sum_gx)
    for (std::int64_t j = 0; j < n; ++j)
      sum_gx += static_cast<float>(dyr[j]) * static_cast<float>(w[j]) * (static_cast<float>(xr[j]) * s);
    const float inv_n = 1.f / static_cast<float>(n);
    DML_SIMD
    for (std::int64_t j = 0; j < n; ++j) {
      const float d = rmsnorm_dx(static_cast<float>(dyr[j]) * static_cast<float>(w[j]), static_cast<float>(xr[j]) * s,
                                 s, sum_gx, inv_n);
      dx[row * n + j] = round_to<T>(d + (add ? static_cast<float>(add[row * n + j]) : 0.f));
    }
  }
};

// dw[j] (+)= Σ_rows dy·x̂; one column per call, the rows in order, so writers never collide and the sum has one order.
template <class T>
struct rmsnorm_backward_weight {
  const T *x, *dy;
  const float* rrms;
  T* dw;
  std::int64_t rows, n;
  bool accumulate;
  DML_HOST_DEVICE void operator()(std::int64_t j) const {
    float g = 0.f;
    for (std::int64_t r = 0; r < rows; ++r) g += static_cast<float>(dy[r * n + j]) * (static_cast<float>(x[r * n + j]) * rrms[r]);
    dw[j] = T(accumulate ? static_cast<float>(dw[j]) + g : g);
  }
};
}  // namespace kernels

namespace detail {
inline void check_rmsnorm_sizes(const char* what, std::int64_t rows, std::int64_t n) {
  if (rows < 0) fail<invalid_argument>(what, ": expected rows >= 0, found rows = ", rows);
  if (n <= 0) fail<invalid_argument>(what, ": expected n > 0, found n = ", n);
}
inline void check_rmsnorm_pointer(const char* what, const char* name, const void* p) {
  if (p == nullptr) fail<invalid_argument>(what, ": expected a pointer to ", name, ", found null");
}
}  // namespace detail

// y = x / √(mean(x²) + eps) · w over rows of n: x, y [rows, n], w [n], all in S. rrms: [rows] floats in S that
// keep each row's 1/rms for backward, or null (inference). T is float, bf16 or fp16; arithmetic in float.
template <execution_space S, float_like T>
void rmsnorm_forward(const T* x, const T* w, T* y, float* rrms, std::int64_t rows, std::int64_t n, float eps) {
  constexpr const char* what = "dml::nn::rmsnorm_forward";
  detail::check_rmsnorm_sizes(what, rows, n);
  detail::check_rmsnorm_pointer(what, "x", x);
  detail::check_rmsnorm_pointer(what, "w", w);
  detail::check_rmsnorm_pointer(what, "y", y);
  for_each_row<S>(rows, kernels::rmsnorm_forward<T>{nullptr, x, w, y, rrms, n, eps}, n);
}

// The residual add and the norm after it in one pass over each row: r += x (r, the residual stream, is updated
// in place), then y = rmsnorm(r), bit for bit what rmsnorm_forward gives on the updated r. Backward takes the
// updated r as its x.
template <execution_space S, float_like T>
void residual_rmsnorm_forward(T* r, const T* x, const T* w, T* y, float* rrms, std::int64_t rows, std::int64_t n,
                              float eps) {
  constexpr const char* what = "dml::nn::residual_rmsnorm_forward";
  detail::check_rmsnorm_sizes(what, rows, n);
  detail::check_rmsnorm_pointer(what, "r", r);
  detail::check_rmsnorm_pointer(what, "x", x);
  detail::check_rmsnorm_pointer(what, "w", w);
  detail::check_rmsnorm_pointer(what, "y", y);
  for_each_row<S>(rows, kernels::rmsnorm_forward<T>{r, x, w, y, rrms, n, eps}, n);
}

// From the norm's input x (for the fused form, the updated r), w, forward's rrms and dy: dx = ∂L/∂x + dr, where
// dr, the gradient already on the residual stream, may be null, and dx may be dr (then the stream's one gradient
// is updated in place); dw (+)= Σ_rows dy·x·rrms. dx or dw may be null: that gradient is not wanted (the norm's
// input is the network's, the weight is frozen). The weight's gradient sums each column over the rows in row
// order: a column per device thread, on the host by blocks of columns (for_each_column_block, as
// nn/layernorm.hpp's), the same bits either way and no atomics.
template <execution_space S, float_like T>
void rmsnorm_backward(const T* x, const T* w, const float* rrms, const T* dy, const std::type_identity_t<T>* dr,
                      std::type_identity_t<T>* dx, std::type_identity_t<T>* dw, std::int64_t rows, std::int64_t n,
                      bool accumulate = false) {
  constexpr const char* what = "dml::nn::rmsnorm_backward";
  detail::check_rmsnorm_sizes(what, rows, n);
  detail::check_rmsnorm_pointer(what, "x", x);
  detail::check_rmsnorm_pointer(what, "w", w);
  detail::check_rmsnorm_pointer(what, "rrms", rrms);
  detail::check_rmsnorm_pointer(what, "dy", dy);
  if (dw) {
    if constexpr (!std::same_as<S, host>) {
      for_each_index<S>(n, kernels::rmsnorm_backward_weight<T>{x, dy, rrms, dw, rows, n, accumulate});
    } else {
      for_each_column_block(n, rows, [=](std::int64_t j0, std::int64_t width) {
        float g[column_block];
        for (std::int64_t j = 0; j < width; ++j) g[j] = 0.f;
        for (std::int64_t r = 0; r < rows; ++r) {
          const T* xr = x + r * n + j0;
          const T* dyr = dy + r * n + j0;
          const float s = rrms[r];
          DML_SIMD
          for (std::int64_t j = 0; j < width; ++j) g[j] += static_cast<float>(dyr[j]) * (static_cast<float>(xr[j]) * s);
        }
        for (std::int64_t j = 0; j < width; ++j)
          dw[j0 + j] = T(accumulate ? static_cast<float>(dw[j0 + j]) + g[j] : g[j]);
      });
    }
  }
  if (dx) for_each_row<S>(rows, kernels::rmsnorm_backward_input<T>{x, w, dy, dr, rrms, dx, n}, n);
}

}  // namespace dml::nn
