// SPDX-License-Identifier: Apache-2.0
// dml/optim/lamb.hpp — LAMB (You et al. 2019, Algorithm 2): Adam moments with bias correction and a per-tensor trust ratio.
// Sits on optim/layerwise.hpp; the moments and the two per-tensor sums are one pass, the update a second.
#pragma once

#include <cmath>
#include <span>
#include <type_traits>

#include "dml/optim/layerwise.hpp"

namespace dml::optim {

namespace kernels {
// First pass: m, v advance; returns (w², u²) with u = m̂/(√v̂ + ε) + λw, the update direction.
template <class G = float>
struct lamb_moments {
  const float* w;
  const G* g;
  float* m;
  float* v;
  float beta1, beta2, eps, grad_scale;
  float inv_bc1;       // 1 / (1 − β1^t)
  float inv_bc2_sqrt;  // 1 / √(1 − β2^t)
  float wd;            // λ; 0 for tensors left out of decay
  DML_HOST_DEVICE optim::detail::sum2 operator()(std::int64_t i) const {
    const float grad = static_cast<float>(g[i]) * grad_scale;
    const float mi = m[i] * beta1 + (1.f - beta1) * grad;
    const float vi = v[i] * beta2 + (1.f - beta2) * grad * grad;
    m[i] = mi;
    v[i] = vi;
    const float u = mi * inv_bc1 / (sqrtf(vi) * inv_bc2_sqrt + eps) + wd * w[i];
    return {static_cast<double>(w[i]) * w[i], static_cast<double>(u) * u};
  }
};
// Second pass: w −= lr·ratio·u. W is the element type of the working copy written alongside w, or void.
template <class W = void>
struct lamb_apply {
  float* w;
  const float* m;
  const float* v;
  float eps, inv_bc1, inv_bc2_sqrt, wd;
  float step;  // lr · trust ratio
  W* working;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const float u = m[i] * inv_bc1 / (sqrtf(v[i]) * inv_bc2_sqrt + eps) + wd * w[i];
    const float updated = w[i] - step * u;
    w[i] = updated;
    if constexpr (!std::is_void_v<W>) working[i] = W(updated);
  }
};
}  // namespace kernels

// LAMB: r = m̂/(√v̂ + ε) + λw, w −= lr·φ(‖w‖)/‖r‖·r per tensor, φ the identity (at most trust_clip when it is
// > 0); the ratio is 1 when either norm is 0. Tensors with adapt unset (1-D: biases, norms) take neither the
// decay nor the ratio: w −= lr·m̂/(√v̂ + ε). update() alone treats its range as one tensor.
struct lamb {
  using policy_family = optimizer_family;
  static constexpr bool writes_working_copy = true;
  static constexpr bool layerwise = true;
  static constexpr const char* name = "lamb";
  static constexpr int state_slots = 2;  // first and second moments
  struct options {
    float lr = 1e-3f;
    float beta1 = 0.9f;
    float beta2 = 0.999f;
    float eps = 1e-6f;
    float weight_decay = 1e-2f;
    float trust_clip = 0.f;  // upper bound on the trust ratio; 0: none
  };
  options opt{};

  lamb() = default;
  explicit lamb(options o) : opt(o) { validate(); }
  // Adam's rules (eps > 0: with 0, an element whose gradient has been 0 at every step gives 0/0, and its NaN makes
  // its whole tensor's ratio 1), and a trust_clip >= 0.
  void validate() const {
    constexpr const char* who = "dml::optim::lamb";
    optim::detail::expect_at_least_zero(who, "lr", opt.lr);
    optim::detail::expect_decay(who, "beta1", opt.beta1);
    optim::detail::expect_decay(who, "beta2", opt.beta2);
    optim::detail::expect_above_zero(who, "eps", opt.eps);
    optim::detail::expect_at_least_zero(who, "weight_decay", opt.weight_decay);
    optim::detail::expect_at_least_zero(who, "trust_clip", opt.trust_clip);
  }
  float default_lr() const { return opt.lr; }

  template <execution_space S>
  void prepare(const step_args& a, std::span<const tensor_piece> pieces, double* sums) const {
    const bias_scales bc = corrections(a.step);
    optim::detail::visit_grad(a, "dml::optim::lamb gradients", [&](const auto* g) {
      using G = std::remove_cvref_t<decltype(*g)>;
      for (const auto& p : pieces) {
        const auto s = transform_reduce_index<S>(
            p.end - p.begin,
            kernels::lamb_moments<G>{a.w + p.begin, g + p.begin, a.state[0] + p.begin, a.state[1] + p.begin, opt.beta1,
                                     opt.beta2, opt.eps, a.grad_scale, bc.inv_bc1, bc.inv_bc2_sqrt, decay(p)},
            optim::detail::sum2{});
        sums[2 * p.tensor] += s.w;
        sums[2 * p.tensor + 1] += s.u;
      }
    });
  }
  template <execution_space S>
  void apply(const step_args& a, std::span<const tensor_piece> pieces, const double* sums) const {
    const bias_scales bc = corrections(a.step);
    optim::detail::visit_working(a, "dml::optim::lamb working copy", [&](auto* working) {
      using W = std::remove_pointer_t<decltype(working)>;
      for (const auto& p : pieces) {
        const float ratio =
            p.adapt ? optim::detail::trust_ratio(sums[2 * p.tensor], sums[2 * p.tensor + 1], 1.0, 0.0, opt.trust_clip) : 1.f;
        W* out = nullptr;
        if constexpr (!std::is_void_v<W>) out = working + p.begin;
        for_each_index<S>(p.end - p.begin,
                          kernels::lamb_apply<W>{a.w + p.begin, a.state[0] + p.begin, a.state[1] + p.begin, opt.eps,
                                                 bc.inv_bc1, bc.inv_bc2_sqrt, decay(p), a.lr * ratio, out});
      }
    });
  }
  template <execution_space S>
  void update(const step_args& a) const {
    optim::detail::update_as_one_tensor<S>(*this, a);
  }

 private:
  float decay(const tensor_piece& p) const { return p.adapt ? opt.weight_decay : 0.f; }
  // Bias corrections in double, as Adam's. A struct, not a structured binding: clang before 16 cannot capture a
  // binding in a lambda.
  struct bias_scales {
    float inv_bc1, inv_bc2_sqrt;
  };
  bias_scales corrections(std::int64_t step) const {
    const optim::detail::bias_corrections bc(opt.beta1, opt.beta2, step);
    return {static_cast<float>(1.0 / bc.bc1), static_cast<float>(1.0 / std::sqrt(bc.bc2))};
  }
};

}  // namespace dml::optim
