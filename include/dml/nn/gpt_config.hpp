// SPDX-License-Identifier: Apache-2.0
// dml/nn/gpt_config.hpp — the configuration of nn::gpt: sizes, dropout, biases, tied weights and mixture of experts.
// Sits on the standard library alone; used by nn/gpt.hpp and nn/detail/gpt_block.hpp, and by code that only fills
// one in.
#pragma once

#include <cstdint>

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
  // experts MLPs of width expert_ffn (0: 4C), each token routed to its top_k (1 to experts); capacity_factor <= 0:
  // dropless; shared_experts: one MLP of shared_experts · expert_ffn that every token passes through besides.
  std::int64_t experts = 0;
  int top_k = 2;
  float capacity_factor = 1.25f;
  std::int64_t moe_every = 1;
  float aux_loss_weight = 0.01f, z_loss_weight = 0.001f;
  float router_skew = 0.f;  // > 0: skewed routing on purpose, nn::skewed_logit_bias(experts, 1, router_skew)
  std::int64_t expert_ffn = 0, shared_experts = 0;
  bool sigmoid_router = false;   // the router's scores: softmax (false) or sigmoid, renormalised over the top-k
  float router_bias_rate = 0.f;  // > 0: loss-free balancing (nn::moe_config::bias_rate)
};

}  // namespace dml::nn
