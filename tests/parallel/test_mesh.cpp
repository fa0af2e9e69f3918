// SPDX-License-Identifier: Apache-2.0
// tests/parallel/test_mesh.cpp — parallel::mesh on comm::local: every tp × dp × pp (× ep) layout of 8, 4, 2 and 1
// ranks has groups of the right members, in Megatron-LM's order; bad shapes fail with what was expected and found.
#include <doctest/doctest.h>

#include <cstdint>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "dml/comm/local.hpp"
#include "dml/parallel/mesh.hpp"
#include "mesh_check.hpp"

namespace test_mesh {

using dml::comm::local;
using dml::parallel::mesh;
using dml::parallel::mesh_shape;

namespace {

// Runs the mesh check of `s` on n local ranks; failures are checked after the ranks have joined.
void check_on_ranks(int n, mesh_shape s) {
  std::mutex m;
  std::vector<std::string> failures;
  local::run(n, [&](local& world) {
    auto rep = mesh_check::check(world, s);
    std::lock_guard lk(m);
    failures.insert(failures.end(), rep.failures.begin(), rep.failures.end());
  });
  for (const auto& f : failures) FAIL_CHECK(f);
}

// The error every rank of an n-rank world raises for shape s.
std::string error_of(int n, mesh_shape s) {
  std::string what;
  try {
    local::run(n, [&](local& world) { mesh<local> m(world, s); });
  } catch (const dml::invalid_argument& e) {
    what = e.what();
  }
  return what;
}

}  // namespace

TEST_CASE("parallel::mesh: every layout of 8, 4, 2 and 1 ranks has the groups of the formula") {
  int shapes = 0;
  for (int n : {8, 4, 2, 1}) {
    for (const auto& s : mesh_check::shapes_of(n)) {
      CAPTURE(dml::parallel::to_string(s));
      check_on_ranks(n, s);
      ++shapes;
    }
  }
  // (tp, dp, pp, ep) with tp·dp·pp = n and ep | dp: 20 + 10 + 4 + 1; then each cp > 1 dividing dp, twice (ep 1
  // and ep = dp): 20, 8 and 2 more for n = 8, 4 and 2.
  CHECK(shapes == 20 + 10 + 4 + 1 + 20 + 8 + 2);
}

TEST_CASE("parallel::mesh: coordinates, neighbours and describe() on tp 1 × dp 2 × pp 2") {
  std::mutex mu;
  std::vector<std::string> texts(4);
  std::vector<std::vector<int>> seen(4);
  local::run(4, [&](local& world) {
    mesh<local> m(world, {.tp = 1, .dp = 2, .pp = 2});
    std::lock_guard lk(mu);
    texts[world.rank()] = m.describe();
    seen[world.rank()] = {m.tp_rank(), m.dp_rank(), m.pp_rank(), m.pp_prev(), m.pp_next(), m.world_rank_of(0, 1, 1)};
  });
  CHECK(texts[0] == "tp 1 × dp 2 × pp 2, this rank: tp 0 dp 0 pp 0");
  CHECK(texts[1] == "tp 1 × dp 2 × pp 2, this rank: tp 0 dp 1 pp 0");
  CHECK(texts[2] == "tp 1 × dp 2 × pp 2, this rank: tp 0 dp 0 pp 1");
  CHECK(texts[3] == "tp 1 × dp 2 × pp 2, this rank: tp 0 dp 1 pp 1");
  CHECK(seen[1] == std::vector<int>{0, 1, 0, -1, 1, 3});
  CHECK(seen[2] == std::vector<int>{0, 0, 1, 0, -1, 3});
}

TEST_CASE("parallel::mesh: describe() names the expert group when ep > 1") {
  std::string text;
  local::run(8, [&](local& world) {
    mesh<local> m(world, {.tp = 2, .dp = 4, .ep = 2});
    if (world.rank() == 7) text = m.describe();
  });
  CHECK(text == "tp 2 × dp 4 (ep 2) × pp 1, this rank: tp 1 dp 3 (ep 1) pp 0");
}

TEST_CASE("parallel::mesh: describe() names the context-parallel group when cp > 1") {
  std::string text;
  local::run(8, [&](local& world) {
    mesh<local> m(world, {.dp = 8, .ep = 2, .cp = 4});
    if (world.rank() == 6) text = m.describe();
  });
  CHECK(text == "tp 1 × dp 8 (ep 2, cp 4) × pp 1, this rank: tp 0 dp 6 (ep 0, cp 2) pp 0");
}

TEST_CASE("parallel::mesh: a shape that does not fit the world fails on every rank with what it expected") {
  CHECK(error_of(3, {.tp = 1, .dp = 2, .pp = 2}) ==
        "dml::parallel::mesh: expected a world of tp 1 × dp 2 × pp 2 = 4 ranks, found 3");
  CHECK(error_of(8, {.tp = 2, .dp = 2}) == "dml::parallel::mesh: expected a world of tp 2 × dp 2 × pp 1 = 4 ranks, found 8");
  CHECK(error_of(1, {.tp = 1, .dp = 1, .pp = 2}) ==
        "dml::parallel::mesh: expected a world of tp 1 × dp 1 × pp 2 = 2 ranks, found 1");
  CHECK(error_of(2, {.tp = 0, .dp = 2}) == "dml::parallel::mesh: expected every degree >= 1, found tp 0, dp 2, pp 1, ep 1, cp 1, replicas 1");
  CHECK(error_of(2, {.dp = 2, .pp = -1}) ==
        "dml::parallel::mesh: expected every degree >= 1, found tp 1, dp 2, pp -1, ep 1, cp 1, replicas 1");
  CHECK(error_of(4, {.dp = 4, .ep = 3}) ==
        "dml::parallel::mesh: expected ep to divide dp (an expert group is ep consecutive data-parallel ranks), found "
        "ep 3 and dp 4");
  CHECK(error_of(4, {.dp = 4, .cp = 3}) ==
        "dml::parallel::mesh: expected cp to divide dp (a context-parallel group is cp consecutive data-parallel "
        "ranks), found cp 3 and dp 4");
}

TEST_CASE("parallel::mesh: ranks that pass different shapes are told so instead of getting wrong groups") {
  std::string what;
  try {
    local::run(4, [&](local& world) {
      // Rank 0 thinks the world is tp 2 × dp 2, the others dp 4: rank 0 finds a tp group of one.
      mesh<local> m(world, world.rank() == 0 ? mesh_shape{.tp = 2, .dp = 2} : mesh_shape{.dp = 4});
    });
  } catch (const dml::error& e) {
    what = e.what();
  }
  CHECK(what.find("every rank must pass the same shape") != std::string::npos);
}

TEST_CASE("parallel::mesh: world_rank_of names coordinates outside the mesh") {
  std::string what;
  local::run(2, [&](local& world) {
    mesh<local> m(world, {.dp = 2});
    try {
      (void)m.world_rank_of(0, 2, 0);
    } catch (const dml::invalid_argument& e) {
      if (world.rank() == 0) what = e.what();
    }
  });
  CHECK(what == "dml::parallel::mesh::world_rank_of: expected tp in [0, 1), dp in [0, 2), pp in [0, 1), found tp 0 dp 2 "
                "pp 0");
}

TEST_CASE("parallel::mesh: a mesh moves with its groups") {
  local::run(4, [&](local& world) {
    mesh<local> a(world, {.tp = 2, .dp = 2});
    mesh<local> b = std::move(a);
    std::int32_t x = 1;
    b.tp().all_reduce(std::span<std::int32_t>(&x, 1), dml::comm::reduce_op::sum);
    if (x != 2) throw std::runtime_error("tp all_reduce after a move");
  });
}

static_assert(dml::comm::communicator<local>);

TEST_CASE("parallel::mesh: hybrid sharding's shard, expert shard and replicate groups") {
  // tp 1 × dp 8 (2 replicas of 4, ep 2) × pp 1: world rank = dp rank = shard rank + 4 · replica.
  local::run(8, [](local& world) {
    mesh<local> m(world, {.dp = 8, .ep = 2, .replicas = 2});
    const int r = world.rank();
    CHECK(m.shard_size() == 4);
    CHECK(m.shard_rank() == r % 4);
    CHECK(m.replica_rank() == r / 4);
    CHECK(m.shard().size() == 4);
    CHECK(m.shard().rank() == r % 4);
    CHECK(m.replicate().size() == 2);
    CHECK(m.replicate().rank() == r / 4);
    CHECK(m.expert_shard().size() == 2);  // the replica's ranks with this rank's experts: r % 2 the same
    CHECK(m.expert_shard().rank() == r % 4 / 2);
    // The shard group sums within a replica, the replicate group across replicas.
    std::vector<int> v{r};
    m.shard().all_reduce(std::span(v), dml::comm::reduce_op::sum);
    CHECK(v[0] == (r / 4) * 16 + 6);
    v = {r};
    m.replicate().all_reduce(std::span(v), dml::comm::reduce_op::sum);
    CHECK(v[0] == 2 * (r % 4) + 4);
    v = {r};
    m.expert_shard().all_reduce(std::span(v), dml::comm::reduce_op::sum);
    CHECK(v[0] == 2 * (r / 4 * 4 + r % 2) + 2);
  });
  CHECK(error_of(8, {.dp = 8, .replicas = 3}) ==
        "dml::parallel::mesh: expected replicas to divide dp (a replica is dp / replicas consecutive data-parallel "
        "ranks), found replicas 3 and dp 8");
  CHECK(error_of(8, {.dp = 8, .ep = 8, .replicas = 2}) ==
        "dml::parallel::mesh: expected ep and cp to divide a replica's 4 data-parallel ranks, found ep 8 and cp 1");
}

}  // namespace test_mesh
