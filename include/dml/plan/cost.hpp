// SPDX-License-Identifier: Apache-2.0
// dml/plan/cost.hpp — the cost model: per-rank bytes (parameters, gradients, optimizer state, master weights,
// activations), FLOPs and a step time of a GPT or a Llama (or a model known by its parameter count) under a layout.
// Sits on core/error.hpp and the standard library; used by plan/exact.hpp, tools/dml-plan and the examples. See
// DESIGN.md §7 (namespace dml::cost: parallel::plan names the kinds of parallelism, this prices a layout of them).
#pragma once

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "dml/core/error.hpp"
#include "dml/parallel/partition.hpp"

namespace dml::cost {

// ---- the papers' formulas, as printed ---------------------------------------------------------------

// ZeRO (Rajbhandari et al. 2020), §3 and Figure 1: bytes of model states per device for Ψ parameters under
// mixed precision (2 + 2 bytes of fp16 parameter and gradient, K bytes of optimizer state per parameter) at
// data-parallel degree nd; stage 0 is plain data parallelism, 1 = P_os, 2 = P_os+g, 3 = P_os+g+p.
inline double zero_model_state_bytes(double psi, double k, double nd, int stage) {
  switch (stage) {
    case 0: return (2 + 2 + k) * psi;
    case 1: return 4 * psi + k * psi / nd;
    case 2: return 2 * psi + (2 + k) * psi / nd;
    case 3: return (2 + 2 + k) * psi / nd;
    default: fail<invalid_argument>("dml::cost::zero_model_state_bytes: expected stage 0 to 3, found ", stage);
  }
}

// Korthikanti et al. 2022, Table 2: activation bytes of one transformer layer (16-bit activations, 1-byte
// dropout masks) for sequence s, micro-batch b, hidden h, heads a, tensor-parallel degree t.
enum class recompute { none, selective, full };
inline double korthikanti_layer_bytes(double s, double b, double h, double a, double t, bool sequence_parallel,
                                      recompute r) {
  const double sbh = s * b * h;
  if (r == recompute::full) return 2 * sbh / (sequence_parallel ? t : 1);  // the layer's input only
  const double attention = r == recompute::selective ? 0 : 5 * a * s / h;   // the s² terms
  if (sequence_parallel || t == 1) return sbh / t * (34 + attention);
  return sbh * (10 + 24 / t + attention / t);
}

// A block with experts: the bytes its MLP's element-wise passes stand for, in units of s·b·h as Korthikanti's 19 of
// a dense MLP (its input 2, GELU's input and output 8 each, the dropout mask 1). Each of a token's k choices passes
// through an expert's MLP (19 less the mask, the experts' input copy in dispatch order 2), the GELU is run again in
// backward from its saved input rather than kept (its input read and output written: 16), and the output comes back
// to be combined (2): 37·k; under expert parallelism the received rows are put in expert order and back, forward
// and backward (4 per choice more).
inline double moe_mlp_bytes_per_sbh(std::int64_t top_k, int ep) {
  return static_cast<double>(top_k) * (37 + (ep > 1 ? 4 : 0));
}
// Bytes one rank sends in each of an expert block's four all-to-alls (forward the tokens to their experts and the
// outputs back; backward the outputs' gradients out and the inputs' gradients back): every token's k rows of h
// values, drops aside.
inline double moe_all_to_all_bytes(double tokens, double h, double top_k, double value_bytes) {
  return tokens * top_k * h * value_bytes;
}

// A block under context parallelism (ring attention): the passes it adds, in units of s·b·h as above, s its rank's
// tokens: K and V packed for the ring, forward and again in backward (their 2h values read and written: 8 each),
// dQ's columns zeroed (2), dK and dV unpacked (8) and the output's dot with its gradient (y and dy read: 4).
inline constexpr double ring_attention_bytes_per_sbh = 30;
// Bytes one rank sends in each of the ring's steps: its tokens' K and V (backward, their gradients too).
inline double ring_kv_bytes(double tokens, double h, double value_bytes) { return tokens * 2 * h * value_bytes; }

// Under expert parallelism a rank's experts take the rows routing sends them, which differ from rank to rank: the
// step waits for the busiest. Its rows over the mean are at most the capacity factor (each of its E/ep experts
// takes at most capacity_factor times its mean share), or ep where nothing is dropped; the model prices that bound,
// so it errs long where routing is balanced (1.09-1.25 measured in one step of plan_accuracy's GPT at initial weights).
inline double busiest_expert_load(double capacity_factor, int ep) {
  if (ep <= 1) return 1;
  return capacity_factor > 0 ? std::min(capacity_factor, static_cast<double>(ep)) : static_cast<double>(ep);
}

// The element-wise passes of a GPT outside its blocks, in values per token of a rank: the embedding's on the first
// stage (forward the token and position rows read and their sum written; backward the dropout's gradient, the
// position rows' and the token rows' gradients: 9 values of width h, every token's under tensor parallelism, the
// lookup being vocabulary-parallel), and on the last stage the final LayerNorm's (2 forward, 8 backward, a t-th under
// sequence parallelism) and the loss's over the logits (the row maxima, the exponentials and their sum, the
// gradient: 5 values of width V / t, vocabulary-parallel).
struct gpt_end_values {
  double embedding = 0, head = 0;
};
// A Llama's embedding has no positions: its token rows read and written forward, their gradient read and the rows'
// gradients read and written backward (positions false: 5 values of width h); its final RMSNorm is priced as the
// LayerNorm.
inline gpt_end_values gpt_end_values_per_token(double h, double V, double t, bool sequence_parallel,
                                               bool positions = true) {
  return {(positions ? 9 : 5) * h, 10 * h / (sequence_parallel ? t : 1) + 5 * V / t};
}

// One nn::llama block's activation bytes as it keeps them (nn::llama_block's saved set, and its output), for sequence
// s, micro-batch b, hidden h, heads a, key/value heads k, SwiGLU width f, tensor-parallel degree t, w bytes a value:
// of each token row (a t-th of them under sequence parallelism) the two RMSNorms' outputs, the residual between the
// halves and the output, 4h values, and two floats of 1/rms; of each token this rank's q, k and v ((a + 2k)·h/a / t;
// where t exceeds k, t / k ranks share each key/value head and attention keeps a whole one: (a/t + 2)·h/a),
// the attention's output (h/t), [gate | up] and SwiGLU's output (3f/t), and a float log-sum-exp per head (a/t). The
// tile attention keeps nothing of s²; selective recompute (llama_config::selective_recompute) drops the RMSNorms'
// outputs (2h a row) and SwiGLU's (f/t a token), which backward computes again; full keeps the input alone.
inline double llama_layer_bytes(double s, double b, double h, double a, double k, double f, double t, double w,
                                bool sequence_parallel, recompute r) {
  const double tokens = s * b, rows = sequence_parallel ? tokens / t : tokens;
  if (r == recompute::full) return rows * h * w;
  const double kept_rows = r == recompute::selective ? 2 : 4, kept_f = r == recompute::selective ? 2 : 3;
  return rows * (kept_rows * h * w + 8) + tokens * (((a + 2 * std::max(k, t)) * h / a + h + kept_f * f) * w + 4 * a) / t;
}

// Narayanan et al. 2021, eq. (3): FLOPs per iteration of a GPT with full recomputation (one extra forward),
// batch B, sequence s, l layers, hidden h, vocabulary V.
inline double megatron_flops(double B, double s, double l, double h, double V) {
  return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
}
// Their §5.1 parameter count: P = 12 l h² (1 + 13/(12h) + (V + s)/(12 l h)).
inline double megatron_params(double l, double h, double V, double s) {
  return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h));
}

// ---- what is priced --------------------------------------------------------------------------------

