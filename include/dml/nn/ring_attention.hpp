// SPDX-License-Identifier: Apache-2.0
// dml/nn/ring_attention.hpp — ring attention for context parallelism: K/V blocks travel a ring of ranks, each
// rank attends its own queries to every block with an online softmax. Sits on nn/attention.hpp and nn/rank_group.hpp.
#pragma once

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"
#include "dml/core/gemm.hpp"
#include "dml/core/math.hpp"
#include "dml/core/space.hpp"
#include "dml/nn/attention.hpp"
#include "dml/nn/detail/rows.hpp"
#include "dml/nn/layer.hpp"
#include "dml/nn/rank_group.hpp"

namespace dml::nn {

// Where this rank's tokens sit in each sequence of a context-parallel ring: nn::context_split (nn/layer.hpp), whose
// zig-zag layout cuts the sequence into 2·ranks chunks and gives rank r chunks r and 2·ranks−1−r, so under a causal
// mask every rank has the same amount of work; otherwise rank r holds chunk r of ranks. cp_position maps a local
// token to its place in the sequence.
using cp_layout = context_split;

// Throws invalid_argument unless the layout names a rank of its ring and seq splits into its chunks.
inline void check_cp_layout(const cp_layout& at, std::int64_t seq) {
  constexpr const char* what = "dml::nn::check_cp_layout";
  if (at.ranks < 1) fail<invalid_argument>(what, ": expected at least 1 context-parallel rank, found ranks = ", at.ranks);
  if (at.rank < 0 || at.rank >= at.ranks)
    fail<invalid_argument>(what, ": expected a rank in [0, ", at.ranks, "), found rank = ", at.rank);
  if (seq <= 0) fail<invalid_argument>(what, ": expected seq > 0, found seq = ", seq);
  if (at.ranks == 1) return;
  const std::int64_t chunks = at.zigzag ? 2 * std::int64_t(at.ranks) : at.ranks;
  if (seq % chunks != 0)
    fail<invalid_argument>(what, ": expected seq divisible by ", chunks, " (", at.zigzag ? "2·ranks, zig-zag" : "ranks",
                           " over ", at.ranks, " ranks), found seq = ", seq);
}

// One ring attention call. seq is the whole sequence (T); each rank holds seq / ranks tokens of each of batch
// sequences. Without `causal` every query sees every key.
struct ring_attention_shape {
  std::int64_t batch = 0, seq = 0, heads = 0, head_dim = 0;
  bool causal = true;
  std::int64_t width() const { return heads * head_dim; }
};

namespace detail {
// What the sizes below are made of, in elements: kv, one travelling K|V block [batch, seq_local, 2·width];
// rows, one float per (batch, head, local query); acc, the float output accumulator [batch, seq_local, width];
// block, one (batch, head)'s scores of the local queries against a key block.
struct ring_parts {
  std::int64_t local, kv, rows, acc, block;
  bool ring;
};
inline ring_parts ring_parts_of(const ring_attention_shape& s, const cp_layout& at) {
  const std::int64_t ranks = at.ranks < 1 ? 1 : at.ranks, n = s.seq / ranks, w = s.heads * s.head_dim;
  return {n, s.batch * n * 2 * w, s.batch * s.heads * n, s.batch * n * w, n * n, ranks > 1};
}
// Float parts live in the T workspace at two elements each (exact for a 16-bit T, spare for float), so one
// size serves every T; the slack covers aligning them when a 16-bit T's workspace starts off a 4-byte boundary.
inline constexpr std::int64_t ring_float_elements = 2;
inline constexpr std::int64_t ring_align_slack = 2;
}  // namespace detail

// Floats that forward keeps for backward: the log-sum-exp of each (batch, head, local query row).
inline std::int64_t ring_attention_saved_size(const ring_attention_shape& s, const cp_layout& at) {
  return detail::ring_parts_of(s, at).rows;
}

// Elements of T scratch that forward and backward each need (the larger of the two, enough for any float_like
// T). Forward: the running softmax sums and the float output accumulator, two K/V receive buffers (double
// buffering; none on one rank) and one block of scores. Backward: D = rowsum(dy ⊙ y), two K/V and two dK/dV
// travelling buffers (none on one rank) and two blocks (P and dP, then dS).
inline std::int64_t ring_attention_workspace_size(const ring_attention_shape& s, const cp_layout& at) {
  const auto p = detail::ring_parts_of(s, at);
  const std::int64_t f = detail::ring_float_elements;
  const std::int64_t forward = f * (p.rows + p.acc) + (p.ring ? 2 * p.kv : 0) + p.block;
  const std::int64_t backward = f * p.rows + (p.ring ? 4 * p.kv : 0) + 2 * p.block;
  return (forward > backward ? forward : backward) + detail::ring_align_slack;
}

namespace kernels {
// A rank's local tokens as at most two runs of consecutive positions (the zig-zag's two chunks), each `length`
// long: local indices local[s]..local[s]+length hold positions global[s]... Masks and block skipping work on runs.
struct cp_runs {
  int count = 1;
  std::int64_t length = 0;
  std::int64_t local[2] = {0, 0}, global[2] = {0, 0};
  DML_HOST_DEVICE std::int64_t position(std::int64_t i) const {
    const int r = (count == 2 && i >= local[1]) ? 1 : 0;
    return global[r] + (i - local[r]);
  }
  // How many keys of run r (from its start) a query at position q sees.
  DML_HOST_DEVICE std::int64_t visible(int r, std::int64_t q, bool causal) const {
    if (!causal) return length;
    const std::int64_t c = q - global[r] + 1;
    return c < 0 ? 0 : (c > length ? length : c);
  }
};
DML_HOST_DEVICE cp_runs cp_runs_of(const cp_layout& at, std::int64_t seq) {
  cp_runs r;
  const std::int64_t ranks = at.ranks < 1 ? 1 : at.ranks, n = seq / ranks;
  if (ranks > 1 && at.zigzag) {
    r.count = 2;
    r.length = n / 2;
    r.local[1] = r.length;
    r.global[0] = at.rank * r.length;
    r.global[1] = (2 * ranks - 1 - at.rank) * r.length;
  } else {
    r.length = n;
    r.global[0] = ranks > 1 ? at.rank * n : 0;
  }
  return r;
}

inline constexpr float ring_no_max = -3.0e38f;  // running max of a row that has seen no key yet

// One row of the online softmax, for local query i of one (batch, head), against one key block. On entry the
// row of s holds the raw scores q·kᵀ where some key is visible (elsewhere anything); on exit it holds
// p = exp(scale·score − m_new), 0 where masked. The running max and sum move to m_new, and the row's output
// accumulator is rescaled by exp(m_old − m_new) so that acc += P·V keeps it consistent.
template <class T>
struct ring_forward_row {
  T* s;
  float *mx, *sum, *acc;
  std::int64_t n, ld_acc, hd;
  cp_runs q, k;
  bool causal;
  float scale;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    T* row = s + i * n;
    const std::int64_t pos = q.position(i);
    std::int64_t vis[2] = {0, 0};
    float blk = ring_no_max;
    for (int r = 0; r < k.count; ++r) {
      vis[r] = k.visible(r, pos, causal);
      const T* kr = row + k.local[r];
      const std::int64_t v = vis[r];
      DML_SIMD_MAX(blk)
      for (std::int64_t j = 0; j < v; ++j) blk = attention_max(blk, scale * static_cast<float>(kr[j]));
    }
    if (vis[0] + vis[1] == 0) {  // nothing visible in this block: the row takes no part in acc += P·V
      for (std::int64_t j = 0; j < n; ++j) row[j] = T(0.f);
      return;
    }
    const float old_sum = sum[i], old_max = mx[i];
    const float m = old_sum > 0.f ? attention_max(old_max, blk) : blk;
    const float alpha = old_sum > 0.f ? fast_exp(old_max - m) : 0.f;
    float add = 0.f;
    for (int r = 0; r < k.count; ++r) {
      T* kr = row + k.local[r];
      const std::int64_t v = vis[r];
      DML_SIMD_SUM(add)
      for (std::int64_t j = 0; j < v; ++j) {
        const float p = static_cast<float>(round_to<T>(fast_exp(scale * static_cast<float>(kr[j]) - m)));
        kr[j] = round_to<T>(p);  // exact: p is a T's value (a float, not a T, so that the loop vectorises)
        add += p;  // the sum of what P·V multiplies, so y = acc / sum is a convex mix
      }
      for (std::int64_t j = v; j < k.length; ++j) kr[j] = T(0.f);
    }
    mx[i] = m;
    sum[i] = old_sum * alpha + add;
    float* a = acc + i * ld_acc;
    DML_SIMD
    for (std::int64_t d = 0; d < hd; ++d) a[d] *= alpha;
  }
};

// y = acc / sum and lse = max + log(sum), for row r = (b·heads + h)·n + i; lse holds the running max on entry.
template <class T>
struct ring_forward_finish {
  const float *acc, *sum;
  float* lse;
  T* y;
  std::int64_t n, heads, hd;
  DML_HOST_DEVICE void operator()(std::int64_t r) const {
    const std::int64_t i = r % n, h = (r / n) % heads, b = r / (n * heads), w = heads * hd;
    const std::int64_t at = (b * n + i) * w + h * hd;
    const float l = sum[r], inv = l > 0.f ? 1.f / l : 0.f;
    for (std::int64_t d = 0; d < hd; ++d) y[at + d] = T(acc[at + d] * inv);
    lse[r] = l > 0.f ? lse[r] + logf(l) : ring_no_max;
  }
};

// D[r] = Σ_d dy·y over row r's head: the softmax backward's row term, computed once instead of per block.
template <class T>
struct ring_backward_dot {
  const T *y, *dy;
  float* dot;
  std::int64_t n, heads, hd;
  DML_HOST_DEVICE void operator()(std::int64_t r) const {
    const std::int64_t i = r % n, h = (r / n) % heads, b = r / (n * heads);
    const std::int64_t at = (b * n + i) * heads * hd + h * hd;
    float acc = 0.f;
    for (std::int64_t d = 0; d < hd; ++d) acc += static_cast<float>(dy[at + d]) * static_cast<float>(y[at + d]);
    dot[r] = acc;
  }
};

// One row for backward: p holds the recomputed scores, d holds dP = dy·vᵀ; on exit p = exp(scale·s − lse) and
// d = dS = p·(dP − D)·scale, both 0 where masked (masked entries are never read: they may hold anything).
template <class T>
struct ring_backward_row {
  T *p, *d;
  const float *lse, *dot;
  std::int64_t n;
  cp_runs q, k;
  bool causal;
  float scale;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t pos = q.position(i);
    const float l = lse[i], D = dot[i];
    for (int r = 0; r < k.count; ++r) {
      T* pr = p + i * n + k.local[r];
      T* dr = d + i * n + k.local[r];
      const std::int64_t v = k.visible(r, pos, causal);
      DML_SIMD
      for (std::int64_t j = 0; j < v; ++j) {
        const float pj = static_cast<float>(round_to<T>(fast_exp(scale * static_cast<float>(pr[j]) - l)));
        pr[j] = round_to<T>(pj);  // exact, as in ring_forward_block
        dr[j] = round_to<T>(attention_softmax_grad(pj, static_cast<float>(dr[j]), D, scale));
      }
      for (std::int64_t j = v; j < k.length; ++j) pr[j] = dr[j] = T(0.f);
    }
  }
};

