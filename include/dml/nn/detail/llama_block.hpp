// SPDX-License-Identifier: Apache-2.0
// dml/nn/detail/llama_block.hpp — nn::llama_block, Llama's pre-RMSNorm decoder block: grouped-query causal attention
// with rotary positions and a SwiGLU MLP, split over the tensor group and over a context-parallel ring (ring
// attention) as gpt_block is. Sits on nn/detail/gpt_common.hpp (split_part), nn/rmsnorm.hpp, nn/rope.hpp,
// nn/swiglu.hpp, nn/tile_attention.hpp and nn/ring_attention.hpp; used by nn/llama.hpp.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/buffer.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/gemm.hpp"
#include "dml/nn/detail/gpt_common.hpp"
#include "dml/nn/detail/rows.hpp"
#include "dml/nn/layer.hpp"
#include "dml/nn/kv_cache.hpp"
#include "dml/nn/llama_config.hpp"
#include "dml/nn/moe.hpp"
#include "dml/nn/ring_attention.hpp"
#include "dml/nn/rmsnorm.hpp"
#include "dml/nn/rope.hpp"
#include "dml/nn/swiglu.hpp"
#include "dml/nn/tile_attention.hpp"

namespace dml::nn {

namespace detail {
// The RoPE table of a configuration: rope_dim / 2 frequencies for positions [0, seq). One per model, shared by its
// blocks (and their copies).
inline std::shared_ptr<const rope_table> llama_rope_table(const llama_config& g) {
  return std::make_shared<const rope_table>(g.rope, g.rope_dim(), g.seq);
}
}  // namespace detail

namespace kernels {
// The position in its sequence of each token row (b, i) of a context-parallel rank's chunks: RoPE's angles.
struct token_positions {
  std::int64_t* out;
  token_place at;
  DML_HOST_DEVICE void operator()(std::int64_t t) const { out[t] = at.position(t); }
};

// Key/value heads shared by tensor ranks (tp > kv_heads, rep = tp / kv_heads ranks a head): a rank's qkv_proj rows
// are its query heads' (qw columns of its qkv row, `width` wide) and a slice of s = head_dim / rep columns of one key
// head and of one value head; the ranks group_first .. group_first + rep − 1 hold that head's slices, in order.
struct kv_share {
  std::int64_t n, width, qw, s, head_dim, rep, group_first;
  DML_HOST_DEVICE std::int64_t att() const { return qw + 2 * head_dim; }  // a row attention reads: q heads, k, v
};
// The rank's k and v slices as [n, 2s] rows, for the all-gather.
template <class T>
struct kv_pack {
  const T* qkv;
  T* out;
  kv_share k;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    out[i] = qkv[i / (2 * k.s) * k.width + k.qw + i % (2 * k.s)];
  }
};
// Attention's rows: the rank's query heads, then its whole key and value head from the gathered slices [tp, n, 2s].
template <class T>
struct kv_assemble {
  const T *qkv, *all;
  T* out;
  kv_share k;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t t = i / k.att(), c = i % k.att();
    if (c < k.qw) {
      out[i] = qkv[t * k.width + c];
      return;
    }
    const std::int64_t part = (c - k.qw) / k.head_dim, e = (c - k.qw) % k.head_dim;  // part 0: k, 1: v
    out[i] = all[((k.group_first + e / k.s) * k.n + t) * 2 * k.s + part * k.s + e % k.s];
  }
};
// Backward: the gradients of attention's key and value columns laid out [tp, n, 2s] for the reduce-scatter, each
// slice under the rank that holds it (zero under the ranks of other heads).
template <class T>
struct kv_spread {
  const T* datt;
  T* out;
  kv_share k;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t j = i / (k.n * 2 * k.s) - k.group_first, t = i / (2 * k.s) % k.n, c = i % (2 * k.s);
    out[i] = j < 0 || j >= k.rep ? T(0.f) : datt[t * k.att() + k.qw + c / k.s * k.head_dim + j * k.s + c % k.s];
  }
};
// The gradient of the rank's qkv rows: its query columns from attention's, its k and v slices summed over the ranks
// of its head ([n, 2s], reduce-scattered).
template <class T>
struct kv_unpack {
  const T *datt, *sums;
  T* dqkv;
  kv_share k;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t t = i / k.width, c = i % k.width;
    dqkv[i] = c < k.qw ? datt[t * k.att() + c] : sums[t * 2 * k.s + c - k.qw];
  }
};

// Multi-head latent attention's rows: q [n, heads·d] (d = nope + rope a head), kv_b_proj's [n, heads·(nope + v)] (a
// head's key columns without position, then its value), the shared rotated key [n, rope], and attention's q, k, v
// rows [n, 3·heads·d] with each value padded to d by zeros (the tile kernel reads one width for all three).
struct latent_geometry {
  std::int64_t heads, nope, rope, v;
  DML_HOST_DEVICE std::int64_t d() const { return nope + rope; }
  DML_HOST_DEVICE std::int64_t q_row() const { return heads * d(); }
  DML_HOST_DEVICE std::int64_t kv_row() const { return heads * (nope + v); }
};
template <class T>
struct latent_assemble {
  const T *q, *kv, *kr;
  T* out;
  latent_geometry g;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t t = i / (3 * g.q_row()), c = i % (3 * g.q_row()), part = c / g.q_row();
    const std::int64_t h = c % g.q_row() / g.d(), e = c % g.d();
    const T* kvh = kv + t * g.kv_row() + h * (g.nope + g.v);
    if (part == 0) out[i] = q[t * g.q_row() + c];
    else if (part == 1) out[i] = e < g.nope ? kvh[e] : kr[t * g.rope + e - g.nope];
    else out[i] = e < g.v ? kvh[g.nope + e] : T(0.f);
  }
};
// Back: kv_b_proj's output gradient from attention's dk and dv columns.
template <class T>
struct latent_dkv {
  const T* dqkv;
  T* dkv;
  latent_geometry g;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t t = i / g.kv_row(), h = i % g.kv_row() / (g.nope + g.v), e = i % (g.nope + g.v);
    const T* row = dqkv + t * 3 * g.q_row() + h * g.d();
    dkv[i] = e < g.nope ? row[g.q_row() + e] : row[2 * g.q_row() + e - g.nope];
  }
};
// Back: the shared rotated key's gradient, summed over the heads that read it.
template <class T>
struct latent_dkr {
  const T* dqkv;
  T* dkr;
  latent_geometry g;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t t = i / g.rope, e = i % g.rope;
    float sum = 0.f;
    for (std::int64_t h = 0; h < g.heads; ++h)
      sum += static_cast<float>(dqkv[t * 3 * g.q_row() + g.q_row() + h * g.d() + g.nope + e]);
    dkr[i] = round_to<T>(sum);
  }
};
// Attention's output [n, heads·d] (values padded) to o_proj's input [n, heads·v] (compact: from padded), and back
// (pad: the padding's gradient is zero).
template <class T>
struct latent_compact {
  const T* from;
  T* to;
  latent_geometry g;
  bool pad;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    if (pad) {
      const std::int64_t t = i / g.q_row(), h = i % g.q_row() / g.d(), e = i % g.d();
      to[i] = e < g.v ? from[t * g.heads * g.v + h * g.v + e] : T(0.f);
    } else {
      const std::int64_t t = i / (g.heads * g.v), h = i % (g.heads * g.v) / g.v, e = i % g.v;
      to[i] = from[t * g.q_row() + h * g.d() + e];
    }
  }
};
// The first `width` columns of rows `ld` apart: attention's dq from its dq, dk, dv rows.
template <class T>
struct leading_columns {
  const T* from;
  T* to;
  std::int64_t width, ld;
  DML_HOST_DEVICE void operator()(std::int64_t i) const { to[i] = from[i / width * ld + i % width]; }
};
// RoPE on `heads` heads of head_dim columns `stride` apart in rows r.ld apart, from r.qkv (the rotated part of each
// query head, or the one shared key).
template <class T>
struct rope_heads {
  rope_rotate<T> r;
  std::int64_t heads, stride;
  DML_HOST_DEVICE void operator()(std::int64_t e) const {
    const std::int64_t half = r.head_dim / 2, token = e / (heads * half), k = e % (heads * half), h = k / half;
    const std::int64_t p = r.position(token);
    r.rotate(r.qkv + token * r.ld + h * stride, r.cos + p * half, r.sin + p * half, k % half);
  }
};
}  // namespace kernels

