// SPDX-License-Identifier: Apache-2.0
// dml/nn/gpt.hpp — a GPT as a layer sequence: embeddings, a stack of pre-LayerNorm blocks, a final LayerNorm
// and LM head; each layer also runs as one rank's part of Megatron tensor (and sequence) parallelism.
// Sits on nn/attention.hpp, nn/tensor_group.hpp and core/gemm.hpp; nn::gpt(config) builds the sequential.
//
// Parameter names and layouts are nanoGPT's state dict without its "transformer." prefix (wte.weight,
// h.{i}.attn.c_attn.weight, ...; Linear weights [out, in]), so weights move to PyTorch and back.
//
// Tensor parallelism (split.ranks = p): c_attn and c_fc are column-parallel (heads, and 4C, split), c_proj
// row-parallel, the embedding and LM head vocabulary-parallel; each half-block makes one all-reduce in
// forward and one in backward. Sequence parallelism (split.sequence): between those regions a rank holds
// rows [r·N/p, (r+1)·N/p) of the micro-batch's N = B·T tokens, carried as shape [B, T/p, C]; all-gathers
// and reduce-scatters replace the all-reduces, and LayerNorm, dropout and residuals run on 1/p of the tokens.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/gemm.hpp"
#include "dml/core/rng.hpp"
#include "dml/nn/activation.hpp"
#include "dml/nn/attention.hpp"
#include "dml/nn/detail/rows.hpp"
#include "dml/nn/layer.hpp"
#include "dml/nn/layernorm.hpp"
#include "dml/nn/moe.hpp"
#include "dml/nn/ring_attention.hpp"
#include "dml/nn/sequential.hpp"

namespace dml::nn {

struct gpt_config {
  std::int64_t vocab = 256;    // byte-level text: 256
  std::int64_t seq = 256;      // the longest sequence (wpe's rows)
  std::int64_t layers = 2;
  std::int64_t d_model = 128;
  std::int64_t heads = 4;
  float dropout = 0.f;         // after the embeddings and on both residual branches, as nanoGPT
  bool bias = false;           // biases in every Linear but lm_head, and in the LayerNorms (nanoGPT's bias=False)
  bool tie_weights = false;    // lm_head.weight tied to wte.weight (nanoGPT, GPT-2)
  float eps = 1e-5f;
  // Mixture of experts: with experts > 0, blocks moe_every−1, 2·moe_every−1, … replace their MLP with nn::moe:
  // experts MLPs of width 4C, each token routed to its top_k; capacity_factor <= 0: dropless.
  std::int64_t experts = 0;
  int top_k = 2;
  float capacity_factor = 1.25f;
  std::int64_t moe_every = 1;
  float aux_loss_weight = 0.01f, z_loss_weight = 0.001f;
  float router_skew = 0.f;  // > 0: skewed routing on purpose, nn::skewed_logit_bias(experts, 1, router_skew)
};


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
  DML_HOST_DEVICE float scale(std::int64_t i) const {
    if (keep >= 1.f) return 1.f;
    const std::uint64_t row = global_row(i / n);
    return rng.uniform(row * static_cast<std::uint64_t>(n) + static_cast<std::uint64_t>(i % n)) < keep ? 1.f / keep : 0.f;
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
};
template <class T>
struct dropout_grad {
  const T* dy;
  T* out;
  token_dropout drop;
  DML_HOST_DEVICE void operator()(std::int64_t i) const { out[i] = T(static_cast<float>(dy[i]) * drop.scale(i)); }
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
};
}  // namespace kernels

namespace detail {
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

// Token and position embeddings, then dropout: ids [B, T] (floats) → [B, T, C] ([B, T/p, C] sequence-parallel).
// wte is vocabulary-parallel: a rank holds rows [r·V/p, (r+1)·V/p), looks up the ids it holds and the group
// sums (one all-reduce, or reduce-scatter under sequence parallelism).
struct gpt_embedding : detail::split_part {
  static constexpr std::int64_t static_in = dynamic;
  static constexpr std::int64_t static_out = dynamic;
  static constexpr const char* kind = "gpt_embedding";
  static constexpr bool float_input = true;
  static constexpr bool uses_row_index = true;
  std::string prefix;  // parameters are "wte.weight", "wpe.weight"
  std::int64_t vocab = 0, seq = 0, dim = 0;
  float dropout = 0.f;
  context_split cp{};  // context parallel: the ids are whole sequences, the output this rank's chunk of them