// The k|v columns of qkv rows (stride 3w) packed into rows of 2w, and dK|dV back into dqkv's k|v columns.
template <class T>
struct ring_pack_kv {
  const T* qkv;
  T* kv;
  std::int64_t w;
  DML_HOST_DEVICE void operator()(std::int64_t e) const { kv[e] = qkv[(e / (2 * w)) * 3 * w + w + e % (2 * w)]; }
  // Token r's K and V whole (detail::token_rows: the host's form, no division per element).
  DML_HOST_DEVICE void row(std::int64_t r) const {
    const T* from = qkv + r * 3 * w + w;
    T* to = kv + r * 2 * w;
    DML_SIMD
    for (std::int64_t j = 0; j < 2 * w; ++j) to[j] = from[j];
  }
};
template <class T>
struct ring_unpack_dkv {
  const T* dkv;
  T* dqkv;
  std::int64_t w;
  DML_HOST_DEVICE void operator()(std::int64_t e) const { dqkv[(e / (2 * w)) * 3 * w + w + e % (2 * w)] = dkv[e]; }
  DML_HOST_DEVICE void row(std::int64_t r) const {
    const T* from = dkv + r * 2 * w;
    T* to = dqkv + r * 3 * w + w;
    DML_SIMD
    for (std::int64_t j = 0; j < 2 * w; ++j) to[j] = from[j];
  }
};
// Columns [0, cols) of rows of stride ld set to 0.
template <class T>
struct ring_zero_columns {
  T* p;
  std::int64_t cols, ld;
  DML_HOST_DEVICE void operator()(std::int64_t e) const { p[(e / cols) * ld + e % cols] = T(0.f); }
  DML_HOST_DEVICE void row(std::int64_t r) const {
    T* to = p + r * ld;
    DML_SIMD
    for (std::int64_t j = 0; j < cols; ++j) to[j] = T(0.f);
  }
};
}  // namespace kernels

