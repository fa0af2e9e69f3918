// SPDX-License-Identifier: Apache-2.0
// benchmarks/gpt_throughput.cpp — training tokens/s of nn::gpt or nn::llama (--arch; AdamW) for each layout (one rank
// fp32 and bf16, tensor parallel with and without sequence parallelism, data parallel, pipeline) beside PyTorch running
// the same model (gpt_throughput_torch.py) and this machine's one-core GEMM roofline, all measured in the same run.
// Both architectures' trainers live in this one unit: what every trainer shares compiles once.
#include <algorithm>
#include <chrono>
#include <map>
#include <cstdio>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <time.h>

#include "dml/dml.hpp"
#include "dml/nn/gpt.hpp"
#include "dml/nn/llama.hpp"
#include "dml/parallel/events.hpp"
#include "dml/parallel/schedule_check.hpp"
#include "dml/plan/calibrate.hpp"
#include "dml/plan/exact.hpp"
#include "dml/train/flags.hpp"

#include "bench_common.hpp"

#ifndef DML_GPT_TORCH_SCRIPT
#  define DML_GPT_TORCH_SCRIPT "benchmarks/gpt_throughput_torch.py"
#endif

namespace {

struct options {
  std::string arch = "gpt";  // gpt or llama
  std::int64_t layers = 6, d_model = 384, heads = 6, seq = 256, vocab = 256;
  std::int64_t kv_heads = 2;    // llama: key/value heads
  std::int64_t ffn_hidden = 0;  // llama: SwiGLU's width; 0: llama_ffn_hidden(d_model)
  std::int64_t batch = 8;  // global batch: sequences per step over all data-parallel ranks
  std::int64_t steps = 5, warmup = 2;
  std::int64_t microbatches = 0;  // of the pp layout; 0: the planner's pick
  std::string schedule;           // of the pp layout; empty: the planner's pick
  std::string pp_plan;            // how the pp layout's schedule and micro-batches were chosen, for the output
  int threads = 1;  // per rank, dml and PyTorch alike
  int repeats = 1;  // runs per layout (and per PyTorch thread count); the fastest is kept
  float lr = 3e-4f;
  std::vector<std::string> layouts;  // empty: every layout that fits the machine
  std::string json, python = "/usr/bin/python3", torch_script = DML_GPT_TORCH_SCRIPT;
  std::string trace;  // trainer_options::trace of every layout's trainer (the last layout's file is kept)
  bool torch = true;
};

// One way to run the model: tp × dp × pp comm::local ranks. recompute: none, full (the trainer's whole stage) or
// selective (a Llama's blocks); named_only: run when --layouts names it, not by default.
struct layout {
  std::string name;
  int tp = 1, dp = 1, pp = 1;
  bool sp = false, bf16 = false;
  std::string recompute = "none";
  bool named_only = false;
  int ranks() const { return tp * dp * pp; }
};
const std::vector<layout>& known_layouts() {
  static const std::vector<layout> all{{"1", 1, 1, 1, false, false},    {"1-bf16", 1, 1, 1, false, true},
                                       {"tp2", 2, 1, 1, false, false},  {"tp2-sp", 2, 1, 1, true, false},
                                       {"dp2", 1, 2, 1, false, false},  {"pp2", 1, 1, 2, false, false},
                                       {"1-selective", 1, 1, 1, false, false, "selective", true},
                                       {"1-full", 1, 1, 1, false, false, "full", true}};
  return all;
}

using dml_bench::clock_type;
using dml_bench::load_meter;
using dml_bench::seconds_since;
using dml_bench::step_trace;
using dml_bench::trace_step;

// CPU seconds the calling thread has run: a rank that waits for a core (or sleeps in a collective) does not count.
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

std::string load_average() {
  std::string s = "?";
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    char buf[64] = {};
    if (std::fgets(buf, sizeof buf, f)) {
      s = buf;
      const auto third = s.find(' ', s.find(' ', s.find(' ') + 1) + 1);  // the three averages
      s = s.substr(0, third);
    }
    std::fclose(f);
  }
  return s;
}

// Where rank 0's time went in one traced step: GEMMs of the Linear layers, GEMMs inside attention
// (q·kᵀ, P·v and their gradients, [T, T] × head_dim), and everything else (softmax, LayerNorm, GELU,
// embeddings, cross-entropy, AdamW, casts, communication and waiting).
struct step_profile {
  double step = 0, linear = 0, attention = 0;
  double linear_flop = 0, attention_flop = 0;
  int calls = 0, attention_calls = 0;
  double other() const { return step - linear - attention; }
};

struct result {
  layout l;
  bool ran = false;
  std::string skipped;  // why a layout could not run
  double tokens_per_s = 0, step_ms = 0, others = -1;
  double on_cpu = 0;  // Σ over ranks of the rank threads' CPU seconds in the timed steps / (wall seconds × ranks)
  std::int64_t peak_bytes = 0, state_bytes = 0;  // largest over ranks
  step_profile profile;
  float loss = 0;
  std::vector<double> idle;  // pipelines: each rank's idle share of its timed steps (parallel::bubble)
  double idle_theory = -1;   // pipelines: the schedule's bubble at forward 1, backward 2 (schedule::simulate)
  std::vector<std::string> action_ms;  // pipelines: per rank, the mean ms of each kind of compute action
};

