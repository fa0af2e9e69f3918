// SPDX-License-Identifier: Apache-2.0
// benchmarks/ps_throughput.cpp — dml's parameter server on comm::local: the consistency bound against a slow
// worker (idle time and time to a test accuracy, after Li et al. OSDI 2014), compression filters (bytes against
// accuracy), and raw push/pull bandwidth beside comm::local all_reduce and memcpy from the same run.
// `ps_throughput [--part staleness|filters|raw|all] [--quick] [--json]`; see benchmarks/README.md.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "dml/comm/local.hpp"
#include "dml/nn/mlp.hpp"
#include "dml/parallel/consistency.hpp"
#include "dml/parallel/param_server.hpp"
#include "dml/train/downpour.hpp"
#include "dml/train/idx.hpp"

#include "bench_common.hpp"

namespace {

namespace ps = dml::parallel::ps;
using dml_bench::clock_type;
using dml_bench::flag_value;
using dml_bench::seconds_since;
using dml_bench::split_list;

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
  std::int64_t eval_every = 0;   // 0: a fifth of an epoch
  double target = 0.85;
  std::vector<std::string> policies{"bsp", "ssp:1", "ssp:4", "ssp:16", "async"};
  std::vector<std::string> filters{"none", "topk:0.01", "onebit", "significant:0.01"};
  std::string filter_policy = "ssp:4";
  bool pull_filter = true;          // the pull direction is filtered alike
  std::int64_t max_range = 1 << 16;
  std::int64_t raw_bytes = std::int64_t(64) << 20;
  int raw_keys = 4, raw_workers = 2, raw_servers = 2;
  std::vector<std::int64_t> raw_ranges{1 << 16, 1 << 22};
  int raw_iters = 8, raw_repeats = 2;
  bool quick = false, json = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "ps_throughput: %s\n"
               "usage: ps_throughput [--part staleness|filters|raw|all (a comma list too)] [--quick] [--json]\n"
               "  training: [--data DIR] [--hidden 256] [--epochs 3] [--steps N] [--batch 32 (per worker)]\n"
               "            [--optimizer adagrad|sgd] [--lr 0.02] [--eval-every N] [--target 0.85] [--max-range 65536]\n"
               "  staleness: [--policies bsp,ssp:1,ssp:4,ssp:16,async] [--slow-ms N (default: %.1f normal steps)]\n"
               "  filters:   [--filters none,topk:0.01,onebit,significant:0.01] [--filter-policy ssp:4]\n"
               "             [--push-only (pulls unfiltered)]\n"
               "  raw:       [--raw-mb 64] [--raw-keys 4] [--raw-ranges 65536,4194304] [--raw-iters 8]\n"
               "             [--raw-repeats 2]\n",
               why.c_str(), options{}.slow_factor);
  std::exit(2);
}

