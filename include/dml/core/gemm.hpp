// SPDX-License-Identifier: Apache-2.0
// dml/core/gemm.hpp — matrix multiply with fused bias and activation: oneDNN on the host, cuBLAS on CUDA.
// Sits on core/space.hpp; nn/linear and every dense layer call it. See DESIGN.md §3.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <unordered_map>

// nvcc 13's front end stops with an internal error on dnnl.hpp in C++20 mode (it cannot destroy
// a std::vector of the C API's unnamed typedef'd structs); CUDA translation units use the C API.
#if defined(__CUDACC__)
#  include <oneapi/dnnl/dnnl.h>
#else
#  include <oneapi/dnnl/dnnl.hpp>
#endif

#include "dml/core/error.hpp"
#include "dml/core/space.hpp"

#if DML_HAS_CUDA
#  include "dml/core/detail/cublas_gemm.cuh"
#endif

namespace dml {

enum class trans : std::uint8_t { n, t };
// What the GEMM applies to its result after bias, fused into the same pass.
enum class epilogue : std::uint8_t { none, relu };

// Row-major C[m,n] = op(A)[m,k] · op(B)[k,n] + beta·C + bias[n], then the epilogue.
// lda/ldb/ldc are row strides of A, B and C as stored (before op).
struct gemm_args {
  trans ta = trans::n, tb = trans::n;
  std::int64_t m = 0, n = 0, k = 0;
  const float* a = nullptr;
  std::int64_t lda = 0;
  const float* b = nullptr;
  std::int64_t ldb = 0;
  float* c = nullptr;
  std::int64_t ldc = 0;
  float beta = 0.f;             // 0 or 1: overwrite or accumulate
  const float* bias = nullptr;  // length n, or null
  epilogue ep = epilogue::none;
};

namespace detail {

#if !defined(__CUDACC__)
struct dnnl_host_context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  using key = std::tuple<int, int, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, bool, bool, int, int>;
  struct entry {
    dnnl::matmul prim;
    dnnl::memory a, b, c, bias;
  };
  std::map<key, entry> cache;

  static dnnl_host_context& get() {
    thread_local dnnl_host_context ctx;  // each rank thread keeps its own primitives and stream
    return ctx;
  }
};

inline dnnl::matmul::primitive_desc host_matmul_desc(const dnnl::engine& eng, const gemm_args& g) {
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  const dims a_strides = g.ta == trans::n ? dims{g.lda, 1} : dims{1, g.lda};
  const dims b_strides = g.tb == trans::n ? dims{g.ldb, 1} : dims{1, g.ldb};
  dnnl::memory::desc a_md({g.m, g.k}, dt::f32, a_strides);
  dnnl::memory::desc b_md({g.k, g.n}, dt::f32, b_strides);
  dnnl::memory::desc c_md({g.m, g.n}, dt::f32, dims{g.ldc, 1});
  dnnl::post_ops ops;
  if (g.beta != 0.f) ops.append_sum(g.beta);
  if (g.ep == epilogue::relu) ops.append_eltwise(1.f, dnnl::algorithm::eltwise_relu, 0.f, 0.f);
  dnnl::primitive_attr attr;
  attr.set_post_ops(ops);
  if (g.bias) {
    dnnl::memory::desc bias_md({1, g.n}, dt::f32, dims{g.n, 1});
    return {dnnl::matmul::desc(a_md, b_md, bias_md, c_md), attr, eng};
  }
  return {dnnl::matmul::desc(a_md, b_md, c_md), attr, eng};
}

inline void host_gemm(const gemm_args& g) {
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) {  // oneDNN rejects empty reductions; the product is zero
    for (std::int64_t i = 0; i < g.m; ++i)
      for (std::int64_t j = 0; j < g.n; ++j) {
        float v = (g.beta != 0.f ? g.beta * g.c[i * g.ldc + j] : 0.f) + (g.bias ? g.bias[j] : 0.f);
        g.c[i * g.ldc + j] = g.ep == epilogue::relu && v < 0.f ? 0.f : v;
      }
    return;
  }
  auto& ctx = dnnl_host_context::get();
  const dnnl_host_context::key key{int(g.ta), int(g.tb), g.m, g.n, g.k, g.lda, g.ldb, g.ldc,
                                   g.bias != nullptr, g.beta != 0.f, int(g.ep), 0};
  auto it = ctx.cache.find(key);
  if (it == ctx.cache.end()) {
    auto pd = host_matmul_desc(ctx.engine, g);
    dnnl_host_context::entry e{dnnl::matmul(pd), dnnl::memory(pd.src_desc(), ctx.engine, nullptr),
                               dnnl::memory(pd.weights_desc(), ctx.engine, nullptr),
                               dnnl::memory(pd.dst_desc(), ctx.engine, nullptr), {}};
    if (g.bias) e.bias = dnnl::memory(pd.bias_desc(), ctx.engine, nullptr);
    it = ctx.cache.emplace(key, std::move(e)).first;
  }
  auto& e = it->second;
  // Memory objects are cached with the primitive; only their data pointers change per call.
  e.a.set_data_handle(const_cast<float*>(g.a));
  e.b.set_data_handle(const_cast<float*>(g.b));
  e.c.set_data_handle(g.c);
  std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, e.a}, {DNNL_ARG_WEIGHTS, e.b}, {DNNL_ARG_DST, e.c}};
  if (g.bias) {
    e.bias.set_data_handle(const_cast<float*>(g.bias));
    args.emplace(DNNL_ARG_BIAS, e.bias);
  }
  e.prim.execute(ctx.stream, args);
  ctx.stream.wait();
}

