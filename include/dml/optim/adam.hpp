// SPDX-License-Identifier: Apache-2.0
// dml/optim/adam.hpp — Adam (L2 decay) and AdamW (decoupled decay), as torch.optim.Adam / AdamW.
// Sits on optim/optimizer.hpp; the update, the gradient scale and the decay are one fused pass.
#pragma once

#include <array>
#include <cmath>
#include <type_traits>

#include "dml/optim/optimizer.hpp"

namespace dml::optim {

namespace kernels {
// W is the element type of the working copy written alongside w, or void for none.
template <class W = void, class G = float>
struct adam_update {
  float* w;
  const G* g;
  float* m;
  float* v;
  float beta1, beta2, eps;
  float beta2_rest;  // 1 − β2; with beta2 = 1 and this 0 the second moment stays as it is (frozen)
  float l2;          // Adam's weight decay, added to the gradient; 0 for AdamW
  float grad_scale;
  float step_size;   // lr / (1 − β1^t)
  float bc2_sqrt;    // √(1 − β2^t)
  float decay;       // 1 − lr·wd for AdamW, 1 for Adam
  W* working;
  // No data-dependent branches: the loop vectorises. Multiplying by 1 and adding 0·p are exact.
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const float p = w[i] * decay;
    const float grad = static_cast<float>(g[i]) * grad_scale + l2 * p;
    const float mi = m[i] * beta1 + (1.f - beta1) * grad;
    const float vi = v[i] * beta2 + beta2_rest * grad * grad;
    m[i] = mi;
    v[i] = vi;
    const float updated = p - step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps));
    w[i] = updated;
    if constexpr (!std::is_void_v<W>) working[i] = W(updated);
  }
};
}  // namespace kernels

namespace detail {
template <bool Decoupled>
struct adam_base {
  using policy_family = optimizer_family;
  static constexpr bool writes_working_copy = true;  // mixed precision: the update casts into the working copy
  static constexpr int state_slots = 2;  // first and second moments
  struct options {
    float lr = 1e-3f;
    float beta1 = 0.9f;
    float beta2 = 0.999f;
    float eps = 1e-8f;
    float weight_decay = Decoupled ? 1e-2f : 0.f;
    // 1-bit Adam (Tang et al. 2021): > 0 freezes the second moment and its bias correction after this step.
    std::int64_t freeze_variance_after = 0;
  };
  options opt{};

  adam_base() = default;
  explicit adam_base(options o) : opt(o) { validate(); }
  // PyTorch's rules, but eps > 0 where PyTorch takes 0: an element whose gradient has been 0 at every step (the
  // flat buffer's padding, an unused embedding row) would update by 0/0.
  void validate() const {
    constexpr const char* who = Decoupled ? "dml::optim::adamw" : "dml::optim::adam";
    optim::detail::expect_at_least_zero(who, "lr", opt.lr);
    optim::detail::expect_decay(who, "beta1", opt.beta1);
    optim::detail::expect_decay(who, "beta2", opt.beta2);
    optim::detail::expect_above_zero(who, "eps", opt.eps);
    optim::detail::expect_at_least_zero(who, "weight_decay", opt.weight_decay);
    if (opt.freeze_variance_after < 0)
      fail<invalid_argument>(who, ": expected freeze_variance_after >= 0 (0: never), found ",
                             opt.freeze_variance_after);
  }
  float default_lr() const { return opt.lr; }
  // Freezes the second moment after step `after` (1-bit Adam) and gives β1, β2 and eps.
  std::array<float, 3> freeze_variance(std::int64_t after) {
    auto next = opt;
    next.freeze_variance_after = after;
    opt = adam_base(next).opt;  // checked: unchanged where it fails
    return {opt.beta1, opt.beta2, opt.eps};
  }

  template <execution_space S>
  void update(const step_args& a) const {
    const bool frozen = opt.freeze_variance_after > 0 && a.step > opt.freeze_variance_after;
    const optim::detail::bias_corrections bc(opt.beta1, opt.beta2, a.step);
    // A frozen second moment stops at step freeze_variance_after (1-bit Adam): so does its correction.
    const double bc2 = frozen ? optim::detail::bias_corrections(opt.beta1, opt.beta2, opt.freeze_variance_after).bc2 : bc.bc2;
    optim::detail::visit_working(a, "dml::optim::adam working copy", [&](auto* working) {
      using W = std::remove_pointer_t<decltype(working)>;
      optim::detail::visit_grad(a, "dml::optim::adam gradients", [&](const auto* g) {
        using G = std::remove_cvref_t<decltype(*g)>;
        for_each_index<S>(a.n, kernels::adam_update<W, G>{a.w, g, a.state[0], a.state[1], opt.beta1,
                                                          frozen ? 1.f : opt.beta2, opt.eps,
                                                          frozen ? 0.f : 1.f - opt.beta2, Decoupled ? 0.f : opt.weight_decay, a.grad_scale,
                                                          static_cast<float>(a.lr / bc.bc1),
                                                          static_cast<float>(std::sqrt(bc2)),
                                                          Decoupled ? 1.f - a.lr * opt.weight_decay : 1.f, working});
      });
    });
  }
};
}  // namespace detail

struct adam : detail::adam_base<false> {
  static constexpr const char* name = "adam";
  using adam_base::adam_base;
};
struct adamw : detail::adam_base<true> {
  static constexpr const char* name = "adamw";
  using adam_base::adam_base;
};

}  // namespace dml::optim
