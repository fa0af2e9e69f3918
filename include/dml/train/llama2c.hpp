// SPDX-License-Identifier: Apache-2.0
// dml/train/llama2c.hpp — nn::llama's weights as llama2.c's legacy checkpoint (version 0, the .bin that run.c reads).
// Sits on train/hf_llama.hpp (the tensors of each fused parameter), nn/rope.hpp and train/checkpoint.hpp (atomic
// writes). See DESIGN.md §6.
//
// The file, little-endian: seven int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len), where
// vocab_size is negated when the classifier is not the embedding; then float32 tensors, row-major, each of all layers
// in turn: the embedding [vocab, dim], rms_att [layers, dim], wq [layers, dim, dim], wk and wv [layers, kv_dim, dim],
// wo [layers, dim, dim], rms_ffn [layers, dim], w1 (gate) [layers, hidden, dim], w2 (down) [layers, dim, hidden], w3
// (up) [layers, hidden, dim], rms_final [dim], RoPE's cos and sin [seq_len, head_size / 2] (run.c skips them), and
// the classifier [vocab, dim] when untied.
//
// llama2.c rotates the interleaved pairs (2i, 2i + 1) of a head, Meta's order; nn::llama rotates (i, i + head_dim/2),
// Hugging Face's. Row s·head_dim/2 + i of a head of q or k is therefore written as the head's row 2i + s. run.c
// computes RoPE with theta 10000 and no scaling, and RMSNorm with eps 1e-5: other configs are refused.
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "dml/core/error.hpp"
#include "dml/nn/llama_config.hpp"
#include "dml/nn/network.hpp"
#include "dml/nn/rope.hpp"
#include "dml/train/checkpoint.hpp"
#include "dml/train/hf_llama.hpp"

namespace dml::train {

// Writes the parameters of nn::llama(g), laid out by `layout` in `flat` (host memory, a whole model's), to `file` in
// llama2.c's legacy format. The bytes go to a temporary beside `file` that is renamed into place, so `file` is the
// old one or the whole new one. A config that run.c would compute differently is refused before anything is written.
// What export_llama2c refuses, checked alone: a caller can refuse a run whose model could not be exported before it
// trains.
inline void check_llama2c(const nn::llama_config& g) {
  constexpr const char* what = "dml::train::export_llama2c";
  if (g.rope.theta != 10000)
    fail<invalid_argument>(what, ": rope.theta: llama2.c expects 10000, found ", g.rope.theta);
  if (g.rope.scaling)
    fail<invalid_argument>(what, ": rope.scaling: llama2.c expects none, found Llama 3.1's (factor ",
                           g.rope.scaling->factor, ")");
  if (g.norm_eps != 1e-5f) fail<invalid_argument>(what, ": norm_eps: llama2.c expects 1e-05, found ", g.norm_eps);
  if (g.experts > 0) fail<invalid_argument>(what, ": llama2.c's checkpoint has no experts: expected experts 0, found ", g.experts);
  if (g.latent())
    fail<invalid_argument>(what, ": llama2.c's checkpoint has no latent attention: expected kv_lora_rank 0, found ",
                           g.kv_lora_rank);
  const std::int64_t sizes[] = {g.d_model, g.ffn_hidden, g.layers, g.heads, g.kv_heads, g.vocab, g.seq};
  for (const std::int64_t v : sizes)
    if (v > std::numeric_limits<std::int32_t>::max())
      fail<invalid_argument>(what, ": llama2.c's header holds int32 sizes, found ", v);
}

inline void export_llama2c(const nn::llama_config& g, const nn::param_layout& layout, std::span<const float> flat,
                           const std::filesystem::path& file) {
  constexpr const char* what = "dml::train::export_llama2c";
  const auto tensors = detail::hf_llama_tensors(g, layout, flat.size(), what);
  check_llama2c(g);

  const auto find = [&](const std::string& name) -> const detail::hf_tensor& {
    for (const auto& t : tensors)
      if (t.name == name) return t;
    fail<invalid_argument>(what, ": no tensor '", name, "'");
  };
  std::string out;
  const auto put = [&](const float* p, std::int64_t n) {
    out.append(reinterpret_cast<const char*>(p), static_cast<std::size_t>(n) * sizeof(float));
  };
  const auto put_tensor = [&](const std::string& name) {
    const auto& t = find(name);
    put(flat.data() + t.offset, t.numel);
  };
  // q or k of one layer, each head's rows from rotate-half order to interleaved pairs.
  const std::int64_t hd = g.head_dim(), half = hd / 2;
  const auto put_rotated = [&](const std::string& name) {
    const auto& t = find(name);
    const std::int64_t c = t.shape[1];
    for (std::int64_t r = 0; r < t.shape[0]; ++r) {
      const std::int64_t head = r / hd, i = r % hd / 2, s = r % 2;
      put(flat.data() + t.offset + (head * hd + s * half + i) * c, c);
    }
  };
  const auto each_layer = [&](const char* suffix, auto write) {
    for (std::int64_t l = 0; l < g.layers; ++l) write(dml::detail::cat("model.layers.", l, ".", suffix));
  };

  const std::int64_t sizes[] = {g.d_model, g.ffn_hidden, g.layers, g.heads, g.kv_heads, g.vocab, g.seq};
  std::int32_t header[7];
  for (int i = 0; i < 7; ++i) header[i] = static_cast<std::int32_t>(sizes[i]);
  if (!g.tie_embeddings) header[5] = -header[5];
  out.append(reinterpret_cast<const char*>(header), sizeof header);
  put_tensor("model.embed_tokens.weight");
  each_layer("input_layernorm.weight", put_tensor);
  each_layer("self_attn.q_proj.weight", put_rotated);
  each_layer("self_attn.k_proj.weight", put_rotated);
  each_layer("self_attn.v_proj.weight", put_tensor);
  each_layer("self_attn.o_proj.weight", put_tensor);
  each_layer("post_attention_layernorm.weight", put_tensor);
  each_layer("mlp.gate_proj.weight", put_tensor);
  each_layer("mlp.down_proj.weight", put_tensor);
  each_layer("mlp.up_proj.weight", put_tensor);
  put_tensor("model.norm.weight");
  const nn::rope_table rope(g.rope, hd, g.seq);  // cos [seq, half], then sin
  put(rope.values.data(), static_cast<std::int64_t>(rope.values.size()));
  if (!g.tie_embeddings) put_tensor("lm_head.weight");
  detail::write_text_atomically(file, out);
}

// The same for a network, in whichever space its parameters live.
template <class Net>
  requires requires(const Net& n) {
    n.layout();
    n.params();
  }
void export_llama2c(const nn::llama_config& g, const Net& net, const std::filesystem::path& file) {
  std::vector<float> host(static_cast<std::size_t>(net.layout().total));
  copy_n(net.params().data(), host.size(), host.data());
  export_llama2c(g, net.layout(), host, file);
}

}  // namespace dml::train
