// SPDX-License-Identifier: Apache-2.0
// The nvcc half of tests/cuda/odr (see host_unit.cpp).
#include <string>

#include "dml/core/buffer.hpp"
#include "dml/core/gemm.hpp"

std::string nvcc_unit_gemm_impl() { return dml::host_gemm_impl(); }
const void* nvcc_unit_copy_n() { return reinterpret_cast<const void*>(&dml::copy_n<float>); }