// nn::gpt's blocks (LayerNorm, multi-head attention, a GELU MLP of 4·d_model or GELU experts) or nn::llama's (RMSNorm,
// RoPE, grouped-query attention, a SwiGLU MLP of ffn_hidden or SwiGLU experts; no biases, no positions).
enum class architecture { gpt, llama };
inline std::string to_string(architecture a) { return a == architecture::gpt ? "gpt" : "llama"; }

struct model {
  std::int64_t layers = 0, d_model = 0, heads = 0, seq = 0, vocab = 0;
  bool bias = false, tie = false;
  std::int64_t experts = 0, top_k = 2, moe_every = 1;
  float capacity_factor = 1.25f;  // tokens an expert takes: factor · tokens · top_k / experts (<= 0: all)
  std::int64_t expert_ffn = 0;      // each expert's width (0: the dense MLP's, 4·d_model or ffn_hidden)
  std::int64_t shared_experts = 0;  // one MLP of shared_experts · expert_ffn beside the routed experts
  bool sigmoid_router = false;      // the router's scores: softmax or sigmoid (which keeps them, n·E floats, too)
  double params_only = 0;  // > 0: a model known by its parameter count (model states only, no activations)
  architecture arch = architecture::gpt;
  std::int64_t kv_heads = 0;    // a Llama's key/value heads (0: heads)
  std::int64_t ffn_hidden = 0;  // a Llama's SwiGLU width (gate and up each)
  // A Llama's multi-head latent attention (nn::llama_config's fields of the same names; kv_lora_rank > 0) and its
  // dense first blocks (first_dense: DeepSeek-V3's first_k_dense_replace).
  std::int64_t q_lora_rank = 0, kv_lora_rank = 0, qk_nope_dim = 0, qk_rope_dim = 0, v_head_dim = 0;
  std::int64_t first_dense = 0;
  bool is_transformer() const { return params_only <= 0; }  // its layers known, not only its parameter count
  bool is_gpt() const { return is_transformer() && arch == architecture::gpt; }
  bool is_llama() const { return is_transformer() && arch == architecture::llama; }
  bool latent() const { return is_llama() && kv_lora_rank > 0; }
  std::int64_t kv() const { return latent() ? heads : kv_heads > 0 ? kv_heads : heads; }
  // Whether block i (from 0) holds experts, and how many of `blocks` blocks from block `from` do.
  bool moe_block(std::int64_t i) const { return experts > 0 && i >= first_dense && (i + 1) % moe_every == 0; }
  std::int64_t moe_blocks(std::int64_t from = 0, std::int64_t blocks = -1) const {
    std::int64_t n = 0;
    for (std::int64_t i = from; i < (blocks < 0 ? layers : std::min(layers, from + blocks)); ++i) n += moe_block(i);
    return n;
  }
  // The share of blocks with experts, as the time and parameter estimates spread them over stages.
  double moe_share() const {
    if (experts <= 0) return 0;
    return first_dense == 0 ? 1.0 / static_cast<double>(moe_every)
                            : static_cast<double>(moe_blocks()) / static_cast<double>(layers);
  }
};

// The published Llama 3 models (Meta's configurations, as Hugging Face's config.json gives them) at sequence 8,192:
// llama3-8b, llama3-70b and llama3-405b; 8 key/value heads, vocabulary 128,256, LM head untied. Their RoPE theta
// (500,000) changes no byte and no FLOP, so model has no field for it. deepseek-v3: DeepSeek-V3's configuration
// (its config.json) at its pre-training sequence of 4,096: 61 blocks of width 7,168, multi-head latent attention
// (128 heads, query latent 1,536, key/value latent 512, 128 + 64 query/key columns a head, values 128), the first 3
// blocks dense (SwiGLU of 18,432), the other 58 with 256 routed SwiGLU experts of 2,048, top 8 of sigmoid scores,
// and one shared expert; vocabulary 129,280, LM head untied; dropless (capacity 0). Its multi-token prediction module
// is not in it.
inline const std::vector<std::string>& preset_names() {
  static const std::vector<std::string> names{"llama3-8b", "llama3-70b", "llama3-405b", "deepseek-v3"};
  return names;
}
inline model preset(std::string_view name) {
  const auto llama3 = [](std::int64_t layers, std::int64_t d_model, std::int64_t ffn_hidden, std::int64_t heads) {
    return model{.layers = layers, .d_model = d_model, .heads = heads, .seq = 8192, .vocab = 128256,
                 .arch = architecture::llama, .kv_heads = 8, .ffn_hidden = ffn_hidden};
  };
  if (name == "llama3-8b") return llama3(32, 4096, 14336, 32);
  if (name == "llama3-70b") return llama3(80, 8192, 28672, 64);
  if (name == "llama3-405b") return llama3(126, 16384, 53248, 128);
  if (name == "deepseek-v3")
    return model{.layers = 61, .d_model = 7168, .heads = 128, .seq = 4096, .vocab = 129280, .experts = 256, .top_k = 8,
                 .moe_every = 1, .capacity_factor = 0.f, .expert_ffn = 2048, .shared_experts = 1, .sigmoid_router = true,
                 .arch = architecture::llama, .ffn_hidden = 18432, .q_lora_rank = 1536, .kv_lora_rank = 512,
                 .qk_nope_dim = 128, .qk_rope_dim = 64, .v_head_dim = 128, .first_dense = 3};
  fail<invalid_argument>("dml::cost::preset: expected llama3-8b, llama3-70b, llama3-405b or deepseek-v3, found '", name,
                         "'");
}

enum class precision { fp32, bf16, fp16 };
inline int value_bytes(precision p) { return p == precision::fp32 ? 4 : 2; }
inline std::string to_string(precision p) { return p == precision::fp32 ? "fp32" : p == precision::bf16 ? "bf16" : "fp16"; }
// Optimizer state slots of 4 bytes per parameter (optim::*::state_slots).
inline int state_slots(std::string_view optimizer) {
  if (optimizer == "adamw" || optimizer == "adam") return 2;
  if (optimizer == "sgd" || optimizer == "adagrad") return 1;
  fail<invalid_argument>("dml::cost: expected optimizer adamw, adam, sgd or adagrad, found '", optimizer, "'");
}
// Bytes the optimizer's update moves per parameter it updates: the (master) parameter read and written, the gradient
// read, each state slot read and written, and under mixed precision the 16-bit working copy written: 28 for AdamW
// in fp32 and in bf16, 20 for SGD with momentum. The update streams them once, so it runs at memory bandwidth.
inline double update_bytes_per_param(std::string_view optimizer, precision p) {
  return 8.0 + value_bytes(p) + 8.0 * state_slots(optimizer) + (p == precision::fp32 ? 0 : value_bytes(p));
}

struct layout {
  int dp = 1, tp = 1, pp = 1, ep = 1, cp = 1, zero = 0, replicas = 1;
  bool sp = false;                    // sequence parallelism (with tp > 1)
  std::string schedule = "1f1b";      // single, gpipe, 1f1b, interleaved:V or zb
  std::int64_t micro_batches = 1;
  recompute recomp = recompute::none;
  // Context parallelism's K/V all-gathered over the group instead of passed round it (nn::context_split::all_gather):
  // the same bytes in as many latency steps, so priced as the ring, but every rank's K/V block held at once.
  bool cp_all_gather = false;
  int devices() const { return dp * tp * pp; }
};

// V of "interleaved:V" (the model chunks a rank holds), 0 for any other name or a V that is not an integer.
inline int interleaved_chunks(std::string_view schedule) {
  constexpr std::string_view prefix = "interleaved:";
  if (!schedule.starts_with(prefix)) return 0;
  const std::string_view v = schedule.substr(prefix.size());
  int chunks = 0;
  const auto [end, err] = std::from_chars(v.data(), v.data() + v.size(), chunks);
  return err == std::errc{} && end == v.data() + v.size() ? chunks : 0;
}

