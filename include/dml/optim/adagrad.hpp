// SPDX-License-Identifier: Apache-2.0
// dml/optim/adagrad.hpp — Adagrad with learning-rate decay and L2 weight decay, as torch.optim.Adagrad.
// Sits on optim/optimizer.hpp; one fused pass over a flat range.
#pragma once

#include <cmath>

#include "dml/optim/optimizer.hpp"

namespace dml::optim {

namespace kernels {
template <class G = float>
struct adagrad_update {
  float* w;
  const G* g;
  float* sum;
  float clr, eps, weight_decay, grad_scale;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    float grad = static_cast<float>(g[i]) * grad_scale;
    if (weight_decay != 0.f) grad = grad + weight_decay * w[i];
    const float s = sum[i] + grad * grad;
    sum[i] = s;
    w[i] = w[i] - clr * (grad / (sqrtf(s) + eps));
  }
};
}  // namespace kernels

struct adagrad {
  using policy_family = optimizer_family;
  static constexpr bool writes_working_copy = false;  // float weights only: no mixed precision
  static constexpr const char* name = "adagrad";
  static constexpr int state_slots = 1;  // running sum of squared gradients
  struct options {
    float lr = 1e-2f;
    float lr_decay = 0.f;
    float weight_decay = 0.f;
    float eps = 1e-10f;
  };
  options opt{};

  adagrad() = default;
  explicit adagrad(options o) : opt(o) { validate(); }
  // PyTorch's rules, but eps > 0 where PyTorch takes 0: an element whose gradient has been 0 at every step would
  // update by 0/0.
  void validate() const {
    constexpr const char* who = "dml::optim::adagrad";
    optim::detail::expect_at_least_zero(who, "lr", opt.lr);
    optim::detail::expect_at_least_zero(who, "lr_decay", opt.lr_decay);
    optim::detail::expect_at_least_zero(who, "weight_decay", opt.weight_decay);
    optim::detail::expect_above_zero(who, "eps", opt.eps);
  }
  float default_lr() const { return opt.lr; }

  template <execution_space S>
  void update(const step_args& a) const {
    if (a.working)
      fail<invalid_argument>("dml::optim::adagrad: expected no working copy (step_args::working), found one; "
                             "mixed-precision copies are written by sgd, adam and adamw");
    const float clr = a.lr / (1.f + static_cast<float>(a.step - 1) * opt.lr_decay);
    optim::detail::visit_grad(a, "dml::optim::adagrad gradients", [&](const auto* g) {
      using G = std::remove_cvref_t<decltype(*g)>;
      for_each_index<S>(a.n, kernels::adagrad_update<G>{a.w, g, a.state[0], clr, opt.eps, opt.weight_decay, a.grad_scale});
    });
  }
};

}  // namespace dml::optim
