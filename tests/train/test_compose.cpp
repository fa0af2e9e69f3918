// SPDX-License-Identifier: Apache-2.0
// tests/train/test_compose.cpp — every sharding composes with every kind of parallelism: shardings {replicate,
// zero1, zero2, zero3, hybrid zero2, hybrid zero3} × layouts {pp2·dp2 under gpipe, 1f1b, interleaved:2, zb;
// tp2+sp·dp2; ep2 (MoE); cp2·dp2; tp2·pp2·dp2; pp2·ep2·dp2; tp2+sp·pp2 zb; pp2·ep2·dp2 zb} × {tied, untied},
// each trained on comm::local against one rank. A pairwise subset (every sharding × layout once, tying alternating so that every sharding
// and every layout meets both) and the full product (label `compose`; about 6 s on 2 cores) both run with the
// unit tests. Checkpoints cross layouts: saved by zero3·pp2·ep2, hybrid zero2·tp2 and replicate·pp2·interleaved,
// each loaded into the other two and into one rank, resumed runs repeat an uninterrupted run's losses.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "support.hpp"
#include "gpt_fixture.hpp"

namespace test_compose {

namespace {

using namespace gpt_fixture;

constexpr int compose_steps = 6;

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
      // zb splits each block's backward: its weight products run later from what the input pass stashed.
      {"tp2+sp·pp2 zb", {.tp = 2, .pp = 2, .sp = true, .schedule = "zb"}},
      {"pp2·ep2·dp2 zb (MoE)", {.pp = 2, .dp = 2, .ep = 2, .schedule = "zb"}, true},
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
  CHECK(runs == 66);
}

// bf16: parameters, activations and gradients in bf16, float master weights. A layout sums gradients in
// another order and rounds them to bf16 at other points, so its losses leave one rank's by more than fp32's.
// Each sharding meets each layout, against a bf16 rank: worst seen 6.4e-4 (5.4e-4 before the zb layouts joined), bound 2e-3.
TEST_CASE("compose: in bf16, each sharding meets each layout, within the bf16 bound of one rank's losses") {
  auto bf16_run = []<class S>(S, const layout& l, const nn::gpt_config& g) {
    result out;
    comm::local::run(l.size(), [&](comm::local& c) {
      auto r = train_gpt<S, precision::bf16, optim::adamw>(c, l, g, compose_steps, 2);
      if (c.rank() == 0) out = std::move(r);
    });
    return out;
  };
  std::map<std::tuple<int, bool, bool>, result> refs;
  double worst = 0.0;
  int runs = 0;
  for (int i = 0; i < 6; ++i)
    for (std::size_t j = 0; j < kinds().size(); ++j) {
      const auto& k = kinds()[j];
      const bool tied = (i + static_cast<int>(j)) % 2 == 1;
      layout l = k.l;
      if (i >= 4 && l.dp % 2 == 0 && (l.dp / 2) % l.ep == 0 && (l.dp / 2) % l.cp == 0) l.replicas = 2;
      const auto g = compose_config(tied, k.moe);
      const int data_ranks = k.moe ? l.dp / l.cp : 1;
      auto key = std::make_tuple(data_ranks, tied, k.moe);
      if (!refs.contains(key)) refs.emplace(key, bf16_run(parallel::replicate{}, layout{.as_dp = data_ranks}, g));
      result got;
      switch (i) {
        case 0: got = bf16_run(parallel::replicate{}, l, g); break;
        case 1: got = bf16_run(parallel::zero<1>{}, l, g); break;
        case 2: got = bf16_run(parallel::zero<2>{}, l, g); break;
        case 3: got = bf16_run(parallel::zero<3>{}, l, g); break;
        case 4: got = bf16_run(parallel::hybrid<parallel::zero<2>>{}, l, g); break;
        default: got = bf16_run(parallel::hybrid<parallel::zero<3>>{}, l, g); break;
      }
      const auto& ref = refs.at(key);
      REQUIRE(got.losses.size() == ref.losses.size());
      for (std::size_t t = 0; t < ref.losses.size(); ++t) {
        const double rel = std::abs(double(got.losses[t]) - double(ref.losses[t])) / std::abs(double(ref.losses[t]));
        INFO("sharding ", i, " × ", k.name, tied ? ", tied" : "", " step ", t + 1);
        CHECK(rel <= 2e-3);
        worst = std::max(worst, rel);
      }
      ++runs;
    }
  MESSAGE("bf16 compose: ", runs, " runs, worst relative loss difference from one bf16 rank ", worst);
  CHECK(runs == 66);
}

TEST_CASE("compose: the full product of shardings × layouts × {tied, untied}") {
  int runs = 0;
  for (const auto& s : shardings())
    for (const auto& k : kinds())
      for (bool tied : {false, true}) {
        check_one(s, k, tied);
        ++runs;
      }
  CHECK(runs == 132);
}

namespace {

// A layout with the sharding it runs under, as a checkpoint's writer or reader.
using ck_runner = std::function<result(const layout&, const nn::gpt_config&, int, const checkpoints&)>;
template <class S>
ck_runner run_ck() {
  return [](const layout& l, const nn::gpt_config& g, int n_steps, const checkpoints& ck) {
    result out;
    comm::local::run(l.size(), [&](comm::local& c) {
      auto r = train_gpt<S, optim::adamw>(c, l, g, n_steps, 2, ck);
      if (c.rank() == 0) out = std::move(r);
    });
    return out;
  };
}
struct endpoint {
  std::string name;
  layout l;
  ck_runner run;
};

}  // namespace

// Every layout here has 2 data-parallel ranks (dp / cp = 2), so one rank ordering its rows as 2 ranks' micro-batches
// (as_dp 2) routes tokens as each of them does; one rank runs the experts unsplit, as does tp.
TEST_CASE("compose: checkpoints of zero3·pp2·ep2, hybrid zero2·tp2 and replicate·pp2·interleaved resume in each other and one rank") {
  constexpr int before = 3, after = 3;
  const std::vector<endpoint> layouts = {
      {"zero3 · pp2·ep2·dp2", {.pp = 2, .dp = 2, .ep = 2}, run_ck<parallel::zero<3>>()},
      {"hybrid zero2 · tp2·dp2 (2 replicas)", {.tp = 2, .dp = 2, .replicas = 2}, run_ck<parallel::hybrid<parallel::zero<2>>>()},
      {"replicate · pp2·dp2 interleaved:2", {.pp = 2, .dp = 2, .schedule = "interleaved:2"}, run_ck<parallel::replicate>()},
  };
  const endpoint one{"one rank", {.as_dp = 2}, run_ck<parallel::replicate>()};
  for (bool tied : {false, true}) {
    const auto g = compose_config(tied, true);
    const auto whole = one.run(one.l, g, before + after, {});
    REQUIRE(whole.losses.size() == before + after);
    int resumed = 0;
    for (const auto& from : layouts) {
      dml_test::temp_dir dir("dml-compose-ckpt");
      const auto first = from.run(from.l, g, before, {.save = dir.path.string()});
      for (const auto* to : {&layouts[0], &layouts[1], &layouts[2], &one}) {
        if (to == &from) continue;
        const auto rest = to->run(to->l, g, after, {.load = dir.path.string()});
        result joined = first;
        joined.losses.insert(joined.losses.end(), rest.losses.begin(), rest.losses.end());
        joined.grad_norms.insert(joined.grad_norms.end(), rest.grad_norms.begin(), rest.grad_norms.end());
        joined.params = rest.params;
        check_same(whole, joined, from.name + " saved, " + to->name + " resumed" + (tied ? ", tied" : ""));
        ++resumed;
      }
    }
    CHECK(resumed == 9);
  }
}

}  // namespace test_compose
