// SPDX-License-Identifier: Apache-2.0
// dml/nn/swiglu.hpp — SwiGLU, h = silu(gate) ⊙ up, on the output of the one GEMM that produced [gate | up]
// side by side, and its gradient. Sits on nn/activation.hpp (silu) and nn/detail/rows.hpp (token_rows).
#pragma once

#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"
#include "dml/core/space.hpp"
#include "dml/nn/activation.hpp"
#include "dml/nn/detail/rows.hpp"

namespace dml::nn {

namespace kernels {
// Element functors over rows × ff outputs; a row of gu is [gate: ff | up: ff]. row(r) runs a row, the same values.
template <class T>
struct swiglu_forward {
  const T* gu;
  T* h;
  std::int64_t ff;
  DML_HOST_DEVICE static float value(float g, float u) { return silu::value(g) * u; }
  DML_HOST_DEVICE void operator()(std::int64_t e) const {
    const std::int64_t r = e / ff, j = e % ff;
    const T* g = gu + 2 * r * ff;
    h[e] = round_to<T>(value(static_cast<float>(g[j]), static_cast<float>(g[ff + j])));
  }
  DML_HOST_DEVICE void row(std::int64_t r) const {
    const T* g = gu + 2 * r * ff;
    T* hr = h + r * ff;
    DML_SIMD
    for (std::int64_t j = 0; j < ff; ++j) hr[j] = round_to<T>(value(static_cast<float>(g[j]), static_cast<float>(g[ff + j])));
  }
};

// d gate = dh · up · silu'(gate), d up = dh · silu(gate); both read before either is stored, so dgu may be gu.
// σ(gate) is found once for both (as two calls, GCC 12 leaves the row's loop unvectorised: "control flow in loop").
template <class T>
struct swiglu_backward {
  const T *gu, *dh;
  T* dgu;
  std::int64_t ff;
  DML_HOST_DEVICE static void at(const T* g, const T* d, T* out, std::int64_t ff, std::int64_t j) {
    const float gate = static_cast<float>(g[j]), up = static_cast<float>(g[ff + j]), dy = static_cast<float>(d[j]);
    const float s = silu::sigmoid(gate);
    out[j] = round_to<T>(dy * up * (s * (1.f + gate * (1.f - s))));  // silu::derivative
    out[ff + j] = round_to<T>(dy * (gate * s));                      // silu::value
  }
  DML_HOST_DEVICE void operator()(std::int64_t e) const {
    const std::int64_t r = e / ff;
    at(gu + 2 * r * ff, dh + r * ff, dgu + 2 * r * ff, ff, e % ff);
  }
  DML_HOST_DEVICE void row(std::int64_t r) const {
    const T *g = gu + 2 * r * ff, *d = dh + r * ff;
    T* out = dgu + 2 * r * ff;
    DML_SIMD
    for (std::int64_t j = 0; j < ff; ++j) at(g, d, out, ff, j);
  }
};
}  // namespace kernels

namespace detail {
inline void check_swiglu(const char* what, std::int64_t rows, std::int64_t ff,
                         std::initializer_list<std::pair<const char*, const void*>> pointers) {
  if (rows < 0) fail<invalid_argument>(what, ": expected rows >= 0, found rows = ", rows);
  if (ff <= 0) fail<invalid_argument>(what, ": expected ff > 0, found ff = ", ff);
  for (const auto& [name, p] : pointers)
    if (p == nullptr) fail<invalid_argument>(what, ": expected a pointer to ", name, ", found null");
}
}  // namespace detail

// h [rows, ff] = silu(gate) ⊙ up from gu [rows, 2·ff] (columns [0, ff) gate, [ff, 2·ff) up), both in S. T is
// float, bf16 or fp16, the arithmetic in float.
template <execution_space S, float_like T>
void swiglu_forward(const T* gu, T* h, std::int64_t rows, std::int64_t ff) {
  detail::check_swiglu("dml::nn::swiglu_forward", rows, ff, {{"gu", gu}, {"h", h}});
  detail::token_rows<S>(rows, ff, kernels::swiglu_forward<T>{gu, h, ff});
}

// From gu and dh [rows, ff], writes dgu [rows, 2·ff] = [d gate | d up] (overwrites; dgu may be gu itself).
template <execution_space S, float_like T>
void swiglu_backward(const T* gu, const T* dh, T* dgu, std::int64_t rows, std::int64_t ff) {
  detail::check_swiglu("dml::nn::swiglu_backward", rows, ff, {{"gu", gu}, {"dh", dh}, {"dgu", dgu}});
  detail::token_rows<S>(rows, ff, kernels::swiglu_backward<T>{gu, dh, dgu, ff});
}

}  // namespace dml::nn