#else
// The same contract through the C API: C = op(A)·op(B) + beta·C by dnnl_sgemm (row-major), then
// bias and ReLU in one pass over C.
inline void host_gemm(const gemm_args& g) {
  if (g.m == 0 || g.n == 0) return;
  if (g.k > 0) {
    const dnnl_status_t st = dnnl_sgemm(g.ta == trans::t ? 'T' : 'N', g.tb == trans::t ? 'T' : 'N', g.m, g.n, g.k,
                                        1.f, g.a, g.lda, g.b, g.ldb, g.beta, g.c, g.ldc);
    if (st != dnnl_success) fail("dml::gemm: dnnl_sgemm expected dnnl_success, found status ", int(st));
  }
  if (g.k > 0 && !g.bias && g.ep == epilogue::none) return;
  for (std::int64_t i = 0; i < g.m; ++i)
    for (std::int64_t j = 0; j < g.n; ++j) {
      float& out = g.c[i * g.ldc + j];
      float v = g.k > 0 ? out : (g.beta != 0.f ? g.beta * out : 0.f);
      if (g.bias) v += g.bias[j];
      out = g.ep == epilogue::relu && v < 0.f ? 0.f : v;
    }
}
#endif
}  // namespace detail

template <execution_space Space>
void gemm(const gemm_args& g) {
  if (g.m < 0 || g.n < 0 || g.k < 0)
    fail<invalid_argument>("dml::gemm: sizes must be non-negative, found m=", g.m, " n=", g.n, " k=", g.k);
  if constexpr (std::same_as<Space, host>) {
    detail::host_gemm(g);
  } else {
#if DML_HAS_CUDA
    detail::cuda_gemm(g);
#else
    static_assert(sizeof(Space) == 0, "dml: the cuda space needs a translation unit compiled by nvcc");
#endif
  }
}

#if !defined(__CUDACC__)
// The implementation oneDNN picks for a representative f32 matmul, e.g. "brg:avx512_core".
inline std::string host_gemm_impl(std::int64_t m = 256, std::int64_t n = 1024, std::int64_t k = 1024) {
  gemm_args g{.m = m, .n = n, .k = k, .lda = k, .ldb = n, .ldc = n};
  return detail::host_matmul_desc(detail::dnnl_host_context::get().engine, g).impl_info_str();
}

#else
// nvcc translation units reach oneDNN through dnnl_sgemm, whose kernel choice is not exposed.
inline std::string host_gemm_impl(std::int64_t = 256, std::int64_t = 1024, std::int64_t = 1024) {
  return "dnnl_sgemm";
}
#endif

}  // namespace dml