// Sizes of one call of a llama block or head on input [B, T or T/p, C].
struct llama_dims {
  std::int64_t b = 0, t = 0, n = 0, n_local = 0;  // sequences, tokens per sequence, tokens, this rank's token rows
};

// x → x2 = x + o_proj(attn(rope(qkv_proj(rmsnorm(x))))), y = x2 + down_proj(swiglu(gate_up_proj(rmsnorm(x2)))).
//
// Parameters (Hugging Face's LlamaDecoderLayer names, q, k, v and gate, up each fused into one tensor):
//   input_layernorm.weight [C]; self_attn.qkv_proj.weight [(heads + 2·kv_heads)·head_dim, C], rows q_proj's
//   (heads·head_dim), then k_proj's, then v_proj's (kv_heads·head_dim each); self_attn.o_proj.weight [C, C];
//   post_attention_layernorm.weight [C]; mlp.gate_up_proj.weight [2·ffn_hidden, C], rows gate_proj's then up_proj's;
//   mlp.down_proj.weight [C, ffn_hidden]. No biases.
//
// Tensor parallelism (split.ranks = p): qkv_proj is column-parallel (a rank holds heads/p query heads and the
// kv_heads/p key/value heads they read, its rows [q part | k part | v part]), gate_up_proj column-parallel (a rank's
// gate columns and the up columns that pair with them), o_proj and down_proj row-parallel; one all-reduce per half in
// each pass. Where p exceeds kv_heads (a multiple of it), p / kv_heads ranks share each key/value head and each
// holds head_dim·kv_heads / p of its k and of its v rows, so every weight is still held once: forward all-gathers
// the group's k and v slices (n·2·kv_heads·head_dim values) and each rank attends with its whole head; backward
// reduce-scatters their gradients back to the slices' ranks. Sequence parallelism (split.sequence): RMSNorm and the residuals run on this rank's token rows, with
// all-gathers before the column-parallel products and reduce-scatters after the row-parallel ones, as gpt_block.
// Context parallelism (set_context_split): the block holds the rank's chunks of each sequence, RoPE turns each token
// by its position in the whole sequence (nn::cp_position), and attention is ring attention over the context group;
// K/V blocks of the kv_heads travel it.
//
// Multi-head latent attention (llama_config::latent(), DeepSeek-V2 and V3) in place of q, k, v: with rows cq =
// q_a_layernorm(q_a_proj(h)) (or h itself without q_lora_rank), q = q_b_proj(cq) gives each head qk_nope_dim columns
// and qk_rope_dim that RoPE turns; the latent c = kv_a_layernorm(kv_a_proj_with_mqa(h)'s first kv_lora_rank columns)
// gives kv_b_proj(c), each head's key columns and its value, and kv_a_proj_with_mqa's last qk_rope_dim columns, turned
// by RoPE, are the rest of every head's key. Attention is the tile kernel over heads of qk_nope_dim + qk_rope_dim
// with each value padded by zeros to that width (its scale 1/sqrt of it); o_proj reads the heads' v_head_dim columns.
// Parameters (Hugging Face's DeepseekV3 names): input_layernorm.weight; self_attn.q_a_proj.weight [q_lora_rank, C],
// q_a_layernorm.weight, q_b_proj.weight [heads·(nope + rope), q_lora_rank] (or q_proj.weight [heads·(nope + rope), C]);
// kv_a_proj_with_mqa.weight [kv_lora_rank + rope, C], kv_a_layernorm.weight, kv_b_proj.weight [heads·(nope + v),
// kv_lora_rank]; o_proj.weight [C, heads·v]; then the MLP's as above. RoPE turns the rotated columns' halves
// (rotate-half), not Hugging Face's interleaved pairs. Such a block runs on one tensor rank and one context rank (the
// layouts DeepSeek-V3 trains with: pipeline, experts and data parallelism) and without a KV cache; the projections'
// weight gradients are the input pass's in a split backward.
struct llama_block : detail::split_part {
  static constexpr std::int64_t static_in = dynamic;
  static constexpr std::int64_t static_out = dynamic;
  static constexpr bool preserves_width = true;
  // Split backward (zb): the input pass leaves the four weight products to the weight pass, keeping their output
  // gradients, and under sequence parallelism their gathered inputs, in its stash (stash_bytes).
  static constexpr bool splits_backward = true;
  static constexpr const char* kind = "llama_block";
  std::int64_t dim = 0, heads = 0, kv_heads = 0, head_dim = 0, ffn = 0;
  std::int64_t q_rank = 0, kv_rank = 0, nope = 0, rope_d = 0, v_dim = 0;  // latent attention (kv_rank > 0)
  float eps = 1e-5f;
  bool selective = false;  // selective recompute: RMSNorm's and SwiGLU's outputs recomputed in backward, not kept
  std::shared_ptr<const rope_table> rope;
  context_split cp{};  // context parallel: attention is ring attention over the context group
  // A mixture of SwiGLU experts in place of the MLP (its parameters are "mlp.router.weight", "mlp.experts.…").
  std::optional<nn::moe> experts;

