// SPDX-License-Identifier: Apache-2.0
// dml/nn/llama.hpp — a Llama-class decoder as a layer sequence: token embedding, a stack of pre-RMSNorm blocks with
// grouped-query attention, RoPE and SwiGLU, a final RMSNorm and LM head; each layer also runs as one rank's part of
// Megatron tensor (and sequence) parallelism, as nn::gpt's do. Sits on nn/detail/llama_block.hpp (the block),
// nn/detail/gpt_common.hpp (embedding kernels, tensor-parallel plumbing), nn/rmsnorm.hpp and nn/sequential.hpp;
// nn::llama(config) builds the sequential.
//
// Parameter names are Hugging Face's LlamaForCausalLM state dict (model.embed_tokens.weight,
// model.layers.{i}.input_layernorm.weight, ..., model.norm.weight, lm_head.weight; Linear weights [out, in]) but for
// two fused tensors per block: self_attn.qkv_proj.weight holds q_proj's rows, then k_proj's, then v_proj's, and
// mlp.gate_up_proj.weight holds gate_proj's rows, then up_proj's (nn/detail/llama_block.hpp). A tied LM head is a
// parameter of its own tied to model.embed_tokens.weight (param_spec::tied_to), as nn::gpt's is.
//
// Tensor parallelism: the embedding and LM head are vocabulary-parallel, the blocks split heads (query and key/value
// alike; where tensor_parallel exceeds kv_heads, a multiple of it, tensor_parallel / kv_heads ranks share each
// key/value head, each holding a slice of its rows) and ffn_hidden. Sequence and context parallelism as nn::gpt: under
// context parallelism the embedding hands each rank its chunks of the sequences, the blocks rotate q and k by each
// token's position in the whole sequence and attend through the ring (grouped-query K/V blocks), and the head works on
// the rank's tokens.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/gemm.hpp"
#include "dml/nn/detail/gpt_common.hpp"
#include "dml/nn/detail/llama_block.hpp"
#include "dml/nn/detail/rows.hpp"
#include "dml/nn/layer.hpp"
#include "dml/nn/llama_config.hpp"
#include "dml/nn/rmsnorm.hpp"
#include "dml/nn/sequential.hpp"

namespace dml::nn {

// Token embedding: ids [B, T] (floats) → [B, T, C] ([B, T/p, C] sequence-parallel; T/cp of each sequence, the
// rank's chunks, under context parallelism); no positions (the blocks rotate q and k instead).
// model.embed_tokens.weight is vocabulary-parallel: a rank holds rows [r·V/p, (r+1)·V/p), looks up the ids it holds
// and the group sums (one all-reduce, or reduce-scatter under sequence parallelism).
struct llama_embedding : detail::split_part {
  static constexpr std::int64_t static_in = dynamic;
  static constexpr std::int64_t static_out = dynamic;
  static constexpr const char* kind = "llama_embedding";
  static constexpr bool float_input = true;
  std::string prefix;  // parameters are "model.embed_tokens.weight"
  std::int64_t vocab = 0, seq = 0, dim = 0;
  context_split cp{};  // context parallel: the ids are whole sequences, the output this rank's chunks of them

  explicit llama_embedding(const llama_config& g) : vocab(g.vocab), seq(g.seq), dim(g.d_model) { g.validate(); }
  void set_split(tensor_split s) {
    split = s;
    check_split(kind);
    check_divides(kind, "the vocabulary", vocab, s.ranks);
  }
  void set_context_split(context_split s) { cp = s; }
  std::int64_t input_width() const { return seq; }

  std::vector<param_spec> parameters() const {
    return {{"model.embed_tokens.weight", {vocab / ranks(), dim}, init_kind::normal, 0.f, 0.02f, shard(vocab, dim, 0)}};
  }
  dml::shape output_shape(dml::shape x) const {
    if (x.rank != 2 || x[1] < 1 || x[1] > seq)
      fail<shape_error>("dml::nn::llama_embedding: expected token ids [batch, T] with 1 <= T <= ", seq, ", found shape ", x);
    const std::int64_t chunks = cp.ranks * (cp.zigzag && cp.ranks > 1 ? 2 : 1);
    if (x[1] % chunks != 0)
      fail<shape_error>("dml::nn::llama_embedding: context parallelism over ", cp.ranks, " ranks",
                        cp.zigzag ? " (zig-zag)" : "", " needs T divisible by ", chunks, ", found T = ", x[1]);
    const std::int64_t t = x[1] / cp.ranks;
    if (sequence() && t % ranks() != 0)
      fail<shape_error>("dml::nn::llama_embedding: sequence parallelism over ", ranks(), " ranks needs T",
                        cp.ranks > 1 ? " / cp" : "", " divisible by ", ranks(), ", found ", t);
    return {x[0], sequence() ? t / ranks() : t, dim};
  }
  // Under sequence parallelism every local token's lookups (forward) and every local token's gradient (backward).
  std::int64_t workspace_size(dml::shape x) const { return sequence() ? x.numel() / cp.ranks * dim : 0; }

