// SPDX-License-Identifier: Apache-2.0
// tests/cuda/odr — one program of an nvcc unit and a host-compiler unit. Functions whose bodies differ between
// the two (core/config.hpp, DML_TU_NAMESPACE) must stay two functions: each unit reaches its own, whichever the
// linker sees first. Runs without a GPU (no CUDA call is made).
#include <cstdio>
#include <string>

#include "dml/core/buffer.hpp"
#include "dml/core/gemm.hpp"

std::string nvcc_unit_gemm_impl();
const void* nvcc_unit_copy_n();

int main() {
  int failures = 0;
  const std::string host = dml::host_gemm_impl(), nvcc = nvcc_unit_gemm_impl();
  const void* host_copy = reinterpret_cast<const void*>(&dml::copy_n<float>);
  std::printf("host unit: host_gemm_impl() = %s\nnvcc unit: host_gemm_impl() = %s\n", host.c_str(), nvcc.c_str());
  // The nvcc unit reaches oneDNN through its C API and says so; the host unit names oneDNN's kernel.
  if (nvcc.find("dnnl_sgemm") == std::string::npos) ++failures, std::printf("FAILED: the nvcc unit ran the host unit's host_gemm_impl\n");
  if (host.find("dnnl_sgemm") != std::string::npos) ++failures, std::printf("FAILED: the host unit ran the nvcc unit's host_gemm_impl\n");
  if (host_copy == nvcc_unit_copy_n()) ++failures, std::printf("FAILED: both units share one copy_n<float>\n");
  std::printf("%s\n", failures ? "odr: FAILED" : "odr: each unit has its own copy_n and host GEMM stack");
  return failures ? 1 : 0;
}