  // table: the model's RoPE table (nn::llama shares one among its blocks); null builds this block's own.
  // with_experts: this block's MLP is a mixture of g.experts experts.
  explicit llama_block(const llama_config& g, std::shared_ptr<const rope_table> table = {}, bool with_experts = false)
      : dim(g.d_model), heads(g.heads), kv_heads(g.latent() ? g.heads : g.kv_heads), head_dim(g.head_dim()),
        ffn(g.ffn_hidden), q_rank(g.q_lora_rank), kv_rank(g.kv_lora_rank), nope(g.qk_nope_dim), rope_d(g.qk_rope_dim),
        v_dim(g.v_head_dim), eps(g.norm_eps), selective(g.selective_recompute), rope(std::move(table)) {
    g.validate();
    if (!rope) rope = detail::llama_rope_table(g);
    if (rope->half != g.rope_dim() / 2)
      fail<invalid_argument>("dml::nn::llama_block: expected a RoPE table of ", g.latent() ? "qk_rope_dim" : "head_dim",
                             " / 2 = ", g.rope_dim() / 2, " frequencies, found ", rope->half);
    if (with_experts)
      experts.emplace(moe_config{.dim = dim, .hidden = g.expert_ffn > 0 ? g.expert_ffn : ffn, .experts = g.experts,
                                 .top_k = g.top_k, .capacity_factor = g.capacity_factor,
                                 .aux_loss_weight = g.aux_loss_weight, .z_loss_weight = g.z_loss_weight,
                                 .mlp = expert_mlp::swiglu, .shared = g.shared_experts,
                                 .score = g.sigmoid_router ? router_score::sigmoid : router_score::softmax,
                                 .bias_rate = g.router_bias_rate});
  }
  void set_split(tensor_split s) {
    split = s;
    check_split(kind);
    if (latent() && s.ranks > 1)
      fail<invalid_argument>("dml::nn::llama_block: latent attention runs on one tensor rank, found tensor parallelism "
                             "over ", s.ranks, " (DeepSeek-V3's layouts: pipeline, experts and data parallelism)");
    check_divides(kind, "the heads", heads, s.ranks);
    if (s.ranks > kv_heads && s.ranks % kv_heads == 0)  // key/value heads shared by ranks: each holds a slice
      check_divides(kind, "the key/value heads' columns kv_heads·head_dim", kv_heads * head_dim, s.ranks);
    else if (s.ranks > 1 && kv_heads % s.ranks != 0)
      fail<invalid_argument>("dml::nn::", kind, ": tensor parallelism over ", s.ranks,
                             " ranks needs the key/value heads divisible by ", s.ranks, " or dividing it, found ",
                             kv_heads);
    if (experts) experts->set_split(s);  // experts stay whole on every tensor rank
    else check_divides(kind, "ffn_hidden", ffn, s.ranks);
  }
  void set_expert_split(int ranks, int rank, int batch_ranks = 0) {
    if (experts) experts->set_expert_split(ranks, rank, batch_ranks);
  }
  void set_context_split(context_split s) {
    if (latent() && s.ranks > 1)
      fail<invalid_argument>("dml::nn::llama_block: latent attention runs on one context rank, found context "
                             "parallelism over ", s.ranks);
    cp = s;
  }
  bool latent() const { return kv_rank > 0; }

  std::vector<param_spec> parameters() const {
    const std::int64_t c = dim, p = ranks(), q = heads * head_dim, kv = kv_heads * head_dim;
    const bool sp = sequence();
    param_shard qkv = shard(q + 2 * kv, c, 0, 3);
    qkv.lead = q;
    const auto normal = [](std::string name, dml::shape shape, param_shard sh = {}) {
      return param_spec{std::move(name), shape, init_kind::normal, 0.f, 0.02f, sh};
    };
    const auto ones = [](std::string name, std::int64_t n, bool partial = false) {
      return param_spec{std::move(name), {n}, init_kind::ones, 0.f, 0.f, {}, partial};
    };
    std::vector<param_spec> out{ones("input_layernorm.weight", c, sp)};
    if (latent()) {
      if (q_rank > 0) {
        out.push_back(normal("self_attn.q_a_proj.weight", {q_rank, c}));
        out.push_back(ones("self_attn.q_a_layernorm.weight", q_rank));
        out.push_back(normal("self_attn.q_b_proj.weight", {q, q_rank}));
      } else {
        out.push_back(normal("self_attn.q_proj.weight", {q, c}));
      }
      out.push_back(normal("self_attn.kv_a_proj_with_mqa.weight", {kv_rank + rope_d, c}));
      out.push_back(ones("self_attn.kv_a_layernorm.weight", kv_rank));
      out.push_back(normal("self_attn.kv_b_proj.weight", {heads * (nope + v_dim), kv_rank}));
      out.push_back(normal("self_attn.o_proj.weight", {c, heads * v_dim}));
    } else {
      out.push_back(normal("self_attn.qkv_proj.weight", {(q + 2 * kv) / p, c}, qkv));
      out.push_back(normal("self_attn.o_proj.weight", {c, q / p}, shard(c, q, 1)));
    }
    out.push_back(ones("post_attention_layernorm.weight", c, sp));
    if (experts) {
      for (auto spec : experts->parameters()) {
        spec.name = "mlp." + spec.name;
        out.push_back(std::move(spec));
      }
      return out;
    }
    out.push_back(normal("mlp.gate_up_proj.weight", {2 * ffn / p, c}, shard(2 * ffn, c, 0, 2)));
    out.push_back(normal("mlp.down_proj.weight", {c, ffn / p}, shard(c, ffn, 1)));
    return out;
  }
  dml::shape output_shape(dml::shape x) const {
    if (x.rank != 3 || x[2] != dim)
      fail<shape_error>("dml::nn::llama_block: expected [batch, T, ", dim, "], found shape ", x);
    if (dims(x).t * cp.ranks > rope->positions)
      fail<shape_error>("dml::nn::llama_block: expected T <= seq = ", rope->positions, ", found T = ", dims(x).t * cp.ranks);
    return x;
  }
  // This rank's products per token: qkv_proj 2·C·(heads + 2·kv_heads)·head_dim, o_proj 2·C², q·kᵀ and p·v over every
  // key 4·T·C (the whole T × T, as model FLOPs count it), gate_up_proj 4·C·F and down_proj 2·F·C; all over the group.
  // With experts, theirs in place of the MLP's (nn::moe::forward_flops), whole on every tensor rank. Latent attention:
  // its five products (latent_flops_per_token) and q·kᵀ over heads·(nope + rope) columns and p·v over heads·v.
  double forward_flops(dml::shape x) const {
    const llama_dims d = dims(x);
    const double n = static_cast<double>(d.n), c = static_cast<double>(dim), p = static_cast<double>(ranks());
    const double qkv = static_cast<double>((heads + 2 * kv_heads) * head_dim), f = static_cast<double>(ffn);
    const double t = static_cast<double>(d.t * cp.ranks);
    const double attention = latent() ? latent_flops_per_token(t)
                                      : 2 * c * qkv + 2 * c * c + 4 * t * c;
    if (experts) return n * attention / p + experts->forward_flops({d.n, dim});
    return n * (attention + 6 * c * f) / p;
  }
  // A latent attention's forward FLOPs per token over sequences of t: q_a_proj and q_b_proj (or q_proj),
  // kv_a_proj_with_mqa, kv_b_proj, o_proj, and attention's two products over every key.
  double latent_flops_per_token(double t) const {
    const double c = static_cast<double>(dim), h = static_cast<double>(heads), qd = static_cast<double>(head_dim);
    const double q = q_rank > 0 ? 2 * static_cast<double>(q_rank) * (c + h * qd) : 2 * c * h * qd;
    const double kv = 2 * c * static_cast<double>(kv_rank + rope_d) +
                      2 * static_cast<double>(kv_rank) * h * static_cast<double>(nope + v_dim);
    return q + kv + 2 * h * static_cast<double>(v_dim) * c + 2 * t * h * (qd + static_cast<double>(v_dim));
  }
  std::int64_t saved_bytes(dml::shape x, std::size_t value_bytes) const {
    detail::carver k;
    if (value_bytes == 2) saved_parts<bf16>(k, dims(x));
    else saved_parts<float>(k, dims(x));
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
    work_parts<float>(k, dims(x));  // floats: enough for any working type
    return k.used / 4;
  }