  template <execution_space S, class Id, class T>
  void forward(const context& c, layer_params<T> p, tensor_view<const Id, S> x, tensor_view<T, S> y) const {
    static_assert(std::same_as<Id, float>, "dml::nn::llama_embedding: ids arrive as floats");
    check_group(kind, c, ranks());
    if constexpr (std::same_as<S, host>) check_ids(x);
    const std::int64_t tokens = x.numel() / cp.ranks, held = vocab / ranks();
    T* all = sequence() ? reinterpret_cast<T*>(c.workspace) : y.data;
    detail::token_rows<S>(tokens, dim, kernels::embed_tokens<T>{x.data, p.w[0], nullptr, all, dim, held * split.rank, held,
                                                                0, place(x.shape[1])});
    reduce(c, all, y.data, y.rows() * dim);
  }
  template <execution_space S, class Id, class T, class Dx>
  void backward(const context& c, layer_params<T> p, tensor_view<const Id, S> x, tensor_view<const T, S>,
                tensor_view<const T, S> dy, tensor_view<Dx, S>) const {
    const std::int64_t held = vocab / ranks();
    const T* all = gather(c, dy.data, reinterpret_cast<T*>(c.workspace), dy.rows() * dim);
    detail::embed_wte_grad_rows<S>(kernels::embed_wte_grad<T>{x.data, all, p.g[0], x.numel() / cp.ranks, dim,
                                                              held * split.rank, held, c.accumulate, place(x.shape[1])});
  }

 private:
  kernels::token_place place(std::int64_t t) const { return {t, t / cp.ranks, cp}; }
  template <class Id>
  void check_ids(tensor_view<const Id, host> x) const {
    for (std::int64_t t = 0; t < x.numel(); ++t) {
      const float id = static_cast<float>(x.data[t]);
      if (!(id >= 0.f && id < static_cast<float>(vocab)) || id != static_cast<float>(static_cast<std::int64_t>(id)))
        fail<invalid_argument>("dml::nn::llama_embedding: expected integer token ids in [0, ", vocab, "), found ", id,
                               " at position ", t);
    }
  }
};

// The final RMSNorm and the LM head: [B, T or T/p, C] → logits [B, T, V/p] (a rank's vocabulary columns;
// softmax_cross_entropy with the tensor group takes them as they are). Tied: lm_head.weight starts as
// model.embed_tokens.weight and a trainer sums the two gradients, so the copies stay equal.
struct llama_head : detail::split_part {
  static constexpr std::int64_t static_in = dynamic;
  static constexpr std::int64_t static_out = dynamic;
  static constexpr const char* kind = "llama_head";
  std::string prefix;  // parameters are "model.norm.weight", "lm_head.weight"
  std::int64_t vocab = 0, dim = 0;
  float eps = 1e-5f;
  bool tied = false;

