// SPDX-License-Identifier: Apache-2.0
// dml/core/gemm.hpp — matrix multiply with fused bias and activation: oneDNN on the host, cuBLAS on CUDA.
// Sits on core/space.hpp and core/cast.hpp; nn/linear and every dense layer call it. See DESIGN.md §3.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

// nvcc 13's front end stops with an internal error on dnnl.hpp in C++20 mode (it cannot destroy
// a std::vector of the C API's unnamed typedef'd structs); CUDA translation units use the C API.
#if defined(__CUDACC__)
#  include <oneapi/dnnl/dnnl.h>
#else
#  include <oneapi/dnnl/dnnl.hpp>
#endif

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"
#include "dml/core/space.hpp"

#if DML_HAS_CUDA
#  include "dml/core/detail/cublas_gemm.cuh"
#endif

namespace dml {

enum class trans : std::uint8_t { n, t };
// What the GEMM applies to its result after bias, fused into the same pass.
enum class epilogue : std::uint8_t { none, relu };

// Row-major C[m,n] = op(A)[m,k] · op(B)[k,n] + beta·C + bias[n], then the epilogue, rounded once
// to C's type. lda/ldb/ldc are row strides of A, B and C as stored (before op).
// Types: A and B alike (f32, bf16 or f16); C and bias alike, either f32 or the type of A and B.
// Each pointer carries its type (core/cast.hpp), so `.a = float_ptr` and `.bias = nullptr` read as
// they always did and a bf16 pointer is never read as floats. Products always accumulate in f32.
struct gemm_args {
  trans ta = trans::n, tb = trans::n;
  std::int64_t m = 0, n = 0, k = 0;
  const_typed_ptr a{};
  std::int64_t lda = 0;
  const_typed_ptr b{};
  std::int64_t ldb = 0;
  typed_ptr c{};
  std::int64_t ldc = 0;
  float beta = 0.f;  // 0 or 1: overwrite or accumulate
  const_typed_ptr bias{};    // length n, or null
  epilogue ep = epilogue::none;
};

namespace detail {

// The product is empty when k = 0 (oneDNN and cuBLASLt both reject it); what is left is the
// epilogue on beta·C, in either space.
template <float_like T>
struct gemm_epilogue_only {
  T* c;
  const T* bias;
  std::int64_t n, ldc;
  float beta;
  bool relu;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t r = i / n, j = i % n;
    T& out = c[r * ldc + j];
    const float v = (beta != 0.f ? beta * static_cast<float>(out) : 0.f) + (bias ? static_cast<float>(bias[j]) : 0.f);
    out = T(relu && v < 0.f ? 0.f : v);
  }
};

// Strided rows×cols matrix <-> packed f32 copy (row stride cols), for the host's widening path.
template <float_like T>
struct widen_rows {
  const T* src;
  float* dst;
  std::int64_t cols, ld;
  DML_HOST_DEVICE void operator()(std::int64_t i) const { dst[i] = static_cast<float>(src[(i / cols) * ld + i % cols]); }
};
template <float_like T>
struct narrow_rows {
  const float* src;
  T* dst;
  std::int64_t cols, ld;
  DML_HOST_DEVICE void operator()(std::int64_t i) const { dst[(i / cols) * ld + i % cols] = T(src[i]); }
};

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
  std::map<key, entry> cache;

  static dnnl_host_context& get() {
    thread_local dnnl_host_context ctx;  // each rank thread keeps its own primitives and stream
    return ctx;
  }
};

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

