// SPDX-License-Identifier: Apache-2.0
// benchmarks/ps_sandblaster.cpp — Sandblaster L-BFGS on dml's parameter server (comm::local, Fashion-MNIST):
// wall time with one worker 5x slower, with and without backup tasks, beside no straggler from the same run;
// and the coordinator's bytes per iteration for two model sizes beside the parameters' bytes.
// `ps_sandblaster [--workers N] [--portions N] [--iterations N] [--slow-factor X] [--quick]`; see --help.
#include <array>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dml/comm/local.hpp"
#include "dml/core/algorithm.hpp"
#include "dml/nn/mlp.hpp"
#include "dml/nn/network.hpp"
#include "dml/ps/downpour.hpp"
#include "dml/ps/sandblaster.hpp"
#include "dml/train/flags.hpp"
#include "dml/train/idx.hpp"

#include "bench_common.hpp"

namespace {

namespace ps = dml::ps;

struct options {
  std::string data = "/usr/share/datasets/fashion-mnist";
  int servers = 2, workers = 8, portions = 20, history = 10, iterations = 10;
  std::int64_t hidden = 64, batch = 500;
  double slow_factor = 5;
  int portion_ms = 0;  // every worker also sleeps this long per portion: a machine of its own, emulated
  int repeats = 3;  // each case's seconds: the median of this many runs
  bool quick = false;
};

struct outcome {
  double seconds = 0, accuracy = 0, portion_s = 0, bytes_per_iteration = 0;
  int passes = 0;
  std::int64_t backups = 0, parameters = 0;
};

outcome run(const options& o, const dml::train::dataset& train, const dml::train::dataset& test, std::int64_t hidden,
            bool backup, int slow_ms) {
  const auto model = dml::nn::mlp<1>(train.features(), std::array{hidden}, 10);
  std::atomic<std::int64_t> portion_ns = 0, portions_done = 0;
  outcome out;
  dml::comm::local::run(1 + o.servers + o.workers, [&](dml::comm::local& world) {
    dml::set_thread_budget(1);
    auto net = [&]<class... L>(const dml::nn::sequential<L...>& m) {
      return std::make_unique<dml::nn::basic_network<dml::host, float, L...>>(m, 1);
    }(model);
    const std::vector<float> x0(net->params().begin(), net->params().end());
    const auto f = ps::classifier_portions(*net, train, o.portions, o.batch);
    const ps::portion_fn timed = [&](int p, std::span<const float> x, std::span<float> g) {
      const auto t0 = std::chrono::steady_clock::now();
      const double l = f(p, x, g);
      if (o.portion_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o.portion_ms));
      portion_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
      ++portions_done;
      return l;
    };
    ps::sandblaster_options so;
    so.servers = o.servers, so.portions = o.portions, so.history = o.history, so.iterations = o.iterations;
    so.backup_tasks = backup, so.slow_worker_ms = slow_ms;
    const auto r = ps::sandblaster(world, x0, timed, so);
    if (r.role == ps::sandblaster_result::coordinator) {
      std::ranges::copy(r.x, net->params().begin());
      out.seconds = r.seconds, out.passes = r.passes, out.backups = r.backups_issued;
      out.bytes_per_iteration = r.bytes_per_iteration();
      out.accuracy = ps::accuracy(*net, test);
      out.parameters = std::int64_t(x0.size());
    }
  });
  out.portion_s = portions_done ? double(portion_ns) * 1e-9 / double(portions_done) : 0.0;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  dml::flags cli("ps_sandblaster",
                 "Sandblaster L-BFGS on the parameter server: wall time with one worker --slow-factor times slower, "
                 "with and without backup tasks, beside no straggler; the coordinator's bytes per iteration for two "
                 "model sizes.",
                 "The straggler sleeps (slow-factor - 1) x the mean portion time measured in the no-straggler run\n"
                 "after each of its portions. Every run does the same iterations (the iterates do not depend on\n"
                 "which copy of a portion finishes first), so the wall times compare.");
  cli.add("--data", o.data, "DIR", "the Fashion-MNIST IDX files");
  cli.add("--servers", o.servers, "N", "server shards").min(1);
  cli.add("--workers", o.workers, "N", "worker ranks").min(2);
  cli.add("--portions", o.portions, "N", "portions per pass").min(1);
  cli.add("--history", o.history, "M", "L-BFGS pairs").min(1).max(100);
  cli.add("--iterations", o.iterations, "N", "L-BFGS iterations per run").min(1);
  cli.add("--hidden", o.hidden, "N", "hidden width of the MLP (the bytes part also runs 4x this)").min(1);
  cli.add("--batch", o.batch, "N", "rows per forward/backward within a portion").min(1);
  cli.add("--slow-factor", o.slow_factor, "X", "how many times slower the straggler is").min(1.0);
  cli.add("--portion-ms", o.portion_ms, "MS",
          "every worker sleeps MS per portion besides computing it (one machine per worker, emulated where "
          "the workers outnumber the cores)").min(0);
  cli.add("--repeats", o.repeats, "N", "runs per case; the table shows the median time").min(1);
  cli.add_switch("--quick", o.quick, "a smoke run: 2 iterations");
  if (const auto status = dml_bench::parse_for_main(cli, argc, argv, [] {})) return *status;
  if (o.quick) o.iterations = 2, o.repeats = 1;
  dml::train::dataset train, test;
  try {
    train = dml::train::load_mnist(o.data, dml::train::split::train);
    test = dml::train::load_mnist(o.data, dml::train::split::test);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ps_sandblaster: %s; skipped\n", e.what());
    return 77;
  }
  std::printf("# Sandblaster L-BFGS: 1 coordinator, %d servers, %d workers (threads), %d portions, history %d, "
              "%d iterations, MLP 784-%lld-10, %u hardware threads, %d ms per portion emulated\n", o.servers,
              o.workers, o.portions, o.history, o.iterations, (long long)o.hidden, std::thread::hardware_concurrency(),
              o.portion_ms);
  // The median run of each case, the cases interleaved so that a burst of load elsewhere spreads over them.
  (void)run(o, train, test, o.hidden, true, 0);  // warm-up: first touch of the pages, thread start-up
  std::vector<outcome> runs[4];
  int slow_ms = 0;
  for (int k = 0; k < o.repeats; ++k) {
    runs[0].push_back(run(o, train, test, o.hidden, true, 0));
    if (k == 0) slow_ms = std::max(1, int(std::lround((o.slow_factor - 1) * runs[0][0].portion_s * 1e3)));
    runs[1].push_back(run(o, train, test, o.hidden, false, 0));
    runs[2].push_back(run(o, train, test, o.hidden, true, slow_ms));
    runs[3].push_back(run(o, train, test, o.hidden, false, slow_ms));
  }
  auto median = [](std::vector<outcome> v) {
    std::ranges::sort(v, {}, &outcome::seconds);
    return v[v.size() / 2];
  };
  const auto base = median(runs[0]), base_off = median(runs[1]), with = median(runs[2]), without = median(runs[3]);
  std::printf("# a portion takes %.1f ms; the straggler sleeps %d ms after each of its portions (%.1fx slower)\n",
              runs[0][0].portion_s * 1e3, slow_ms, 1 + slow_ms / (runs[0][0].portion_s * 1e3));
  std::printf("%-34s %9s %9s %7s %8s %9s\n", "case", "seconds", "ratio", "passes", "backups", "accuracy");
  auto row = [&](const char* name, const outcome& r) {
    std::printf("%-34s %9.2f %9.2f %7d %8lld %9.4f\n", name, r.seconds, r.seconds / base.seconds, r.passes,
                (long long)r.backups, r.accuracy);
  };
  row("no straggler, backup tasks", base);
  row("no straggler, no backup tasks", base_off);
  row("1 worker slower, backup tasks", with);
  row("1 worker slower, no backup tasks", without);
  std::printf("straggler_ratio_backup=%.2f\nstraggler_ratio_no_backup=%.2f\n", with.seconds / base.seconds,
              without.seconds / base.seconds);
  // The coordinator's traffic: scalars only, the same per pass for a model 4x as wide (the line search may
  // take a different number of passes).
  std::printf("%-34s %12s %7s %16s %9s\n", "model", "parameters", "passes", "coord_bytes/iter", "fraction");
  for (const auto h : {o.hidden, 4 * o.hidden}) {
    const auto r = run(o, train, test, h, false, 0);
    const std::string name = "MLP 784-" + std::to_string(h) + "-10";
    std::printf("%-34s %12lld %7d %16.0f %9.2e\n", name.c_str(), (long long)r.parameters, r.passes, r.bytes_per_iteration,
                r.bytes_per_iteration / (4.0 * double(r.parameters)));
  }
  return 0;
}
