// SPDX-License-Identifier: Apache-2.0
// benchmarks/plan_accuracy.cpp — dml::cost's predicted step time against measured steps of nn::gpt on comm::local,
// after calibrating this host (GEMM, memcpy, AdamW and GPT-block probes) in the same run. Prints predicted, measured and their ratio
// per layout (the median of the timed steps, taken in rounds that go round the layouts); asserts nothing (timing on a
// shared machine is noisy).
#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "dml/nn/gpt.hpp"
#include "dml/plan/calibrate.hpp"
#include "dml/plan/cost.hpp"

namespace {

using namespace dml;

// Rank 0's timed steps: each step's seconds, the seconds its traced GEMMs took in it, and the seconds inside its
// schedule's forward and backward actions (the trainer's compute events).
struct measured {
  std::vector<double> step, gemm, actions;
};
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// Trains layout l for a warm step and `steps` timed ones, and adds rank 0's timings to `into`.
void measure(const nn::gpt_config& g, const cost::layout& l, std::int64_t batch, int steps, measured& into) {
  const auto model = nn::gpt(g);
  comm::local::run(l.devices(), [&](comm::local& c) {
    train::trainer_options o;
    o.tensor_parallel = l.tp;
    o.sequence_parallel = l.sp;
    o.pipeline_stages = l.pp;
    o.expert_parallel = l.ep;
    o.context_parallel = l.cp;
    o.micro_batches = l.micro_batches;
    o.record_events = true;
    if (l.pp > 1) o.schedule = l.schedule;
    trainer<parallel::replicate, optim::adamw> t(c, model, o);
    const std::int64_t rows = batch / (l.dp / l.cp);
    // A data group's rows: the ranks of a tensor or context group pass the same ones.
    const auto data_rank = static_cast<std::size_t>(c.rank() / l.tp % l.dp / l.cp);
    std::vector<float> x(static_cast<std::size_t>(rows * g.seq));
    std::vector<std::int32_t> y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      x[i] = static_cast<float>((i * 7 + data_rank) % static_cast<std::size_t>(g.vocab));
      y[i] = static_cast<std::int32_t>((i * 5) % static_cast<std::size_t>(g.vocab));
    }
    auto step = [&] { t.step(tensor_view<const float>(x.data(), {rows, g.seq}), y.data(), batch); };
    step();  // warm
    c.barrier();
    std::vector<double> each, gemm, actions;
    std::vector<gemm_call> calls;
    for (int s = 0; s < steps; ++s) {
      const std::size_t seen = t.events().size();
      calls.clear();
      dml::detail::host_gemm_trace = &calls;
      const auto t0 = dml_bench::clock_type::now();
      step();
      each.push_back(dml_bench::seconds_since(t0));
      dml::detail::host_gemm_trace = nullptr;
      double g = 0;
      for (const auto& call : calls) g += call.seconds;
      gemm.push_back(g);
      double inside = 0, opened = 0;
      for (std::size_t i = seen; i < t.events().size(); ++i) {
        const auto& e = t.events()[i];
        if (e.kind == parallel::event_kind::compute_begin) opened = e.t;
        if (e.kind == parallel::event_kind::compute_end) inside += e.t - opened;
      }
      actions.push_back(inside);
    }
    c.barrier();
    if (c.rank() == 0) {
      into.step.insert(into.step.end(), each.begin(), each.end());
      into.gemm.insert(into.gemm.end(), gemm.begin(), gemm.end());
      into.actions.insert(into.actions.end(), actions.begin(), actions.end());
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 5, rounds = 3;
  std::int64_t batch = 8;
  bool quick = false;
  std::string only;
  dml::flags cli("plan_accuracy", "Predicted (dml::cost, calibrated here) against measured step time of a small GPT.");
  cli.add("--steps", steps, "N", "timed steps per layout in each round").min(1);
  cli.add("--rounds", rounds, "R", "rounds, each timing every layout in turn").min(1);
  cli.add("--batch", batch, "B", "global batch (sequences)").min(2);
  cli.add("--only", only, "TEXT", "only the layouts whose name (\"moe dp=2,...\") contains TEXT");
  cli.add_switch("--quick", quick, "one round of one timed step, the first two layouts");
  if (const auto status = dml_bench::parse_for_main(cli, argc, argv)) return *status;
  if (quick) steps = rounds = 1;
  const nn::gpt_config g{.vocab = 256, .seq = 128, .layers = 2, .d_model = 256, .heads = 4};
  const cost::model m{.layers = g.layers, .d_model = g.d_model, .heads = g.heads, .seq = g.seq, .vocab = g.vocab};
  // The same GPT with a mixture of 4 experts (top 2) in place of each block's MLP.
  nn::gpt_config g_moe = g;
  g_moe.experts = 4;
  cost::model m_moe = m;
  m_moe.experts = g_moe.experts;
  m_moe.top_k = g_moe.top_k;
  const cost::training t{.global_batch = batch, .prec = cost::precision::fp32, .optimizer = "adamw"};

  struct run_case {
    const nn::gpt_config* g;
    const cost::model* m;
    cost::layout l;
  };
  const auto start = dml_bench::load_meter::now();
  std::vector<run_case> cases;
  for (const char* l : {"dp=1,schedule=single", "dp=2,schedule=single", "dp=1,mb=4,schedule=single",
                        "tp=2,sp=1,schedule=single", "pp=2,mb=2,schedule=1f1b", "pp=2,mb=4,schedule=1f1b",
                        "pp=2,mb=8,schedule=1f1b", "pp=2,mb=4,schedule=zb", "pp=2,mb=8,schedule=zb",
                        "dp=2,cp=2,schedule=single"})
    cases.push_back({&g, &m, cost::parse_layout(l)});
  for (const char* l : {"dp=1,schedule=single", "dp=2,schedule=single", "dp=2,ep=2,schedule=single"})
    cases.push_back({&g_moe, &m_moe, cost::parse_layout(l)});
  const auto name = [](const run_case& k) { return (k.m->experts > 0 ? "moe " : "") + cost::to_string(k.l); };
  std::erase_if(cases, [&](const run_case& k) { return name(k).find(only) == std::string::npos; });
  if (quick && cases.size() > 2) cases.resize(2);
  std::printf("# %s; GPT 2 layers, d_model 256, 4 heads, seq 128, vocabulary 256, global batch %lld, fp32 AdamW; "
              "moe: 4 experts (top 2, capacity factor 1.25) in each block\n",
              dml::host_cpu_model().c_str(), static_cast<long long>(batch));
  // Ranks are threads sharing this host, each with its share of the cores (comm::local's thread budget):
  // calibrated once per rank count, as one of them, at the model's widths.
  std::map<int, cost::cluster> clusters;
  for (const auto& k : cases) {
    const auto& l = k.l;
    if (clusters.contains(l.devices())) continue;
    const auto& c = clusters[l.devices()] = cost::calibrate_gpt_rank_of(l.devices(), g.d_model, g.heads, g.seq, g.vocab);
    std::printf("# one of %d rank(s): fp32 GEMM %.1f GFLOP/s, %s %.1f GB/s (%.2f us per ring step; all-gathers and "
                "reduce-scatters %.1f GB/s), AdamW update %.1f GB/s, a block's element-wise passes %.1f GB/s of its "
                "activations and %.3f ms per block per micro-batch; share of the fp32 rate at",
                l.devices(), c.flops_fp32 / 1e9, l.devices() > 1 ? "collectives" : "memcpy", c.intra_bandwidth / 1e9,
                c.intra_latency * 1e6, (c.intra_gather_bandwidth > 0 ? c.intra_gather_bandwidth : c.intra_bandwidth) / 1e9,
                c.memory_bandwidth / 1e9, c.elementwise_bandwidth / 1e9, c.block_seconds * 1e3);
    for (const auto& [rows, share] : c.gemm_rows) std::printf(" %g rows %.2f,", rows, share);
    std::printf("\n");
  }
  std::printf("%-76s %12s %12s %8s %10s %10s %10s %10s %10s %10s\n", "layout", "predicted_s", "measured_s", "ratio",
              "gemm_pred", "gemm_meas", "ew_pred", "ew_meas", "out_pred", "out_meas");
  std::vector<cost::estimate> predicted;
  for (const auto& k : cases) predicted.push_back(cost::evaluate(*k.m, k.l, t, clusters.at(k.l.devices()), k.l.devices()));
  const auto refused = [&](std::size_t i) { return !predicted[i].why.empty() && !predicted[i].fits; };
  // The layouts measured in turn, `rounds` times: a slow spell of a shared host then lengthens a few steps of
  // several layouts rather than every step of one, and the median over the rounds sets it aside.
  std::vector<measured> got(cases.size());
  for (int r = 0; r < rounds; ++r)
    for (std::size_t i = 0; i < cases.size(); ++i)
      if (!refused(i)) measure(*cases[i].g, cases[i].l, batch, steps, got[i]);
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const auto& e = predicted[i];
    if (refused(i)) {
      std::printf("%-76s refused: %s\n", name(cases[i]).c_str(), e.why.c_str());
      continue;
    }
    const double step = median(got[i].step), gemm = median(got[i].gemm), actions = median(got[i].actions);
    const double in_actions = e.time.elementwise + e.time.tp + e.time.ep + e.time.cp;  // inside the layers' calls
    std::printf("%-76s %12.4g %12.4g %8.2f %10.4g %10.4g %10.4g %10.4g %10.4g %10.4g\n", name(cases[i]).c_str(), e.step_seconds,
                step, step / e.step_seconds, e.time.compute, gemm, in_actions, actions - gemm,
                e.step_seconds - e.time.compute - in_actions, step - actions);
  }
  std::printf("other processes used %.0f%% of the machine meanwhile\n", 100 * dml_bench::load_meter::others_since(start));
  return 0;
}