inline dnnl::matmul::primitive_desc host_matmul_desc(const dnnl::engine& eng, const gemm_args& g) {
  using dims = dnnl::memory::dims;
  const dims a_strides = g.ta == trans::n ? dims{g.lda, 1} : dims{1, g.lda};
  const dims b_strides = g.tb == trans::n ? dims{g.ldb, 1} : dims{1, g.ldb};
  const auto ab = dnnl_type(g.a.type), ct = dnnl_type(g.c.type);
  dnnl::memory::desc a_md({g.m, g.k}, ab, a_strides);
  dnnl::memory::desc b_md({g.k, g.n}, ab, b_strides);
  dnnl::memory::desc c_md({g.m, g.n}, ct, dims{g.ldc, 1});
  dnnl::post_ops ops;
  if (g.beta != 0.f) ops.append_sum(g.beta);
  if (g.ep == epilogue::relu) ops.append_eltwise(1.f, dnnl::algorithm::eltwise_relu, 0.f, 0.f);
  dnnl::primitive_attr attr;
  attr.set_post_ops(ops);
  try {
    if (g.bias.ptr) {
      dnnl::memory::desc bias_md({1, g.n}, ct, dims{g.n, 1});
      return {dnnl::matmul::desc(a_md, b_md, bias_md, c_md), attr, eng};
    }
    return {dnnl::matmul::desc(a_md, b_md, c_md), attr, eng};
  } catch (const dnnl::error& e) {
    fail("dml::gemm: expected oneDNN to offer a matmul for A,B=", g.a.type, " C=", g.c.type, " m=", g.m, " n=", g.n,
         " k=", g.k, " on this CPU, found none (", e.what(), ")");
  }
}

// f32 and bf16 inputs: one cached oneDNN matmul primitive per problem, with beta, bias and ReLU as
// post-ops and the output rounded to C's type by the kernel.
inline void host_gemm_native(const gemm_args& g) {
  auto& ctx = dnnl_host_context::get();
  const dnnl_host_context::key key{int(g.ta), int(g.tb), g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.bias.ptr != nullptr,
                                   g.beta != 0.f, int(g.ep), int(g.a.type), int(g.c.type)};
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

// oneDNN 2.6 has f16 matmul kernels only for CPUs with AVX512-FP16; elsewhere f16 inputs are widened.
inline bool host_gemm_is_native(dtype ab) { return ab != dtype::f16; }

#else
// The same contract through the C API: C = op(A)·op(B) + beta·C by dnnl_sgemm (row-major), then
// bias and ReLU in one pass over C. f32 only: oneDNN 2.6's C API has no bf16 GEMM entry point.
inline void host_gemm_native(const gemm_args& g) {
  float* c = g.c.as<float>();
  const float* bias = g.bias.as<float>();
  const dnnl_status_t st = dnnl_sgemm(g.ta == trans::t ? 'T' : 'N', g.tb == trans::t ? 'T' : 'N', g.m, g.n, g.k, 1.f,
                                      g.a.as<float>(), g.lda, g.b.as<float>(), g.ldb, g.beta, c, g.ldc);
  if (st != dnnl_success) fail("dml::gemm: dnnl_sgemm expected dnnl_success, found status ", int(st));
  if (!bias && g.ep == epilogue::none) return;
  for (std::int64_t i = 0; i < g.m; ++i)
    for (std::int64_t j = 0; j < g.n; ++j) {
      float& out = c[i * g.ldc + j];
      float v = out;
      if (bias) v += bias[j];
      out = g.ep == epilogue::relu && v < 0.f ? 0.f : v;
    }
}

inline bool host_gemm_is_native(dtype ab) { return ab == dtype::f32; }
#endif

// Inputs without a native kernel: A, B, bias (and C when accumulating) are widened to packed f32
// copies, multiplied in f32 and rounded once into C. The copies cost O(mk + kn + mn) against the
// product's O(mnk), and f32 holds every bf16 and fp16 value exactly, so the result equals a native
// kernel's up to the order of the f32 accumulation. The scratch is kept per thread between calls.
inline void host_gemm_widened(const gemm_args& g) {
  thread_local std::vector<float> wa, wb, wc, wbias;
  const auto widen = [](const const_typed_ptr& src, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                        std::vector<float>& dst) {
    dst.resize(static_cast<std::size_t>(rows * cols));
    visit_float_like(src.type, "dml::gemm", [&](auto t) {
      using T = decltype(t);
      for_each_index<host>(rows * cols, widen_rows<T>{src.as<T>(), dst.data(), cols, ld});
    });
  };
  const std::int64_t a_rows = g.ta == trans::n ? g.m : g.k, a_cols = g.ta == trans::n ? g.k : g.m;
  const std::int64_t b_rows = g.tb == trans::n ? g.k : g.n, b_cols = g.tb == trans::n ? g.n : g.k;
  gemm_args f = g;
  widen(g.a, a_rows, a_cols, g.lda, wa);
  widen(g.b, b_rows, b_cols, g.ldb, wb);
  f.a = static_cast<const float*>(wa.data());
  f.lda = a_cols;
  f.b = static_cast<const float*>(wb.data());
  f.ldb = b_cols;
  if (g.bias.ptr) {
    widen(g.bias, 1, g.n, g.n, wbias);
    f.bias = static_cast<const float*>(wbias.data());
  }
  const bool narrow_c = g.c.type != dtype::f32;
  if (narrow_c) {
    if (g.beta != 0.f) widen(g.c, g.m, g.n, g.ldc, wc);
    else wc.resize(static_cast<std::size_t>(g.m * g.n));  // not read: beta = 0 overwrites
    f.c = wc.data();
    f.ldc = g.n;
  }
  host_gemm_native(f);
  if (narrow_c)
    visit_float_like(g.c.type, "dml::gemm", [&](auto t) {
      using T = decltype(t);
      for_each_index<host>(g.m * g.n, narrow_rows<T>{wc.data(), g.c.as<T>(), g.n, g.ldc});
    });
}

inline void host_gemm(const gemm_args& g) {
  if (host_gemm_is_native(g.a.type)) host_gemm_native(g);
  else host_gemm_widened(g);
}

inline void check_gemm_args(const gemm_args& g) {
  if (g.m < 0 || g.n < 0 || g.k < 0)
    fail<invalid_argument>("dml::gemm: sizes must be non-negative, found m=", g.m, " n=", g.n, " k=", g.k);
  const auto is_float_like = [](dtype t) { return t == dtype::f32 || t == dtype::bf16 || t == dtype::f16; };
  if (!is_float_like(g.a.type) || g.b.type != g.a.type)
    fail<invalid_argument>("dml::gemm: expected A and B of one type among F32, BF16, F16; found A=", g.a.type,
                           " B=", g.b.type);
  if (g.c.type != dtype::f32 && g.c.type != g.a.type) {
    if (g.a.type == dtype::f32)
      fail<invalid_argument>("dml::gemm: expected C of type F32 (as A and B), found ", g.c.type);
    fail<invalid_argument>("dml::gemm: expected C of type F32 or ", g.a.type, " (as A and B), found ", g.c.type);
  }
  if (g.bias.ptr && g.bias.type != g.c.type)
    fail<invalid_argument>("dml::gemm: expected the bias to have C's type ", g.c.type, ", found ", g.bias.type);
}
}  // namespace detail