  explicit llama_head(const llama_config& g) : vocab(g.vocab), dim(g.d_model), eps(g.norm_eps), tied(g.tie_embeddings) {
    g.validate();
  }
  void set_split(tensor_split s) {
    split = s;
    check_split(kind);
    check_divides(kind, "the vocabulary", vocab, s.ranks);
  }
  std::vector<param_spec> parameters() const {
    return {{"model.norm.weight", {dim}, init_kind::ones, 0.f, 0.f, {}, sequence()},
            {"lm_head.weight", {vocab / ranks(), dim}, init_kind::normal, 0.f, 0.02f, shard(vocab, dim, 0), false,
             tied ? "model.embed_tokens.weight" : ""}};
  }
  dml::shape output_shape(dml::shape x) const {
    if (x.rank != 3 || x[2] != dim) fail<shape_error>("dml::nn::llama_head: expected [batch, T, ", dim, "], found shape ", x);
    return {x[0], sequence() ? x[1] * ranks() : x[1], vocab / ranks()};
  }
  // lm_head's product over this rank's vocabulary columns for every token.
  double forward_flops(dml::shape x) const {
    const double tokens = static_cast<double>(x[0] * (sequence() ? x[1] * ranks() : x[1]));
    return 2 * tokens * static_cast<double>(dim) * static_cast<double>(vocab / ranks());
  }
  std::int64_t saved_bytes(dml::shape x, std::size_t value_bytes) const {
    detail::carver k;
    if (value_bytes == 2) kept<bf16>(k, x.rows());
    else kept<float>(k, x.rows());
    return k.used;
  }
  // The input gradient's partial sums over every token, and this rank's rows of their sum.
  std::int64_t workspace_size(dml::shape x) const { return x.rows() * dim * (ranks() + 1) + 32; }

  template <execution_space S, class T>
  void forward(const context& c, layer_params<T> p, tensor_view<const T, S> x, tensor_view<T, S> y) const {
    check_group(kind, c, ranks());
    const std::int64_t nl = x.rows(), n = y.rows();
    detail::carver k{c.saved};
    const auto [rrms, hs, hfull] = kept<T>(k, nl);
    rmsnorm_forward<S>(x.data, static_cast<const T*>(p.w[0]), hs, rrms, nl, dim, eps);
    const T* h = gather(c, static_cast<const T*>(hs), hfull, nl * dim);
    detail::linear_forward<S>(n, dim, vocab / ranks(), h, p.w[1], static_cast<const T*>(nullptr), y.data);
  }
  template <execution_space S, class T>
  void backward(const context& c, layer_params<T> p, tensor_view<const T, S> x, tensor_view<const T, S>,
                tensor_view<const T, S> dy, tensor_view<T, S> dx) const {
    const std::int64_t nl = x.rows(), n = dy.rows(), v = vocab / ranks();
    detail::carver k{c.saved};
    const auto [rrms, hs, hfull] = kept<T>(k, nl);
    const T* h = sequence() ? hfull : hs;
    T* full = reinterpret_cast<T*>(c.workspace);
    T* part = full + n * dim;
    detail::linear_weight_grad<S>(n, dim, v, h, dy.data, p.g[1], c.accumulate);
    detail::linear_input_grad<S>(n, dim, v, dy.data, p.w[1], full);
    const T* dh = reduce(c, full, part, nl * dim);
    rmsnorm_backward<S>(x.data, static_cast<const T*>(p.w[0]), static_cast<const float*>(rrms), dh,
                        static_cast<const T*>(nullptr), dx.data, p.g[0], nl, dim, c.accumulate);
  }

 private:
  // model.norm's 1/rms and output (this rank's rows), and the gathered output under sequence parallelism.
  template <class T>
  std::tuple<float*, T*, T*> kept(detail::carver& k, std::int64_t nl) const {
    float* rrms = k.take<float>(nl);
    T* hs = k.take<T>(nl * dim);
    T* hfull = sequence() ? k.take<T>(nl * ranks() * dim) : nullptr;
    return {rrms, hs, hfull};
  }
};

// A Llama as a sequence of layers: the token embedding, blocks model.layers.0 … model.layers.{layers−1}, the final
// RMSNorm and LM head. The blocks share one RoPE table; with experts, every moe_every-th block's MLP after the first
// first_dense is a mixture of SwiGLU experts (llama_config).
inline auto llama(const llama_config& g) {
  g.validate();
  const auto table = detail::llama_rope_table(g);
  std::vector<llama_block> blocks;
  bool any_experts = false;
  for (std::int64_t i = 0; i < g.layers; ++i) any_experts = any_experts || g.moe_block(i);
  if (g.experts > 0 && !any_experts)
    fail<invalid_argument>("dml::nn::llama: expected a block to hold the ", g.experts, " experts (every ", g.moe_every,
                           "-th after the first ", g.first_dense, " dense ones), found ", g.layers, " layers and none");
  for (std::int64_t i = 0; i < g.layers; ++i) blocks.emplace_back(g, table, g.moe_block(i));
  return sequential{llama_embedding(g), stack<llama_block>{"model.layers", std::move(blocks)}, llama_head(g)};
}
using llama_model = decltype(llama(llama_config{}));

}  // namespace dml::nn