// Token ids of global sequences [first, first + rows) and their next-token labels, from Philox.
void synthetic_rows(const options& o, std::int64_t first, std::int64_t rows, std::vector<float>& x,
                    std::vector<std::int32_t>& y) {
  const std::int64_t t = o.seq;
  x.resize(static_cast<std::size_t>(rows * t));
  y.resize(x.size());
  const dml::rng_stream rng{42, 7};
  const auto token = [&](std::int64_t row, std::int64_t j) {
    return static_cast<std::int32_t>(rng.block(static_cast<std::uint64_t>(row * (t + 1) + j))[0] % o.vocab);
  };
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < t; ++j) {
      x[static_cast<std::size_t>(r * t + j)] = static_cast<float>(token(first + r, j));
      y[static_cast<std::size_t>(r * t + j)] = token(first + r, j + 1);
    }
}

// Llama's SwiGLU width for a model width: 8/3 of it (two thirds of GPT's 4C, for three matrices in place of two),
// rounded up to a multiple of 256, as Meta's reference code sizes it (1024 at d_model 384).
std::int64_t llama_ffn_hidden(std::int64_t d_model) { return (8 * d_model / 3 + 255) / 256 * 256; }

// Each architecture's model from the command line; run_rank is templated on them (both in this unit).
struct gpt_arch {
  static dml::nn::gpt_config config(const options& o) {
    return {.vocab = o.vocab, .seq = o.seq, .layers = o.layers, .d_model = o.d_model, .heads = o.heads};
  }
  static auto model(const options& o, const layout& l) {
    if (l.recompute == "selective")
      dml::fail<dml::invalid_argument>("selective recompute is a Llama block's: run it with --arch llama");
    return dml::nn::gpt(config(o));
  }
};
struct llama_arch {
  static dml::nn::llama_config config(const options& o) {
    return {.vocab = o.vocab, .seq = o.seq, .d_model = o.d_model, .layers = o.layers, .heads = o.heads,
            .kv_heads = o.kv_heads, .ffn_hidden = o.ffn_hidden};
  }
  static auto model(const options& o, const layout& l) {
    auto g = config(o);
    g.selective_recompute = l.recompute == "selective";
    return dml::nn::llama(g);
  }
};
bool is_llama(const options& o) { return o.arch == "llama"; }

// Parameters that multiply (every one but the token and position embeddings): GPT's blocks 12C² + 2C each (LayerNorm
// weights included), ln_f and the untied lm_head; Llama's blocks 2C + C·(C + 2·kv·hd) + C² + 3·F·C each (two RMSNorm
// weights, qkv_proj, o_proj, gate_up_proj and down_proj), model.norm and the untied lm_head.
double multiplying_params(const options& o) {
  const double C = double(o.d_model), L = double(o.layers), V = double(o.vocab);
  if (!is_llama(o)) return L * (12 * C * C + 2 * C) + C + V * C;
  const double kv = double(o.kv_heads * (o.d_model / o.heads)), F = double(o.ffn_hidden);
  return L * (2 * C + C * (C + 2 * kv) + C * C + 3 * F * C) + C + V * C;
}

// The cost model's view of the benchmark's model (plan_pipeline, pick_precision).
dml::cost::model cost_model(const options& o) {
  return {.layers = o.layers, .d_model = o.d_model, .heads = o.heads, .seq = o.seq, .vocab = o.vocab,
          .arch = is_llama(o) ? dml::cost::architecture::llama : dml::cost::architecture::gpt,
          .kv_heads = is_llama(o) ? o.kv_heads : 0, .ffn_hidden = is_llama(o) ? o.ffn_hidden : 0};
}

step_profile classify(const std::vector<dml::gemm_call>& calls, double step_seconds, const options& o) {
  step_profile p;
  p.step = step_seconds;
  const std::int64_t t = o.seq, hd = o.d_model / o.heads;
  for (const auto& c : calls) {
    const auto& g = c.args;
    const bool attention = g.m == t && ((g.n == t && g.k == hd) || (g.n == hd && g.k == t));
    const double flop = 2.0 * double(g.m) * double(g.n) * double(g.k);
    (attention ? p.attention : p.linear) += c.seconds;
    (attention ? p.attention_flop : p.linear_flop) += flop;
    p.attention_calls += attention;
    ++p.calls;
  }
  return p;
}

