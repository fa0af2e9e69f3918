// SPDX-License-Identifier: Apache-2.0
// benchmarks/ps_throughput.cpp — dml's parameter server on comm::local: the consistency bound against a slow
// worker (idle time and time to a test accuracy, after Li et al. OSDI 2014), compression filters (bytes against
// accuracy), and raw push/pull bandwidth beside comm::local all_reduce and memcpy from the same run.
// `ps_throughput [--part staleness|filters|raw|all] [--quick] [--json]`; see benchmarks/README.md.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "dml/comm/local.hpp"
#include "dml/nn/mlp.hpp"
#include "dml/ps/consistency.hpp"
#include "dml/ps/downpour.hpp"
#include "dml/ps/ps.hpp"
#include "dml/train/idx.hpp"

#include "bench_common.hpp"

namespace {

namespace ps = dml::ps;
using dml_bench::clock_type;
using dml_bench::load_meter;
using dml_bench::seconds_since;

struct options {
  std::vector<std::string> parts{"staleness", "filters", "raw"};
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::int64_t hidden = 256;
  int servers = 2, workers = 4;
  int epochs = 3;
  std::int64_t steps = 0;   // per worker; 0: what the epochs give
  std::int64_t batch = 32;  // per worker
  std::string optimizer = "adagrad";  // reaches 85% in about 1.6 epochs here; sgd needs all 3
  float lr = 0.02f;
  int slow_ms = -1;              // -1: derived from a measured normal step
  double slow_factor = 3.5;      // the slow worker's step, in normal steps, when slow_ms is derived
  // fixed: the last worker is slow at every step (downpour_options::slow_worker_ms); rotating: worker
  // (step / rotate_every) % workers is slow, so each worker straggles one run of rotate_every steps in `workers`.
  std::vector<std::string> stragglers{"fixed", "rotating"};
  std::int64_t rotate_every = 4;
  std::int64_t eval_every = 0;   // 0: a fifth of an epoch
  double target = 0.85;
  std::vector<std::string> policies{"bsp", "ssp:1", "ssp:4", "ssp:16", "async"};
  std::vector<std::string> filters{"none", "topk:0.01", "onebit", "significant:0.01"};
  std::string filter_policy = "ssp:4";
  // filtered: pulls go through the same filter as pushes; dense: pulls carry whole values.
  std::vector<std::string> pulls{"filtered", "dense"};
  std::int64_t max_range = 1 << 16;
  double raw_mb = 64;
  std::int64_t raw_bytes = 0;  // raw_mb in bytes (check_across)
  int raw_keys = 4, raw_workers = 2, raw_servers = 2;
  std::vector<std::int64_t> raw_ranges{1 << 16, 1 << 22};
  int raw_iters = 8, raw_repeats = 2;
  bool quick = false, json = false;
};

// The command line (dml/train/flags.hpp).
dml::flags command_line(options& o) {
  dml::flags f("ps_throughput",
               "The parameter server's consistency bounds, filters and raw push/pull bandwidth beside all_reduce.");
  f.add("--part", o.parts, "P,P", "parts to run").choices({"staleness", "filters", "raw", "all"}).default_text("all");
  f.add_switch("--quick", o.quick, "a smoke run: every part and every row, on little work");
  f.add_switch("--json", o.json, "print one JSON object per result too");
  // training
  f.add("--data", o.data, "DIR", "the Fashion-MNIST IDX files");
  f.add("--hidden", o.hidden, "N", "hidden layer width").min(1);
  f.add("--epochs", o.epochs, "N", "epochs").min(1);
  f.add("--steps", o.steps, "N", "steps per worker; 0: what the epochs give").min(0);
  f.add("--batch", o.batch, "N", "batch per worker").min(1);
  f.add("--optimizer", o.optimizer, "O", "the servers' optimizer: adagrad or sgd");
  f.add("--lr", o.lr, "X", "learning rate");
  f.add("--eval-every", o.eval_every, "N", "steps between scores; 0: a fifth of an epoch").min(0);
  f.add("--target", o.target, "X", "the test accuracy to reach");
  f.add("--max-range", o.max_range, "N", "the largest key range a server holds, in floats").min(1);
  // staleness
  f.add("--policies", o.policies, "C,C", "consistency policies: bsp, ssp:S, async");
  f.add("--slow-ms", o.slow_ms, "N", "the slow worker's extra milliseconds per step")
      .min(0)
      .default_text(dml::detail::cat("a slow step of ", options{}.slow_factor, " normal steps"));
  f.add("--straggler", o.stragglers, "M,M", "which worker is slow").choices({"fixed", "rotating"});
  f.add("--rotate-every", o.rotate_every, "N", "steps each rotating straggler stays slow").min(1);
  // filters
  f.add("--filters", o.filters, "F,F", "filters: none, topk:K, onebit, significant:T");
  f.add("--filter-policy", o.filter_policy, "C", "the consistency of the filter runs");
  f.add("--pulls", o.pulls, "M,M", "pulls through the filter, or whole values").choices({"filtered", "dense"});
  // raw
  f.add("--raw-mb", o.raw_mb, "X", "MB pushed and pulled per iteration")
      .check([](double mb) { return mb > 0 && mb <= 65536 ? std::string() : "a size in (0, 65536]"; }, "in (0, 65536]");
  f.add("--raw-keys", o.raw_keys, "N", "keys the raw bytes are split into").min(1);
  f.add("--raw-ranges", o.raw_ranges, "N,N", "largest key ranges of the raw runs").min(1);
  f.add("--raw-iters", o.raw_iters, "N", "timed iterations").min(1);
  f.add("--raw-repeats", o.raw_repeats, "N", "runs per configuration").min(1);
  return f;
}

// What the table cannot check alone, --part all, and --quick's small sizes.
void check_across(options& o, const dml::flags& cli) {
  if (std::ranges::find(o.parts, "all") != o.parts.end()) o.parts = options{}.parts;
  o.raw_bytes = std::int64_t(o.raw_mb * 1048576.0);
  if (o.quick) {
    // A smoke run: every part and every row, on little work.
    if (o.steps == 0) o.steps = 40;
    if (o.eval_every == 0) o.eval_every = 20;
    o.raw_bytes = std::min<std::int64_t>(o.raw_bytes, std::int64_t(4) << 20);
    if (!cli.given("--raw-ranges")) o.raw_ranges = {1 << 16};
    o.raw_iters = std::min(o.raw_iters, 3);
    o.raw_repeats = 1;
  }
  if (o.raw_bytes < std::int64_t(4 * o.raw_keys))
    dml::fail<dml::invalid_argument>("--raw-mb: expected at least 4 bytes per key (--raw-keys ", o.raw_keys,
                                     "), found ", o.raw_bytes, " bytes");
  for (const auto& p : o.policies) ps::consistency::parse(p);  // fails early on a misspelt policy
  ps::consistency::parse(o.filter_policy);
  for (const auto& f : o.filters) dml::comm::any_filter::parse(f);
  ps::server_optimizer::parse(o.optimizer, o.lr);
}

bool wants(const options& o, const char* part) { return std::ranges::find(o.parts, part) != o.parts.end(); }

// --json: one object per line, in addition to the tables; each part prints its lines after its tables.
struct json_lines {
  bool on = false;
  std::vector<std::string> pending;
  void add(const char* fmt, ...) __attribute__((format(printf, 2, 3))) {
    if (!on) return;
    va_list a, b;
    va_start(a, fmt);
    va_copy(b, a);
    std::string line(std::size_t(std::vsnprintf(nullptr, 0, fmt, a)), '\0');
    std::vsnprintf(line.data(), line.size() + 1, fmt, b);
    va_end(b);
    va_end(a);
    pending.push_back(std::move(line));
  }
  void flush() {
    for (const auto& l : pending) std::printf("%s\n", l.c_str());
    pending.clear();
    std::fflush(stdout);
  }
};
json_lines json;

// ---------------------------------------------------------------------------------------------------------
// Training runs: ps::downpour on servers + workers comm::local threads.

struct eval_point {
  std::int64_t step;
  double accuracy, seconds;
};

struct train_run {
  std::string policy, filter;
  int slow_ms = 0;
  double wall_s = 0;                       // the whole comm::local::run
  std::vector<double> seconds, idle;       // per worker: its training loop, and its time inside wait()
  std::vector<std::int64_t> steps;         // per worker
  std::int64_t bytes_pushed = 0, bytes_pulled = 0, lost = 0;
  std::vector<eval_point> evals;           // worker 0's

