// SPDX-License-Identifier: Apache-2.0
// dml/parallel/policy.hpp — policy families and the lookup that lets trainer policies come in any order.
// Sits on optim/optimizer.hpp; train/trainer.hpp composes what it finds here. See DESIGN.md §1.
#pragma once

#include <type_traits>

#include "dml/core/dtype.hpp"
#include "dml/optim/optimizer.hpp"

namespace dml {

struct sharding_family {};
struct precision_family {};
using optim::optimizer_family;

namespace parallel {
// Data parallel (DDP): every rank holds everything; gradients are all-reduced in buckets during backward.
struct replicate {
  using policy_family = sharding_family;
  static constexpr int stage = 0;
  static constexpr const char* name = "ddp";
};
// ZeRO stage 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters).
template <int Stage>
struct zero {
  static_assert(1 <= Stage && Stage <= 3, "dml::parallel::zero<Stage>: Stage is 1, 2 or 3");
  using policy_family = sharding_family;
  static constexpr int stage = Stage;
  static constexpr const char* name = Stage == 1 ? "zero1" : Stage == 2 ? "zero2" : "zero3";
};
}  // namespace parallel

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

namespace detail {
template <class P>
concept has_policy_family = requires { typename P::policy_family; };

template <class P, class Family>
constexpr bool in_family() {
  if constexpr (has_policy_family<P>) return std::is_same_v<typename P::policy_family, Family>;
  else return false;
}

template <class Family, class Default, class... P>
struct find_policy {
  using type = Default;
};
template <class Family, class Default, class P, class... Rest>
struct find_policy<Family, Default, P, Rest...> {
  using type = std::conditional_t<in_family<P, Family>(), P, typename find_policy<Family, Default, Rest...>::type>;
};
}  // namespace detail

// The policy of Family among P..., or Default when none is given.
template <class Family, class Default, class... P>
using find_policy_t = typename detail::find_policy<Family, Default, P...>::type;

template <class Family, class... P>
inline constexpr int count_policies = (0 + ... + (detail::in_family<P, Family>() ? 1 : 0));

}  // namespace dml
