// SPDX-License-Identifier: Apache-2.0
// dml/nn/tile_attention.hpp — attention that never holds T×T: softmax(q·kᵀ/√d, masked)·v over tiles of 128 queries
// by 128 keys with an online softmax (FlashAttention-2's scheme), grouped-query heads, causal and document masks.
// Forward keeps one float per (batch, head, query), the log-sum-exp of its row; backward recomputes each tile's
// probabilities from it. Sits on core/algorithm.hpp, core/gemm.hpp, core/math.hpp and nn/attention.hpp (its
// argument checks); GPT and Llama blocks call it, and ring attention (nn/ring_attention.hpp) runs each of its steps,
// a block of queries against a block of keys elsewhere in the sequence, on its kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"
#include "dml/core/gemm.hpp"
#include "dml/core/math.hpp"
#include "dml/core/space.hpp"
#include "dml/nn/attention.hpp"

namespace dml::nn {

// Sizes of one call. qkv rows are tokens (b, t), row-major [batch, seq]; each row holds q (heads·head_dim values,
// head h at columns h·head_dim), then k and v (kv_heads·head_dim each). Query head h reads key/value head
// h / (heads / kv_heads): kv_heads = heads is multi-head attention, 1 is multi-query. kv_heads = 0 means heads.
struct tile_attention_shape {
  std::int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  bool causal = true;
  DML_HOST_DEVICE std::int64_t kv() const { return kv_heads > 0 ? kv_heads : heads; }
  DML_HOST_DEVICE std::int64_t group() const { return heads / kv(); }                   // query heads per key/value head
  DML_HOST_DEVICE std::int64_t width() const { return heads * head_dim; }                // y's row width
  DML_HOST_DEVICE std::int64_t row() const { return (heads + 2 * kv()) * head_dim; }    // qkv's row stride
};

// Floats forward keeps for backward: the log-sum-exp of every (batch, head, query) row.
inline std::int64_t tile_attention_saved_size(const tile_attention_shape& s) { return s.batch * s.heads * s.seq; }
// Floats of workspace backward needs: dQ's float sums [batch, seq, width] and D = rowsum(dy ⊙ y) per row.
// Forward needs none. Each host thread also keeps tiles of its own, 6·128·head_dim + 2·128² floats (the CUDA
// kernels tile by 32, in shared memory).
inline std::int64_t tile_attention_workspace_size(const tile_attention_shape& s) {
  return s.batch * s.seq * s.width() + s.batch * s.heads * s.seq;
}

namespace kernels {
inline constexpr std::int64_t attention_tile = 128;  // queries and keys per tile
inline constexpr float attention_no_key = -HUGE_VALF;  // the log-sum-exp of a row that sees no key

// Where the tokens of a block of each sequence sit in it: at most two runs of consecutive positions, in order of
// position, each `length` long (a context-parallel rank's chunks, nn/ring_attention.hpp): local indices
// local[r]..local[r]+length hold positions global[r]...
struct position_runs {
  int count = 1;
  std::int64_t length = 0;
  std::int64_t local[2] = {0, 0}, global[2] = {0, 0};
  DML_HOST_DEVICE std::int64_t position(std::int64_t i) const {
    const int r = (count == 2 && i >= local[1]) ? 1 : 0;
    return global[r] + (i - local[r]);
  }
  // How many of the tokens sit at positions <= p: they are the first that many, the runs being in order.
  DML_HOST_DEVICE std::int64_t upto(std::int64_t p) const {
    std::int64_t n = 0;
    for (int r = 0; r < count; ++r) {
      const std::int64_t c = p - global[r] + 1;
      n += c < 0 ? 0 : (c > length ? length : c);
    }
    return n;
  }
  // The first local index at a position >= p (count·length where there is none).
  DML_HOST_DEVICE std::int64_t first_from(std::int64_t p) const {
    for (int r = 0; r < count; ++r)
      if (p < global[r] + length) return local[r] + (p > global[r] ? p - global[r] : 0);
    return count * length;
  }
};

// The keys query t of sequence b may see: [first, last], by the causal mask and its document. doc, when given,
// holds for every token (b, t) the position its document starts at (packed sequences: a token attends only within
// its own document). With `runs`, queries and keys are blocks of a longer sequence whose positions q and k give
// (context parallelism's local queries against a key block; doc then holds positions in the whole sequence): a query
// sees the keys at positions from its document's start up to its own.
struct attention_mask {
  const std::int64_t* doc;
  std::int64_t seq;
  bool causal;
  bool runs = false;
  position_runs q{}, k{};
  // With runs, doc holds positions in the whole sequence: the first key of the block at or after the document's start.
  DML_HOST_DEVICE std::int64_t first(std::int64_t b, std::int64_t t) const {
    if (!doc) return 0;
    return runs ? k.first_from(doc[b * seq + t]) : doc[b * seq + t];
  }
  DML_HOST_DEVICE std::int64_t last(std::int64_t t) const {
    if (!causal) return seq - 1;
    return runs ? k.upto(q.position(t)) - 1 : t;
  }
  // The first query that may see key j (later ones see it too, but for documents).
  DML_HOST_DEVICE std::int64_t first_query(std::int64_t j) const {
    if (!causal) return 0;
    return runs ? q.first_from(k.position(j)) : j;
  }
};
}  // namespace kernels

}  // namespace dml::nn