template <class Arch, class Precision>
void run_rank(dml::comm::local& comm, const options& o, const layout& l, result& res, std::mutex& mu) {
  dml::set_thread_budget(o.threads);
  dml::train::trainer_options to;
  to.seed = 1;
  to.tensor_parallel = l.tp;
  to.sequence_parallel = l.sp;
  to.pipeline_stages = l.pp;
  to.micro_batches = l.pp > 1 ? o.microbatches : 1;
  if (l.pp > 1) to.schedule = o.schedule;
  to.record_events = l.pp > 1;  // compute_begin/compute_end around each action: the measured bubble
  to.recompute = l.recompute == "full";
  to.trace = o.trace;
  const auto model = Arch::model(o, l);
  dml::trainer<dml::parallel::replicate, dml::optim::adamw, Precision> t(comm, model, to, dml::optim::adamw({.lr = o.lr}));
  // World rank = tp rank + TP·(dp rank + DP·pp rank): every tp and pp rank of a data-parallel rank passes its rows.
  const int dp_rank = comm.rank() / l.tp % l.dp;
  const std::int64_t first = o.batch * dp_rank / l.dp, rows = o.batch * (dp_rank + 1) / l.dp - first;
  std::vector<float> x;
  std::vector<std::int32_t> y;
  synthetic_rows(o, first, rows, x, y);
  const dml::tensor_view<const float> xv(x.data(), {rows, o.seq});
  for (std::int64_t s = 0; s < o.warmup; ++s) t.step(xv, y.data(), o.batch);
  // One traced step (not timed): rank 0's GEMMs with their shapes and times.
  comm.barrier();
  const step_trace traced = trace_step([&] { t.step(xv, y.data(), o.batch); });
  comm.barrier();
  const auto t0 = clock_type::now();
  const double cpu0 = thread_cpu_seconds();
  float loss = 0;
  for (std::int64_t s = 0; s < o.steps; ++s) loss = t.step(xv, y.data(), o.batch).loss;
  const double cpu = thread_cpu_seconds() - cpu0;
  comm.barrier();
  const double secs = seconds_since(t0);
  if (!o.trace.empty()) t.write_trace();  // collective, after the timed steps
  std::lock_guard lk(mu);
  res.on_cpu += cpu / (secs * l.ranks());
  res.peak_bytes = std::max(res.peak_bytes, t.peak_activation_bytes());
  res.state_bytes = std::max(res.state_bytes, t.memory().total());
  if (l.pp > 1) {
    res.idle.resize(static_cast<std::size_t>(l.ranks()));
    // The steps after the warm-up and the traced one.
    res.idle[static_cast<std::size_t>(comm.rank())] = dml::parallel::bubble(t.events(), o.warmup + 1);
    const auto& table = t.schedule_table(to.micro_batches);
    res.idle_theory = dml::schedule::simulate(table).bubble;
    // Mean time of each kind of compute action on this rank over the timed steps: the k-th compute_begin of a step
    // is the k-th compute action of the rank's list.
    const auto computes = dml_bench::compute_kinds(table.ranks[static_cast<std::size_t>(comm.rank())]);
    std::map<std::string, std::pair<double, int>> kinds;
    double begun = -1;
    std::size_t next = 0;
    std::int64_t ended = 0;
    for (const auto& e : t.events()) {
      if (e.kind == dml::parallel::event_kind::step_end) ++ended, next = 0;
      if (e.kind == dml::parallel::event_kind::compute_begin) begun = e.t;
      if (e.kind != dml::parallel::event_kind::compute_end || begun < 0 || next >= computes.size()) continue;
      const auto kind = computes[next++];
      if (ended <= o.warmup + 1) continue;  // the warm-up and traced steps
      auto& [sum, n] = kinds[dml::schedule::to_string(kind)];
      sum += e.t - begun;
      ++n;
    }
    std::string text;
    for (const auto& [name, sn] : kinds) {
      char item[48];
      std::snprintf(item, sizeof item, "%s%s %.1f", text.empty() ? "" : ", ", name.c_str(), 1e3 * sn.first / sn.second);
      text += item;
    }
    res.action_ms.resize(static_cast<std::size_t>(l.ranks()));
    res.action_ms[static_cast<std::size_t>(comm.rank())] = text;
  }
  if (comm.rank() == 0) {
    res.tokens_per_s = double(o.batch * o.seq * o.steps) / secs;
    res.step_ms = 1e3 * secs / double(o.steps);
    res.profile = classify(traced.calls, traced.seconds, o);
    res.loss = loss;
  }
}

result run_layout(const options& o, const layout& l) {
  result res;
  res.l = l;
  std::mutex mu;
  const load_meter start = load_meter::now();
  try {
    dml::comm::local::run(l.ranks(), [&](dml::comm::local& comm) {
      if (is_llama(o)) {
        if (l.bf16) run_rank<llama_arch, dml::precision::bf16>(comm, o, l, res, mu);
        else run_rank<llama_arch, dml::precision::fp32>(comm, o, l, res, mu);
      } else {
        if (l.bf16) run_rank<gpt_arch, dml::precision::bf16>(comm, o, l, res, mu);
        else run_rank<gpt_arch, dml::precision::fp32>(comm, o, l, res, mu);
      }
    });
    res.ran = true;
  } catch (const std::exception& e) {
    res.skipped = e.what();
  }
  res.others = load_meter::others_since(start);
  return res;
}

// GFLOP/s of `run` (`flops` each call): the fastest of five timings of at least 0.1 s, after three warm calls (other
// processes only ever slow a timing down).
template <class Run>
double fastest_gflops(const Run& run, double flops) {
  for (int i = 0; i < 3; ++i) run();
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    int iters = 0;
    const auto t0 = clock_type::now();
    while (seconds_since(t0) < 0.1 || iters < 3) {
      run();
      ++iters;
    }
    best = std::max(best, flops * iters / seconds_since(t0) / 1e9);
  }
  return best;
}

// GFLOP/s of C[m, n] = A[m, k]·B[k, n] (A, B of type T, C f32) on one core: on `lib` (f32; where rows lie a multiple
// of 1 KiB apart, the faster of its plain and padded runs), or through the dispatch (16-bit inputs).
template <class T>
double gemm_gflops(std::int64_t m, std::int64_t n, std::int64_t k, const dml::host_gemm_library* lib) {
  std::vector<T> a(static_cast<std::size_t>(m * k), T(0.5f)), b(static_cast<std::size_t>(k * n), T(0.25f));
  std::vector<float> c(static_cast<std::size_t>(m * n));
  const dml::gemm_args g{.m = m, .n = n, .k = k, .a = a.data(), .lda = k, .b = b.data(), .ldb = n, .c = c.data(), .ldc = n};
  double best = 0;
  for (const bool padded : {false, true}) {
    if (padded && !(lib && dml::detail::host_gemm_strides_conflict(g))) continue;
    const auto run = [&] { lib ? dml::host_gemm_on(*lib, g, padded) : dml::gemm<dml::host>(g); };
    best = std::max(best, fastest_gflops(run, 2.0 * double(m) * double(n) * double(k)));
  }
  return best;
}


