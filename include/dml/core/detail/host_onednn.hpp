// SPDX-License-Identifier: Apache-2.0
// dml/core/detail/host_onednn.hpp — oneDNN as dml::gemm's host back end: one cached matmul primitive per problem,
// with bias, beta and ReLU as post-ops, or dnnl_sgemm through the C API (under nvcc always).
// Sits on core/gemm_args.hpp; used by core/gemm.hpp and core/detail/host_gemm_choice.hpp.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>

#if defined(_OPENMP)
#  include <omp.h>
#endif

// nvcc 13's front end stops with an internal error on dnnl.hpp in C++20 mode (it cannot destroy
// a std::vector of the C API's unnamed typedef'd structs); CUDA translation units use the C API.
#if defined(__CUDACC__)
#  include <oneapi/dnnl/dnnl.h>
#else
#  include <oneapi/dnnl/dnnl.hpp>
#endif
#include <oneapi/dnnl/dnnl_version.h>  // DNNL_VERSION_MAJOR: the 2.x and 3.x forms below

#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"
#include "dml/core/gemm_args.hpp"

namespace dml::detail::inline DML_TU_NAMESPACE {  // differs between nvcc and host compilers (config.hpp)

// C += bias, then ReLU, over an m×n block: what the matmul primitive fuses as post-ops, as one pass after a
// BLAS-like call (dnnl_sgemm, OpenBLAS, BLIS).
inline void host_bias_relu(float* c, std::int64_t m, std::int64_t n, std::int64_t ldc, const float* bias, bool relu) {
  if (!bias && !relu) return;
  for (std::int64_t i = 0; i < m; ++i) {
    float* row = c + i * ldc;
#pragma omp simd
    for (std::int64_t j = 0; j < n; ++j) {
      const float v = row[j] + (bias ? bias[j] : 0.f);
      row[j] = relu ? (v < 0.f ? 0.f : v) : v;
    }
  }
}

// C = op(A)·op(B) + beta·C by dnnl_sgemm (row-major; f32 only: oneDNN 2.6's C API has no 16-bit GEMM entry point),
// then bias and ReLU in one pass over C. It reads the C it accumulates into inside the kernel, where the matmul
// primitive's sum post-op waits on each line of a C out of cache (DESIGN.md §3).
inline void host_gemm_sgemm(const gemm_args& g) {
  float* c = g.c.as<float>();
  const dnnl_status_t st = dnnl_sgemm(g.ta == trans::t ? 'T' : 'N', g.tb == trans::t ? 'T' : 'N', g.m, g.n, g.k, 1.f,
                                      g.a.as<float>(), g.lda, g.b.as<float>(), g.ldb, g.beta, c, g.ldc);
  if (st != dnnl_success) fail("dml::gemm: dnnl_sgemm expected dnnl_success, found status ", int(st));
  host_bias_relu(c, g.m, g.n, g.ldc, g.bias.as<float>(), g.ep == epilogue::relu);
}

#if !defined(__CUDACC__)
struct dnnl_host_context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  // ta, tb, m, n, k, lda, ldb, ldc, bias, beta, epilogue, type of A and B, type of C.
  using key = std::tuple<int, int, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, bool, bool, int, int, int>;
  struct entry {
    dnnl::matmul prim;
    dnnl::memory a, b, c, bias;
  };
  // Keyed by the threads as well: a primitive runs on the threads the calling thread had when it was built
  // (oneDNN reads omp_get_max_threads() then), so one built under a budget of 2 and run under 1 would start
  // two threads per call beside the other ranks', and one built under 1 would leave a core idle under 2.
  std::map<std::pair<int, key>, entry> cache;
  static int threads() {
#  if defined(_OPENMP)
    return omp_get_max_threads();
#  else
    return 0;
#  endif
  }

  static dnnl_host_context& get() {
    thread_local dnnl_host_context ctx;  // each rank thread keeps its own primitives and stream
    return ctx;
  }
};

inline dnnl_host_context::key gemm_key(const gemm_args& g) {
  return {int(g.ta), int(g.tb), g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.bias.ptr != nullptr,
          g.beta != 0.f, int(g.ep), int(g.a.type), int(g.c.type)};
}

inline dnnl::memory::data_type dnnl_type(dtype t) {
  using dt = dnnl::memory::data_type;
  switch (t) {
    case dtype::f32: return dt::f32;
    case dtype::bf16: return dt::bf16;
    case dtype::f16: return dt::f16;
    default: break;
  }
  fail<invalid_argument>("dml::gemm: expected an element type of F32, BF16 or F16, found ", t);
}