  explicit gpt_embedding(const gpt_config& g) : vocab(g.vocab), seq(g.seq), dim(g.d_model), dropout(g.dropout) {
    if (vocab <= 0 || seq <= 0 || dim <= 0)
      fail<invalid_argument>("dml::nn::gpt_embedding: sizes must be positive, found vocab ", vocab, ", seq ", seq, ", d_model ", dim);
  }
  void set_split(tensor_split s) {
    split = s;
    check_split(kind);
    check_divides(kind, "the vocabulary", vocab, s.ranks);
  }
  void set_context_split(context_split s) { cp = s; }
  std::int64_t input_width() const { return seq; }

  std::vector<param_spec> parameters() const {
    // nanoGPT: normal(0, 0.02) for both tables.
    const std::int64_t v = vocab / ranks();
    return {{"wte.weight", {v, dim}, init_kind::normal, 0.f, 0.02f, shard(vocab, dim, 0)},
            {"wpe.weight", {seq, dim}, init_kind::normal, 0.f, 0.02f, {}, sequence()}};
  }
  dml::shape output_shape(dml::shape x) const {
    if (x.rank != 2 || x[1] < 1 || x[1] > seq)
      fail<shape_error>("dml::nn::gpt_embedding: expected token ids [batch, T] with 1 <= T <= ", seq, ", found shape ", x);
    const std::int64_t chunks = cp.ranks * (cp.zigzag && cp.ranks > 1 ? 2 : 1);
    if (x[1] % chunks != 0)
      fail<shape_error>("dml::nn::gpt_embedding: context parallelism over ", cp.ranks, " ranks", cp.zigzag ? " (zig-zag)" : "",
                        " needs T divisible by ", chunks, ", found T = ", x[1]);
    const std::int64_t t = x[1] / cp.ranks;
    if (sequence() && t % ranks() != 0)
      fail<shape_error>("dml::nn::gpt_embedding: sequence parallelism over ", ranks(), " ranks needs T",
                        cp.ranks > 1 ? " / cp" : "", " divisible by ", ranks(), ", found ", t);
    return {x[0], sequence() ? t / ranks() : t, dim};
  }
  // Forward sums every token's lookups there (tensor parallel); backward keeps the dropout gradient of this
  // rank's rows, and every token's under sequence parallelism.
  std::int64_t workspace_size(dml::shape x) const { return x.numel() / cp.ranks * dim * (sequence() ? 2 : 1); }

  template <execution_space S, class Id, class T>
  void forward(const context& c, layer_params<T> p, tensor_view<const Id, S> x, tensor_view<T, S> y) const {
    static_assert(std::same_as<Id, float>, "dml::nn::gpt_embedding: ids arrive as floats");
    check_group(kind, c, ranks());
    if constexpr (std::same_as<S, host>) check_ids(x);
    const std::int64_t tokens = x.numel() / cp.ranks, mine = y.rows(), first_id = vocab / ranks() * split.rank;
    const auto drop = dropout_of(c, x.shape[1], y.shape);
    const auto at = place(x.shape[1]);
    if (ranks() == 1) {
      for_each_index<S>(mine * dim, kernels::embed_tokens<T>{x.data, p.w[0], p.w[1], y.data, dim, 0, vocab, 0, at});
      if (drop.keep < 1.f) for_each_index<S>(mine * dim, kernels::residual_dropout<T>{nullptr, y.data, nullptr, y.data, drop});
      return;
    }
    // Each rank looks up the ids it holds for every token; the group sums; positions and dropout follow.
    T* full = reinterpret_cast<T*>(c.workspace);
    for_each_index<S>(tokens * dim, kernels::embed_tokens<T>{x.data, p.w[0], nullptr, full, dim, first_id, vocab / ranks(), 0, at});
    const T* sum = reduce(c, full, y.data, mine * dim);
    const std::int64_t first_token = sequence() ? mine * split.rank : 0;
    for_each_index<S>(mine * dim, kernels::add_positions<T>{sum, p.w[1], y.data, dim, first_token, at, drop});
  }
  template <execution_space S, class Id, class T, class Dx>
  void backward(const context& c, layer_params<T> p, tensor_view<const Id, S> x, tensor_view<const T, S>,
                tensor_view<const T, S> dy, tensor_view<Dx, S>) const {
    const std::int64_t tokens = x.numel() / cp.ranks, mine = dy.rows(), first_id = vocab / ranks() * split.rank;
    const std::int64_t first_token = sequence() ? mine * split.rank : 0;
    const auto drop = dropout_of(c, x.shape[1], dy.shape);
    const auto at = place(x.shape[1]);
    // The gradient of the sum before dropout, this rank's token rows; then every token's (sequence parallel).
    T* d = reinterpret_cast<T*>(c.workspace);
    T* mine_d = sequence() ? d + tokens * dim : d;
    for_each_index<S>(mine * dim, kernels::dropout_grad<T>{dy.data, mine_d, drop});
    for_each_index<S>(seq * dim, kernels::embed_wpe_grad<T>{mine_d, p.g[1], mine, dim, first_token, at, c.accumulate});
    const T* all = gather(c, static_cast<const T*>(mine_d), d, mine * dim);
    for_each_index<S>(dim, kernels::embed_wte_grad<T>{x.data, all, p.g[0], tokens, dim, first_id, vocab / ranks(), c.accumulate, at});
  }

