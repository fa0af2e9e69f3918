// SPDX-License-Identifier: Apache-2.0
// dml/nn/detail/gpt_common.hpp — what nn::gpt's layers share: the element kernels (dropout keyed by the token's
// place in the global batch, embedding lookups and their gradients) and the tensor-parallel plumbing (split_part).
// Sits on nn/layer.hpp, nn/rank_group.hpp, nn/detail/rows.hpp and core/rng.hpp; used by nn/gpt.hpp and
// nn/detail/gpt_block.hpp.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/rng.hpp"
#include "dml/nn/detail/rows.hpp"
#include "dml/nn/layer.hpp"
#include "dml/nn/rank_group.hpp"

namespace dml::nn {

namespace kernels {
// Inverted dropout keyed by the element's place in the global batch: global token row g, column j.
struct token_dropout {
  rng_stream rng;
  float keep;              // 1: no dropout
  std::uint64_t first_row; // global token row of local row 0 (context parallel: of the micro-batch's first token)
  std::int64_t n;          // columns
  // Context parallelism: local rows are chunks of each sequence's positions (t_local of seq per sequence),
  // starting at local token row local_first.
  context_split cp{};
  std::int64_t t_local = 0, seq = 0, local_first = 0;
  DML_HOST_DEVICE std::uint64_t global_row(std::int64_t r) const {
    if (cp.ranks <= 1) return first_row + static_cast<std::uint64_t>(r);
    const std::int64_t lt = local_first + r;
    return first_row + static_cast<std::uint64_t>(lt / t_local * seq + cp_position(cp, seq, lt % t_local));
  }
  // Local row r's key: scale_at(row_key(r), j) is the scale of element (r, j), found without a division.
  DML_HOST_DEVICE std::uint64_t row_key(std::int64_t r) const { return global_row(r) * static_cast<std::uint64_t>(n); }
  DML_HOST_DEVICE float scale_at(std::uint64_t key, std::int64_t j) const {
    if (keep >= 1.f) return 1.f;
    return rng.uniform(key + static_cast<std::uint64_t>(j)) < keep ? 1.f / keep : 0.f;
  }
  DML_HOST_DEVICE float scale(std::int64_t i) const { return keep >= 1.f ? 1.f : scale_at(row_key(i / n), i % n); }
  // body(j, scale of (r, j)) for the n columns of local row r; without dropout the scale is the constant 1 and
  // the loop vectorises (a test of keep per column kept it scalar).
  template <class Body>
  DML_HOST_DEVICE void each_column(std::int64_t r, Body body) const {
    if (keep >= 1.f) {
      DML_SIMD
      for (std::int64_t j = 0; j < n; ++j) body(j, 1.f);
      return;
    }
    const std::uint64_t key = row_key(r);
    DML_SIMD
    for (std::int64_t j = 0; j < n; ++j) body(j, scale_at(key, j));
  }
};
// out = residual + dropout(branch + bias): the end of each half-block (and the embeddings' sum).
template <class T>
struct residual_dropout {
  const T *residual, *branch, *bias;  // residual, bias may be null
  T* out;
  token_dropout drop;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const float v = static_cast<float>(branch[i]) + (bias ? static_cast<float>(bias[i % drop.n]) : 0.f);
    out[i] = T((residual ? static_cast<float>(residual[i]) : 0.f) + v * drop.scale(i));
  }
  // Local row r whole, as its elements' calls would (the same values).
  DML_HOST_DEVICE void row(std::int64_t r) const {
    const std::int64_t o = r * drop.n;
    const T *b = branch + o, *res = residual ? residual + o : nullptr, *c = bias;
    T* y = out + o;
    drop.each_column(r, [=](std::int64_t j, float s) {
      const float v = static_cast<float>(b[j]) + (c ? static_cast<float>(c[j]) : 0.f);
      y[j] = T((res ? static_cast<float>(res[j]) : 0.f) + v * s);
    });
  }
};
template <class T>
struct dropout_grad {
  const T* dy;
  T* out;
  token_dropout drop;
  DML_HOST_DEVICE void operator()(std::int64_t i) const { out[i] = T(static_cast<float>(dy[i]) * drop.scale(i)); }
  DML_HOST_DEVICE void row(std::int64_t r) const {
    const T* d = dy + r * drop.n;
    T* y = out + r * drop.n;
    drop.each_column(r, [=](std::int64_t j, float s) { y[j] = T(static_cast<float>(d[j]) * s); });
  }
};
// Where local token row `token` of a micro-batch sits: its position in its sequence, and its index in the
// ids [batch, seq]. Under context parallelism a rank holds t_local = seq / cp positions of each sequence.
struct token_place {
  std::int64_t seq, t_local;
  context_split cp{};
  DML_HOST_DEVICE std::int64_t position(std::int64_t token) const { return cp_position(cp, seq, token % t_local); }
  DML_HOST_DEVICE std::int64_t id_index(std::int64_t token) const { return token / t_local * seq + position(token); }
};
// y[t, j] = (wte rows this rank holds)[id_t, j] (0 for ids outside them) + wpe[pos_t, j], positions and
// ids read for local rows; wpe may be null (added after the reduction).
template <class T>
struct embed_tokens {
  const float* ids;
  const T *wte, *wpe;
  T* y;
  std::int64_t n, first_id, ids_held;
  std::int64_t first_token;                 // token row of y's row 0 within the micro-batch
  token_place at;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t t = i / n, j = i % n, token = first_token + t;
    const std::int64_t id = static_cast<std::int64_t>(ids[at.id_index(token)]) - first_id;
    float v = id >= 0 && id < ids_held ? static_cast<float>(wte[id * n + j]) : 0.f;
    if (wpe) v += static_cast<float>(wpe[at.position(token) * n + j]);
    y[i] = T(v);
  }
  // Local token row t whole, as (t·n .. t·n + n − 1) would: its id and position found once, the columns contiguous.
  DML_HOST_DEVICE void row(std::int64_t t) const {
    const std::int64_t token = first_token + t;
    const std::int64_t id = static_cast<std::int64_t>(ids[at.id_index(token)]) - first_id;
    const T* w = id >= 0 && id < ids_held ? wte + id * n : nullptr;
    const T* p = wpe ? wpe + at.position(token) * n : nullptr;
    T* out = y + t * n;
    DML_SIMD
    for (std::int64_t j = 0; j < n; ++j) {
      float v = w ? static_cast<float>(w[j]) : 0.f;
      if (p) v += static_cast<float>(p[j]);
      out[j] = round_to<T>(v);
    }
  }
};
// y = dropout(sum + wpe[position]) for local token rows (sum may be y).
template <class T>
struct add_positions {
  const T *sum, *wpe;
  T* y;
  std::int64_t n, first_token;
  token_place at;
  token_dropout drop;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t pos = at.position(first_token + i / n);
    y[i] = T((static_cast<float>(sum[i]) + static_cast<float>(wpe[pos * n + i % n])) * drop.scale(i));
  }
  DML_HOST_DEVICE void row(std::int64_t t) const {
    const T *p = wpe + at.position(first_token + t) * n, *x = sum + t * n;
    T* out = y + t * n;
    drop.each_column(t, [=](std::int64_t j, float s) {
      out[j] = T((static_cast<float>(x[j]) + static_cast<float>(p[j])) * s);
    });
  }
};
// dwte rows this rank holds, one column per call: Σ over tokens with that id.
template <class T>
struct embed_wte_grad {
  const float* ids;
  const T* dy;
  T* dw;
  std::int64_t tokens, n, first_id, ids_held;
  bool accumulate;
  token_place at;
  DML_HOST_DEVICE void operator()(std::int64_t j) const {
    if (!accumulate)
      for (std::int64_t r = 0; r < ids_held; ++r) dw[r * n + j] = T(0.f);
    for (std::int64_t t = 0; t < tokens; ++t) {
      const std::int64_t id = static_cast<std::int64_t>(ids[at.id_index(t)]) - first_id;
      if (id < 0 || id >= ids_held) continue;
      T& g = dw[id * n + j];
      g = T(static_cast<float>(g) + static_cast<float>(dy[t * n + j]));
    }
  }
};
// dwpe[pos, j] (+)= Σ over local token rows at that position; one (pos, j) per call.
template <class T>
struct embed_wpe_grad {
  const T* dy;
  T* dw;
  std::int64_t rows, n, first_token;
  token_place at;
  bool accumulate;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t pos = i / n, j = i % n, t = at.t_local;
    float s = accumulate ? static_cast<float>(dw[i]) : 0.f;
    // Local index k of the position in each sequence (−1: another rank's); row r holds token first_token + r.
    const std::int64_t k = pos < at.seq ? cp_local_index(at.cp, at.seq, pos) : -1;
    if (k >= 0)
      for (std::int64_t r = ((k - first_token) % t + t) % t; r < rows; r += t) s += static_cast<float>(dy[r * n + j]);
    dw[i] = T(s);
  }
  // Row pos of dw (the host's form): the position found once, every column's sum over the same rows in the same
  // order, by column blocks so the inner loop is contiguous.
  DML_HOST_DEVICE void row(std::int64_t pos) const {
    const std::int64_t t = at.t_local, k = pos < at.seq ? cp_local_index(at.cp, at.seq, pos) : -1;
    const std::int64_t r0 = k >= 0 ? ((k - first_token) % t + t) % t : rows;
    T* d = dw + pos * n;
    for (std::int64_t j0 = 0; j0 < n; j0 += column_block)
      sum_rows_block(dy, n, r0, t, rows, d, j0, n - j0 < column_block ? n - j0 : column_block, accumulate);
  }
};
}  // namespace kernels