  double idle_fraction() const {
    const double s = std::accumulate(seconds.begin(), seconds.end(), 0.0);
    return s > 0 ? std::accumulate(idle.begin(), idle.end(), 0.0) / s : 0.0;
  }
  const eval_point* first_at(double target) const {
    for (const auto& e : evals)
      if (e.accuracy >= target) return &e;
    return nullptr;
  }
  double final_accuracy() const { return evals.empty() ? 0.0 : evals.back().accuracy; }
  // The mean of the last three evaluations: steadier than the last one alone.
  double last3_accuracy() const {
    const std::size_t n = std::min<std::size_t>(3, evals.size());
    double s = 0;
    for (std::size_t i = evals.size() - n; i < evals.size(); ++i) s += evals[i].accuracy;
    return n ? s / double(n) : 0.0;
  }
  // Worker w's steps per second (worker 0's loop includes its evaluations), and its share of time idle.
  double steps_per_s(std::size_t w) const { return seconds[w] > 0 ? double(steps[w]) / seconds[w] : 0.0; }
  double idle_of(std::size_t w) const { return seconds[w] > 0 ? idle[w] / seconds[w] : 0.0; }
};

struct data {
  dml::train::dataset train, test;
};

auto make_model(const options& o) {
  const std::int64_t hidden[] = {o.hidden};
  return dml::nn::mlp<1>(784, hidden, 10);
}

// slow_ms > 0 makes a worker sleep that long after some steps: the last worker after every step (fixed), or
// worker (step / rotate_every) % workers (rotating).
train_run train_once(const options& o, const data& d, const std::string& policy, const std::string& filter, int slow_ms,
                     bool rotating, std::int64_t steps, std::int64_t eval_every, bool filter_pulls = false) {
  ps::options po;
  po.servers = o.servers;
  po.max_range = o.max_range;
  po.optimizer = ps::server_optimizer::parse(o.optimizer, o.lr);
  po.push_filter = filter;
  po.pull_filter = filter_pulls ? filter : "none";
  ps::downpour_options dpo;
  dpo.epochs = o.epochs;
  dpo.steps = steps;
  dpo.batch = o.batch;
  dpo.seed = 1;
  dpo.slow_worker_ms = rotating ? 0 : slow_ms;
  if (rotating && slow_ms > 0)
    dpo.on_step = [&o, slow_ms](int worker, std::int64_t step, float) {
      if ((step / o.rotate_every) % o.workers == worker) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
    };
  dpo.eval_every = eval_every;
  train_run run;
  run.policy = policy;
  run.filter = filter;
  run.slow_ms = slow_ms;
  run.seconds.assign(std::size_t(o.workers), 0);
  run.idle.assign(std::size_t(o.workers), 0);
  run.steps.assign(std::size_t(o.workers), 0);
  dpo.on_eval = [&](int, std::int64_t step, double accuracy, double seconds) {
    run.evals.push_back({step, accuracy, seconds});  // worker 0 only
  };
  std::mutex m;
  const auto model = make_model(o);
  const auto consistency = ps::consistency::parse(policy);
  const auto t0 = clock_type::now();
  dml::comm::local::run(o.servers + o.workers, [&](dml::comm::local& c) {
    const auto r = std::visit(
        [&](auto p) { return ps::downpour(c, model, d.train, d.test, p, po, dpo); }, consistency);
    if (r.server) return;
    const auto w = std::size_t(c.rank() - o.servers);
    std::lock_guard lk(m);
    run.seconds[w] = r.seconds;
    run.idle[w] = r.traffic.idle_s;
    run.steps[w] = r.steps;
    run.bytes_pushed += r.traffic.bytes_pushed;
    run.bytes_pulled += r.traffic.bytes_pulled;
    run.lost += r.lost;
  });
  run.wall_s = seconds_since(t0);
  return run;
}

std::int64_t steps_per_epoch(const options& o, const data& d) { return d.train.size() / (o.batch * o.workers); }

std::int64_t eval_interval(const options& o, const data& d) {
  return o.eval_every > 0 ? o.eval_every : std::max<std::int64_t>(1, steps_per_epoch(o, d) / 5);
}

std::int64_t total_steps(const options& o, const data& d) {
  return o.steps > 0 ? o.steps : steps_per_epoch(o, d) * o.epochs;
}

std::string model_text(const options& o) {
  return dml::detail::cat("MLP 784-", o.hidden, "-10, ", o.servers, " servers + ", o.workers,
                          " workers (comm::local threads), server ", o.optimizer, " lr ", o.lr, ", batch ", o.batch,
                          " per worker (global ", o.batch * o.workers, ")");
}

// A normal step: workers' mean seconds per step in a short async run with no slow worker and no evaluation.
double normal_step_ms(const options& o, const data& d) {
  const std::int64_t steps = std::min<std::int64_t>(60, std::max<std::int64_t>(steps_per_epoch(o, d) - 1, 1));
  const train_run r = train_once(o, d, "async", "none", 0, false, steps, 0);
  double s = 0;
  for (std::size_t w = 0; w < r.seconds.size(); ++w) s += r.seconds[w] / double(std::max<std::int64_t>(r.steps[w], 1));
  return 1e3 * s / double(r.seconds.size());
}

std::string time_text(const train_run& r, double target) {
  const auto* e = r.first_at(target);
  if (!e) return "not reached";
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", e->seconds);
  return b;
}

// The share of the machine's CPU time that other processes took since `start` (the machine may be shared).
void print_others(const char* part, const load_meter& start) {
  const double others = load_meter::others_since(start);
  if (others < 0) return;
  json.add("{\"part\":\"%s\",\"other_processes_cpu_share\":%.3f}", part, others);
  std::printf("# other processes took %.0f%% of the machine's CPU time meanwhile\n", 100 * others);
  std::fflush(stdout);
}

void part_staleness(const options& o, const data& d) {
  const std::int64_t steps = total_steps(o, d), every = eval_interval(o, d);
  const double step_ms = normal_step_ms(o, d);
  const int slow_ms = o.slow_ms >= 0 ? o.slow_ms : std::max(1, int(std::lround((o.slow_factor - 1) * step_ms)));
  {
    std::printf("#\n# part 1: staleness sweep, %s\n", model_text(o).c_str());
    std::printf("# %lld steps per worker (%.2f epochs), test accuracy (10000 images) on worker 0 every %lld steps\n",
                static_cast<long long>(steps), double(steps) / double(steps_per_epoch(o, d)),
                static_cast<long long>(every));
    std::printf("# normal step %.2f ms (async, no slow worker, mean of the workers); a slow step sleeps %d ms more: about "
                "%.1f normal steps%s\n",
                step_ms, slow_ms, (step_ms + slow_ms) / step_ms, o.slow_ms >= 0 ? " (--slow-ms)" : "");
    std::printf("# idle = sum of the workers' time inside wait() / sum of their training seconds (w0, w%d: the same for "
                "one worker); t->%.0f%% = worker 0's seconds at its first evaluation >= %.2f, step = its step then; final "
                "= worker 0's last evaluation; steps/s per worker; lost = acknowledged pushes missing at the servers\n",
                o.workers - 1, 100 * o.target, o.target);
  }
  for (const auto& straggler : o.stragglers) {
    const bool rotating = straggler == "rotating";
    {
      if (rotating)
        std::printf("# straggler rotating: worker (step / %lld) %% %d sleeps after its step, so each worker is slow for "
                    "%lld steps in every %lld\n",
                    static_cast<long long>(o.rotate_every), o.workers, static_cast<long long>(o.rotate_every),
                    static_cast<long long>(o.rotate_every * o.workers));
      else
        std::printf("# straggler fixed: worker %d sleeps at every step (downpour_options::slow_worker_ms)\n", o.workers - 1);
      std::printf("%8s %7s %7s %7s %12s %6s %7s %8s %10s %10s %5s\n", "policy", "idle", "w0",
                  dml::detail::cat("w", o.workers - 1).c_str(), "t->target(s)", "step", "final", "wall(s)", "w0 step/s",
                  dml::detail::cat("w", o.workers - 1, " step/s").c_str(), "lost");
      json.add("{\"part\":\"staleness\",\"straggler\":\"%s\",\"rotate_every\":%lld,\"normal_step_ms\":%.3f,"
               "\"slow_ms\":%d,\"steps\":%lld,\"eval_every\":%lld,\"model\":\"%s\"}",
               straggler.c_str(), static_cast<long long>(o.rotate_every), step_ms, slow_ms,
               static_cast<long long>(steps), static_cast<long long>(every), model_text(o).c_str());
    }
    std::fflush(stdout);
    const load_meter start = load_meter::now();
    std::vector<double> idles;
    bool all_reached = true;
    for (const auto& policy : o.policies) {
      const train_run r = train_once(o, d, policy, "none", slow_ms, rotating, steps, every);
      const auto* hit = r.first_at(o.target);
      const std::size_t last = r.seconds.size() - 1;
      idles.push_back(r.idle_fraction());
      all_reached = all_reached && hit;
      char step_s[24] = "-";
      if (hit) std::snprintf(step_s, sizeof step_s, "%lld", static_cast<long long>(hit->step));
      std::printf("%8s %6.1f%% %6.1f%% %6.1f%% %12s %6s %7.4f %8.1f %10.1f %10.1f %5lld\n", policy.c_str(),
                  100 * r.idle_fraction(), 100 * r.idle_of(0), 100 * r.idle_of(last), time_text(r, o.target).c_str(),
                  step_s, r.final_accuracy(), r.wall_s, r.steps_per_s(0), r.steps_per_s(last),
                  static_cast<long long>(r.lost));
      std::string per_worker, evals;
      for (std::size_t w = 0; w <= last; ++w)
        per_worker += dml::detail::cat(w ? "," : "", "{\"idle_fraction\":", r.idle_of(w), ",\"steps_per_s\":",
                                       r.steps_per_s(w), "}");
      for (std::size_t i = 0; i < r.evals.size(); ++i)
        evals += dml::detail::cat(i ? "," : "", "[", r.evals[i].step, ",", r.evals[i].accuracy, ",", r.evals[i].seconds, "]");
      json.add("{\"part\":\"staleness\",\"straggler\":\"%s\",\"policy\":\"%s\",\"slow_ms\":%d,"
               "\"idle_fraction\":%.4f,\"workers\":[%s],\"target\":%.3f,\"time_to_target_s\":%s,"
               "\"step_at_target\":%s,\"final_accuracy\":%.4f,\"wall_s\":%.3f,\"lost\":%lld,"
               "\"evals_step_accuracy_seconds\":[%s]}",
               straggler.c_str(), policy.c_str(), slow_ms, r.idle_fraction(), per_worker.c_str(), o.target,
               hit ? dml::detail::cat(hit->seconds).c_str() : "null", hit ? step_s : "null", r.final_accuracy(),
               r.wall_s, static_cast<long long>(r.lost), evals.c_str());
      std::fflush(stdout);
    }
    if (idles.size() > 1) {
      // In the order the policies were listed (growing bounds by default), each idle share below the one before.
      bool falls = true;
      std::string seq;
      for (std::size_t i = 0; i < idles.size(); ++i) {
        falls = falls && (i == 0 || idles[i] < idles[i - 1]);
        char cell[32];
        std::snprintf(cell, sizeof cell, "%s%.1f%%", i ? ", " : "", 100 * idles[i]);
        seq += cell;
      }
      std::printf("# goal, idle falls as the bound grows (%s): %s; every policy reaches %.2f: %s\n", seq.c_str(),
                  falls ? "met" : "not met", o.target, all_reached ? "met" : "not met");
    }
    print_others("staleness", start);
    json.flush();
  }
}

void part_filters(const options& o, const data& d) {
  const std::int64_t steps = total_steps(o, d), every = eval_interval(o, d);
  std::printf("#\n# part 2: filters, %s, %s, no slow worker, %lld steps per worker, max_range %lld\n",
              model_text(o).c_str(), o.filter_policy.c_str(), static_cast<long long>(steps),
              static_cast<long long>(o.max_range));
  std::printf("# pushes go through the filter with error feedback; pulls through the same filter (filtered) or as whole "
              "values (dense); bytes = payload bytes summed over the workers, initial values included; ratio = the first "
              "row's bytes / this row's; final = worker 0's last evaluation, last3 = the mean of its last three; diff = "
              "final - the first row's final, in points\n");
  std::printf("%18s %8s %12s %8s %12s %8s %8s %8s %8s %8s %12s\n", "filter", "pulls", "pushed(MB)", "ratio", "pulled(MB)",
              "ratio", "final", "last3", "diff", "wall(s)", "t->target(s)");
  std::fflush(stdout);
  const load_meter start = load_meter::now();
  train_run base;
  bool have_base = false;
  std::vector<std::string> goals;
  for (const auto& pulls : o.pulls) {
    for (const auto& f : o.filters) {
      const bool reference = f == o.filters.front();
      // The reference (none by default) runs once; with no filter, pulls are whole values either way.
      if (reference && have_base) continue;
      const train_run r = train_once(o, d, o.filter_policy, f, 0, false, steps, every, pulls == "filtered");
      if (reference) {
        base = r;
        have_base = true;
      }
      const double push_ratio = r.bytes_pushed ? double(base.bytes_pushed) / double(r.bytes_pushed) : 0.0;
      const double pull_ratio = r.bytes_pulled ? double(base.bytes_pulled) / double(r.bytes_pulled) : 0.0;
      const double diff = 100 * (r.final_accuracy() - base.final_accuracy());
      std::printf("%18s %8s %12.2f %7.1fx %12.2f %7.1fx %8.4f %8.4f %+8.2f %8.1f %12s\n", f.c_str(),
                  reference ? "-" : pulls.c_str(), double(r.bytes_pushed) / 1e6, push_ratio, double(r.bytes_pulled) / 1e6,
                  pull_ratio, r.final_accuracy(), r.last3_accuracy(), diff, r.wall_s, time_text(r, o.target).c_str());
      std::fflush(stdout);
      json.add("{\"part\":\"filters\",\"filter\":\"%s\",\"pulls\":\"%s\",\"policy\":\"%s\",\"max_range\":%lld,"
               "\"steps\":%lld,\"bytes_pushed\":%lld,\"bytes_pulled\":%lld,\"push_ratio\":%.3f,\"pull_ratio\":%.3f,"
               "\"final_accuracy\":%.4f,\"last3_accuracy\":%.4f,\"accuracy_diff_points\":%.3f,\"wall_s\":%.3f,"
               "\"lost\":%lld}",
               f.c_str(), reference ? "dense" : pulls.c_str(), o.filter_policy.c_str(),
               static_cast<long long>(o.max_range), static_cast<long long>(steps),
               static_cast<long long>(r.bytes_pushed), static_cast<long long>(r.bytes_pulled), push_ratio, pull_ratio,
               r.final_accuracy(), r.last3_accuracy(), diff, r.wall_s, static_cast<long long>(r.lost));
      const auto kind = dml::comm::any_filter::parse(f).kind();
      if (!reference && (kind == dml::comm::filter_kind::topk || kind == dml::comm::filter_kind::onebit)) {
        char line[256];
        std::snprintf(line, sizeof line,
                      "# goal, %s with %s pulls: %.1fx fewer bytes pushed than %s (>= 30x: %s), final accuracy %+.2f "
                      "points (within 1: %s)",
                      f.c_str(), pulls.c_str(), push_ratio, o.filters.front().c_str(),
                      push_ratio >= 30 ? "met" : "not met", diff, std::abs(diff) <= 1 ? "met" : "not met");
        goals.push_back(line);
      }
    }
  }
  for (const auto& g : goals) std::printf("%s\n", g.c_str());
  print_others("filters", start);
  json.flush();
}

// ---------------------------------------------------------------------------------------------------------
// Raw bandwidth: push+wait and pull+wait of a whole model per worker, beside all_reduce and memcpy.

double memcpy_gbs(std::size_t bytes, int iters) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  std::memcpy(dst.data(), src.data(), bytes);  // fault the pages in
  double best = 1e300;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = clock_type::now();
    for (int i = 0; i < iters; ++i) std::memcpy(dst.data(), src.data(), bytes);
    best = std::min(best, seconds_since(t0) / iters);
  }
  return double(bytes) / best / 1e9;
}