  template <execution_space S, class T>
  void forward(const context& c, layer_params<T> p, tensor_view<const T, S> x, tensor_view<T, S> y) const {
    check_group(kind, c, ranks());
    check_ring(c);
    check_cache<S>(kind, c, cp.ranks);
    if (latent() && c.kv)
      fail<invalid_argument>("dml::nn::llama_block: latent attention keeps no KV cache; decode with a forward over the "
                             "whole window");
    const llama_dims d = dims(x.shape);
    const std::int64_t C = dim, nl = d.n_local, qw = o_width(), qkv_w = width(), fp = ffn / ranks();
    const auto ws = work_parts<T>(c.workspace, d);
    const auto sv = kept_parts<T>(c.saved, ws, d);
    const auto w = weights(p.w);
    // attention half: x2 = x + o_proj(attn(rope(qkv_proj(rmsnorm(x)))))
    rmsnorm_forward<S>(x.data, w.ln1, sv.h1, sv.rrms1, nl, C, eps);
    const T* h1 = gather(c, static_cast<const T*>(sv.h1), ws.full1, nl * C);
    if (latent()) {
      latent_forward<S>(c, d, w, h1, sv, ws);
    } else {
      T* const qkv = shares_kv() ? ws.qkv : sv.qkv;
      detail::linear_forward<S>(d.n, C, qkv_w, h1, w.qkv, static_cast<const T*>(nullptr), qkv);
      if (shares_kv()) gather_kv<S>(c, d, static_cast<const T*>(qkv), ws, sv.qkv);
      rope_forward<S>(rope_dims(d), sv.qkv, table<S>(ws), c.kv ? c.kv->positions(d.b, d.t) : positions<S>(ws, d));
      if (c.kv)
        c.kv->attend<S>(c.layer, attention(d), static_cast<const T*>(sv.qkv), sv.att, sv.lse);
      else if (ring())
        ring_attention_forward<S>(ring_shape(d), cp, c.cp, static_cast<const T*>(sv.qkv), sv.att, sv.lse, ws.scratch,
                                  c.doc_start);
      else
        tile_attention_forward<S>(attention(d), static_cast<const T*>(sv.qkv), sv.att, sv.lse, c.doc_start);
    }
    // The row-parallel product's partial sums land where their sum goes (in place, or reduce-scattered there).
    T* o = sequence() ? ws.full2 : sv.x2;
    detail::linear_forward<S>(d.n, qw, C, static_cast<const T*>(sv.att), w.o, static_cast<const T*>(nullptr), o);
    reduce(c, o, sv.x2, nl * C);
    residual_rmsnorm_forward<S>(sv.x2, x.data, w.ln2, sv.h2, sv.rrms2, nl, C, eps);
    if (experts) {  // on this rank's token rows: the experts are whole here, nothing to gather or reduce
      moe_of(d).template forward_rows<S>(c, p.w + mlp_index(), static_cast<const T*>(sv.h2), ws.part, nl, sv.moe, ws.moe,
                                         d.t * cp.ranks);
      detail::token_rows<S>(nl, C, kernels::residual_dropout<T>{sv.x2, static_cast<const T*>(ws.part), nullptr, y.data,
                                                             no_dropout()});
      return;
    }
    // MLP half: y = x2 + down_proj(silu(gate) ⊙ up), [gate | up] = gate_up_proj(rmsnorm(x2))
    const T* h2 = gather(c, static_cast<const T*>(sv.h2), ws.full1, nl * C);
    detail::linear_forward<S>(d.n, C, 2 * fp, h2, w.gate_up, static_cast<const T*>(nullptr), sv.gu);
    swiglu_forward<S>(static_cast<const T*>(sv.gu), sv.a, d.n, fp);
    T* m = sequence() ? ws.full2 : y.data;
    detail::linear_forward<S>(d.n, fp, C, static_cast<const T*>(sv.a), w.down, static_cast<const T*>(nullptr), m);
    const T* r2 = reduce(c, m, ws.part, nl * C);
    detail::token_rows<S>(nl, C, kernels::residual_dropout<T>{sv.x2, r2, nullptr, y.data, no_dropout()});
  }

