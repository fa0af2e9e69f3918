// SPDX-License-Identifier: Apache-2.0
// tools/dml-plan.cpp — dml-plan: ranks the layouts of a GPT or a Llama (or a model known by its parameter count) on N
// devices by dml::cost's predicted step time, with per-rank memory by category, MFU, bubble and bottleneck, and says
// why the rejected ones were rejected; --preset names a published Llama 3; --layout evaluates one; --calibrate
// measures this host's GEMM, copy, memory and element-wise rates.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "dml/plan/calibrate.hpp"
#include "dml/plan/cluster.hpp"
#include "dml/plan/cost.hpp"
#include "dml/plan/exact.hpp"
#include "dml/train/flags.hpp"

namespace {

using namespace dml;

std::string gib(double bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f", bytes / (1ull << 30));
  return s;
}

nlohmann::json to_json(const cost::estimate& e) {
  const auto& b = e.per_rank;
  return {{"layout", cost::to_string(e.lay)},
          {"precision", cost::to_string(e.prec)},
          {"params", e.params},
          {"bytes",
           {{"params", b.params}, {"grads", b.grads}, {"optimizer", b.optimizer}, {"master", b.master},
            {"activations", b.activations}, {"buffers", b.buffers}, {"workspace", b.workspace}, {"total", b.total()}}},
          {"flops_per_step", e.flops_per_step},
          {"hardware_flops_per_step", e.hardware_flops_per_step},
          {"step_seconds", e.step_seconds},
          {"seconds",
           {{"compute", e.time.compute}, {"elementwise", e.time.elementwise}, {"tensor_parallel", e.time.tp},
            {"expert_parallel", e.time.ep}, {"context_parallel", e.time.cp}, {"pipeline_sends", e.time.pp}, {"bubble", e.time.bubble}, {"data_parallel", e.time.dp},
            {"update", e.time.update}}},
          {"mfu", e.mfu},
          {"bubble", e.bubble},
          {"bottleneck", e.bottleneck},
          {"fits", e.fits},
          {"why", e.why}};
}

void print(const cost::estimate& e, int rank) {
  const auto& b = e.per_rank;
  std::printf("%3d  %s, %s\n     GiB/rank: params %s grads %s optimizer %s master %s activations %s buffers %s workspace %s total %s\n"
              "     step %.4g s  MFU %.1f%%  bubble %.1f%%  bottleneck: %s\n",
              rank, cost::to_string(e.lay).c_str(), cost::to_string(e.prec).c_str(), gib(b.params).c_str(), gib(b.grads).c_str(), gib(b.optimizer).c_str(),
              gib(b.master).c_str(), gib(b.activations).c_str(), gib(b.buffers).c_str(), gib(b.workspace).c_str(), gib(b.total()).c_str(),
              e.step_seconds, 100 * e.mfu, 100 * e.bubble, e.bottleneck.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_kind = "gpt", preset, precision = "bf16", optimizer = "adamw", memory = "80GiB", cluster_file,
              layout, calibrate_file, bytes_from = "dml";
  cost::model m{.layers = 12, .d_model = 768, .heads = 12, .seq = 1024, .vocab = 50304};
  double params = 0;
  std::int64_t batch = 8, micro_batch = 1;
  int devices = 1, show = 10, max_cp = 1;
  bool json = false;
  dml::flags cli("dml-plan", "Ranks the layouts of a model on N devices by predicted step time (dml::cost).");
  cli.add("--model", model_kind, "KIND", "gpt, llama, or params (a model known by --params alone)")
      .choices({"gpt", "llama", "params"});
  cli.add("--preset", preset, "NAME",
          "a published model, its sizes the defaults of the flags below: llama3-8b, llama3-70b or llama3-405b "
          "(Llama 3, sequence 8,192), deepseek-v3 (sequence 4,096)")
      .choices(cost::preset_names());
  cli.add("--layers", m.layers, "L", "transformer blocks").min(1);
  cli.add("--d-model", m.d_model, "H", "hidden size").min(1);
  cli.add("--heads", m.heads, "A", "attention heads").min(1);
  cli.add("--kv-heads", m.kv_heads, "K", "a Llama's key/value heads (0: --heads)").min(0);
  cli.add("--ffn-hidden", m.ffn_hidden, "F", "a Llama's SwiGLU width (gate and up each)").min(0);
  cli.add("--seq", m.seq, "S", "sequence length").min(1);
  cli.add("--vocab", m.vocab, "V", "vocabulary size").min(1);
  cli.add_switch("--bias", m.bias, "biases in every Linear and LayerNorm");
  cli.add_switch("--tie", m.tie, "LM head tied to the token embedding");
  cli.add("--experts", m.experts, "E", "experts per MoE block (0: dense)").min(0);
  cli.add("--top-k", m.top_k, "K", "experts per token").min(1);
  cli.add("--moe-every", m.moe_every, "N", "every N-th block is MoE").min(1);
  cli.add("--capacity-factor", m.capacity_factor, "C", "tokens an expert takes: C·tokens·k/E (<= 0: all)");
  cli.add("--expert-ffn", m.expert_ffn, "F", "each expert's width (0: the dense MLP's)").min(0);
  cli.add("--shared-experts", m.shared_experts, "S", "one MLP of S·expert-ffn beside the routed experts").min(0);
  cli.add_switch("--sigmoid-router", m.sigmoid_router, "the router's scores are sigmoids (DeepSeek-V3), not a softmax");
  cli.add("--first-dense", m.first_dense, "N", "the first N blocks keep the dense MLP").min(0);
  cli.add("--kv-lora-rank", m.kv_lora_rank, "R", "a Llama's latent attention: the key/value latent (0: none)").min(0);
  cli.add("--q-lora-rank", m.q_lora_rank, "R", "latent attention's query latent (0: none)").min(0);
  cli.add("--qk-nope-dim", m.qk_nope_dim, "D", "latent attention: a head's query/key columns without position").min(0);
  cli.add("--qk-rope-dim", m.qk_rope_dim, "D", "latent attention: a head's query/key columns RoPE turns").min(0);
  cli.add("--v-head-dim", m.v_head_dim, "D", "latent attention: a head's value width").min(0);
  cli.add("--params", params, "N", "parameter count (model states only, no activations); implies --model params").min(0);
  cli.add("--batch", batch, "B", "global batch, sequences per step").min(1);
  cli.add("--micro-batch", micro_batch, "b",
          "sequences per micro-batch in the search (0: every micro-batch count that divides a rank's sequences)")
      .min(0);
  cli.add("--precision", precision, "P",
          "working precision; auto: fp32 and bf16 ranked together (the faster on the cluster's rates that fits)")
      .choices({"fp32", "bf16", "fp16", "auto"});
  cli.add("--optimizer", optimizer, "O", "optimizer").choices({"adamw", "adam", "sgd", "adagrad"});
  cli.add("--devices", devices, "N", "devices (ranks)").min(1);
  cli.add("--max-cp", max_cp, "C", "the search also cuts sequences over cp = 2, 4, ... up to C ranks (long context)").min(1);
  cli.add("--memory", memory, "BYTES", "memory per device (80GiB, 40GB, ...)").check([](const std::string& s) {
    try {
      cost::parse_bytes(s);
      return std::string{};
    } catch (const dml::error&) {
      return std::string("a positive size such as 80GiB, 40GB or 1e9");
    }
  });
  cli.add("--cluster", cluster_file, "FILE", "cluster description (JSON; see --calibrate)");
  cli.add("--layout", layout, "LAYOUT", "evaluate one layout: dp=8,tp=4,pp=2,zero=1,sp=1,schedule=1f1b,mb=8,recompute=selective");
  cli.add("--bytes", bytes_from, "FROM",
          "dml: a GPT's bytes as dml's trainer will hold them, to the byte; papers: ZeRO's and Korthikanti et al.'s "
          "formulas (selective recompute priced too)")
      .choices({"dml", "papers"});
  cli.add("--top", show, "N", "layouts to print").min(0);
  cli.add_switch("--json", json, "one JSON object per layout");
  cli.add("--calibrate", calibrate_file, "FILE",
          "measure this host's GEMM rates, element-wise rate and each block's fixed cost on GPTs of 1 and 2 layers "
          "(1024 wide, 16 heads, 128 to 1,024 tokens, 4,096 ids), the GEMM rate's share at a micro-batch's tokens "
          "(the model's products from 128 to 1,024, one GEMM shape below), the copy rate and the memory bandwidth "
          "(dml's AdamW update), and write them as a cluster file");
  if (const auto status = cli.parse_for_main(argc, argv)) return *status;

  try {
    if (!calibrate_file.empty()) {
      const auto c = cost::calibrate_gpt_rank_of(1, 1024, 16, 512, 4096);  // GPT-2-medium widths
      std::ofstream(calibrate_file) << to_json(c).dump(2) << "\n";
      std::printf("%s\n", to_json(c).dump(2).c_str());
      return 0;
    }
    cost::cluster c;
    if (!cluster_file.empty()) {
      std::ifstream in(cluster_file);
      if (!in) dml::fail<dml::io_error>("cannot open the cluster file ", cluster_file);
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(in);
      } catch (const nlohmann::json::exception& e) {
        dml::fail<dml::format_error>(cluster_file, ": not JSON: ", e.what());
      }
      c = cost::cluster_from_json(j, cluster_file);
    }
    c.memory_bytes = cost::parse_bytes(memory);
    if (!preset.empty()) {  // the preset's sizes where no flag gives them
      const cost::model p = cost::preset(preset);
      const auto keep = [&](const char* flag, auto& field, auto value) {
        if (!cli.given(flag)) field = value;
      };
      keep("--layers", m.layers, p.layers);
      keep("--d-model", m.d_model, p.d_model);
      keep("--heads", m.heads, p.heads);
      keep("--kv-heads", m.kv_heads, p.kv_heads);
      keep("--ffn-hidden", m.ffn_hidden, p.ffn_hidden);
      keep("--seq", m.seq, p.seq);
      keep("--vocab", m.vocab, p.vocab);
      keep("--experts", m.experts, p.experts);
      keep("--top-k", m.top_k, p.top_k);
      keep("--moe-every", m.moe_every, p.moe_every);
      keep("--capacity-factor", m.capacity_factor, p.capacity_factor);
      keep("--expert-ffn", m.expert_ffn, p.expert_ffn);
      keep("--shared-experts", m.shared_experts, p.shared_experts);
      keep("--sigmoid-router", m.sigmoid_router, p.sigmoid_router);
      keep("--first-dense", m.first_dense, p.first_dense);
      keep("--kv-lora-rank", m.kv_lora_rank, p.kv_lora_rank);
      keep("--q-lora-rank", m.q_lora_rank, p.q_lora_rank);
      keep("--qk-nope-dim", m.qk_nope_dim, p.qk_nope_dim);
      keep("--qk-rope-dim", m.qk_rope_dim, p.qk_rope_dim);
      keep("--v-head-dim", m.v_head_dim, p.v_head_dim);
      keep("--model", model_kind, cost::to_string(p.arch));
    }
    if (model_kind == "llama") {
      if (m.ffn_hidden < 1) dml::fail<dml::invalid_argument>("--model llama needs --ffn-hidden F > 0 (or a --preset)");
      m.arch = cost::architecture::llama;
    }
    if (params > 0 || model_kind == "params") {
      if (!(params > 0)) dml::fail<dml::invalid_argument>("--model params needs --params N > 0");
      m = cost::model{.seq = m.seq, .params_only = params};
    }
    const cost::training t{.global_batch = batch,
                           .prec = precision == "fp32" ? cost::precision::fp32 : precision == "fp16" ? cost::precision::fp16 : cost::precision::bf16,
                           .optimizer = optimizer};
    const std::vector<cost::precision> precisions =
        precision == "auto" ? std::vector{cost::precision::fp32, cost::precision::bf16} : std::vector{t.prec};
    const auto all = cost::search_precisions(t, precisions, [&](const cost::training& u) {
      if (!layout.empty()) {
        const auto l = cost::parse_layout(layout);
        return std::vector{bytes_from == "dml" ? cost::evaluate_dml(m, l, u, c, l.devices()) : cost::evaluate(m, l, u, c, l.devices())};
      }
      return bytes_from == "dml" ? cost::search_dml(m, u, c, devices, micro_batch, max_cp)
                                 : cost::search(m, u, c, devices, micro_batch, max_cp);
    });
    if (json) {
      for (const auto& e : all) std::printf("%s\n", to_json(e).dump().c_str());
      return 0;
    }
    if (m.is_transformer()) {
      const double n = cost::count_layers(m).total(m);
      const int exponent = static_cast<int>(std::floor(std::log10(n)));
      std::printf("%s: %.0f parameters (%.2fe%d)\n", (preset.empty() ? cost::to_string(m.arch) : preset).c_str(), n,
                  n / std::pow(10.0, exponent), exponent);
    }
    int rank = 0;
    const auto fits = std::count_if(all.begin(), all.end(), [](const auto& e) { return e.fits; });
    std::printf("%lld of %zu layouts fit in %s GiB per device%s\n", static_cast<long long>(fits), all.size(),
                gib(c.memory_bytes).c_str(), fits ? "; fastest first:" : "");
    for (const auto& e : all)
      if (e.fits && rank < show) print(e, ++rank);
    std::printf("rejected:\n");
    for (const auto& e : all)
      if (!e.fits) std::printf("  %s, %s: %s\n", cost::to_string(e.lay).c_str(), cost::to_string(e.prec).c_str(), e.why.c_str());
    return 0;
  } catch (const dml::error& e) {
    std::fprintf(stderr, "dml-plan: error: %s\n", e.what());
    return 2;
  }
}
