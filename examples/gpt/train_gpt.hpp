// SPDX-License-Identifier: Apache-2.0
// examples/gpt/train_gpt.hpp — train a byte-level GPT or Llama on a text file, then sample from it.
// Flags: see command_line() below, or run it with --help. Prints a progress line every few steps and ends with final_loss=... tokens_per_s=...
// The trainers are instantiated per architecture (gpt_arch here, llama_arch in train_llama.hpp) and per communicator
// (comm::local in main.cpp, MPI and Gloo in units of their own).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <sys/resource.h>

#include "dml/dml.hpp"
#include "dml/nn/gpt.hpp"
#include "dml/nn/llama_config.hpp"
#include "dml/plan/calibrate.hpp"
#include "dml/plan/cluster.hpp"
#include "dml/plan/exact.hpp"
#include "dml/train/flags.hpp"
#include "dml/train/text.hpp"
#include "dml/train/weights.hpp"

namespace gpt_example {

struct options {
  // model
  std::string arch = "gpt";  // gpt | llama
  std::int64_t layers = 2, d_model = 128, heads = 4, seq = 64, vocab = 256;
  // llama: key/value heads (0: --heads), SwiGLU's width (0: 8/3 of d_model rounded up to a multiple of 32), RoPE's
  // base and RMSNorm's epsilon
  std::int64_t kv_heads = 0, ffn_hidden = 0;
  double rope_theta = 10000;
  float norm_eps = 1e-5f;
  std::optional<dml::nn::rope_scaling> rope_scaling;  // Llama 3.1's, from --load-hf's config.json
  // llama: DeepSeek-V3's multi-head latent attention with a key/value latent of kv_lora_rank (0: grouped-query
  // attention); a head's query/key columns without position and turned by RoPE, and its value width (0: d_model /
  // heads, half that, d_model / heads)
  std::int64_t kv_lora_rank = 0, q_lora_rank = 0, qk_nope_dim = 0, qk_rope_dim = 0, v_head_dim = 0;
  std::int64_t first_dense = 0;  // with experts: the first N blocks keep the dense MLP
  bool documents = false;  // the text's paragraphs (split at blank lines) as documents: attention stays within each
  float dropout = 0.f;
  bool bias = false;
  bool tie = false;  // lm_head.weight tied to wte.weight
  // mixture of experts: every --moe-every-th block's MLP becomes --experts experts (0: none)
  std::int64_t experts = 0, moe_every = 2;
  int top_k = 2;
  float capacity_factor = 1.25f;  // <= 0: dropless
  float aux_loss_weight = 0.01f, z_loss_weight = 0.001f;
  std::optional<std::int64_t> expert_ffn;  // each expert's width; unset: the dense MLP's
  std::int64_t shared_experts = 0;
  std::string router = "softmax";
  float router_bias_rate = 0.f;  // > 0: loss-free balancing
  // training
  std::int64_t batch = 16;  // global sequences per step
  std::int64_t steps = 500;
  float lr = 3e-3f;
  std::int64_t warmup = -1;  // -1: steps / 10 (at most 100)
  float clip = 0.f;          // global gradient norm; 0: no clipping (the defaults train as well without)
  std::uint64_t seed = 1;
  std::string precision = "fp32";
  // layout
  int ranks = 1;
  std::string comm = "local";  // local | mpi (launched by mpirun; ranks = the MPI world)
  int dp = 0, tp = 1, pp = 1;  // dp 0: ranks / (tp · pp)
  bool sp = false;
  int ep = 1, cp = 1;          // carved out of dp
  bool cp_zigzag = true;
  std::string cp_attention = "ring";  // ring | allgather: how K/V reach the other ranks of a context group
  std::int64_t microbatches = 1;
  std::string schedule;  // gpipe | 1f1b | interleaved:V | zb | FILE.csv; empty: the default
  std::string recompute = "none";  // full: whole stages (trainer_options::recompute); selective: a Llama's blocks
  // sharding across the data-parallel ranks: replicate | zero1 | zero2 | zero3 ("ddp" reads as replicate);
  // with replicas > 1 the dp ranks form that many replicas and ZeRO shards within each (hybrid sharding)
  std::string parallel = "replicate";
  int replicas = 1;
  // --plan auto: the fastest layout dml::cost predicts to fit in --memory per rank replaces the layout flags; with
  // max_cp > 1 the search also cuts sequences over up to max_cp context-parallel ranks (long sequences)
  std::string plan = "manual", memory = "80GiB";
  int max_cp = 0;
  double planned_activations = -1;  // set by --plan auto or --precision auto: the layout's activation bytes per rank
  bool memory_cap = false;          // --memory given: the layout flags' predicted bytes per rank must fit it
  // One thread per rank by default: at these sizes a second OpenMP thread gains little, and loses badly
  // when another process shares the cores (its threads spin at every barrier).
  int threads = 1;
  // files and output
  std::string text;  // empty: dml::train::default_text_path
  double holdout = 0.1;  // the text's tail kept for val_loss; 0: none
  std::string init, save, log;
  std::string trace;  // the run's timeline, Chrome trace-event JSON (trainer_options::trace)
  std::string save_hf, load_hf, export_llama2c;  // llama: Hugging Face's layout (a directory), llama2.c's .bin
  std::string checkpoint, resume;               // sharded checkpoints: save into / continue from a directory
  std::string offload;  // optimizer[,master]:disk:DIR keeps the optimizer state (and master weights) in files in DIR
  std::optional<std::int64_t> checkpoint_every;  // absent: save after the last step only
  bool checkpoint_async = false;                 // write checkpoints in the background while training goes on
  std::int64_t print_every = 0;  // 0: about 20 lines per run
  std::int64_t sample = 0;
  std::optional<std::string> prompt;
  std::optional<float> temperature;  // absent or 0: greedy
  // under dml-run: train through deaths (main_elastic.cpp); each configuration restarts at its size
  bool elastic = false;
  std::string commit_log;               // append "step epoch members hash" per committed step; {slot}: the rank's slot
  std::int64_t comm_timeout_ms = 2000;  // the deadline of every collective
  int copies = 1;                       // the members after each that hold a copy of its state
  std::int64_t commit_every = 1;  // --elastic, restarting: vote and copy the state every this many steps
};

// The command line: every flag bound to its member of `o`, with its default and its rules (dml/train/flags.hpp);
// --help prints this table between the lines below.
inline dml::flags command_line(options& o) {
  dml::flags f(
      "gpt", "Trains a byte-level GPT or Llama on a text file, then samples from it.",
      "Trains a GPT on the bytes of a text file (default: the GNU GPL version 3 that Debian ships in\n"
      "/usr/share/common-licenses/GPL-3), one byte per token. --batch is the global number of sequences of\n"
      "--seq bytes per step; the ranks are tp x dp x pp (tensor-parallel ranks fastest), and every layout\n"
      "trains the model one rank does. The last --holdout of the text is never trained on: val_loss is\n"
      "measured there. --sample N writes N bytes after --prompt (default: the text's first 16 bytes),\n"
      "greedy unless --temperature is given. Under mpirun, pass --comm mpi. --clip X clips the global\n"
      "gradient norm (off by default).\n"
      "--experts E turns the MLP of every --moe-every-th block (default 2) into E experts, each token routed to\n"
      "its --top-k (1 to E); --capacity-factor C drops what overflows C·tokens·k/E per expert (<= 0: dropless).\n"
      "--expert-ffn F makes each expert F wide (fine-grained experts; default the dense MLP's width), --shared-experts\n"
      "S adds one MLP of S·F that every token passes through, --router sigmoid scores as DeepSeek-V3 does, and\n"
      "--router-bias-rate R balances the load without a loss: a per-expert bias on the scores, for choosing only,\n"
      "moved by R after each step toward equal load (pair it with --aux-loss-weight 0).\n"
      "--ep N shares the experts out over N data-parallel ranks (all-to-all dispatch); --cp N cuts each sequence\n"
      "over N data-parallel ranks (ring attention, or --cp-attention allgather: K/V all-gathered at once; zig-zag\n"
      "chunks unless --cp-contiguous). Both divide dp.\n"
      "--tie ties the LM head's weight to the token embedding's (nanoGPT, GPT-2).\n"
      "--parallel shards the data-parallel ranks' model state: replicate (or ddp: everything on every rank,\n"
      "the default), zero1 (optimizer state), zero2 (+ gradients) or zero3 (+ parameters). --replicas R with\n"
      "zero1-3 is hybrid sharding: the dp ranks form R replicas of dp/R consecutive ranks, ZeRO shards within\n"
      "each and the replicas sum their gradients; R divides dp, and --ep and --cp divide dp/R.\n"
      "--checkpoint DIR saves a sharded checkpoint (weights, optimizer state, step) after the last step, and\n"
      "after every N-th with --checkpoint-every N (--checkpoint-async: written in the background while training\n"
      "goes on). --resume DIR loads the newest checkpoint in DIR before\n"
      "training, in any layout and sharding, and continues from its step to --steps (the learning-rate\n"
      "schedule and the batches follow the step, so the run goes on as if never stopped).\n"
      "--arch llama trains a Llama instead (RMSNorm, rotary positions, grouped-query attention with --kv-heads,\n"
      "SwiGLU of --ffn-hidden; no biases or dropout) on comm::local ranks, in every layout; its experts are SwiGLU.\n"
      "--save-hf DIR writes its weights in Hugging Face's Llama layout (config.json, model.safetensors), --load-hf\n"
      "DIR starts from such a checkpoint (its config.json gives the model's shape: the model flags are not used)\n"
      "and --export-llama2c FILE writes llama2.c's checkpoint. --documents packs the text's paragraphs (split at\n"
      "blank lines) as documents: a token attends only within its own.");
  const auto probability = [](const char* what) {
    return [what](auto p) { return p >= 0 && p < 1 ? std::string() : std::string(what) + " in [0, 1)"; };
  };
  // model
  f.add("--text", o.text, "FILE", "the text to train on").default_text(dml::train::default_text_path);
  f.add("--arch", o.arch, "A", "architecture").choices({"gpt", "llama"});
  f.add("--layers", o.layers, "N", "transformer blocks").min(1);
  f.add("--d-model", o.d_model, "N", "model width, a multiple of --heads").min(1);
  f.add("--heads", o.heads, "N", "attention heads").min(1);
  f.add("--seq", o.seq, "N", "tokens per sequence").min(1);
  f.add("--vocab", o.vocab, "N", "vocabulary size; every byte of the text below it").min(1);
  f.add("--dropout", o.dropout, "X", "dropout probability").check(probability("a probability"), "in [0, 1)");
  f.add_switch("--bias", o.bias, "biases in the linear layers and layer norms");
  f.add_switch("--tie", o.tie, "tie the LM head's weight to the token embedding's");
  f.add("--kv-heads", o.kv_heads, "N", "llama: key/value heads, dividing --heads").min(0).default_text("--heads");
  f.add("--ffn-hidden", o.ffn_hidden, "N", "llama: SwiGLU's width").min(0).default_text("8/3 of --d-model, to 32");
  f.add("--rope-theta", o.rope_theta, "X", "llama: RoPE's base").min(1.0);
  f.add("--norm-eps", o.norm_eps, "X", "llama: RMSNorm's epsilon").check(
      [](float e) { return e > 0.f ? std::string() : std::string("a positive number"); }, "> 0");
  f.add_switch("--documents", o.documents, "the text's paragraphs as documents: attention stays within each");
  f.add("--kv-lora-rank", o.kv_lora_rank, "R",
        "llama: DeepSeek-V3's multi-head latent attention, keys and values from a latent of R; 0: grouped-query").min(0);
  f.add("--q-lora-rank", o.q_lora_rank, "R", "llama, latent attention: queries from a latent of R; 0: from the input")
      .min(0);
  f.add("--qk-nope-dim", o.qk_nope_dim, "D", "latent attention: a head's query/key columns without position").min(0)
      .default_text("d_model / heads");
  f.add("--qk-rope-dim", o.qk_rope_dim, "D", "latent attention: a head's query/key columns turned by RoPE").min(0)
      .default_text("half of d_model / heads");
  f.add("--v-head-dim", o.v_head_dim, "D", "latent attention: a head's value width").min(0).default_text("d_model / heads");
  // training
  f.add("--batch", o.batch, "N", "global sequences per step").min(1);
  f.add("--steps", o.steps, "N", "optimizer steps").min(0);
  f.add("--lr", o.lr, "X", "peak learning rate (warmup, then cosine decay to a tenth)").min(0.f);
  f.add("--warmup", o.warmup, "N", "warmup steps; -1: steps / 10, at most 100");
  f.add("--clip", o.clip, "X", "clip the global gradient norm to X; 0: no clipping").min(0.f);
  f.add("--seed", o.seed, "N", "seed of the initial weights, the batches and dropout");
  f.add("--precision", o.precision, "P",
        "arithmetic; auto: fp32 or bf16, whichever dml::cost predicts faster on this host's measured rates (bf16 where "
        "only its bytes fit in --memory)")
      .choices({"fp32", "bf16", "auto"});
  // mixture of experts
  f.add("--experts", o.experts, "E", "experts in each mixture-of-experts MLP; 0: none").min(0);
  f.add("--top-k", o.top_k, "K", "experts per token, 1 to --experts").min(1);
  f.add("--expert-ffn", o.expert_ffn, "F", "each expert's MLP width; default: the dense MLP's").min(1);
  f.add("--shared-experts", o.shared_experts, "S", "shared experts beside the routed ones: one MLP of S times the expert width")
      .min(0);
  f.add("--router", o.router, "R", "the router's scores").choices({"softmax", "sigmoid"});
  f.add("--router-bias-rate", o.router_bias_rate, "R", "loss-free balancing's bias step per training step; 0: none").min(0.f);
  f.add("--capacity-factor", o.capacity_factor, "C", "expert capacity factor; <= 0: dropless");
  f.add("--moe-every", o.moe_every, "N", "every N-th block's MLP is a mixture of experts").min(1);
  f.add("--first-dense", o.first_dense, "N", "the first N blocks keep the dense MLP (DeepSeek-V3: 3)").min(0);
  f.add("--aux-loss-weight", o.aux_loss_weight, "X", "weight of the load-balancing loss").min(0.f);
  f.add("--z-loss-weight", o.z_loss_weight, "X", "weight of the router z-loss").min(0.f);
  // layout
  f.add("--ranks", o.ranks, "N", "comm::local ranks; with --comm mpi the MPI world (leave it out)").min(1);
  f.add("--comm", o.comm, "C", "communicator").choices({"local", "mpi"});
  f.add("--dp", o.dp, "N", "data-parallel ranks; 0: ranks / (tp x pp)").min(0);
  f.add("--tp", o.tp, "N", "tensor-parallel ranks").min(1);
  f.add("--pp", o.pp, "N", "pipeline stages").min(1);
  f.add_switch("--sp", o.sp, "sequence parallelism over the tensor-parallel ranks");
  f.add("--ep", o.ep, "N", "expert-parallel ranks, carved out of dp").min(1);
  f.add("--cp", o.cp, "N", "context-parallel ranks, carved out of dp").min(1);
  f.add_switch("--cp-contiguous", o.cp_zigzag, "contiguous context-parallel chunks, not zig-zag", false);
  f.add("--cp-attention", o.cp_attention, "A", "how K/V reach a context group's ranks").choices({"ring", "allgather"});
  f.add("--microbatches", o.microbatches, "M", "microbatches per step").min(1);
  f.add("--schedule", o.schedule, "S", "pipeline schedule: gpipe, 1f1b, interleaved:V, zb or FILE.csv")
      .default_text("the trainer's");
  f.add("--recompute", o.recompute, "R",
        "activations recomputed in backward: none, full (each stage from its input) or selective (a Llama's RMSNorm and "
        "SwiGLU outputs)")
      .choices({"none", "full", "selective"})
      .bare("full");
  f.add("--threads", o.threads, "N", "OpenMP threads per rank").min(1);
  f.add("--parallel", o.parallel, "P", "sharding: replicate (or ddp), zero1, zero2 or zero3")
      .check([](const std::string& p) {
        return p == "replicate" || p == "ddp" || p == "zero1" || p == "zero2" || p == "zero3"
                   ? std::string()
                   : "replicate (or ddp), zero1, zero2 or zero3";
      });
  f.add("--replicas", o.replicas, "R", "replicas of hybrid sharding, with zero1-3").min(1);
  f.add("--plan", o.plan, "P", "manual: the layout flags; auto: the fastest layout that fits --memory (dml::cost)")
      .choices({"manual", "auto"});
  f.add("--max-cp", o.max_cp, "C", "--plan auto: also cut sequences over up to C context-parallel ranks").min(0);
  f.add("--memory", o.memory, "BYTES",
        "memory per rank: what --plan auto and --precision auto fit in; given with the layout flags, the layout's "
        "predicted bytes per rank must fit it (80GiB, 512MiB, ...)")
      .check([](const std::string& s) {
        try {
          dml::cost::parse_bytes(s);
          return std::string();
        } catch (const dml::error&) {
          return std::string("a positive size such as 80GiB, 40GB or 1e9");
        }
      });
  // files and output
  f.add("--init", o.init, "FILE", "initial weights, .safetensors");
  f.add("--save", o.save, "FILE", "save the trained weights, .safetensors");
  f.add("--save-hf", o.save_hf, "DIR", "llama: save the trained weights in Hugging Face's layout");
  f.add("--load-hf", o.load_hf, "DIR", "llama: start from a Hugging Face checkpoint (its config gives the model)");
  f.add("--export-llama2c", o.export_llama2c, "FILE", "llama: save the trained weights as llama2.c's .bin");
  f.add("--log", o.log, "FILE", "write the losses per step, .csv");
  f.add("--trace", o.trace, "FILE", "write the run's timeline, .json (Perfetto UI, chrome://tracing)");
  f.add("--holdout", o.holdout, "X", "the text's tail kept for val_loss; 0: none")
      .check(probability("a fraction"), "in [0, 1)");
  f.add("--checkpoint", o.checkpoint, "DIR", "save sharded checkpoints here");
  f.add("--checkpoint-every", o.checkpoint_every, "N", "save a checkpoint every N steps")
      .min(1)
      .default_text("after the last step only");
  f.add_switch("--checkpoint-async", o.checkpoint_async, "write checkpoints in the background while training goes on");
  f.add("--resume", o.resume, "DIR", "continue from the newest checkpoint in DIR");
  f.add("--offload", o.offload, "optimizer[,master]:disk:DIR",
        "keep the optimizer state (with master, also bf16's fp32 master weights) in files in DIR (an existing, "
        "writable directory)")
      .check(dml::parallel::offload_spec_problem);
  f.add("--print-every", o.print_every, "N", "steps between progress lines; 0: about 20 lines").min(0);
  f.add("--sample", o.sample, "N", "bytes to sample after training").min(0);
  f.add("--prompt", o.prompt, "TEXT", "what the sample continues").default_text("the text's first 16 bytes");
  f.add("--temperature", o.temperature, "X", "sampling temperature").min(0.f).default_text("greedy");
  f.add_switch("--elastic", o.elastic,
               "under dml-run (with Gloo): train through deaths, freezes and restarts of ranks; each configuration "
               "restarts at its size, with the most tensor-parallel ranks up to --tp that it allows");
  f.add("--commit-log", o.commit_log, "FILE", "with --elastic: append one line per committed step");
  f.add("--comm-timeout-ms", o.comm_timeout_ms, "MS", "with --elastic: the deadline of every collective").min(1);
  f.add("--copies", o.copies, "K", "with --elastic: the members after each that hold a copy of its state").min(1);
  f.add("--commit-every", o.commit_every, "K",
        "with --elastic where members hold parts of the model: vote and copy the state every K steps (a failure "
        "runs up to K steps again)")
      .min(1);
  return f;
}

// What the table cannot check alone: rules across flags. Reads --parallel ddp as replicate.
inline void check_across(options& o) {
  if (o.d_model % o.heads != 0)
    dml::fail<dml::invalid_argument>("--d-model: expected a multiple of --heads ", o.heads, ", found ", o.d_model);
  const bool llama = o.arch == "llama";
  const auto only = [&](bool given, const char* flag, const char* arch) {
    if (given)
      dml::fail<dml::invalid_argument>(flag, " belongs to --arch ", arch, ": expected it left out with --arch ", o.arch);
  };
  only(!llama && o.kv_heads != 0, "--kv-heads", "llama");
  only(!llama && o.ffn_hidden != 0, "--ffn-hidden", "llama");
  only(!llama && o.rope_theta != 10000, "--rope-theta", "llama");
  only(!llama && o.norm_eps != 1e-5f, "--norm-eps", "llama");
  only(!llama && !o.save_hf.empty(), "--save-hf", "llama");
  only(!llama && !o.load_hf.empty(), "--load-hf", "llama");
  only(!llama && !o.export_llama2c.empty(), "--export-llama2c", "llama");
  only(llama && o.bias, "--bias", "gpt");
  only(!llama && o.kv_lora_rank != 0, "--kv-lora-rank", "llama");
  if (o.kv_lora_rank == 0 && (o.q_lora_rank || o.qk_nope_dim || o.qk_rope_dim || o.v_head_dim))
    dml::fail<dml::invalid_argument>("--q-lora-rank, --qk-nope-dim, --qk-rope-dim and --v-head-dim shape latent "
                                     "attention: expected --kv-lora-rank > 0 with them, found 0");
  if (o.kv_lora_rank > 0) {
    if (!o.save_hf.empty() || !o.load_hf.empty() || !o.export_llama2c.empty())
      dml::fail<dml::invalid_argument>("--kv-lora-rank: Hugging Face's Llama layout and llama2.c's checkpoint have no "
                                       "latent attention: expected no --save-hf, --load-hf or --export-llama2c with it");
    if (o.sample > 0)
      dml::fail<dml::invalid_argument>("--sample: latent attention keeps no KV cache in dml: expected --sample 0 with "
                                       "--kv-lora-rank, found --sample ", o.sample);
    const std::int64_t hd = o.d_model / o.heads;
    if (o.qk_nope_dim == 0) o.qk_nope_dim = hd;
    if (o.qk_rope_dim == 0) o.qk_rope_dim = hd / 2 + hd / 2 % 2;  // RoPE turns pairs
    if (o.v_head_dim == 0) o.v_head_dim = hd;
  }
  if (o.first_dense > 0 && o.experts == 0)
    dml::fail<dml::invalid_argument>("--first-dense keeps the first blocks dense: expected --experts > 0, found 0");
  if (!llama && o.recompute == "selective")
    dml::fail<dml::invalid_argument>("--recompute selective: a Llama's blocks recompute selectively (a GPT's keep what "
                                     "they use or recompute whole stages): expected --arch llama or --recompute full, "
                                     "found --arch ", o.arch);
  only(llama && o.dropout > 0.f, "--dropout", "gpt");
  if (llama && o.experts > 0 && (!o.save_hf.empty() || !o.load_hf.empty() || !o.export_llama2c.empty()))
    dml::fail<dml::invalid_argument>("--experts: Hugging Face's Llama layout and llama2.c's checkpoint have no experts: "
                                     "expected no --save-hf, --load-hf or --export-llama2c with --experts ", o.experts);
  if (llama && (o.comm != "local" || o.elastic))
    dml::fail<dml::invalid_argument>("--arch llama: this example trains Llama on comm::local ranks: expected --comm "
                                     "local without --elastic, found --comm ", o.comm, o.elastic ? " --elastic" : "");
  if (!o.load_hf.empty() && (!o.init.empty() || !o.resume.empty()))
    dml::fail<dml::invalid_argument>("--load-hf gives the initial weights: expected no --init or --resume with it");
  if (o.ep > 1 && o.experts == 0)
    dml::fail<dml::invalid_argument>("--ep shares out experts: expected --experts > 0, found 0");
  if (o.experts > 0 && o.top_k > o.experts)
    dml::fail<dml::invalid_argument>("--top-k: expected at most --experts = ", o.experts, ", found ", o.top_k);
  if (o.experts == 0 && (o.expert_ffn || o.shared_experts > 0 || o.router != "softmax" || o.router_bias_rate > 0.f))
    dml::fail<dml::invalid_argument>("--expert-ffn, --shared-experts, --router and --router-bias-rate shape the experts: "
                                     "expected --experts > 0 with them, found --experts 0");
  if (o.sp && o.tp == 1)
    dml::fail<dml::invalid_argument>("--sp splits the sequence over the tensor-parallel ranks: expected --tp > 1, found 1");
  if (o.replicas > 1 && (o.parallel == "replicate" || o.parallel == "ddp"))
    dml::fail<dml::invalid_argument>("--replicas ", o.replicas, ": hybrid sharding shards within each replica, so it "
                                     "needs --parallel zero1, zero2 or zero3; found --parallel ", o.parallel,
                                     " (which holds everything on every rank: leave --replicas out)");
  if (o.parallel == "ddp") o.parallel = "replicate";
  if (o.comm == "mpi" && (o.plan == "auto" || o.precision == "auto"))
    dml::fail<dml::invalid_argument>("--plan auto and --precision auto measure the host where they run: with --comm "
                                     "mpi every process would measure on its own and might choose otherwise; run "
                                     "dml-plan and give the layout and --precision it picks");
  if (o.elastic && !o.trace.empty())
    dml::fail<dml::invalid_argument>("--trace: expected no --elastic (its trainers change with the membership)");
  if (o.checkpoint_async && o.checkpoint.empty())
    dml::fail<dml::invalid_argument>("--checkpoint-async: expected --checkpoint DIR to save into, found none");
  if (o.checkpoint_every && o.checkpoint.empty())
    dml::fail<dml::invalid_argument>("--checkpoint-every: expected --checkpoint DIR to save into, found none");
  if (!o.resume.empty() && !o.init.empty())
    dml::fail<dml::invalid_argument>("--resume loads the weights from its checkpoint: expected no --init with it, "
                                     "found --init ", o.init);
}

// The data-parallel degree of a world of `world` ranks: --dp, or what --tp and --pp leave.
inline int data_parallel(const options& o, int world) {
  const int dp = o.dp > 0 ? o.dp : world / (o.tp * o.pp);
  if (dp < 1 || o.tp * dp * o.pp != world)
    dml::fail<dml::invalid_argument>("layout: expected --tp × --dp × --pp = the ", world, " ranks, found ", o.tp, " × ",
                                     o.dp > 0 ? std::to_string(o.dp) : "(" + std::to_string(world) + " / " +
                                                                             std::to_string(o.tp * o.pp) + ")",
                                     " × ", o.pp);
  if (dp % o.replicas != 0)
    dml::fail<dml::invalid_argument>("--replicas: the ", dp, " data-parallel ranks form replicas of equal size: "
                                     "expected a divisor of ", dp, ", found ", o.replicas);
  const int replica = dp / o.replicas;
  if (replica % o.ep != 0 || replica % o.cp != 0)
    dml::fail<dml::invalid_argument>("layout: --ep and --cp are carved out of the ", replica, " data-parallel ranks",
                                     o.replicas > 1 ? " of a replica (dp / --replicas)" : "",
                                     " and must divide them; found --ep ", o.ep, " and --cp ", o.cp);
  if (o.batch < dp / o.cp)
    dml::fail<dml::invalid_argument>("--batch: expected at least one sequence per data-parallel group (", dp / o.cp,
                                     "), found ", o.batch);
  return dp;
}

// A Llama's SwiGLU width: --ffn-hidden, or 8/3 of --d-model rounded up to a multiple of 32 (0 for a GPT).
inline std::int64_t ffn_hidden(const options& o) {
  if (o.arch != "llama") return 0;
  return o.ffn_hidden > 0 ? o.ffn_hidden : (8 * o.d_model + 95) / 96 * 32;
}

// --plan auto: of the layouts of `world` ranks dml::cost ranks (DESIGN.md §7), the fastest whose largest rank fits
// in --memory, by the bytes the trainer will hold (cost::search_dml; 1F1B or zb on a pipeline; every micro-batch count
// that divides a rank's sequences), replaces the layout flags; it is printed before training. --precision auto: the
// faster of fp32 and bf16 on the layout (the one given, or each the search tries), printed with both predictions.
// Times are this host's: its GEMM rates in each precision (bf16's as they run here, on native kernels or widened to
// f32, and their share at a micro-batch's rows), copy rate, memory bandwidth and a block's element-wise rate in each
// precision, measured first for one of `world` ranks of --threads threads sharing this machine, at the model's widths
// (cost::calibrate_gpt_rank_of).
inline dml::cost::model cost_model_of(const options& o) {
  namespace cost = dml::cost;
  return {.layers = o.layers, .d_model = o.d_model, .heads = o.heads, .seq = o.seq, .vocab = o.vocab, .bias = o.bias,
          .tie = o.tie, .experts = o.experts, .top_k = o.top_k, .moe_every = o.moe_every,
          .capacity_factor = o.capacity_factor, .expert_ffn = o.expert_ffn.value_or(0),
          .shared_experts = o.shared_experts, .sigmoid_router = o.router == "sigmoid",
          .arch = o.arch == "llama" ? cost::architecture::llama : cost::architecture::gpt, .kv_heads = o.kv_heads,
          .ffn_hidden = ffn_hidden(o), .q_lora_rank = o.q_lora_rank, .kv_lora_rank = o.kv_lora_rank,
          .qk_nope_dim = o.qk_nope_dim, .qk_rope_dim = o.qk_rope_dim, .v_head_dim = o.v_head_dim,
          .first_dense = o.first_dense};
}
inline dml::cost::training cost_training_of(const options& o) {
  return {.global_batch = o.batch, .prec = o.precision == "bf16" ? dml::cost::precision::bf16 : dml::cost::precision::fp32};
}
// The layout the flags give: a schedule the model does not price (a CSV file) is priced as 1F1B.
inline dml::cost::layout cost_layout_of(const options& o, int world) {
  namespace cost = dml::cost;
  return {.dp = data_parallel(o, world), .tp = o.tp, .pp = o.pp, .ep = o.ep, .cp = o.cp,
          .zero = o.parallel == "replicate" ? 0 : o.parallel.back() - '0', .replicas = o.replicas, .sp = o.sp,
          .schedule = o.pp == 1 ? "single" : o.schedule.empty() || o.schedule.ends_with(".csv") ? "1f1b" : o.schedule,
          .micro_batches = o.microbatches,
          .recomp = o.recompute == "full"        ? cost::recompute::full
                    : o.recompute == "selective" ? cost::recompute::selective
                                                 : cost::recompute::none,
          .cp_all_gather = o.cp_attention == "allgather"};
}

// The bytes the largest rank of the flags' layout will hold (cost::rank_bytes: what the trainer counts, to the byte),
// by category, as "params 1.23 MiB, grads ..., total=..." (MiB).
inline std::string bytes_line(const dml::cost::bytes& b) {
  char s[320];
  std::snprintf(s, sizeof s, "params %.2f MiB, grads %.2f, optimizer %.2f, master %.2f, activations %.2f, buffers %.2f, "
                "workspace %.2f; total=%.2f MiB", b.params / 1048576, b.grads / 1048576, b.optimizer / 1048576,
                b.master / 1048576, b.activations / 1048576, b.buffers / 1048576, b.workspace / 1048576,
                b.total() / 1048576);
  return s;
}

// --memory given with the layout flags: the layout's predicted bytes per rank must fit it, or the run stops before a
// step, naming the categories and the first of them (in the order above) past which the sum does not fit.
inline void check_memory(const options& o, int world) {
  if (!o.memory_cap || o.plan == "auto" || o.precision == "auto") return;  // the search already keeps to it
  namespace cost = dml::cost;
  const double cap = cost::parse_bytes(o.memory);
  const cost::bytes b = cost::rank_bytes(cost_model_of(o), cost_layout_of(o, world), cost_training_of(o));
  if (b.total() <= cap) return;
  const std::pair<const char*, double> parts[] = {{"the parameters", b.params}, {"the gradients", b.grads},
                                                  {"the optimizer state", b.optimizer}, {"the master weights", b.master},
                                                  {"the activations", b.activations}, {"the buffers", b.buffers},
                                                  {"the workspace", b.workspace}};
  double sum = 0;
  const char* from = "";
  for (const auto& [name, v] : parts)
    if ((sum += v) > cap) {
      from = name;
      break;
    }
  dml::fail<dml::invalid_argument>("--memory ", o.memory, ": expected the layout's largest rank to fit, found it "
                                   "predicted to hold ", bytes_line(b), "; it passes the cap at ", from,
                                   " (more --microbatches, ZeRO, more ranks, --recompute, or --plan auto)");
}

inline void apply_plan(options& o, int world) {
  if (o.plan != "auto" && o.precision != "auto") return;
  namespace cost = dml::cost;
  const cost::model m = cost_model_of(o);
  const cost::training t = cost_training_of(o);
  const std::vector<cost::precision> precisions =
      o.precision == "auto" ? std::vector{cost::precision::fp32, cost::precision::bf16} : std::vector{t.prec};
  // The probe's rates at up to 1,024 tokens a sequence: its T×T GPT block would take minutes at long sequences, and
  // attention's own cost at --seq is priced from its FLOPs.
  cost::cluster c = cost::calibrate_gpt_rank_of(world, o.d_model, o.heads, std::min<std::int64_t>(o.seq, 1024), o.vocab,
                                                o.threads);
  c.memory_bytes = cost::parse_bytes(o.memory);
  const auto ranked = cost::search_precisions(t, precisions, [&](const cost::training& u) {
    if (o.plan == "auto") return cost::search_dml(m, u, c, world, o.max_cp);
    return std::vector{cost::evaluate_dml(m, cost_layout_of(o, world), u, c, world)};
  });
  const auto chosen = std::find_if(ranked.begin(), ranked.end(), [](const cost::estimate& e) { return e.fits; });
  if (chosen == ranked.end()) {
    if (o.plan == "auto")
      dml::fail<dml::invalid_argument>("--plan auto: no layout of ", world, " ranks fits in --memory ", o.memory,
                                       "; dml-plan lists each with its reason");
    dml::fail<dml::invalid_argument>("--precision auto: the layout given fits in --memory ", o.memory,
                                     " in neither precision: ", ranked.front().why);
  }
  o.planned_activations = chosen->per_rank.activations;
  if (o.plan == "auto") {
    const auto& l = chosen->lay;
    o.tp = l.tp, o.pp = l.pp, o.dp = l.dp, o.sp = l.sp, o.ep = l.ep, o.replicas = 1, o.cp = l.cp;
    o.cp_zigzag = true;  // as dml::cost prices it
    o.parallel = l.zero == 0 ? "replicate" : "zero" + std::to_string(l.zero);
    o.microbatches = l.micro_batches;
    o.recompute = cost::to_string(l.recomp);
    o.schedule = l.pp > 1 ? l.schedule : "";
    std::printf("plan: %s (predicted %.3g s per step, %.3g MiB per rank, activations %.0f bytes)\n",
                cost::to_string(l).c_str(), chosen->step_seconds, chosen->per_rank.total() / (1 << 20),
                chosen->per_rank.activations);
  }
  if (o.precision == "auto") {
    o.precision = cost::to_string(chosen->prec);
    // The other precision's best on the same layout, for the record.
    const auto other = std::find_if(ranked.begin(), ranked.end(), [&](const cost::estimate& e) {
      return e.prec != chosen->prec && cost::to_string(e.lay) == cost::to_string(chosen->lay);
    });
    std::string against = "not priced";  // each layout is priced in both: not reached
    if (other != ranked.end()) {
      char s[64];
      std::snprintf(s, sizeof s, "%.3g s", other->step_seconds);
      against = cost::to_string(other->prec) + " " + (other->fits ? std::string(s) : other->why);
    }
    std::printf("precision: %s (predicted %.3g s per step, %s; bf16's products %s here)\n", o.precision.c_str(),
                chosen->step_seconds, against.c_str(), dml::host_gemm_native(dml::dtype::bf16) ? "on native kernels" : "widened to f32");
  }
  std::fflush(stdout);
}

// The text, split into what is trained on and the held-out tail, with every byte checked against --vocab.
struct corpus {
  std::string path;
  dml::train::text_corpus all, train;
  std::optional<dml::train::text_corpus> val;
};

inline corpus load_corpus(const options& o) {
  const std::string path = o.text.empty() ? dml::train::default_text_path : o.text;
  auto all = dml::train::text_corpus::load(path);
  const auto bytes = all.bytes();
  for (std::size_t i = 0; i < bytes.size(); ++i)
    if (bytes[i] >= o.vocab)
      dml::fail<dml::invalid_argument>(path, ": byte ", static_cast<int>(bytes[i]), " at offset ", i,
                                       " is not a token of the vocabulary: expected bytes < --vocab ", o.vocab,
                                       " (--vocab 256 takes any byte)");
  if (o.holdout == 0.0) {
    if (o.seq >= all.size())
      dml::fail<dml::invalid_argument>("--seq: expected fewer than the text's ", all.size(), " bytes, found ", o.seq);
    auto train = all;
    return {path, std::move(all), std::move(train), std::nullopt};
  }
  auto [train, val] = all.split(o.holdout);
  if (o.seq >= val.size())
    dml::fail<dml::invalid_argument>("--seq: the held-out tail of ", path, " (--holdout ", o.holdout, ") has ", val.size(),
                                     " bytes; expected --seq below that, found ", o.seq,
                                     " (lower --seq, raise --holdout, or --holdout 0)");
  return {path, std::move(all), std::move(train), std::move(val)};
}

// The experts' flags into a gpt_config or llama_config (their expert fields share names).
template <class Config>
void set_experts(Config& g, const options& o) {
  g.experts = o.experts;
  g.top_k = o.top_k;
  g.capacity_factor = o.capacity_factor;
  g.moe_every = o.moe_every;
  g.aux_loss_weight = o.aux_loss_weight;
  g.z_loss_weight = o.z_loss_weight;
  g.expert_ffn = o.expert_ffn.value_or(0);
  g.shared_experts = o.shared_experts;
  g.sigmoid_router = o.router == "sigmoid";
  g.router_bias_rate = o.router_bias_rate;
}

inline dml::nn::gpt_config model_config(const options& o) {
  dml::nn::gpt_config g{.vocab = o.vocab, .seq = o.seq, .layers = o.layers, .d_model = o.d_model, .heads = o.heads,
                        .dropout = o.dropout, .bias = o.bias};
  set_experts(g, o);
  g.tie_weights = o.tie;
  return g;
}

// What run_trainer needs of an architecture: its config from the flags, its model, its whole network on one rank,
// the model line it prints, and what it reads before training and writes after (Llama: train_llama.hpp).
struct gpt_arch {
  using config = dml::nn::gpt_config;
  using network = dml::nn::network<dml::host, dml::nn::gpt_embedding, dml::nn::stack<dml::nn::gpt_block>,
                                   dml::nn::gpt_head>;
  static config make_config(const options& o) { return model_config(o); }
  static auto model(const config& g) { return dml::nn::gpt(g); }
  static std::string describe(const options& o) {
    return dml::detail::cat("gpt, ", o.layers, " layers, d_model ", o.d_model, ", ", o.heads, " heads, seq ", o.seq);
  }
  static void load(const options&, const config&, const dml::nn::param_layout&, std::span<float>) {}
  static void save(const options&, const config&, const dml::nn::param_layout&, std::span<const float>) {}
};

// The token each of `rows` windows of `seq` tokens starts its documents at (--documents): a document starts at the
// window's first token and at each token after a blank line ("\n\n") that is not itself a newline.
inline void document_starts(const std::vector<float>& x, std::int64_t rows, std::int64_t seq, std::vector<std::int64_t>& doc) {
  doc.resize(x.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* w = x.data() + r * seq;
    std::int64_t* d = doc.data() + r * seq;
    for (std::int64_t t = 0; t < seq; ++t)
      d[t] = t >= 2 && w[t - 1] == '\n' && w[t - 2] == '\n' && w[t] != '\n' ? t : t == 0 ? 0 : d[t - 1];
  }
}

// Linear warmup, then cosine decay to a tenth of --lr at the last step.
inline float learning_rate(const options& o, std::int64_t step) {
  const std::int64_t warmup = o.warmup >= 0 ? o.warmup : std::min<std::int64_t>(100, o.steps / 10);
  return dml::optim::warmup_cosine{o.lr, warmup, std::max<std::int64_t>(o.steps, 1), o.lr / 10}(step);
}

// The whole model on one rank, for what comes after training: val_loss and sampling. Parameters are
// copied by name, so the trainer's layout (its padding, its stages) does not matter.
template <class Arch>
class inference_model {
 public:
  using network = typename Arch::network;

