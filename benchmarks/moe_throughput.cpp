// SPDX-License-Identifier: Apache-2.0
// benchmarks/moe_throughput.cpp — expert and context parallelism measured: tokens/s of a mixture-of-experts GPT
// against ep (each rank the same batch, so ep ranks train ep times the tokens), the all_to_allv bus bandwidth of the
// same run's dispatch and combine beside comm::local's all_reduce, and attention activation memory per rank under
// ring attention (cp = 1, 2, 4) beside full attention; fine-grained experts (DeepSeek-V3's kind: 16 of width d/2,
// top-4 and a shared one, ep 4) against the dense model in FLOP/s of active work, and loss-free balancing against the
// auxiliary loss on a skewed router. Prints tables; --json FILE writes one line per result.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "dml/comm/local.hpp"
#include "dml/nn/gpt.hpp"
#include "dml/plan/cost.hpp"
#include "dml/train/text.hpp"

namespace {

using namespace dml;
using dml_bench::clock_type, dml_bench::seconds_since;

struct options {
  std::int64_t experts = 8, d_model = 256, heads = 4, layers = 2, seq = 64, batch = 8;  // batch: sequences per rank
  int top_k = 2, steps = 6, warmup = 2, max_ep = 2;
  float capacity_factor = 1.25f;
  std::vector<float> skews{0.f};  // router skew (nn::skewed_logit_bias scale): imbalance on purpose
  std::int64_t attention_seq = 512;
  // Fine-grained experts and loss-free balancing.
  std::vector<int> fine_ranks{1, 2, 4};  // the issue's layout is 4 ranks, ep 4: on 2 cores they take turns
  int balance_ranks = 2, balance_steps = 200;
  float bias_rate = 0.005f, balance_skew = 2.f;
  std::string json;
  bool quick = false;
};

// The model every ep runs: every block's MLP a mixture of experts.
nn::gpt_config model(const options& o) {
  nn::gpt_config g{.vocab = 256, .seq = std::max(o.seq, o.attention_seq), .layers = o.layers, .d_model = o.d_model,
                   .heads = o.heads};
  g.experts = o.experts;
  g.top_k = o.top_k;
  g.capacity_factor = o.capacity_factor;
  g.moe_every = 1;
  return g;
}
nn::gpt_config model(const options& o, float skew) {
  auto g = model(o);
  g.router_skew = skew;
  return g;
}

const train::text_corpus& corpus() {
  static const train::text_corpus text = [] {
    std::vector<std::uint8_t> bytes(1 << 16);
    const rng_stream rng{7, 3};
    for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::uint8_t>(rng.block(i)[0] % 256);
    return train::text_corpus(bytes);
  }();
  return text;
}

struct moe_run {
  int ep = 1;
  double tokens_per_s = 0, a2a_seconds = 0, a2a_bytes = 0, imbalance = 0;
  double dropped_fraction = 0;
};

// ep ranks, each with o.batch sequences (expert-parallel over all of them); timed steps after warm-up.
moe_run run_moe(const options& o, int ep, float skew) {
  moe_run out;
  out.ep = ep;
  comm::local::run(ep, [&](comm::local& c) {
    set_thread_budget(1);
    train::trainer_options to;
    to.seed = 5;
    to.expert_parallel = ep;
    trainer<parallel::replicate, optim::adamw> t(c, nn::gpt(model(o, skew)), to, optim::adamw({.lr = 1e-3f}));
    std::vector<float> x(static_cast<std::size_t>(o.batch * o.seq));
    std::vector<std::int32_t> y(x.size());
    clock_type::time_point t0{};
    std::int64_t bytes = 0, tokens = 0, dropped = 0;
    double imbalance = 0;
    for (int s = 0; s < o.warmup + o.steps; ++s) {
      if (s == o.warmup) {
        c.barrier();
        t0 = clock_type::now();
      }
      corpus().batch(1, static_cast<std::uint64_t>(s), o.batch * c.rank(), o.batch, o.seq, x.data(), y.data());
      const auto r = t.step(tensor_view<const float>(x.data(), {o.batch, o.seq}), y.data(), o.batch * ep);
      if (s >= o.warmup) {
        bytes += r.routing.a2a_bytes;
        imbalance += r.routing.imbalance() / o.steps;
        for (std::size_t e = 0; e < r.routing.tokens.size(); ++e) tokens += r.routing.tokens[e], dropped += r.routing.dropped[e];
      }
    }
    c.barrier();
    const double secs = seconds_since(t0);
    if (c.rank() == 0) {
      out.tokens_per_s = double(o.steps * o.batch * o.seq * ep) / secs;
      out.a2a_bytes = double(bytes) / o.steps;
      out.imbalance = imbalance;
      out.dropped_fraction = tokens > 0 ? double(dropped) / double(tokens) : 0;
    }
  });
  return out;
}

// Fine-grained experts as DeepSeek-V3 has them: 16 of width d/2, top-4, one shared of d/2 (5·d/2 of active width per
// token, where the dense MLP has 4·d), sigmoid scores, dropless; and the dense model beside them.
nn::gpt_config fine_model(const options& o) {
  auto g = model(o);
  g.experts = 16, g.top_k = 4, g.expert_ffn = o.d_model / 2, g.shared_experts = 1, g.sigmoid_router = true;
  g.capacity_factor = 0.f;
  return g;
}
nn::gpt_config dense_model(const options& o) {
  auto g = model(o);
  g.experts = 0;
  return g;
}
// The planner's model of a GPT config: its forward FLOPs per token (active: the chosen experts and the shared one).
cost::model cost_model(const nn::gpt_config& g, std::int64_t seq) {
  return {.layers = g.layers, .d_model = g.d_model, .heads = g.heads, .seq = seq, .vocab = g.vocab, .experts = g.experts,
          .top_k = g.top_k, .moe_every = g.moe_every, .capacity_factor = g.capacity_factor, .expert_ffn = g.expert_ffn,
          .shared_experts = g.shared_experts};
}

struct fine_run {
  double tokens_per_s = 0, flops_per_s = 0, imbalance = 0;
};
// `ranks` ranks (ep = ranks with experts, data-parallel without), o.batch sequences each, timed after warm-up;
// imbalance: the most uneven layer's max/mean of its tokens over the last `tail` steps (steps run: warm-up + steps).
fine_run run_fine(const options& o, const nn::gpt_config& g, int ranks, int steps, int tail) {
  fine_run out;
  comm::local::run(ranks, [&](comm::local& c) {
    set_thread_budget(1);
    train::trainer_options to;
    to.seed = 5;
    to.expert_parallel = g.experts > 0 ? ranks : 1;
    trainer<parallel::replicate, optim::adamw> t(c, nn::gpt(g), to, optim::adamw({.lr = 1e-3f}));
    std::vector<float> x(static_cast<std::size_t>(o.batch * o.seq));
    std::vector<std::int32_t> y(x.size());
    clock_type::time_point t0{};
    std::vector<std::vector<std::int64_t>> load;  // per layer: tokens per expert over the last `tail` steps
    for (int s = 0; s < o.warmup + steps; ++s) {
      if (s == o.warmup) {
        c.barrier();
        t0 = clock_type::now();
      }
      corpus().batch(1, static_cast<std::uint64_t>(s), o.batch * c.rank(), o.batch, o.seq, x.data(), y.data());
      const auto r = t.step(tensor_view<const float>(x.data(), {o.batch, o.seq}), y.data(), o.batch * ranks);
      if (s >= o.warmup + steps - tail) {
        load.resize(r.routing.layer_tokens.size());
        for (std::size_t l = 0; l < load.size(); ++l) {
          load[l].resize(r.routing.layer_tokens[l].size(), 0);
          for (std::size_t e = 0; e < load[l].size(); ++e) load[l][e] += r.routing.layer_tokens[l][e];
        }
      }
    }
    c.barrier();
    const double secs = seconds_since(t0);
    if (c.rank() == 0) {
      out.tokens_per_s = double(steps * o.batch * o.seq * ranks) / secs;
      out.flops_per_s = out.tokens_per_s * 3 * cost::gpt_forward_flops_per_token(cost_model(g, o.seq));
      out.imbalance = parallel::worst_imbalance(load);
    }
  });
  return out;
}

// all_to_allv of `bytes` per rank (equal blocks) and all_reduce of the same bytes on n local ranks: busbw each.
std::pair<double, double> collective_busbw(int n, std::int64_t bytes) {
  double a2a = 0, ar = 0;
  comm::local::run(n, [&](comm::local& c) {
    const std::size_t count = static_cast<std::size_t>(bytes / 4);
    std::vector<float> send(count, 1.f), recv(count);
    std::vector<std::size_t> counts(static_cast<std::size_t>(n), count / static_cast<std::size_t>(n));
    const std::size_t used = counts[0] * static_cast<std::size_t>(n);
    auto time = [&](auto&& op) {
      for (int i = 0; i < 3; ++i) op();
      c.barrier();
      const auto t0 = clock_type::now();
      const int reps = 20;
      for (int i = 0; i < reps; ++i) op();
      c.barrier();
      return seconds_since(t0) / reps;
    };
    const double t_a2a = time([&] {
      c.all_to_allv(std::span<const float>(send.data(), used), std::span<const std::size_t>(counts),
                    std::span<float>(recv.data(), used), std::span<const std::size_t>(counts));
    });
    const double t_ar = time([&] { c.all_reduce(std::span<float>(send.data(), used), comm::reduce_op::sum); });
    if (c.rank() == 0) {
      const double s = double(used * 4);
      a2a = comm::bus_factor(comm::collective::all_to_all, n) * s / t_a2a / 1e9;
      ar = comm::bus_factor(comm::collective::all_reduce, n) * s / t_ar / 1e9;
    }
  });
  return {a2a, ar};
}

// Attention activation bytes per rank of one block: what ring attention keeps from forward for backward (q, k, v,
// the output and a log-sum-exp per row: the rank's chunk of each), the scratch it needs while it runs, and the
// trainer's measured activation peak of a one-block GPT; beside them full attention on one rank, which keeps the
// T×T probabilities of every head.
struct memory_row {
  int cp = 1;
  double saved = 0, scratch = 0, full = 0;
  std::int64_t measured_peak = 0;
};
memory_row attention_memory(const options& o, int cp) {
  memory_row m;
  m.cp = cp;
  const std::int64_t b = 1, h = o.heads, hd = o.d_model / o.heads, t = o.attention_seq;
  const nn::attention_shape full{.batch = b, .seq = t, .heads = h, .head_dim = hd};
  const nn::ring_attention_shape ring{.batch = b, .seq = t, .heads = h, .head_dim = hd, .causal = true};
  const nn::cp_layout at{.ranks = cp, .rank = 0, .zigzag = true};
  m.saved = double(4 * b * (t / cp) * h * hd) * 4 + double(nn::ring_attention_saved_size(ring, at)) * 4;
  m.scratch = double(nn::ring_attention_workspace_size(ring, at)) * 4;
  m.full = double(4 * b * t * h * hd) * 4 + double(nn::attention_saved_size(full)) * 4;
  // The whole model's activation peak in the trainer (dense MLPs: attention is what cp changes).
  comm::local::run(cp, [&](comm::local& c) {
    set_thread_budget(1);
    auto g = model(o);
    g.experts = 0;
    g.layers = 1;
    train::trainer_options to;
    to.context_parallel = cp;
    trainer<parallel::replicate, optim::adamw> tr(c, nn::gpt(g), to);
    std::vector<float> x(static_cast<std::size_t>(t));
    std::vector<std::int32_t> y(x.size());
    corpus().batch(1, 1, 0, 1, t, x.data(), y.data());
    tr.step(tensor_view<const float>(x.data(), {1, t}), y.data(), 1);
    if (c.rank() == 0) m.measured_peak = tr.peak_activation_bytes();
  });
  return m;
}

// The command line (dml/train/flags.hpp).
dml::flags command_line(options& o) {
  dml::flags f("moe_throughput", "Tokens/s of a mixture-of-experts GPT against ep, all_to_allv beside all_reduce, "
                                 "and ring attention's memory beside full attention.");
  f.add("--experts", o.experts, "E", "experts in every MLP").min(1);
  f.add("--d-model", o.d_model, "N", "model width").min(1);
  f.add("--layers", o.layers, "N", "transformer blocks").min(1);
  f.add("--seq", o.seq, "N", "tokens per sequence").min(1);
  f.add("--batch", o.batch, "N", "sequences per rank").min(1);
  f.add("--top-k", o.top_k, "K", "experts per token").min(1);
  f.add("--steps", o.steps, "N", "timed steps").min(1);
  f.add("--max-ep", o.max_ep, "N", "the largest expert-parallel degree").min(1);
  f.add("--attention-seq", o.attention_seq, "N", "sequence of the ring-attention part").min(1);
  f.add("--capacity-factor", o.capacity_factor, "C", "expert capacity factor; <= 0: dropless");
  f.add("--skew", o.skews, "S,S", "router skews (imbalance on purpose)");
  f.add("--fine-ranks", o.fine_ranks, "N,N", "ranks (and ep) of the fine-grained experts' part").min(1);
  f.add("--balance-ranks", o.balance_ranks, "N", "ranks (and ep) of the balancing part").min(1);
  f.add("--balance-steps", o.balance_steps, "N", "steps of the balancing part").min(20);
  f.add("--bias-rate", o.bias_rate, "R", "loss-free balancing's bias step").min(0.f);
  f.add("--balance-skew", o.balance_skew, "S", "the balancing part's router skew").min(0.f);
  f.add("--json", o.json, "FILE", "write one JSON object per result");
  f.add_switch("--quick", o.quick, "a smoke run: every part, tiny");
  return f;
}

void check_across(options& o) {
  if (o.quick) {  // a smoke run: every part, tiny
    o.experts = 4, o.d_model = 32, o.layers = 1, o.seq = 16, o.batch = 2, o.steps = 1, o.warmup = 1, o.attention_seq = 32;
    o.skews = {0.f, 4.f};
    o.fine_ranks = {2}, o.balance_ranks = 2, o.balance_steps = 20;
  }
}

}  // namespace

