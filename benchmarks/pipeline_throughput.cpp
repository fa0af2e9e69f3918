// SPDX-License-Identifier: Apache-2.0
// benchmarks/pipeline_throughput.cpp — training samples/s of an MLP under pipeline parallelism (GPipe, 1F1B,
// interleaved, zero-bubble) on comm::local ranks, the bubble measured from the trainer's event log beside the
// schedule's own (simulated and closed-form) bubble, and one rank's samples/s on the same model and global
// batch from the same run. The micro-batch count is the planner's unless given (dml::cost::rank_pipelines on this
// host's calibrated rates), and each row prints the step the planner predicts beside the measured one.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "dml/dml.hpp"
#include "dml/plan/calibrate.hpp"
#include "dml/plan/exact.hpp"

#include "bench_common.hpp"

namespace {

struct options {
  std::vector<std::int64_t> hidden{1024, 1024, 1024};
  std::int64_t batch = 256;  // global batch: rows per step over all data-parallel ranks
  std::int64_t steps = 30, warmup = 5;
  int repeats = 3;  // runs per configuration; the fastest is kept
  int pp = 2, dp = 1;
  std::int64_t microbatches = 0;  // 0: the planner's pick
  std::vector<std::int64_t> micro_rows;  // each micro-batch's rows; empty: equal (or the planner's split, with M = 0)
  std::vector<std::string> schedules{"gpipe", "1f1b", "interleaved:2", "zb"};
  std::vector<std::size_t> cuts;
  bool recompute = false, json = false;
};

using dml_bench::clock_type;
using dml_bench::load_meter;
using dml_bench::seconds_since;
using dml_bench::synthetic_batch;

// What one rank saw in each measured step.
struct rank_figures {
  // Per step: its seconds (from the rank's previous step_end to this one), the seconds inside forward
  // and backward actions (Σ compute_end − compute_begin), and the tail after the last of them
  // (gradient reduction, loss all-reduce, optimizer update, and waiting for the other stages).
  std::vector<double> step, compute, tail;
  // Mean seconds of one action per kind (forward, backward, backward_input, backward_weight); 0: none ran.
  std::array<double, 4> mean_action{};
  std::int64_t peak_activation_bytes = 0, peak_in_flight = 0;
  double idle = 0;  // dml::parallel::bubble over the same steps: 1 − Σ compute / Σ step
  static double sum(const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return s;
  }
};

struct result {
  std::string schedule;
  int pp = 1, dp = 1;
  std::int64_t microbatches = 1;
  double samples_per_s = 0;
  double others = -1;  // share of the machine's CPU time other processes used during this run; −1: unknown
  std::vector<rank_figures> ranks;  // world rank order
  dml::schedule::table table;
  // Mean over ranks of idle / step time.
  double bubble_measured() const {
    double s = 0;
    for (const auto& r : ranks) s += r.idle;
    return ranks.empty() ? 0.0 : s / double(ranks.size());
  }
  // The same over the span that schedule::simulate models: each step less the shortest tail over ranks
  // (what the rank that computes last spends after its last action: reduction, loss all-reduce, update).
  double bubble_in_schedule() const {
    if (ranks.empty() || ranks[0].step.empty()) return 0.0;
    const std::size_t steps = ranks[0].step.size();
    std::vector<double> tail(steps, 1e300);
    for (const auto& r : ranks)
      for (std::size_t s = 0; s < steps && s < r.tail.size(); ++s) tail[s] = std::min(tail[s], r.tail[s]);
    double b = 0;
    for (const auto& r : ranks) {
      double span = 0, compute = 0;
      for (std::size_t s = 0; s < steps && s < r.step.size(); ++s) {
        span += r.step[s] - tail[s];
        compute += r.compute[s];
      }
      b += span > 0 ? 1.0 - compute / span : 0.0;
    }
    return b / double(ranks.size());
  }
  std::int64_t peak_activation_bytes() const {
    std::int64_t p = 0;
    for (const auto& r : ranks) p = std::max(p, r.peak_activation_bytes);
    return p;
  }
  std::int64_t peak_in_flight() const {
    std::int64_t p = 0;
    for (const auto& r : ranks) p = std::max(p, r.peak_in_flight);
    return p;
  }
  double step_ms() const {
    double s = 0;
    for (const auto& r : ranks) s += rank_figures::sum(r.step) / double(std::max<std::size_t>(r.step.size(), 1));
    return ranks.empty() ? 0.0 : 1e3 * s / double(ranks.size());
  }
};

// Reads a rank's event log over steps warmup + 2 ... warmup + steps (the first timed step follows a
// barrier and is left out). The k-th compute action of a step has the kind of the k-th compute action of
// this rank's list (dml_bench::compute_kinds).
rank_figures read_events(const std::vector<dml::parallel::event>& log,
                         const std::vector<dml::schedule::action>& plan, std::int64_t warmup, std::int64_t steps) {
  using dml::parallel::event_kind;
  rank_figures f;
  std::int64_t ended = 0;
  double step_start = -1, begun = -1, compute = 0, last_end = 0;
  const auto kinds = dml_bench::compute_kinds(plan);
  std::size_t next = 0;  // the step's compute actions so far
  std::array<double, 4> sum{};
  std::array<std::int64_t, 4> count{};
  for (const auto& e : log) {
    if (e.kind == event_kind::step_end) {
      ++ended;
      if (ended > warmup + 1 && ended <= warmup + steps) {
        f.step.push_back(e.t - step_start);
        f.compute.push_back(compute);
        f.tail.push_back(e.t - last_end);
      }
      step_start = last_end = e.t;
      compute = 0;
      next = 0;
      continue;
    }
    if (e.kind == event_kind::compute_end && next < kinds.size()) ++next;
    if (ended < warmup + 1 || ended >= warmup + steps) continue;
    if (e.kind == event_kind::compute_begin) {
      begun = e.t;
    } else if (e.kind == event_kind::compute_end && begun >= 0) {
      compute += e.t - begun;
      last_end = e.t;
      if (next >= 1) {
        const auto k = static_cast<std::size_t>(kinds[next - 1]);
        if (k < sum.size()) {
          sum[k] += e.t - begun;
          ++count[k];
        }
      }
      begun = -1;
    }
  }
  for (std::size_t k = 0; k < sum.size(); ++k) f.mean_action[k] = count[k] ? sum[k] / double(count[k]) : 0.0;
  f.idle = dml::parallel::bubble(log, warmup + 1);
  return f;
}

// The schedule's bubble with each rank's own measured action times and no message latency: what the
// list order and the stages' imbalance alone leave idle (schedule::simulate with per-rank costs).
double simulate_measured(const dml::schedule::table& t, const std::vector<rank_figures>& stage_costs) {
  std::vector<dml::schedule::costs> c;  // simulate's costs are a rank's V chunks together: V times one action's
  const double v = t.virtual_stages;
  for (const auto& r : stage_costs) {
    const auto& a = r.mean_action;  // indexed by op: forward, backward, backward_input, backward_weight
    c.push_back({.forward = v * a[0], .backward = v * a[1], .backward_input = v * a[2], .backward_weight = v * a[3]});
  }
  return dml::schedule::simulate(t, c).bubble;
}

// Closed forms with forward = 1, backward = 2 (zb: forward = backward_input = backward_weight = 1), for
// M >= K; −1 where none is known (M < K, or a CSV schedule).
double bubble_formula(const std::string& schedule, int k, std::int64_t m) {
  if (m < k) return -1;
  const double K = k, M = double(m);
  if (schedule == "gpipe" || schedule == "1f1b" || schedule == "single") return (K - 1) / (M + K - 1);
  if (schedule == "zb") return (K - 1) / (3 * M + K - 1);
  if (schedule.starts_with("interleaved:")) {
    const double v = std::stod(schedule.substr(12));
    return (K - 1) / (v * M + K - 1);
  }
  return -1;
}

// One configuration: pp × dp comm::local ranks (threads, one BLAS thread each) step a pipeline trainer.
result run_config(const options& o, const std::string& schedule, int pp, int dp, std::int64_t m,
                  const std::vector<std::int64_t>& micro_rows, bool recompute) {
  result res;
  res.schedule = schedule;
  res.pp = pp;
  res.dp = dp;
  res.microbatches = m;
  res.ranks.resize(static_cast<std::size_t>(pp * dp));
  std::mutex mu;
  dml::comm::local::run(pp * dp, [&](dml::comm::local& comm) {
    dml::set_thread_budget(1);
    dml::train::trainer_options to;
    to.seed = 1;
    to.record_events = true;
    to.pipeline_stages = pp;
    to.micro_batches = m;
    to.micro_batch_rows = micro_rows;
    to.schedule = schedule;
    to.stage_cuts = pp > 1 ? o.cuts : std::vector<std::size_t>{};
    to.recompute = recompute;
    dml::nn::with_mlp(784, o.hidden, 10, [&](auto model) {
      dml::trainer<dml::parallel::replicate, dml::precision::fp32, dml::optim::adamw> t(comm, model, to);
      // Stages share their data-parallel rank's rows (world rank = dp + DP·pp).
      const int dp_rank = comm.rank() % dp;
      const std::int64_t rows = o.batch * (dp_rank + 1) / dp - o.batch * dp_rank / dp;
      std::vector<float> x;
      std::vector<std::int32_t> y;
      synthetic_batch(rows, dp_rank, x, y);
      const dml::tensor_view<const float> xv(x.data(), {rows, 784});
      for (std::int64_t s = 0; s < o.warmup; ++s) t.step(xv, y.data(), o.batch);
      comm.barrier();
      const auto t0 = clock_type::now();
      for (std::int64_t s = 0; s < o.steps; ++s) t.step(xv, y.data(), o.batch);
      comm.barrier();
      const double secs = seconds_since(t0);
      const auto& table = t.schedule_table(std::min(m, rows));
      const int pp_rank = comm.rank() / dp;
      auto f = read_events(t.events(), table.ranks[static_cast<std::size_t>(pp_rank)], o.warmup, o.steps);
      f.peak_activation_bytes = t.peak_activation_bytes();
      f.peak_in_flight = t.peak_in_flight();
      std::lock_guard lk(mu);
      res.ranks[static_cast<std::size_t>(comm.rank())] = f;
      if (comm.rank() == 0) {
        res.samples_per_s = double(o.steps * o.batch) / secs;
        res.table = table;
      }
    });
  });
  return res;
}

// One configuration of the run, and the fastest of its runs (empty until one ran; skipped: why it cannot run).
struct config {
  std::string schedule;
  int pp = 1, dp = 1;
  std::int64_t m = 1;
  std::vector<std::int64_t> rows{};  // each micro-batch's rows; empty: equal
  bool recompute = false;
  std::optional<result> best{};
  std::string skipped{};
};

// The fastest of o.repeats runs of every configuration: other processes on a shared machine only ever slow a run
// down. The runs go round the configurations, one of each per round, so that a slow spell of the host costs one run
// of each, not every run of one (a baseline timed in a quiet minute against pipelines timed in a busy one moved the
// speed-ups by 20%). Each run notes how much of the machine other processes took meanwhile.
void best_of_in_turn(const options& o, std::vector<config>& configs) {
  for (int i = 0; i < o.repeats; ++i)
    for (auto& c : configs) {
      if (!c.skipped.empty()) continue;
      try {
        const load_meter start = load_meter::now();
        result r = run_config(o, c.schedule, c.pp, c.dp, c.m, c.rows, c.recompute);
        r.others = load_meter::others_since(start);
        if (!c.best || r.samples_per_s > c.best->samples_per_s) c.best = std::move(r);
      } catch (const dml::invalid_argument& e) {  // a layout this model or run cannot take; the others still run
        c.skipped = e.what();
      }
    }
}

// The command line (dml/train/flags.hpp).
dml::flags command_line(options& o) {
  dml::flags f("pipeline_throughput", "Samples/s and the measured bubble of every pipeline schedule beside one rank.");
  f.add("--schedule", o.schedules, "S,S", "schedules: gpipe, 1f1b, interleaved:V, zb, FILE.csv, or all")
      .default_text("all");
  f.add("--pp", o.pp, "K", "pipeline stages").min(1);
  f.add("--dp", o.dp, "D", "data-parallel ranks per stage").min(1);
  f.add("--microbatches", o.microbatches, "M", "microbatches per step; 0: the planner's pick").min(0);
  f.add("--micro-rows", o.micro_rows, "R,R", "rows of each microbatch of a data-parallel rank (as many as M)")
      .min(1)
      .default_text("equal, or the planner's split");
  f.add("--batch", o.batch, "N", "global rows per step").min(1);
  f.add("--steps", o.steps, "N", "timed steps").min(2);
  f.add("--warmup", o.warmup, "N", "untimed steps first").min(0);
  f.add("--repeats", o.repeats, "N", "runs per configuration; the fastest is kept").min(1);
  f.add("--hidden", o.hidden, "W,W", "hidden layer widths").min(1);
  f.add("--cuts", o.cuts, "L,L", "first layer of each stage after the first").default_text("balanced");
  f.add_switch("--recompute", o.recompute, "recompute activations in the backward pass");
  f.add_switch("--json", o.json, "print one JSON object per result too");
  return f;
}

void check_across(options& o) {
  if (o.schedules.size() == 1 && o.schedules[0] == "all") o.schedules = {"gpipe", "1f1b", "interleaved:2", "zb"};
  if (o.batch < o.dp * std::max<std::int64_t>(o.microbatches, 1))
    dml::fail<dml::invalid_argument>("--batch: expected at least dp × M = ", o.dp * o.microbatches, " rows, found ",
                                     o.batch);
  if (o.schedules.empty()) dml::fail<dml::invalid_argument>("--schedule: expected at least one schedule");
  if (o.micro_rows.empty()) return;
  if (o.microbatches == 0) o.microbatches = std::ssize(o.micro_rows);
  std::int64_t sum = 0;
  for (const auto r : o.micro_rows) sum += r;
  if (std::ssize(o.micro_rows) != o.microbatches || o.batch % o.dp != 0 || sum != o.batch / o.dp)
    dml::fail<dml::invalid_argument>("--micro-rows: expected M = ", o.microbatches, " row counts summing to a "
                                     "data-parallel rank's ", o.batch / o.dp, " rows (of --batch ", o.batch, " over --dp ",
                                     o.dp, "), found ", o.micro_rows.size(), " summing to ", sum);
}

// "128 rows" for equal micro-batches, "108/148 rows" for the rows given.
std::string rows_text(const std::vector<std::int64_t>& rows, std::int64_t equal) {
  std::string s;
  for (const auto r : rows) s += (s.empty() ? "" : "/") + std::to_string(r);
  return (s.empty() ? std::to_string(equal) : s) + " rows";
}

// What the planner predicts for this run's pipelines: this host's rates for one of the run's ranks at the MLP's
// widths (dml::cost::calibrate_rank_of), then each schedule's step through its own table with the stages as the
// trainer cuts them (dml::cost::simulate_pipeline).
struct planner {
  dml::cost::cluster host;
  dml::cost::pipeline_pick pick;  // the fastest 1F1B or zb pipeline over every micro-batch count (rank_pipelines)
  std::vector<double> work;       // each stage's share of the step's work (its FLOPs at the rate, and its update)
  template <class Model>
  static planner calibrate(const options& o, const Model& model) {
    planner p{dml::cost::calibrate_rank_of(o.pp * o.dp, o.hidden.front(), o.hidden.front()), {}, {}};
    if (!o.cuts.empty()) return p;
    p.pick = dml::cost::rank_pipelines(model, o.pp, o.batch / o.dp, p.host).front();
    const auto costs = dml::cost::pipeline_rank_costs(model, o.pp, 1, o.batch / o.dp, p.host);
    const auto update = dml::cost::pipeline_update_seconds(model, o.pp, 1, p.host);
    double total = 0;
    for (std::size_t r = 0; r < costs.size(); ++r) {
      p.work.push_back(costs[r].forward + costs[r].backward + update[r]);
      total += p.work.back();
    }
    for (double& w : p.work) w /= total;
    return p;
  }
  // No pipeline of these stages beats one rank by more than the whole work over the busiest stage's.
  double ceiling() const { return work.empty() ? 0 : 1 / *std::max_element(work.begin(), work.end()); }
  // The predicted step of a schedule at m micro-batches (0 where the planner cannot price it: a CSV file, a count
  // that does not divide the rows, or cuts given by hand).
  template <class Model>
  double step_seconds(const options& o, const Model& model, const std::string& schedule, std::int64_t m) const {
    if (!o.cuts.empty()) return 0;
    try {
      if (!o.micro_rows.empty())
        return dml::cost::simulate_pipeline(model, o.pp, dml::schedule::make(schedule, o.pp, static_cast<int>(m)),
                                            o.micro_rows, host).makespan;
      return dml::cost::simulate_pipeline(model, o.pp, schedule, m, o.batch / o.dp, host).makespan;
    } catch (const dml::invalid_argument&) {
      return 0;
    }
  }
};

std::string model_name(const options& o) {
  std::string s = "784-";
  for (auto h : o.hidden) s += std::to_string(h) + "-";
  return s + "10";
}

}  // namespace

