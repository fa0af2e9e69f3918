// SPDX-License-Identifier: Apache-2.0
// dml/optim/sgd.hpp — SGD with momentum, dampening, Nesterov and L2 weight decay, as torch.optim.SGD.
// Sits on optim/optimizer.hpp; one fused pass over a flat range.
#pragma once

#include <type_traits>

#include "dml/optim/optimizer.hpp"

namespace dml::optim {

namespace kernels {
// W is the element type of the working copy written alongside w, or void for none.
template <class W = void, class G = float>
struct sgd_update {
  float* w;
  const G* g;
  float* buf;  // momentum buffer, unused without momentum
  float lr, momentum, dampening, weight_decay, grad_scale;
  bool nesterov, first;
  W* working;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    float d = static_cast<float>(g[i]) * grad_scale;
    if (weight_decay != 0.f) d = d + weight_decay * w[i];
    if (momentum != 0.f) {
      // PyTorch starts the buffer at the first gradient, without dampening.
      const float b = first ? d : buf[i] * momentum + (1.f - dampening) * d;
      buf[i] = b;
      d = nesterov ? d + momentum * b : b;
    }
    const float updated = w[i] - lr * d;
    w[i] = updated;
    if constexpr (!std::is_void_v<W>) working[i] = W(updated);
  }
};
}  // namespace kernels

struct sgd {
  using policy_family = optimizer_family;
  static constexpr bool writes_working_copy = true;  // mixed precision: the update casts into the working copy
  static constexpr const char* name = "sgd";
  static constexpr int state_slots = 1;
  struct options {
    float lr = 0.01f;
    float momentum = 0.f;
    float dampening = 0.f;
    float weight_decay = 0.f;
    bool nesterov = false;
  };
  options opt{};

  sgd() = default;
  explicit sgd(options o) : opt(o) { validate(); }
  // PyTorch's rules, and dampening in [0, 1] (PyTorch checks none): the buffer takes (1 − dampening)·g, which
  // climbs the gradient for dampening above 1 and magnifies it below 0.
  void validate() const {
    constexpr const char* who = "dml::optim::sgd";
    optim::detail::expect_at_least_zero(who, "lr", opt.lr);
    optim::detail::expect_at_least_zero(who, "momentum", opt.momentum);
    if (!(opt.dampening >= 0.f && opt.dampening <= 1.f))
      fail<invalid_argument>(who, ": expected dampening in [0, 1], found ", opt.dampening);
    optim::detail::expect_at_least_zero(who, "weight_decay", opt.weight_decay);
    if (opt.nesterov && (opt.momentum <= 0.f || opt.dampening != 0.f))
      fail<invalid_argument>(who, ": expected momentum > 0 and dampening 0 with nesterov, found momentum ",
                             opt.momentum, " and dampening ", opt.dampening);
  }
  float default_lr() const { return opt.lr; }

  template <execution_space S>
  void update(const step_args& a) const {
    optim::detail::visit_working(a, "dml::optim::sgd working copy", [&](auto* working) {
      using W = std::remove_pointer_t<decltype(working)>;
      optim::detail::visit_grad(a, "dml::optim::sgd gradients", [&](const auto* g) {
        using G = std::remove_cvref_t<decltype(*g)>;
        for_each_index<S>(a.n, kernels::sgd_update<W, G>{a.w, g, a.state[0], a.lr, opt.momentum, opt.dampening,
                                                         opt.weight_decay, a.grad_scale, opt.nesterov, a.step == 1,
                                                         working});
      });
    });
  }
};

}  // namespace dml::optim
