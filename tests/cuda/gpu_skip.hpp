// SPDX-License-Identifier: Apache-2.0
// tests/cuda/gpu_skip.hpp — when a GPU test cannot run: no CUDA device, or (under mpirun) fewer devices on a
// node than ranks on it. Such a test prints one `SKIPPED: <reason>` line and exits 77, ctest's
// SKIP_RETURN_CODE for every gpu-labelled test, so that a machine without a GPU reports it skipped, never
// passed. Used by tests/cuda/*.cu and tests/comm/nccl_check.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <string>

namespace gpu_skip {

inline constexpr int exit_code = 77;

// Why this process cannot use a GPU, or "" when it can.
inline std::string no_device_reason() {
  int devices = 0;
  const cudaError_t rc = cudaGetDeviceCount(&devices);
  if (rc != cudaSuccess) return std::string("no CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(rc) + ")";
  if (devices == 0) return "no CUDA device (cudaGetDeviceCount found 0)";
  return "";
}

// For a single-process test: prints the SKIPPED line and returns true when there is no device.
inline bool skip_without_device() {
  const std::string why = no_device_reason();
  if (why.empty()) return false;
  std::printf("SKIPPED: %s\n", why.c_str());
  std::fflush(stdout);
  return true;
}

}  // namespace gpu_skip

#if __has_include(<mpi.h>)
#  include "dml/comm/mpi.hpp"

namespace gpu_skip {

// For a test under mpirun, after MPI_Init: every rank learns the same verdict (so none waits in a collective
// that another rank skipped), rank 0 prints the reason, and true means every rank returns exit_code. A rank
// needs a device of its own: its rank among the ranks of its node must be below the node's device count,
// which is the device comm::nccl's constructor selects.
inline bool skip_without_devices(MPI_Comm world) {
  int rank = 0;
  MPI_Comm_rank(world, &rank);
  const auto [local, local_size] = dml::comm::place_on_node(world);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  // [a rank without any device, a rank whose node has fewer devices than ranks, most ranks on a node, -fewest devices]
  int mine[4] = {devices == 0, local >= devices, local_size, -devices}, all[4] = {};
  MPI_Allreduce(mine, all, 4, MPI_INT, MPI_MAX, world);
  const bool skip = all[0] || all[1];
  if (skip && rank == 0) {
    std::string why;
    if (all[0]) {
      why = no_device_reason();
      if (why.empty()) why = "a rank on another node has no CUDA device";
    } else {
      why = "a node has fewer CUDA devices than ranks (fewest devices on a node: " + std::to_string(-all[3]) +
            ", most ranks on a node: " + std::to_string(all[2]) + "); run at most one rank per GPU";
    }
    std::printf("SKIPPED: %s\n", why.c_str());
    std::fflush(stdout);
  }
  // The line is out before any rank exits: mpirun ends the job when the first rank returns non-zero.
  MPI_Barrier(world);
  return skip;
}

}  // namespace gpu_skip
#endif
