// SPDX-License-Identifier: Apache-2.0
// dml/core/space.hpp — execution spaces: where data lives and where kernels run.
// Sits on core/config.hpp; buffer, algorithm and gemm dispatch on these tags. See DESIGN.md §3.
#pragma once

#include <concepts>

#include "dml/core/config.hpp"

namespace dml {

// Spaces are policies too: dml::trainer<dml::cuda, ...> trains on the GPU.
struct space_family {};

// The CPU: Thrust's CPP/OpenMP back ends, oneDNN for GEMM.
struct host {
  using policy_family = space_family;
  static constexpr const char* name = "host";
};
// An NVIDIA GPU: Thrust's CUDA back end, cuBLAS for GEMM. Usable where nvcc compiles.
struct cuda {
  using policy_family = space_family;
  static constexpr const char* name = "cuda";
};

template <class S>
concept execution_space = std::same_as<S, host> || std::same_as<S, cuda>;

}  // namespace dml