  template <execution_space S, class T>
  void backward(const context& c, layer_params<T> p, tensor_view<const T, S> x, tensor_view<const T, S>,
                tensor_view<const T, S> dy, tensor_view<T, S> dx) const {
    const llama_dims d = dims(x.shape);
    const std::int64_t C = dim, nl = d.n_local, qw = o_width(), qkv_w = width(), fp = ffn / ranks();
    const auto ws = work_parts<T>(c.workspace, d);
    const auto sv = kept_parts<T>(c.saved, ws, d);
    const auto w = weights(p.w);
    const auto g = weights(p.g);
    const bool acc = c.accumulate, sp = sequence();
    if (selective) {  // what forward did not keep, again from what it did: the same kernels on the same inputs
      rmsnorm_forward<S>(x.data, static_cast<const T*>(w.ln1), sv.h1, nullptr, nl, C, eps);
      rmsnorm_forward<S>(static_cast<const T*>(sv.x2), static_cast<const T*>(w.ln2), sv.h2, nullptr, nl, C, eps);
      if (!experts) swiglu_forward<S>(static_cast<const T*>(sv.gu), sv.a, d.n, fp);
    }
    if (c.stash && c.weight_grads) {  // the weight pass: the products the input pass left, from its stash
      const auto st = stash_parts<T>(c.stash, d);
      if (!experts) {
        detail::linear_weight_grad<S>(d.n, fp, C, static_cast<const T*>(sv.a), static_cast<const T*>(st.dm), g.down, acc);
        detail::linear_weight_grad<S>(d.n, C, 2 * fp, static_cast<const T*>(sp ? st.h2 : sv.h2),
                                      static_cast<const T*>(st.dgu), g.gate_up, acc);
      }
      detail::linear_weight_grad<S>(d.n, qw, C, static_cast<const T*>(sv.att), static_cast<const T*>(st.dp), g.o, acc);
      if (!latent())  // latent attention's projections took theirs in the input pass
        detail::linear_weight_grad<S>(d.n, C, qkv_w, static_cast<const T*>(sp ? st.h1 : sv.h1),
                                      static_cast<const T*>(st.dqkv), g.qkv, acc);
      return;
    }
    // The input pass of a split backward writes what the weight pass reads straight into the stash.
    const stash_set<T> parts = c.stash ? stash_parts<T>(c.stash, d) : stash_set<T>{};
    const stash_set<T>* const st = c.stash ? &parts : nullptr;
    // MLP half. The branch's output gradient is dy itself (gathered under sequence parallelism). Experts take
    // this rank's rows and compute their weight gradients at once.
    const T* dh2 = ws.part;
    if (experts)
      moe_of(d).template backward_rows<S>(c, p.w + mlp_index(), p.g + mlp_index(), static_cast<const T*>(sv.h2), dy.data,
                                          ws.part, nl, sv.moe,
                                          ws.moe, d.t * cp.ranks);
    else
      dh2 = dense_mlp_backward<S>(c, d, w, g, dy.data, st, sv, ws, acc);
    // dx2 = dy + rmsnorm's input gradient: the residual stream's gradient, and the attention branch's output gradient.
    T* const dx2 = st && !sp ? st->dp : ws.dx2;
    rmsnorm_backward<S>(static_cast<const T*>(sv.x2), static_cast<const T*>(w.ln2), static_cast<const float*>(sv.rrms2),
                        dh2, dy.data, dx2, g.ln2, nl, C, acc);
    // attention half
    const T* dp = gather(c, static_cast<const T*>(dx2), st ? st->dp : ws.full1, nl * C);
    if (!st) detail::linear_weight_grad<S>(d.n, qw, C, static_cast<const T*>(sv.att), dp, g.o, acc);
    detail::linear_input_grad<S>(d.n, qw, C, dp, w.o, ws.datt);
    if (latent()) {
      latent_backward<S>(c, d, w, g, static_cast<const T*>(sv.h1), sv, ws, acc);
      rmsnorm_backward<S>(x.data, static_cast<const T*>(w.ln1), static_cast<const float*>(sv.rrms1),
                          static_cast<const T*>(ws.full3), static_cast<const T*>(dx2), dx.data, g.ln1, nl, C, acc);
      return;
    }
    T* const dqkv = st ? st->dqkv : ws.dqkv;
    T* const datt = shares_kv() ? ws.dqkv_att : dqkv;  // attention's q, k, v gradients (whole key/value heads)
    if (ring())
      ring_attention_backward<S>(ring_shape(d), cp, c.cp, static_cast<const T*>(sv.qkv), static_cast<const T*>(sv.att),
                                 static_cast<const float*>(sv.lse), static_cast<const T*>(ws.datt), datt, ws.scratch,
                                 c.doc_start);
    else
      tile_attention_backward<S>(attention(d), static_cast<const T*>(sv.qkv), static_cast<const T*>(sv.att),
                                 static_cast<const float*>(sv.lse), static_cast<const T*>(ws.datt), datt, ws.tiles,
                                 c.doc_start);
    rope_backward<S>(rope_dims(d), datt, table<S>(ws), positions<S>(ws, d));
    if (shares_kv()) scatter_kv<S>(c, d, static_cast<const T*>(datt), ws, dqkv);
    if (!st) {
      const T* h1 = gather(c, static_cast<const T*>(sv.h1), ws.full2, nl * C);
      detail::linear_weight_grad<S>(d.n, C, qkv_w, h1, static_cast<const T*>(dqkv), g.qkv, acc);
    } else if (sp) {
      gather(c, static_cast<const T*>(sv.h1), st->h1, nl * C);
    }
    detail::linear_input_grad<S>(d.n, C, qkv_w, static_cast<const T*>(dqkv), w.qkv, ws.full3);
    const T* dh1 = reduce(c, ws.full3, ws.part, nl * C);
    rmsnorm_backward<S>(x.data, static_cast<const T*>(w.ln1), static_cast<const float*>(sv.rrms1), dh1,
                        static_cast<const T*>(dx2), dx.data, g.ln1, nl, C, acc);
  }

