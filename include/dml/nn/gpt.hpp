// SPDX-License-Identifier: Apache-2.0
// dml/nn/gpt.hpp — a GPT as a layer sequence: embeddings, a stack of pre-LayerNorm blocks, a final LayerNorm
// and LM head; each layer also runs as one rank's part of Megatron tensor (and sequence) parallelism.
// Sits on nn/attention.hpp, nn/rank_group.hpp and core/gemm.hpp; nn::gpt(config) builds the sequential.
// Its parts: nn/gpt_config.hpp (the configuration), nn/detail/gpt_common.hpp (the layers' kernels and tensor-parallel
// plumbing) and nn/detail/gpt_block.hpp (the transformer block).
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

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/gemm.hpp"
#include "dml/core/rng.hpp"
#include "dml/nn/activation.hpp"
#include "dml/nn/attention.hpp"
#include "dml/nn/detail/gpt_block.hpp"
#include "dml/nn/detail/gpt_common.hpp"
#include "dml/nn/detail/rows.hpp"
#include "dml/nn/gpt_config.hpp"
#include "dml/nn/layer.hpp"
#include "dml/nn/layernorm.hpp"
#include "dml/nn/moe.hpp"
#include "dml/nn/ring_attention.hpp"
#include "dml/nn/sequential.hpp"

namespace dml::nn {

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
    check_cache<S>(kind, c, cp.ranks);
    if constexpr (std::same_as<S, host>) check_ids(x);
    const std::int64_t tokens = x.numel() / cp.ranks, mine = y.rows(), first_id = vocab / ranks() * split.rank;
    const auto drop = dropout_of(c, x.shape[1], y.shape);
    const auto at = place(x.shape[1]);
    if (ranks() == 1) {
      // Decoding (context::kv): the tokens after the cached ones, their positions from there on.
      const T* wpe = c.kv ? p.w[1] + c.kv->first_position(x.shape[1]) * dim : p.w[1];
      detail::token_rows<S>(mine, dim, kernels::embed_tokens<T>{x.data, p.w[0], wpe, y.data, dim, 0, vocab, 0, at});
      if (drop.keep < 1.f)
        detail::token_rows<S>(mine, dim, kernels::residual_dropout<T>{nullptr, y.data, nullptr, y.data, drop});
      return;
    }
    // Each rank looks up the ids it holds for every token; the group sums; positions and dropout follow.
    T* full = reinterpret_cast<T*>(c.workspace);
    detail::token_rows<S>(tokens, dim,
                          kernels::embed_tokens<T>{x.data, p.w[0], nullptr, full, dim, first_id, vocab / ranks(), 0, at});
    const T* sum = reduce(c, full, y.data, mine * dim);
    const std::int64_t first_token = sequence() ? mine * split.rank : 0;
    detail::token_rows<S>(mine, dim, kernels::add_positions<T>{sum, p.w[1], y.data, dim, first_token, at, drop});
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
    detail::token_rows<S>(mine, dim, kernels::dropout_grad<T>{dy.data, mine_d, drop});
    detail::token_rows<S>(seq, dim, kernels::embed_wpe_grad<T>{mine_d, p.g[1], mine, dim, first_token, at, c.accumulate});
    const T* all = gather(c, static_cast<const T*>(mine_d), d, mine * dim);
    detail::embed_wte_grad_rows<S>(kernels::embed_wte_grad<T>{x.data, all, p.g[0], tokens, dim, first_id, vocab / ranks(), c.accumulate, at});
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
  // lm_head's product over this rank's vocabulary columns for every token.
  double forward_flops(dml::shape x) const {
    const double tokens = static_cast<double>(x[0] * (sequence() ? x[1] * ranks() : x[1]));
    return 2 * tokens * static_cast<double>(dim) * static_cast<double>(vocab / ranks());
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
    for_each_row<S>(nl, kernels::layernorm_forward<T>{x.data, p.w[0], bias ? p.w[1] : nullptr, hs, stats, dim, eps}, dim);
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
    layernorm_params_grad<S>(x.data, dh, stats, p.g[0], bias ? p.g[1] : nullptr, nl, dim, c.accumulate);
    if (dx.data)
      for_each_row<S>(nl,
                      kernels::layernorm_backward_input<T>{x.data, p.w[0], dh, static_cast<const T*>(nullptr), stats,
                                                           dx.data, dim},
                      dim);
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
