// SPDX-License-Identifier: Apache-2.0
// dml/ps/consistency.hpp — the consistency policy family: when a parameter-server worker may go on with stale
// parameters. bsp, ssp<S> (bounded delay) and async (Downpour).
// Sits on core/; used by ps/server.hpp, which enforces the bound, and ps/downpour.hpp, which follows the cadence.
#pragma once

#include <concepts>
#include <cstdint>
#include <string>
#include <string_view>
#include <variant>

#include "dml/core/error.hpp"

namespace dml::ps {

struct consistency_family {};

namespace consistency {

// A pull made after a worker's c-th push waits until every live worker has pushed at least c - staleness()
// times to the ranges pulled. staleness() < 0: never waits.
inline constexpr int unbounded = -1;

// Bulk synchronous: step t's pushes of every worker are applied, at once and in worker order, before any
// pull of step t + 1 is answered, which gives synchronous data parallel's parameters.
struct bsp {
  using policy_family = consistency_family;
  static constexpr const char* name = "bsp";
  constexpr int staleness() const { return 0; }
  constexpr int pull_every() const { return 1; }
  constexpr int push_every() const { return 1; }
};

// Stale synchronous (bounded delay, Li et al. OSDI 2014 §3): a worker runs at most S steps ahead of the
// slowest. ssp<4> fixes the bound in the type; ssp<> takes it at run time.
inline constexpr int dynamic_staleness = -2;
template <int S = dynamic_staleness>
struct ssp {
  static_assert(S >= 0 || S == dynamic_staleness, "dml::ps::consistency::ssp<S>: expected a bound S >= 0");
  using policy_family = consistency_family;
  static constexpr const char* name = "ssp";
  int bound = S;
  constexpr int staleness() const { return bound; }
  constexpr int pull_every() const { return 1; }
  constexpr int push_every() const { return 1; }
};

// Downpour SGD (Dean et al. 2012): no waiting; a worker fetches parameters every n_fetch steps and pushes
// the gradients it accumulated every n_push steps.
struct async {
  using policy_family = consistency_family;
  static constexpr const char* name = "async";
  int n_fetch = 1, n_push = 1;
  constexpr int staleness() const { return unbounded; }
  constexpr int pull_every() const { return n_fetch; }
  constexpr int push_every() const { return n_push; }
};

}  // namespace consistency

template <class P>
concept in_consistency_family = requires { typename P::policy_family; } &&
                                std::same_as<typename P::policy_family, consistency_family>;
template <class P>
concept has_consistency_name = requires {
  { P::name } -> std::convertible_to<std::string_view>;
};
template <class P>
concept has_staleness = requires(const P& p) {
  { p.staleness() } -> std::convertible_to<int>;
};
template <class P>
concept has_cadence = requires(const P& p) {
  { p.pull_every() } -> std::convertible_to<int>;
  { p.push_every() } -> std::convertible_to<int>;
};
template <class P>
concept consistency_policy = in_consistency_family<P> && has_consistency_name<P> && has_staleness<P> && has_cadence<P>;

// static_assert(diagnose_consistency<P>()) names what P lacks.
template <class P>
consteval bool diagnose_consistency() {
  static_assert(in_consistency_family<P>,
                "dml: a consistency policy needs `using policy_family = dml::ps::consistency_family;`");
  static_assert(has_consistency_name<P>, "dml: a consistency policy needs `static constexpr const char* name`");
  static_assert(has_staleness<P>,
                "dml: a consistency policy needs `int staleness() const` (steps a worker may run ahead; < 0: any)");
  static_assert(has_cadence<P>,
                "dml: a consistency policy needs `int pull_every() const` and `int push_every() const` (steps)");
  return true;
}

static_assert(consistency_policy<consistency::bsp> && consistency_policy<consistency::ssp<4>> &&
              consistency_policy<consistency::ssp<>> && consistency_policy<consistency::async>);

namespace consistency {

using any = std::variant<bsp, ssp<>, async>;

// "bsp", "ssp:S" or "async" (n_fetch and n_push come from their own flags).
inline any parse(std::string_view s, int n_fetch = 1, int n_push = 1) {
  auto bad = [&](std::string_view why) -> any {
    fail<invalid_argument>("dml::ps::consistency::parse: expected bsp, ssp:S (S >= 0) or async, found '", s, "'", why);
  };
  if (s == "bsp") return bsp{};
  if (s == "async") {
    if (n_fetch < 1 || n_push < 1)
      fail<invalid_argument>("dml::ps::consistency::async: expected n_fetch >= 1 and n_push >= 1, found ", n_fetch,
                             " and ", n_push);
    return async{n_fetch, n_push};
  }
  if (s.starts_with("ssp:")) {
    const auto digits = s.substr(4);
    if (digits.empty() || digits.size() > 6) return bad("");
    int v = 0;
    for (char c : digits) {
      if (c < '0' || c > '9') return bad("");
      v = v * 10 + (c - '0');
    }
    return ssp<>{v};
  }
  return bad("");
}

inline std::string to_string(const any& p) {
  return std::visit(
      []<class P>(const P& q) -> std::string {
        if constexpr (std::same_as<P, ssp<>>) return dml::detail::cat("ssp:", q.bound);
        else if constexpr (std::same_as<P, async>)
          return dml::detail::cat("async(n_fetch ", q.n_fetch, ", n_push ", q.n_push, ")");
        else return P::name;
      },
      p);
}

}  // namespace consistency
}  // namespace dml::ps