 private:
  kernels::token_dropout dropout_of(const context& c, std::int64_t t, const dml::shape& y) const {
    const std::int64_t first = sequence() ? y.rows() * split.rank : 0;
    return detail::token_dropout_of(c, 0, dropout, t, t / cp.ranks, first, dim, cp);
  }
  kernels::token_place place(std::int64_t t) const { return {t, t / cp.ranks, cp}; }
  template <class Id>
  void check_ids(tensor_view<const Id, host> x) const {
    for (std::int64_t t = 0; t < x.numel(); ++t) {
      const float id = static_cast<float>(x.data[t]);
      if (!(id >= 0.f && id < static_cast<float>(vocab)) || id != static_cast<float>(static_cast<std::int64_t>(id)))
        fail<invalid_argument>("dml::nn::gpt_embedding: expected integer token ids in [0, ", vocab, "), found ", id,
                               " at position ", t);
    }
  }
};

// Sizes of one call of a block or head on input [B, T or T/p, C].
struct gpt_dims {
  std::int64_t b = 0, t = 0, n = 0, n_local = 0;  // sequences, tokens per sequence, tokens, this rank's token rows
};

// A pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)), dropout on both branches.
// Heads are split over the tensor group (c_attn column-parallel, c_proj row-parallel), and so is the MLP's
// 4C (c_fc column-parallel, c_proj row-parallel).
struct gpt_block : detail::split_part {
  static constexpr std::int64_t static_in = dynamic;
  static constexpr std::int64_t static_out = dynamic;
  static constexpr bool preserves_width = true;
  static constexpr bool uses_row_index = true;
  static constexpr const char* kind = "gpt_block";
  std::int64_t dim = 0, heads = 0, layers = 1;
  float dropout = 0.f, eps = 1e-5f;
  bool bias = false;
  context_split cp{};  // context parallel: attention is ring attention over the context group
  // A mixture of experts in place of the MLP (its parameters are "mlp.router.weight", "mlp.experts.…").
  std::optional<nn::moe> experts;

  // with_experts: this block's MLP is a mixture of g.experts experts.
  explicit gpt_block(const gpt_config& g, bool with_experts = false)
      : dim(g.d_model), heads(g.heads), layers(g.layers), dropout(g.dropout), eps(g.eps), bias(g.bias) {
    if (dim <= 0 || heads <= 0 || dim % heads != 0)
      fail<invalid_argument>("dml::nn::gpt_block: expected d_model a positive multiple of heads, found d_model ", dim,
                             " and heads ", heads);
    if (with_experts)
      experts.emplace(moe_config{.dim = dim, .hidden = 4 * dim, .experts = g.experts, .top_k = g.top_k,
                                 .capacity_factor = g.capacity_factor, .aux_loss_weight = g.aux_loss_weight,
                                 .z_loss_weight = g.z_loss_weight, .bias = bias,
                                 .proj_std = 0.02f / std::sqrt(2.f * static_cast<float>(layers)),
                                 .logit_bias = g.router_skew > 0.f ? skewed_logit_bias(g.experts, 1.0, g.router_skew)
                                                                   : std::vector<float>{}});
  }
  void set_split(tensor_split s) {
    split = s;
    check_split(kind);
    check_divides(kind, "the heads", heads, s.ranks);
    if (experts) experts->set_split(s);  // experts stay whole on every tensor rank
    else check_divides(kind, "4·d_model", 4 * dim, s.ranks);
  }
  void set_expert_split(int ranks, int rank) {
    if (experts) experts->set_expert_split(ranks, rank);
  }
  void set_context_split(context_split s) { cp = s; }