int main(int argc, char** argv) try {
  options o;
  auto cli = command_line(o);
  if (const auto status = dml_bench::parse_for_main(cli, argc, argv, [&] { check_across(o); })) return *status;
  std::FILE* json = o.json.empty() ? nullptr : std::fopen(o.json.c_str(), "w");
  if (!o.json.empty() && !json) dml::fail("--json: cannot write ", o.json);
  std::printf("# moe_throughput on %s, %d hardware threads; 1 thread per rank\n", dml::host_cpu_model().c_str(),
              static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)));
  std::printf("# gpt: %lld layers, every MLP %lld experts (top-%d, capacity factor %g), d_model %lld, seq %lld, "
              "%lld sequences per rank\n",
              static_cast<long long>(o.layers), static_cast<long long>(o.experts), o.top_k,
              static_cast<double>(o.capacity_factor), static_cast<long long>(o.d_model), static_cast<long long>(o.seq),
              static_cast<long long>(o.batch));
  std::printf("%5s %4s %12s %9s %14s %12s %12s %10s %9s\n", "skew", "ep", "tokens/s", "vs ep 1", "a2a bytes/step",
              "a2a busbw", "allred busbw", "imbalance", "dropped");
  for (const float skew : o.skews) {
    double base = 0;
    for (int ep = 1; ep <= o.max_ep; ep *= 2) {
      const auto r = run_moe(o, ep, skew);
      if (ep == 1) base = r.tokens_per_s;
      // The bus bandwidth of all_to_allv at this run's message size per rank, beside all_reduce of the same bytes.
      const std::int64_t msg = std::max<std::int64_t>(4096, static_cast<std::int64_t>(r.a2a_bytes / (4 * o.layers)));
      const auto [a2a, ar] = ep > 1 ? collective_busbw(ep, msg) : std::pair<double, double>{0, 0};
      std::printf("%5g %4d %12.0f %8.2fx %14.0f %9.2f GB/s %9.2f GB/s %10.2f %8.1f%%\n", static_cast<double>(skew), ep,
                  r.tokens_per_s, r.tokens_per_s / base, r.a2a_bytes, a2a, ar, r.imbalance, 100 * r.dropped_fraction);
      if (json)
        std::fprintf(json,
                     "{\"part\":\"ep\",\"cpu\":\"%s\",\"skew\":%g,\"ep\":%d,\"experts\":%lld,\"d_model\":%lld,\"top_k\":%d,"
                     "\"tokens_per_s\":%.1f,\"speedup_vs_ep1\":%.3f,\"a2a_bytes_per_step\":%.0f,\"a2a_busbw_gbs\":%.3f,"
                     "\"all_reduce_busbw_gbs\":%.3f,\"imbalance\":%.3f,\"dropped_fraction\":%.4f}\n",
                     dml::host_cpu_model().c_str(), static_cast<double>(skew), ep, static_cast<long long>(o.experts),
                     static_cast<long long>(o.d_model), o.top_k, r.tokens_per_s, r.tokens_per_s / base, r.a2a_bytes, a2a, ar, r.imbalance, r.dropped_fraction);
    }
  }
  std::printf("\n# attention activations per rank, one block, batch 1, seq %lld, %lld heads\n",
              static_cast<long long>(o.attention_seq), static_cast<long long>(o.heads));
  std::printf("%4s %14s %9s %15s %19s %9s\n", "cp", "saved (ring)", "vs cp 1", "scratch (ring)", "trainer peak (gpt)",
              "vs cp 1");
  memory_row first;
  for (int cp : {1, 2, 4}) {
    const auto m = attention_memory(o, cp);
    if (cp == 1) first = m;
    std::printf("%4d %14.0f %8.1f%% %15.0f %19lld %8.1f%%\n", cp, m.saved, 100 * m.saved / first.saved, m.scratch,
                static_cast<long long>(m.measured_peak), 100.0 * double(m.measured_peak) / double(first.measured_peak));
    if (json)
      std::fprintf(json,
                   "{\"part\":\"cp\",\"cp\":%d,\"seq\":%lld,\"ring_saved_bytes\":%.0f,\"saved_ratio_vs_cp1\":%.4f,"
                   "\"ring_scratch_bytes\":%.0f,\"full_attention_saved_bytes\":%.0f,\"trainer_peak_activation_bytes\":%lld,"
                   "\"peak_ratio_vs_cp1\":%.4f}\n",
                   cp, static_cast<long long>(o.attention_seq), m.saved, m.saved / first.saved, m.scratch, m.full,
                   static_cast<long long>(m.measured_peak), double(m.measured_peak) / double(first.measured_peak));
  }
  std::printf("full attention on one rank keeps %.0f bytes (the T×T probabilities of every head)\n", first.full);

  // Fine-grained experts against the dense model, in FLOP/s of the work each token does (cost::gpt_forward_flops_per_token).
  const auto fine = fine_model(o), dense = dense_model(o);
  std::printf("\n# fine-grained experts: %lld of width %lld, top-%d + %lld shared, sigmoid, dropless, ep = ranks; the dense "
              "GPT (MLP 4·d) on as many data-parallel ranks; %d hardware threads\n",
              static_cast<long long>(fine.experts), static_cast<long long>(fine.expert_ffn), fine.top_k,
              static_cast<long long>(fine.shared_experts), static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)));
  std::printf("%5s %14s %14s %17s %17s %9s\n", "ranks", "dense tok/s", "moe tok/s", "dense GFLOP/s", "moe active GFLOP/s",
              "moe/dense");
  for (const int r : o.fine_ranks) {
    const auto fr = run_fine(o, fine, r, o.steps, 1), dr = run_fine(o, dense, r, o.steps, 1);
    std::printf("%5d %14.0f %14.0f %17.2f %17.2f %8.2fx\n", r, dr.tokens_per_s, fr.tokens_per_s, dr.flops_per_s / 1e9,
                fr.flops_per_s / 1e9, fr.flops_per_s / dr.flops_per_s);
    if (json)
      std::fprintf(json,
                   "{\"part\":\"fine\",\"cpu\":\"%s\",\"ranks\":%d,\"moe_tokens_per_s\":%.1f,\"dense_tokens_per_s\":%.1f,"
                   "\"moe_active_flops_per_s\":%.4g,\"dense_flops_per_s\":%.4g,\"ratio\":%.3f}\n",
                   dml::host_cpu_model().c_str(), r, fr.tokens_per_s, dr.tokens_per_s, fr.flops_per_s, dr.flops_per_s,
                   fr.flops_per_s / dr.flops_per_s);
  }
  const int r = o.balance_ranks;

  // Loss-free balancing against the auxiliary loss, on a router skewed toward low experts.
  const int tail = std::min(20, o.balance_steps);
  auto skewed = fine;
  skewed.router_skew = o.balance_skew;
  const auto aux = run_fine(o, skewed, r, o.balance_steps, tail);
  skewed.aux_loss_weight = 0.f;
  const auto none = run_fine(o, skewed, r, o.balance_steps, tail);
  skewed.router_bias_rate = o.bias_rate;
  const auto free = run_fine(o, skewed, r, o.balance_steps, tail);
  std::printf("\n# balance: router skew %g, %d steps on %d ranks (ep %d); the most uneven layer's busiest expert over its "
              "mean, tokens of the last %d steps\n",
              static_cast<double>(o.balance_skew), o.balance_steps, r, r, tail);
  std::printf("%-34s %12s\n", "balancing", "max/mean");
  std::printf("%-34s %12.3f\n", "none", none.imbalance);
  std::printf("%-34s %12.3f\n", "auxiliary loss (weight 0.01)", aux.imbalance);
  char label[64];
  std::snprintf(label, sizeof label, "router bias (rate %g, no aux loss)", static_cast<double>(o.bias_rate));
  std::printf("%-34s %12.3f\n", label, free.imbalance);
  if (json)
    std::fprintf(json,
                 "{\"part\":\"balance\",\"steps\":%d,\"skew\":%g,\"bias_rate\":%g,\"none_imbalance\":%.4f,"
                 "\"aux_loss_imbalance\":%.4f,\"bias_imbalance\":%.4f}\n",
                 o.balance_steps, static_cast<double>(o.balance_skew), static_cast<double>(o.bias_rate), none.imbalance,
                 aux.imbalance, free.imbalance);
  if (json) std::fclose(json);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "moe_throughput: error: %s\n", e.what());
  return 1;
}