options parse(int argc, char** argv) {
  options o;
  bool range_set = false;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const auto next = [&] { return flag_value(argc, argv, i); };
      if (a == "--part") {
        const std::string v = next();
        o.parts = v == "all" ? options{}.parts : split_list(v);
        for (const auto& p : o.parts)
          if (p != "staleness" && p != "filters" && p != "raw") usage("--part: expected staleness, filters, raw or all, found '" + p + "'");
      } else if (a == "--data") o.data = next();
      else if (a == "--hidden") o.hidden = std::stoll(next());
      else if (a == "--epochs") o.epochs = std::stoi(next());
      else if (a == "--steps") o.steps = std::stoll(next());
      else if (a == "--batch") o.batch = std::stoll(next());
      else if (a == "--optimizer") o.optimizer = next();
      else if (a == "--lr") o.lr = std::stof(next());
      else if (a == "--slow-ms") o.slow_ms = std::stoi(next());
      else if (a == "--eval-every") o.eval_every = std::stoll(next());
      else if (a == "--target") o.target = std::stod(next());
      else if (a == "--policies") o.policies = split_list(next());
      else if (a == "--filters") o.filters = split_list(next());
      else if (a == "--filter-policy") o.filter_policy = next();
      else if (a == "--push-only") o.pull_filter = false;
      else if (a == "--max-range") o.max_range = std::stoll(next());
      else if (a == "--raw-mb") o.raw_bytes = std::int64_t(std::stod(next()) * 1048576.0);
      else if (a == "--raw-keys") o.raw_keys = std::stoi(next());
      else if (a == "--raw-ranges") {
        o.raw_ranges.clear();
        for (const auto& r : split_list(next())) o.raw_ranges.push_back(std::stoll(r));
        range_set = true;
      } else if (a == "--raw-iters") o.raw_iters = std::stoi(next());
      else if (a == "--raw-repeats") o.raw_repeats = std::stoi(next());
      else if (a == "--quick") o.quick = true;
      else if (a == "--json") o.json = true;
      else if (a == "--help" || a == "-h") usage("help");
      else usage("unknown argument '" + a + "'");
    }
  } catch (const std::logic_error& e) {  // std::stoi and friends on text that is no number
    usage(std::string("expected a number: ") + e.what());
  }
  if (o.quick) {
    // A smoke run: every part and every row, on little work.
    if (o.steps == 0) o.steps = 40;
    if (o.eval_every == 0) o.eval_every = 20;
    o.raw_bytes = std::min<std::int64_t>(o.raw_bytes, std::int64_t(4) << 20);
    if (!range_set) o.raw_ranges = {1 << 16};
    o.raw_iters = std::min(o.raw_iters, 3);
    o.raw_repeats = 1;
  }
  if (o.epochs < 1 || o.batch < 1 || o.hidden < 1 || o.steps < 0 || o.eval_every < 0 || o.max_range < 1)
    usage("expected --epochs, --batch, --hidden, --max-range >= 1 and --steps, --eval-every >= 0");
  if (o.raw_keys < 1 || o.raw_bytes < std::int64_t(4 * o.raw_keys) || o.raw_iters < 1 || o.raw_repeats < 1)
    usage("expected --raw-keys, --raw-iters, --raw-repeats >= 1 and --raw-mb of at least 4 bytes per key");
  for (const auto& p : o.policies) dml::consistency::parse(p);  // fails early on a misspelt policy
  dml::consistency::parse(o.filter_policy);
  for (const auto& f : o.filters) dml::comm::any_filter::parse(f);
  ps::server_optimizer::parse(o.optimizer, o.lr);
  return o;
}

bool wants(const options& o, const char* part) { return std::ranges::find(o.parts, part) != o.parts.end(); }

// ---------------------------------------------------------------------------------------------------------
// Training runs: train::downpour on servers + workers comm::local threads.

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
  // Steps per second of worker 0 (a fast worker), whose loop includes its evaluations.
  double fast_steps_per_s() const { return seconds.empty() || seconds[0] <= 0 ? 0.0 : double(steps[0]) / seconds[0]; }
};

struct data {
  dml::train::dataset train, test;
};

auto make_model(const options& o) {
  const std::int64_t hidden[] = {o.hidden};
  return dml::nn::mlp<1>(784, hidden, 10);
}

