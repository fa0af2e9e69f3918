// SPDX-License-Identifier: Apache-2.0
// dml/optim/clip.hpp — global-norm gradient clipping, folded into the optimizer's grad_scale.
// Sits on core/algorithm.hpp; sharded trainers sum squared norms over ranks before clip_scale.
#pragma once

#include <cmath>

#include "dml/core/algorithm.hpp"

namespace dml::optim {

namespace kernels {
template <class T = float>
struct square {
  const T* g;
  DML_HOST_DEVICE double operator()(std::int64_t i) const {
    const double v = static_cast<float>(g[i]);
    return v * v;
  }
};
}  // namespace kernels

// Σ g² over a range (padding is zero, so whole flat buffers may be passed).
template <execution_space S, class T>
double squared_norm(const T* g, std::int64_t n) {
  return transform_reduce_index<S>(n, kernels::square<T>{g}, 0.0);
}

// The factor torch.nn.utils.clip_grad_norm_ applies: max_norm / (norm + 1e-6) when norm exceeds max_norm.
inline float clip_scale(double total_norm, float max_norm) {
  if (max_norm <= 0.f) return 1.f;
  const double coef = static_cast<double>(max_norm) / (total_norm + 1e-6);
  return coef < 1.0 ? static_cast<float>(coef) : 1.f;
}

}  // namespace dml::optim
