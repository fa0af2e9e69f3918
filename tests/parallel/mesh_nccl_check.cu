// SPDX-License-Identifier: Apache-2.0
// tests/parallel/mesh_nccl_check.cu — parallel::mesh over comm::nccl, every member instantiated under nvcc.
// Compile-only (part of dml_cuda_compile): the mesh's logic is tested on comm::local and comm::mpi. Its groups
// are comm::nccl communicators (split from the world), which move device memory.
#include <concepts>

#include "dml/comm/nccl.hpp"
#include "dml/parallel/mesh.hpp"

static_assert(dml::comm::communicator<dml::comm::nccl>);
static_assert(std::same_as<dml::comm::memory_space_t<dml::comm::nccl>, dml::cuda>);
template class dml::parallel::mesh<dml::comm::nccl>;