namespace detail {
// Tags of the ring's messages: forward's K/V at 0x5a000 + step, backward's at 0x5a800 + 2·step + {0 (K/V), 1 (dK/dV)},
// so the two passes never match each other's messages, nor those of other traffic on the group.
inline constexpr int ring_forward_tag = 0x5a000;
inline constexpr int ring_backward_tag = 0x5a800;
inline constexpr int ring_max_ranks = 0x400;

// Carves the workspace: float parts first (aligned to 4 bytes), then parts of T.
struct ring_carver {
  std::byte* at;
  template <class U>
  U* take(std::int64_t n) {
    const auto addr = reinterpret_cast<std::uintptr_t>(at);
    const std::uintptr_t aligned = (addr + alignof(U) - 1) / alignof(U) * alignof(U);
    U* p = reinterpret_cast<U*>(aligned);
    at = reinterpret_cast<std::byte*>(aligned) + n * static_cast<std::int64_t>(sizeof(U));
    return p;
  }
};

inline void check_ring_call(const char* what, const ring_attention_shape& s, const cp_layout& at, const rank_group* cp) {
  const auto positive = [&](const char* name, std::int64_t v) {
    if (v <= 0) fail<invalid_argument>(what, ": expected ", name, " > 0, found ", name, " = ", v);
  };
  positive("batch", s.batch);
  positive("seq", s.seq);
  positive("heads", s.heads);
  positive("head_dim", s.head_dim);
  check_cp_layout(at, s.seq);
  if (at.ranks > ring_max_ranks)
    fail<invalid_argument>(what, ": expected at most ", ring_max_ranks, " context-parallel ranks, found ", at.ranks);
  if (at.ranks > 1 && cp == nullptr)
    fail<invalid_argument>(what, ": expected a context-parallel group of ", at.ranks, " ranks, found none");
  if (cp && (cp->size() != at.ranks || cp->rank() != at.rank))
    fail<invalid_argument>(what, ": expected a group of ", at.ranks, " ranks in which this is rank ", at.rank,
                           ", found ", cp->size(), " ranks and rank ", cp->rank());
}

// Query run a against key run b of one block: skipped when the causal mask hides all of it.
inline bool ring_pair_visible(const kernels::cp_runs& q, int a, const kernels::cp_runs& k, int b, bool causal) {
  return !causal || k.global[b] <= q.global[a] + q.length - 1;
}
inline bool ring_block_visible(const kernels::cp_runs& q, const kernels::cp_runs& k, bool causal) {
  for (int a = 0; a < q.count; ++a)
    for (int b = 0; b < k.count; ++b)
      if (ring_pair_visible(q, a, k, b, causal)) return true;
  return false;
}

// Attends every local query to one key block (keys at k + j·ldk, values at v + j·ldk, laid out as the runs of
// kr), updating the running max (in lse), sum and accumulator. sc: one block of scratch.
template <execution_space S, class T>
void ring_forward_block(const ring_attention_shape& s, std::int64_t n, const kernels::cp_runs& qr,
                        const kernels::cp_runs& kr, const T* qkv, const T* k, const T* v, std::int64_t ldk, float* lse,
                        float* sum, float* acc, T* sc) {
  if (!ring_block_visible(qr, kr, s.causal)) return;
  const std::int64_t hd = s.head_dim, w = s.width(), ld = 3 * w, L = qr.length;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t h = 0; h < s.heads; ++h) {
      const T* qb = qkv + b * n * ld + h * hd;
      const T* kb = k + b * n * ldk + h * hd;
      const T* vb = v + b * n * ldk + h * hd;
      float* ab = acc + b * n * w + h * hd;
      const std::int64_t row0 = (b * s.heads + h) * n;
      // Scores of the visible run pairs only; q and k are read in place through their row strides.
      for (int x = 0; x < qr.count; ++x)
        for (int y = 0; y < kr.count; ++y)
          if (ring_pair_visible(qr, x, kr, y, s.causal))
            gemm<S>(gemm_args{.ta = trans::n, .tb = trans::t, .m = L, .n = kr.length, .k = hd,
                              .a = qb + qr.local[x] * ld, .lda = ld, .b = kb + kr.local[y] * ldk, .ldb = ldk,
                              .c = sc + qr.local[x] * n + kr.local[y], .ldc = n});
      for_each_row<S>(n, kernels::ring_forward_row<T>{sc, lse + row0, sum + row0, ab, n, w, hd, qr, kr, s.causal, scale});
      for (int x = 0; x < qr.count; ++x)
        for (int y = 0; y < kr.count; ++y)
          if (ring_pair_visible(qr, x, kr, y, s.causal))
            gemm<S>(gemm_args{.m = L, .n = hd, .k = kr.length, .a = sc + qr.local[x] * n + kr.local[y], .lda = n,
                              .b = vb + kr.local[y] * ldk, .ldb = ldk, .c = ab + qr.local[x] * w, .ldc = w,
                              .beta = 1.f});
    }
}