// Runs gpt_throughput_torch.py with `threads` threads; its tokens/s, or −1 (and why) if it did not run.
double torch_tokens_per_s(const options& o, int threads, std::string& info, double& on_cpu) {
  const std::string llama = is_llama(o) ? " --arch llama --kv-heads " + std::to_string(o.kv_heads) + " --ffn-hidden " +
                                              std::to_string(o.ffn_hidden)
                                        : std::string();
  const std::string cmd = o.python + " " + o.torch_script + llama + " --layers " + std::to_string(o.layers) + " --d-model " +
                          std::to_string(o.d_model) + " --heads " + std::to_string(o.heads) + " --seq " +
                          std::to_string(o.seq) + " --vocab " + std::to_string(o.vocab) + " --batch " +
                          std::to_string(o.batch) + " --steps " + std::to_string(o.steps) + " --warmup " +
                          std::to_string(o.warmup) + " --threads " + std::to_string(threads) + " --lr " +
                          std::to_string(o.lr) + " 2>&1";
  std::FILE* p = popen(cmd.c_str(), "r");
  if (!p) {
    info = "could not start: " + cmd;
    return -1;
  }
  std::string out;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  const int rc = pclose(p);
  const auto field = [&](const std::string& key) -> std::string {
    const auto at = out.rfind("\"" + key + "\": ");
    if (at == std::string::npos) return {};
    auto from = at + key.size() + 4;
    if (out[from] == '"') {
      ++from;
      return out.substr(from, out.find('"', from) - from);
    }
    return out.substr(from, out.find_first_of(",}", from) - from);
  };
  const std::string rate = field("tokens_per_s");
  if (rc != 0 || rate.empty()) {
    info = "failed (" + cmd + "): " + out.substr(out.size() > 400 ? out.size() - 400 : 0);
    return -1;
  }
  info = "PyTorch " + field("version") + ", " + field("blas");
  const std::string cpu = field("cpu_seconds"), secs = field("seconds");
  on_cpu = cpu.empty() || secs.empty() ? -1.0 : std::stod(cpu) / (std::stod(secs) * threads);
  return std::stod(rate);
}

// The command line (dml/train/flags.hpp).
dml::flags command_line(options& o) {
  dml::flags f("gpt_throughput", "Tokens/s of nn::gpt or nn::llama per layout beside PyTorch and the GEMM roofline.");
  f.add("--arch", o.arch, "A", "architecture: nn::gpt or nn::llama").choices({"gpt", "llama"});
  f.add("--layouts", o.layouts, "L,L", "layouts to run")
      .choices({"1", "1-bf16", "tp2", "tp2-sp", "dp2", "pp2", "1-selective", "1-full", "all"})
      .default_text("all that fit the machine");
  f.add("--layers", o.layers, "L", "transformer blocks").min(1);
  f.add("--d-model", o.d_model, "C", "model width, a multiple of --heads").min(1);
  f.add("--heads", o.heads, "H", "attention heads (llama: query heads)").min(1);
  f.add("--kv-heads", o.kv_heads, "K", "llama: key/value heads, dividing --heads").min(1);
  f.add("--ffn-hidden", o.ffn_hidden, "F", "llama: SwiGLU's width").min(1).default_text("8/3 C rounded up to a multiple of 256");
  f.add("--seq", o.seq, "T", "tokens per sequence").min(1);
  f.add("--batch", o.batch, "B", "global sequences per step").min(1);
  f.add("--steps", o.steps, "N", "timed steps").min(1);
  f.add("--warmup", o.warmup, "N", "untimed steps first").min(0);
  f.add("--microbatches", o.microbatches, "M", "microbatches of the pp layout (0: the planner's pick)").min(0);
  f.add("--schedule", o.schedule, "S", "schedule of the pp layout: gpipe, 1f1b, interleaved:V, zb or a CSV file")
      .default_text("the planner's pick");
  f.add("--threads", o.threads, "N", "threads per rank, dml and PyTorch alike").min(1);
  f.add("--repeats", o.repeats, "N", "runs per layout; the fastest is kept").min(1);
  f.add("--lr", o.lr, "X", "learning rate").min(0.f);
  f.add("--json", o.json, "FILE", "write one JSON object per result");
  f.add("--trace", o.trace, "FILE", "record every step's timeline (trainer_options::trace) and write it to FILE");
  f.add("--python", o.python, "PATH", "the Python of the PyTorch baseline");
  f.add("--torch-script", o.torch_script, "PATH", "the PyTorch baseline's script");
  f.add_switch("--no-torch", o.torch, "skip the PyTorch baseline", false);
  return f;
}

void check_across(options& o, const dml::flags& f) {
  if (o.d_model % o.heads != 0)
    dml::fail<dml::invalid_argument>("--d-model: expected a multiple of --heads ", o.heads, ", found ", o.d_model);
  if (!is_llama(o)) {
    for (const char* name : {"--kv-heads", "--ffn-hidden"})
      if (f.given(name)) dml::fail<dml::invalid_argument>(name, ": expected with --arch llama, found --arch ", o.arch);
  } else {
    if (o.heads % o.kv_heads != 0)
      dml::fail<dml::invalid_argument>("--kv-heads: expected a divisor of --heads ", o.heads, ", found ", o.kv_heads);
    if (o.d_model / o.heads % 2 != 0)
      dml::fail<dml::invalid_argument>("--heads: expected an even head width d_model / heads (RoPE rotates pairs), "
                                       "found ", o.d_model, " / ", o.heads);
    if (o.ffn_hidden == 0) o.ffn_hidden = llama_ffn_hidden(o.d_model);
  }
  if (std::find(o.layouts.begin(), o.layouts.end(), "all") != o.layouts.end()) o.layouts.clear();
}

