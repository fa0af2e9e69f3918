// SPDX-License-Identifier: Apache-2.0
// dml/core/gemm.hpp — matrix multiply with fused bias and activation: oneDNN on the host, cuBLAS on CUDA.
// Sits on core/space.hpp and core/cast.hpp; nn/linear and every dense layer call it. See DESIGN.md §3.
// Its parts: core/gemm_args.hpp (the arguments), core/detail/host_onednn.hpp (oneDNN's primitives) and
// core/detail/host_gemm_choice.hpp (which host library runs a shape).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/detail/host_gemm_choice.hpp"
#include "dml/core/detail/host_onednn.hpp"
#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"
#include "dml/core/gemm_args.hpp"
#include "dml/core/space.hpp"

#if DML_HAS_CUDA
#  include "dml/core/detail/cublas_gemm.cuh"
#endif

namespace dml {

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

// When set on a thread, each host GEMM it runs is timed and recorded here (benchmarks, profiles).
inline thread_local std::vector<gemm_call>* host_gemm_trace = nullptr;

// The host GEMM stack differs between nvcc and host compilers (config.hpp, DML_TU_NAMESPACE).
inline namespace DML_TU_NAMESPACE {
// Inputs without a native kernel: A, B, bias (and C when accumulating) are widened to packed f32
// copies, multiplied in f32 and rounded once into C. The copies cost O(mk + kn + mn) against the
// product's O(mnk), and f32 holds every bf16 and fp16 value exactly, so the result equals a native
// kernel's up to the order of the f32 accumulation. The scratch is kept per thread between calls.
// Returns what multiplied the f32 copies.
inline host_gemm_pick host_gemm_widened(const gemm_args& g) {
  thread_local std::vector<float> wa, wb, wc, wbias;
  const auto widen = [](const const_typed_ptr& src, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                        std::vector<float>& dst) {
    dst.resize(static_cast<std::size_t>(rows * cols));
    visit_float_like(src.type, "dml::gemm", [&](auto t) {
      using T = decltype(t);
      // Packed rows convert as one flat, vectorised pass; strided ones index through the division.
      if (ld == cols) cast_n<host>(src.as<T>(), dst.data(), rows * cols);
      else for_each_index<host>(rows * cols, widen_rows<T>{src.as<T>(), dst.data(), cols, ld});
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
  const host_gemm_pick pick = host_gemm_choose(f);
  host_gemm_run(pick, f);
  if (narrow_c)
    visit_float_like(g.c.type, "dml::gemm", [&](auto t) {
      using T = decltype(t);
      if (g.ldc == g.n) cast_n<host>(static_cast<const float*>(wc.data()), g.c.as<T>(), g.m * g.n);
      else for_each_index<host>(g.m * g.n, narrow_rows<T>{wc.data(), g.c.as<T>(), g.n, g.ldc});
    });
  return pick;
}

inline void host_gemm(const gemm_args& g) {
  const auto t0 = host_gemm_trace ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  const bool native = host_gemm_is_native(g.a.type);
  host_gemm_pick pick{};
  if (g.a.type == dtype::f32) host_gemm_run(pick = host_gemm_choose(g), g);
  else if (native) host_gemm_onednn(g);
  else pick = host_gemm_widened(g);
  if (host_gemm_trace)
    host_gemm_trace->push_back({g, pick.library, native,
                                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), pick.padded});
}
}  // namespace DML_TU_NAMESPACE

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

inline namespace DML_TU_NAMESPACE {
// Whether host products with inputs of type ab run on a native oneDNN kernel here. false means they
// are widened to f32 and multiplied by the f32 dispatch: bf16 and f16 on CPUs without AVX-512
// (oneDNN 2.6 has no 16-bit matmul for AVX2), f16 without AVX512-FP16.
inline bool host_gemm_native(dtype ab) { return detail::host_gemm_is_native(ab); }

// The library the host dispatch runs this f32 problem on, and whether on padded copies of A and B, measuring the
// shape now if it is new.
inline host_gemm_pick host_gemm_choice(const gemm_args& g) {
  detail::check_gemm_args(g);
  return detail::host_gemm_choose(g);
}

// Runs g on the named library whatever the dispatch would pick (f32; benchmarks compare libraries), padded: with A and
// B copied first to longer rows where theirs lie a multiple of 1 KiB apart.
inline void host_gemm_on(host_gemm_library lib, const gemm_args& g, bool padded = false) {
  detail::check_gemm_args(g);
  if (lib != host_gemm_library::onednn && (g.a.type != dtype::f32 || g.c.type != dtype::f32))
    fail<invalid_argument>("dml::host_gemm_on: ", to_string(lib), " multiplies F32 only, found A=", g.a.type,
                           " C=", g.c.type);
#if !defined(__CUDACC__)
  if (!detail::host_gemm_available(lib)) fail("dml::host_gemm_on: ", to_string(lib), " could not be loaded here");
#endif
  if (g.m > 0 && g.n > 0 && g.k > 0) detail::host_gemm_run(host_gemm_pick{lib, padded}, g);
}

#if !defined(__CUDACC__)
// The CPU's model name, as benchmarks print it beside their figures.
inline std::string host_cpu_model() { return detail::cpu_model(); }

// The host GEMM libraries this process found, each with its version and kernel set.
inline std::vector<std::pair<host_gemm_library, std::string>> host_gemm_libraries() {
  const dnnl_version_t* v = dnnl_version();
  const std::string onednn =
      "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
  std::vector<std::pair<host_gemm_library, std::string>> out{{host_gemm_library::onednn, onednn + " matmul"},
                                                             {host_gemm_library::onednn_sgemm, onednn + " dnnl_sgemm"}};
  const auto& blas = detail::host_blas::get();
  if (blas.openblas_sgemm) out.emplace_back(host_gemm_library::openblas, blas.openblas_name);
  if (blas.blis_sgemm) out.emplace_back(host_gemm_library::blis, blas.blis_name);
  return out;
}

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

}  // namespace DML_TU_NAMESPACE

}  // namespace dml