// Backward against one key block: dQ (in dqkv's q columns, stride 3w) and this block's dK|dV (at dk + j·lddk,
// dv likewise) accumulate. p, d: two blocks of scratch.
template <execution_space S, class T>
void ring_backward_block(const ring_attention_shape& s, std::int64_t n, const kernels::cp_runs& qr,
                         const kernels::cp_runs& kr, const T* qkv, const T* dy, const float* lse, const float* dot,
                         const T* k, const T* v, std::int64_t ldk, T* dqkv, T* dk, T* dv, std::int64_t lddk, T* p, T* d) {
  if (!ring_block_visible(qr, kr, s.causal)) return;
  const std::int64_t hd = s.head_dim, w = s.width(), ld = 3 * w, L = qr.length, M = kr.length;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t h = 0; h < s.heads; ++h) {
      const T* qb = qkv + b * n * ld + h * hd;
      const T* kb = k + b * n * ldk + h * hd;
      const T* vb = v + b * n * ldk + h * hd;
      const T* gb = dy + b * n * w + h * hd;
      T* dqb = dqkv + b * n * ld + h * hd;
      T* dkb = dk + b * n * lddk + h * hd;
      T* dvb = dv + b * n * lddk + h * hd;
      const std::int64_t row0 = (b * s.heads + h) * n;
      for (int x = 0; x < qr.count; ++x)
        for (int y = 0; y < kr.count; ++y)
          if (ring_pair_visible(qr, x, kr, y, s.causal)) {
            const std::int64_t qo = qr.local[x], ko = kr.local[y];
            gemm<S>(gemm_args{.ta = trans::n, .tb = trans::t, .m = L, .n = M, .k = hd, .a = qb + qo * ld, .lda = ld,
                              .b = kb + ko * ldk, .ldb = ldk, .c = p + qo * n + ko, .ldc = n});
            gemm<S>(gemm_args{.ta = trans::n, .tb = trans::t, .m = L, .n = M, .k = hd, .a = gb + qo * w, .lda = w,
                              .b = vb + ko * ldk, .ldb = ldk, .c = d + qo * n + ko, .ldc = n});
          }
      for_each_row<S>(n, kernels::ring_backward_row<T>{p, d, lse + row0, dot + row0, n, qr, kr, s.causal, scale});
      for (int x = 0; x < qr.count; ++x)
        for (int y = 0; y < kr.count; ++y)
          if (ring_pair_visible(qr, x, kr, y, s.causal)) {
            const std::int64_t qo = qr.local[x], ko = kr.local[y];
            // dQ += dS·K, dK += dSᵀ·Q, dV += Pᵀ·dY
            gemm<S>(gemm_args{.m = L, .n = hd, .k = M, .a = d + qo * n + ko, .lda = n, .b = kb + ko * ldk,
                              .ldb = ldk, .c = dqb + qo * ld, .ldc = ld, .beta = 1.f});
            gemm<S>(gemm_args{.ta = trans::t, .m = M, .n = hd, .k = L, .a = d + qo * n + ko, .lda = n,
                              .b = qb + qo * ld, .ldb = ld, .c = dkb + ko * lddk, .ldc = lddk, .beta = 1.f});
            gemm<S>(gemm_args{.ta = trans::t, .m = M, .n = hd, .k = L, .a = p + qo * n + ko, .lda = n,
                              .b = gb + qo * w, .ldb = w, .c = dvb + ko * lddk, .ldc = lddk, .beta = 1.f});
          }
    }
}
}  // namespace detail

