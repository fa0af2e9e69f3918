// SPDX-License-Identifier: Apache-2.0
// dml/core/detail/cublas_gemm.cuh — the CUDA side of dml::gemm: cuBLASLt with bias and ReLU as epilogues.
// Sits on core/algorithm.hpp (for the stream) and core/dtype.hpp; included by core/gemm.hpp under nvcc.
#pragma once

#include <cstdint>
#include <map>
#include <tuple>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "dml/core/algorithm.hpp"
#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"

namespace dml {

// A cuBLAS(Lt) call that did not return CUBLAS_STATUS_SUCCESS.
class cublas_error : public error {
 public:
  using error::error;
};

}  // namespace dml

#define DML_CHECK_CUBLAS(expr)                                                                       \
  do {                                                                                               \
    const cublasStatus_t dml_cublas_status_ = (expr);                                                \
    if (dml_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                                 \
      ::dml::fail<::dml::cublas_error>(__FILE__, ":", __LINE__, ": ", #expr,                         \
                                       " expected CUBLAS_STATUS_SUCCESS, found ",                    \
                                       cublasLtGetStatusString(dml_cublas_status_));                 \
  } while (0)

namespace dml::detail {

// Row-major C = op(A)·op(B) seen by a column-major library is Cᵀ = op(B)ᵀ·op(A)ᵀ: the operands swap
// and each keeps its own transpose flag, so no data moves. Sizes and flags are plain values here so
// that this file needs nothing from gemm.hpp, which includes it before it defines gemm_args.
// A and B share ab_type; C, D and the bias share c_type; products accumulate in f32 (alpha and beta
// are floats) whatever the storage types.
struct lt_problem {
  bool ta = false, tb = false;
  std::int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  std::int64_t lda = 0;
  const void* b = nullptr;
  std::int64_t ldb = 0;
  void* c = nullptr;
  std::int64_t ldc = 0;
  float beta = 0.f;
  const void* bias = nullptr;
  bool relu = false;
  cudaDataType_t ab_type = CUDA_R_32F, c_type = CUDA_R_32F;
};

inline cudaDataType_t cuda_data_type(dtype t) {
  switch (t) {
    case dtype::f32: return CUDA_R_32F;
    case dtype::bf16: return CUDA_R_16BF;
    case dtype::f16: return CUDA_R_16F;
    default: break;
  }
  fail<invalid_argument>("dml::gemm: expected an element type of F32, BF16 or F16 on CUDA, found ", t);
}

// Largest power of two (up to 256, cuBLASLt's default assumption) that divides the address: the
// heuristic must not pick a kernel that needs more alignment than a view into a flat buffer has.
// 16-bit elements may sit at any even address, so the floor is 2 bytes.
inline std::uint32_t pointer_alignment(const void* p) {
  const auto v = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t align = 256;
  while (align > 2 && v % align != 0) align /= 2;
  return align;
}

// One cuBLASLt handle, workspace and plan cache per thread and device: ranks that are threads each
// get their own, and nothing is shared across threads without a lock.
class lt_context {
 public:
  // Hopper's kernels want up to 32 MiB; smaller workspaces only narrow the heuristic's choice.
  static constexpr std::size_t workspace_bytes = std::size_t{32} << 20;

  explicit lt_context(int device) : device_(device) {
    DML_CHECK_CUBLAS(cublasLtCreate(&handle_));
    if (const cudaError_t e = cudaMalloc(&workspace_, workspace_bytes); e != cudaSuccess) {
      cublasLtDestroy(handle_);
      fail(__FILE__, ":", __LINE__, ": cudaMalloc of the ", workspace_bytes, "-byte cuBLASLt workspace failed: ",
           cudaGetErrorString(e));
    }
  }
  lt_context(const lt_context&) = delete;
  lt_context& operator=(const lt_context&) = delete;
  ~lt_context() {
    // Errors are ignored: at thread or process exit the runtime may already be shutting down.
    for (auto& [key, p] : plans_) p.release();
    int current = 0;
    if (cudaGetDevice(&current) == cudaSuccess && current != device_) cudaSetDevice(device_);
    cudaFree(workspace_);
    cublasLtDestroy(handle_);
    if (current != device_) cudaSetDevice(current);
  }

  static lt_context& get() {
    thread_local std::map<int, lt_context> per_device;
    int device = 0;
    DML_CHECK_CUDA(cudaGetDevice(&device));
    auto it = per_device.find(device);
    if (it == per_device.end()) it = per_device.try_emplace(device, device).first;
    return it->second;
  }

  void run(const lt_problem& p, cudaStream_t stream) {
    plan& pl = find_plan(p);
    // The bias pointer changes per call (it is not part of the plan); setting it costs no GPU work.
    if (p.bias) DML_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias,
                                                                sizeof(p.bias)));
    const float alpha = 1.f;
    DML_CHECK_CUBLAS(cublasLtMatmul(handle_, pl.desc, &alpha, p.b, pl.a_layout, p.a, pl.b_layout, &p.beta, p.c,
                                    pl.c_layout, p.c, pl.c_layout, &pl.algo, workspace_, workspace_bytes, stream));
  }

 private:
  struct plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a_layout = nullptr, b_layout = nullptr, c_layout = nullptr;
    cublasLtMatmulAlgo_t algo{};
    void release() noexcept {
      if (a_layout) cublasLtMatrixLayoutDestroy(a_layout);
      if (b_layout) cublasLtMatrixLayoutDestroy(b_layout);
      if (c_layout) cublasLtMatrixLayoutDestroy(c_layout);
      if (desc) cublasLtMatmulDescDestroy(desc);
      *this = {};
    }
  };
  // Everything the heuristic's answer depends on: shapes, strides, flags, types and pointer alignments.
  using key = std::tuple<bool, bool, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, bool, bool, bool, std::uint32_t, std::uint32_t, std::uint32_t, int, int>;

  plan& find_plan(const lt_problem& p) {
    const std::uint32_t align_a = pointer_alignment(p.b), align_b = pointer_alignment(p.a),
                        align_c = pointer_alignment(p.c);
    const key k{p.ta, p.tb, p.m, p.n, p.k, p.lda, p.ldb, p.ldc, p.beta != 0.f, p.bias != nullptr, p.relu,
                align_a, align_b, align_c, int(p.ab_type), int(p.c_type)};
    auto it = plans_.find(k);
    if (it != plans_.end()) return it->second;

    plan pl;
    try {
      make_plan(p, pl, align_a, align_b, align_c);
    } catch (...) {
      pl.release();
      throw;
    }
    return plans_.emplace(k, pl).first->second;
  }

  void make_plan(const lt_problem& p, plan& pl, std::uint32_t align_a, std::uint32_t align_b, std::uint32_t align_c) {
    // Column-major problem: D[n×m] = opA(B')·opB(A'), where B' and A' are the row-major buffers read
    // column-major (that is, transposed for free).
    const cublasOperation_t op_a = p.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = p.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    const auto u = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
    DML_CHECK_CUBLAS(cublasLtMatmulDescCreate(&pl.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    DML_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    DML_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
    // Bias (length n, one value per column-major row) and ReLU run on the tile in registers after
    // beta·C is added: relu(op(A)·op(B) + beta·C + bias), the order oneDNN's post-ops use on the host.
    const cublasLtEpilogue_t ep = p.bias ? (p.relu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS)
                                         : (p.relu ? CUBLASLT_EPILOGUE_RELU : CUBLASLT_EPILOGUE_DEFAULT);
    DML_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof(ep)));
    // The bias is read with D's type (CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE's default), which is
    // dml's rule too: bias and C share a type.
    if (p.bias)  // the heuristic may look at it; run() sets the real one each call
      DML_CHECK_CUBLAS(
          cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof(p.bias)));

    DML_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&pl.a_layout, p.ab_type, p.tb ? u(p.k) : u(p.n),
                                                p.tb ? u(p.n) : u(p.k), p.ldb));
    DML_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&pl.b_layout, p.ab_type, p.ta ? u(p.m) : u(p.k),
                                                p.ta ? u(p.k) : u(p.m), p.lda));
    DML_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&pl.c_layout, p.c_type, u(p.n), u(p.m), p.ldc));

    cublasLtMatmulPreference_t pref = nullptr;
    DML_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, const auto& v) {
      return cublasLtMatmulPreferenceSetAttribute(pref, attr, &v, sizeof(v));
    };
    const std::uint64_t ws = workspace_bytes;
    cublasStatus_t status = set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws);
    if (status == CUBLAS_STATUS_SUCCESS) status = set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a);
    if (status == CUBLAS_STATUS_SUCCESS) status = set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b);
    if (status == CUBLAS_STATUS_SUCCESS) status = set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c);
    if (status == CUBLAS_STATUS_SUCCESS) status = set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c);
    if (status == CUBLAS_STATUS_SUCCESS)
      status = cublasLtMatmulAlgoGetHeuristic(handle_, pl.desc, pl.a_layout, pl.b_layout, pl.c_layout, pl.c_layout,
                                              pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    DML_CHECK_CUBLAS(status);
    if (found == 0)
      fail<cublas_error>("dml::gemm: cuBLASLt found no algorithm for m=", p.m, " n=", p.n, " k=", p.k, " lda=", p.lda,
                         " ldb=", p.ldb, " ldc=", p.ldc, " (ta=", p.ta, " tb=", p.tb, " bias=", p.bias != nullptr,
                         " relu=", p.relu, " A,B type=", int(p.ab_type), " C type=", int(p.c_type),
                         "); expected at least one");
    pl.algo = result.algo;
  }

  int device_ = 0;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<key, plan> plans_;
};

// cuBLASLt rejects empty reductions: dml::gemm runs the k = 0 case (the epilogue alone) itself.
inline void cuda_gemm(const lt_problem& p) {
  if (p.m == 0 || p.n == 0) return;
  if (p.k == 0) fail<invalid_argument>("dml::detail::cuda_gemm: expected k > 0, found k = 0");
  lt_context::get().run(p, current_stream());
}

// Args is dml::gemm_args; a template because gemm.hpp includes this file before defining it.
template <class Args>
void cuda_gemm(const Args& g) {
  using trans_t = decltype(g.ta);
  using epilogue_t = decltype(g.ep);
  cuda_gemm(lt_problem{g.ta == trans_t::t, g.tb == trans_t::t, g.m, g.n, g.k, g.a.ptr, g.lda, g.b.ptr, g.ldb,
                       g.c.ptr, g.ldc, g.beta, g.bias.ptr, g.ep == epilogue_t::relu, cuda_data_type(g.a.type),
                       cuda_data_type(g.c.type)});
}

}  // namespace dml::detail
