// SPDX-License-Identifier: Apache-2.0
// dml/nn/ring_attention.hpp — attention for context parallelism: K/V blocks (of the key/value heads alone, under
// grouped-query attention) travel a ring of ranks, or are all-gathered at once (the Llama 3 report's scheme, with its
// gradients reduce-scattered back); each rank attends its own queries to every block with tile attention's kernels
// and merges the blocks' outputs by their log-sum-exps. Causal and document masks, zig-zag or contiguous chunks. Sits
// on nn/tile_attention.hpp and nn/rank_group.hpp.
#pragma once

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"
#include "dml/core/space.hpp"
#include "dml/nn/attention.hpp"
#include "dml/nn/detail/rows.hpp"
#include "dml/nn/layer.hpp"
#include "dml/nn/rank_group.hpp"
#include "dml/nn/tile_attention.hpp"

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
// sequences. Grouped-query heads as tile attention's (nn/tile_attention.hpp): query head h reads key/value head
// h / (heads / kv_heads); kv_heads = 0 means heads. Without `causal` every query sees every key.
struct ring_attention_shape {
  std::int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  bool causal = true;
  std::int64_t kv() const { return kv_heads > 0 ? kv_heads : heads; }
  std::int64_t width() const { return heads * head_dim; }                // y's row width
  std::int64_t row() const { return (heads + 2 * kv()) * head_dim; }    // qkv's row stride
};

