// SPDX-License-Identifier: Apache-2.0
// examples/fashion_mnist/main_mpi.cpp — the --comm mpi path: one rank per process, launched by mpirun.
// Its trainers compile here, in a unit of their own (fashion_mnist.hpp, run_engines).
#include "dml/comm/mpi.hpp"
#include "fashion_mnist.hpp"

namespace fashion_mnist {

int run_mpi(const options& o, int argc, char** argv, const dml::train::dataset& tr, const dml::train::dataset& te) {
  (void)argc;
  (void)argv;
  dml::comm::mpi::environment env;
  dml::comm::mpi comm;
  if (o.ranks != 1 && o.ranks != comm.size())
    dml::fail<dml::invalid_argument>("--ranks ", o.ranks, " with --comm mpi: the MPI world has ", comm.size(),
                                     " ranks; leave --ranks out or make them agree");
  dml::set_thread_budget(o.threads);
  return run_parallel(o, comm, tr, te);
}

}  // namespace fashion_mnist
