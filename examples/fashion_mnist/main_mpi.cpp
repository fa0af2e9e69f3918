// SPDX-License-Identifier: Apache-2.0
// examples/fashion_mnist/main_mpi.cpp — the --comm mpi path: one rank per process, launched by mpirun.
// A translation unit of its own so its trainers compile in parallel with the comm::local ones.
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
  return dml::nn::with_mlp<max_hidden>(tr.features(), o.hidden, 10,
                                       [&](auto model) { return run_parallel(o, comm, model, tr, te); });
}

}  // namespace fashion_mnist