 private:
  // Latent attention's forward from the block's normed input h (one tensor rank: every token's row here): sv.qkv,
  // attention's output (sv.att_pad) and o_proj's input (sv.att).
  template <execution_space S, class T, class R, class Sv, class Ws>
  void latent_forward(const context& c, const llama_dims& d, const R& w, const T* h, const Sv& sv, const Ws& ws) const {
    const std::int64_t C = dim, n = d.n, q = heads * head_dim;
    const auto geo = latent_geo();
    const T* none = nullptr;
    if (q_rank > 0) {
      detail::linear_forward<S>(n, C, q_rank, h, w.qa, none, sv.cq);
      rmsnorm_forward<S>(static_cast<const T*>(sv.cq), static_cast<const T*>(w.qan), sv.cqn, sv.rrms_q, n, q_rank, eps);
      detail::linear_forward<S>(n, q_rank, q, static_cast<const T*>(sv.cqn), w.qb, none, ws.q);
    } else {
      detail::linear_forward<S>(n, C, q, h, w.qb, none, ws.q);
    }
    // kv_a_proj_with_mqa's rows: the latent's kv_rank, then the shared key's rope_d (two products of its two row blocks)
    detail::linear_forward<S>(n, C, kv_rank, h, w.kva, none, sv.ckv);
    detail::linear_forward<S>(n, C, rope_d, h, static_cast<const T*>(w.kva + kv_rank * C), none, ws.kr);
    rmsnorm_forward<S>(static_cast<const T*>(sv.ckv), static_cast<const T*>(w.kvan), sv.ckvn, sv.rrms_kv, n, kv_rank, eps);
    detail::linear_forward<S>(n, kv_rank, geo.kv_row(), static_cast<const T*>(sv.ckvn), w.kvb, none, ws.kv);
    rotate_latent<S>(d, ws, 1.f);
    for_each_index<S>(n * 3 * q, kernels::latent_assemble<T>{ws.q, ws.kv, ws.kr, sv.qkv, geo});
    tile_attention_forward<S>(attention(d), static_cast<const T*>(sv.qkv), sv.att_pad, sv.lse, c.doc_start);
    for_each_index<S>(n * heads * v_dim, kernels::latent_compact<T>{sv.att_pad, sv.att, geo, false});
  }
  // Back from o_proj's input gradient (ws.datt) to the normed input's (ws.full3), every projection's weight gradient
  // taken on the way.
  template <execution_space S, class T, class R, class Sv, class Ws>
  void latent_backward(const context& c, const llama_dims& d, const R& w, const R& g, const T* h, const Sv& sv,
                       const Ws& ws, bool acc) const {
    const std::int64_t C = dim, n = d.n, q = heads * head_dim;
    const auto geo = latent_geo();
    for_each_index<S>(n * q, kernels::latent_compact<T>{ws.datt, ws.datt_pad, geo, true});
    tile_attention_backward<S>(attention(d), static_cast<const T*>(sv.qkv), static_cast<const T*>(sv.att_pad),
                               static_cast<const float*>(sv.lse), static_cast<const T*>(ws.datt_pad), ws.dqkv, ws.tiles,
                               c.doc_start);
    for_each_index<S>(n * q, kernels::leading_columns<T>{ws.dqkv, ws.q, q, 3 * q});
    for_each_index<S>(n * geo.kv_row(), kernels::latent_dkv<T>{ws.dqkv, ws.kv, geo});
    for_each_index<S>(n * rope_d, kernels::latent_dkr<T>{ws.dqkv, ws.kr, geo});
    rotate_latent<S>(d, ws, -1.f);
    // keys and values: kv_b_proj, kv_a_layernorm, kv_a_proj_with_mqa's two row blocks
    detail::linear_weight_grad<S>(n, kv_rank, geo.kv_row(), static_cast<const T*>(sv.ckvn), static_cast<const T*>(ws.kv),
                                  g.kvb, acc);
    detail::linear_input_grad<S>(n, kv_rank, geo.kv_row(), static_cast<const T*>(ws.kv), w.kvb, ws.dlat);
    rmsnorm_backward<S>(static_cast<const T*>(sv.ckv), static_cast<const T*>(w.kvan), static_cast<const float*>(sv.rrms_kv),
                        static_cast<const T*>(ws.dlat), static_cast<const T*>(nullptr), ws.dlat2, g.kvan, n, kv_rank, acc);
    detail::linear_weight_grad<S>(n, C, kv_rank, h, static_cast<const T*>(ws.dlat2), g.kva, acc);
    detail::linear_weight_grad<S>(n, C, rope_d, h, static_cast<const T*>(ws.kr), g.kva + kv_rank * C, acc);
    detail::linear_input_grad<S>(n, C, kv_rank, static_cast<const T*>(ws.dlat2), w.kva, ws.full3);
    detail::linear_input_grad<S>(n, C, rope_d, static_cast<const T*>(ws.kr), static_cast<const T*>(w.kva + kv_rank * C),
                                 ws.full3, true);
    // queries
    if (q_rank > 0) {
      detail::linear_weight_grad<S>(n, q_rank, q, static_cast<const T*>(sv.cqn), static_cast<const T*>(ws.q), g.qb, acc);
      detail::linear_input_grad<S>(n, q_rank, q, static_cast<const T*>(ws.q), w.qb, ws.dq1);
      rmsnorm_backward<S>(static_cast<const T*>(sv.cq), static_cast<const T*>(w.qan), static_cast<const float*>(sv.rrms_q),
                          static_cast<const T*>(ws.dq1), static_cast<const T*>(nullptr), ws.dq2, g.qan, n, q_rank, acc);
      detail::linear_weight_grad<S>(n, C, q_rank, h, static_cast<const T*>(ws.dq2), g.qa, acc);
      detail::linear_input_grad<S>(n, C, q_rank, static_cast<const T*>(ws.dq2), w.qa, ws.full3, true);
    } else {
      detail::linear_weight_grad<S>(n, C, q, h, static_cast<const T*>(ws.q), g.qb, acc);
      detail::linear_input_grad<S>(n, C, q, static_cast<const T*>(ws.q), w.qb, ws.full3, true);
    }
  }
  // RoPE on the queries' rotated columns (ws.q) and the shared key (ws.kr), forward (sign 1) or back (−1).
  template <execution_space S, class Ws>
  void rotate_latent(const llama_dims& d, const Ws& ws, float sign) const {
    using T = std::remove_pointer_t<decltype(ws.q)>;
    const rope_table_view rt = table<S>(ws);
    const std::int64_t half = rope_d / 2, q = heads * head_dim;
    const auto turn = [&](T* base, std::int64_t ld, std::int64_t n_heads, std::int64_t stride) {
      for_each_index<S>(d.n * n_heads * half,
                        kernels::rope_heads<T>{{base, rt.cos, rt.sin, nullptr, d.t, ld, rope_d, n_heads * half, sign},
                                               n_heads, stride});
    };
    turn(ws.q + nope, q, heads, head_dim);
    turn(ws.kr, rope_d, 1, 0);
  }
  kernels::latent_geometry latent_geo() const { return {.heads = heads, .nope = nope, .rope = rope_d, .v = v_dim}; }
  // o_proj's input row: this rank's heads' values.
  std::int64_t o_width() const { return heads * (latent() ? v_dim : head_dim) / ranks(); }
  // The index of the MLP's (or the experts') first parameter.
  std::int64_t mlp_index() const { return (latent() ? (q_rank > 0 ? 6 : 4) : 1) + 3; }

  // The dense MLP's backward (stash: a split backward's input pass): rmsnorm(x2)'s gradient, in ws.part.
  template <execution_space S, class T, class R, class St, class Sv, class Ws>
  const T* dense_mlp_backward(const context& c, const llama_dims& d, const R& w, const R& g, const T* dy, const St* st,
                              const Sv& sv, const Ws& ws, bool acc) const {
    const std::int64_t C = dim, nl = d.n_local, fp = ffn / ranks();
    const bool sp = sequence();
    const T* dm = dy;
    if (sp) {
      dm = gather(c, dy, st ? st->dm : ws.full1, nl * C);
    } else if (st) {
      dml::copy_n(dy, static_cast<std::size_t>(nl * C), st->dm);
      dm = st->dm;
    }
    if (!st) detail::linear_weight_grad<S>(d.n, fp, C, static_cast<const T*>(sv.a), dm, g.down, acc);
    detail::linear_input_grad<S>(d.n, fp, C, dm, w.down, ws.da);
    T* const dgu = st ? st->dgu : ws.dgu;
    swiglu_backward<S>(static_cast<const T*>(sv.gu), static_cast<const T*>(ws.da), dgu, d.n, fp);
    if (!st) {
      const T* h2 = gather(c, static_cast<const T*>(sv.h2), ws.full2, nl * C);
      detail::linear_weight_grad<S>(d.n, C, 2 * fp, h2, static_cast<const T*>(dgu), g.gate_up, acc);
    } else if (sp) {
      gather(c, static_cast<const T*>(sv.h2), st->h2, nl * C);
    }
    detail::linear_input_grad<S>(d.n, C, 2 * fp, static_cast<const T*>(dgu), w.gate_up, ws.full3);
    return reduce(c, ws.full3, ws.part, nl * C);
  }

