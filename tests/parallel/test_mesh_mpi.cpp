// SPDX-License-Identifier: Apache-2.0
// tests/parallel/test_mesh_mpi.cpp — under mpirun: parallel::mesh over comm::mpi, every tp × dp × pp (× ep) layout of
// the world has groups of the right members; a shape of another size fails on every process with what it expected.
#include <doctest/doctest.h>

#include <string>

#include "dml/comm/mpi.hpp"
#include "dml/parallel/mesh.hpp"
#include "mesh_check.hpp"

namespace {
dml::comm::mpi::environment& environment() {
  static dml::comm::mpi::environment env;
  return env;
}
}  // namespace

static_assert(dml::comm::communicator<dml::comm::mpi>);

TEST_CASE("comm::mpi: every layout of the world has the groups of the formula") {
  environment();
  dml::comm::mpi world;
  const auto shapes = mesh_check::shapes_of(world.size());
  for (const auto& s : shapes) {
    CAPTURE(dml::parallel::to_string(s));
    const auto rep = mesh_check::check(world, s);
    for (const auto& f : rep.failures) FAIL_CHECK(f);
  }
  CHECK(!shapes.empty());
}

TEST_CASE("comm::mpi: a shape that does not fit the world fails with what it expected") {
  environment();
  dml::comm::mpi world;
  const int n = world.size();
  const std::string expected = dml::detail::cat("dml::parallel::mesh: expected a world of tp 2 × dp ", n,
                                                " × pp 1 = ", 2 * n, " ranks, found ", n);
  CHECK_THROWS_WITH_AS(dml::parallel::mesh<dml::comm::mpi>(world, {.tp = 2, .dp = n}), expected.c_str(),
                       dml::invalid_argument);
  // The world is still usable: the failure came before any split.
  dml::parallel::mesh<dml::comm::mpi> m(world, {.dp = n});
  CHECK(m.dp().size() == n);
}
