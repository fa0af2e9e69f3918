// SPDX-License-Identifier: Apache-2.0
// tests/comm/mpi_watchdog.cpp — comm::mpi's watchdog: a collective that a peer never joins ends the job.
// Run under mpirun -np 2; ctest passes it when stderr names the operation and the rank.
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "dml/comm/mpi.hpp"

int main(int argc, char** argv) {
  dml::comm::mpi::environment env(&argc, &argv);
  dml::comm::mpi world(MPI_COMM_WORLD, {.timeout = std::chrono::milliseconds(500)});
  std::vector<float> x(1000, 1.0f);
  world.all_reduce(std::span<float>(x), dml::comm::reduce_op::sum);  // everyone joins this one
  if (world.rank() != 0) {
    // Rank 0 waits alone in the next all_reduce; the watchdog must end the job long before this.
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return 0;
  }
  world.all_reduce(std::span<float>(x), dml::comm::reduce_op::sum);
  std::printf("unreachable: the all_reduce completed without its peer\n");
  return 0;
}