  inference_model(const typename Arch::config& g, const dml::nn::param_layout& from, std::span<const float> full)
      : vocab_(g.vocab), seq_(g.seq), net_(Arch::model(g), 0) {
    for (const auto& s : net_.layout().slots) {
      const auto& f = from.find(s.name);
      if (!(f.shape == s.shape))
        dml::fail<dml::shape_error>("gpt: parameter ", s.name, " has shape ", f.shape, " in the trainer, expected ",
                                    s.shape);
      std::copy_n(full.data() + f.offset, s.shape.numel(), net_.params().data() + s.offset);
    }
  }

  // Mean cross-entropy per token of `rows` windows of the text (fixed windows: seed 0, step 0), `micro` windows a
  // forward (a training micro-batch's rows: evaluation holds no more than a step does).
  double loss(const dml::train::text_corpus& text, std::int64_t rows, std::int64_t micro) {
    std::vector<float> x(static_cast<std::size_t>(rows * seq_));
    std::vector<std::int32_t> y(x.size());
    text.batch(0, 0, 0, rows, seq_, x.data(), y.data());
    std::vector<float> row_loss;
    double sum = 0;
    for (std::int64_t r = 0; r < rows; r += micro) {
      const std::int64_t m = std::min(micro, rows - r);
      auto logits = net_.forward(dml::tensor_view<const float>(x.data() + r * seq_, {m, seq_}), {.training = false});
      row_loss.resize(static_cast<std::size_t>(m * seq_));
      sum += static_cast<double>(m) * dml::nn::softmax_cross_entropy{}.forward_backward<dml::host>(
                                          logits, y.data() + r * seq_, dml::tensor_view<float>(nullptr, logits.shape),
                                          row_loss.data());
    }
    return sum / static_cast<double>(rows);
  }

