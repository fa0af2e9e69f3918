// SPDX-License-Identifier: Apache-2.0
// tests/train/test_compose_mpi.cpp — under mpirun -np 4: six cases of the compose product (test_compose.cpp) over
// comm::mpi, each process's losses, gradient norms and parameters against a one-rank run it computes itself on a
// split of one. The cases: zero3 · pp2·dp2 zb; hybrid zero2 · tp2+sp·dp2 (2 replicas), tied; zero2 · ep2·edp2
// (MoE); zero1 · cp2·dp2; replicate · tp2·pp2, tied; zero3 · pp2·ep2 (MoE), tied.
#include <doctest/doctest.h>

#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "dml/comm/mpi.hpp"
#include "gpt_fixture.hpp"
#include "support.hpp"

namespace {

using namespace gpt_fixture;

constexpr int compose_steps = 6;

dml::comm::mpi::environment& environment() {
  static dml::comm::mpi::environment env;
  return env;
}

using runner = std::function<result(comm::mpi&, const layout&, const nn::gpt_config&)>;
template <class S>
runner run_with() {
  return [](comm::mpi& c, const layout& l, const nn::gpt_config& g) {
    return train_gpt<S, optim::adamw>(c, l, g, compose_steps, 2);
  };
}

struct compose_case {
  std::string name;
  runner run;
  layout l;
  bool tied = false, moe = false;
};

}  // namespace

TEST_CASE("comm::mpi: six shardings × layouts of the compose product equal one rank") {
  environment();
  comm::mpi world;
  if (world.size() != 4) {
    dml_test::skip("the cases need 4 processes, found " + std::to_string(world.size()));
    return;
  }
  comm::mpi alone = world.split(world.rank(), 0);  // a group of one: the single-rank reference
  const std::vector<compose_case> cases = {
      {"zero3 · pp2·dp2 zb", run_with<parallel::zero<3>>(), {.pp = 2, .dp = 2, .schedule = "zb"}},
      {"hybrid zero2 · tp2+sp·dp2 (2 replicas)", run_with<parallel::hybrid<parallel::zero<2>>>(),
       {.tp = 2, .dp = 2, .sp = true, .replicas = 2}, true},
      {"zero2 · ep2·edp2 (MoE)", run_with<parallel::zero<2>>(), {.dp = 4, .ep = 2}, false, true},
      {"zero1 · cp2·dp2", run_with<parallel::zero<1>>(), {.dp = 4, .cp = 2}},
      {"replicate · tp2·pp2", run_with<parallel::replicate>(), {.tp = 2, .pp = 2}, true},
      {"zero3 · pp2·ep2 (MoE)", run_with<parallel::zero<3>>(), {.pp = 2, .dp = 2, .ep = 2}, true, true},
  };
  // One rank, its rows ordered as the layout's micro-batches group them where routing statistics see them.
  std::map<std::tuple<int, bool, bool>, result> refs;
  int runs = 0;
  for (const auto& k : cases) {
    const int data_ranks = k.moe ? k.l.dp / k.l.cp : 1;
    const auto g = compose_config(k.tied, k.moe);
    auto key = std::make_tuple(data_ranks, k.tied, k.moe);
    if (!refs.contains(key))
      refs.emplace(key, train_gpt<parallel::replicate, optim::adamw>(alone, layout{.as_dp = data_ranks}, g,
                                                                     compose_steps, 2));
    REQUIRE(k.l.size() == world.size());
    const std::string what = k.name + (k.tied ? ", tied" : "") + ", rank " + std::to_string(world.rank());
    CAPTURE(what);
    check_same(refs.at(key), k.run(world, k.l, g), what);
    ++runs;
  }
  CHECK(runs == 6);
}