namespace detail {
// What the sizes below are made of, in elements: local, a rank's tokens of a sequence; kv, one travelling K|V block
// [batch, local, 2·kv_heads·head_dim]; rows, one float per (batch, head, local query); out, [batch, local, width];
// qkv, [batch, local, row]: a step's queries beside the key block it attends to.
struct ring_parts {
  std::int64_t local, kv, rows, out, qkv;
  bool ring;
  std::int64_t ranks;
  bool gather;  // K/V all-gathered (context_split::all_gather), not passed round
};
inline ring_parts ring_parts_of(const ring_attention_shape& s, const cp_layout& at) {
  const std::int64_t ranks = at.ranks < 1 ? 1 : at.ranks, n = s.seq / ranks;
  return {n, s.batch * n * 2 * s.kv() * s.head_dim, s.batch * s.heads * n, s.batch * n * s.width(), s.batch * n * s.row(),
          ranks > 1, ranks, ranks > 1 && at.all_gather};
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
// T); linear in the local tokens, as tile attention's. On one rank: tile attention's backward workspace. On a
// ring, forward: the running output in float, a step's output and log-sum-exp, two K/V receive buffers (double
// buffering) and a step's q|k|v rows; backward: D = rowsum(dy ⊙ y) and the tiles' dQ sums in float, two K/V and two
// dK/dV travelling buffers, a step's q|k|v rows and their gradients. All-gathered, the K/V of every rank instead of
// two buffers (forward and backward), and backward the dK/dV of every rank's block and this rank's sum of them.
inline std::int64_t ring_attention_workspace_size(const ring_attention_shape& s, const cp_layout& at) {
  const auto p = detail::ring_parts_of(s, at);
  const std::int64_t f = detail::ring_float_elements;
  const std::int64_t tiles = f * (p.rows + p.out);
  const std::int64_t blocks = p.gather ? p.ranks * p.kv : 2 * p.kv;           // K/V at hand
  const std::int64_t dblocks = p.gather ? (p.ranks + 1) * p.kv : 2 * p.kv;    // dK/dV
  const std::int64_t forward = p.ring ? tiles + p.out + blocks + p.qkv : 0;
  const std::int64_t backward = tiles + (p.ring ? blocks + dblocks + 2 * p.qkv : 0);
  return (forward > backward ? forward : backward) + detail::ring_align_slack;
}

namespace kernels {
// Where a rank's local tokens sit in each sequence: the zig-zag's two chunks, or one.
DML_HOST_DEVICE position_runs cp_runs_of(const cp_layout& at, std::int64_t seq) {
  position_runs r;
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

// Folds one key block's attention (y, lse of the step) into the running one (acc in float, lse) of row
// r = (b·heads + h)·n + i: both are softmax-weighted means, so their mix by the exponentials of the log-sum-exps is
// the attention over the keys of both. A row that sees no key of the block (lse −inf) keeps what it has.
template <class T>
struct ring_merge {
  const T* y;
  const float* step_lse;
  float *acc, *lse;
  std::int64_t n, heads, hd;
  DML_HOST_DEVICE void operator()(std::int64_t r) const {
    const float b = step_lse[r], a = lse[r];
    if (!(b > attention_no_key)) return;
    const float m = a > b ? a : b, l = m + logf(expf(a - m) + expf(b - m));
    const float wa = expf(a - l), wb = expf(b - l);
    const std::int64_t i = r % n, h = (r / n) % heads, at = (r / (n * heads) * n + i) * heads * hd + h * hd;
    for (std::int64_t d = 0; d < hd; ++d) acc[at + d] = wa * acc[at + d] + wb * static_cast<float>(y[at + d]);
    lse[r] = l;
  }
};

// Columns [0, cols) of rows of stride from_ld copied (or added) onto rows of stride to_ld.
template <class T>
struct ring_columns {
  const T* from;
  T* to;
  std::int64_t cols, from_ld, to_ld;
  bool add;
  DML_HOST_DEVICE void operator()(std::int64_t e) const {
    const std::int64_t r = e / cols, j = e % cols;
    T& x = to[r * to_ld + j];
    x = add ? round_to<T>(static_cast<float>(x) + static_cast<float>(from[r * from_ld + j])) : from[r * from_ld + j];
  }
  // Row r whole (detail::token_rows: the host's form, no division per element).
  DML_HOST_DEVICE void row(std::int64_t r) const {
    const T* a = from + r * from_ld;
    T* b = to + r * to_ld;
    if (add) {
      DML_SIMD
      for (std::int64_t j = 0; j < cols; ++j) b[j] = round_to<T>(static_cast<float>(b[j]) + static_cast<float>(a[j]));
    } else {
      DML_SIMD
      for (std::int64_t j = 0; j < cols; ++j) b[j] = a[j];
    }
  }
};
// y = the running output, rounded to T.
template <class T>
struct ring_to_t {
  const float* acc;
  T* y;
  DML_HOST_DEVICE void operator()(std::int64_t e) const { y[e] = T(acc[e]); }
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
  if (s.kv_heads < 0 || s.heads % s.kv() != 0)
    fail<invalid_argument>(what, ": expected kv_heads dividing heads = ", s.heads, ", found kv_heads = ", s.kv_heads);
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
inline bool ring_pair_visible(const kernels::position_runs& q, int a, const kernels::position_runs& k, int b, bool causal) {
  return !causal || k.global[b] <= q.global[a] + q.length - 1;
}
inline bool ring_block_visible(const kernels::position_runs& q, const kernels::position_runs& k, bool causal) {
  for (int a = 0; a < q.count; ++a)
    for (int b = 0; b < k.count; ++b)
      if (ring_pair_visible(q, a, k, b, causal)) return true;
  return false;
}

// The tile shape of one step: the local queries against a key block of as many tokens.
inline tile_attention_shape ring_step_shape(const ring_attention_shape& s, std::int64_t n) {
  return {.batch = s.batch, .seq = n, .heads = s.heads, .kv_heads = s.kv(), .head_dim = s.head_dim, .causal = s.causal};
}
inline kernels::attention_mask ring_step_mask(const ring_attention_shape& s, std::int64_t n, const kernels::position_runs& q,
                                              const kernels::position_runs& k, const std::int64_t* doc) {
  return {.doc = doc, .seq = n, .causal = s.causal, .runs = true, .q = q, .k = k};
}
// A step's q|k|v rows: the local queries (copied when `queries`, once a pass), beside the key block kv.
template <execution_space S, class T>
void ring_stage(const ring_attention_shape& s, std::int64_t n, const T* qkv, const T* kv, T* stage, bool queries) {
  const std::int64_t rows = s.batch * n, qw = s.width(), kw = 2 * s.kv() * s.head_dim, ld = s.row();
  if (queries) token_rows<S>(rows, qw, kernels::ring_columns<T>{qkv, stage, qw, ld, ld, false});
  token_rows<S>(rows, kw, kernels::ring_columns<T>{kv, stage + qw, kw, kw, ld, false});
}
}  // namespace detail

// y[b, i, h·hd + d] = Σ_s softmax_s(q·k / √hd, masked) · v[b, s, kvh·hd + d] over all seq positions s of the ring,
// kvh = h / (heads / kv_heads), for this rank's local tokens i (positions cp_position(at, seq, i)); masked: key
// position > query position when causal. qkv: [batch, seq/ranks, row()] as tile_attention_forward's; y: [batch,
// seq/ranks, width]; lse: ring_attention_saved_size floats [batch, heads, seq/ranks], for backward; workspace:
// ring_attention_workspace_size elements. cp: the ring (null or one rank: the whole sequence is local, and this is
// tile attention). Each step attends the local queries to the key block at hand with tile attention's kernels and
// folds its output into the running one by the log-sum-exps; the blocks come round the ring, or with at.all_gather
// from one all-gather before the first. doc (packed sequences; null: one document a row): for each local token
// [batch, seq/ranks] the position in the whole sequence its document starts at (causal only). Collective over cp:
// every rank of the ring calls it with the same shape.
template <execution_space S, float_like T>
void ring_attention_forward(const ring_attention_shape& s, const cp_layout& at, rank_group* cp, const T* qkv, T* y,
                            float* lse, T* workspace, const std::int64_t* doc = nullptr) {
  constexpr const char* what = "dml::nn::ring_attention_forward";
  detail::check_ring_call(what, s, at, cp);
  detail::check_attention_pointer(what, "qkv", qkv);
  detail::check_attention_pointer(what, "y", y);
  detail::check_attention_pointer(what, "lse", lse);
  detail::check_attention_pointer(what, "workspace", workspace);
  const auto z = detail::ring_parts_of(s, at);
  const std::int64_t n = z.local, ld = s.row(), kw = 2 * s.kv() * s.head_dim;
  const auto ts = detail::ring_step_shape(s, n);
  if (!z.ring) {
    detail::tile_forward<S>(ts, qkv, y, lse, kernels::attention_mask{doc, n, s.causal});
    return;
  }
  detail::ring_carver carve{reinterpret_cast<std::byte*>(workspace)};
  float* acc = carve.take<float>(z.out);
  float* step_lse = carve.take<float>(z.rows);
  T* step_y = carve.take<T>(z.out);
  T* kv[2] = {};
  T* all = z.gather ? carve.take<T>(z.ranks * z.kv) : nullptr;  // every rank's K/V, in rank order
  if (!z.gather) kv[0] = carve.take<T>(z.kv), kv[1] = carve.take<T>(z.kv);
  T* stage = carve.take<T>(z.qkv);
  fill_n<S>(lse, z.rows, kernels::attention_no_key);
  fill_n<S>(acc, z.out, 0.f);
  const auto qr = kernels::cp_runs_of(at, s.seq);
  const int ranks = at.ranks, next = (at.rank + 1) % ranks, prev = (at.rank + ranks - 1) % ranks;
  // This rank's K/V packed [batch, local, 2·kv_heads·head_dim]: the ring's first block, or what the all-gather sends
  // (from the stage, free until the second step).
  detail::token_rows<S>(s.batch * n, kw, kernels::ring_columns<T>{qkv + s.width(), z.gather ? stage : kv[0], kw, ld, kw, false});
  if (z.gather) cp->all_gather(const_typed_ptr(static_cast<const T*>(stage)), typed_ptr(all), z.kv);
  bool staged = false;  // the stage's q columns hold the local queries
  for (int step = 0; step < ranks; ++step) {
    const int cur = step % 2;
    // The next block is on its way while this one is used: post both transfers before computing.
    group_request both;
    if (!z.gather && step + 1 < ranks)
      both = cp->isendrecv(static_cast<const T*>(kv[cur]), next, kv[1 - cur], prev, z.kv, detail::ring_forward_tag + step);
    const cp_layout from{.ranks = ranks, .rank = (at.rank - step + ranks) % ranks, .zigzag = at.zigzag};
    const T* block = z.gather ? all + from.rank * z.kv : kv[cur];
    const auto kr = kernels::cp_runs_of(from, s.seq);
    if (detail::ring_block_visible(qr, kr, s.causal)) {
      if (step > 0) {
        detail::ring_stage<S>(s, n, qkv, block, stage, !staged);
        staged = true;
      }
      detail::tile_forward<S>(ts, step == 0 ? qkv : static_cast<const T*>(stage), step_y, step_lse,
                              detail::ring_step_mask(s, n, qr, kr, doc));
      for_each_row<S>(z.rows, kernels::ring_merge<T>{step_y, step_lse, acc, lse, n, s.heads, s.head_dim}, s.head_dim);
    }
    both.wait();
  }
  for_each_index<S>(z.out, kernels::ring_to_t<T>{acc, y});
}

// Gradients of ring_attention_forward, recomputing each step's probabilities from lse (tile attention's backward
// with D = rowsum(dy ⊙ y) of the whole rows). dy: [batch, seq/ranks, width]; writes (overwrites) dqkv [batch,
// seq/ranks, row()]. K/V travel the ring again with their dK/dV accumulators, which come back to their owner after a
// full turn; or with at.all_gather K/V are gathered again and each block's dK/dV reduce-scattered to its owner at
// the end. dQ accumulates in place. doc as forward's.
template <execution_space S, float_like T>
void ring_attention_backward(const ring_attention_shape& s, const cp_layout& at, rank_group* cp, const T* qkv,
                             const T* y, const float* lse, const T* dy, T* dqkv, T* workspace,
                             const std::int64_t* doc = nullptr) {
  constexpr const char* what = "dml::nn::ring_attention_backward";
  detail::check_ring_call(what, s, at, cp);
  detail::check_attention_pointer(what, "qkv", qkv);
  detail::check_attention_pointer(what, "y", y);
  detail::check_attention_pointer(what, "lse", lse);
  detail::check_attention_pointer(what, "dy", dy);
  detail::check_attention_pointer(what, "dqkv", dqkv);
  detail::check_attention_pointer(what, "workspace", workspace);
  const auto z = detail::ring_parts_of(s, at);
  const std::int64_t n = z.local, ld = s.row(), qw = s.width(), kw = 2 * s.kv() * s.head_dim;
  const auto ts = detail::ring_step_shape(s, n);
  detail::ring_carver carve{reinterpret_cast<std::byte*>(workspace)};
  float* dot = carve.take<float>(z.rows);
  float* dq = carve.take<float>(z.out);
  for_each_row<S>(z.rows, detail::tile_backward_dot<T>{ts, y, dy, dot}, s.head_dim);
  if (!z.ring) {
    detail::tile_backward<S>(ts, qkv, lse, dot, dy, dqkv, dq, kernels::attention_mask{doc, n, s.causal});
    return;
  }
  const int ranks = at.ranks, next = (at.rank + 1) % ranks, prev = (at.rank + ranks - 1) % ranks;
  T* kv[2] = {};
  T* dkv[2] = {};
  T* all = nullptr;   // all-gathered: every rank's K/V, in rank order
  T* dall = nullptr;  // and the dK/dV of each rank's block, in rank order (the reduce-scatter's input)
  if (z.gather) {
    all = carve.take<T>(z.ranks * z.kv);
    dall = carve.take<T>(z.ranks * z.kv);
    dkv[0] = carve.take<T>(z.kv);
  } else {
    kv[0] = carve.take<T>(z.kv), kv[1] = carve.take<T>(z.kv);
    dkv[0] = carve.take<T>(z.kv), dkv[1] = carve.take<T>(z.kv);
  }
  T* stage = carve.take<T>(z.qkv);
  T* dstage = carve.take<T>(z.qkv);
  const auto qr = kernels::cp_runs_of(at, s.seq);
  const std::int64_t rows = s.batch * n;
  fill_n<S>(dqkv, rows * ld, T(0.f));
  detail::token_rows<S>(rows, kw, kernels::ring_columns<T>{qkv + qw, z.gather ? dkv[0] : kv[0], kw, ld, kw, false});
  if (z.gather) {
    cp->all_gather(const_typed_ptr(static_cast<const T*>(dkv[0])), typed_ptr(all), z.kv);
    fill_n<S>(dall, z.ranks * z.kv, T(0.f));
  } else {
    fill_n<S>(dkv[0], z.kv, T(0.f));
  }
  bool staged = false;  // the stage's q columns hold the local queries
  for (int step = 0; step < ranks; ++step) {
    const int cur = step % 2;
    const int kv_tag = detail::ring_backward_tag + 2 * step, dkv_tag = kv_tag + 1;
    group_request kv_both;
    // K/V go on before this block is used; dK/dV can leave only once this rank has added to them, so they
    // travel after the block, each rank sending and receiving at once. After a full turn (the last step) the
    // accumulators arrive back at their owner: this rank's own lands in dkv[1 - cur].
    if (!z.gather && step + 1 < ranks)
      kv_both = cp->isendrecv(static_cast<const T*>(kv[cur]), next, kv[1 - cur], prev, z.kv, kv_tag);
    const cp_layout from{.ranks = ranks, .rank = (at.rank - step + ranks) % ranks, .zigzag = at.zigzag};
    const T* block = z.gather ? all + from.rank * z.kv : kv[cur];
    T* dblock = z.gather ? dall + from.rank * z.kv : dkv[cur];
    const auto kr = kernels::cp_runs_of(from, s.seq);
    if (detail::ring_block_visible(qr, kr, s.causal)) {
      if (step > 0) {
        detail::ring_stage<S>(s, n, qkv, block, stage, !staged);
        staged = true;
      }
      detail::tile_backward<S>(ts, step == 0 ? qkv : static_cast<const T*>(stage), lse, dot, dy, dstage, dq,
                               detail::ring_step_mask(s, n, qr, kr, doc));
      detail::token_rows<S>(rows, qw, kernels::ring_columns<T>{dstage, dqkv, qw, ld, ld, true});
      detail::token_rows<S>(rows, kw, kernels::ring_columns<T>{dstage + qw, dblock, kw, ld, kw, true});
    }
    if (z.gather) continue;
    group_request dkv_both = cp->isendrecv(static_cast<const T*>(dkv[cur]), next, dkv[1 - cur], prev, z.kv, dkv_tag);
    kv_both.wait();
    dkv_both.wait();
  }
  // This rank's dK/dV: the sum of every rank's gradient of its block (reduce-scattered), or the accumulator back
  // from its full turn.
  if (z.gather) cp->reduce_scatter(const_typed_ptr(static_cast<const T*>(dall)), typed_ptr(dkv[0]), z.kv);
  const T* mine = z.gather ? dkv[0] : dkv[ranks % 2];
  detail::token_rows<S>(rows, kw, kernels::ring_columns<T>{mine, dqkv + qw, kw, kw, ld, false});
}

}  // namespace dml::nn