namespace detail {
// dwte: on the device a column per thread (embed_wte_grad); on the host blocks of columns, each adding the tokens'
// rows in token order (every entry's sum runs over the tokens in the functor's order), the inner loop contiguous.
template <execution_space S, class T>
void embed_wte_grad_rows(const kernels::embed_wte_grad<T>& f) {
  if constexpr (!std::same_as<S, host>) {
    for_each_index<S>(f.n, f);
  } else {
    // Column blocks (one token's row adds into its id's row; ids in token order, as the functor's loop).
    for_each_column_block(f.n, f.tokens, [f](std::int64_t j0, std::int64_t width) {
      if (!f.accumulate)
        for (std::int64_t r = 0; r < f.ids_held; ++r) std::fill_n(f.dw + r * f.n + j0, width, T(0.f));
      for (std::int64_t t = 0; t < f.tokens; ++t) {
        const std::int64_t id = static_cast<std::int64_t>(f.ids[f.at.id_index(t)]) - f.first_id;
        if (id < 0 || id >= f.ids_held) continue;
        T* g = f.dw + id * f.n + j0;
        const T* d = f.dy + t * f.n + j0;
        DML_SIMD
        for (std::int64_t j = 0; j < width; ++j) g[j] = round_to<T>(static_cast<float>(g[j]) + static_cast<float>(d[j]));
      }
    });
  }
}

// The tensor-parallel plumbing every GPT layer shares.
struct split_part {
  tensor_split split{};

