// SPDX-License-Identifier: Apache-2.0
// dml/optim/optimizer.hpp — what an optimizer is: a fused update over a flat range with K state slots.
// Sits on core/; the state slots mirror the flat parameter buffer, so a ZeRO shard is a sub-range.
#pragma once

#include <cmath>
#include <concepts>
#include <cstdint>
#include <span>

#include "dml/core/algorithm.hpp"
#include "dml/core/buffer.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/error.hpp"

namespace dml::optim {

struct optimizer_family {};

// One optimizer step's view of a range of the flat buffers. `grad_scale` multiplies every gradient
// inside the fused pass (global-norm clipping, loss-scale removal, averaging over ranks).
// For mixed precision, w is the f32 master copy and `working` (when set) the bf16 or fp16 copy that
// forward and backward read: the same pass writes working[i] = T(updated w[i]), rounded to nearest
// even, so unscale, clip, update and cast cost one read and one write of each array.
struct step_args {
  std::int64_t n = 0;
  float* w = nullptr;
  const_typed_ptr g{};  // n gradients: float, or bf16/fp16 under mixed precision (read as float)
  float* const* state = nullptr;  // state_slots pointers, each to n floats
  std::int64_t step = 1;          // 1 on the first update, as PyTorch counts
  float lr = 0.f;
  float grad_scale = 1.f;
  typed_ptr working{};  // n elements of float, bf16 or fp16, or null
};

namespace detail {
// Calls f(W* working) with the working copy's element type, or with a null void* when there is
// none, so that a kernel can be instantiated with its optional store compiled out.
template <class F>
void visit_working(const step_args& a, const char* who, F&& f) {
  if (!a.working) {
    f(static_cast<void*>(nullptr));
    return;
  }
  dml::detail::visit_float_like(a.working.type, who, [&](auto t) { f(a.working.as<decltype(t)>()); });
}
// Calls f(const G* g) with the gradients' element type.
template <class F>
void visit_grad(const step_args& a, const char* who, F&& f) {
  dml::detail::visit_float_like(a.g.type, who, [&](auto t) { f(a.g.as<decltype(t)>()); });
}
// Adam's bias corrections at step t, 1 − β1^t and 1 − β2^t (Adam, AdamW, LAMB), in double as PyTorch
// computes them in Python floats.
struct bias_corrections {
  double bc1, bc2;
  bias_corrections(float beta1, float beta2, std::int64_t step)
      : bc1(1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step))),
        bc2(1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step))) {}
};

// The checks an optimizer's validate() makes of its settings where it is built, as PyTorch's constructors do. Each
// message names the optimizer (`who`) and the setting, the rule and the value: "dml::optim::sgd: expected lr >= 0,
// found -0.5". NaN and infinities fail every rule: one such setting turns every weight into NaN.
inline void expect_finite(const char* who, const char* what, float v) {
  if (!std::isfinite(v)) fail<invalid_argument>(who, ": expected a finite ", what, ", found ", v);
}
inline void expect_at_least_zero(const char* who, const char* what, float v) {
  expect_finite(who, what, v);
  if (!(v >= 0.f)) fail<invalid_argument>(who, ": expected ", what, " >= 0, found ", v);
}
inline void expect_above_zero(const char* who, const char* what, float v) {
  expect_finite(who, what, v);
  if (!(v > 0.f)) fail<invalid_argument>(who, ": expected ", what, " > 0, found ", v);
}
// [0, 1): the decay of a running average (Adam's betas, LARS's momentum); 1 would never forget, above 1 diverges.
inline void expect_decay(const char* who, const char* what, float v) {
  if (!(v >= 0.f && v < 1.f)) fail<invalid_argument>(who, ": expected ", what, " in [0, 1), found ", v);
}
}  // namespace detail

// Calls o.validate() where O has one (dml's optimizers do; their constructors call it): for holders of an optimizer
// (the trainer) whose settings may have been changed through its public `opt` after it was built.
template <class O>
void validate(const O& o) {
  if constexpr (requires { o.validate(); }) o.validate();
}

// The concept, in named parts so that a failure names the missing one.
template <class O>
concept has_state_slots = requires {
  { O::state_slots } -> std::convertible_to<int>;
};
template <class O>
concept has_optimizer_name = requires {
  { O::name } -> std::convertible_to<const char*>;
};
template <class O>
concept has_default_lr = requires(const O& o) {
  { o.default_lr() } -> std::convertible_to<float>;
};
template <class O>
concept has_host_update = requires(const O& o, step_args a) { o.template update<host>(a); };
template <class O>
concept optimizer = has_state_slots<O> && has_optimizer_name<O> && has_default_lr<O> && has_host_update<O>;

// static_assert(diagnose_optimizer<O>()) names the first missing part.
template <class O>
consteval bool diagnose_optimizer() {
  static_assert(has_state_slots<O>, "dml: an optimizer needs `static constexpr int state_slots` (floats of state per parameter)");
  static_assert(has_optimizer_name<O>, "dml: an optimizer needs `static constexpr const char* name`");
  static_assert(has_default_lr<O>, "dml: an optimizer needs `float default_lr() const`");
  static_assert(has_host_update<O>,
                "dml: an optimizer needs `template <execution_space S> void update(const step_args&) const`");
  return true;
}

// Mixed precision needs an update that also writes the 16-bit working copy (step_args::working);
// an optimizer says so with `static constexpr bool writes_working_copy = true`.
template <class O>
inline constexpr bool writes_working_copy_v = requires { requires O::writes_working_copy; };

// The state an optimizer keeps for a range of n parameters: state_slots buffers of n floats, zeroed.
template <optimizer O, execution_space Space = host>
class state {
 public:
  state() = default;
  explicit state(std::int64_t n) { resize(n); }
  void resize(std::int64_t n) {
    n_ = n;
    for (int s = 0; s < O::state_slots; ++s) {
      slots_[s].resize(static_cast<std::size_t>(n));
      fill_n<Space>(slots_[s].data(), n, 0.f);
      ptrs_[s] = slots_[s].data();
    }
  }
  std::int64_t size() const { return n_; }
  float* const* pointers() { return ptrs_; }
  span_in<float, Space> slot(int s) { return slots_[s].span(); }
  span_in<const float, Space> slot(int s) const { return slots_[s].span(); }
  std::int64_t bytes() const { return n_ * O::state_slots * static_cast<std::int64_t>(sizeof(float)); }

 private:
  static constexpr int slot_count = O::state_slots > 0 ? O::state_slots : 1;
  buffer<float, Space> slots_[slot_count];
  float* ptrs_[slot_count] = {};
  std::int64_t n_ = 0;
};

}  // namespace dml::optim