  std::vector<param_spec> parameters() const {
    const std::int64_t c = dim, p = ranks();
    const float std_proj = 0.02f / std::sqrt(2.f * static_cast<float>(layers));  // nanoGPT's scaled residual init
    const bool sp = sequence();
    std::vector<param_spec> out;
    auto norm = [&](const char* name) {
      out.push_back({std::string(name) + ".weight", {c}, init_kind::ones, 0.f, 0.f, {}, sp});
      if (bias) out.push_back({std::string(name) + ".bias", {c}, init_kind::zeros, 0.f, 0.f, {}, sp});
    };
    auto column = [&](const char* name, std::int64_t width, int blocks) {
      out.push_back({std::string(name) + ".weight", {width / p, c}, init_kind::normal, 0.f, 0.02f, shard(width, c, 0, blocks)});
      if (bias) out.push_back({std::string(name) + ".bias", {width / p}, init_kind::zeros, 0.f, 0.f, shard(width, 1, 0, blocks)});
    };
    auto row = [&](const char* name, std::int64_t width) {
      out.push_back({std::string(name) + ".weight", {c, width / p}, init_kind::normal, 0.f, std_proj, shard(c, width, 1)});
      if (bias) out.push_back({std::string(name) + ".bias", {c}, init_kind::zeros, 0.f, 0.f, {}, sp});
    };
    norm("ln_1");
    column("attn.c_attn", 3 * c, 3);
    row("attn.c_proj", c);
    norm("ln_2");
    if (experts) {
      for (auto spec : experts->parameters()) {
        spec.name = "mlp." + spec.name;
        out.push_back(std::move(spec));
      }
      return out;
    }
    column("mlp.c_fc", 4 * c, 1);
    row("mlp.c_proj", 4 * c);
    return out;
  }
  dml::shape output_shape(dml::shape x) const {
    if (x.rank != 3 || x[2] != dim)
      fail<shape_error>("dml::nn::gpt_block: expected [batch, T, ", dim, "], found shape ", x);
    return x;
  }
  std::int64_t saved_bytes(dml::shape x, std::size_t value_bytes) const {
    detail::carver k;
    saved_parts(k, dims(x), value_bytes);
    return k.used;
  }
  std::int64_t workspace_size(dml::shape x) const {
    detail::carver k;
    work_parts(k, dims(x), 4);  // floats: enough for any working type
    return k.used / 4;
  }

  template <execution_space S, class T>
  void forward(const context& c, layer_params<T> p, tensor_view<const T, S> x, tensor_view<T, S> y) const {
    check_group(kind, c, ranks());
    check_ring(c);
    const gpt_dims d = dims(x.shape);
    const std::int64_t C = dim, cp_ = dim / ranks(), fp = 4 * dim / ranks(), nl = d.n_local;
    const auto sv = saved_parts<T>(c.saved, d);
    const auto ws = work_parts<T>(c.workspace, d);
    const auto w = weights(p.w);
    // attention half
    for_each_index<S>(nl, kernels::layernorm_forward<T>{x.data, w.ln1_w, w.ln1_b, sv.h1, sv.stats1, C, eps});
    const T* h1 = gather(c, static_cast<const T*>(sv.h1), ws.full1, nl * C);
    detail::linear_forward<S>(d.n, C, 3 * cp_, h1, w.qkv_w, w.qkv_b, sv.qkv);
    if (ring())
      ring_attention_forward<S>(ring_shape(d), ring_layout(), c.cp, static_cast<const T*>(sv.qkv), sv.att, sv.lse, ws.scratch);
    else
      causal_attention_forward<S>(attention(d), static_cast<const T*>(sv.qkv), sv.probs, sv.att);
    detail::linear_forward<S>(d.n, cp_, C, static_cast<const T*>(sv.att), w.proj_w, static_cast<const T*>(nullptr), ws.full2);
    const T* r1 = reduce(c, ws.full2, ws.part, nl * C);
    for_each_index<S>(nl * C, kernels::residual_dropout<T>{x.data, r1, w.proj_b, sv.x2, drop(c, d, 1)});
    // MLP half
    for_each_index<S>(nl, kernels::layernorm_forward<T>{sv.x2, w.ln2_w, w.ln2_b, sv.h2, sv.stats2, C, eps});
    if (experts) {  // on this rank's token rows: the experts are whole here, nothing to gather or reduce
      moe_of(d).template forward_rows<S>(c, p.w + w.mlp, static_cast<const T*>(sv.h2), ws.part, nl, sv.moe, ws.moe,
                                         d.t * cp.ranks);
      for_each_index<S>(nl * C, kernels::residual_dropout<T>{sv.x2, ws.part, static_cast<const T*>(nullptr), y.data,
                                                             drop(c, d, 2)});
      return;
    }
    const T* h2 = gather(c, static_cast<const T*>(sv.h2), ws.full1, nl * C);
    detail::linear_forward<S>(d.n, C, fp, h2, w.fc_w, w.fc_b, sv.f);
    for_each_index<S>(d.n * fp, kernels::gelu_forward<T>{sv.f, sv.g});
    detail::linear_forward<S>(d.n, fp, C, static_cast<const T*>(sv.g), w.fc2_w, static_cast<const T*>(nullptr), ws.full2);
    const T* r2 = reduce(c, ws.full2, ws.part, nl * C);
    for_each_index<S>(nl * C, kernels::residual_dropout<T>{sv.x2, r2, w.fc2_b, y.data, drop(c, d, 2)});
  }