struct allreduce_result {
  double time_us = 0, algbw = 0, busbw = 0;
};

// comm::local all_reduce of `count` floats on every rank of c, out of place: the best of `repeats` means over
// `iters` calls, timed on the slowest rank, as collectives does.
allreduce_result measure_all_reduce(dml::comm::local& c, std::size_t count, int iters, int repeats) {
  std::vector<float> send(count, 1.f), recv(count, 0.f);
  for (int i = 0; i < 2; ++i) c.all_reduce(std::span<const float>(send), std::span<float>(recv), dml::comm::reduce_op::sum);
  double best = 1e300;
  for (int rep = 0; rep < repeats; ++rep) {
    c.barrier();
    const auto t0 = clock_type::now();
    for (int i = 0; i < iters; ++i)
      c.all_reduce(std::span<const float>(send), std::span<float>(recv), dml::comm::reduce_op::sum);
    double t = seconds_since(t0) / iters;
    c.all_reduce(std::span<double>(&t, 1), dml::comm::reduce_op::max);
    best = std::min(best, t);
  }
  allreduce_result r;
  r.time_us = best * 1e6;
  r.algbw = double(count * sizeof(float)) / best / 1e9;
  r.busbw = r.algbw * dml::comm::bus_factor(dml::comm::collective::all_reduce, c.size());
  return r;
}

