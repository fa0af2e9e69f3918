// SPDX-License-Identifier: Apache-2.0
// dml/nn/attention.hpp — causal multi-head self-attention core: softmax(q·kᵀ/√d, causal)·v and its gradients.
// Sits on core/gemm.hpp and core/algorithm.hpp; the transformer block of nn/ calls it between its projections.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <type_traits>

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"
#include "dml/core/gemm.hpp"
#include "dml/core/math.hpp"
#include "dml/core/space.hpp"

namespace dml::nn {

// Sizes of one attention call. qkv rows are tokens (b, t) in row-major [batch, seq]; each row holds
// q (heads*head_dim values, head h at columns h*head_dim..), then k, then v: row stride 3*heads*head_dim.
struct attention_shape {
  std::int64_t batch = 0, seq = 0, heads = 0, head_dim = 0;
  std::int64_t width() const { return heads * head_dim; }  // y's row width
};

// Elements of type T that causal_attention_forward keeps for backward (the probabilities, [batch, heads, seq, seq]).
inline std::int64_t attention_saved_size(const attention_shape& s) { return s.batch * s.heads * s.seq * s.seq; }
// Elements of T scratch that backward needs: dP (then dS, in place) of one (batch, head) at a time.
inline std::int64_t attention_scratch_size(const attention_shape& s) { return s.seq * s.seq; }

namespace kernels {
// Per-element arithmetic shared by the row functors below and the CUDA kernels of nn/detail/attention.cuh.
DML_HOST_DEVICE float attention_max(float a, float b) { return b > a ? b : a; }
// dS = P ⊙ (dP − Σ_s dP⊙P) · scale: the softmax's Jacobian, times the logits' scale.
DML_HOST_DEVICE float attention_softmax_grad(float p, float dp, float dot, float scale) {
  return p * (dp - dot) * scale;
}

// In place on one row of probs (r = ((b·heads + h)·seq + t)): scale, mask s > t to 0, and softmax over
// s <= t. Three reads of the row (max, sum, write) so that each probability rounds to T once. The exponentials
// run over the visible columns rounded up to a multiple of 16 (within the row), the extra ones set to −inf first
// (exp gives 0): a row's length varies with t, and the scalar remainder of a vectorised loop of 16 lanes took
// most of the pass's time (the pass ran 4.5x faster so).
template <class T>
struct causal_softmax_row {
  T* p;
  std::int64_t seq;
  float scale;
  DML_HOST_DEVICE void operator()(std::int64_t r) const {
    T* row = p + r * seq;
    const std::int64_t n = r % seq + 1;  // columns s <= t
    const std::int64_t rounded = (n + 15) / 16 * 16, padded = rounded < seq ? rounded : seq;
    std::int32_t mk = ordered_bits(scale * static_cast<float>(row[0]));
    DML_SIMD_MAX(mk)
    for (std::int64_t s = 1; s < n; ++s) mk = std::max(mk, ordered_bits(scale * static_cast<float>(row[s])));
    const float mx = from_ordered_bits(mk);
    for (std::int64_t s = n; s < padded; ++s) row[s] = round_to<T>(-HUGE_VALF);
    float sum = 0.f;
    if constexpr (std::is_same_v<T, float>) {  // the exponentials kept in the row between the sum and the scaling
      DML_SIMD_SUM(sum)
      for (std::int64_t s = 0; s < padded; ++s) {
        const float e = fast_exp(scale * row[s] - mx);
        row[s] = e;
        sum += e;
      }
      const float inv = 1.f / sum;
      DML_SIMD
      for (std::int64_t s = 0; s < padded; ++s) row[s] *= inv;
    } else {
      DML_SIMD_SUM(sum)
      for (std::int64_t s = 0; s < padded; ++s) sum += fast_exp(scale * static_cast<float>(row[s]) - mx);
      const float inv = 1.f / sum;
      DML_SIMD
      for (std::int64_t s = 0; s < padded; ++s)
        row[s] = round_to<T>(fast_exp(scale * static_cast<float>(row[s]) - mx) * inv);
    }
    for (std::int64_t s = padded; s < seq; ++s) row[s] = T(0.f);
  }
};

// In place on one row of d (dP on entry, dS on exit), given the same row of the probabilities p;
// r % seq is the row's query token t, and columns s > t get 0.
template <class T>
struct causal_softmax_backward_row {
  const T* p;
  T* d;
  std::int64_t seq;
  float scale;
  DML_HOST_DEVICE void operator()(std::int64_t r) const {
    const T* pr = p + r * seq;
    T* dr = d + r * seq;
    const std::int64_t n = r % seq + 1;
    float dot = 0.f;
    DML_SIMD_SUM(dot)
    for (std::int64_t s = 0; s < n; ++s) dot += static_cast<float>(dr[s]) * static_cast<float>(pr[s]);
    DML_SIMD
    for (std::int64_t s = 0; s < n; ++s)
      dr[s] = round_to<T>(attention_softmax_grad(static_cast<float>(pr[s]), static_cast<float>(dr[s]), dot, scale));
    for (std::int64_t s = n; s < seq; ++s) dr[s] = T(0.f);
  }
};
}  // namespace kernels

}  // namespace dml::nn

#if DML_HAS_CUDA
#  include "dml/nn/detail/attention.cuh"
#endif

