// SPDX-License-Identifier: Apache-2.0
// dml/parallel/plan.hpp — the kinds of parallelism a run may use, as types: plan<data<S>, pipe<Sched>,
// tensor<...>, experts, context<...>>. Degrees are not part of the type: they come from the mesh at run time,
// so one binary sweeps them. Sits on parallel/{replicate,zero,schedule}.hpp and nn/; parallel/parallelize.hpp
// places a model by a plan, and train/trainer.hpp takes a plan as a policy. See DESIGN.md §9.
#pragma once

#include <concepts>
#include <type_traits>

#include "dml/nn/sequential.hpp"
#include "dml/parallel/mesh.hpp"
#include "dml/parallel/replicate.hpp"
#include "dml/parallel/schedule.hpp"
#include "dml/parallel/zero.hpp"

namespace dml {

struct plan_family {};

namespace parallel {

// ---- the kinds

// Data parallelism, with the sharding of parameters, gradients and optimizer state over the data-parallel
// ranks: replicate, zero<S> or hybrid<zero<S>>.
template <class Sharding = replicate>
struct data {
  using sharding = Sharding;
};
// Pipeline stages, run by a schedule policy (schedule::gpipe, one_f_one_b, interleaved<V>, zero_bubble, or
// automatic: 1F1B on a pipeline).
template <class Schedule = schedule::automatic>
struct pipe {
  using schedule = Schedule;
};
// Tensor parallelism (Megatron) of the layers that have a tensor-parallel form; with sequence_parallel the
// regions between them are split by tokens too.
struct sequence_parallel {};
template <class... Options>
struct tensor {
  static_assert((std::same_as<Options, sequence_parallel> && ...),
                "dml::parallel::tensor<...>: the only option is parallel::sequence_parallel");
  static constexpr bool sequence = (std::same_as<Options, sequence_parallel> || ...);
};
// Expert parallelism: the experts of mixture-of-experts layers shared out over groups of data-parallel ranks.
struct experts {};
// Context parallelism: attention over ranks holding chunks of the same sequences, zig-zag (balanced for causal
// attention) or contiguous, their K/V passed round the ranks (ring) or all-gathered at once (all_gather: the Llama 3
// report's scheme).
struct zigzag {};
struct contiguous {};
struct ring {};
struct all_gather {};
template <class Order = zigzag, class Exchange = ring>
struct context {
  static_assert(std::same_as<Order, zigzag> || std::same_as<Order, contiguous>,
                "dml::parallel::context<Order, Exchange>: Order is parallel::zigzag or parallel::contiguous");
  static_assert(std::same_as<Exchange, ring> || std::same_as<Exchange, all_gather>,
                "dml::parallel::context<Order, Exchange>: Exchange is parallel::ring or parallel::all_gather");
  static constexpr bool zigzag_chunks = std::same_as<Order, zigzag>;
  static constexpr bool gathers_kv = std::same_as<Exchange, all_gather>;
};

namespace detail {
template <class K, template <class...> class Tmpl>
inline constexpr bool is_kind = false;
template <template <class...> class Tmpl, class... A>
inline constexpr bool is_kind<Tmpl<A...>, Tmpl> = true;

template <class K>
inline constexpr bool known_kind = is_kind<K, data> || is_kind<K, pipe> || is_kind<K, tensor> ||
                                   std::same_as<K, experts> || is_kind<K, context>;

template <template <class...> class Tmpl, class Default, class... K>
struct kind_of {
  using type = Default;
};
template <template <class...> class Tmpl, class Default, class K, class... Rest>
struct kind_of<Tmpl, Default, K, Rest...> {
  using type = std::conditional_t<is_kind<K, Tmpl>, K, typename kind_of<Tmpl, Default, Rest...>::type>;
};

template <class Sharding>
inline constexpr bool hybrid_sharding = requires { requires Sharding::hybrid_sharding; };
}  // namespace detail

// The kinds of parallelism of a run, each at most once, in any order. What a plan lacks must have degree 1.
template <class... Kinds>
struct plan {
  static_assert((detail::known_kind<Kinds> && ...),
                "dml::parallel::plan<...>: every argument is a kind of parallelism: parallel::data<Sharding>, "
                "pipe<Schedule>, tensor<[sequence_parallel]>, experts or context<zigzag|contiguous>");
  static_assert((0 + ... + int(detail::is_kind<Kinds, data>)) <= 1 && (0 + ... + int(detail::is_kind<Kinds, pipe>)) <= 1 &&
                    (0 + ... + int(detail::is_kind<Kinds, tensor>)) <= 1 &&
                    (0 + ... + int(std::same_as<Kinds, experts>)) <= 1 &&
                    (0 + ... + int(detail::is_kind<Kinds, context>)) <= 1,
                "dml::parallel::plan<...>: a kind of parallelism appears twice; name each at most once");
  using policy_family = plan_family;
  using sharding = typename detail::kind_of<data, data<>, Kinds...>::type::sharding;
  using schedule = typename detail::kind_of<pipe, pipe<>, Kinds...>::type::schedule;
  static constexpr bool any_degree = false;  // degrees above 1 only for the kinds named
  static constexpr bool has_data = (detail::is_kind<Kinds, data> || ...);
  static constexpr bool has_pipe = (detail::is_kind<Kinds, pipe> || ...);
  static constexpr bool has_tensor = (detail::is_kind<Kinds, tensor> || ...);
  static constexpr bool has_experts = (std::same_as<Kinds, experts> || ...);
  static constexpr bool has_context = (detail::is_kind<Kinds, context> || ...);
  static constexpr bool sequence = detail::kind_of<tensor, tensor<>, Kinds...>::type::sequence;
  static constexpr bool zigzag_chunks = detail::kind_of<context, context<>, Kinds...>::type::zigzag_chunks;
  static constexpr bool gathers_kv = detail::kind_of<context, context<>, Kinds...>::type::gathers_kv;
};

// Every kind, with its degree and options left to run time: what dml::trainer<Sharding, Schedule> uses.
template <class Sharding = replicate, class Schedule = schedule::automatic>
struct any_plan {
  using policy_family = plan_family;
  using sharding = Sharding;
  using schedule = Schedule;
  static constexpr bool any_degree = true;
  static constexpr bool has_data = true, has_pipe = true, has_tensor = true, has_experts = true, has_context = true;
};

template <class P>
concept plan_policy = requires {
  typename P::sharding;
  typename P::schedule;
  { P::any_degree } -> std::convertible_to<bool>;
} && std::same_as<typename P::policy_family, plan_family>;

// ---- what the model must offer for each kind the plan names

// Of a layer, or of the layers of a stack.
template <class L, class E = nn::element_layer_t<L>>
concept tensor_splittable = requires(E& l, nn::tensor_split s) { l.set_split(s); };
template <class L, class E = nn::element_layer_t<L>>
concept expert_splittable = requires(E& l) { l.set_expert_split(1, 0); };
template <class L, class E = nn::element_layer_t<L>>
concept context_splittable = requires(E& l, nn::context_split s) { l.set_context_split(s); };

// static_assert(plan_fits<Plan, Layers...>()) fails, naming the kind, when the plan names a kind of
// parallelism that no layer of the model can take.
template <class Plan, class... Layers>
consteval bool plan_fits() {
  if constexpr (!Plan::any_degree) {
    static_assert(!Plan::has_tensor || (tensor_splittable<Layers> || ...),
                  "dml::parallelize: the plan names parallel::tensor<> but no layer of the model has a "
                  "tensor-parallel form (`set_split(nn::tensor_split)`, as nn::gpt's layers do); drop tensor<> "
                  "from the plan");
    static_assert(!Plan::has_experts || (expert_splittable<Layers> || ...),
                  "dml::parallelize: the plan names parallel::experts but no layer of the model holds experts "
                  "(`set_expert_split(ranks, rank)`, as nn::moe does); drop experts from the plan");
    static_assert(!Plan::has_context || (context_splittable<Layers> || ...),
                  "dml::parallelize: the plan names parallel::context<> but no layer of the model follows "
                  "context parallelism (`set_context_split(nn::context_split)`, as nn::gpt's layers do); drop "
                  "context<> from the plan");
  }
  return true;
}

// Fails, in one line naming the fix, when the mesh gives a degree above 1 to a kind the plan lacks.
template <plan_policy Plan>
void check_degrees(const mesh_shape& s) {
  if constexpr (!Plan::any_degree) {
    auto refuse = [&](const char* what, int degree, const char* kind) {
      fail<invalid_argument>("dml::parallelize: the mesh has ", what, " ", degree, " (", to_string(s),
                             ") but the plan has no ", kind, "; add it to the plan or make ", what, " 1");
    };
    if (s.tp > 1 && !Plan::has_tensor) refuse("tp", s.tp, "parallel::tensor<>");
    if (s.pp > 1 && !Plan::has_pipe) refuse("pp", s.pp, "parallel::pipe<Schedule>");
    if (s.ep > 1 && !Plan::has_experts) refuse("ep", s.ep, "parallel::experts");
    if (s.cp > 1 && !Plan::has_context) refuse("cp", s.cp, "parallel::context<>");
    if (s.dp > 1 && !Plan::has_data) refuse("dp", s.dp, "parallel::data<Sharding>");
  }
  if (s.replicas > 1 && !detail::hybrid_sharding<typename Plan::sharding>)
    fail<invalid_argument>("dml::parallelize: replicas ", s.replicas, " needs hybrid sharding (parallel::hybrid<",
                           "parallel::zero<S>>); found ", Plan::sharding::name);
}

}  // namespace parallel
}  // namespace dml