// A step's compute on one stage in units of its slots: M forward-backward pairs under GPipe and 1F1B, V·M under
// interleaved:V (each chunk a V-th of the stage), 3M under zb (forward, input and weight passes of equal cost).
// A pipeline of p stages then lasts (units + p − 1) slots: the bubble is (p − 1)/(units + p − 1) of the step
// (Narayanan et al. 2021; Qi et al. 2023 for zb's ZB-H1).
inline double schedule_units(const layout& l) {
  const auto m = static_cast<double>(l.micro_batches);
  if (l.schedule == "zb") return 3 * m;
  if (const int v = interleaved_chunks(l.schedule)) return v * m;
  return m;
}

inline std::string to_string(recompute r) {
  return r == recompute::none ? "none" : r == recompute::selective ? "selective" : "full";
}
inline std::string to_string(const layout& l) {
  return "dp=" + std::to_string(l.dp) + ",tp=" + std::to_string(l.tp) + ",pp=" + std::to_string(l.pp) +
         ",ep=" + std::to_string(l.ep) + ",cp=" + std::to_string(l.cp) + ",zero=" + std::to_string(l.zero) +
         ",replicas=" + std::to_string(l.replicas) + ",sp=" + (l.sp ? "1" : "0") + ",schedule=" + l.schedule +
         ",mb=" + std::to_string(l.micro_batches) + ",recompute=" + to_string(l.recomp) +
         (l.cp_all_gather ? ",cp_attention=allgather" : "");
}

