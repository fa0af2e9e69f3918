// SPDX-License-Identifier: Apache-2.0
// tests/train/test_trainer_mpi.cpp — under mpirun: every sharding over comm::mpi trains to the per-step losses
// of one rank with the same global batch (each process computes that reference on a one-rank split).
#include <doctest/doctest.h>

#include "dml/comm/mpi.hpp"
#include "gpt_fixture.hpp"
#include "trainer_fixture.hpp"

using namespace trainer_fixture;

namespace {
dml::comm::mpi::environment& environment() {
  static dml::comm::mpi::environment env;
  return env;
}
}  // namespace

TEST_CASE_TEMPLATE("comm::mpi: sharding x world size equals one rank", S, parallel::replicate, parallel::zero<1>,
                   parallel::zero<2>, parallel::zero<3>) {
  environment();
  comm::mpi world;
  comm::mpi alone = world.split(world.rank(), 0);  // a group of one: the single-rank reference
  const auto ref = train_ranks<parallel::replicate, optim::adamw>(alone, options());
  auto o = options();
  o.micro_batches = 2;
  const auto got = train_ranks<S, optim::adamw>(world, o);
  CAPTURE(world.size());
  check_same(ref, got, 1e-5);
}

// Pipeline stages over processes (np 4: 2 stages × 2 data-parallel ranks; np 2: 2 stages), dropout on.
TEST_CASE("comm::mpi: pipeline schedules x stages equal one rank") {
  environment();
  comm::mpi world;
  comm::mpi alone = world.split(world.rank(), 0);
  const auto model = make_deep_model(0.2f);
  const auto ref = train_ranks<parallel::replicate>(alone, options(), model);
  for (const char* sched : {"gpipe", "1f1b", "interleaved:2", "zb"}) {
    auto o = options();
    o.pipeline_stages = 2;
    o.micro_batches = 4;
    o.schedule = sched;
    CAPTURE(sched);
    CAPTURE(world.size());
    check_same(ref, train_ranks<parallel::replicate>(world, o, model), 1e-5);
  }
}

// A GPT over processes against one rank, dropout on: np 4 runs tp 4 with sequence parallelism, tp 2 × dp 2, and
// tp 2 × pp 2 with sequence parallelism; np 2 runs tp 2 with and without it (train_tensor covers every layout
// on comm::local).
TEST_CASE("comm::mpi: tensor, sequence, pipeline and data parallelism of a GPT equal one rank") {
  environment();
  comm::mpi world;
  comm::mpi alone = world.split(world.rank(), 0);
  const auto ref = gpt_fixture::train_gpt<parallel::replicate, optim::adamw>(alone, {}, gpt_fixture::config());
  const int n = world.size();
  for (const gpt_fixture::layout& l : {gpt_fixture::layout{.tp = n}, gpt_fixture::layout{.tp = n, .sp = true},
                                      gpt_fixture::layout{.tp = 2, .dp = n / 2}, gpt_fixture::layout{.tp = 2, .pp = n / 2, .sp = true}}) {
    if (l.size() != n || (n == 4 && l.tp == 4 && !l.sp)) continue;
    CAPTURE(l.name());
    gpt_fixture::check_same(ref, gpt_fixture::train_gpt<parallel::replicate, optim::adamw>(world, l, gpt_fixture::config()),
                            l.name());
  }
}
