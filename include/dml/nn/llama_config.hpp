// SPDX-License-Identifier: Apache-2.0
// dml/nn/llama_config.hpp — the configuration of nn::llama: sizes, grouped-query heads (or DeepSeek's multi-head latent
// attention), the SwiGLU width, RMSNorm's epsilon, RoPE (theta and Llama 3.1's frequency scaling), a tied LM head and
// experts; validate() names the first rule broken.
// Sits on nn/rope.hpp (rope_config); used by nn/llama.hpp and nn/detail/llama_block.hpp, and by code that only fills
// one in.
#pragma once

#include <cstdint>

#include "dml/core/error.hpp"
#include "dml/nn/rope.hpp"

namespace dml::nn {

// Field names follow Hugging Face's LlamaConfig where one exists: vocab_size, max_position_embeddings (seq),
// hidden_size (d_model), num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size
// (ffn_hidden), rms_norm_eps, rope_theta and rope_scaling (rope), tie_word_embeddings.
struct llama_config {
  std::int64_t vocab = 256;       // byte-level text: 256
  std::int64_t seq = 256;         // the longest sequence (RoPE's table has this many positions)
  std::int64_t d_model = 128;
  std::int64_t layers = 2;
  std::int64_t heads = 4;         // query heads; head_dim = d_model / heads
  std::int64_t kv_heads = 4;      // key/value heads: heads is multi-head attention, 1 multi-query, between grouped-query
  std::int64_t ffn_hidden = 352;  // SwiGLU's width (gate and up each)
  float norm_eps = 1e-5f;
  rope_config rope{};             // theta 10000; scaling: none, or Llama 3.1's (rope_scaling{})
  bool tie_embeddings = false;    // lm_head.weight tied to model.embed_tokens.weight
  // Selective recompute (Korthikanti et al.'s scheme, for a block whose attention keeps nothing of T×T): the blocks
  // keep their GEMMs' outputs and recompute the two RMSNorms' outputs and SwiGLU's in backward, the same bits.
  bool selective_recompute = false;
  // Mixture of experts (Mixtral, Qwen3-MoE, DeepSeek-V3): with experts > 0, blocks moe_every−1, 2·moe_every−1, …
  // replace their MLP with nn::moe of SwiGLU experts, expert_ffn wide (0: ffn_hidden), each token routed to its
  // top_k (1 to experts); shared_experts: one SwiGLU of shared_experts · expert_ffn beside them. As nn::gpt_config.
  std::int64_t experts = 0;
  int top_k = 2;
  float capacity_factor = 1.25f;  // <= 0: dropless
  std::int64_t moe_every = 1;
  float aux_loss_weight = 0.01f, z_loss_weight = 0.001f;
  std::int64_t expert_ffn = 0, shared_experts = 0;
  bool sigmoid_router = false;    // the router's scores: softmax (false) or sigmoid, renormalised over the top-k
  float router_bias_rate = 0.f;   // > 0: loss-free balancing (nn::moe_config::bias_rate)
  // The first first_dense blocks keep the dense MLP whatever moe_every says (DeepSeek-V3's first_k_dense_replace: 3).
  std::int64_t first_dense = 0;
  // Multi-head latent attention (DeepSeek-V2 and V3; Hugging Face's DeepseekV3Config names), with kv_lora_rank > 0:
  // keys and values come from one latent of kv_lora_rank values a token (kv_a_proj_with_mqa, RMSNorm, kv_b_proj),
  // queries from one of q_lora_rank (0: q_proj straight from the block's input); each head's query and key are
  // qk_nope_dim values without position and qk_rope_dim rotated by RoPE (the key's rotated part is one per token,
  // shared by the heads), its value v_head_dim (at most qk_nope_dim + qk_rope_dim). kv_heads is not used.
  std::int64_t q_lora_rank = 0, kv_lora_rank = 0, qk_nope_dim = 0, qk_rope_dim = 0, v_head_dim = 0;

  bool latent() const { return kv_lora_rank > 0; }
  std::int64_t head_dim() const { return latent() ? qk_nope_dim + qk_rope_dim : heads > 0 ? d_model / heads : 0; }
  std::int64_t rope_dim() const { return latent() ? qk_rope_dim : head_dim(); }  // the columns RoPE turns, a head
  // Whether block i (from 0) holds experts.
  bool moe_block(std::int64_t i) const { return experts > 0 && i >= first_dense && (i + 1) % moe_every == 0; }

  // Throws invalid_argument naming the first rule broken, what it expected and what it found.
  void validate() const {
    constexpr const char* what = "dml::nn::llama_config";
    const auto positive = [&](const char* name, std::int64_t v) {
      if (v <= 0) fail<invalid_argument>(what, ": expected ", name, " > 0, found ", name, " = ", v);
    };
    positive("vocab", vocab);
    positive("seq", seq);
    positive("d_model", d_model);
    positive("layers", layers);
    positive("heads", heads);
    positive("kv_heads", kv_heads);
    positive("ffn_hidden", ffn_hidden);
    if (first_dense < 0) fail<invalid_argument>(what, ": expected first_dense >= 0, found first_dense = ", first_dense);
    if (latent()) {
      positive("qk_nope_dim", qk_nope_dim);
      positive("qk_rope_dim", qk_rope_dim);
      positive("v_head_dim", v_head_dim);
      if (q_lora_rank < 0) fail<invalid_argument>(what, ": expected q_lora_rank >= 0, found q_lora_rank = ", q_lora_rank);
      if (qk_rope_dim % 2 != 0)
        fail<invalid_argument>(what, ": expected an even qk_rope_dim (RoPE rotates pairs), found qk_rope_dim = ", qk_rope_dim);
      if (v_head_dim > head_dim())
        fail<invalid_argument>(what, ": expected v_head_dim <= qk_nope_dim + qk_rope_dim = ", head_dim(),
                               ", found v_head_dim = ", v_head_dim);
    } else if (q_lora_rank != 0 || qk_nope_dim != 0 || qk_rope_dim != 0 || v_head_dim != 0) {
      fail<invalid_argument>(what, ": q_lora_rank, qk_nope_dim, qk_rope_dim and v_head_dim are latent attention's, "
                             "which needs kv_lora_rank > 0; found kv_lora_rank = ", kv_lora_rank);
    }
    if (!latent() && d_model % heads != 0)
      fail<invalid_argument>(what, ": expected d_model divisible by heads = ", heads, ", found d_model = ", d_model);
    if (kv_lora_rank < 0) fail<invalid_argument>(what, ": expected kv_lora_rank >= 0, found kv_lora_rank = ", kv_lora_rank);
    if (!latent() && heads % kv_heads != 0)
      fail<invalid_argument>(what, ": expected kv_heads dividing heads = ", heads, ", found kv_heads = ", kv_heads);
    if (!latent() && head_dim() % 2 != 0)
      fail<invalid_argument>(what, ": expected an even head_dim = d_model / heads (RoPE rotates pairs), found head_dim = ",
                             head_dim(), " (d_model ", d_model, ", heads ", heads, ")");
    if (!(norm_eps > 0.f)) fail<invalid_argument>(what, ": expected norm_eps > 0, found norm_eps = ", norm_eps);
    if (!(rope.theta > 0)) fail<invalid_argument>(what, ": expected rope.theta > 0, found rope.theta = ", rope.theta);
    if (experts < 0) fail<invalid_argument>(what, ": expected experts >= 0, found experts = ", experts);
    if (experts > 0) positive("moe_every", moe_every);
  }
};

}  // namespace dml::nn