  // n tokens after `prompt`, each from the logits of the last position over the window before it: the most likely
  // one, or one drawn from softmax(logits / temperature). Each token is one token's forward: the window's keys and
  // values stay in a KV cache (nn::generate; a full window starts again from its last seq/2 tokens).
  std::string generate(std::string_view prompt, std::int64_t n, float temperature, std::uint64_t seed) {
    std::vector<float> tokens;
    for (const char ch : prompt) tokens.push_back(static_cast<float>(static_cast<unsigned char>(ch)));
    const dml::rng_stream rng{seed, 0x5a4d504cull};  // its own stream: not the training windows' or dropout's
    std::vector<double> p(static_cast<std::size_t>(vocab_));
    dml::nn::kv_cache cache(seq_);
    const auto ids = dml::nn::generate(net_, cache, tokens, n, [&](const float* last, std::int64_t i) {
      std::int64_t next = std::max_element(last, last + vocab_) - last;
      if (temperature > 0.f) {
        const double top = last[next];
        double sum = 0;
        for (std::int64_t v = 0; v < vocab_; ++v) sum += p[static_cast<std::size_t>(v)] = std::exp((last[v] - top) / temperature);
        double u = static_cast<double>(rng.uniform(static_cast<std::uint64_t>(i))) * sum;
        for (next = 0; next + 1 < vocab_ && u >= p[static_cast<std::size_t>(next)]; ++next) u -= p[static_cast<std::size_t>(next)];
      }
      return next;
    });
    std::string out;
    for (const float id : ids) out.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    return out;
  }