  llama_dims dims(const dml::shape& x) const {
    const std::int64_t t = sequence() ? x[1] * ranks() : x[1];
    return {x[0], t, x[0] * t, x[0] * x[1]};
  }
  // A row of this rank's qkv_proj: its query heads, then the key and value heads they read (or, where ranks share
  // them, its slices of one key and one value head).
  std::int64_t width() const { return (heads + 2 * kv_heads) * head_dim / ranks(); }
  // More ranks than key/value heads: ranks() / kv_heads ranks share each one.
  bool shares_kv() const { return ranks() > kv_heads; }
  // The key/value heads this rank's attention reads, and its row of q, k, v there.
  std::int64_t local_kv() const { return shares_kv() ? 1 : kv_heads / ranks(); }
  std::int64_t attention_width() const { return (heads / ranks() + 2 * local_kv()) * head_dim; }
  kernels::kv_share kv_geometry(const llama_dims& d) const {
    const std::int64_t rep = ranks() / kv_heads;
    return {.n = d.n, .width = width(), .qw = heads / ranks() * head_dim, .s = head_dim / rep, .head_dim = head_dim,
            .rep = rep, .group_first = split.rank / rep * rep};
  }
  // Attention's q, k, v rows from this rank's qkv_proj rows: one all-gather of the group's k and v slices.
  template <execution_space S, class T, class W>
  void gather_kv(const context& c, const llama_dims& d, const T* qkv, const W& ws, T* out) const {
    const kernels::kv_share k = kv_geometry(d);
    for_each_index<S>(d.n * 2 * k.s, kernels::kv_pack<T>{qkv, ws.kv_part, k});
    c.tp->all_gather(const_typed_ptr(static_cast<const T*>(ws.kv_part)), typed_ptr(ws.kv_all), d.n * 2 * k.s);
    for_each_index<S>(d.n * k.att(), kernels::kv_assemble<T>{qkv, ws.kv_all, out, k});
  }
  // Back: the gradient of this rank's qkv_proj rows, its k and v slices summed over the ranks of its head (one
  // reduce-scatter).
  template <execution_space S, class T, class W>
  void scatter_kv(const context& c, const llama_dims& d, const T* datt, const W& ws, T* dqkv) const {
    const kernels::kv_share k = kv_geometry(d);
    for_each_index<S>(ranks() * d.n * 2 * k.s, kernels::kv_spread<T>{datt, ws.kv_all, k});
    c.tp->reduce_scatter(const_typed_ptr(static_cast<const T*>(ws.kv_all)), typed_ptr(ws.kv_part), d.n * 2 * k.s);
    for_each_index<S>(d.n * width(), kernels::kv_unpack<T>{datt, ws.kv_part, dqkv, k});
  }
  tile_attention_shape attention(const llama_dims& d) const {
    return {.batch = d.b, .seq = d.t, .heads = heads / ranks(), .kv_heads = local_kv(), .head_dim = head_dim,
            .causal = true};
  }
  rope_shape rope_dims(const llama_dims& d) const {
    return {.batch = d.b, .seq = d.t, .heads = heads / ranks(), .kv_heads = local_kv(), .head_dim = head_dim};
  }
  // Context parallel: d.t is this rank's chunks of each sequence, and attention is ring attention.
  bool ring() const { return cp.ranks > 1; }
  ring_attention_shape ring_shape(const llama_dims& d) const {
    return {.batch = d.b, .seq = d.t * cp.ranks, .heads = heads / ranks(), .kv_heads = local_kv(),
            .head_dim = head_dim, .causal = true};
  }
  void check_ring(const context& c) const {
    if (ring() && (!c.cp || c.cp->size() != cp.ranks || c.cp->rank() != cp.rank))
      fail<invalid_argument>("dml::nn::llama_block: split over ", cp.ranks, " context-parallel ranks but the context's "
                             "group has ", c.cp ? c.cp->size() : 0, " (a trainer with context_parallel sets it)");
  }
  // RoPE's positions: null (a token's index in its sequence), or under context parallelism each local token's
  // position in the whole sequence, written into the workspace.
  template <execution_space S, class W>
  const std::int64_t* positions(const W& ws, const llama_dims& d) const {
    if (!ring()) return nullptr;
    for_each_index<S>(d.n, kernels::token_positions{ws.positions, {d.t * cp.ranks, d.t, cp}});
    return ws.positions;
  }
  kernels::token_dropout no_dropout() const { return {rng_stream{0, 0}, 1.f, 0, dim}; }
  // The table in space S: the host's as it is; on a device, copied into the workspace's share for it.
  template <execution_space S, class W>
  rope_table_view table(const W& ws) const {
    if constexpr (std::same_as<S, host>) {
      return rope->view();
    } else {
      dml::copy_n(rope->values.data(), rope->values.size(), ws.rope);
      return {ws.rope, ws.rope + rope->positions * rope->half, rope->positions, rope->half};
    }
  }
  // The parameters (or gradients) by role.
  template <class T>
  struct roles {
    T *ln1, *qkv, *o, *ln2, *gate_up, *down;
    T *qa, *qan, *qb, *kva, *kvan, *kvb;  // latent attention's, in place of qkv
  };
  template <class T>
  roles<T> weights(T* const* v) const {
    roles<T> r{};
    std::size_t i = 0;
    r.ln1 = v[i++];
    if (latent()) {
      if (q_rank > 0) r.qa = v[i++], r.qan = v[i++];
      r.qb = v[i++], r.kva = v[i++], r.kvan = v[i++], r.kvb = v[i++];
    } else {
      r.qkv = v[i++];
    }
    r.o = v[i++], r.ln2 = v[i++];
    if (!experts) r.gate_up = v[i], r.down = v[i + 1];  // the experts' own from mlp_index()
    return r;
  }
  // The experts sized for any rank of the expert group (as gpt_block's).
  nn::moe moe_of(const llama_dims& d) const {
    nn::moe m = *experts;
    m.group_rows = d.n_local + d.n_local / std::max<std::int64_t>(d.b, 1);
    return m;
  }
  // What forward keeps for backward: the RMSNorm outputs of this rank's rows and their 1/rms (re-gathered in
  // backward under sequence parallelism), q k v after RoPE, the attention's output and the log-sum-exp of each of its
  // rows, the residual between the halves, and [gate | up] with SwiGLU's output. Where ranks share key/value heads,
  // q k v are attention's rows (the rank's query heads and its whole key and value head).
  // Latent attention keeps its two latents before and after their RMSNorms with each row's 1/rms, attention's output
  // with padded values and o_proj's input, in place of q k v's rows it keeps attention's.
  template <class T>
  struct saved_set {
    float *rrms1, *rrms2, *lse;
    T *h1, *qkv, *att, *x2, *h2, *gu, *a;
    std::byte* moe;  // what the experts keep, in place of gu and a
    float *rrms_q, *rrms_kv;
    T *cq, *cqn, *ckv, *ckvn, *att_pad;
  };
  template <class T>
  saved_set<T> saved_parts(std::byte* base, const llama_dims& d) const {
    detail::carver k{base};
    return saved_parts<T>(k, d);
  }
  template <class T>
  saved_set<T> saved_parts(detail::carver& k, const llama_dims& d) const {
    const std::int64_t C = dim, fp = ffn / ranks();
    saved_set<T> s{};
    s.rrms1 = k.take<float>(d.n_local);
    s.rrms2 = k.take<float>(d.n_local);
    if (!selective) s.h1 = k.take<T>(d.n_local * C);
    if (latent()) {
      if (q_rank > 0) {
        s.rrms_q = k.take<float>(d.n);
        s.cq = k.take<T>(d.n * q_rank);
        s.cqn = k.take<T>(d.n * q_rank);
      }
      s.rrms_kv = k.take<float>(d.n);
      s.ckv = k.take<T>(d.n * kv_rank);
      s.ckvn = k.take<T>(d.n * kv_rank);
      s.att_pad = k.take<T>(d.n * heads * head_dim);
    }
    s.qkv = k.take<T>(d.n * attention_width());
    s.lse = k.take<float>(ring() ? ring_attention_saved_size(ring_shape(d), cp) : tile_attention_saved_size(attention(d)));
    s.att = k.take<T>(d.n * o_width());
    s.x2 = k.take<T>(d.n_local * C);
    if (!selective) s.h2 = k.take<T>(d.n_local * C);
    if (experts) {
      s.moe = k.take<std::byte>(moe_of(d).saved_bytes_rows(d.n_local, sizeof(T)));
      return s;
    }
    s.gu = k.take<T>(d.n * 2 * fp);
    if (!selective) s.a = k.take<T>(d.n * fp);
    return s;
  }
  // The saved set with, under selective recompute, the RMSNorm and SwiGLU outputs in the workspace: forward writes
  // them there and backward computes them again there.
  template <class T, class W>
  saved_set<T> kept_parts(std::byte* base, const W& ws, const llama_dims& d) const {
    auto s = saved_parts<T>(base, d);
    if (selective) s.h1 = ws.kh1, s.h2 = ws.kh2, s.a = ws.ka;
    return s;
  }
  template <class T>
  struct work_set {
    T *full1, *full2, *full3, *part, *dx2, *da, *dgu, *datt, *dqkv, *scratch;
    T *qkv, *dqkv_att, *kv_part, *kv_all;  // ranks sharing key/value heads: their rows, slices and gathered slices
    T *q, *kv, *kr, *datt_pad, *dlat, *dlat2, *dq1, *dq2;  // latent attention's projections and their gradients
    T *kh1, *kh2, *ka;                     // selective recompute: the outputs of the RMSNorms and of SwiGLU
    float *tiles, *rope, *moe;
    std::int64_t* positions;
  };
  template <class T>
  work_set<T> work_parts(float* base, const llama_dims& d) const {
    detail::carver k{reinterpret_cast<std::byte*>(base)};
    return work_parts<T>(k, d);
  }
  template <class T>
  work_set<T> work_parts(detail::carver& k, const llama_dims& d) const {
    const std::int64_t C = dim, fp = ffn / ranks();
    work_set<T> w{};
    w.full1 = k.take<T>(d.n * C);
    w.full2 = k.take<T>(d.n * C);
    w.full3 = k.take<T>(d.n * C);
    w.part = k.take<T>(d.n_local * C);
    w.dx2 = k.take<T>(d.n_local * C);
    if (experts) {
      w.moe = k.take<float>(moe_of(d).workspace_rows(d.n_local));
    } else {
      w.da = k.take<T>(d.n * fp);
      w.dgu = k.take<T>(d.n * 2 * fp);
    }
    w.datt = k.take<T>(d.n * o_width());
    w.dqkv = k.take<T>(d.n * (latent() ? attention_width() : width()));
    if (latent()) {
      w.q = k.take<T>(d.n * heads * head_dim);
      w.kv = k.take<T>(d.n * latent_geo().kv_row());
      w.kr = k.take<T>(d.n * rope_d);
      w.datt_pad = k.take<T>(d.n * heads * head_dim);
      w.dlat = k.take<T>(d.n * kv_rank);
      w.dlat2 = k.take<T>(d.n * kv_rank);
      w.dq1 = k.take<T>(d.n * q_rank);
      w.dq2 = k.take<T>(d.n * q_rank);
    }
    if (shares_kv()) {
      w.qkv = k.take<T>(d.n * width());
      w.dqkv_att = k.take<T>(d.n * attention_width());
      w.kv_part = k.take<T>(d.n * 2 * kv_heads * head_dim / ranks());
      w.kv_all = k.take<T>(d.n * 2 * kv_heads * head_dim);
    }
    if (ring()) {
      w.scratch = k.take<T>(ring_attention_workspace_size(ring_shape(d), cp));
      w.positions = k.take<std::int64_t>(d.n);
    } else {
      w.tiles = k.take<float>(tile_attention_workspace_size(attention(d)));
    }
    w.rope = k.take<float>(2 * rope->positions * rope->half);
    if (selective) {
      w.kh1 = k.take<T>(d.n_local * C);
      w.kh2 = k.take<T>(d.n_local * C);
      if (!experts) w.ka = k.take<T>(d.n * fp);
    }
    return w;
  }
  // What a split backward's input pass keeps for its weight pass: the output gradients of down_proj, gate_up_proj,
  // o_proj and qkv_proj (gathered over the tensor group; qkv's after RoPE's backward), and under sequence parallelism
  // the gathered RMSNorm outputs that gate_up_proj and qkv_proj multiply (the weight pass then needs no collective).
  template <class T>
  struct stash_set {
    T *dm, *dgu, *h2, *dp, *dqkv, *h1;
  };
  template <class T>
  stash_set<T> stash_parts(std::byte* base, const llama_dims& d) const {
    detail::carver k{base};
    return stash_parts<T>(k, d);
  }
  template <class T>
  stash_set<T> stash_parts(detail::carver& k, const llama_dims& d) const {
    const std::int64_t C = dim, fp = ffn / ranks();
    stash_set<T> s{};
    if (!experts) {  // experts compute their weight gradients in the input pass
      s.dm = k.take<T>(d.n * C);
      s.dgu = k.take<T>(d.n * 2 * fp);
      if (sequence()) s.h2 = k.take<T>(d.n * C);
    }
    s.dp = k.take<T>(d.n * C);
    if (latent()) return s;  // its projections' weight gradients are the input pass's
    s.dqkv = k.take<T>(d.n * width());
    if (sequence()) s.h1 = k.take<T>(d.n * C);
    return s;
  }
};

}  // namespace dml::nn
