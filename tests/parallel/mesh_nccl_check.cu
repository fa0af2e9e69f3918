// SPDX-License-Identifier: Apache-2.0
// tests/parallel/mesh_nccl_check.cu — parallel::mesh over comm::nccl, every member instantiated under nvcc.
// Compile-only (part of dml_cuda_compile): the mesh's logic is tested on comm::local and comm::mpi.
#include "dml/comm/nccl.hpp"
#include "dml/parallel/mesh.hpp"

static_assert(dml::comm::communicator<dml::comm::nccl>);
template class dml::parallel::mesh<dml::comm::nccl>;
