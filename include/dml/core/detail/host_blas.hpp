// SPDX-License-Identifier: Apache-2.0
// dml/core/detail/host_blas.hpp — OpenBLAS and BLIS as optional host GEMM back ends beside oneDNN.
// Sits under core/gemm.hpp, which measures them per shape. Host only (never included by nvcc).
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <string>

namespace dml::detail {

// Both libraries are opened at run time with RTLD_LOCAL rather than linked: each exports the
// reference BLAS names (cblas_sgemm, sgemm_), so linking both makes one shadow the other, and a
// program built with dml runs, on oneDNN alone, where neither is installed. Only f32 GEMM is used.
struct host_blas {
  // OpenBLAS's CBLAS entry with 32-bit integers (Debian's libopenblas0 is LP64).
  using cblas_sgemm_fn = void (*)(int order, int ta, int tb, int m, int n, int k, float alpha, const float* a,
                                  int lda, const float* b, int ldb, float beta, float* c, int ldc);
  // BLIS's typed API with general strides (dim_t and inc_t are 64-bit in Debian's build).
  using bli_sgemm_fn = void (*)(int ta, int tb, std::int64_t m, std::int64_t n, std::int64_t k, const float* alpha,
                                const float* a, std::int64_t rsa, std::int64_t csa, const float* b, std::int64_t rsb,
                                std::int64_t csb, const float* beta, float* c, std::int64_t rsc, std::int64_t csc);

  cblas_sgemm_fn openblas_sgemm = nullptr;
  bli_sgemm_fn blis_sgemm = nullptr;
  std::string openblas_name, blis_name;  // e.g. "OpenBLAS 0.3.21 ... SkylakeX", "BLIS 0.9.0 (skx)"

  static const host_blas& get() {
    static const host_blas lib;
    return lib;
  }

 private:
  host_blas() {
    // Each library runs single-threaded: dml gives a rank its cores through OpenMP and oneDNN, and
    // the dispatch only considers these libraries for ranks whose thread budget is one.
    if (void* h = open({"libopenblas.so.0", "libopenblas.so"})) {
      openblas_sgemm = reinterpret_cast<cblas_sgemm_fn>(dlsym(h, "cblas_sgemm"));
      if (auto set = reinterpret_cast<void (*)(int)>(dlsym(h, "openblas_set_num_threads"))) set(1);
      auto config = reinterpret_cast<const char* (*)()>(dlsym(h, "openblas_get_config"));
      auto core = reinterpret_cast<const char* (*)()>(dlsym(h, "openblas_get_corename"));
      openblas_name = std::string(config ? config() : "OpenBLAS") + (core ? std::string(" core ") + core() : "");
    }
    if (void* h = open({"libblis.so.4", "libblis.so"})) {
      blis_sgemm = reinterpret_cast<bli_sgemm_fn>(dlsym(h, "bli_sgemm"));
      if (auto set = reinterpret_cast<void (*)(std::int64_t)>(dlsym(h, "bli_thread_set_num_threads"))) set(1);
      auto version = reinterpret_cast<const char* (*)()>(dlsym(h, "bli_info_get_version_str"));
      auto arch_id = reinterpret_cast<int (*)()>(dlsym(h, "bli_arch_query_id"));
      auto arch = reinterpret_cast<const char* (*)(int)>(dlsym(h, "bli_arch_string"));
      blis_name = std::string("BLIS ") + (version ? version() : "") +
                  (arch_id && arch ? std::string(" (") + arch(arch_id()) + ")" : "");
    }
  }
  static void* open(std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (void* h = dlopen(n, RTLD_NOW | RTLD_LOCAL)) return h;
    return nullptr;
  }
};

}  // namespace dml::detail
