// SPDX-License-Identifier: Apache-2.0
// tests/parallel/test_param_server_mpi.cpp — under mpirun -np 5: the parameter server over comm::mpi.
// Ranks 0-1 (or 0-2) serve, the rest train: bsp gives synchronous data parallel's losses, and a server that
// stops mid-training under chain replication loses no acknowledged update.
#include <doctest/doctest.h>

#include <cmath>

#include "dml/comm/mpi.hpp"
#include "dml/ps/downpour.hpp"
#include "ps_fixture.hpp"

using namespace ps_fixture;
namespace ps = dml::ps;

namespace {
dml::comm::mpi::environment& environment() {
  static dml::comm::mpi::environment env;
  return env;
}
}  // namespace

TEST_CASE("comm::mpi: bsp with SGD gives synchronous data parallel's losses") {
  environment();
  comm::mpi world;
  const auto train = blobs(512, 1), test = blobs(64, 2);
  ps::options o;
  o.servers = 2;
  o.max_range = 100;
  o.optimizer = {ps::server_optimizer::sgd, 0.2f};
  const int workers = world.size() - o.servers;
  const std::int64_t steps = 20, batch = 8;
  std::vector<double> mine(std::size_t(steps), 0.0);
  ps::downpour_options d;
  d.steps = steps;
  d.batch = batch;
  d.seed = 3;
  d.on_step = [&](int, std::int64_t s, float loss) { mine[std::size_t(s)] = loss / workers; };
  ps::downpour(world, small_model(), train, test, ps::consistency::bsp{}, o, d);
  world.all_reduce(std::span<double>(mine), comm::reduce_op::sum);  // servers add zeros
  const auto want = sync_losses(train, workers, batch, steps, 0.2f, 3);
  for (std::int64_t s = 0; s < steps; ++s)
    CHECK(std::abs(mine[std::size_t(s)] - want[std::size_t(s)]) <= 1e-5 * std::abs(want[std::size_t(s)]));
}

TEST_CASE("comm::mpi: a server stops mid-training and no acknowledged update is lost") {
  environment();
  comm::mpi world;
  const auto train = blobs(2048, 8), test = blobs(400, 9);
  const ps::options o = failover_options();
  ps::downpour_options d;
  d.epochs = 2;
  d.batch = 16;
  const auto r = ps::downpour(world, small_model(), train, test, ps::consistency::ssp<>{2}, o, d);
  // Worker 0 holds the workers' totals and the accuracy; the server that stopped says so.
  const bool w0 = !r.accuracy.empty();
  double v[4] = {w0 ? r.totals.acknowledged : 0, w0 ? r.totals.lost : 0, r.died ? 1.0 : 0.0, w0 ? r.accuracy.back() : 0};
  world.all_reduce(std::span<double>(v), comm::reduce_op::sum);
  MESSAGE("acknowledged ", v[0], ", lost ", v[1], ", accuracy ", v[3]);
  CHECK(v[0] > 0);
  CHECK(v[1] == 0);
  CHECK(v[2] == 1);
  CHECK(v[3] > 0.9);
}