train_run train_once(const options& o, const data& d, const std::string& policy, const std::string& filter, int slow_ms,
                     std::int64_t steps, std::int64_t eval_every) {
  ps::options po;
  po.servers = o.servers;
  po.max_range = o.max_range;
  po.optimizer = ps::server_optimizer::parse(o.optimizer, o.lr);
  po.push_filter = filter;
  po.pull_filter = o.pull_filter ? filter : "none";
  dml::train::downpour_options dpo;
  dpo.epochs = o.epochs;
  dpo.steps = steps;
  dpo.batch = o.batch;
  dpo.seed = 1;
  dpo.slow_worker_ms = slow_ms;
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
  const auto consistency = dml::consistency::parse(policy);
  const auto t0 = clock_type::now();
  dml::comm::local::run(o.servers + o.workers, [&](dml::comm::local& c) {
    const auto r = std::visit(
        [&](auto p) { return dml::train::downpour(c, model, d.train, d.test, p, po, dpo); }, consistency);
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
  const train_run r = train_once(o, d, "async", "none", 0, steps, 0);
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

void part_staleness(const options& o, const data& d) {
  const std::int64_t steps = total_steps(o, d), every = eval_interval(o, d);
  const double step_ms = normal_step_ms(o, d);
  const int slow_ms = o.slow_ms >= 0 ? o.slow_ms : std::max(1, int(std::lround((o.slow_factor - 1) * step_ms)));
  if (!o.json) {
    std::printf("#\n# part 1: staleness sweep, %s\n", model_text(o).c_str());
    std::printf("# %lld steps per worker (%.2f epochs), test accuracy (10000 images) on worker 0 every %lld steps\n",
                static_cast<long long>(steps), double(steps) / double(steps_per_epoch(o, d)),
                static_cast<long long>(every));
    std::printf("# normal step %.2f ms (async, no slow worker, mean of the workers); worker %d sleeps %d ms per step: "
                "about %.1f normal steps%s\n",
                step_ms, o.workers - 1, slow_ms, (step_ms + slow_ms) / step_ms, o.slow_ms >= 0 ? " (--slow-ms)" : "");
    std::printf("# idle = sum of the workers' time inside wait() / sum of their training seconds; t->%.0f%% = worker 0's "
                "seconds at the first evaluation >= %.2f; final = worker 0's last evaluation\n",
                100 * o.target, o.target);
    std::printf("%8s %7s %12s %9s %9s %9s %12s %12s %6s\n", "policy", "idle", "t->target(s)", "step", "final",
                "wall(s)", "w0 steps/s", "slow steps/s", "lost");
    std::fflush(stdout);
  } else {
    std::printf("{\"part\":\"staleness\",\"normal_step_ms\":%.3f,\"slow_ms\":%d,\"steps\":%lld,\"eval_every\":%lld}\n",
                step_ms, slow_ms, static_cast<long long>(steps), static_cast<long long>(every));
  }
  for (const auto& policy : o.policies) {
    const train_run r = train_once(o, d, policy, "none", slow_ms, steps, every);
    const auto* hit = r.first_at(o.target);
    const std::size_t slow = r.seconds.size() - 1;
    const double slow_rate = r.seconds[slow] > 0 ? double(r.steps[slow]) / r.seconds[slow] : 0.0;
    if (o.json) {
      std::printf("{\"part\":\"staleness\",\"policy\":\"%s\",\"slow_ms\":%d,\"idle_fraction\":%.4f,"
                  "\"target\":%.3f,\"time_to_target_s\":%s,\"step_at_target\":%lld,\"final_accuracy\":%.4f,"
                  "\"wall_s\":%.3f,\"worker0_steps_per_s\":%.2f,\"slow_worker_steps_per_s\":%.2f,\"lost\":%lld,"
                  "\"evals\":[",
                  policy.c_str(), slow_ms, r.idle_fraction(), o.target,
                  hit ? std::to_string(hit->seconds).c_str() : "null", static_cast<long long>(hit ? hit->step : -1),
                  r.final_accuracy(), r.wall_s, r.fast_steps_per_s(), slow_rate, static_cast<long long>(r.lost));
      for (std::size_t i = 0; i < r.evals.size(); ++i)
        std::printf("%s[%lld,%.4f,%.3f]", i ? "," : "", static_cast<long long>(r.evals[i].step), r.evals[i].accuracy,
                    r.evals[i].seconds);
      std::printf("]}\n");
    } else {
      char step_s[24] = "-";
      if (hit) std::snprintf(step_s, sizeof step_s, "%lld", static_cast<long long>(hit->step));
      std::printf("%8s %6.1f%% %12s %9s %9.4f %9.1f %12.1f %12.1f %6lld\n", policy.c_str(), 100 * r.idle_fraction(),
                  time_text(r, o.target).c_str(), step_s, r.final_accuracy(), r.wall_s, r.fast_steps_per_s(), slow_rate,
                  static_cast<long long>(r.lost));
    }
    std::fflush(stdout);
  }
}

void part_filters(const options& o, const data& d) {
  const std::int64_t steps = total_steps(o, d), every = eval_interval(o, d);
  if (!o.json) {
    std::printf("#\n# part 2: filters, %s, %s, no slow worker, %lld steps per worker, max_range %lld\n",
                model_text(o).c_str(), o.filter_policy.c_str(), static_cast<long long>(steps),
                static_cast<long long>(o.max_range));
    std::printf("# the filter encodes %s, with error feedback; bytes are payload bytes summed over the workers; "
                "ratio = none's bytes / this filter's; diff = final accuracy - none's, in points\n",
                o.pull_filter ? "pushes and pulls" : "pushes (pulls unfiltered)");
    std::printf("%18s %12s %8s %12s %8s %9s %9s %9s %12s\n", "filter", "pushed(MB)", "ratio", "pulled(MB)", "ratio",
                "final", "diff", "wall(s)", "t->target(s)");
    std::fflush(stdout);
  }
  double base_push = 0, base_pull = 0, base_acc = -1;
  for (const auto& f : o.filters) {
    const train_run r = train_once(o, d, o.filter_policy, f, 0, steps, every);
    if (base_acc < 0) {  // the first filter listed (none by default) is the reference
      base_push = double(r.bytes_pushed);
      base_pull = double(r.bytes_pulled);
      base_acc = r.final_accuracy();
    }
    const double push_ratio = r.bytes_pushed ? base_push / double(r.bytes_pushed) : 0.0;
    const double pull_ratio = r.bytes_pulled ? base_pull / double(r.bytes_pulled) : 0.0;
    const double diff = 100 * (r.final_accuracy() - base_acc);
    if (o.json) {
      std::printf("{\"part\":\"filters\",\"filter\":\"%s\",\"policy\":\"%s\",\"pull_filtered\":%s,\"bytes_pushed\":%lld,"
                  "\"bytes_pulled\":%lld,\"push_ratio\":%.3f,\"pull_ratio\":%.3f,\"final_accuracy\":%.4f,"
                  "\"accuracy_diff_points\":%.3f,\"wall_s\":%.3f,\"lost\":%lld}\n",
                  f.c_str(), o.filter_policy.c_str(), o.pull_filter ? "true" : "false",
                  static_cast<long long>(r.bytes_pushed), static_cast<long long>(r.bytes_pulled), push_ratio, pull_ratio,
                  r.final_accuracy(), diff, r.wall_s, static_cast<long long>(r.lost));
    } else {
      std::printf("%18s %12.2f %7.1fx %12.2f %7.1fx %9.4f %+9.2f %9.1f %12s\n", f.c_str(), double(r.bytes_pushed) / 1e6,
                  push_ratio, double(r.bytes_pulled) / 1e6, pull_ratio, r.final_accuracy(), diff, r.wall_s,
                  time_text(r, o.target).c_str());
    }
    std::fflush(stdout);
  }
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
  po.staleness = dml::consistency::unbounded;  // async: no pull ever waits on a clock
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
    kv.wait(kv.push(keys, grads));  // warm-up: every buffer on the way has been touched once
    kv.wait(kv.pull(keys, values));
    double best_push = 1e300, best_pull = 1e300;
    for (int rep = 0; rep < o.raw_repeats; ++rep) {
      peers.barrier();
      auto t0 = clock_type::now();
      for (int i = 0; i < o.raw_iters; ++i) kv.wait(kv.push(keys, grads));
      best_push = std::min(best_push, seconds_since(t0) / o.raw_iters);
      peers.barrier();
      t0 = clock_type::now();
      for (int i = 0; i < o.raw_iters; ++i) kv.wait(kv.pull(keys, values));
      best_pull = std::min(best_pull, seconds_since(t0) / o.raw_iters);
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
  const double memcpy1 = memcpy_gbs(bytes, copies);
  allreduce_result ar;
  dml::comm::local::run(ranks, [&](dml::comm::local& c) {
    const auto r = measure_all_reduce(c, count, o.quick ? 2 : 5, o.quick ? 1 : 3);
    if (c.rank() == 0) ar = r;
  });
  std::vector<raw_row> rows;
  for (auto mr : o.raw_ranges) rows.push_back(measure_ps(o, mr));
  if (o.json) {
    std::printf("{\"part\":\"raw\",\"op\":\"memcpy\",\"threads\":1,\"bytes\":%zu,\"gbs\":%.3f}\n", bytes, memcpy1);
    std::printf("{\"part\":\"raw\",\"op\":\"all_reduce\",\"comm\":\"local\",\"ranks\":%d,\"bytes\":%zu,\"time_us\":%.1f,"
                "\"algbw_gbs\":%.3f,\"busbw_gbs\":%.3f}\n",
                ranks, bytes, ar.time_us, ar.algbw, ar.busbw);
  } else {
    std::printf("#\n# part 3: raw push/pull bandwidth, a %.0f MiB model (%zu floats as %d keys), %d servers + %d workers "
                "on comm::local, no filter, async, server sgd\n",
                double(bytes) / 1048576.0, count, o.raw_keys, o.raw_servers, o.raw_workers);
    std::printf("# roofline: memcpy of %zu bytes, one thread: %.2f GB/s\n", bytes, memcpy1);
    std::printf("# baseline: comm::local all_reduce on %d ranks (threads), out of place\n", ranks);
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
      if (o.json) {
        std::printf("{\"part\":\"raw\",\"op\":\"ps\",\"max_range\":%lld,\"ranges\":%zu,\"worker\":%zu,\"bytes\":%zu,"
                    "\"push_s\":%.6f,\"push_gbs\":%.3f,\"pull_s\":%.6f,\"pull_gbs\":%.3f,\"push_vs_busbw\":%.4f,"
                    "\"pull_vs_busbw\":%.4f}\n",
                    static_cast<long long>(r.max_range), r.ranges, w, bytes, r.push_s[w], push, r.pull_s[w], pull,
                    push / ar.busbw, pull / ar.busbw);
      } else {
        std::printf("  %9lld %7zu %15s %7zu %10.1f %10.2f %6.0f%% %10.1f %10.2f %6.0f%%\n",
                    static_cast<long long>(r.max_range), r.ranges, split.c_str(), w, 1e3 * r.push_s[w], push,
                    100 * push / ar.busbw, 1e3 * r.pull_s[w], pull, 100 * pull / ar.busbw);
      }
    }
  }
  if (!o.json && !rows.empty()) {
    double worst = 1e300;
    for (const auto& r : rows)
      for (std::size_t w = 0; w < r.push_s.size(); ++w)
        worst = std::min({worst, double(bytes) / r.push_s[w] / 1e9, double(bytes) / r.pull_s[w] / 1e9});
    std::printf("# goal, push and pull >= 50%% of all_reduce busbw (%.2f GB/s) per worker: slowest %.2f GB/s = %.0f%%: %s\n",
                ar.busbw, worst, 100 * worst / ar.busbw, worst >= 0.5 * ar.busbw ? "met" : "not met");
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  const std::string cpu = dml::host_cpu_model();
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (o.json) std::printf("{\"cpu\":\"%s\",\"cores\":%d,\"quick\":%s}\n", cpu.c_str(), cores, o.quick ? "true" : "false");
  else std::printf("# %s, %d core(s)%s\n", cpu.c_str(), cores, o.quick ? "; --quick: a smoke run, not a measurement" : "");
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
      std::printf(o.json ? "{\"skipped\":\"staleness,filters\",\"why\":\"no data set in %s\"}\n"
                         : "# staleness and filters skipped: no Fashion-MNIST in %s (--data DIR)\n",
                  o.data.c_str());
      skipped = true;
    }
    if (!skipped && wants(o, "staleness")) part_staleness(o, d);
    if (!skipped && wants(o, "filters")) part_filters(o, d);
  }
  if (wants(o, "raw")) part_raw(o);
  if (!o.json) std::printf("# %.1f s in all\n", seconds_since(t0));
  return skipped ? 77 : 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ps_throughput: error: %s\n", e.what());
  return 1;
}