// "dp=8,tp=4,pp=2,zero=1,schedule=1f1b,mb=8,recompute=selective[,cp_attention=allgather]": fields left out keep
// their defaults.
inline layout parse_layout(std::string_view text) {
  layout l;
  while (!text.empty()) {
    const auto comma = text.find(',');
    const std::string_view item = text.substr(0, comma);
    text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
    const auto eq = item.find('=');
    if (eq == std::string_view::npos)
      fail<invalid_argument>("dml::cost::parse_layout: expected key=value, found '", item, "'");
    const std::string key(item.substr(0, eq)), value(item.substr(eq + 1));
    auto number = [&] {
      std::size_t used = 0;
      long long v = -1;
      try {
        v = std::stoll(value, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != value.size() || v < 0)
        fail<invalid_argument>("dml::cost::parse_layout: expected a non-negative integer for ", key, ", found '", value, "'");
      return v;
    };
    if (key == "dp") l.dp = static_cast<int>(number());
    else if (key == "tp") l.tp = static_cast<int>(number());
    else if (key == "pp") l.pp = static_cast<int>(number());
    else if (key == "ep") l.ep = static_cast<int>(number());
    else if (key == "cp") l.cp = static_cast<int>(number());
    else if (key == "zero") l.zero = static_cast<int>(number());
    else if (key == "replicas") l.replicas = static_cast<int>(number());
    else if (key == "sp") l.sp = number() != 0;
    else if (key == "mb") l.micro_batches = number();
    else if (key == "schedule") {
      if (value != "single" && value != "gpipe" && value != "1f1b" && value != "zb" && interleaved_chunks(value) < 2)
        fail<invalid_argument>("dml::cost::parse_layout: expected schedule single, gpipe, 1f1b, zb or interleaved:V "
                               "(V >= 2), found '", value, "'");
      l.schedule = value;
    } else if (key == "recompute") {
      if (value == "none") l.recomp = recompute::none;
      else if (value == "selective") l.recomp = recompute::selective;
      else if (value == "full") l.recomp = recompute::full;
      else fail<invalid_argument>("dml::cost::parse_layout: expected recompute none, selective or full, found '", value, "'");
    } else if (key == "cp_attention") {
      if (value != "ring" && value != "allgather")
        fail<invalid_argument>("dml::cost::parse_layout: expected cp_attention ring or allgather, found '", value, "'");
      l.cp_all_gather = value == "allgather";
    } else
      fail<invalid_argument>("dml::cost::parse_layout: unknown key '", key,
                             "'; expected dp, tp, pp, ep, cp, zero, replicas, sp, schedule, mb, recompute or cp_attention");
  }
  return l;
}

// A cluster: what a step's time is priced with. Rates in FLOP/s and bytes/s, latency in seconds.
struct cluster {
  int devices_per_node = 8;
  double memory_bytes = 80.0 * (1ull << 30);
  double flops_fp32 = 60e12, flops_bf16 = 990e12;  // dense GEMM rate per device
  double intra_bandwidth = 450e9, intra_latency = 5e-6;   // within a node (per direction)
  double inter_bandwidth = 50e9, inter_latency = 10e-6;   // between nodes
  // Within a node, the ring bytes per second of an all-gather or a reduce-scatter, where they move at another rate
  // than an all-reduce's: comm::local's threads copy every block of an all-gather's output, their own too, and read
  // every block of a reduce-scatter's input, where the ring they are priced as moves (t − 1)/t of them.
  // cost::calibrate_rank_of times them. 0: intra_bandwidth, as on a ring.
  double intra_gather_bandwidth = 0;
  // The share of the GEMM rate that products of a given number of rows (a micro-batch's tokens) reach:
  // {rows, share} in increasing rows, interpolated in log(rows) between points and held beyond the ends
  // (dml-plan --calibrate measures it). Empty: every product at the full rate.
  std::vector<std::pair<double, double>> gemm_rows{};
  // Bytes per second a streaming pass reaches on one device: what the optimizer's update runs at
  // (update_bytes_per_param); dml-plan --calibrate times dml's own AdamW update.
  double memory_bandwidth = 2.5e12;
  // Bytes of a layer's saved activations (korthikanti_layer_bytes at the working type; a Llama's llama_layer_bytes)
  // per second that its element-wise passes (LayerNorms, softmax, GELU, dropout, residual adds), forward and backward
  // together, get through; the passes outside the blocks (gpt_end_values_per_token, at the working type's bytes) at
  // the same rate. The default takes four passes over those bytes at memory bandwidth (written in forward; read, with
  // their gradients written and read, in backward); cost::elementwise_bandwidth_of measures dml's own on a host.
  double elementwise_bandwidth = 2.5e12 / 4;
  // The same for 16-bit working types (bf16 and fp16), in bytes at 2 per value. The default takes the passes as
  // bandwidth-bound (the same bytes per second); dml's host kernels, which convert around float arithmetic, are not:
  // calibrated on an AVX-512 Xeon they move about as many values a second as in fp32 (2.5 G), half the bytes.
  double elementwise_bandwidth_bf16 = 2.5e12 / 4;
  // Seconds each transformer block costs a micro-batch on top of its bytes, whatever its tokens: its layers' calls,
  // their threads' start, the workspaces they take (forward and backward together; in fp32 and in 16-bit working
  // types). cost::probe_gpt fits it on a host; 0 prices the passes by their bytes alone.
  double block_seconds = 0, block_seconds_bf16 = 0;
  double flops(precision p) const { return p == precision::fp32 ? flops_fp32 : flops_bf16; }
  double block(precision p) const { return p == precision::fp32 ? block_seconds : block_seconds_bf16; }
  double elementwise(precision p) const { return p == precision::fp32 ? elementwise_bandwidth : elementwise_bandwidth_bf16; }
  double gemm_share(double rows) const {
    if (gemm_rows.empty()) return 1.0;
    if (rows <= gemm_rows.front().first) return gemm_rows.front().second;
    for (std::size_t i = 1; i < gemm_rows.size(); ++i)
      if (rows <= gemm_rows[i].first) {
        const auto [r0, s0] = gemm_rows[i - 1];
        const auto [r1, s1] = gemm_rows[i];
        return s0 + (s1 - s0) * std::log(rows / r0) / std::log(r1 / r0);
      }
    return gemm_rows.back().second;
  }
};

struct training {
  std::int64_t global_batch = 1;   // sequences per step
  precision prec = precision::bf16;
  std::string optimizer = "adamw";
};

struct bytes {
  double params = 0, grads = 0, optimizer = 0, master = 0, activations = 0, buffers = 0;
  // dml's bytes only (cost::evaluate_dml): what a rank holds at its high-water mark beyond the model states and the
  // activation peak (memory().allocated_peak less those): workspaces, the pipeline's transfer copies, transients.
  double workspace = 0;
  double total() const { return params + grads + optimizer + master + activations + buffers + workspace; }
};

struct estimate {
  layout lay;
  precision prec = precision::bf16;  // the working precision it was priced at (training::prec)
  double params = 0;  // the whole model's parameter count
  bytes per_rank;     // the largest rank
  double flops_per_step = 0, hardware_flops_per_step = 0;
  double step_seconds = 0, mfu = 0, bubble = 0;
  // The step's parts (seconds; step_seconds is their sum): the busiest rank's products (compute) and element-wise
  // passes, its tensor-parallel and pipeline messages, the pipeline's idle slots, the data-parallel reduction and the
  // optimizer's update.
  struct parts {
    double compute = 0, elementwise = 0, tp = 0, ep = 0, cp = 0, pp = 0, bubble = 0, dp = 0, update = 0;
    // Each part with the name the bottleneck goes by.
    std::array<std::pair<const char*, double>, 9> named() const {
      return {{{"compute", compute}, {"element-wise passes", elementwise}, {"tensor-parallel communication", tp},
               {"expert routing and all-to-alls", ep}, {"context-parallel ring", cp}, {"pipeline sends", pp},
               {"pipeline bubble", bubble}, {"data-parallel communication", dp}, {"optimizer update", update}}};
    }
  } time;
  std::string bottleneck;
  bool fits = false;
  std::string why;  // empty when it fits
};

// A dense block's activation bytes at sequence s, micro-batch b, tensor-parallel degree t and w bytes a value: a GPT's
// Korthikanti et al.'s (their 2-byte tensors, scaled to w), a Llama's llama_layer_bytes, or with latent attention
// (one tensor rank) as nn::llama_block keeps it: of each token the RMSNorms' outputs, the residual and the output (4h,
// or 2h selective) and their 1/rms, the two latents before and after their RMSNorms (2·q_lora_rank + 2·kv_lora_rank)
// with theirs, q, k and v as attention reads them (3·heads·(nope + rope), values padded), attention's output at that
// width and o_proj's input (heads·v), a float log-sum-exp per head, and SwiGLU's [gate | up] and output (3f, or 2f
// selective); full recompute keeps the input alone.
inline double layer_activation_bytes(const model& m, double s, double b, double t, double w, bool sequence_parallel,
                                     recompute r) {
  const double h = static_cast<double>(m.d_model), a = static_cast<double>(m.heads), f = static_cast<double>(m.ffn_hidden);
  if (!m.is_llama()) return korthikanti_layer_bytes(s, b, h, a, t, sequence_parallel, r) * (w / 2);
  if (!m.latent()) return llama_layer_bytes(s, b, h, a, static_cast<double>(m.kv()), f, t, w, sequence_parallel, r);
  const double tokens = s * b;
  if (r == recompute::full) return tokens * h * w;
  const bool sel = r == recompute::selective;
  const double qd = static_cast<double>(m.qk_nope_dim + m.qk_rope_dim), v = static_cast<double>(m.v_head_dim);
  const double latents = 2 * static_cast<double>(m.q_lora_rank + m.kv_lora_rank);
  const double floats = (m.q_lora_rank > 0 ? 4 : 3) + a;  // the 1/rms of each RMSNorm and the log-sum-exp per head
  return tokens * (((sel ? 2 : 4) * h + latents + 4 * a * qd + a * v + (sel ? 2 : 3) * f) * w + 4 * floats);
}

// ---- the GPT's and the Llama's counts (their parameters, as their layers declare them) ----------------

// An expert's width, and the parameters and forward FLOPs per token of an MLP of width f in a block of `m`: a GPT's
// GELU MLP (two products, biases with m.bias) or a Llama's SwiGLU (gate and up, then down).
inline double expert_width(const model& m) {
  if (m.expert_ffn > 0) return static_cast<double>(m.expert_ffn);
  return m.arch == architecture::llama ? static_cast<double>(m.ffn_hidden) : 4 * static_cast<double>(m.d_model);
}
inline double mlp_params(const model& m, double f) {
  const double h = static_cast<double>(m.d_model);
  if (m.arch == architecture::llama) return 3 * h * f;
  return 2 * h * f + (m.bias ? f + h : 0);
}
inline double mlp_forward_flops(const model& m, double f) {
  return (m.arch == architecture::llama ? 6 : 4) * static_cast<double>(m.d_model) * f;
}
// A block with experts: its MLP's forward FLOPs per token (top_k experts and the shared MLP; the router apart) and its
// parameters (every expert, the router's E·h, the shared MLP).
inline double moe_mlp_flops(const model& m) {
  const double f = expert_width(m);
  return static_cast<double>(m.top_k) * mlp_forward_flops(m, f) +
         (m.shared_experts > 0 ? mlp_forward_flops(m, static_cast<double>(m.shared_experts) * f) : 0);
}
inline double moe_mlp_params(const model& m) {
  const double f = expert_width(m), e = static_cast<double>(m.experts);
  return e * mlp_params(m, f) + static_cast<double>(m.d_model) * e +
         (m.shared_experts > 0 ? mlp_params(m, static_cast<double>(m.shared_experts) * f) : 0);
}

struct gpt_counts {
  double embedding = 0, block = 0, moe_block = 0, head = 0;  // parameters
  double total(const model& m) const {
    const double moe_blocks = static_cast<double>(m.moe_blocks());
    return embedding + (static_cast<double>(m.layers) - moe_blocks) * block + moe_blocks * moe_block + head;
  }
};
inline gpt_counts count_gpt(const model& m) {
  const double h = static_cast<double>(m.d_model), b = m.bias ? 1 : 0;
  gpt_counts c;
  c.embedding = static_cast<double>(m.vocab) * h + static_cast<double>(m.seq) * h;
  const double attn = 2 * h * (1 + b) + 3 * h * h + 3 * h * b + h * h + h * b;
  const double mlp = 4 * h * h + 4 * h * b + 4 * h * h + h * b;
  c.block = attn + mlp;
  c.moe_block = attn + moe_mlp_params(m);
  c.head = h * (1 + b) + (m.tie ? 0 : static_cast<double>(m.vocab) * h);
  return c;
}
// nn::llama's: the token embedding; per block two RMSNorm weights, q, k and v (heads·head_dim + 2·kv·head_dim rows),
// o_proj, gate and up (2·ffn_hidden rows) and down_proj; the final RMSNorm and the LM head (untied). No bias.
// Latent attention in place of q, k, v and o_proj: q_a_proj, q_a_layernorm and q_b_proj (or q_proj),
// kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj and o_proj.
inline double latent_attention_params(const model& m) {
  const double h = static_cast<double>(m.d_model), a = static_cast<double>(m.heads);
  const double qd = static_cast<double>(m.qk_nope_dim + m.qk_rope_dim), qr = static_cast<double>(m.q_lora_rank);
  const double kvr = static_cast<double>(m.kv_lora_rank), v = static_cast<double>(m.v_head_dim);
  const double q = m.q_lora_rank > 0 ? qr * h + qr + a * qd * qr : a * qd * h;
  return q + (kvr + static_cast<double>(m.qk_rope_dim)) * h + kvr + a * (static_cast<double>(m.qk_nope_dim) + v) * kvr +
         h * a * v;
}
inline gpt_counts count_llama(const model& m) {
  const double h = static_cast<double>(m.d_model), v = static_cast<double>(m.vocab), f = static_cast<double>(m.ffn_hidden);
  const double kv = static_cast<double>(m.kv()) * (h / static_cast<double>(m.heads));
  gpt_counts c;
  c.embedding = v * h;
  c.block = 2 * h + (m.latent() ? latent_attention_params(m) : (h + 2 * kv) * h + h * h) + 3 * f * h;
  c.moe_block = c.block - 3 * f * h + moe_mlp_params(m);
  c.head = h + (m.tie ? 0 : v * h);
  return c;
}
inline gpt_counts count_layers(const model& m) { return m.is_llama() ? count_llama(m) : count_gpt(m); }

// Forward FLOPs per token of a dense block: its attention's products (q·kᵀ and p·v over all seq keys included) and
// its MLP's; a Llama's as nn::llama_block::forward_flops counts them.
struct block_flops {
  double attention = 0, mlp = 0;
};
inline block_flops block_forward_flops(const model& m) {
  const double h = static_cast<double>(m.d_model), s = static_cast<double>(m.seq);
  if (!m.is_llama()) return {2 * (4 * h * h) + 2 * (2 * s * h), 2 * 8 * h * h};  // qkv + proj, QK^T and AV
  const double mlp = 6 * h * static_cast<double>(m.ffn_hidden);
  if (m.latent()) {  // as nn::llama_block::latent_flops_per_token
    const double a = static_cast<double>(m.heads), qd = static_cast<double>(m.qk_nope_dim + m.qk_rope_dim);
    const double qr = static_cast<double>(m.q_lora_rank), kvr = static_cast<double>(m.kv_lora_rank);
    const double v = static_cast<double>(m.v_head_dim);
    const double q = m.q_lora_rank > 0 ? 2 * qr * (h + a * qd) : 2 * h * a * qd;
    const double kv = 2 * h * (kvr + static_cast<double>(m.qk_rope_dim)) + 2 * kvr * a * (static_cast<double>(m.qk_nope_dim) + v);
    return {q + kv + 2 * a * v * h + 2 * s * a * (qd + v), mlp};
  }
  const double kv = static_cast<double>(m.kv()) * (h / static_cast<double>(m.heads));
  return {2 * h * (h + 2 * kv) + 2 * h * h + 4 * s * h, mlp};
}

// Model FLOPs of one step (forward and backward: 3 × forward GEMMs; attention's two batched GEMMs included),
// tokens = global batch × seq; with full recompute, hardware FLOPs add one forward of the blocks.
inline double gpt_forward_flops_per_token(const model& m, bool blocks_only = false) {
  const double h = static_cast<double>(m.d_model), v = static_cast<double>(m.vocab);
  const double moe_blocks = static_cast<double>(m.moe_blocks());
  const double dense = static_cast<double>(m.layers) - moe_blocks;
  const auto [attn, mlp] = block_forward_flops(m);
  const double blocks = dense * (attn + mlp) + moe_blocks * (attn + moe_mlp_flops(m));
  return blocks + (blocks_only ? 0 : 2 * h * v);
}

// The share of a step's FLOPs that the busiest pipeline rank computes when the model's layers (embedding, blocks, head)
// are cut where their training FLOPs balance, as the trainer cuts them (parallel::stage_chunks over
// parallel::layer_training_flops: the embedding's lookup and the blocks' and head's products, three times the forward's with
// their gradients); 1/pp for a model known by its parameter count. The pipeline runs at this rank's pace.
inline double busiest_stage_share(const model& m, const layout& l) {
  if (l.pp <= 1) return 1;
  if (!m.is_transformer()) return 1.0 / l.pp;
  const double h = static_cast<double>(m.d_model), s = static_cast<double>(m.seq) / l.cp;
  const auto [attn, mlp] = block_forward_flops(m);
  std::vector<double> cost{2 * h * s};  // per sequence: the embedding's lookup and its weight gradient
  for (std::int64_t i = 0; i < m.layers; ++i) {
    const bool moe = m.moe_block(i);
    const double experts = moe_mlp_flops(m) + 2 * h * static_cast<double>(m.experts);  // and the router
    cost.push_back(3 * s * (moe ? attn / l.tp + experts : (attn + mlp) / l.tp));  // experts stay whole per tensor rank
  }
  cost.push_back(3 * s * 2 * h * static_cast<double>(m.vocab) / l.tp);
  const int chunks = std::max(1, interleaved_chunks(l.schedule));
  const auto first = parallel::balance_stages(cost, l.pp * chunks);
  const auto stages = parallel::stage_costs(cost, first);
  double total = 0, busiest = 0;
  for (double c : cost) total += c;
  for (int r = 0; r < l.pp; ++r) {
    double mine = 0;
    for (std::size_t v = static_cast<std::size_t>(r); v < stages.size(); v += static_cast<std::size_t>(l.pp)) mine += stages[v];
    busiest = std::max(busiest, mine);
  }
  return total > 0 ? busiest / total : 1.0 / l.pp;
}

// ---- checks and the estimate -------------------------------------------------------------------------

// Why a layout cannot run this model at this batch (empty: it can). The trainer refuses the same.
inline std::string refusal(const model& m, const layout& l, const training& t, int devices) {
  auto str = [](auto v) { return std::to_string(v); };
  if (l.dp < 1 || l.tp < 1 || l.pp < 1 || l.ep < 1 || l.cp < 1 || l.replicas < 1 || l.micro_batches < 1)
    return "every degree and mb must be at least 1";
  if (devices > 0 && l.devices() != devices)
    return "dp × tp × pp = " + str(l.devices()) + " but there are " + str(devices) + " devices";
  if (l.zero < 0 || l.zero > 3) return "zero must be 0 to 3, found " + str(l.zero);
  if (l.dp % l.replicas != 0) return "replicas " + str(l.replicas) + " do not divide dp " + str(l.dp);
  if (l.replicas > 1 && l.zero == 0) return "replicas > 1 needs zero 1 to 3 (hybrid sharding)";
  if (l.dp % l.ep != 0 || l.dp % l.cp != 0) return "ep and cp are carved out of dp: they must divide dp " + str(l.dp);
  if (l.sp && l.tp == 1) return "sequence parallelism needs tp > 1";
  if (l.schedule == "single" && l.pp > 1) return "schedule single runs one stage; pp is " + str(l.pp);
  const std::int64_t data = l.dp / l.cp;
  if (t.global_batch % data != 0)
    return "the global batch " + str(t.global_batch) + " is not divisible by the " + str(data) + " data-parallel groups";
  if (t.global_batch / data % l.micro_batches != 0)
    return "a rank's " + str(t.global_batch / data) + " sequences do not split into mb = " + str(l.micro_batches);
  if (l.pp > 1 && l.micro_batches < l.pp)
    return "mb = " + str(l.micro_batches) + " is fewer than pp = " + str(l.pp) + " stages";
  if (!m.is_transformer()) return {};
  if (m.heads % l.tp != 0) return "tp " + str(l.tp) + " does not divide the " + str(m.heads) + " heads";
  if (m.vocab % l.tp != 0) return "tp " + str(l.tp) + " does not divide the vocabulary " + str(m.vocab);
  if (m.latent()) {  // what nn::llama_config::validate and a latent attention block refuse
    if (l.tp > 1) return "latent attention runs on one tensor rank, found tp " + str(l.tp);
    if (l.cp > 1) return "latent attention runs on one context rank, found cp " + str(l.cp);
    if (m.qk_rope_dim % 2 != 0) return "qk_rope_dim " + str(m.qk_rope_dim) + " is odd (RoPE rotates pairs)";
    if (m.v_head_dim > m.qk_nope_dim + m.qk_rope_dim) return "v_head_dim is wider than a head's query";
  } else if (m.d_model % m.heads != 0) {
    return "heads " + str(m.heads) + " do not divide d_model " + str(m.d_model);
  }
  if (m.is_llama() && !m.latent()) {  // what nn::llama_config::validate and the Llama's layers refuse
    if (m.ffn_hidden < 1) return "a Llama needs ffn_hidden >= 1, found " + str(m.ffn_hidden);
    if (m.heads % m.kv() != 0) return "kv_heads " + str(m.kv()) + " do not divide the " + str(m.heads) + " heads";
    if (m.d_model / m.heads % 2 != 0)
      return "a Llama's head_dim " + str(m.d_model / m.heads) + " is odd (RoPE rotates pairs)";
    if (l.tp > m.kv() ? l.tp % m.kv() != 0 : m.kv() % l.tp != 0)
      return "tp " + str(l.tp) + " neither divides the " + str(m.kv()) + " key/value heads nor is a multiple of them";
    if (l.tp > m.kv() && m.kv() * (m.d_model / m.heads) % l.tp != 0)
      return "tp " + str(l.tp) + " does not divide the key/value heads' " + str(m.kv() * (m.d_model / m.heads)) + " columns";
    if (m.ffn_hidden % l.tp != 0) return "tp " + str(l.tp) + " does not divide ffn_hidden " + str(m.ffn_hidden);
    if (m.bias) return "a Llama has no biases";
  }
  if (l.pp > m.layers) return "pp " + str(l.pp) + " is more than the " + str(m.layers) + " layers";
  if (const int v = interleaved_chunks(l.schedule); v > 0 && l.pp * v > m.layers)
    return "interleaved:" + str(v) + " on pp " + str(l.pp) + " needs " + str(l.pp * v) + " stages of layers, more than the " +
           str(m.layers) + " layers";
  if (l.ep > 1 && (m.experts == 0 || m.experts % l.ep != 0))
    return "ep " + str(l.ep) + " does not divide the " + str(m.experts) + " experts";
  if (m.seq % (2 * l.cp) != 0 && l.cp > 1) return "cp " + str(l.cp) + " needs seq divisible by " + str(2 * l.cp);
  if (l.sp && m.seq / l.cp * (t.global_batch / data / l.micro_batches) % l.tp != 0)
    return "sequence parallelism needs a micro-batch's tokens divisible by tp";
  return {};
}

// One step's collectives in a tensor-parallel group of nn::gpt (or nn::llama), as each of its ranks makes them: calls,
// their payload in bytes as nn::rank_group::bytes counts it (an all-gather's or reduce-scatter's whole tensor), and in
// a ring the steps each waits a link's latency (an all-reduce 2(t − 1), an all-gather or reduce-scatter t − 1) and the bytes
// each rank moves (2(t − 1)/t and (t − 1)/t of the payload). Per
// micro-batch of T tokens (seq/cp · rows), hidden h, at the working type's w bytes:
// - without sp: each block's 2 all-reduces forward and 2 backward of T·h values; the embedding's sum (forward) and
//   the head's input gradient (backward), one each;
// - with sp: each block's 2 all-gathers and 2 reduce-scatters forward, 4 all-gathers (2 re-gather the LayerNorms'
//   outputs) and 2 reduce-scatters backward; the embedding's reduce-scatter and its gradient's all-gather, the head's
//   input all-gather and its gradient's reduce-scatter; and once a step, in fp32, an all-reduce of each weight whose
//   gradient is partial over the group: a block's 2 LayerNorm weights (with bias also their biases and the two
//   row-parallel biases: 6), the final LayerNorm's (2 with bias) and the position embedding (seq·h); a Llama's are
//   the same but for the position embedding, which it has not (its RMSNorms have no bias); and where t exceeds a
//   Llama's key/value heads, each block's all-gather of their k and v slices forward and reduce-scatter backward,
//   2·kv_heads·head_dim values a token;
// - the vocabulary-parallel loss's max and its sums, all-reduces of T and 2T floats.
// A pipeline stage holds ceil(layers / pp) blocks; the first stage the embedding, the last the head and loss, and
// where pp > 1 the last one's (the busier end) is priced. A block with experts counts as a dense one here (its
// experts stay whole per tensor rank; the router's all-reduce and the all-to-alls are priced apart).
struct collectives {
  double calls = 0, payload = 0, steps = 0, moved = 0;
  double moved_gather = 0;  // the part of `moved` that all-gathers and reduce-scatters move
};
inline collectives gpt_tp_collectives(const model& m, const layout& l, double mb_rows, double w) {
  collectives c;
  if (l.tp <= 1 || !m.is_transformer()) return c;
  const double t = l.tp, h = static_cast<double>(m.d_model), M = static_cast<double>(l.micro_batches);
  const double T = static_cast<double>(m.seq) / l.cp * mb_rows, blocks = std::ceil(static_cast<double>(m.layers) / l.pp);
  const double big = T * h * w, f32 = 4, bias = m.bias ? 1 : 0;
  const double embedding = l.pp == 1 ? 1 : 0;  // the head's end is on every priced stage
  auto add = [&](double calls, double payload, bool all_reduce) {
    const double ring = all_reduce ? 2 : 1;
    c.calls += calls;
    c.payload += calls * payload;
    c.steps += calls * ring * (t - 1);
    c.moved += calls * ring * payload * (t - 1) / t;
    if (!all_reduce) c.moved_gather += calls * payload * (t - 1) / t;
  };
  if (!l.sp) {
    add(M * (4 * blocks + embedding + 1), big, true);
  } else {
    add(M * (10 * blocks + 2 * embedding + 2), big, false);
    add(blocks * (2 + 4 * bias), h * f32, true);
    add(1 + bias, h * f32, true);
    if (m.is_gpt()) add(embedding, static_cast<double>(m.seq) * h * f32, true);
  }
  if (m.is_llama() && l.tp > m.kv())
    add(M * 2 * blocks, T * 2 * static_cast<double>(m.kv() * (m.d_model / m.heads)) * w, false);
  add(M, T * f32, true);
  add(M, 2 * T * f32, true);
  return c;
}

// Whether the largest rank's bytes fit the cluster's memory, and if not, why.
inline void check_fit(estimate& e, const cluster& c) {
  e.fits = e.per_rank.total() <= c.memory_bytes;
  e.why = e.fits ? "" : "needs " + std::to_string(static_cast<long long>(e.per_rank.total())) +
                            " bytes per rank, over the memory of " + std::to_string(static_cast<long long>(c.memory_bytes));
}

inline estimate evaluate(const model& m, const layout& l, const training& t, const cluster& c, int devices = 0) {
  estimate e;
  e.lay = l;
  e.prec = t.prec;
  e.why = refusal(m, l, t, devices);
  if (!e.why.empty()) return e;
  const int slots = state_slots(t.optimizer);
  const bool mixed = t.prec != precision::fp32;
  const double w = value_bytes(t.prec);
  const double shard = l.zero > 0 ? l.dp / l.replicas : 1;  // ZeRO shards over one replica's ranks
  const double mb_rows = static_cast<double>(t.global_batch / (l.dp / l.cp) / l.micro_batches);

  // Parameters held by the largest rank: the first stage's blocks plus the embedding (and, on one stage,
  // the head), over tp; experts over ep.
  double psi_rank = 0;
  if (m.is_transformer()) {
    const auto g = count_layers(m);
    e.params = g.total(m);
    const double blocks = std::ceil(static_cast<double>(m.layers) / l.pp);
    const double moe_frac = m.moe_share();
    const double block = (1 - moe_frac) * g.block + moe_frac * (g.moe_block - (g.moe_block - g.block) * (1 - 1.0 / l.ep));
    psi_rank = (blocks * block + g.embedding + (l.pp == 1 ? g.head : 0)) / l.tp;
  } else {
    e.params = m.params_only;
    psi_rank = m.params_only / (l.tp * l.pp);
  }
  auto& b = e.per_rank;
  b.params = psi_rank * w / (l.zero == 3 ? shard : 1);
  b.grads = psi_rank * w / (l.zero >= 2 ? shard : 1);
  b.optimizer = psi_rank * 4 * slots / (l.zero >= 1 ? shard : 1);
  b.master = mixed ? psi_rank * 4 / (l.zero >= 1 ? shard : 1) : 0;

  // A layer's activation bytes at v bytes a value of sequence s: Korthikanti's for a GPT (their 2-byte tensors,
  // scaled), llama_layer_bytes for a Llama.
  const auto layer_bytes = [&](double s, double v, recompute r) {
    return layer_activation_bytes(m, s, mb_rows, l.tp, v, l.sp, r);
  };
  if (m.is_transformer()) {
    // Activations: a layer's bytes at the working type, times the layers of a stage and the micro-batches in flight
    // on the first stage.
    const double s = static_cast<double>(m.seq) / l.cp;
    const double per_layer = layer_bytes(s, w, l.recomp);
    const double layers = std::ceil(static_cast<double>(m.layers) / l.pp);
    const double in_flight = l.schedule == "gpipe" ? static_cast<double>(l.micro_batches)
                           : l.pp > 1 ? std::min<double>(static_cast<double>(l.micro_batches), l.pp) : 1;
    // Full recompute holds one layer's activations at a time on top of every layer's input.
    const double full_layer = l.recomp == recompute::full ? layer_bytes(s, w, recompute::none) : 0;
    // Interleaving holds (1 + (p − 1)/(p·V)) times 1F1B's micro-batches on the first stage (Narayanan et al. 2021).
    const int chunks = interleaved_chunks(l.schedule);
    const double interleave = chunks > 0 ? 1 + static_cast<double>(l.pp - 1) / (l.pp * chunks) : 1;
    b.activations = in_flight * interleave * layers * per_layer + full_layer;
    // Logits of a micro-batch on the last stage (vocabulary-parallel): s·b·V/t values, kept once.
    b.buffers = s * mb_rows * static_cast<double>(m.vocab) / l.tp * w;
  }

  // FLOPs and time.
  const double tokens = static_cast<double>(t.global_batch) * static_cast<double>(m.seq);
  if (m.is_transformer()) {
    e.flops_per_step = 3 * tokens * gpt_forward_flops_per_token(m);
    const double extra = l.recomp == recompute::full ? tokens * gpt_forward_flops_per_token(m, true)
                       : l.recomp == recompute::selective && !m.is_llama()  // a Llama's recomputes no product
                           ? tokens * static_cast<double>(m.layers) * 2 * (2 * static_cast<double>(m.seq) * m.d_model)
                                                          : 0;
    e.hardware_flops_per_step = e.flops_per_step + extra;
  } else {
    e.flops_per_step = e.hardware_flops_per_step = 6 * tokens * e.params;
  }
  const double rate = c.flops(t.prec);
  // The busiest rank's share, no bubble, its products at the rate of a micro-batch's rows (tokens).
  const double gemm_rows = mb_rows * static_cast<double>(std::max<std::int64_t>(m.seq, 1)) / l.cp;
  // Under ep the busiest rank's experts run busiest_expert_load times their mean rows.
  const double load = m.experts > 0 ? busiest_expert_load(m.capacity_factor, l.ep) : 1;
  const double expert_flops = m.experts > 0 ? 3 * tokens * static_cast<double>(m.moe_blocks()) *
                                                  static_cast<double>(m.top_k) * mlp_forward_flops(m, expert_width(m))
                                            : 0;
  const double compute = (e.hardware_flops_per_step + (load - 1) * expert_flops) / (l.dp * l.tp) *
                         busiest_stage_share(m, l) / (rate * c.gemm_share(gemm_rows));
  auto link = [&](int group_span) {  // a group of ranks spanning group_span consecutive devices
    return group_span <= c.devices_per_node ? std::pair{c.intra_bandwidth, c.intra_latency}
                                            : std::pair{c.inter_bandwidth, c.inter_latency};
  };
  // Tensor parallelism: every collective of the step (gpt_tp_collectives), a latency per ring step and the bytes a
  // rank moves (within a node, the all-gathers' and reduce-scatters' at their own rate where the cluster has one).
  double tp_time = 0;
  if (l.tp > 1 && m.is_transformer()) {
    const auto [bw, lat] = link(l.tp);
    const double gather_bw = l.tp <= c.devices_per_node && c.intra_gather_bandwidth > 0 ? c.intra_gather_bandwidth : bw;
    const collectives tc = gpt_tp_collectives(m, l, mb_rows, w);
    tp_time = tc.steps * lat + (tc.moved - tc.moved_gather) / bw + tc.moved_gather / gather_bw;
  }
  // Data parallelism: one all-reduce (or reduce-scatter + all-gather) of the gradients per step.
  double dp_time = 0;
  if (l.dp > 1) {
    const auto [bw, lat] = link(l.dp * l.tp * l.pp);
    dp_time = 2.0 * (l.dp - 1) / l.dp * psi_rank * w / bw + 2.0 * (l.dp - 1) * lat;
    if (l.zero == 3) dp_time *= 1.5;  // parameters gathered in forward and backward, gradients reduce-scattered
  }
  // Pipeline: the schedule's bubble, (p − 1)/(units + p − 1) of the step (schedule_units); sends of s·b·h each
  // way, per micro-batch and chunk.
  double pp_time = 0;
  if (l.pp > 1 && m.is_transformer()) {
    const auto [bw, lat] = link(l.tp * l.pp);
    const double msg = static_cast<double>(m.seq) / l.cp * mb_rows * static_cast<double>(m.d_model) * w / (l.sp ? l.tp : 1);
    pp_time = 2 * static_cast<double>(l.micro_batches) * std::max(1, interleaved_chunks(l.schedule)) * (msg / bw + lat);
  }
  // The blocks' element-wise passes: their saved activation bytes (Korthikanti et al.'s, which shrink with tp only
  // where the work splits; a Llama's llama_layer_bytes) for every micro-batch, at the element-wise rate, and each
  // block's fixed cost (cluster::block_seconds) for every micro-batch; recomputation's extra forward is not priced.
  // The passes outside the blocks are the first stage's (embedding) and the last's (final LayerNorm, loss): both on one stage, else the
  // larger. A block with experts (moe_mlp_bytes_per_sbh) trades the dense MLP's 19·sbh for its experts' passes;
  // under cp a rank's queries meet every key (a GPT's s² terms at its s/cp queries by s keys; a Llama's have none, as
  // llama_layer_bytes) and the ring adds ring_attention_bytes_per_sbh.
  double elementwise = 0;
  const double stage_blocks = std::ceil(static_cast<double>(m.layers) / l.pp);
  const double stage_moe_blocks = stage_blocks * m.moe_share();
  const double s_rank = static_cast<double>(m.seq) / l.cp, M = static_cast<double>(l.micro_batches);
  if (m.is_transformer()) {
    const double rank_tokens = s_rank * mb_rows * M;
    const auto ends = gpt_end_values_per_token(static_cast<double>(m.d_model), static_cast<double>(m.vocab), l.tp, l.sp,
                                               m.is_gpt());
    const double end_values = l.pp == 1 ? ends.embedding + ends.head : std::max(ends.embedding, ends.head);
    const double h = static_cast<double>(m.d_model), a = static_cast<double>(m.heads);
    double dense_layer = layer_bytes(s_rank, 2, recompute::none);
    // A Llama's selective recompute writes the outputs it dropped again in backward, and reads them there.
    if (m.is_llama() && l.recomp == recompute::selective)
      dense_layer += 2 * (dense_layer - layer_bytes(s_rank, 2, recompute::selective));
    if (l.cp > 1)
      dense_layer += s_rank * mb_rows * h / l.tp *
                     ((m.is_llama() ? 0 : 5 * a * (static_cast<double>(m.seq) - s_rank) / h) + ring_attention_bytes_per_sbh);
    // An expert block's tokens per tensor rank: every token, or a t-th of them under sequence parallelism.
    const double moe_sbh = s_rank * mb_rows * static_cast<double>(m.d_model) / (l.sp ? l.tp : 1);
    const double moe_extra = (moe_mlp_bytes_per_sbh(m.top_k, l.ep) * load - 19) * moe_sbh;
    elementwise = (M * (stage_blocks * dense_layer + stage_moe_blocks * moe_extra) * (w / 2) + rank_tokens * end_values * w) /
                      c.elementwise(t.prec) +
                  stage_blocks * M * c.block(t.prec);
  }
  // Experts: each block's routing all-reduces a few numbers over the data group (a latency per ring step) per
  // micro-batch; under ep, the 4 all-to-alls of moe_all_to_all_bytes, a latency per peer and the bytes leaving.
  double ep_time = 0;
  if (stage_moe_blocks > 0) {
    const int group = l.dp / l.cp;
    if (group > 1) ep_time += stage_moe_blocks * M * 2 * (group - 1) * link(l.dp * l.tp * l.pp).second;
    if (l.ep > 1) {
      const auto [bw, lat] = link(l.ep * l.tp);
      const double bytes = moe_all_to_all_bytes(s_rank * mb_rows / (l.sp ? l.tp : 1), static_cast<double>(m.d_model),
                                                static_cast<double>(m.top_k), w);
      ep_time += stage_moe_blocks * M * 4 * ((l.ep - 1) * lat + bytes * (l.ep - 1) / l.ep / bw);
    }
  }
  // Context parallelism: each block's ring, per micro-batch cp − 1 steps forward and 2(cp − 1) backward (K/V, then
  // their gradients), each a latency and ring_kv_bytes of the rank's tokens (its key/value heads' share under tp: a
  // Llama's grouped-query blocks send kv_heads' columns, not d_model).
  double cp_time = 0;
  if (l.cp > 1 && m.is_transformer()) {
    const auto [bw, lat] = link(l.cp * l.tp);
    const double kv_width = static_cast<double>(m.d_model) * static_cast<double>(m.kv()) / static_cast<double>(m.heads);
    const double kv = ring_kv_bytes(s_rank * mb_rows, kv_width / l.tp, w);
    cp_time = stage_blocks * M * 3 * (l.cp - 1) * (lat + kv / bw);
  }
  // The optimizer's update, after the gradients: the rank's parameters (its shard under ZeRO), each moving
  // update_bytes_per_param at memory bandwidth.
  const double update_time = psi_rank / (l.zero >= 1 ? shard : 1) * update_bytes_per_param(t.optimizer, t.prec) /
                             c.memory_bandwidth;
  const double busy = compute + elementwise + tp_time + ep_time + cp_time + pp_time;
  const double units = schedule_units(l);
  const double slots_in_step = (units + l.pp - 1) / units;
  const double pipeline = busy * slots_in_step;
  e.step_seconds = pipeline + dp_time + update_time;
  e.bubble = e.step_seconds > 0 ? (pipeline - busy) / e.step_seconds : 0;
  e.mfu = e.flops_per_step / (e.step_seconds * rate * l.devices());
  e.time = {compute, elementwise, tp_time, ep_time, cp_time, pp_time, pipeline - busy, dp_time, update_time};
  const auto parts = e.time.named();
  e.bottleneck =
      std::max_element(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.second < b.second; })->first;
  check_fit(e, c);
  return e;
}

