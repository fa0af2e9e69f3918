// SPDX-License-Identifier: Apache-2.0
// dml/core/gemm_args.hpp — what dml::gemm is asked to do (gemm_args, trans, epilogue) and which host library did it
// (host_gemm_library, gemm_call); it includes no oneDNN, so code that only describes a product can include it alone.
// Sits on core/cast.hpp; used by core/gemm.hpp and its host back ends in core/detail/.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "dml/core/cast.hpp"

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

// The host libraries an f32 GEMM can run on; see host_gemm_choice.
// onednn: a matmul primitive, bias, beta and ReLU fused as post-ops; onednn_sgemm: oneDNN's BLAS-like dnnl_sgemm
// (beta in the kernel, bias and ReLU one pass after), which accumulates into a C out of cache without the post-op's
// stalls (a 1024 × 1024 weight gradient over 128 rows: 1.16 ms against the primitive's 1.83 ms, DESIGN.md §3).
enum class host_gemm_library : std::uint8_t { onednn, onednn_sgemm, openblas, blis };
inline std::string_view to_string(host_gemm_library lib) {
  switch (lib) {
    case host_gemm_library::onednn: return "onednn";
    case host_gemm_library::onednn_sgemm: return "onednn-sgemm";
    case host_gemm_library::openblas: return "openblas";
    case host_gemm_library::blis: return "blis";
  }
  return "?";
}

inline constexpr host_gemm_library host_gemm_all_libraries[] = {host_gemm_library::onednn,
                                                              host_gemm_library::onednn_sgemm,
                                                              host_gemm_library::openblas, host_gemm_library::blis};

// What the host dispatch runs an f32 problem on: a library, and whether A and B are first copied to rows 64 bytes
// longer than theirs (padded) because their rows lie a multiple of 1 KiB apart (detail::host_gemm_strides_conflict).
struct host_gemm_pick {
  host_gemm_library library = host_gemm_library::onednn;
  bool padded = false;
  friend bool operator==(const host_gemm_pick&, const host_gemm_pick&) = default;
};
// "onednn", or "onednn padded": the form the choice file records.
inline std::string to_string(host_gemm_pick p) {
  return std::string(to_string(p.library)) + (p.padded ? " padded" : "");
}

// One host GEMM as detail::host_gemm_trace records it.
struct gemm_call {
  gemm_args args;                 // pointers are only meaningful during the call
  host_gemm_library library;      // the library that multiplied (the f32 copies, when widened)
  bool native = true;             // false: 16-bit inputs were widened to f32
  double seconds = 0;
  bool padded = false;            // A and B multiplied from copies with longer rows (host_gemm_pick)
};

}  // namespace dml