struct raw_row {
  std::int64_t max_range = 0;
  std::size_t ranges = 0;
  std::vector<std::int64_t> per_server;  // elements whose primary is each server
  std::vector<double> push_s, pull_s;    // per worker: seconds of one push+wait, one pull+wait (best repeat)
};

raw_row measure_ps(const options& o, std::int64_t max_range) {
  const std::int64_t total = o.raw_bytes / 4;
  std::vector<std::int64_t> lengths;
  for (int k = 0; k < o.raw_keys; ++k) lengths.push_back(total * (k + 1) / o.raw_keys - total * k / o.raw_keys);
  ps::options po;
  po.servers = o.raw_servers;
  po.max_range = max_range;
  po.staleness = ps::consistency::unbounded;  // async: no pull ever waits on a clock
  po.optimizer = {ps::server_optimizer::sgd, 0.1f};
  raw_row row;
  row.max_range = max_range;
  row.push_s.assign(std::size_t(o.raw_workers), 0);
  row.pull_s.assign(std::size_t(o.raw_workers), 0);
  std::mutex m;
  dml::comm::local::run(o.raw_servers + o.raw_workers, [&](dml::comm::local& world) {
    const bool server = world.rank() < o.raw_servers;
    // The workers' own group, to start their timed loops together; collective, so before the endpoints.
    auto peers = world.split(server ? 0 : 1, world.rank());
    if (server) {
      ps::server<dml::comm::local> s(world, lengths, po);
      s.serve();
      return;
    }
    ps::kv_worker<dml::comm::local> kv(world, lengths, po);
    std::vector<ps::key> keys(lengths.size());
    std::iota(keys.begin(), keys.end(), ps::key(0));
    std::vector<float> values(std::size_t(total), 0.f), grads(std::size_t(total), 1e-6f);
    kv.init(keys, values);
    if (kv.index() == 0) {
      std::vector<bool> none(std::size_t(o.raw_servers), false);
      row.per_server.assign(std::size_t(o.raw_servers), 0);
      for (const auto& r : kv.layout().table.ranges()) row.per_server[std::size_t(kv.layout().primary(r.id, none))] += r.length;
      row.ranges = kv.layout().table.ranges().size();
    }
    // Round -1 warms up: the timed loops overlap the two workers' requests, which takes more payload buffers
    // than one push and pull apart (the servers answer both workers at once), and a buffer's first use maps and
    // faults in its pages (a 32 MiB reply then took 2-8 times as long), so the warm-up runs the loops themselves.
    double best_push = 1e300, best_pull = 1e300;
    for (int rep = -1; rep < o.raw_repeats; ++rep) {
      peers.barrier();
      auto t0 = clock_type::now();
      for (int i = 0; i < o.raw_iters; ++i) kv.wait(kv.push(keys, grads));
      if (rep >= 0) best_push = std::min(best_push, seconds_since(t0) / o.raw_iters);
      peers.barrier();
      t0 = clock_type::now();
      for (int i = 0; i < o.raw_iters; ++i) kv.wait(kv.pull(keys, values));
      if (rep >= 0) best_pull = std::min(best_pull, seconds_since(t0) / o.raw_iters);
    }
    {
      std::lock_guard lk(m);
      row.push_s[std::size_t(kv.index())] = best_push;
      row.pull_s[std::size_t(kv.index())] = best_pull;
    }
    kv.leave();
  });
  return row;
}

