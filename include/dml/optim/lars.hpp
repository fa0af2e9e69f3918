// SPDX-License-Identifier: Apache-2.0
// dml/optim/lars.hpp — LARS (You et al. 2017, Algorithm 1): momentum SGD with a per-tensor local learning rate.
// Sits on optim/layerwise.hpp; the two per-tensor sums are one pass, the momentum update a second.
#pragma once

#include <span>
#include <type_traits>

#include "dml/optim/layerwise.hpp"

namespace dml::optim {

namespace kernels {
// First pass: (w², g²), g scaled.
template <class G = float>
struct lars_sums {
  const float* w;
  const G* g;
  float grad_scale;
  DML_HOST_DEVICE optim::detail::sum2 operator()(std::int64_t i) const {
    const float grad = static_cast<float>(g[i]) * grad_scale;
    return {static_cast<double>(w[i]) * w[i], static_cast<double>(grad) * grad};
  }
};
// Second pass: b = μb + γ·λ_local·(g + βw), w −= b. W is the working copy's element type, or void.
template <class W = void, class G = float>
struct lars_apply {
  float* w;
  const G* g;
  float* buf;
  float momentum, wd, grad_scale;
  float step;  // γ · local learning rate
  W* working;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const float d = static_cast<float>(g[i]) * grad_scale + wd * w[i];
    const float b = buf[i] * momentum + step * d;
    buf[i] = b;
    const float updated = w[i] - b;
    w[i] = updated;
    if constexpr (!std::is_void_v<W>) working[i] = W(updated);
  }
};
}  // namespace kernels

// LARS: per tensor, local lr = η‖w‖/(‖g‖ + β‖w‖) (1 when either norm is 0; at most trust_clip when it is > 0),
// b = μb + γ·local·(g + βw), w −= b, γ the global lr. Tensors with adapt unset (1-D: biases, norms) take
// neither decay nor the local lr: b = μb + γg. update() alone treats its range as one tensor.
struct lars {
  using policy_family = optimizer_family;
  static constexpr bool writes_working_copy = true;
  static constexpr bool layerwise = true;
  static constexpr const char* name = "lars";
  static constexpr int state_slots = 1;  // momentum
  struct options {
    float lr = 1.f;  // γ; the adapted step is about γ·η·‖w‖ per tensor
    float momentum = 0.9f;
    float weight_decay = 5e-4f;
    float eta = 1e-3f;       // trust coefficient
    float trust_clip = 0.f;  // upper bound on the local lr; 0: none
  };
  options opt{};

  lars() = default;
  explicit lars(options o) : opt(o) { validate(); }
  void validate() const {
    constexpr const char* who = "dml::optim::lars";
    optim::detail::expect_at_least_zero(who, "lr", opt.lr);
    optim::detail::expect_decay(who, "momentum", opt.momentum);
    optim::detail::expect_at_least_zero(who, "weight_decay", opt.weight_decay);
    optim::detail::expect_above_zero(who, "eta (trust coefficient)", opt.eta);
    optim::detail::expect_at_least_zero(who, "trust_clip", opt.trust_clip);
  }
  float default_lr() const { return opt.lr; }

  template <execution_space S>
  void prepare(const step_args& a, std::span<const tensor_piece> pieces, double* sums) const {
    optim::detail::visit_grad(a, "dml::optim::lars gradients", [&](const auto* g) {
      using G = std::remove_cvref_t<decltype(*g)>;
      for (const auto& p : pieces) {
        if (!p.adapt) continue;
        const auto s = transform_reduce_index<S>(p.end - p.begin, kernels::lars_sums<G>{a.w + p.begin, g + p.begin, a.grad_scale},
                                                 optim::detail::sum2{});
        sums[2 * p.tensor] += s.w;
        sums[2 * p.tensor + 1] += s.u;
      }
    });
  }
  template <execution_space S>
  void apply(const step_args& a, std::span<const tensor_piece> pieces, const double* sums) const {
    optim::detail::visit_working(a, "dml::optim::lars working copy", [&](auto* working) {
      using W = std::remove_pointer_t<decltype(working)>;
      optim::detail::visit_grad(a, "dml::optim::lars gradients", [&](const auto* g) {
        using G = std::remove_cvref_t<decltype(*g)>;
        for (const auto& p : pieces) {
          const float local = p.adapt ? optim::detail::trust_ratio(sums[2 * p.tensor], sums[2 * p.tensor + 1], opt.eta,
                                                                   opt.weight_decay, opt.trust_clip)
                                      : 1.f;
          W* out = nullptr;
          if constexpr (!std::is_void_v<W>) out = working + p.begin;
          for_each_index<S>(p.end - p.begin,
                            kernels::lars_apply<W, G>{a.w + p.begin, g + p.begin, a.state[0] + p.begin, opt.momentum,
                                                      p.adapt ? opt.weight_decay : 0.f, a.grad_scale, a.lr * local, out});
        }
      });
    });
  }
  template <execution_space S>
  void update(const step_args& a) const {
    optim::detail::update_as_one_tensor<S>(*this, a);
  }
};

}  // namespace dml::optim