// y[b, i, h·hd + d] = Σ_s softmax_s(q·k / √hd, masked) · v[b, s, h·hd + d] over all seq positions s of the ring,
// for this rank's local tokens i (positions cp_position(at, seq, i)); masked: key position > query position
// when causal. qkv: [batch, seq/ranks, 3·width] as causal_attention_forward's; y: [batch, seq/ranks, width];
// lse: ring_attention_saved_size floats [batch, heads, seq/ranks], for backward; workspace:
// ring_attention_workspace_size elements. cp: the ring (null or one rank: the whole sequence is local).
// Collective over cp: every rank of the ring calls it with the same shape.
template <execution_space S, float_like T>
void ring_attention_forward(const ring_attention_shape& s, const cp_layout& at, rank_group* cp, const T* qkv, T* y,
                            float* lse, T* workspace) {
  constexpr const char* what = "dml::nn::ring_attention_forward";
  detail::check_ring_call(what, s, at, cp);
  detail::check_attention_pointer(what, "qkv", qkv);
  detail::check_attention_pointer(what, "y", y);
  detail::check_attention_pointer(what, "lse", lse);
  detail::check_attention_pointer(what, "workspace", workspace);
  const auto z = detail::ring_parts_of(s, at);
  const std::int64_t n = z.local, w = s.width();
  detail::ring_carver carve{reinterpret_cast<std::byte*>(workspace)};
  float* sum = carve.take<float>(z.rows);
  float* acc = carve.take<float>(z.acc);
  T* kv[2] = {z.ring ? carve.take<T>(z.kv) : nullptr, z.ring ? carve.take<T>(z.kv) : nullptr};
  T* sc = carve.take<T>(z.block);
  fill_n<S>(lse, z.rows, kernels::ring_no_max);  // the running max until finish turns it into the log-sum-exp
  fill_n<S>(sum, z.rows, 0.f);
  fill_n<S>(acc, z.acc, 0.f);
  const auto qr = kernels::cp_runs_of(at, s.seq);
  if (!z.ring) {
    detail::ring_forward_block<S>(s, n, qr, qr, qkv, qkv + w, qkv + 2 * w, 3 * w, lse, sum, acc, sc);
  } else {
    const int ranks = at.ranks, next = (at.rank + 1) % ranks, prev = (at.rank + ranks - 1) % ranks;
    detail::token_rows<S>(z.kv / (2 * w), 2 * w, kernels::ring_pack_kv<T>{qkv, kv[0], w});
    for (int step = 0; step < ranks; ++step) {
      const int cur = step % 2;
      // The next block is on its way while this one is used: post both transfers before computing.
      group_request both;
      if (step + 1 < ranks)
        both = cp->isendrecv(static_cast<const T*>(kv[cur]), next, kv[1 - cur], prev, z.kv, detail::ring_forward_tag + step);
      const cp_layout from{.ranks = ranks, .rank = (at.rank - step + ranks) % ranks, .zigzag = at.zigzag};
      detail::ring_forward_block<S>(s, n, qr, kernels::cp_runs_of(from, s.seq), qkv, kv[cur], kv[cur] + w, 2 * w,
                                    lse, sum, acc, sc);
      both.wait();
    }
  }
  for_each_row<S>(z.rows, kernels::ring_forward_finish<T>{acc, sum, lse, y, n, s.heads, s.head_dim});
}

