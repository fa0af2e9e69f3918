// SPDX-License-Identifier: Apache-2.0
// dml/nn/detail/moe_kernels.hpp — nn::moe's per-element passes: rows gathered into dispatch or expert order, the
// gated combine of the experts' outputs, and the gates' gradient; each runs as a functor in the layer's space.
// Sits on core/config.hpp and core/dtype.hpp; used by nn/moe.hpp.
#pragma once

#include <cstdint>

#include "dml/core/config.hpp"
#include "dml/core/dtype.hpp"

namespace dml::nn {

namespace kernels {
// out[r, j] = scale[r] · in[index[r], j] (scale null: 1): tokens into dispatch order, received rows into
// expert order and back.
template <class T>
struct moe_gather_rows {
  const T* in;
  const std::int64_t* index;
  const float* scale;
  T* out;
  std::int64_t n;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t r = i / n, j = i % n;
    float v = static_cast<float>(in[index[r] * n + j]);
    if (scale) v *= scale[r];
    out[i] = T(v);
  }
  // Row r whole, as its elements' calls would (the host's form: no division per element, the columns vectorise).
  DML_HOST_DEVICE void row(std::int64_t r) const {
    const T* from = in + index[r] * n;
    const float s = scale ? scale[r] : 1.f;
    T* to = out + r * n;
    if (scale) {
      DML_SIMD
      for (std::int64_t j = 0; j < n; ++j) to[j] = round_to<T>(static_cast<float>(from[j]) * s);
    } else {
      DML_SIMD
      for (std::int64_t j = 0; j < n; ++j) to[j] = round_to<T>(static_cast<float>(from[j]));
    }
  }
};
// y[t, j] (+)= Σ over choices c = 0..k−1, in that order, of gate[t, c] · rows[slot[t, c], j]; slot −1 (a dropped
// choice) adds nothing, gate null means 1. The fixed order makes the sum independent of where experts ran.
template <class T>
struct moe_combine {
  const T* rows;
  const std::int64_t* slot;
  const float* gate;
  T* y;
  std::int64_t n, k;
  bool accumulate;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t t = i / n, j = i % n;
    float s = accumulate ? static_cast<float>(y[i]) : 0.f;
    for (std::int64_t c = 0; c < k; ++c) {
      const std::int64_t at = slot[t * k + c];
      if (at >= 0) s += (gate ? gate[t * k + c] : 1.f) * static_cast<float>(rows[at * n + j]);
    }
    y[i] = T(s);
  }
  // Token row t whole, each column's choices added in the same order (the host's form).
  DML_HOST_DEVICE void row(std::int64_t t) const {
    T* out = y + t * n;
    DML_SIMD
    for (std::int64_t j = 0; j < n; ++j) {
      float s = accumulate ? static_cast<float>(out[j]) : 0.f;
      for (std::int64_t c = 0; c < k; ++c) {
        const std::int64_t at = slot[t * k + c];
        if (at >= 0) s += (gate ? gate[t * k + c] : 1.f) * static_cast<float>(rows[at * n + j]);
      }
      out[j] = round_to<T>(s);
    }
  }
};
// dgate[t, c] = dy[t] · rows[slot[t, c]] (0 for a dropped choice): the gradient of a gate.
template <class T>
struct moe_gate_grad {
  const T* dy;
  const T* rows;
  const std::int64_t* slot;
  float* dgate;
  std::int64_t n, k;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t t = i / k, at = slot[i];
    float s = 0.f;
    if (at >= 0)
      for (std::int64_t j = 0; j < n; ++j) s += static_cast<float>(dy[t * n + j]) * static_cast<float>(rows[at * n + j]);
    dgate[i] = s;
  }
};
}  // namespace kernels

}  // namespace dml::nn