 private:
  std::int64_t vocab_, seq_;
  network net_;
};

inline constexpr std::int64_t val_rows = 64;

// A number the checkpoint's user metadata holds under `key` (written by run_trainer).
inline std::int64_t checkpoint_number(const std::map<std::string, std::string>& meta, const std::string& dir,
                                      const char* key) {
  const auto it = meta.find(key);
  if (it == meta.end())
    dml::fail<dml::format_error>("--resume ", dir, ": expected '", key, "' in the checkpoint's metadata (a checkpoint "
                                 "of this example), found none");
  return dml::parse_number<std::int64_t>(dml::detail::cat("--resume ", dir, ": '", key, "'"), it->second);
}

// Every rank runs this with its communicator; rank 0 prints and writes files.
template <class Arch, class Precision, class Sharding, class Comm>
int run_trainer(const options& o, Comm& comm, const corpus& text) {
  const int world = comm.size(), rank = comm.rank();
  const int dp = data_parallel(o, world);
  // World rank = tp + TP·(dp + DP·pp): all ranks of one tensor and pipeline group pass one dp rank's rows, and
  // so do the cp consecutive dp ranks of a context-parallel group (each trains on its chunk of the positions).
  const int data_rank = (rank / o.tp) % dp / o.cp, data_ranks = dp / o.cp;
  const std::int64_t first = o.batch * data_rank / data_ranks, rows = o.batch * (data_rank + 1) / data_ranks - first;
  const auto config = Arch::make_config(o);
  const auto model = Arch::model(config);

  dml::train::trainer_options to;
  to.seed = o.seed;
  to.micro_batches = o.microbatches;
  to.pipeline_stages = o.pp;
  to.schedule = o.schedule;
  to.recompute = o.recompute == "full";
  // --memory binds the trainer too: dml's buffers past it stop the run, naming what is held (the plan's bytes fit).
  if (o.memory_cap) to.memory_limit = static_cast<std::int64_t>(dml::parse_bytes(o.memory));
  to.clip_norm = o.clip;
  to.tensor_parallel = o.tp;
  to.sequence_parallel = o.sp;
  to.expert_parallel = o.ep;
  to.context_parallel = o.cp;
  to.cp_zigzag = o.cp_zigzag;
  to.cp_all_gather = o.cp_attention == "allgather";
  to.replicas = o.replicas;
  to.offload = o.offload;
  to.lr = [&o](std::int64_t s) { return learning_rate(o, s); };
  to.trace = o.trace;
  // Held by pointer so that what comes after training (val_loss, sampling) runs after its memory is given back.
  auto held = std::make_unique<dml::trainer<Sharding, dml::optim::adamw, Precision>>(comm, model, to,
                                                                                    dml::optim::adamw({.lr = o.lr}));
  auto& trainer = *held;
  if (!o.init.empty() || !o.load_hf.empty()) {
    std::vector<float> full(static_cast<std::size_t>(trainer.layout().total));
    if (!o.init.empty()) dml::train::load_weights(trainer.layout(), full, o.init);
    else Arch::load(o, config, trainer.layout(), full);
    trainer.load_full_parameters(full);
  }
  // Resuming: the weights, optimizer state and step of the checkpoint, whatever layout wrote it. The batches,
  // the dropout masks and the learning rate all follow the step, so training goes on where it stopped.
  std::int64_t resumed_at = 0, planned = o.steps;
  if (!o.resume.empty()) {
    const auto meta = trainer.load_checkpoint(o.resume);  // collective
    resumed_at = checkpoint_number(meta, o.resume, "step");
    planned = checkpoint_number(meta, o.resume, "steps");
    if (resumed_at != trainer.steps())
      dml::fail<dml::format_error>("--resume ", o.resume, ": the metadata says step ", resumed_at,
                                   ", the checkpoint itself step ", trainer.steps());
    if (resumed_at > o.steps)
      dml::fail<dml::invalid_argument>("--resume ", o.resume, ": the checkpoint is at step ", resumed_at,
                                       "; expected --steps >= ", resumed_at, ", found ", o.steps);
  }
  std::ofstream log;
  if (rank == 0) {
    if (!o.log.empty()) {
      log.open(o.log);
      if (!log) dml::fail<dml::io_error>(o.log, ": cannot open for writing");
      log << "step,loss" << (o.experts > 0 ? ",aux_loss,z_loss,dropped,a2a_bytes,imbalance" : "");
      for (std::int64_t e = 0; e < o.experts; ++e) log << ",tokens_" << e;
      for (std::int64_t e = 0; e < o.experts; ++e) log << ",dropped_" << e;
      log << '\n' << std::fixed << std::setprecision(6);
    }
    std::printf("text: %s, %lld bytes (%lld trained on, %lld held out), byte tokens, vocabulary %lld\n",
                text.path.c_str(), static_cast<long long>(text.all.size()), static_cast<long long>(text.train.size()),
                static_cast<long long>(text.val ? text.val->size() : 0), static_cast<long long>(o.vocab));
    const std::string from = !o.init.empty() ? o.init : o.load_hf;
    std::printf("model: %s, %lld parameters%s%s%s%s\n", Arch::describe(o).c_str(),
                static_cast<long long>(trainer.layout().numel), o.bias ? ", biases" : "",
                o.tie ? ", lm_head tied to the token embedding" : "", from.empty() ? "" : (", from " + from).c_str(),
                o.documents ? ", paragraphs as documents" : "");
    char clip[32] = "no clipping";
    if (o.clip > 0.f) std::snprintf(clip, sizeof clip, "clip %g", static_cast<double>(o.clip));
    std::printf("training: %lld steps of %lld sequences (%lld tokens), adamw lr=%g (warmup, cosine to lr/10), %s, "
                "dropout %g, %s\n",
                static_cast<long long>(o.steps), static_cast<long long>(o.batch), static_cast<long long>(o.batch * o.seq),
                static_cast<double>(o.lr), clip, static_cast<double>(o.dropout), Precision::name);
    if (o.experts > 0) {
      char capacity[48] = "dropless";
      if (o.capacity_factor > 0.f)
        std::snprintf(capacity, sizeof capacity, "capacity factor %g", static_cast<double>(o.capacity_factor));
      std::printf("experts: %lld in every %lld%s block, top-%d, %s, aux loss weight %g, z-loss weight %g, %s router",
                  static_cast<long long>(o.experts), static_cast<long long>(o.moe_every),
                  o.moe_every == 1 ? "" : o.moe_every == 2 ? "nd" : o.moe_every == 3 ? "rd" : "th", o.top_k, capacity,
                  static_cast<double>(o.aux_loss_weight), static_cast<double>(o.z_loss_weight), o.router.c_str());
      if (o.expert_ffn) std::printf(", expert width %lld", static_cast<long long>(*o.expert_ffn));
      if (o.shared_experts > 0) std::printf(", %lld shared", static_cast<long long>(o.shared_experts));
      if (o.router_bias_rate > 0.f) std::printf(", loss-free balancing rate %g", static_cast<double>(o.router_bias_rate));
      std::printf("\n");
    }
    std::string carved;
    if (o.ep > 1) carved += " (ep " + std::to_string(o.ep) + ")";
    if (o.cp > 1)
      carved += " (cp " + std::to_string(o.cp) + (o.cp_zigzag ? ", zig-zag, " : ", contiguous, ") + o.cp_attention + ")";
    std::printf("layout: %d %s rank(s) = tp %d%s × dp %d%s × pp %d, sharding %s, replicas %d, %lld micro-batch(es)"
                "%s%s%s; %d thread(s) per rank; gemm %s\n",
                world, o.comm.c_str(), o.tp, o.sp ? " (sequence parallel)" : "", dp, carved.c_str(), o.pp,
                o.parallel.c_str(), o.replicas, static_cast<long long>(o.microbatches),
                o.schedule.empty() ? "" : ", schedule ", o.schedule.c_str(),
                o.recompute == "none" ? "" : (", recompute " + o.recompute).c_str(), dml::thread_budget(),
                dml::host_gemm_impl(o.batch * o.seq / world, o.d_model, 4 * o.d_model,
                                    dml::dtype_v<typename Precision::type>).c_str());
    if (!o.resume.empty()) {
      std::printf("resumed from %s at step %lld", o.resume.c_str(), static_cast<long long>(resumed_at));
      if (planned != o.steps)
        std::printf(" (its run planned %lld steps; the schedule now follows --steps %lld)",
                    static_cast<long long>(planned), static_cast<long long>(o.steps));
      std::printf("\n");
    }
    std::fflush(stdout);
  }

  std::vector<float> x(static_cast<std::size_t>(rows * o.seq));
  std::vector<std::int32_t> y(x.size());
  std::vector<std::int64_t> doc;
  const std::int64_t every = o.print_every > 0 ? o.print_every : std::max<std::int64_t>(1, o.steps / 20);
  const auto start = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  float loss = std::nanf("");
  std::deque<std::vector<std::vector<std::int64_t>>> last_loads;  // with experts: the last steps' per-layer loads
  // Collective. The checkpoint's user metadata: the step (the trainer keeps it too) and the run's planned steps.
  std::int64_t saved = o.resume.empty() ? -1 : resumed_at;  // the step of the newest checkpoint of this state
  // What the saves cost training (rank 0's view): the time inside save_checkpoint, and each step's time with
  // whether a save was being written behind it (async), to set against the steps without.
  std::int64_t saves = 0;
  double stalled = 0;
  std::vector<std::pair<double, bool>> step_times;
  auto save_checkpoint = [&](std::int64_t step) {
    const double began = seconds();
    trainer.save_checkpoint(o.checkpoint, {{"step", std::to_string(step)}, {"steps", std::to_string(o.steps)}},
                            o.checkpoint_async ? dml::train::save_mode::async : dml::train::save_mode::sync);
    const double took = seconds() - began;
    stalled += took;
    ++saves;
    saved = step;
    if (rank == 0) {
      std::printf("checkpoint %s at step %lld (%.1f ms in the call)\n", o.checkpoint.c_str(),
                  static_cast<long long>(step), 1e3 * took);
      std::fflush(stdout);
    }
  };
  for (std::int64_t step = resumed_at + 1; step <= o.steps; ++step) {
    text.train.batch(o.seed, static_cast<std::uint64_t>(step), first, rows, o.seq, x.data(), y.data());
    if (o.documents) document_starts(x, rows, o.seq, doc);
    const bool behind = trainer.checkpoint_pending();
    const double step_began = seconds();
    const auto r = trainer.step(dml::tensor_view<const float>(x.data(), {rows, o.seq}), y.data(), o.batch,
                                o.documents ? doc.data() : nullptr);
    if (step > resumed_at + 1) step_times.emplace_back(seconds() - step_began, behind);  // the first warms up
    loss = r.loss;
    const auto& moe = r.routing;
    if (o.experts > 0) {  // each layer's tokens per expert over the last 20 steps
      if (last_loads.size() == 20) last_loads.pop_front();
      last_loads.push_back(moe.layer_tokens);
    }
    std::int64_t dropped = 0;
    for (auto d : moe.dropped) dropped += d;
    if (rank == 0) {
      if (log) {
        log << step << ',' << loss;
        if (o.experts > 0)
          log << ',' << moe.aux_loss << ',' << moe.z_loss << ',' << dropped << ',' << moe.a2a_bytes << ',' << moe.imbalance();
        for (auto t : moe.tokens) log << ',' << t;
        for (auto d : moe.dropped) log << ',' << d;
        log << '\n';
      }
      if (step == resumed_at + 1 || step % every == 0 || step == o.steps) {
        const double s = seconds();
        std::printf("step %lld/%lld loss=%.4f lr=%.2e tokens_per_s=%.0f", static_cast<long long>(step),
                    static_cast<long long>(o.steps), static_cast<double>(loss), static_cast<double>(learning_rate(o, step)),
                    s > 0 ? static_cast<double>((step - resumed_at) * o.batch * o.seq) / s : 0.0);
        if (o.experts > 0) {
          std::printf(" aux_loss=%.4f z_loss=%.3f dropped=%lld a2a_bytes=%lld imbalance=%.2f tokens_per_expert=",
                      moe.aux_loss, moe.z_loss, static_cast<long long>(dropped), static_cast<long long>(moe.a2a_bytes),
                      moe.imbalance());
          for (std::size_t e = 0; e < moe.tokens.size(); ++e)
            std::printf("%s%lld", e ? "/" : "", static_cast<long long>(moe.tokens[e]));
        }
        std::printf("\n");
        std::fflush(stdout);
      }
    }
    if (!o.checkpoint.empty() && o.checkpoint_every && step % *o.checkpoint_every == 0) save_checkpoint(step);
  }
  if (!o.checkpoint.empty() && saved != o.steps) save_checkpoint(o.steps);
  const double finishing = seconds();
  trainer.wait_checkpoint();  // collective: the last save in the background is complete before training ends
  const double train_seconds = seconds();  // with the saves
  if (rank == 0 && saves > 0) {
    // The steps a save was written behind, against the median of the others.
    std::vector<double> clear;
    double behind = 0;
    std::int64_t slowed = 0;
    for (const auto& [t, b] : step_times)
      if (!b) clear.push_back(t);
    std::ranges::sort(clear);
    const double typical = clear.empty() ? 0.0 : clear[clear.size() / 2];
    for (const auto& [t, b] : step_times)
      if (b) behind += t - typical, ++slowed;
    std::printf("checkpoint_saves=%lld checkpoint_call_seconds=%.3f checkpoint_steps_behind=%lld "
                "checkpoint_steps_excess_seconds=%.3f checkpoint_final_wait_seconds=%.3f (%s)\n",
                static_cast<long long>(saves), stalled, static_cast<long long>(slowed), behind,
                train_seconds - finishing, o.checkpoint_async ? "async" : "sync");
  }
  if (log) log.close();
  if (!o.trace.empty()) {
    trainer.write_trace();  // collective
    if (rank == 0) std::printf("trace %s\n", o.trace.c_str());
  }

  const auto mem = trainer.memory();  // rank 0's: its stage and its tensor-parallel part
  trainer.release_activations();  // the whole model's gather below holds memory of its own
  const auto full = trainer.full_parameters();  // collective
  const dml::nn::param_layout layout = trainer.layout();
  held.reset();  // gradients, optimizer state and activations: evaluation and sampling hold their own, smaller set
  if (rank != 0) return 0;
  // dml's buffers by category; the rest of their high-water mark is workspaces and transients.
  std::printf("memory per rank (rank 0): %s\n", mem.by_category().c_str());
  double predicted = -1;  // the largest rank's bytes
  try {
    if (o.schedule.ends_with(".csv")) dml::fail<dml::invalid_argument>("a schedule file");
    const auto b = dml::cost::rank_bytes(cost_model_of(o), cost_layout_of(o, world), cost_training_of(o));
    std::printf("predicted (largest rank): %s\n", bytes_line(b).c_str());
    predicted = b.total();
  } catch (const dml::error& e) {
    std::printf("predicted (largest rank): not priced (%s)\n", e.what());
  }
  if (o.planned_activations >= 0)
    std::printf("activation bytes per rank (rank 0): %lld at peak, %.0f planned\n",
                static_cast<long long>(mem.activations), o.planned_activations);
  if (!o.save.empty()) dml::train::save_weights(layout, full, o.save);
  Arch::save(o, config, layout, full);
  inference_model<Arch> net(config, layout, full);
  const std::int64_t eval_rows = std::max<std::int64_t>(1, rows / o.microbatches);  // a training micro-batch's
  std::printf("final_loss=%.4f", static_cast<double>(loss));
  if (text.val) std::printf(" val_loss=%.4f", net.loss(*text.val, val_rows, eval_rows));
  std::printf(" tokens_per_s=%.0f seconds=%.1f\n",
              train_seconds > 0 ? static_cast<double>((o.steps - resumed_at) * o.batch * o.seq) / train_seconds : 0.0,
              train_seconds);
  for (const auto& f : {o.save, o.save_hf, o.export_llama2c})
    if (!f.empty()) std::printf("saved %s\n", f.c_str());
  if (!last_loads.empty()) {  // each layer's tokens summed over the run's last 20 steps
    auto sum = last_loads.front();
    for (std::size_t i = 1; i < last_loads.size(); ++i)
      for (std::size_t l = 0; l < sum.size() && l < last_loads[i].size(); ++l)
        for (std::size_t e = 0; e < sum[l].size() && e < last_loads[i][l].size(); ++e) sum[l][e] += last_loads[i][l][e];
    std::printf("expert_load_max_over_mean=%.3f (the most unevenly loaded layer's busiest expert over its mean, tokens of "
                "the last %zu steps)\n",
                dml::parallel::worst_imbalance(sum), last_loads.size());
  }
  if (o.sample > 0) {
    const auto head = text.all.bytes().first(std::min<std::size_t>(16, text.all.bytes().size()));
    const std::string prompt = o.prompt ? *o.prompt : std::string(head.begin(), head.end());
    if (prompt.empty()) dml::fail<dml::invalid_argument>("--prompt: expected at least one byte, found none");
    for (const char ch : prompt)
      if (static_cast<unsigned char>(ch) >= o.vocab)
        dml::fail<dml::invalid_argument>("--prompt: byte ", static_cast<int>(static_cast<unsigned char>(ch)),
                                         " is not a token: expected bytes < --vocab ", o.vocab);
    const float temperature = o.temperature.value_or(0.f);
    char how[64] = "greedy";
    if (temperature > 0.f)
      std::snprintf(how, sizeof how, "temperature %g, seed %llu", static_cast<double>(temperature),
                    static_cast<unsigned long long>(o.seed));
    std::printf("sample (%s): %lld bytes after a prompt of %zu bytes:\n", how, static_cast<long long>(o.sample),
                prompt.size());
    const std::string out = net.generate(prompt, o.sample, temperature, o.seed);
    std::fwrite(prompt.data(), 1, prompt.size(), stdout);
    std::fwrite(out.data(), 1, out.size(), stdout);
    std::fputc('\n', stdout);
  }
  // The process's high-water mark: its ranks' tensors, and the code, libraries, stacks, scratch and text beside them.
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const int ranks_here = o.comm == "local" ? world : 1;
  const double peak = static_cast<double>(usage.ru_maxrss) * 1024.0;
  std::printf("process peak resident: %.2f MiB (all %d ranks of this process, with code, libraries and the text)",
              peak / 1048576.0, ranks_here);
  if (predicted >= 0)
    std::printf("; predicted %.2f MiB for its ranks (the largest's × %d), %.2f MiB over", predicted * ranks_here / 1048576.0,
                ranks_here, (peak - predicted * ranks_here) / 1048576.0);
  std::printf("\n");
  std::fflush(stdout);
  return 0;
}

// zeroN is always hybrid<zero<N>>: with --replicas 1 that is plain ZeRO, and it halves the trainers compiled.
template <class Arch, class Precision, class Comm>
int run_sharding(const options& o, Comm& comm, const corpus& text) {
  using dml::parallel::hybrid, dml::parallel::zero;
  if (o.parallel == "zero1") return run_trainer<Arch, Precision, hybrid<zero<1>>>(o, comm, text);
  if (o.parallel == "zero2") return run_trainer<Arch, Precision, hybrid<zero<2>>>(o, comm, text);
  if (o.parallel == "zero3") return run_trainer<Arch, Precision, hybrid<zero<3>>>(o, comm, text);
  return run_trainer<Arch, Precision, dml::parallel::replicate>(o, comm, text);
}

template <class Arch = gpt_arch, class Comm>
int run(const options& o, Comm& comm, const corpus& text) {
  if (o.precision == "bf16") return run_sharding<Arch, dml::precision::bf16>(o, comm, text);
  return run_sharding<Arch, dml::precision::fp32>(o, comm, text);
}

// train_llama.hpp (main.cpp): the Llama trainers on comm::local ranks, and --load-hf's config.json read into the
// model flags.
int run_llama(const options& o, dml::comm::local& comm, const corpus& text);
void read_hf_config(options& o);

#if defined(DML_EXAMPLE_WITH_MPI)
int run_mpi(const options& o, const corpus& text);
#endif
#if defined(DML_EXAMPLE_WITH_GLOO)
int run_elastic(const options& o, const corpus& text);
#endif

inline int main(int argc, char** argv) {
  options o;
  auto cli = command_line(o);
  if (const auto status = cli.parse_for_main(argc, argv, [&] { check_across(o); })) return *status;
  try {
    const corpus text = load_corpus(o);
    if (o.elastic) {
#if defined(DML_EXAMPLE_WITH_GLOO)
      return run_elastic(o, text);
#else
      dml::fail<dml::invalid_argument>("--elastic: this build has no Gloo");
#endif
    }
    if (o.comm == "mpi") {
#if defined(DML_EXAMPLE_WITH_MPI)
      return run_mpi(o, text);
#else
      dml::fail<dml::invalid_argument>("--comm mpi: this build has no MPI");
#endif
    }
    options chosen = o;
    if (!o.load_hf.empty()) read_hf_config(chosen);
    chosen.memory_cap = cli.given("--memory");
    apply_plan(chosen, o.ranks);
    data_parallel(chosen, o.ranks);  // a bad layout fails here, before any rank starts
    check_memory(chosen, o.ranks);
    int status = 0;
    dml::comm::local::run(o.ranks, [&](dml::comm::local& comm) {
      dml::set_thread_budget(o.threads);
      const int s = chosen.arch == "llama" ? run_llama(chosen, comm, text) : run(chosen, comm, text);
      if (comm.rank() == 0) status = s;
    });
    return status;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "gpt: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace gpt_example
