// SPDX-License-Identifier: Apache-2.0
// examples/param_server/main_mpi.cpp — the --comm mpi path: one rank per process, launched by mpirun.
#include "dml/comm/mpi.hpp"
#include "param_server.hpp"

namespace param_server {

int run_mpi(const options& o, const dml::train::dataset& train, const dml::train::dataset& test) {
  dml::comm::mpi::environment env;
  dml::comm::mpi world;
  return run(o, world, train, test);
}

}  // namespace param_server