void part_raw(const options& o) {
  const std::size_t bytes = std::size_t(o.raw_bytes / 4) * 4, count = bytes / 4;
  const int ranks = o.raw_servers + o.raw_workers;
  const int copies = int(std::clamp<std::size_t>((std::size_t(1) << 30) / bytes, 3, 64));
  const load_meter start = load_meter::now();
  const double memcpy1 = memcpy_gbs(bytes, copies);
  // all_reduce before and after the parameter server, the faster kept, so that both see the same machine load.
  allreduce_result ar;
  ar.time_us = 1e300;
  const auto all_reduce_once = [&] {
    dml::comm::local::run(ranks, [&](dml::comm::local& c) {
      const auto r = measure_all_reduce(c, count, o.quick ? 2 : 5, o.quick ? 1 : 2);
      if (c.rank() == 0 && r.time_us < ar.time_us) ar = r;
    });
  };
  all_reduce_once();
  std::vector<raw_row> rows;
  for (auto mr : o.raw_ranges) rows.push_back(measure_ps(o, mr));
  all_reduce_once();
  json.add("{\"part\":\"raw\",\"op\":\"memcpy\",\"threads\":1,\"bytes\":%zu,\"gbs\":%.3f}", bytes, memcpy1);
  json.add("{\"part\":\"raw\",\"op\":\"all_reduce\",\"comm\":\"local\",\"ranks\":%d,\"bytes\":%zu,\"time_us\":%.1f,"
           "\"algbw_gbs\":%.3f,\"busbw_gbs\":%.3f}",
           ranks, bytes, ar.time_us, ar.algbw, ar.busbw);
  {
    std::printf("#\n# part 3: raw push/pull bandwidth, a %.0f MiB model (%zu floats as %d keys), %d servers + %d workers "
                "on comm::local, no filter, async, server sgd\n",
                double(bytes) / 1048576.0, count, o.raw_keys, o.raw_servers, o.raw_workers);
    std::printf("# roofline: memcpy of %zu bytes, one thread: %.2f GB/s\n", bytes, memcpy1);
    std::printf("# baseline: comm::local all_reduce on %d ranks (threads), out of place, busbw = algbw x 2(n-1)/n; timed "
                "before and after the parameter server, the faster kept\n",
                ranks);
    std::printf("# %10s %12s %6s %6s %12s %12s %12s\n", "size", "count", "type", "redop", "time(us)", "algbw(GB/s)",
                "busbw(GB/s)");
    std::printf("  %10zu %12zu %6s %6s %12.1f %12.2f %12.2f\n", bytes, count, "float", "sum", ar.time_us, ar.algbw,
                ar.busbw);
    std::printf("# parameter server: per worker, seconds of one push+wait and one pull+wait of the whole model (both "
                "workers at once), best of %d means over %d; GB/s = %zu bytes / that time; %% of all_reduce busbw\n",
                o.raw_repeats, o.raw_iters, bytes);
    std::printf("# %9s %7s %15s %7s %10s %10s %7s %10s %10s %7s\n", "max_range", "ranges", "elements/server", "worker",
                "push(ms)", "push GB/s", "%bus", "pull(ms)", "pull GB/s", "%bus");
  }
  for (const auto& r : rows) {
    std::string split;
    for (auto e : r.per_server) {
      if (!split.empty()) split += '/';
      split += std::to_string(e);
    }
    for (std::size_t w = 0; w < r.push_s.size(); ++w) {
      const double push = double(bytes) / r.push_s[w] / 1e9, pull = double(bytes) / r.pull_s[w] / 1e9;
      std::printf("  %9lld %7zu %15s %7zu %10.1f %10.2f %6.0f%% %10.1f %10.2f %6.0f%%\n",
                  static_cast<long long>(r.max_range), r.ranges, split.c_str(), w, 1e3 * r.push_s[w], push,
                  100 * push / ar.busbw, 1e3 * r.pull_s[w], pull, 100 * pull / ar.busbw);
      json.add("{\"part\":\"raw\",\"op\":\"ps\",\"max_range\":%lld,\"ranges\":%zu,\"worker\":%zu,\"bytes\":%zu,"
               "\"push_s\":%.6f,\"push_gbs\":%.3f,\"pull_s\":%.6f,\"pull_gbs\":%.3f,\"push_vs_busbw\":%.4f,"
               "\"pull_vs_busbw\":%.4f}",
               static_cast<long long>(r.max_range), r.ranges, w, bytes, r.push_s[w], push, r.pull_s[w], pull,
               push / ar.busbw, pull / ar.busbw);
    }
  }
  if (!rows.empty()) {
    double worst = 1e300;
    for (const auto& r : rows)
      for (std::size_t w = 0; w < r.push_s.size(); ++w)
        worst = std::min({worst, double(bytes) / r.push_s[w] / 1e9, double(bytes) / r.pull_s[w] / 1e9});
    std::printf("# goal, push and pull >= 50%% of all_reduce busbw (%.2f GB/s) per worker: slowest %.2f GB/s = %.0f%%: %s\n",
                ar.busbw, worst, 100 * worst / ar.busbw, worst >= 0.5 * ar.busbw ? "met" : "not met");
  }
  print_others("raw", start);
  json.flush();
}

}  // namespace