  int ranks() const { return split.ranks; }
  bool sequence() const { return split.sequence && split.ranks > 1; }
  // A [rows, cols] parameter split along `axis` in `blocks` blocks (a whole one when ranks == 1).
  param_shard shard(std::int64_t rows, std::int64_t cols, int axis, int blocks = 1) const {
    return {.rows = rows, .cols = cols, .axis = axis, .blocks = blocks, .rank = split.rank, .ranks = split.ranks};
  }
  static void check_divides(const char* kind, const char* what, std::int64_t n, int ranks) {
    if (ranks > 1 && n % ranks != 0)
      fail<invalid_argument>("dml::nn::", kind, ": tensor parallelism over ", ranks, " ranks needs ", what,
                             " divisible by ", ranks, ", found ", n);
  }
  void check_split(const char* kind) const {
    if (split.ranks < 1 || split.rank < 0 || split.rank >= split.ranks)
      fail<invalid_argument>("dml::nn::", kind, ": expected 0 <= rank < ranks, found rank ", split.rank, " of ", split.ranks);
  }
  static void check_group(const char* kind, const context& c, int ranks) {
    if (ranks > 1 && (!c.tp || c.tp->size() != ranks))
      fail<invalid_argument>("dml::nn::", kind, ": split over ", ranks, " tensor-parallel ranks but the context's group has ",
                             c.tp ? c.tp->size() : 0, " (a trainer with tensor parallelism sets it)");
  }
  // A KV cache (context::kv) serves one rank's whole model on the host.
  template <execution_space S>
  void check_cache(const char* kind, const context& c, int context_ranks) const {
    if (c.kv && (!std::same_as<S, host> || split.ranks > 1 || context_ranks > 1))
      fail<invalid_argument>("dml::nn::", kind, ": a KV cache decodes one rank's whole model on the host, found ",
                             std::same_as<S, host> ? "host" : "device", " space, tensor parallelism over ", split.ranks,
                             " and context parallelism over ", context_ranks, " ranks");
  }
  // Full rows from this rank's token rows (sequence parallel: all-gather); otherwise `part` already is.
  template <class T>
  const T* gather(const context& c, const T* part, T* full, std::int64_t n) const {
    if (!sequence()) return part;
    c.tp->all_gather(const_typed_ptr(part), typed_ptr(full), n);
    return full;
  }
  // Sums a partial [N, cols] result over the group: into `part` rows (sequence parallel: reduce-scatter),
  // else in place; returns where the sum is.
  template <class T>
  T* reduce(const context& c, T* full, T* part, std::int64_t part_n) const {
    if (sequence()) {
      c.tp->reduce_scatter(const_typed_ptr(full), typed_ptr(part), part_n);
      return part;
    }
    if (split.ranks > 1) c.tp->all_reduce(typed_ptr(full), part_n);
    return full;
  }
};

inline rng_stream dropout_stream(const context& c, std::uint64_t which) {
  return {c.seed ^ (0x9e3779b97f4a7c15ull * (which + 1)), (c.step << 16) ^ c.layer};
}
// Dropout `which` of a layer whose local token rows start at `first` of the micro-batch's rows, sequences of
// t tokens of which this rank holds t_local (context parallel: a chunk of positions; else t_local == t).
inline kernels::token_dropout token_dropout_of(const context& c, std::uint64_t which, float p, std::int64_t t,
                                               std::int64_t t_local, std::int64_t first, std::int64_t n, context_split cp) {
  kernels::token_dropout d{dropout_stream(c, which), c.training ? 1.f - p : 1.f,
                           static_cast<std::uint64_t>(c.row_offset * t + (cp.ranks > 1 ? 0 : first)), n};
  d.cp = cp;
  d.t_local = t_local;
  d.seq = t;
  d.local_first = first;
  return d;
}
}  // namespace detail

}  // namespace dml::nn
