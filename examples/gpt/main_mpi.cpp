// SPDX-License-Identifier: Apache-2.0
// examples/gpt/main_mpi.cpp — the --comm mpi path: one rank per process, launched by mpirun.
// A translation unit of its own so its trainers compile in parallel with the comm::local ones.
#include "dml/comm/mpi.hpp"
#include "train_gpt.hpp"

namespace gpt_example {

int run_mpi(const options& o, const corpus& text) {
  dml::comm::mpi::environment env;
  dml::comm::mpi comm;
  if (o.ranks != 1 && o.ranks != comm.size())
    dml::fail<dml::invalid_argument>("--ranks ", o.ranks, " with --comm mpi: the MPI world has ", comm.size(),
                                     " ranks; leave --ranks out or make them agree");
  dml::set_thread_budget(o.threads);
  return run(o, comm, text);
}

}  // namespace gpt_example
