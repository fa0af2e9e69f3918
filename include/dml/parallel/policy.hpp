// SPDX-License-Identifier: Apache-2.0
// dml/parallel/policy.hpp — every policy family, and the lookup that lets trainer policies come in any order.
// Sits on parallel/{replicate,zero,precision,schedule}.hpp and optim/; train/trainer.hpp composes what it finds
// here. See DESIGN.md §1.
#pragma once

#include <type_traits>

#include "dml/core/space.hpp"
#include "dml/optim/optimizer.hpp"
#include "dml/parallel/plan.hpp"
#include "dml/parallel/precision.hpp"
#include "dml/parallel/replicate.hpp"
#include "dml/parallel/schedule.hpp"
#include "dml/parallel/zero.hpp"

namespace dml {

using optim::optimizer_family;

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

template <class P>
inline constexpr bool known_family = in_family<P, sharding_family>() || in_family<P, schedule_family>() ||
                                     in_family<P, precision_family>() || in_family<P, optimizer_family>() ||
                                     in_family<P, space_family>() || in_family<P, plan_family>();
}  // namespace detail

// The policy of Family among P..., or Default when none is given.
template <class Family, class Default, class... P>
using find_policy_t = typename detail::find_policy<Family, Default, P...>::type;

template <class Family, class... P>
inline constexpr int count_policies = (0 + ... + (detail::in_family<P, Family>() ? 1 : 0));

namespace detail {
// One check per template argument, so the compiler's "in instantiation of policy_check<X, ...>" line
// names the offending type X.
template <class P, class... All>
struct policy_check {
  static_assert(has_policy_family<P>,
                "dml::trainer: a template argument is not a policy (it has no `policy_family`); give shardings "
                "(parallel::replicate, parallel::zero<S>), schedules, precisions, optimizers or execution spaces");
  static_assert(!has_policy_family<P> || known_family<P>,
                "dml::trainer: a template argument's `policy_family` is none of sharding_family, schedule_family, "
                "precision_family, optim::optimizer_family, space_family, plan_family");
  static constexpr int same_family = [] {
    if constexpr (has_policy_family<P>) return count_policies<typename P::policy_family, All...>;
    else return 1;
  }();
  static_assert(same_family <= 1, "dml::trainer: two policies of one family; give at most one of each family");
  static constexpr bool ok = true;
};
}  // namespace detail

// Every Policies... is a known policy and no family repeats; the instantiation names the offender.
template <class... Policies>
inline constexpr bool check_policies = (detail::policy_check<Policies, Policies...>::ok && ...);

}  // namespace dml
