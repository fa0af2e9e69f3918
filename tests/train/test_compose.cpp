// SPDX-License-Identifier: Apache-2.0
// tests/train/test_compose.cpp — every sharding composes with every kind of parallelism: shardings {replicate,
// zero1, zero2, zero3, hybrid zero2, hybrid zero3} × layouts {pp2·dp2 under gpipe, 1f1b, interleaved:2, zb;
// tp2+sp·dp2; ep2 (MoE); cp2·dp2; tp2·pp2·dp2; pp2·ep2·dp2} × {tied, untied}, each trained on comm::local
// against one rank. A pairwise subset (every sharding × layout once, tying alternating so that every sharding
// and every layout meets both) and the full product (label `compose`; about 6 s on 2 cores) both run with the
// unit tests.
#include <doctest/doctest.h>

#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "gpt_fixture.hpp"

namespace {

using namespace gpt_fixture;

constexpr int compose_steps = 6;

// Four blocks (interleaved:2 on 2 stages needs 4 chunks), dropout off (the one-rank reference reorders rows
// as the micro-batches of the layout group them, which dropout masks would notice), optionally tied and with
// experts in every second block (4 experts, top-2, a capacity that drops tokens).
nn::gpt_config compose_config(bool tied, bool moe) {
  auto g = config(4, 0.f);
  g.tie_weights = tied;
  if (moe) {
    g.experts = 4;
    g.top_k = 2;
    g.capacity_factor = 1.f;
    g.moe_every = 2;
  }
  return g;
}

struct kind {
  std::string name;
  layout l;
  bool moe = false;
};
const std::vector<kind>& kinds() {
  static const std::vector<kind> all = {
      {"pp2·dp2 gpipe", {.pp = 2, .dp = 2, .schedule = "gpipe"}},
      {"pp2·dp2 1f1b", {.pp = 2, .dp = 2, .schedule = "1f1b"}},
      {"pp2·dp2 interleaved:2", {.pp = 2, .dp = 2, .schedule = "interleaved:2"}},
      {"pp2·dp2 zb", {.pp = 2, .dp = 2, .schedule = "zb"}},
      {"tp2+sp·dp2", {.tp = 2, .dp = 2, .sp = true}},
      {"ep2·edp2 (MoE)", {.dp = 4, .ep = 2}, true},
      {"cp2·dp2", {.dp = 4, .cp = 2}},
      {"tp2·pp2·dp2", {.tp = 2, .pp = 2, .dp = 2}},
      {"pp2·ep2·dp2 (MoE)", {.pp = 2, .dp = 2, .ep = 2}, true},
  };
  return all;
}

// A sharding, and whether it is hybrid (2 replicas where ep and cp still divide a replica).
using runner = std::function<result(const layout&, const nn::gpt_config&)>;
template <class S>
runner run_with() {
  return [](const layout& l, const nn::gpt_config& g) {
    result out;
    comm::local::run(l.size(), [&](comm::local& c) {
      auto r = train_gpt<S, optim::adamw>(c, l, g, compose_steps, 2);
      if (c.rank() == 0) out = std::move(r);
    });
    return out;
  };
}
struct sharding {
  std::string name;
  runner run;
  bool hybrid = false;
};
const std::vector<sharding>& shardings() {
  static const std::vector<sharding> all = {
      {"replicate", run_with<parallel::replicate>()},
      {"zero1", run_with<parallel::zero<1>>()},
      {"zero2", run_with<parallel::zero<2>>()},
      {"zero3", run_with<parallel::zero<3>>()},
      {"hybrid zero2", run_with<parallel::hybrid<parallel::zero<2>>>(), true},
      {"hybrid zero3", run_with<parallel::hybrid<parallel::zero<3>>>(), true},
  };
  return all;
}

// One rank, its rows ordered as the layout's micro-batches group them (what MoE routing statistics see).
const result& reference(const layout& l, bool tied, bool moe) {
  static std::map<std::tuple<int, bool, bool>, result> done;
  const int data_ranks = moe ? l.dp / l.cp : 1;
  auto key = std::make_tuple(data_ranks, tied, moe);
  if (auto it = done.find(key); it != done.end()) return it->second;
  result out;
  comm::local::run(1, [&](comm::local& c) {
    out = train_gpt<parallel::replicate, optim::adamw>(c, layout{.as_dp = data_ranks}, compose_config(tied, moe),
                                                       compose_steps, 2);
  });
  return done.emplace(key, std::move(out)).first->second;
}

void check_one(const sharding& s, const kind& k, bool tied) {
  layout l = k.l;
  const int shard = l.dp / 2;
  if (s.hybrid && l.dp % 2 == 0 && shard % l.ep == 0 && shard % l.cp == 0) l.replicas = 2;
  const std::string what = s.name + " × " + k.name + (l.replicas > 1 ? " (2 replicas)" : "") + (tied ? ", tied" : "");
  const auto got = s.run(l, compose_config(tied, k.moe));
  check_same(reference(l, tied, k.moe), got, what);
}

}  // namespace

TEST_CASE("compose: every sharding × every layout once, tied and untied alternating, gives one rank's losses") {
  int runs = 0;
  for (std::size_t i = 0; i < shardings().size(); ++i)
    for (std::size_t j = 0; j < kinds().size(); ++j) {
      check_one(shardings()[i], kinds()[j], (i + j) % 2 == 1);
      ++runs;
    }
  CHECK(runs == 54);
}

TEST_CASE("compose: the full product of shardings × layouts × {tied, untied}") {
  int runs = 0;
  for (const auto& s : shardings())
    for (const auto& k : kinds())
      for (bool tied : {false, true}) {
        check_one(s, k, tied);
        ++runs;
      }
  CHECK(runs == 108);
}