  template <execution_space S, class T>
  void backward(const context& c, layer_params<T> p, tensor_view<const T, S> x, tensor_view<const T, S>,
                tensor_view<const T, S> dy, tensor_view<T, S> dx) const {
    const gpt_dims d = dims(x.shape);
    const std::int64_t C = dim, cp_ = dim / ranks(), fp = 4 * dim / ranks(), nl = d.n_local;
    const auto sv = saved_parts<T>(c.saved, d);
    const auto ws = work_parts<T>(c.workspace, d);
    const auto w = weights(p.w);
    const auto g = weights(p.g);
    const bool acc = c.accumulate;
    // MLP half: y = x2 + dropout(c_proj(gelu(c_fc(ln_2(x2)))) + b), or x2 + dropout(moe(ln_2(x2)))
    for_each_index<S>(nl * C, kernels::dropout_grad<T>{dy.data, ws.part_a, drop(c, d, 2)});
    const T* dh2 = ws.part_b;
    if (experts) {
      moe_of(d).template backward_rows<S>(c, p.w + w.mlp, p.g + w.mlp, static_cast<const T*>(sv.h2),
                                          static_cast<const T*>(ws.part_a), ws.part_b, nl, sv.moe, ws.moe, d.t * cp.ranks);
    } else {
      if (g.fc2_b) for_each_index<S>(C, kernels::column_sum<T>{ws.part_a, g.fc2_b, nl, C, acc});
      const T* dm = gather(c, static_cast<const T*>(ws.part_a), ws.full1, nl * C);
      detail::linear_weight_grad<S>(d.n, fp, C, static_cast<const T*>(sv.g), dm, g.fc2_w, acc);
      detail::linear_input_grad<S>(d.n, fp, C, dm, w.fc2_w, ws.big);
      for_each_index<S>(d.n * fp, kernels::gelu_backward_inplace<T>{sv.f, ws.big});
      if (g.fc_b) for_each_index<S>(fp, kernels::column_sum<T>{ws.big, g.fc_b, d.n, fp, acc});
      const T* h2 = gather(c, static_cast<const T*>(sv.h2), ws.full2, nl * C);
      detail::linear_weight_grad<S>(d.n, C, fp, h2, static_cast<const T*>(ws.big), g.fc_w, acc);
      detail::linear_input_grad<S>(d.n, C, fp, static_cast<const T*>(ws.big), w.fc_w, ws.full3);
      dh2 = reduce(c, ws.full3, ws.part_b, nl * C);
    }
    for_each_index<S>(C, kernels::layernorm_backward_params<T>{sv.x2, dh2, sv.stats2, g.ln2_w, g.ln2_b, nl, C, acc});
    for_each_index<S>(nl, kernels::layernorm_backward_input<T>{sv.x2, w.ln2_w, dh2, dy.data, sv.stats2, ws.dx2, C});
    // attention half: x2 = x + dropout(c_proj(attn(c_attn(ln_1(x)))) + b)
    for_each_index<S>(nl * C, kernels::dropout_grad<T>{ws.dx2, ws.part_a, drop(c, d, 1)});
    if (g.proj_b) for_each_index<S>(C, kernels::column_sum<T>{ws.part_a, g.proj_b, nl, C, acc});
    const T* dp = gather(c, static_cast<const T*>(ws.part_a), ws.full1, nl * C);
    detail::linear_weight_grad<S>(d.n, cp_, C, static_cast<const T*>(sv.att), dp, g.proj_w, acc);
    detail::linear_input_grad<S>(d.n, cp_, C, dp, w.proj_w, ws.datt);
    if (ring())
      ring_attention_backward<S>(ring_shape(d), ring_layout(), c.cp, static_cast<const T*>(sv.qkv),
                                 static_cast<const T*>(sv.att), static_cast<const float*>(sv.lse),
                                 static_cast<const T*>(ws.datt), ws.dqkv, ws.scratch);
    else
      causal_attention_backward<S>(attention(d), static_cast<const T*>(sv.qkv), static_cast<const T*>(sv.probs),
                                   static_cast<const T*>(ws.datt), ws.dqkv, ws.scratch);
    if (g.qkv_b) for_each_index<S>(3 * cp_, kernels::column_sum<T>{ws.dqkv, g.qkv_b, d.n, 3 * cp_, acc});
    const T* h1 = gather(c, static_cast<const T*>(sv.h1), ws.full2, nl * C);
    detail::linear_weight_grad<S>(d.n, C, 3 * cp_, h1, static_cast<const T*>(ws.dqkv), g.qkv_w, acc);
    detail::linear_input_grad<S>(d.n, C, 3 * cp_, static_cast<const T*>(ws.dqkv), w.qkv_w, ws.full3);
    const T* dh1 = reduce(c, ws.full3, ws.part_b, nl * C);
    for_each_index<S>(C, kernels::layernorm_backward_params<T>{x.data, dh1, sv.stats1, g.ln1_w, g.ln1_b, nl, C, acc});
    if (dx.data)
      for_each_index<S>(nl, kernels::layernorm_backward_input<T>{x.data, w.ln1_w, dh1, ws.dx2, sv.stats1, dx.data, C});
  }