namespace dml::nn {

namespace detail {
inline void check_attention_shape(const char* what, const attention_shape& s) {
  const auto positive = [&](const char* name, std::int64_t v) {
    if (v <= 0) fail<invalid_argument>(what, ": expected ", name, " > 0, found ", name, " = ", v);
  };
  positive("batch", s.batch);
  positive("seq", s.seq);
  positive("heads", s.heads);
  positive("head_dim", s.head_dim);
}
inline void check_attention_pointer(const char* what, const char* name, const void* p) {
  if (p == nullptr) fail<invalid_argument>(what, ": expected a pointer to ", name, ", found null");
}

inline float attention_scale(const attention_shape& s) {
  return 1.f / std::sqrt(static_cast<float>(s.head_dim));
}

// rows rows of seq probabilities each, row r standing for query token r % seq.
template <execution_space S, class T>
void causal_softmax_rows(T* p, std::int64_t rows, std::int64_t seq, float scale) {
#if DML_HAS_CUDA
  if constexpr (std::same_as<S, cuda>)  // one block per row instead of one thread
    causal_softmax_cuda(p, rows, seq, scale);
  else
#endif
    for_each_row<S>(rows, kernels::causal_softmax_row<T>{p, seq, scale}, seq);
}
template <execution_space S, class T>
void causal_softmax_backward_rows(const T* p, T* d, std::int64_t rows, std::int64_t seq, float scale) {
#if DML_HAS_CUDA
  if constexpr (std::same_as<S, cuda>)
    causal_softmax_backward_cuda(p, d, rows, seq, scale);
  else
#endif
    for_each_row<S>(rows, kernels::causal_softmax_backward_row<T>{p, d, seq, scale}, seq);
}
}  // namespace detail

// y[b, t, h*hd + d] = Σ_s softmax_s( q·k / sqrt(hd), masked to s <= t ) · v[b, s, h*hd + d]
// qkv: [batch, seq, 3*width]; y: [batch, seq, width]; probs: [batch, heads, seq, seq], written
// (zeros above the diagonal) and read by backward. All three in space S; T is float, bf16 or fp16,
// with GEMMs accumulating and the softmax computing in float.
template <execution_space S, float_like T>
void causal_attention_forward(const attention_shape& s, const T* qkv, T* probs, T* y) {
  constexpr const char* what = "dml::nn::causal_attention_forward";
  detail::check_attention_shape(what, s);
  detail::check_attention_pointer(what, "qkv", qkv);
  detail::check_attention_pointer(what, "probs", probs);
  detail::check_attention_pointer(what, "y", y);
  const std::int64_t L = s.seq, hd = s.head_dim, w = s.width(), ld = 3 * w;
  // The logits go straight into probs: q and k are read in place through the qkv row stride, so
  // nothing is copied or transposed, and the softmax then runs over all (batch, head) rows at once.
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t h = 0; h < s.heads; ++h) {
      const T* q = qkv + b * L * ld + h * hd;
      gemm<S>(gemm_args{.ta = trans::n, .tb = trans::t, .m = L, .n = L, .k = hd, .a = q, .lda = ld, .b = q + w,
                        .ldb = ld, .c = probs + (b * s.heads + h) * L * L, .ldc = L});
    }
  detail::causal_softmax_rows<S>(probs, s.batch * s.heads * L, L, detail::attention_scale(s));
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t h = 0; h < s.heads; ++h) {
      const T* v = qkv + b * L * ld + 2 * w + h * hd;
      gemm<S>(gemm_args{.m = L, .n = hd, .k = L, .a = probs + (b * s.heads + h) * L * L, .lda = L, .b = v,
                        .ldb = ld, .c = y + b * L * w + h * hd, .ldc = w});
    }
}

// dy: [batch, seq, width]; writes dqkv [batch, seq, 3*width] (overwrites, never accumulates).
// probs: as causal_attention_forward left them; scratch: attention_scratch_size(s) elements of T in S.
template <execution_space S, float_like T>
void causal_attention_backward(const attention_shape& s, const T* qkv, const T* probs, const T* dy, T* dqkv,
                               T* scratch) {
  constexpr const char* what = "dml::nn::causal_attention_backward";
  detail::check_attention_shape(what, s);
  detail::check_attention_pointer(what, "qkv", qkv);
  detail::check_attention_pointer(what, "probs", probs);
  detail::check_attention_pointer(what, "dy", dy);
  detail::check_attention_pointer(what, "dqkv", dqkv);
  detail::check_attention_pointer(what, "scratch", scratch);
  const std::int64_t L = s.seq, hd = s.head_dim, w = s.width(), ld = 3 * w;
  const float scale = detail::attention_scale(s);
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t h = 0; h < s.heads; ++h) {
      const T* q = qkv + b * L * ld + h * hd;
      const T *k = q + w, *v = q + 2 * w;
      const T* p = probs + (b * s.heads + h) * L * L;
      const T* g = dy + b * L * w + h * hd;
      T* dq = dqkv + b * L * ld + h * hd;
      T *dk = dq + w, *dv = dq + 2 * w;
      // dP = dY·Vᵀ, then dS in place: the logits' gradient, zero above the diagonal.
      gemm<S>(gemm_args{.ta = trans::n, .tb = trans::t, .m = L, .n = L, .k = hd, .a = g, .lda = w, .b = v, .ldb = ld,
                        .c = scratch, .ldc = L});
      detail::causal_softmax_backward_rows<S>(p, scratch, L, L, scale);
      gemm<S>(gemm_args{.m = L, .n = hd, .k = L, .a = scratch, .lda = L, .b = k, .ldb = ld, .c = dq, .ldc = ld});
      gemm<S>(gemm_args{.ta = trans::t, .m = L, .n = hd, .k = L, .a = scratch, .lda = L, .b = q, .ldb = ld, .c = dk,
                        .ldc = ld});
      gemm<S>(gemm_args{.ta = trans::t, .m = L, .n = hd, .k = L, .a = p, .lda = L, .b = g, .ldb = w, .c = dv,
                        .ldc = ld});
    }
}

}  // namespace dml::nn