int main(int argc, char** argv) try {
  options o;
  auto cli = command_line(o);
  if (const auto status = dml_bench::parse_for_main(cli, argc, argv, [&] { check_across(o); })) return *status;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int ranks = o.pp * o.dp;
  const std::string cpu = dml::host_cpu_model(), model = model_name(o);
  const int rank_width = std::max(14, 6 * ranks - 1);  // the measured/rank column: "0.123/" per rank
  // The planner first (a second of GEMM probes): the micro-batch count where none is given, and every row's
  // predicted step.
  const bool planned = o.microbatches == 0;
  if (planned && !o.cuts.empty())
    dml::fail<dml::invalid_argument>("--microbatches 0 leaves the count to the planner, which prices the stages the "
                                     "trainer balances, not --cuts; give --microbatches");
  const auto mlp = [&](auto&& f) { return dml::nn::with_mlp(784, o.hidden, 10, f); };
  const planner plan = mlp([&](auto m) { return planner::calibrate(o, m); });
  if (planned) {
    o.microbatches = plan.pick.micro_batches;
    o.micro_rows = plan.pick.micro_rows;
  }
  const double one_rank_predicted = mlp([&](auto m) {
    return dml::cost::simulate_pipeline(m, 1, "1f1b", 1, o.batch, plan.host).makespan;
  });
  // The baseline: one rank, one stage, the whole global batch in one micro-batch, no recomputation.
  // Beside it, one rank with the run's M micro-batches (gradient accumulation): what batch/M-row
  // products cost by themselves.
  const load_meter start = load_meter::now();
  std::vector<config> configs{{.schedule = "single"},
                              {.schedule = "single", .m = o.microbatches, .rows = o.dp == 1 ? o.micro_rows : std::vector<std::int64_t>{}}};
  for (const auto& schedule : o.schedules)
    configs.push_back({.schedule = schedule, .pp = o.pp, .dp = o.dp, .m = o.microbatches, .rows = o.micro_rows,
                       .recompute = o.recompute});
  best_of_in_turn(o, configs);
  for (int i = 0; i < 2; ++i)
    if (!configs[static_cast<std::size_t>(i)].best) dml::fail("the one-rank baseline did not run: ", configs[static_cast<std::size_t>(i)].skipped);
  const result& base = *configs[0].best;
  const result& base_m = *configs[1].best;
  const double base_outside = base.bubble_measured(), micro_cost = base_m.samples_per_s / base.samples_per_s;
  if (!o.json) {
    std::printf("# %s; MLP %s (relu), AdamW, fp32, global batch %lld, %lld steps after %lld warm-up, best of %d "
                "runs, taken in turn with the baselines'%s\n",
                cpu.c_str(), model.c_str(), static_cast<long long>(o.batch), static_cast<long long>(o.steps),
                static_cast<long long>(o.warmup), o.repeats, o.recompute ? ", recompute" : "");
    std::printf("# ranks are comm::local threads with one BLAS thread each: %d rank(s) on %d core(s)\n", ranks, cores);
    if (o.cuts.empty())
      std::printf("# planner (dml::cost::rank_pipelines; GEMMs calibrated for one of %d ranks at %lld x %lld: %.1f GFLOP/s "
                  "at 512 rows, AdamW's update %.1f GB/s): fastest %s at M = %lld (%s), step %.2f ms predicted against %.2f ms "
                  "for one rank (%.2fx)%s\n",
                  ranks, static_cast<long long>(o.hidden.front()), static_cast<long long>(o.hidden.front()),
                  plan.host.flops_fp32 / 1e9, plan.host.memory_bandwidth / 1e9, plan.pick.schedule.c_str(),
                  static_cast<long long>(plan.pick.micro_batches),
                  rows_text(plan.pick.micro_rows, o.batch / o.dp / std::max<std::int64_t>(plan.pick.micro_batches, 1)).c_str(),
                  1e3 * plan.pick.step_seconds, 1e3 * one_rank_predicted, one_rank_predicted / plan.pick.step_seconds,
                  planned ? "; this run's M and rows" : "");
    if (!plan.work.empty()) {
      std::printf("# the stages as the trainer cuts them hold");
      for (std::size_t r = 0; r < plan.work.size(); ++r) std::printf("%s %.0f%%", r ? " /" : "", 100 * plan.work[r]);
      std::printf(" of the work (FLOPs and updates): with no bubble at all, pp %d reaches at most %.2fx one rank\n", o.pp,
                  plan.ceiling());
    }
    if (ranks > cores)
      std::printf("# note: %d ranks share %d cores, so they time-share them: samples/s cannot scale past %d cores, "
                  "and the measured bubble includes time spent waiting for a core\n",
                  ranks, cores, cores);
    std::printf("# baseline: 1 rank (pp 1, dp 1, M 1, schedule single): %.1f samples/s, %.1f%% of its step outside "
                "forward and backward (loss, optimizer update); other processes %.0f%%\n",
                base.samples_per_s, 100.0 * base_outside, 100.0 * base.others);
    std::printf("# 1 rank with M = %lld (micro-batches of %s, gradients accumulated): %.1f samples/s = %.2fx the "
                "baseline; other processes %.0f%%\n",
                static_cast<long long>(o.microbatches),
                rows_text(o.dp == 1 ? o.micro_rows : std::vector<std::int64_t>{}, o.batch / o.microbatches).c_str(),
                base_m.samples_per_s, micro_cost, 100.0 * base_m.others);
    std::printf("# bubble columns: measured = mean over ranks of 1 - compute/step, from the event log; in-sched = the "
                "same less each step's tail after the last forward/backward (reduction, update); sim@meas = "
                "schedule::simulate with each rank's measured action times; theory = schedule::simulate with "
                "forward 1, backward 2 (zb: forward, backward_input, backward_weight 1); closed = (K-1)/(M+K-1), "
                "interleaved (K-1)/(V*M+K-1), zb (K-1)/(3M+K-1); others = CPU share other processes took during "
                "the run kept (the fastest of the repeats)\n");
    std::printf("%14s %3s %3s %4s %11s %8s %9s %9s %9s %7s %7s %*s %9s %9s %8s %8s %7s\n", "schedule", "pp", "dp", "M",
                "samples/s", "speedup", "measured", "in-sched", "sim@meas", "theory", "closed", rank_width, "measured/rank",
                "peak MiB", "in-flight", "step ms", "pred ms", "others");
  } else {
    std::printf("{\"cpu\":\"%s\",\"model\":\"%s\",\"schedule\":\"single\",\"pp\":1,\"dp\":1,\"microbatches\":1,"
                "\"batch\":%lld,\"samples_per_s\":%.1f,\"outside_compute\":%.4f,\"other_processes_cpu_share\":%.3f}\n",
                cpu.c_str(), model.c_str(), static_cast<long long>(o.batch), base.samples_per_s, base_outside,
                base.others);
    std::printf("{\"cpu\":\"%s\",\"model\":\"%s\",\"schedule\":\"single\",\"pp\":1,\"dp\":1,\"microbatches\":%lld,"
                "\"batch\":%lld,\"samples_per_s\":%.1f,\"baseline_samples_per_s\":%.1f,\"speedup\":%.3f,"
                "\"other_processes_cpu_share\":%.3f}\n",
                cpu.c_str(), model.c_str(), static_cast<long long>(o.microbatches), static_cast<long long>(o.batch),
                base_m.samples_per_s, base.samples_per_s, micro_cost, base_m.others);
  }
  std::fflush(stdout);
  struct verdict {
    std::string schedule;
    double speedup, measured, in_schedule, theory;
    bool picked;  // the planner's schedule at its micro-batch count
  };
  std::vector<verdict> verdicts;
  for (std::size_t k = 2; k < configs.size(); ++k) {
    const std::string& schedule = configs[k].schedule;
    if (!configs[k].best) {
      if (o.json) std::printf("{\"schedule\":\"%s\",\"skipped\":true}\n", schedule.c_str());
      else std::printf("# %s skipped: %s\n", schedule.c_str(), configs[k].skipped.c_str());
      std::fflush(stdout);
      continue;
    }
    const result& r = *configs[k].best;
    const double theory = dml::schedule::simulate(r.table).bubble;
    const double closed = bubble_formula(schedule, o.pp, r.table.micro_batches);
    // Stage ranks of data-parallel rank 0 (world ranks 0, D, 2D, ...) give the per-stage action times.
    std::vector<rank_figures> stage_costs;
    for (int s = 0; s < o.pp; ++s) stage_costs.push_back(r.ranks[static_cast<std::size_t>(s * o.dp)]);
    const double sim = simulate_measured(r.table, stage_costs);
    const double speedup = r.samples_per_s / base.samples_per_s;
    const double predicted = mlp([&](auto m) { return plan.step_seconds(o, m, schedule, o.microbatches); });
    const bool picked = planned && schedule == plan.pick.schedule;
    verdicts.push_back({schedule, speedup, r.bubble_measured(), r.bubble_in_schedule(), theory, picked});
    if (o.json) {
      std::string rows_json;
      for (const auto n : o.micro_rows) rows_json += (rows_json.empty() ? "" : ",") + std::to_string(n);
      std::printf("{\"cpu\":\"%s\",\"model\":\"%s\",\"schedule\":\"%s\",\"pp\":%d,\"dp\":%d,\"microbatches\":%lld,"
                  "\"micro_rows\":[%s],\"batch\":%lld,\"recompute\":%s,\"samples_per_s\":%.1f,\"baseline_samples_per_s\":%.1f,"
                  "\"speedup\":%.3f,\"bubble_measured\":%.4f,\"bubble_in_schedule\":%.4f,"
                  "\"bubble_simulated_measured_costs\":%.4f,\"bubble_theory\":%.4f,\"bubble_closed_form\":%.4f,"
                  "\"bubble_per_rank\":[",
                  cpu.c_str(), model.c_str(), schedule.c_str(), o.pp, o.dp, static_cast<long long>(o.microbatches),
                  rows_json.c_str(), static_cast<long long>(o.batch), o.recompute ? "true" : "false", r.samples_per_s,
                  base.samples_per_s, speedup, r.bubble_measured(), r.bubble_in_schedule(), sim, theory, closed);
      for (std::size_t i = 0; i < r.ranks.size(); ++i) std::printf("%s%.4f", i ? "," : "", r.ranks[i].idle);
      std::printf("],\"compute_ms_per_step\":[");
      for (std::size_t i = 0; i < r.ranks.size(); ++i) {
        const auto& f = r.ranks[i];
        std::printf("%s%.3f", i ? "," : "", 1e3 * rank_figures::sum(f.compute) / double(std::max<std::size_t>(f.compute.size(), 1)));
      }
      std::printf("],\"action_ms\":[");
      for (std::size_t i = 0; i < r.ranks.size(); ++i) {
        const auto& a = r.ranks[i].mean_action;
        std::printf("%s{\"forward\":%.3f,\"backward\":%.3f,\"backward_input\":%.3f,\"backward_weight\":%.3f}",
                    i ? "," : "", 1e3 * a[0], 1e3 * a[1], 1e3 * a[2], 1e3 * a[3]);
      }
      std::printf("],\"stage_work\":[");
      for (std::size_t i = 0; i < plan.work.size(); ++i) std::printf("%s%.4f", i ? "," : "", plan.work[i]);
      std::printf("],\"speedup_ceiling\":%.3f", plan.ceiling());
      std::printf(",\"step_ms\":%.3f,\"predicted_step_ms\":%.3f,\"planner_pick\":%s,\"peak_activation_bytes\":%lld,"
                  "\"peak_in_flight\":%lld,\"ranks_over_cores\":%s,\"other_processes_cpu_share\":%.3f}\n",
                  r.step_ms(), 1e3 * predicted, picked ? "true" : "false", static_cast<long long>(r.peak_activation_bytes()),
                  static_cast<long long>(r.peak_in_flight()), ranks > cores ? "true" : "false", r.others);
    } else {
      std::string per_rank;
      for (const auto& f : r.ranks) {
        char cell[16];
        std::snprintf(cell, sizeof cell, "%s%.3f", per_rank.empty() ? "" : "/", f.idle);
        per_rank += cell;
      }
      char closed_s[16] = "-";
      if (closed >= 0) std::snprintf(closed_s, sizeof closed_s, "%.3f", closed);
      char predicted_s[16] = "-";
      if (predicted > 0) std::snprintf(predicted_s, sizeof predicted_s, "%.2f", 1e3 * predicted);
      std::printf("%14s %3d %3d %4lld %11.1f %7.2fx %9.3f %9.3f %9.3f %7.3f %7s %*s %9.2f %9lld %8.2f %8s %6.0f%%\n",
                  (picked ? "*" + schedule : schedule).c_str(), o.pp, o.dp, static_cast<long long>(o.microbatches),
                  r.samples_per_s, speedup, r.bubble_measured(), r.bubble_in_schedule(), sim, theory, closed_s,
                  rank_width, per_rank.c_str(), double(r.peak_activation_bytes()) / 1048576.0,
                  static_cast<long long>(r.peak_in_flight()), r.step_ms(), predicted_s, 100.0 * r.others);
    }
    std::fflush(stdout);
  }
  const double others = load_meter::others_since(start);
  if (!o.json) {
    if (others >= 0)
      std::printf("# other processes used %.0f%% of the machine's CPU time over all runs\n", 100 * others);
    // The goals: the measured bubble within 10% (relative) of theory at M = 4K; with pp 2 on 2 ranks and
    // M = 8, the 784-1024x3-10 MLP at 1.5x one rank's samples/s or more.
    const auto rel = [](double x, double theory) { return theory > 0 ? (x - theory) / theory : 0.0; };
    for (const auto& v : verdicts) {
      if (o.pp > 1 && o.microbatches == 4 * o.pp)
        std::printf("# goal, bubble within 10%% of theory at M = 4K: %s theory %.3f, measured %.3f (%+.0f%%): %s; "
                    "in-schedule %.3f (%+.0f%%): %s%s\n",
                    v.schedule.c_str(), v.theory, v.measured, 100 * rel(v.measured, v.theory),
                    std::abs(rel(v.measured, v.theory)) <= 0.10 ? "met" : "not met", v.in_schedule,
                    100 * rel(v.in_schedule, v.theory), std::abs(rel(v.in_schedule, v.theory)) <= 0.10 ? "met" : "not met",
                    ranks > cores ? " (ranks over cores)" : "");
      if (v.picked && o.pp == 2 && o.dp == 1 && o.hidden == std::vector<std::int64_t>{1024, 1024, 1024} &&
          o.batch == 256 && !o.recompute)
        std::printf("# goal, 784-1024x3-10 at pp 2 on 2 ranks, the planner's pick (%s, M = %lld, %s), >= 1.5x one "
                    "rank: %.2fx: %s\n",
                    v.schedule.c_str(), static_cast<long long>(o.microbatches),
                    rows_text(o.micro_rows, o.batch / o.microbatches).c_str(), v.speedup,
                    v.speedup >= 1.5 ? "met" : "not met");
    }
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "pipeline_throughput: error: %s\n", e.what());
  return 1;
}