namespace detail {
// std::stable_sort's order by std::sort with the position as the last key: libstdc++ 12's stable_sort calls the
// deprecated std::get_temporary_buffer, which clang 18 and later report in every unit that instantiates it.
template <class T, class Less>
void stable_sort(std::vector<T>& v, Less less) {
  std::vector<std::size_t> order(v.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return less(v[a], v[b]) || (!less(v[b], v[a]) && a < b); });
  std::vector<T> sorted;
  sorted.reserve(v.size());
  for (const std::size_t i : order) sorted.push_back(std::move(v[i]));
  v = std::move(sorted);
}
}  // namespace detail

// Those that fit first, fastest first; then those that can run but need more memory; then the refused.
inline void rank_estimates(std::vector<estimate>& out) {
  detail::stable_sort(out, [](const estimate& a, const estimate& b) {
    const bool ra = a.why.empty() || a.fits, rb = b.why.empty() || b.fits;
    if (a.fits != b.fits) return a.fits;
    if (ra != rb) return ra;
    return a.step_seconds < b.step_seconds;
  });
}

// Every layout of `devices` ranks (tp, pp powers of two, zero 0 to 3, recompute none/selective/full, a pipeline
// under 1F1B or zb, micro-batches of `micro_batch` sequences, or with micro_batch 0 every micro-batch count that
// divides a rank's sequences), evaluated; the ones that fit first, fastest first. Interleaved and GPipe are left
// out: at equal micro-batches zb's bubble is the smaller and GPipe's activations the larger. max_cp > 1 also cuts each
// sequence over cp = 2, 4, ... up to max_cp of the data-parallel ranks (long context; the rows then split over dp/cp).
// A model with experts also shares them out over ep = 2, 4, ... of the data-parallel ranks (ep dividing the experts).
inline std::vector<estimate> search(const model& m, const training& t, const cluster& c, int devices,
                                    std::int64_t micro_batch, int max_cp = 1) {
  std::vector<estimate> out;
  for (int tp = 1; tp <= devices; tp *= 2)
    for (int pp = 1; tp * pp <= devices; pp *= 2)
     for (int cp = 1; cp <= max_cp && tp * pp * cp <= devices; cp *= 2) {
      if (devices % (tp * pp * cp) != 0) continue;
      const int dp = devices / (tp * pp);
      const std::vector<std::string> schedules = pp > 1 ? std::vector<std::string>{"1f1b", "zb"}
                                                        : std::vector<std::string>{"single"};
      for (int ep = 1; ep <= dp; ep *= 2) {
      if (ep > 1 && (m.experts <= 0 || m.experts % ep != 0 || dp % ep != 0)) continue;
      for (int zero = 0; zero <= 3; ++zero) {
        if (dp == 1 && zero > 0) continue;
        for (recompute r : {recompute::none, recompute::selective, recompute::full}) {
          if (!m.is_transformer() && r != recompute::none) continue;
          for (const auto& sched : schedules) {
            layout l{.dp = dp, .tp = tp, .pp = pp, .ep = ep, .cp = cp, .zero = zero, .sp = tp > 1, .schedule = sched,
                     .recomp = r};
            const std::int64_t rows = t.global_batch / (dp / cp);
            if (micro_batch > 0) {
              l.micro_batches = rows % micro_batch == 0 ? std::max<std::int64_t>(1, rows / micro_batch) : 1;
              out.push_back(evaluate(m, l, t, c, devices));
            } else {
              for (std::int64_t count = 1; count <= std::max<std::int64_t>(rows, 1); ++count)
                if (rows <= 0 || rows % count == 0) {
                  l.micro_batches = count;
                  out.push_back(evaluate(m, l, t, c, devices));
                }
            }
          }
        }
      }
      }
    }
  rank_estimates(out);
  return out;
}

// One search at each of several working precisions (training::prec in turn; search(t) → its estimates), ranked
// together: the fastest layout that fits may then be fp32 on a host whose bf16 products are slower than its fp32
// ones (widened to f32), or bf16 where only its smaller bytes fit. Each estimate says its precision (estimate::prec).
template <class Search>
std::vector<estimate> search_precisions(training t, const std::vector<precision>& precisions, Search&& search) {
  std::vector<estimate> out;
  for (const precision p : precisions) {
    t.prec = p;
    auto some = search(t);
    out.insert(out.end(), some.begin(), some.end());
  }
  rank_estimates(out);
  return out;
}

}  // namespace dml::cost
