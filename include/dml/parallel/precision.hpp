// SPDX-License-Identifier: Apache-2.0
// dml/parallel/precision.hpp — the precision family: the working type of parameters, activations and gradients.
// Sits on core/dtype.hpp; the sharding policies keep float master weights beside a 16-bit working copy.
#pragma once

#include <concepts>

#include "dml/core/dtype.hpp"

namespace dml {

struct precision_family {};

namespace precision {
// Parameters, activations, gradients and optimizer state in float.
struct fp32 {
  using policy_family = precision_family;
  using type = float;
  static constexpr bool loss_scaling = false;
  static constexpr const char* name = "fp32";
};
// Mixed precision: parameters, activations and gradients in bf16 (GEMMs through oneDNN's bf16 kernels
// or cuBLASLt), float master weights and optimizer state, one fused update that writes both.
struct bf16 {
  using policy_family = precision_family;
  using type = dml::bf16;
  static constexpr bool loss_scaling = false;
  static constexpr const char* name = "bf16";
};
// As bf16 but in fp16, with dynamic loss scaling: a step whose gradients overflow is skipped and the
// scale shrinks; it grows after a run of good steps (optim/loss_scaler.hpp).
struct fp16 {
  using policy_family = precision_family;
  using type = dml::fp16;
  static constexpr bool loss_scaling = true;
  static constexpr const char* name = "fp16";
};
}  // namespace precision

// The concept, in named parts so that a failure names the missing one.
template <class P>
concept in_precision_family = requires { typename P::policy_family; } &&
                              std::same_as<typename P::policy_family, precision_family>;
template <class P>
concept has_working_type = requires { typename P::type; } &&
                           (std::same_as<typename P::type, float> || std::same_as<typename P::type, dml::bf16> ||
                            std::same_as<typename P::type, dml::fp16>);
template <class P>
concept has_loss_scaling = requires {
  { P::loss_scaling } -> std::convertible_to<bool>;
};
template <class P>
concept has_precision_name = requires {
  { P::name } -> std::convertible_to<const char*>;
};
template <class P>
concept precision_policy = in_precision_family<P> && has_working_type<P> && has_loss_scaling<P> && has_precision_name<P>;

// static_assert(diagnose_precision<P>()) names the first missing part.
template <class P>
consteval bool diagnose_precision() {
  static_assert(in_precision_family<P>, "dml: a precision policy needs `using policy_family = dml::precision_family;`");
  static_assert(has_working_type<P>, "dml: a precision policy needs `using type = float`, `dml::bf16` or `dml::fp16`");
  static_assert(has_loss_scaling<P>, "dml: a precision policy needs `static constexpr bool loss_scaling`");
  static_assert(has_precision_name<P>, "dml: a precision policy needs `static constexpr const char* name`");
  return true;
}

}  // namespace dml