int main(int argc, char** argv) try {
  options o;
  auto cli = command_line(o);
  if (const auto status = dml_bench::parse_for_main(cli, argc, argv, [&] { check_across(o, cli); })) return *status;
  const std::string cpu = dml::host_cpu_model();
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  json.on = o.json;
  double load[3] = {-1, -1, -1};
  getloadavg(load, 3);
  std::printf("# %s, %d core(s); load average %.2f %.2f %.2f at start%s\n", cpu.c_str(), cores, load[0], load[1], load[2],
              o.quick ? "; --quick: a smoke run, not a measurement" : "");
  json.add("{\"cpu\":\"%s\",\"cores\":%d,\"quick\":%s,\"load_average\":%.2f}", cpu.c_str(), cores,
           o.quick ? "true" : "false", load[0]);
  json.flush();
  std::fflush(stdout);
  const auto t0 = clock_type::now();
  bool skipped = false;
  if (wants(o, "staleness") || wants(o, "filters")) {
    data d;
    try {
      d.train = dml::train::load_mnist(o.data, dml::train::split::train);
      d.test = dml::train::load_mnist(o.data, dml::train::split::test);
    } catch (const dml::io_error& e) {
      // No data set: the training parts cannot run (Debian's dataset-fashion-mnist provides it).
      std::printf("# staleness and filters skipped: %s (--data DIR)\n", e.what());
      json.add("{\"skipped\":[\"staleness\",\"filters\"],\"data\":\"%s\"}", o.data.c_str());
      json.flush();
      skipped = true;
    }
    if (!skipped && wants(o, "staleness")) part_staleness(o, d);
    if (!skipped && wants(o, "filters")) part_filters(o, d);
  }
  if (wants(o, "raw")) part_raw(o);
  getloadavg(load, 3);
  std::printf("# %.1f s in all; load average %.2f %.2f %.2f at the end\n", seconds_since(t0), load[0], load[1], load[2]);
  return skipped ? 77 : 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ps_throughput: error: %s\n", e.what());
  return 1;
}