template <execution_space Space>
void gemm(const gemm_args& g) {
  detail::check_gemm_args(g);
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) {
    detail::visit_float_like(g.c.type, "dml::gemm", [&](auto t) {
      using T = decltype(t);
      for_each_index<Space>(g.m * g.n, detail::gemm_epilogue_only<T>{g.c.as<T>(), g.bias.as<T>(), g.n, g.ldc, g.beta,
                                                                     g.ep == epilogue::relu});
    });
    return;
  }
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
// The implementation oneDNN picks for a representative matmul with inputs of type ab and an f32
// result, e.g. "brg:avx512_core" (f32) or "brg:avx512_core_bf16" (bf16).
inline std::string host_gemm_impl(std::int64_t m = 256, std::int64_t n = 1024, std::int64_t k = 1024,
                                  dtype ab = dtype::f32) {
  gemm_args g{.m = m, .n = n, .k = k, .lda = k, .ldb = n, .ldc = n};
  g.a.type = g.b.type = ab;
  if (!detail::host_gemm_is_native(ab)) return "widened to f32: " + host_gemm_impl(m, n, k);
  return detail::host_matmul_desc(detail::dnnl_host_context::get().engine, g).impl_info_str();
}

#else
// nvcc translation units reach oneDNN through dnnl_sgemm, whose kernel choice is not exposed.
inline std::string host_gemm_impl(std::int64_t = 256, std::int64_t = 1024, std::int64_t = 1024,
                                  dtype ab = dtype::f32) {
  return ab == dtype::f32 ? "dnnl_sgemm" : "widened to f32: dnnl_sgemm";
}
#endif

}  // namespace dml