// Gradients of ring_attention_forward, recomputing each block's probabilities from lse (flash-attention style).
// dy: [batch, seq/ranks, width]; writes (overwrites) dqkv [batch, seq/ranks, 3·width]. K/V travel the ring again
// with their dK/dV accumulators, which come back to their owner after a full turn; dQ accumulates in place.
template <execution_space S, float_like T>
void ring_attention_backward(const ring_attention_shape& s, const cp_layout& at, rank_group* cp, const T* qkv,
                             const T* y, const float* lse, const T* dy, T* dqkv, T* workspace) {
  constexpr const char* what = "dml::nn::ring_attention_backward";
  detail::check_ring_call(what, s, at, cp);
  detail::check_attention_pointer(what, "qkv", qkv);
  detail::check_attention_pointer(what, "y", y);
  detail::check_attention_pointer(what, "lse", lse);
  detail::check_attention_pointer(what, "dy", dy);
  detail::check_attention_pointer(what, "dqkv", dqkv);
  detail::check_attention_pointer(what, "workspace", workspace);
  const auto z = detail::ring_parts_of(s, at);
  const std::int64_t n = z.local, w = s.width();
  detail::ring_carver carve{reinterpret_cast<std::byte*>(workspace)};
  float* dot = carve.take<float>(z.rows);
  T* kv[2] = {z.ring ? carve.take<T>(z.kv) : nullptr, z.ring ? carve.take<T>(z.kv) : nullptr};
  T* dkv[2] = {z.ring ? carve.take<T>(z.kv) : nullptr, z.ring ? carve.take<T>(z.kv) : nullptr};
  T* p = carve.take<T>(z.block);
  T* d = carve.take<T>(z.block);
  for_each_row<S>(z.rows, kernels::ring_backward_dot<T>{y, dy, dot, n, s.heads, s.head_dim});
  const auto qr = kernels::cp_runs_of(at, s.seq);
  if (!z.ring) {
    fill_n<S>(dqkv, s.batch * n * 3 * w, T(0.f));
    detail::ring_backward_block<S>(s, n, qr, qr, qkv, dy, lse, dot, qkv + w, qkv + 2 * w, 3 * w, dqkv, dqkv + w,
                                   dqkv + 2 * w, 3 * w, p, d);
    return;
  }
  const int ranks = at.ranks, next = (at.rank + 1) % ranks, prev = (at.rank + ranks - 1) % ranks;
  detail::token_rows<S>(s.batch * n, w, kernels::ring_zero_columns<T>{dqkv, w, 3 * w});
  detail::token_rows<S>(z.kv / (2 * w), 2 * w, kernels::ring_pack_kv<T>{qkv, kv[0], w});
  fill_n<S>(dkv[0], z.kv, T(0.f));
  for (int step = 0; step < ranks; ++step) {
    const int cur = step % 2;
    const int kv_tag = detail::ring_backward_tag + 2 * step, dkv_tag = kv_tag + 1;
    group_request kv_both;
    // K/V go on before this block is used; dK/dV can leave only once this rank has added to them, so they
    // travel after the block, each rank sending and receiving at once. After a full turn (the last step) the
    // accumulators arrive back at their owner: this rank's own lands in dkv[1 - cur].
    if (step + 1 < ranks)
      kv_both = cp->isendrecv(static_cast<const T*>(kv[cur]), next, kv[1 - cur], prev, z.kv, kv_tag);
    const cp_layout from{.ranks = ranks, .rank = (at.rank - step + ranks) % ranks, .zigzag = at.zigzag};
    detail::ring_backward_block<S>(s, n, qr, kernels::cp_runs_of(from, s.seq), qkv, dy, lse, dot, kv[cur],
                                   kv[cur] + w, 2 * w, dqkv, dkv[cur], dkv[cur] + w, 2 * w, p, d);
    group_request dkv_both = cp->isendrecv(static_cast<const T*>(dkv[cur]), next, dkv[1 - cur], prev, z.kv, dkv_tag);
    kv_both.wait();
    dkv_both.wait();
  }
  detail::token_rows<S>(z.kv / (2 * w), 2 * w, kernels::ring_unpack_dkv<T>{dkv[ranks % 2], dqkv, w});
}

}  // namespace dml::nn