 private:
  gpt_dims dims(const dml::shape& x) const {
    const std::int64_t t = sequence() ? x[1] * ranks() : x[1];
    return {x[0], t, x[0] * t, x[0] * x[1]};
  }
  attention_shape attention(const gpt_dims& d) const {
    return {.batch = d.b, .seq = d.t, .heads = heads / ranks(), .head_dim = dim / heads};
  }
  // Context parallel: d.t is this rank's chunk of each sequence, and attention is ring attention.
  bool ring() const { return cp.ranks > 1; }
  ring_attention_shape ring_shape(const gpt_dims& d) const {
    return {.batch = d.b, .seq = d.t * cp.ranks, .heads = heads / ranks(), .head_dim = dim / heads, .causal = true};
  }
  cp_layout ring_layout() const { return {.ranks = cp.ranks, .rank = cp.rank, .zigzag = cp.zigzag}; }
  void check_ring(const context& c) const {
    if (ring() && (!c.cp || c.cp->size() != cp.ranks || c.cp->rank() != cp.rank))
      fail<invalid_argument>("dml::nn::gpt_block: split over ", cp.ranks, " context-parallel ranks but the context's "
                             "group has ", c.cp ? c.cp->size() : 0, " (a trainer with context_parallel sets it)");
  }
  kernels::token_dropout drop(const context& c, const gpt_dims& d, std::uint64_t which) const {
    const std::int64_t first = sequence() ? d.n_local * split.rank : 0;
    return detail::token_dropout_of(c, which, dropout, d.t * cp.ranks, d.t, first, dim, cp);
  }
  // The parameters (or gradients) by role; biases null without bias.
  template <class T>
  struct roles {
    T *ln1_w, *ln1_b, *qkv_w, *qkv_b, *proj_w, *proj_b, *ln2_w, *ln2_b, *fc_w, *fc_b, *fc2_w, *fc2_b;
    std::size_t mlp;  // index of the MLP's first parameter (the experts' parameters start there)
  };
  template <class T>
  roles<T> weights(T* const* v) const {
    std::size_t i = 0;
    auto next = [&](bool present) { return present ? v[i++] : static_cast<T*>(nullptr); };
    roles<T> r{};
    r.ln1_w = next(true), r.ln1_b = next(bias), r.qkv_w = next(true), r.qkv_b = next(bias);
    r.proj_w = next(true), r.proj_b = next(bias), r.ln2_w = next(true), r.ln2_b = next(bias);
    r.mlp = i;
    if (experts) return r;
    r.fc_w = next(true), r.fc_b = next(bias), r.fc2_w = next(true), r.fc2_b = next(bias);
    return r;
  }
  // What forward keeps for backward: LayerNorm outputs of this rank's rows (re-gathered in backward under
  // sequence parallelism, as Korthikanti et al. do), q k v, the attention probabilities and output, the
  // residual between the halves, and c_fc's output before and after GELU.
  template <class T>
  struct saved_set {
    kernels::row_stats *stats1, *stats2;
    T *h1, *qkv, *probs, *att, *x2, *h2, *f, *g;
    float* lse;      // ring attention keeps a log-sum-exp per query row instead of the probabilities
    std::byte* moe;  // what the experts keep, in place of f and g
  };
  template <class T>
  saved_set<T> saved_parts(std::byte* base, const gpt_dims& d) const {
    detail::carver k{base};
    return saved_parts<T>(k, d);
  }
  template <class T>
  saved_set<T> saved_parts(detail::carver& k, const gpt_dims& d) const {
    const std::int64_t C = dim, cw = dim / ranks(), fp = 4 * dim / ranks();
    saved_set<T> s{};
    s.stats1 = k.take<kernels::row_stats>(d.n_local);
    s.stats2 = k.take<kernels::row_stats>(d.n_local);
    s.h1 = k.take<T>(d.n_local * C);
    s.qkv = k.take<T>(d.n * 3 * cw);
    if (ring()) s.lse = k.take<float>(ring_attention_saved_size(ring_shape(d), ring_layout()));
    else s.probs = k.take<T>(attention_saved_size(attention(d)));
    s.att = k.take<T>(d.n * cw);
    s.x2 = k.take<T>(d.n_local * C);
    s.h2 = k.take<T>(d.n_local * C);
    if (experts) {
      s.moe = k.take<std::byte>(moe_of(d).saved_bytes_rows(d.n_local, sizeof(T)));
      return s;
    }
    s.f = k.take<T>(d.n * fp);
    s.g = k.take<T>(d.n * fp);
    return s;
  }
  void saved_parts(detail::carver& k, const gpt_dims& d, std::size_t value_bytes) const {
    if (value_bytes == 2) saved_parts<bf16>(k, d);
    else saved_parts<float>(k, d);
  }
  template <class T>
  struct work_set {
    T *full1, *full2, *full3, *part, *part_a, *part_b, *dx2, *big, *datt, *dqkv, *scratch;
    float* moe;
  };
  template <class T>
  work_set<T> work_parts(float* base, const gpt_dims& d) const {
    detail::carver k{reinterpret_cast<std::byte*>(base)};
    return work_parts<T>(k, d);
  }
  template <class T>
  work_set<T> work_parts(detail::carver& k, const gpt_dims& d) const {
    const std::int64_t C = dim, cw = dim / ranks(), fp = 4 * dim / ranks();
    work_set<T> w{};
    w.full1 = k.take<T>(d.n * C);
    w.full2 = k.take<T>(d.n * C);
    w.full3 = k.take<T>(d.n * C);
    w.part = w.part_a = k.take<T>(d.n_local * C);
    w.part_b = k.take<T>(d.n_local * C);
    w.dx2 = k.take<T>(d.n_local * C);
    if (experts) w.moe = k.take<float>(moe_of(d).workspace_rows(d.n_local));
    else w.big = k.take<T>(d.n * fp);
    w.datt = k.take<T>(d.n * cw);
    w.dqkv = k.take<T>(d.n * 3 * cw);
    w.scratch = k.take<T>(ring() ? ring_attention_workspace_size(ring_shape(d), ring_layout())
                                 : attention_scratch_size(attention(d)));
    return w;
  }
  void work_parts(detail::carver& k, const gpt_dims& d, std::size_t) const { work_parts<float>(k, d); }
  // The experts sized for any rank of the expert group: data-parallel ranks hold at most one sequence more
  // than another (the sampler's split), so buffers allow for that many rows from each.
  nn::moe moe_of(const gpt_dims& d) const {
    nn::moe m = *experts;
    m.group_rows = d.n_local + d.n_local / std::max<std::int64_t>(d.b, 1);
    return m;
  }
};

// The final LayerNorm and the LM head: [B, T or T/p, C] → logits [B, T, V/p] (a rank's vocabulary columns;
// softmax_cross_entropy with the tensor group takes them as they are, never gathering the vocabulary).
struct gpt_head : detail::split_part {
  static constexpr std::int64_t static_in = dynamic;
  static constexpr std::int64_t static_out = dynamic;
  static constexpr const char* kind = "gpt_head";
  std::string prefix;  // parameters are "ln_f.weight", "lm_head.weight"
  std::int64_t vocab = 0, dim = 0;
  float eps = 1e-5f;
  bool bias = false;

