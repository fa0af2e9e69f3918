// SPDX-License-Identifier: Apache-2.0
// dml/nn/detail/gpt_block.hpp — nn::gpt_block, GPT's pre-LayerNorm transformer block: attention (causal tile
// attention, or ring attention under context parallelism) and an MLP or a mixture of experts, split over the tensor
// group. Sits on nn/detail/gpt_common.hpp, nn/tile_attention.hpp, nn/ring_attention.hpp and nn/moe.hpp; used by
// nn/gpt.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/gemm.hpp"
#include "dml/nn/activation.hpp"
#include "dml/nn/detail/gpt_common.hpp"
#include "dml/nn/detail/rows.hpp"
#include "dml/nn/gpt_config.hpp"
#include "dml/nn/layer.hpp"
#include "dml/nn/layernorm.hpp"
#include "dml/nn/moe.hpp"
#include "dml/nn/kv_cache.hpp"
#include "dml/nn/ring_attention.hpp"
#include "dml/nn/tile_attention.hpp"

namespace dml::nn {

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
  // Split backward (zb): the input pass leaves the four weight products (and only them) to the weight pass, keeping
  // their output gradients, and under sequence parallelism their gathered inputs, in its stash (stash_bytes).
  static constexpr bool splits_backward = true;
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
      experts.emplace(moe_config{.dim = dim, .hidden = g.expert_ffn > 0 ? g.expert_ffn : 4 * dim, .experts = g.experts,
                                 .top_k = g.top_k, .capacity_factor = g.capacity_factor,
                                 .aux_loss_weight = g.aux_loss_weight, .z_loss_weight = g.z_loss_weight, .bias = bias,
                                 .proj_std = 0.02f / std::sqrt(2.f * static_cast<float>(layers)),
                                 .logit_bias = g.router_skew > 0.f ? skewed_logit_bias(g.experts, 1.0, g.router_skew)
                                                                   : std::vector<float>{},
                                 .shared = g.shared_experts,
                                 .score = g.sigmoid_router ? router_score::sigmoid : router_score::softmax,
                                 .bias_rate = g.router_bias_rate});
  }
  void set_split(tensor_split s) {
    split = s;
    check_split(kind);
    check_divides(kind, "the heads", heads, s.ranks);
    if (experts) experts->set_split(s);  // experts stay whole on every tensor rank
    else check_divides(kind, "4·d_model", 4 * dim, s.ranks);
  }
  void set_expert_split(int ranks, int rank, int batch_ranks = 0) {
    if (experts) experts->set_expert_split(ranks, rank, batch_ranks);
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
  // This rank's products: c_attn and c_proj (8C² per token), q·kᵀ and p·v over every key (4·T·C per token: the whole
  // T × T, as model FLOPs count it, though the tiles skip most of the masked half), and the MLP's 16C², or the
  // experts' (nn::moe::forward_flops); all over the tensor group.
  double forward_flops(dml::shape x) const {
    const gpt_dims d = dims(x);
    const double n = static_cast<double>(d.n), c = static_cast<double>(dim), p = static_cast<double>(ranks());
    const double keys = static_cast<double>(d.t * cp.ranks);
    const double attention = n * (8 * c * c + 4 * keys * c) / p;
    if (experts) return attention + experts->forward_flops({d.n, dim});
    return attention + n * 16 * c * c / p;
  }
  std::int64_t saved_bytes(dml::shape x, std::size_t value_bytes) const {
    detail::carver k;
    saved_parts(k, dims(x), value_bytes);
    return k.used;
  }
  std::int64_t stash_bytes(dml::shape x, std::size_t value_bytes) const {
    detail::carver k;
    if (value_bytes == 2) stash_parts<bf16>(k, dims(x));
    else stash_parts<float>(k, dims(x));
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
    check_cache<S>(kind, c, cp.ranks);
    const gpt_dims d = dims(x.shape);
    const std::int64_t C = dim, cp_ = dim / ranks(), fp = 4 * dim / ranks(), nl = d.n_local;
    const auto sv = saved_parts<T>(c.saved, d);
    const auto ws = work_parts<T>(c.workspace, d);
    const auto w = weights(p.w);
    // attention half
    for_each_row<S>(nl, kernels::layernorm_forward<T>{x.data, w.ln1_w, w.ln1_b, sv.h1, sv.stats1, C, eps}, C);
    const T* h1 = gather(c, static_cast<const T*>(sv.h1), ws.full1, nl * C);
    detail::linear_forward<S>(d.n, C, 3 * cp_, h1, w.qkv_w, w.qkv_b, sv.qkv);
    if (c.kv)
      c.kv->attend<S>(c.layer, attention(d), static_cast<const T*>(sv.qkv), sv.att, sv.lse);
    else if (ring())
      ring_attention_forward<S>(ring_shape(d), cp, c.cp, static_cast<const T*>(sv.qkv), sv.att, sv.lse, ws.scratch,
                                c.doc_start);
    else
      tile_attention_forward<S>(attention(d), static_cast<const T*>(sv.qkv), sv.att, sv.lse, c.doc_start);
    detail::linear_forward<S>(d.n, cp_, C, static_cast<const T*>(sv.att), w.proj_w, static_cast<const T*>(nullptr), ws.full2);
    const T* r1 = reduce(c, ws.full2, ws.part, nl * C);
    detail::token_rows<S>(nl, C, kernels::residual_dropout<T>{x.data, r1, w.proj_b, sv.x2, drop(c, d, 1)});
    // MLP half
    for_each_row<S>(nl, kernels::layernorm_forward<T>{sv.x2, w.ln2_w, w.ln2_b, sv.h2, sv.stats2, C, eps}, C);
    if (experts) {  // on this rank's token rows: the experts are whole here, nothing to gather or reduce
      moe_of(d).template forward_rows<S>(c, p.w + w.mlp, static_cast<const T*>(sv.h2), ws.part, nl, sv.moe, ws.moe,
                                         d.t * cp.ranks);
      detail::token_rows<S>(nl, C, kernels::residual_dropout<T>{sv.x2, ws.part, static_cast<const T*>(nullptr), y.data,
                                                             drop(c, d, 2)});
      return;
    }
    const T* h2 = gather(c, static_cast<const T*>(sv.h2), ws.full1, nl * C);
    detail::linear_forward<S>(d.n, C, fp, h2, w.fc_w, w.fc_b, sv.f);
    for_each_index<S>(d.n * fp, kernels::gelu_forward<T>{sv.f, sv.g});
    detail::linear_forward<S>(d.n, fp, C, static_cast<const T*>(sv.g), w.fc2_w, static_cast<const T*>(nullptr), ws.full2);
    const T* r2 = reduce(c, ws.full2, ws.part, nl * C);
    detail::token_rows<S>(nl, C, kernels::residual_dropout<T>{sv.x2, r2, w.fc2_b, y.data, drop(c, d, 2)});
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
    const bool sp = sequence();
    if (c.stash && c.weight_grads) {  // the weight pass: the products the input pass left, from its stash
      const auto st = stash_parts<T>(c.stash, d);
      if (!experts) {
        detail::linear_weight_grad<S>(d.n, fp, C, static_cast<const T*>(sv.g), static_cast<const T*>(st.dm), g.fc2_w, acc);
        detail::linear_weight_grad<S>(d.n, C, fp, static_cast<const T*>(sp ? st.h2 : sv.h2), static_cast<const T*>(st.big),
                                      g.fc_w, acc);
      }
      detail::linear_weight_grad<S>(d.n, cp_, C, static_cast<const T*>(sv.att), static_cast<const T*>(st.dp), g.proj_w, acc);
      detail::linear_weight_grad<S>(d.n, C, 3 * cp_, static_cast<const T*>(sp ? st.h1 : sv.h1), static_cast<const T*>(st.dqkv),
                                    g.qkv_w, acc);
      return;
    }
    // The input pass of a split backward writes what the weight pass reads straight into the stash.
    const stash_set<T> parts = c.stash ? stash_parts<T>(c.stash, d) : stash_set<T>{};
    const stash_set<T>* const st = c.stash ? &parts : nullptr;
    // MLP half: y = x2 + dropout(c_proj(gelu(c_fc(ln_2(x2)))) + b), or x2 + dropout(moe(ln_2(x2)))
    T* const da = st && !sp && !experts ? st->dm : ws.part_a;
    detail::token_rows<S>(nl, C, kernels::dropout_grad<T>{dy.data, da, drop(c, d, 2)});
    const T* dh2 = ws.part_b;
    if (experts) {
      moe_of(d).template backward_rows<S>(c, p.w + w.mlp, p.g + w.mlp, static_cast<const T*>(sv.h2),
                                          static_cast<const T*>(ws.part_a), ws.part_b, nl, sv.moe, ws.moe, d.t * cp.ranks);
    } else {
      if (g.fc2_b) detail::column_sums<S>(da, g.fc2_b, nl, C, acc);
      const T* dm = gather(c, static_cast<const T*>(da), st ? st->dm : ws.full1, nl * C);
      if (!st) detail::linear_weight_grad<S>(d.n, fp, C, static_cast<const T*>(sv.g), dm, g.fc2_w, acc);
      T* const big = st ? st->big : ws.big;
      detail::linear_input_grad<S>(d.n, fp, C, dm, w.fc2_w, big);
      for_each_index<S>(d.n * fp, kernels::gelu_backward_inplace<T>{sv.f, big});
      if (g.fc_b) detail::column_sums<S>(big, g.fc_b, d.n, fp, acc);
      if (!st) {
        const T* h2 = gather(c, static_cast<const T*>(sv.h2), ws.full2, nl * C);
        detail::linear_weight_grad<S>(d.n, C, fp, h2, static_cast<const T*>(big), g.fc_w, acc);
      } else if (sp) {
        gather(c, static_cast<const T*>(sv.h2), st->h2, nl * C);
      }
      detail::linear_input_grad<S>(d.n, C, fp, static_cast<const T*>(big), w.fc_w, ws.full3);
      dh2 = reduce(c, ws.full3, ws.part_b, nl * C);
    }
    layernorm_params_grad<S>(sv.x2, dh2, sv.stats2, g.ln2_w, g.ln2_b, nl, C, acc);
    for_each_row<S>(nl, kernels::layernorm_backward_input<T>{sv.x2, w.ln2_w, dh2, dy.data, sv.stats2, ws.dx2, C}, C);
    // attention half: x2 = x + dropout(c_proj(attn(c_attn(ln_1(x)))) + b)
    T* const dr = st && !sp ? st->dp : ws.part_a;
    detail::token_rows<S>(nl, C, kernels::dropout_grad<T>{ws.dx2, dr, drop(c, d, 1)});
    if (g.proj_b) detail::column_sums<S>(dr, g.proj_b, nl, C, acc);
    const T* dp = gather(c, static_cast<const T*>(dr), st ? st->dp : ws.full1, nl * C);
    if (!st) detail::linear_weight_grad<S>(d.n, cp_, C, static_cast<const T*>(sv.att), dp, g.proj_w, acc);
    detail::linear_input_grad<S>(d.n, cp_, C, dp, w.proj_w, ws.datt);
    T* const dqkv = st ? st->dqkv : ws.dqkv;
    if (ring())
      ring_attention_backward<S>(ring_shape(d), cp, c.cp, static_cast<const T*>(sv.qkv),
                                 static_cast<const T*>(sv.att), static_cast<const float*>(sv.lse),
                                 static_cast<const T*>(ws.datt), dqkv, ws.scratch, c.doc_start);
    else
      tile_attention_backward<S>(attention(d), static_cast<const T*>(sv.qkv), static_cast<const T*>(sv.att),
                                 static_cast<const float*>(sv.lse), static_cast<const T*>(ws.datt), dqkv, ws.tiles, c.doc_start);
    if (g.qkv_b) detail::column_sums<S>(dqkv, g.qkv_b, d.n, 3 * cp_, acc);
    if (!st) {
      const T* h1 = gather(c, static_cast<const T*>(sv.h1), ws.full2, nl * C);
      detail::linear_weight_grad<S>(d.n, C, 3 * cp_, h1, static_cast<const T*>(dqkv), g.qkv_w, acc);
    } else if (sp) {
      gather(c, static_cast<const T*>(sv.h1), st->h1, nl * C);
    }
    detail::linear_input_grad<S>(d.n, C, 3 * cp_, static_cast<const T*>(dqkv), w.qkv_w, ws.full3);
    const T* dh1 = reduce(c, ws.full3, ws.part_b, nl * C);
    layernorm_params_grad<S>(x.data, dh1, sv.stats1, g.ln1_w, g.ln1_b, nl, C, acc);
    if (dx.data)
      for_each_row<S>(nl, kernels::layernorm_backward_input<T>{x.data, w.ln1_w, dh1, ws.dx2, sv.stats1, dx.data, C}, C);
  }

 private:
  gpt_dims dims(const dml::shape& x) const {
    const std::int64_t t = sequence() ? x[1] * ranks() : x[1];
    return {x[0], t, x[0] * t, x[0] * x[1]};
  }
  tile_attention_shape attention(const gpt_dims& d) const {
    return {.batch = d.b, .seq = d.t, .heads = heads / ranks(), .head_dim = dim / heads};
  }
  // Context parallel: d.t is this rank's chunk of each sequence, and attention is ring attention.
  bool ring() const { return cp.ranks > 1; }
  ring_attention_shape ring_shape(const gpt_dims& d) const {
    return {.batch = d.b, .seq = d.t * cp.ranks, .heads = heads / ranks(), .head_dim = dim / heads, .causal = true};
  }
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
  // sequence parallelism, as Korthikanti et al. do), q k v, the attention's output and the log-sum-exp of each of
  // its rows (never the T × T probabilities), the residual between the halves, and c_fc's output before and after
  // GELU.
  template <class T>
  struct saved_set {
    kernels::row_stats *stats1, *stats2;
    T *h1, *qkv, *att, *x2, *h2, *f, *g;
    float* lse;      // a log-sum-exp per (batch, head, query row)
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
    if (ring()) s.lse = k.take<float>(ring_attention_saved_size(ring_shape(d), cp));
    else s.lse = k.take<float>(tile_attention_saved_size(attention(d)));
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
    float *moe, *tiles;
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
    if (ring()) w.scratch = k.take<T>(ring_attention_workspace_size(ring_shape(d), cp));
    else w.tiles = k.take<float>(tile_attention_workspace_size(attention(d)));
    return w;
  }
  void work_parts(detail::carver& k, const gpt_dims& d, std::size_t) const { work_parts<float>(k, d); }
  // What a split backward's input pass keeps for its weight pass: the output gradients of c_fc, the MLP's c_proj,
  // c_attn and the attention's c_proj (gathered over the tensor group), and under sequence parallelism the gathered
  // LayerNorm outputs that c_fc and c_attn multiply (the weight pass then needs no collective).
  template <class T>
  struct stash_set {
    T *dm, *big, *h2, *dp, *dqkv, *h1;
  };
  template <class T>
  stash_set<T> stash_parts(std::byte* base, const gpt_dims& d) const {
    detail::carver k{base};
    return stash_parts<T>(k, d);
  }
  template <class T>
  stash_set<T> stash_parts(detail::carver& k, const gpt_dims& d) const {
    const std::int64_t C = dim, cw = dim / ranks(), fp = 4 * dim / ranks();
    stash_set<T> s{};
    if (!experts) {
      s.dm = k.take<T>(d.n * C);
      s.big = k.take<T>(d.n * fp);
      if (sequence()) s.h2 = k.take<T>(d.n * C);
    }
    s.dp = k.take<T>(d.n * C);
    s.dqkv = k.take<T>(d.n * 3 * cw);
    if (sequence()) s.h1 = k.take<T>(d.n * C);
    return s;
  }
  // The experts sized for any rank of the expert group: data-parallel ranks hold at most one sequence more
  // than another (the sampler's split), so buffers allow for that many rows from each.
  nn::moe moe_of(const gpt_dims& d) const {
    nn::moe m = *experts;
    m.group_rows = d.n_local + d.n_local / std::max<std::int64_t>(d.b, 1);
    return m;
  }
};

}  // namespace dml::nn
