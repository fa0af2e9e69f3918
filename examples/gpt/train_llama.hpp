// SPDX-License-Identifier: Apache-2.0
// examples/gpt/train_llama.hpp — --arch llama: the Llama trainers on comm::local ranks, Hugging Face's layout read
// before training (--load-hf) and written after (--save-hf), and llama2.c's checkpoint (--export-llama2c). Included
// by main.cpp alone (it defines run_llama and read_hf_config): in the GPT trainers' unit the Llama's add 17 CPU s
// to its 75, where a unit of their own took 75 (what every trainer shares compiles once per unit).
#pragma once

#include "dml/nn/llama.hpp"
#include "dml/train/hf_llama.hpp"
#include "dml/train/llama2c.hpp"
#include "train_gpt.hpp"

namespace gpt_example {

namespace {

struct llama_arch {
  using config = dml::nn::llama_config;
  using network = dml::nn::network<dml::host, dml::nn::llama_embedding, dml::nn::stack<dml::nn::llama_block>,
                                   dml::nn::llama_head>;
  static config make_config(const options& o) {
    config g{.vocab = o.vocab, .seq = o.seq, .d_model = o.d_model, .layers = o.layers, .heads = o.heads,
             .kv_heads = o.kv_heads > 0 ? o.kv_heads : o.heads, .ffn_hidden = ffn_hidden(o), .norm_eps = o.norm_eps,
             .tie_embeddings = o.tie};
    g.rope.theta = o.rope_theta;
    g.rope.scaling = o.rope_scaling;
    set_experts(g, o);
    g.first_dense = o.first_dense;
    g.q_lora_rank = o.q_lora_rank, g.kv_lora_rank = o.kv_lora_rank, g.qk_nope_dim = o.qk_nope_dim;
    g.qk_rope_dim = o.qk_rope_dim, g.v_head_dim = o.v_head_dim;
    if (g.latent()) g.kv_heads = g.heads;
    g.selective_recompute = o.recompute == "selective";
    return g;
  }
  static auto model(const config& g) { return dml::nn::llama(g); }
  static std::string describe(const options& o) {
    const config g = make_config(o);
    const std::string attention =
        g.latent() ? dml::detail::cat(" (latent attention: kv latent ", g.kv_lora_rank, ", q latent ", g.q_lora_rank,
                                      ", qk ", g.qk_nope_dim, " + ", g.qk_rope_dim, " rope, v ", g.v_head_dim, ")")
                   : dml::detail::cat(" (", g.kv_heads, " key/value)");
    return dml::detail::cat("llama, ", g.layers, " layers, d_model ", g.d_model, ", ", g.heads, " heads", attention,
                            ", ffn ", g.ffn_hidden, ", seq ", g.seq, ", rope theta ", g.rope.theta,
                            g.rope.scaling ? " (llama3 scaling)" : "", ", norm eps ", g.norm_eps,
                            g.experts > 0 ? ", SwiGLU experts" : "",
                            g.first_dense > 0 ? dml::detail::cat(" after ", g.first_dense, " dense blocks") : "");
  }
  static void load(const options& o, const config& g, const dml::nn::param_layout& layout, std::span<float> full) {
    dml::train::load_hf_llama(g, layout, full, o.load_hf);
  }
  static void save(const options& o, const config& g, const dml::nn::param_layout& layout, std::span<const float> full) {
    if (!o.save_hf.empty()) dml::train::save_hf_llama(g, layout, full, o.save_hf);
    if (!o.export_llama2c.empty()) dml::train::export_llama2c(g, layout, full, o.export_llama2c);
  }
};

}  // namespace

int run_llama(const options& o, dml::comm::local& comm, const corpus& text) {
  if (!o.export_llama2c.empty()) dml::train::check_llama2c(llama_arch::make_config(o));  // before training, not after
  return run<llama_arch>(o, comm, text);
}

// The model flags from dir/config.json (--seq stays: RoPE's table is made for the sequences trained on).
void read_hf_config(options& o) {
  const auto g = dml::train::read_hf_llama_config(o.load_hf);
  o.vocab = g.vocab, o.d_model = g.d_model, o.layers = g.layers, o.heads = g.heads, o.kv_heads = g.kv_heads;
  o.ffn_hidden = g.ffn_hidden, o.norm_eps = g.norm_eps, o.rope_theta = g.rope.theta, o.rope_scaling = g.rope.scaling;
  o.tie = g.tie_embeddings;
}

}  // namespace gpt_example