  bool tied = false;

  explicit gpt_head(const gpt_config& g) : vocab(g.vocab), dim(g.d_model), eps(g.eps), bias(g.bias), tied(g.tie_weights) {}
  void set_split(tensor_split s) {
    split = s;
    check_split(kind);
    check_divides(kind, "the vocabulary", vocab, s.ranks);
  }
  std::vector<param_spec> parameters() const {
    std::vector<param_spec> out{{"ln_f.weight", {dim}, init_kind::ones, 0.f, 0.f, {}, sequence()}};
    if (bias) out.push_back({"ln_f.bias", {dim}, init_kind::zeros, 0.f, 0.f, {}, sequence()});
    out.push_back({"lm_head.weight", {vocab / ranks(), dim}, init_kind::normal, 0.f, 0.02f, shard(vocab, dim, 0), false,
                   tied ? "wte.weight" : ""});
    return out;
  }
  dml::shape output_shape(dml::shape x) const {
    if (x.rank != 3 || x[2] != dim) fail<shape_error>("dml::nn::gpt_head: expected [batch, T, ", dim, "], found shape ", x);
    return {x[0], sequence() ? x[1] * ranks() : x[1], vocab / ranks()};
  }
  std::int64_t saved_bytes(dml::shape x, std::size_t value_bytes) const {
    const std::int64_t nl = x.rows(), n = sequence() ? nl * ranks() : 0;
    return (nl * static_cast<std::int64_t>(sizeof(kernels::row_stats)) + 63) / 64 * 64 +
           ((nl + n) * dim * static_cast<std::int64_t>(value_bytes) + 63) / 64 * 64;
  }
  std::int64_t workspace_size(dml::shape x) const { return x.rows() * dim * (ranks() + 1) + 32; }