// The pp layout's micro-batch count and schedule where the command line leaves them to the planner: of the
// layouts of two pipeline stages (no other parallelism, no recompute) that dml::cost ranks on this host's rates
// for one of two ranks at the model's widths (cost::calibrate_gpt_rank_of, about a second; a Llama priced as
// cost::architecture::llama on those rates), the fastest, as `gpt --plan auto` picks (--arch llama too).
void plan_pipeline(options& o) {
  const bool choose_m = o.microbatches == 0, choose_s = o.schedule.empty();
  if (!choose_m && !choose_s) {
    o.pp_plan = "given";
    return;
  }
  const dml::cost::model m = cost_model(o);
  const dml::cost::training t{.global_batch = o.batch, .prec = dml::cost::precision::fp32};
  const dml::cost::cluster c = dml::cost::calibrate_gpt_rank_of(2, o.d_model, o.heads, o.seq, o.vocab, o.threads);
  std::vector<dml::cost::estimate> ranked;
  if (choose_s || o.schedule == "1f1b" || o.schedule == "zb") {
    ranked = dml::cost::search_dml(m, t, c, 2, 0);
  } else {  // a schedule the search does not try: every micro-batch count under it
    dml::cost::layout l;
    try {
      l = dml::cost::parse_layout("pp=2,schedule=" + o.schedule);
    } catch (const dml::invalid_argument&) {
      dml::fail<dml::invalid_argument>("--microbatches 0 leaves the count to the planner, which does not price "
                                       "--schedule ", o.schedule, "; give --microbatches");
    }
    for (std::int64_t count = 1; count <= o.batch; ++count)
      if (o.batch % count == 0) {
        l.micro_batches = count;
        ranked.push_back(dml::cost::evaluate_dml(m, l, t, c, 2));
      }
    dml::cost::rank_estimates(ranked);
  }
  for (const auto& e : ranked) {
    const auto& l = e.lay;
    if (l.pp != 2 || l.zero != 0 || l.recomp != dml::cost::recompute::none || !e.why.empty()) continue;
    if ((!choose_m && l.micro_batches != o.microbatches) || (!choose_s && l.schedule != o.schedule)) continue;
    o.microbatches = l.micro_batches;
    o.schedule = l.schedule;
    char text[160];
    std::snprintf(text, sizeof text, "the planner's pick (predicted %.3g s per step, bubble %.3f)", e.step_seconds,
                  e.bubble);
    o.pp_plan = text;
    return;
  }
  dml::fail<dml::invalid_argument>("the planner found no pipeline of 2 stages for this model and batch",
                                   choose_s ? "" : " under --schedule " + o.schedule);
}

// The precision `gpt --precision auto` trains one rank of this benchmark's model in: dml::cost's faster of fp32 and
// bf16 on one rank, on this host's rates in each (cost::calibrate_gpt_rank_of: bf16's products as they run here).
struct precision_pick {
  dml::cost::precision chosen;
  double bf16_speedup;  // predicted fp32 step over bf16 step
};
precision_pick pick_precision(const options& o) {
  const dml::cost::model m = cost_model(o);
  const dml::cost::training t{.global_batch = o.batch, .prec = dml::cost::precision::fp32};
  const dml::cost::cluster c = dml::cost::calibrate_gpt_rank_of(1, o.d_model, o.heads, o.seq, o.vocab, o.threads);
  const auto ranked = dml::cost::search_precisions(t, {dml::cost::precision::fp32, dml::cost::precision::bf16},
                                                   [&](const dml::cost::training& u) {
    return std::vector{dml::cost::evaluate_dml(m, dml::cost::parse_layout("schedule=single"), u, c, 1)};
  });
  const auto& fp32 = ranked.front().prec == dml::cost::precision::fp32 ? ranked.front() : ranked.back();
  const auto& bf16 = ranked.front().prec == dml::cost::precision::bf16 ? ranked.front() : ranked.back();
  return {ranked.front().prec, fp32.step_seconds / bf16.step_seconds};
}

}  // namespace