// The matmul oneDNN offers for g on this CPU, or none (reference kernels count as none: they are
// orders of magnitude slower than widening to f32).
inline std::optional<dnnl::matmul::primitive_desc> try_host_matmul_desc(const dnnl::engine& eng, const gemm_args& g) {
  using dims = dnnl::memory::dims;
  const dims a_strides = g.ta == trans::n ? dims{g.lda, 1} : dims{1, g.lda};
  const dims b_strides = g.tb == trans::n ? dims{g.ldb, 1} : dims{1, g.ldb};
  const auto ab = dnnl_type(g.a.type), ct = dnnl_type(g.c.type);
  dnnl::memory::desc a_md({g.m, g.k}, ab, a_strides);
  dnnl::memory::desc b_md({g.k, g.n}, ab, b_strides);
  dnnl::memory::desc c_md({g.m, g.n}, ct, dims{g.ldc, 1});
  dnnl::post_ops ops;
  if (g.beta != 0.f) ops.append_sum(g.beta);
  // oneDNN 3.0 dropped the eltwise post-op's scale and the operation descriptors (matmul::desc): the
  // primitive descriptor takes the engine and the memory descriptors directly. Both forms are kept so
  // the package builds with Debian's 2.x and with the 3.x that vcpkg and Conan ship (README: Packaging).
#if DNNL_VERSION_MAJOR >= 3
  if (g.ep == epilogue::relu) ops.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
#else
  if (g.ep == epilogue::relu) ops.append_eltwise(1.f, dnnl::algorithm::eltwise_relu, 0.f, 0.f);
#endif
  dnnl::primitive_attr attr;
  attr.set_post_ops(ops);
  try {
    std::optional<dnnl::matmul::primitive_desc> pd;
    if (g.bias.ptr) {
      dnnl::memory::desc bias_md({1, g.n}, ct, dims{g.n, 1});
#if DNNL_VERSION_MAJOR >= 3
      pd.emplace(eng, a_md, b_md, bias_md, c_md, attr);
#else
      pd.emplace(dnnl::matmul::desc(a_md, b_md, bias_md, c_md), attr, eng);
#endif
    } else {
#if DNNL_VERSION_MAJOR >= 3
      pd.emplace(eng, a_md, b_md, c_md, attr);
#else
      pd.emplace(dnnl::matmul::desc(a_md, b_md, c_md), attr, eng);
#endif
    }
    if (g.a.type != dtype::f32 && std::string_view(pd->impl_info_str()).starts_with("ref")) return std::nullopt;
    return pd;
  } catch (const dnnl::error&) {
    return std::nullopt;
  }
}

inline dnnl::matmul::primitive_desc host_matmul_desc(const dnnl::engine& eng, const gemm_args& g) {
  if (auto pd = try_host_matmul_desc(eng, g)) return *pd;
  fail("dml::gemm: expected oneDNN to offer a matmul for A,B=", g.a.type, " C=", g.c.type, " m=", g.m, " n=", g.n,
       " k=", g.k, " on this CPU, found none");
}

// One cached oneDNN matmul primitive per problem, with beta, bias and ReLU as post-ops and the
// output rounded to C's type by the kernel.
inline void host_gemm_onednn(const gemm_args& g) {
  auto& ctx = dnnl_host_context::get();
  const auto key = std::pair{dnnl_host_context::threads(), gemm_key(g)};
  auto it = ctx.cache.find(key);
  if (it == ctx.cache.end()) {
    auto pd = host_matmul_desc(ctx.engine, g);
    dnnl_host_context::entry e{dnnl::matmul(pd), dnnl::memory(pd.src_desc(), ctx.engine, nullptr),
                               dnnl::memory(pd.weights_desc(), ctx.engine, nullptr),
                               dnnl::memory(pd.dst_desc(), ctx.engine, nullptr), {}};
    if (g.bias.ptr) e.bias = dnnl::memory(pd.bias_desc(), ctx.engine, nullptr);
    it = ctx.cache.emplace(key, std::move(e)).first;
  }
  auto& e = it->second;
  // Memory objects are cached with the primitive; only their data pointers change per call.
  e.a.set_data_handle(const_cast<void*>(g.a.ptr));
  e.b.set_data_handle(const_cast<void*>(g.b.ptr));
  e.c.set_data_handle(g.c.ptr);
  std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, e.a}, {DNNL_ARG_WEIGHTS, e.b}, {DNNL_ARG_DST, e.c}};
  if (g.bias.ptr) {
    e.bias.set_data_handle(const_cast<void*>(g.bias.ptr));
    args.emplace(DNNL_ARG_BIAS, e.bias);
  }
  e.prim.execute(ctx.stream, args);
  ctx.stream.wait();
}

// Whether oneDNN has a matmul kernel for 16-bit inputs on this CPU. oneDNN 2.6 has bf16 kernels
// only from AVX512-BF16 (or AVX-512 emulation) on and f16 kernels only with AVX512-FP16; an AVX2
// CPU has neither. Asked once per type for a representative shape.
inline bool host_gemm_is_native(dtype ab) {
  if (ab == dtype::f32) return true;
  static const auto probe = [](dtype t) {
    gemm_args g{.m = 64, .n = 64, .k = 64, .lda = 64, .ldb = 64, .ldc = 64};
    g.a.type = g.b.type = t;
    return try_host_matmul_desc(dnnl::engine(dnnl::engine::kind::cpu, 0), g).has_value();
  };
  static const bool bf16 = probe(dtype::bf16), f16 = probe(dtype::f16);
  return ab == dtype::bf16 ? bf16 : f16;
}

#else
// The same contract through the C API (host_gemm_sgemm): f32 only.
inline void host_gemm_onednn(const gemm_args& g) { host_gemm_sgemm(g); }

inline bool host_gemm_is_native(dtype ab) { return ab == dtype::f32; }
#endif

}  // namespace dml::detail::DML_TU_NAMESPACE