  template <execution_space S, class T>
  void forward(const context& c, layer_params<T> p, tensor_view<const T, S> x, tensor_view<T, S> y) const {
    check_group(kind, c, ranks());
    const std::int64_t nl = x.rows(), n = y.rows();
    auto [stats, hs, hfull] = kept<T>(c.saved, nl);
    for_each_index<S>(nl, kernels::layernorm_forward<T>{x.data, p.w[0], bias ? p.w[1] : nullptr, hs, stats, dim, eps});
    const T* h = gather(c, static_cast<const T*>(hs), hfull, nl * dim);
    detail::linear_forward<S>(n, dim, vocab / ranks(), h, p.w[bias ? 2 : 1], static_cast<const T*>(nullptr), y.data);
  }
  template <execution_space S, class T>
  void backward(const context& c, layer_params<T> p, tensor_view<const T, S> x, tensor_view<const T, S>,
                tensor_view<const T, S> dy, tensor_view<T, S> dx) const {
    const std::int64_t nl = x.rows(), n = dy.rows(), v = vocab / ranks();
    auto [stats, hs, hfull] = kept<T>(c.saved, nl);
    const T* h = sequence() ? hfull : hs;
    T* full = reinterpret_cast<T*>(c.workspace);
    T* part = full + n * dim;
    const std::size_t wi = bias ? 2 : 1;
    detail::linear_weight_grad<S>(n, dim, v, h, dy.data, p.g[wi], c.accumulate);
    detail::linear_input_grad<S>(n, dim, v, dy.data, p.w[wi], full);
    const T* dh = reduce(c, full, part, nl * dim);
    for_each_index<S>(dim, kernels::layernorm_backward_params<T>{x.data, dh, stats, p.g[0], bias ? p.g[1] : nullptr, nl, dim,
                                                             c.accumulate});
    if (dx.data)
      for_each_index<S>(nl, kernels::layernorm_backward_input<T>{x.data, p.w[0], dh, static_cast<const T*>(nullptr), stats,
                                                                 dx.data, dim});
  }

 private:
  // ln_f's statistics and output (this rank's rows), and the gathered output under sequence parallelism.
  template <class T>
  std::tuple<kernels::row_stats*, T*, T*> kept(std::byte* base, std::int64_t nl) const {
    detail::carver k{base};
    auto* stats = k.take<kernels::row_stats>(nl);
    T* hs = k.take<T>(nl * dim);
    T* hfull = sequence() ? k.take<T>(nl * ranks() * dim) : nullptr;
    return {stats, hs, hfull};
  }
};

// Where a configuration is known at compile time, its fit to a tensor-parallel degree is checked there:
//     constexpr nn::gpt_config cfg{.vocab = 256, .layers = 6, .d_model = 384, .heads = 6};
//     static_assert(nn::check_tensor_parallel<cfg, 4>());   // fails: 6 heads do not split over 4 ranks
template <gpt_config G, int TP>
consteval bool check_tensor_parallel() {
  static_assert(TP >= 1, "dml::nn::gpt: the tensor-parallel degree is at least 1");
  static_assert(G.heads % TP == 0, "dml::nn::gpt: tensor parallelism splits whole heads: make heads a multiple of TP");
  static_assert(G.d_model % TP == 0 && (4 * G.d_model) % TP == 0,
                "dml::nn::gpt: tensor parallelism splits d_model and 4·d_model: make d_model a multiple of TP");
  static_assert(G.vocab % TP == 0,
                "dml::nn::gpt: the embedding and LM head are vocabulary-parallel: make vocab a multiple of TP (pad it)");
  return true;
}

// A GPT as a sequence of layers: embeddings, blocks h.0 … h.{layers−1}, final LayerNorm and LM head.
inline auto gpt(const gpt_config& g) {
  if (g.layers < 1) fail<invalid_argument>("dml::nn::gpt: expected at least one layer, found ", g.layers);
  if (g.experts < 0 || g.moe_every < 1)
    fail<invalid_argument>("dml::nn::gpt: expected experts >= 0 and moe_every >= 1, found ", g.experts, " and ", g.moe_every);
  if (g.experts > 0 && g.moe_every > g.layers)
    fail<invalid_argument>("dml::nn::gpt: experts in every ", g.moe_every, " blocks need at least that many layers; found ",
                           g.layers, ", so no block would hold the ", g.experts, " experts");
  std::vector<gpt_block> blocks;
  for (std::int64_t i = 0; i < g.layers; ++i) blocks.emplace_back(g, g.experts > 0 && (i + 1) % g.moe_every == 0);
  return sequential{gpt_embedding(g), stack<gpt_block>{"h", std::move(blocks)}, gpt_head(g)};
}
using gpt_model = decltype(gpt(gpt_config{}));

}  // namespace dml::nn