#if DML_HAS_CUDA
#  include "dml/nn/detail/tile_attention.cuh"
#endif

namespace dml::nn {

namespace detail {
// The T×T attention's checks (nn/attention.hpp), and the grouping and masks of this one.
inline void check_tile_attention(const char* what, const tile_attention_shape& s, const std::int64_t* doc) {
  check_attention_shape(what, attention_shape{s.batch, s.seq, s.heads, s.head_dim});
  if (s.kv_heads < 0 || s.heads % s.kv() != 0)
    fail<invalid_argument>(what, ": expected kv_heads dividing heads = ", s.heads, ", found kv_heads = ", s.kv_heads);
  if (doc && !s.causal)
    fail<invalid_argument>(what, ": document masks need the causal mask (a document's keys end at its query)");
}

// One thread's tiles, grown once to the largest head_dim it has seen. Float whatever T is: the products and the
// softmax run in float, and T is rounded to once, on the way out.
struct attention_tiles {
  std::vector<float> buf;
  float *q, *o, *k, *v, *dk, *dv, *s, *p;
  void size_for(std::int64_t hd) {
    constexpr std::int64_t n = kernels::attention_tile;
    const std::int64_t need = 6 * n * hd + 2 * n * n;
    if (static_cast<std::int64_t>(buf.size()) < need) buf.assign(static_cast<std::size_t>(need), 0.f);
    float* at = buf.data();
    for (float** part : {&q, &o, &k, &v, &dk, &dv}) *part = at, at += n * hd;
    s = at, p = at + n * n;
  }
};
inline attention_tiles& thread_tiles(std::int64_t hd) {
  thread_local attention_tiles t;
  t.size_for(hd);
  return t;
}

// C (+)= op(A)·op(B) on float tiles, one thread's (oneDNN's sgemm runs on the calling thread inside a parallel
// region).
inline void tile_gemm(trans ta, trans tb, std::int64_t m, std::int64_t n, std::int64_t k, const float* a,
                      std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc, bool accumulate) {
  dml::detail::host_gemm_sgemm(gemm_args{.ta = ta, .tb = tb, .m = m, .n = n, .k = k, .a = a, .lda = lda, .b = b, .ldb = ldb, .c = c,
                            .ldc = ldc, .beta = accumulate ? 1.f : 0.f});
}

// Rows [0, n) of the strided matrix src (row stride ld) as floats times `mul`, packed [n][hd].
template <class T>
DML_HOST_CLONES void load_tile(const T* src, std::int64_t ld, std::int64_t n, std::int64_t hd, float mul, float* packed) {
  for (std::int64_t j = 0; j < n; ++j) {
    const T* r = src + j * ld;
    DML_SIMD
    for (std::int64_t d = 0; d < hd; ++d) packed[j * hd + d] = mul * static_cast<float>(r[d]);
  }
}

// The keys of the tile at k0 (bc of them) that query t sees: [lo, hi) within the tile, 0 <= lo <= hi <= bc.
struct visible_span {
  std::int64_t lo, hi;
};
inline visible_span visible_keys(const kernels::attention_mask& m, std::int64_t b, std::int64_t t, std::int64_t k0,
                                 std::int64_t bc) {
  const std::int64_t lo = std::clamp<std::int64_t>(m.first(b, t) - k0, 0, bc);
  return {lo, std::clamp<std::int64_t>(m.last(t) - k0 + 1, lo, bc)};
}

// Row i of a tile keeps columns [vis[i].lo, vis[i].hi); the others become −inf, whose exponential is 0.
inline void mask_tile(float* s, std::int64_t br, const visible_span* vis) {
  constexpr std::int64_t n = kernels::attention_tile;
  for (std::int64_t i = 0; i < br; ++i) {
    std::fill(s + i * n, s + i * n + vis[i].lo, -HUGE_VALF);
    std::fill(s + i * n + vis[i].hi, s + (i + 1) * n, -HUGE_VALF);
  }
}

// The online softmax over one forward tile: rows [0, br) of s, the scaled scores, become P = exp(s − m_new) (0 where
// masked), and each row's running max, sum and output accumulator o (rows of hd) move on. A row that sees no key of
// this tile takes no part.
DML_HOST_CLONES inline void softmax_tile_forward(float* s, std::int64_t br, const visible_span* vis, float* mx,
                                                 float* sum, float* o, std::int64_t hd) {
  constexpr std::int64_t n = kernels::attention_tile;
  mask_tile(s, br, vis);
  for (std::int64_t i = 0; i < br; ++i) {
    float* row = s + i * n;
    if (vis[i].lo >= vis[i].hi) {
      std::fill(row, row + n, 0.f);
      continue;
    }
    std::int32_t mk = ordered_bits(mx[i]);
    DML_SIMD_MAX(mk)
    for (std::int64_t j = 0; j < n; ++j) mk = std::max(mk, ordered_bits(row[j]));
    const float m = from_ordered_bits(mk);
    const float alpha = sum[i] > 0.f ? fast_exp(mx[i] - m) : 0.f;
    float add = 0.f;
    DML_SIMD_SUM(add)
    for (std::int64_t j = 0; j < n; ++j) {
      const float p = fast_exp(row[j] - m);
      row[j] = p;
      add += p;
    }
    mx[i] = m;
    sum[i] = sum[i] * alpha + add;
    if (alpha != 1.f) {
      float* oi = o + i * hd;
      DML_SIMD
      for (std::int64_t d = 0; d < hd; ++d) oi[d] *= alpha;
    }
  }
}

// One backward tile: s (the scaled scores) becomes P = exp(s − lse), and dp (dO·Vᵀ) becomes dS = P·(dP − D), the
// softmax's backward without the scale (folded into q for dK, applied to dQ when written out); both 0 where masked.
DML_HOST_CLONES inline void softmax_tile_backward(float* s, float* dp, std::int64_t br, const visible_span* vis,
                                                  const float* lse, const float* dot) {
  constexpr std::int64_t n = kernels::attention_tile;
  mask_tile(s, br, vis);
  for (std::int64_t i = 0; i < br; ++i) {
    float *srow = s + i * n, *drow = dp + i * n;
    const float li = lse[i], di = dot[i];
    DML_SIMD
    for (std::int64_t j = 0; j < n; ++j) {
      const float p = fast_exp(srow[j] - li);
      srow[j] = p;
      drow[j] = p * (drow[j] - di);
    }
  }
}

// One forward item: query tile qt of head h of sequence b, against every key tile it sees.
template <class T>
struct tile_forward_item {
  tile_attention_shape s;
  const T* qkv;
  T* y;
  float* lse;
  kernels::attention_mask mask;
  void operator()(std::int64_t item) const {
    constexpr std::int64_t n = kernels::attention_tile;
    const std::int64_t tiles = (s.seq + n - 1) / n, hd = s.head_dim, ld = s.row(), L = s.seq;
    const std::int64_t qt = item % tiles, h = (item / tiles) % s.heads, b = item / (tiles * s.heads);
    const std::int64_t q0 = qt * n, br = std::min(n, L - q0), kvh = h / s.group();
    const T* base = qkv + b * L * ld;
    const T* kcol = base + (s.heads + kvh) * hd;
    const T* vcol = base + (s.heads + s.kv() + kvh) * hd;
    attention_tiles& t = thread_tiles(hd);
    load_tile(base + q0 * ld + h * hd, ld, br, hd, 1.f / std::sqrt(static_cast<float>(hd)), t.q);
    float mx[n], sum[n];
    std::int64_t first = L;
    for (std::int64_t i = 0; i < br; ++i) {
      mx[i] = kernels::attention_no_key, sum[i] = 0.f;
      first = std::min(first, mask.first(b, q0 + i));
    }
    std::fill(t.o, t.o + br * hd, 0.f);
    const std::int64_t k_end = std::min(L, mask.last(q0 + br - 1) + 1);
    for (std::int64_t k0 = first / n * n; k0 < k_end; k0 += n) {
      const std::int64_t bc = std::min(n, L - k0);
      load_tile(kcol + k0 * ld, ld, bc, hd, 1.f, t.k);
      load_tile(vcol + k0 * ld, ld, bc, hd, 1.f, t.v);
      tile_gemm(trans::n, trans::t, br, bc, hd, t.q, hd, t.k, hd, t.s, n, false);
      visible_span vis[n];
      for (std::int64_t i = 0; i < br; ++i) vis[i] = visible_keys(mask, b, q0 + i, k0, bc);
      softmax_tile_forward(t.s, br, vis, mx, sum, t.o, hd);
      tile_gemm(trans::n, trans::n, br, hd, bc, t.s, n, t.v, hd, t.o, hd, true);  // O += P·V
    }
    for (std::int64_t i = 0; i < br; ++i) {
      const float inv = sum[i] > 0.f ? 1.f / sum[i] : 0.f;
      T* out = y + (b * L + q0 + i) * s.width() + h * hd;
      for (std::int64_t d = 0; d < hd; ++d) out[d] = round_to<T>(t.o[i * hd + d] * inv);
      lse[(b * s.heads + h) * L + q0 + i] = sum[i] > 0.f ? mx[i] + std::log(sum[i]) : kernels::attention_no_key;
    }
  }
};

// D[b, h, t] = Σ_d dy·y over the row's head: the softmax backward's row term.
template <class T>
struct tile_backward_dot {
  tile_attention_shape s;
  const T *y, *dy;
  float* dot;
  DML_HOST_DEVICE void operator()(std::int64_t r) const {
    const std::int64_t t = r % s.seq, h = (r / s.seq) % s.heads, b = r / (s.seq * s.heads);
    const std::int64_t at = (b * s.seq + t) * s.width() + h * s.head_dim;
    float acc = 0.f;
    for (std::int64_t d = 0; d < s.head_dim; ++d) acc += static_cast<float>(dy[at + d]) * static_cast<float>(y[at + d]);
    dot[r] = acc;
  }
};

// One backward item: key/value head kvh of sequence b, every key tile (outer) against every query tile of the
// heads that read it (inner). dK and dV of a key tile sum in the tile; dQ in float rows of the workspace, which
// no other item touches.
template <class T>
struct tile_backward_item {
  tile_attention_shape s;
  const T *qkv, *dy;
  const float *lse, *dot;
  T* dqkv;
  float* dq;  // [batch, seq, width]
  kernels::attention_mask mask;
  void operator()(std::int64_t item) const {
    constexpr std::int64_t n = kernels::attention_tile;
    const std::int64_t hd = s.head_dim, ld = s.row(), L = s.seq, w = s.width(), kvh = item % s.kv(), b = item / s.kv();
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    const T* base = qkv + b * L * ld;
    const std::int64_t kc = (s.heads + kvh) * hd, vc = (s.heads + s.kv() + kvh) * hd;
    attention_tiles& t = thread_tiles(hd);
    float* dqb = dq + b * L * w;
    for (std::int64_t k0 = 0; k0 < L; k0 += n) {
      const std::int64_t bc = std::min(n, L - k0);
      load_tile(base + k0 * ld + kc, ld, bc, hd, 1.f, t.k);
      load_tile(base + k0 * ld + vc, ld, bc, hd, 1.f, t.v);
      std::fill(t.dk, t.dk + bc * hd, 0.f);
      std::fill(t.dv, t.dv + bc * hd, 0.f);
      for (std::int64_t h = kvh * s.group(); h < (kvh + 1) * s.group(); ++h)
        for (std::int64_t q0 = mask.first_query(k0) / n * n; q0 < L; q0 += n) {
          const std::int64_t br = std::min(n, L - q0);
          visible_span vis[n];
          bool any = false;
          for (std::int64_t i = 0; i < br; ++i) {
            vis[i] = visible_keys(mask, b, q0 + i, k0, bc);
            any = any || vis[i].lo < vis[i].hi;
          }
          if (!any) continue;
          load_tile(base + q0 * ld + h * hd, ld, br, hd, scale, t.q);
          load_tile(dy + (b * L + q0) * w + h * hd, w, br, hd, 1.f, t.o);
          tile_gemm(trans::n, trans::t, br, bc, hd, t.q, hd, t.k, hd, t.s, n, false);  // scaled scores
          tile_gemm(trans::n, trans::t, br, bc, hd, t.o, hd, t.v, hd, t.p, n, false);  // dP = dO·Vᵀ
          const float* l = lse + (b * s.heads + h) * L + q0;
          const float* dd = dot + (b * s.heads + h) * L + q0;
          softmax_tile_backward(t.s, t.p, br, vis, l, dd);
          tile_gemm(trans::t, trans::n, bc, hd, br, t.s, n, t.o, hd, t.dv, hd, true);  // dV += Pᵀ·dO
          tile_gemm(trans::t, trans::n, bc, hd, br, t.p, n, t.q, hd, t.dk, hd, true);  // dK += dSᵀ·(scale·Q)
          // dQ += dS·K, scaled when written out
          tile_gemm(trans::n, trans::n, br, hd, bc, t.p, n, t.k, hd, dqb + q0 * w + h * hd, w, true);
        }
      for (std::int64_t j = 0; j < bc; ++j) {
        T* row = dqkv + (b * L + k0 + j) * ld;
        for (std::int64_t d = 0; d < hd; ++d) {
          row[kc + d] = round_to<T>(t.dk[j * hd + d]);
          row[vc + d] = round_to<T>(t.dv[j * hd + d]);
        }
      }
    }
  }
};

// dqkv's q columns = scale · dQ's float sums, for token row r.
template <class T>
struct tile_write_dq {
  tile_attention_shape s;
  const float* dq;
  T* dqkv;
  float scale;
  DML_HOST_DEVICE void operator()(std::int64_t r) const {
    const std::int64_t w = s.width();
    const float* from = dq + r * w;
    T* to = dqkv + r * s.row();
    for (std::int64_t j = 0; j < w; ++j) to[j] = round_to<T>(scale * from[j]);
  }
};
}  // namespace detail

namespace detail {
// Forward and backward on an explicit mask, unchecked: the public calls below, and ring attention's steps (a block
// of queries against a block of keys, nn/ring_attention.hpp). Backward reads D = rowsum(dy ⊙ y) from dot and
// overwrites dqkv; dq: [batch, seq, width] floats of workspace (the host's dQ sums).
template <execution_space S, class T>
void tile_forward(const tile_attention_shape& s, const T* qkv, T* y, float* lse, const kernels::attention_mask& mask) {
#if DML_HAS_CUDA
  if constexpr (std::same_as<S, cuda>) {
    tile_attention_forward_cuda(s, qkv, y, lse, mask);
    return;
  }
#endif
  if constexpr (std::same_as<S, host>) {
    const std::int64_t tiles = (s.seq + kernels::attention_tile - 1) / kernels::attention_tile;
    for_each_row<S>(s.batch * s.heads * tiles, tile_forward_item<T>{s, qkv, y, lse, mask},
                    kernels::attention_tile * s.seq * s.head_dim);
  }
}
template <execution_space S, class T>
void tile_backward(const tile_attention_shape& s, const T* qkv, const float* lse, const float* dot, const T* dy,
                   T* dqkv, float* dq, const kernels::attention_mask& mask) {
#if DML_HAS_CUDA
  if constexpr (std::same_as<S, cuda>) {
    tile_attention_backward_cuda(s, qkv, lse, dot, dy, dqkv, mask);
    return;
  }
#endif
  if constexpr (std::same_as<S, host>) {
    fill_n<S>(dq, s.batch * s.seq * s.width(), 0.f);
    for_each_row<S>(s.batch * s.kv(), tile_backward_item<T>{s, qkv, dy, lse, dot, dqkv, dq, mask},
                    s.seq * s.seq * s.head_dim);
    for_each_row<S>(s.batch * s.seq, tile_write_dq<T>{s, dq, dqkv, 1.f / std::sqrt(static_cast<float>(s.head_dim))},
                    s.width());
  }
}
}  // namespace detail

// y[b, t, h·hd + d] = Σ_s softmax_s(q·k / √hd over the keys t sees) · v[b, s, kvh·hd + d], kvh = h / group.
// qkv: [batch, seq, (heads + 2·kv_heads)·head_dim]; y: [batch, seq, heads·head_dim]; lse:
// tile_attention_saved_size(s) floats, written and read by backward. doc: null, or [batch, seq] positions where each
// token's document starts (needs the causal mask). All in space S; T is float, bf16 or fp16, computed in float.
template <execution_space S, float_like T>
void tile_attention_forward(const tile_attention_shape& s, const T* qkv, T* y, float* lse,
                            const std::int64_t* doc = nullptr) {
  constexpr const char* what = "dml::nn::tile_attention_forward";
  detail::check_tile_attention(what, s, doc);
  detail::check_attention_pointer(what, "qkv", qkv);
  detail::check_attention_pointer(what, "y", y);
  detail::check_attention_pointer(what, "lse", lse);
  detail::tile_forward<S>(s, qkv, y, lse, kernels::attention_mask{doc, s.seq, s.causal});
}

// dy: [batch, seq, heads·head_dim]; y and lse as forward left them; writes dqkv (overwrites, never accumulates).
// workspace: tile_attention_workspace_size(s) floats in S.
template <execution_space S, float_like T>
void tile_attention_backward(const tile_attention_shape& s, const T* qkv, const T* y, const float* lse, const T* dy,
                             T* dqkv, float* workspace, const std::int64_t* doc = nullptr) {
  constexpr const char* what = "dml::nn::tile_attention_backward";
  detail::check_tile_attention(what, s, doc);
  detail::check_attention_pointer(what, "qkv", qkv);
  detail::check_attention_pointer(what, "y", y);
  detail::check_attention_pointer(what, "lse", lse);
  detail::check_attention_pointer(what, "dy", dy);
  detail::check_attention_pointer(what, "dqkv", dqkv);
  detail::check_attention_pointer(what, "workspace", workspace);
  float* dq = workspace;
  float* dot = workspace + s.batch * s.seq * s.width();
  for_each_row<S>(s.batch * s.heads * s.seq, detail::tile_backward_dot<T>{s, y, dy, dot}, s.head_dim);
  detail::tile_backward<S>(s, qkv, lse, dot, dy, dqkv, dq, kernels::attention_mask{doc, s.seq, s.causal});
}

}  // namespace dml::nn