int main(int argc, char** argv) try {
  options o;
  auto cli = command_line(o);
  if (const auto status = dml_bench::parse_for_main(cli, argc, argv, [&] { check_across(o, cli); })) return *status;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<layout> layouts;
  for (const auto& l : known_layouts()) {
    const bool named = std::find(o.layouts.begin(), o.layouts.end(), l.name) != o.layouts.end();
    if (o.layouts.empty() ? !l.named_only && l.ranks() * o.threads <= cores : named) layouts.push_back(l);
  }
  if (std::any_of(layouts.begin(), layouts.end(), [](const layout& l) { return l.pp > 1; })) plan_pipeline(o);
  const std::int64_t C = o.d_model, L = o.layers, T = o.seq, V = o.vocab, tokens = o.batch * o.seq;
  const bool llama = is_llama(o);
  // FLOPs per token: 6 per weight that multiplies (forward 2, backward 4) over every parameter but the embedding
  // tables (multiplying_params), plus attention's q·kᵀ and P·v, 12·L·T·C: the full T × T products, as model FLOPs
  // count them, over the query heads (heads × head_dim = C; a Llama's grouped key/value heads make k and v narrower,
  // not these products).
  const double n_params = multiplying_params(o);
  const double flop_per_token = 6.0 * n_params + 12.0 * double(L * T * C);
  const std::string cpu = dml::host_cpu_model();

  std::printf("# %s, %d core(s); load average %s at start\n", cpu.c_str(), cores, load_average().c_str());
  if (llama)
    std::printf("# Llama: vocab %lld, seq %lld, %lld layers, d_model %lld, %lld heads (%lld key/value), SwiGLU %lld, "
                "RMSNorm, RoPE (no biases, untied head), ",
                static_cast<long long>(V), static_cast<long long>(T), static_cast<long long>(L),
                static_cast<long long>(C), static_cast<long long>(o.heads), static_cast<long long>(o.kv_heads),
                static_cast<long long>(o.ffn_hidden));
  else
    std::printf("# GPT: vocab %lld, seq %lld, %lld layers, d_model %lld, %lld heads (no biases, untied head), ",
                static_cast<long long>(V), static_cast<long long>(T), static_cast<long long>(L),
                static_cast<long long>(C), static_cast<long long>(o.heads));
  std::printf("AdamW lr %g; global batch %lld sequences = %lld tokens; %lld steps after %lld warm-up, best of %d; %d "
              "thread(s) per rank\n",
              double(o.lr), static_cast<long long>(o.batch), static_cast<long long>(tokens),
              static_cast<long long>(o.steps), static_cast<long long>(o.warmup), o.repeats, o.threads);
  std::printf("# FLOPs per token = 6 N + 12 L T C = 6 x %.3fM + %.3fM = %.2f MFLOP (N: parameters but %s)\n",
              n_params / 1e6, 12.0 * double(L * T * C) / 1e6, flop_per_token / 1e6,
              llama ? "model.embed_tokens" : "wte and wpe");
  if (!o.pp_plan.empty())
    std::printf("# pp2: schedule %s, %lld micro-batches: %s\n", o.schedule.c_str(),
                static_cast<long long>(o.microbatches), o.pp_plan.c_str());
  std::fflush(stdout);

  // PyTorch, once per round for each thread count an fp32 layout uses (ranks × threads per rank).
  struct torch_run {
    int threads = 0;
    double rate = -1, on_cpu = -1, others = -1;
    std::string info;
    bool failed = false;
  };
  std::vector<torch_run> torch_rates;
  if (o.torch)
    for (const auto& l : layouts) {
      const int th = l.ranks() * o.threads;
      if (l.bf16 || std::any_of(torch_rates.begin(), torch_rates.end(), [&](auto& p) { return p.threads == th; }))
        continue;
      torch_rates.emplace_back().threads = th;
    }
  const auto run_torch = [&](torch_run& t) {
    if (t.failed) return;
    const load_meter start = load_meter::now();
    std::string info;
    double cpu = -1;
    const double r = torch_tokens_per_s(o, t.threads, info, cpu);
    if (r < 0) {
      t.rate = -1;
      t.info = info;
      t.failed = true;
    } else if (r > t.rate) {
      t.rate = r;
      t.on_cpu = cpu;
      t.others = load_meter::others_since(start);
      t.info = info;
    }
  };

  // The fastest of --repeats runs of PyTorch and of each layout; the runs go round them, one of each per round (PyTorch
  // first), so that a slow spell of a shared host costs one run of each rather than every run of one (the baselines
  // included).
  std::vector<result> results;
  for (int i = 0; i < o.repeats; ++i) {
    for (auto& t : torch_rates) run_torch(t);
    for (std::size_t k = 0; k < layouts.size(); ++k) {
      if (i == 0) {
        results.push_back(run_layout(o, layouts[k]));
        continue;
      }
      if (!results[k].ran) continue;
      result r = run_layout(o, layouts[k]);
      if (r.tokens_per_s > results[k].tokens_per_s) results[k] = std::move(r);
    }
  }
  for (const auto& t : torch_rates) {
    if (t.rate > 0)
      std::printf("# PyTorch, %d thread(s): %.1f tokens/s, on CPU %.0f%% of its threads' time (%s; other processes "
                  "%.0f%% of the machine)\n",
                  t.threads, t.rate, 100.0 * t.on_cpu, t.info.c_str(), 100.0 * t.others);
    else
      std::printf("# PyTorch, %d thread(s): %s\n", t.threads, t.info.c_str());
  }
  std::fflush(stdout);
  const auto torch_of = [&](int th) {
    for (const auto& r : torch_rates)
      if (r.threads == th) return r;
    return torch_run{};
  };
  const auto torch_rate = [&](int th) { return torch_of(th).rate; };

  // The roofline: the model's dominant GEMM shape (GPT's c_fc: m = B·T, n = 4C, k = C; Llama's gate_up_proj:
  // n = 2F) on one core, f32 on the fastest library found, bf16 through the dispatch where oneDNN has a native bf16
  // kernel here.
  dml::set_thread_budget(1);
  const std::int64_t gm = tokens, gn = llama ? 2 * o.ffn_hidden : 4 * C, gk = C;
  double f32_roof = 0;
  std::string f32_lib;
  std::printf("# GEMM roofline, one core, m x n x k = %lldx%lldx%lld (%s):", static_cast<long long>(gm),
              static_cast<long long>(gn), static_cast<long long>(gk), llama ? "B*T x 2F x C" : "B*T x 4C x C");
  for (const auto& [lib, name] : dml::host_gemm_libraries()) {
    const double r = gemm_gflops<float>(gm, gn, gk, &lib);
    std::printf(" %s %.1f;", std::string(dml::to_string(lib)).c_str(), r);
    if (r > f32_roof) {
      f32_roof = r;
      f32_lib = std::string(dml::to_string(lib)) + " (" + name + ")";
    }
  }
  const bool bf16_native = dml::host_gemm_native(dml::dtype::bf16);
  const double bf16_roof = bf16_native ? gemm_gflops<dml::bf16>(gm, gn, gk, nullptr) : 0.0;
  std::printf(" GFLOP/s f32\n# f32 roofline %.1f GFLOP/s per core on %s; oneDNN f32 kernel %s\n", f32_roof,
              f32_lib.c_str(), dml::host_gemm_impl(gm, gn, gk, dml::dtype::f32).c_str());
  if (bf16_native)
    std::printf("# bf16 roofline %.1f GFLOP/s per core, oneDNN kernel %s\n", bf16_roof,
                dml::host_gemm_impl(gm, gn, gk, dml::dtype::bf16).c_str());
  else
    std::printf("# bf16: no native bf16 GEMM on this CPU (%s); bf16 runs are held to the f32 roofline\n",
                dml::host_gemm_impl(gm, gn, gk, dml::dtype::bf16).c_str());

  std::printf("%-8s %5s %3s %3s %3s %11s %11s %7s %6s %9s %8s %6s %6s %6s %6s %6s %7s\n", "layout", "ranks", "tp",
              "dp", "pp", "tokens/s", "torch tok/s", "ratio", "MFU", "peak MiB", "step ms", "gemm", "attn", "other",
              "on-cpu", "others", "loss");
  std::FILE* json = o.json.empty() ? nullptr : std::fopen(o.json.c_str(), "w");
  if (!o.json.empty() && !json) dml::fail("--json: cannot write ", o.json);
  for (const auto& r : results) {
    if (!r.ran) {
      std::printf("# %s skipped: %s\n", r.l.name.c_str(), r.skipped.c_str());
      continue;
    }
    const int used = r.l.ranks() * o.threads;
    const double roof = (r.l.bf16 && bf16_native ? bf16_roof : f32_roof) * used;
    const double mfu = r.tokens_per_s * flop_per_token / (roof * 1e9);
    const double tr = r.l.bf16 ? -1.0 : torch_rate(used);
    const auto& p = r.profile;
    char ratio[16] = "-", trs[24] = "-", attn[16] = "-", attn_json[16] = "null";
    // Attention's products run inside its tile kernels (untraced: their time is in `other`) unless a layout's
    // attention called the GEMM dispatch at its [T, T] × head_dim shapes.
    if (p.attention_calls > 0) {
      std::snprintf(attn, sizeof attn, "%.1f%%", 100.0 * p.attention / p.step);
      std::snprintf(attn_json, sizeof attn_json, "%.4f", p.attention / p.step);
    }
    if (tr > 0) {
      std::snprintf(ratio, sizeof ratio, "%.2fx", r.tokens_per_s / tr);
      std::snprintf(trs, sizeof trs, "%.1f", tr);
    }
    std::printf("%-8s %5d %3d %3d %3d %11.1f %11s %7s %5.1f%% %9.1f %8.1f %5.1f%% %6s %5.1f%% %5.0f%% %5.0f%% "
                "%7.4f\n",
                r.l.name.c_str(), r.l.ranks(), r.l.tp, r.l.dp, r.l.pp, r.tokens_per_s, trs, ratio, 100.0 * mfu,
                double(r.peak_bytes) / (1 << 20), r.step_ms, 100.0 * p.linear / p.step, attn,
                100.0 * p.other() / p.step, 100.0 * r.on_cpu, 100.0 * r.others, double(r.loss));
    if (json) {
      std::fprintf(json,
                   "{\"arch\":\"%s\",\"layout\":\"%s\",\"cpu\":\"%s\",\"ranks\":%d,\"tp\":%d,\"dp\":%d,\"pp\":%d,\"sequence_parallel\":%s,"
                   "\"precision\":\"%s\",\"threads_per_rank\":%d,\"layers\":%lld,\"d_model\":%lld,\"heads\":%lld,"
                   "\"seq\":%lld,\"batch\":%lld,\"schedule\":\"%s\",\"microbatches\":%lld,\"steps\":%lld,\"tokens_per_s\":%.1f,"
                   "\"step_ms\":%.2f,\"flop_per_token\":%.0f,\"roofline_gflops_per_core\":%.1f,"
                   "\"mfu_vs_gemm_roofline\":%.4f,\"peak_bytes\":%lld,\"state_bytes\":%lld,"
                   "\"linear_gemm_share\":%.4f,\"attention_gemm_share\":%s,\"other_share\":%.4f,"
                   "\"on_cpu_share\":%.3f,\"other_processes_cpu_share\":%.3f",
                   o.arch.c_str(), r.l.name.c_str(), cpu.c_str(), r.l.ranks(), r.l.tp, r.l.dp, r.l.pp, r.l.sp ? "true" : "false",
                   r.l.bf16 ? "bf16" : "fp32", o.threads, static_cast<long long>(L), static_cast<long long>(C),
                   static_cast<long long>(o.heads), static_cast<long long>(T), static_cast<long long>(o.batch),
                   r.l.pp > 1 ? o.schedule.c_str() : "single", static_cast<long long>(r.l.pp > 1 ? o.microbatches : 1),
                   static_cast<long long>(o.steps),
                   r.tokens_per_s, r.step_ms, flop_per_token, roof / used, mfu, static_cast<long long>(r.peak_bytes),
                   static_cast<long long>(r.state_bytes), p.linear / p.step, attn_json, p.other() / p.step,
                   r.on_cpu, r.others);
      if (llama)
        std::fprintf(json, ",\"kv_heads\":%lld,\"ffn_hidden\":%lld", static_cast<long long>(o.kv_heads),
                     static_cast<long long>(o.ffn_hidden));
      if (tr > 0) std::fprintf(json, ",\"torch_tokens_per_s\":%.1f,\"ratio_vs_torch\":%.3f", tr, r.tokens_per_s / tr);
      std::fprintf(json, "}\n");
    }
  }
  if (json) std::fclose(json);
  std::printf("# columns: ratio = dml / PyTorch fp32 with the same threads in all (bf16 rows: none); MFU = tokens/s x "
              "FLOPs per token / (roofline x cores used); gemm, attn, other = rank 0's time in one traced step in "
              "Linear GEMMs, attention GEMMs at [T, T] x head_dim through the GEMM dispatch ('-': none; the tile "
              "attention's products run inside its kernels and count in other), and everything else (attention, %s, "
              "embeddings, loss, AdamW, communication, waiting); on-cpu = CPU time of the rank threads / (wall time x ranks) in the timed steps (below "
              "100%%: waiting for a core or for another rank); others = other processes' share of the machine's CPU "
              "during the layout\n",
              llama ? "RMSNorm, RoPE, SwiGLU" : "LayerNorm, GELU");
  for (const auto& r : results)
    if (r.ran && (r.l.name == "1" || r.l.name == "1-bf16")) {
      const auto& p = r.profile;
      std::printf("# %s: traced step %.1f ms: Linear GEMMs %.1f ms at %.1f GFLOP/s, ", r.l.name.c_str(), 1e3 * p.step,
                  1e3 * p.linear, p.linear > 0 ? p.linear_flop / p.linear / 1e9 : 0.0);
      if (p.attention_calls > 0)
        std::printf("attention GEMMs %.1f ms at %.1f GFLOP/s", 1e3 * p.attention,
                    p.attention > 0 ? p.attention_flop / p.attention / 1e9 : 0.0);
      else
        std::printf("attention in its tile kernels (in other)");
      std::printf(" (%d GEMM calls), other %.1f ms\n", p.calls, 1e3 * p.other());
    }

  // The issues' goals, where the layouts they need ran: nn::gpt's, and nn::llama's one (>= 1.5x PyTorch on one rank).
  const auto find = [&](const char* name) -> const result* {
    for (const auto& r : results)
      if (r.ran && r.l.name == name) return &r;
    return nullptr;
  };
  const result* one = find("1");
  if (one) {
    const double tr = torch_rate(o.threads), want = llama ? 1.5 : 2.0;
    if (tr > 0)
      std::printf("# goal, %sone rank fp32 >= %gx PyTorch: %.2fx: %s\n", llama ? "Llama, " : "", want,
                  one->tokens_per_s / tr, one->tokens_per_s >= want * tr ? "met" : "not met");
    // On a shared machine: both runs' tokens per second of CPU time, which time-sharing affects far less.
    const torch_run t1 = torch_of(o.threads);
    if (o.threads == 1 && tr > 0 && t1.on_cpu > 0 && one->on_cpu > 0)
      std::printf("# per CPU-second of their one thread: dml %.1f, PyTorch %.1f tokens, %.2fx\n",
                  one->tokens_per_s / one->on_cpu, tr / t1.on_cpu, (one->tokens_per_s / one->on_cpu) / (tr / t1.on_cpu));
    const double mfu = one->tokens_per_s * flop_per_token / (f32_roof * o.threads * 1e9);
    if (!llama)
      std::printf("# goal, one rank fp32 >= 60%% of the GEMM roofline: %.1f%%: %s\n", 100.0 * mfu,
                  mfu >= 0.6 ? "met" : "not met");
    if (const result* b = find("1-bf16"); b && !llama) {
      const double ratio = b->tokens_per_s / one->tokens_per_s;
      std::printf("# goal, bf16 faster than fp32%s: %.2fx: %s\n",
                  bf16_native ? " (this CPU has bf16 dot products)" : " (no native bf16 GEMM here: not expected)", ratio,
                  ratio > 1 ? "met" : "not met");
      // What gpt --precision auto would train one rank in: the planner's pick on this host's rates in each precision.
      const auto pick = pick_precision(o);
      const bool bf16 = pick.chosen == dml::cost::precision::bf16;
      std::printf("# goal, --precision auto never slower than fp32: dml::cost picks %s (predicted bf16 %.2fx fp32; "
                  "bf16's products %s here), measured %.2fx fp32: %s\n",
                  bf16 ? "bf16" : "fp32", pick.bf16_speedup, bf16_native ? "on native kernels" : "widened to f32",
                  bf16 ? ratio : 1.0, !bf16 || ratio >= 1 ? "met" : "not met");
    }
    for (const char* name : {"tp2", "tp2-sp"})
      if (const result* t = find(name); t && !llama)
        std::printf("# goal, %s on 2 ranks >= 1.4x one rank: %.2fx: %s\n", name, t->tokens_per_s / one->tokens_per_s,
                    t->tokens_per_s >= 1.4 * one->tokens_per_s ? "met" : "not met");
    if (const result* p = find("pp2"); p && !p->idle.empty()) {
      std::printf("# pp2: idle share of each rank's steps (outside its forward and backward actions)");
      for (const double v : p->idle) std::printf(" %.3f", v);
      std::printf("; the schedule's bubble at forward 1, backward 2: %.3f; mean ms per action:", p->idle_theory);
      for (std::size_t r = 0; r < p->action_ms.size(); ++r) std::printf(" rank %zu: %s;", r, p->action_ms[r].c_str());
      std::printf("\n");
    }
    if (const result* p = find("pp2"); p && !llama)
      std::printf("# goal, pp2 on 2 ranks >= 1.6x one rank (%s, M = %lld, %s): %.2fx: %s\n", o.schedule.c_str(),
                  static_cast<long long>(o.microbatches), o.pp_plan == "given" ? "given" : "the planner's pick",
                  p->tokens_per_s / one->tokens_per_s, p->tokens_per_s >= 1.6 * one->tokens_per_s ? "met" : "not met");
  }
  std::printf("# load average %s at the end\n", load_average().c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "gpt_throughput: error: %s\n", e.what());
  return 1;
}
