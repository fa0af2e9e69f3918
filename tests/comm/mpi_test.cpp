// SPDX-License-Identifier: Apache-2.0
// tests/comm/mpi_test.cpp — comm::mpi under mpirun -np 2/3/4: the shared suite, sub-groups, misuse.
// Every process runs every case; a failure on any rank fails the mpirun.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "dml/comm/mpi.hpp"
#include "suite.hpp"

using dml::comm::mpi;
using dml::comm::reduce_op;

namespace {

// MPI lives as long as the process: initialised before doctest's main, finalised after it.
mpi::environment environment;

// A test that goes wrong on one rank must not leave the others waiting for ctest's timeout.
mpi::options test_options(bool check = false) {
  return {.timeout = std::chrono::seconds(120), .check_arguments = check};
}

void expect_clean(const dml_test::report& rep) {
  for (const auto& f : rep.failures) FAIL_CHECK(f);
  CHECK(rep.failures.empty());
}

}  // namespace

static_assert(dml::comm::communicator<mpi>);

TEST_CASE("comm::mpi: every operation, dtype and size matches the reference") {
  mpi world(MPI_COMM_WORLD, test_options());
  CHECK(world.size() >= 1);
  expect_clean(dml_test::run_suite(world, {0, 1, 1001, (1u << 15) + 3}));
}

TEST_CASE("comm::mpi: sub-groups of one rank each and of all ranks run the suite") {
  mpi world(MPI_COMM_WORLD, test_options());
  mpi self = world.split(world.rank(), 0);
  CHECK(self.size() == 1);
  expect_clean(dml_test::run_suite(self, {0, 1, 17}));
  mpi reversed = world.split(0, -world.rank());
  CHECK(reversed.rank() == world.size() - 1 - world.rank());
  expect_clean(dml_test::run_suite(reversed, {3, 1001}));
}

TEST_CASE("comm::mpi: split into a grid, collectives along rows and columns at once") {
  mpi world(MPI_COMM_WORLD, test_options());
  dml_test::report rep;
  dml_test::check_grid(world, rep);
  expect_clean(rep);
}

TEST_CASE("comm::mpi: with check_arguments, counts that differ across ranks throw on every rank") {
  mpi world(MPI_COMM_WORLD, test_options(true));
  if (world.size() < 2) return;
  std::vector<float> x(world.rank() == 1 ? 5 : 4, 1.0f);
  CHECK_THROWS_AS(world.all_reduce(std::span<float>(x), reduce_op::sum), dml::invalid_argument);
  std::vector<int> b(3);
  CHECK_THROWS_AS(world.broadcast(std::span<int>(b), world.rank() == 0 ? 0 : 1), dml::invalid_argument);
  std::vector<std::size_t> sc(world.size(), 1), rc(world.size(), 1);
  if (world.rank() == 1) rc[0] = 2;
  std::vector<float> s(world.size()), r(world.size() + (world.rank() == 1));
  CHECK_THROWS_AS(world.all_to_allv(std::span<const float>(s), std::span<const std::size_t>(sc),
                                    std::span<float>(r), std::span<const std::size_t>(rc)),
                  dml::invalid_argument);
  std::vector<float> y(7, 1.0f);  // still usable afterwards
  world.all_reduce(std::span<float>(y), reduce_op::sum);
  CHECK(y[6] == float(world.size()));
}

TEST_CASE("comm::mpi: a receive of the wrong size is an error naming the sizes") {
  mpi world(MPI_COMM_WORLD, test_options());
  const int next = (world.rank() + 1) % world.size(), prev = (world.rank() + world.size() - 1) % world.size();
  std::vector<double> s(3, 1.0), r(5);
  auto q = world.isend(std::span<const double>(s), next, 9);
  try {
    world.recv(std::span<double>(r), prev, 9);
    FAIL_CHECK("expected dml::invalid_argument");
  } catch (const dml::invalid_argument& e) {
    CHECK(std::string(e.what()).find("expected 5 elements") != std::string::npos);
  }
  q.wait();
  world.barrier();
}
