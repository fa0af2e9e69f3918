// SPDX-License-Identifier: Apache-2.0
// examples/param_server/param_server.hpp — Downpour training of an MLP on Fashion-MNIST with a parameter server.
// Ranks [0, --servers) hold the parameters and apply the pushed gradients with their optimizer; the --workers
// ranks after them each train a replica. Prints test_accuracy=... after every epoch, then the traffic and the
// check that no acknowledged update was lost. With --algorithm sandblaster, Sandblaster L-BFGS instead (rank 0
// coordinates, then the servers, then the workers): prints test_accuracy=, seconds= and
// coordinator_bytes_per_iteration=. Flags: see command_line() below, or run it with --help.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "dml/comm/local.hpp"
#include "dml/core/algorithm.hpp"
#include "dml/nn/mlp.hpp"
#include "dml/ps/downpour.hpp"
#include "dml/ps/sandblaster.hpp"
#include "dml/train/flags.hpp"
#include "dml/train/idx.hpp"

namespace param_server {

namespace ps = dml::ps;

struct options {
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string comm = "local";  // local: one thread per rank | mpi: launched by mpirun, one process per rank
  int servers = 2, workers = 2, replicas = 0;
  std::string consistency = "ssp:4";
  int n_fetch = 1, n_push = 1;  // async only: pull every n_fetch steps, push every n_push
  std::string server_optimizer = "adagrad";
  std::optional<float> lr;      // default: 0.03 for adagrad, 0.1 for sgd
  std::string filter = "none";  // on pushes and on pulls
  std::string kill_at;          // --kill-server RANK@STEP, read into the two below
  int kill_server = -1;         // fault: this server stops once a worker's clock there reaches kill_step
  std::int64_t kill_step = 0;
  int slow_worker_ms = 0;
  std::int64_t epochs = 3, steps = 0, batch = 64, hidden = 256, max_range = 1 << 16, timeout_ms = 2000;
  std::uint64_t seed = 1;
  std::string log;
  std::string algorithm = "downpour";  // or sandblaster
  int portions = 32, history = 10, iterations = 60;  // sandblaster
  std::string backup_tasks = "on";
};

// The command line: every flag bound to its member of `o`, with its default and its rules (dml/train/flags.hpp).
inline dml::flags command_line(options& o) {
  dml::flags f("param_server",
               "Downpour training of an MLP on Fashion-MNIST: --servers ranks hold the parameters, --workers ranks "
               "train replicas.",
               "--batch is per worker. --n-fetch and --n-push are for async. --steps N stops every worker after N steps\n"
               "(overriding --epochs) and scores the model there. Under mpirun pass --comm mpi; the world must have\n"
               "--servers + --workers ranks.");
  f.add("--servers", o.servers, "N", "server ranks").min(1);
  f.add("--workers", o.workers, "N", "worker ranks").min(1);
  f.add("--consistency", o.consistency, "C", "bsp, ssp:S (S >= 0) or async");
  f.add("--n-fetch", o.n_fetch, "N", "async: pull every N steps");
  f.add("--n-push", o.n_push, "N", "async: push every N steps");
  f.add("--server-optimizer", o.server_optimizer, "O", "the servers' optimizer: sgd or adagrad");
  f.add("--lr", o.lr, "X", "learning rate").default_text("0.03 for adagrad, 0.1 for sgd");
  f.add("--filter", o.filter, "F", "on pushes and pulls: none, significant:T, topk:K or onebit");
  f.add("--replicas", o.replicas, "R", "replicas of each server's ranges, fewer than --servers").min(0);
  f.add("--kill-server", o.kill_at, "RANK@STEP", "stop server RANK once a worker's clock there reaches STEP")
      .check([](const std::string& v) { return v.find('@') == std::string::npos ? "RANK@STEP" : ""; });
  f.add("--slow-worker", o.slow_worker_ms, "MS", "slow one worker's steps down by MS milliseconds").min(0);
  f.add("--timeout-ms", o.timeout_ms, "MS", "how long a worker waits for a server").min(1);
  f.add("--max-range", o.max_range, "N", "the largest key range a server holds, in floats").min(1);
  f.add("--epochs", o.epochs, "N", "epochs").min(1);
  f.add("--steps", o.steps, "N", "stop every worker after N steps; 0: no limit").min(0);
  f.add("--batch", o.batch, "N", "batch per worker").min(1);
  f.add("--hidden", o.hidden, "N", "hidden layer width").min(1);
  f.add("--seed", o.seed, "N", "seed of the initial weights and the shuffles");
  f.add("--log", o.log, "FILE", "write the losses per step, .csv");
  f.add("--data", o.data, "DIR", "the Fashion-MNIST IDX files");
  f.add("--comm", o.comm, "C", "communicator").choices({"local", "mpi"});
  f.add("--algorithm", o.algorithm, "A", "downpour, or sandblaster (L-BFGS; one more rank coordinates)")
      .choices({"downpour", "sandblaster"});
  f.add("--portions", o.portions, "N", "sandblaster: portions of the training set per pass").min(1);
  f.add("--history", o.history, "M", "sandblaster: L-BFGS pairs kept on the servers").min(1).max(100);
  f.add("--iterations", o.iterations, "N", "sandblaster: L-BFGS iterations").min(1);
  f.add("--backup-tasks", o.backup_tasks, "on|off", "sandblaster: re-issue the slowest portions").choices({"on", "off"});
  return f;
}

// What the table cannot check alone: rules across flags, --kill-server split, and the library's parsers of
// --consistency, --filter and --server-optimizer (with --lr: the server optimizer's rules).
inline void check_across(options& o, const dml::flags& cli) {
  if (o.algorithm != "sandblaster")
    for (const char* flag : {"--portions", "--history", "--iterations", "--backup-tasks"})
      if (cli.given(flag))
        dml::fail<dml::invalid_argument>(flag, ": expected --algorithm sandblaster, found '", o.algorithm, "'");
  if (o.replicas >= o.servers)
    dml::fail<dml::invalid_argument>("--replicas: expected fewer than --servers ", o.servers, ", found ", o.replicas);
  if ((cli.given("--n-fetch") || cli.given("--n-push")) && o.consistency != "async")
    dml::fail<dml::invalid_argument>("--n-fetch and --n-push: expected --consistency async, found '", o.consistency,
                                     "'");
  if (const auto at = o.kill_at.find('@'); at != std::string::npos) {
    o.kill_server = dml::parse_number<int>("--kill-server", std::string_view(o.kill_at).substr(0, at));
    o.kill_step = dml::parse_number<std::int64_t>("--kill-server", std::string_view(o.kill_at).substr(at + 1));
  }
  if (o.kill_server >= o.servers || (o.kill_server >= 0 && o.kill_step < 1))
    dml::fail<dml::invalid_argument>("--kill-server: expected a server rank below ", o.servers,
                                     " and a step >= 1, found ", o.kill_server, "@", o.kill_step);
  // The library's parsers say what they expect; the flag goes in front.
  auto check = [](std::string_view flag, auto&& parse_it) {
    try {
      (void)parse_it();
    } catch (const dml::invalid_argument& e) {
      dml::fail<dml::invalid_argument>(flag, ": ", e.what());
    }
  };
  check("--consistency", [&] { return ps::consistency::parse(o.consistency, o.n_fetch, o.n_push); });
  check("--filter", [&] { return dml::comm::any_filter::parse(o.filter); });
  check("--server-optimizer", [&] { return ps::server_optimizer::parse(o.server_optimizer, 0.f); });
  if (o.lr) check("--lr", [&] { return ps::server_optimizer::parse(o.server_optimizer, *o.lr); });
}

// Sandblaster L-BFGS on the mean cross-entropy over the whole training set: rank 0 coordinates and prints.
template <class Comm>
int run_sandblaster(const options& o, Comm& world, const dml::train::dataset& train, const dml::train::dataset& test) {
  if (world.size() != 1 + o.servers + o.workers)
    dml::fail<dml::invalid_argument>("expected 1 + --servers + --workers = the ", world.size(),
                                     " ranks of the MPI world, found 1 + ", o.servers, " + ", o.workers);
  dml::set_thread_budget(1);
  const auto model = dml::nn::mlp<1>(train.features(), std::array{o.hidden}, 10);
  auto net = [&]<class... L>(const dml::nn::sequential<L...>& m) {
    return std::make_unique<dml::nn::basic_network<dml::host, float, L...>>(m, o.seed);
  }(model);
  const std::vector<float> x0(net->params().begin(), net->params().end());
  ps::sandblaster_options so;
  so.servers = o.servers;
  so.portions = o.portions;
  so.history = o.history;
  so.iterations = o.iterations;
  so.backup_tasks = o.backup_tasks == "on";
  so.slow_worker_ms = o.slow_worker_ms;
  so.on_iteration = [](int it, double loss, double seconds) {
    std::printf("iteration=%d loss=%.5f seconds=%.2f\n", it + 1, loss, seconds);
    std::fflush(stdout);
  };
  // f_p: the mean cross-entropy over the training set, portion p's rows, --batch rows at a time.
  const auto f = ps::classifier_portions(*net, train, o.portions, o.batch);
  const std::int64_t width = train.features();
  const bool printer = world.rank() == 0;
  if (printer) {
    std::printf("sandblaster L-BFGS: 1 coordinator, %d servers, %d workers over comm::%s; %d portions, history %d, "
                "backup tasks %s; MLP %lld-%lld-10\n", o.servers, o.workers, o.comm.c_str(), o.portions, o.history,
                o.backup_tasks.c_str(), (long long)width, (long long)o.hidden);
    std::fflush(stdout);
  }
  const auto r = ps::sandblaster(world, x0, f, so);
  if (printer) {
    std::ranges::copy(r.x, net->params().begin());
    std::printf("test_accuracy=%.4f iterations=%d seconds=%.2f\ncoordinator_bytes_per_iteration=%.0f\n"
                "parameter_bytes=%lld\npasses=%d\nportions_counted=%lld\nbackup_tasks_issued=%lld\n",
                ps::accuracy(*net, test), r.iterations, r.seconds, r.bytes_per_iteration(),
                (long long)(x0.size() * sizeof(float)), r.passes, (long long)r.portions_counted,
                (long long)r.backups_issued);
    std::fflush(stdout);
  }
  return 0;
}

// Every rank of `world` runs this: servers serve, workers train; worker 0 (rank --servers) prints. Returns the
// exit status.
template <class Comm>
int run(const options& o, Comm& world, const dml::train::dataset& train, const dml::train::dataset& test) {
  if (o.algorithm == "sandblaster") return run_sandblaster(o, world, train, test);
  if (world.size() != o.servers + o.workers)
    dml::fail<dml::invalid_argument>("expected --servers + --workers = the ", world.size(),
                                     " ranks of the MPI world, found ", o.servers, " + ", o.workers);
  dml::set_thread_budget(1);  // small GEMMs: one thread per rank
  const bool printer = world.rank() == o.servers;
  ps::options po;
  po.servers = o.servers;
  po.replicas = o.replicas;
  po.max_range = o.max_range;
  po.timeout = std::chrono::milliseconds(o.timeout_ms);
  const float lr = o.lr.value_or(o.server_optimizer == "sgd" ? 0.1f : 0.03f);
  po.optimizer = ps::server_optimizer::parse(o.server_optimizer, lr);
  po.push_filter = po.pull_filter = o.filter;
  if (o.kill_server >= 0)
    po.fault = [s = o.kill_server, at = o.kill_step](int server, std::int64_t clock) {
      return server == s && clock >= at;
    };
  ps::downpour_options d;
  d.epochs = int(o.epochs);
  d.steps = o.steps;
  d.batch = o.batch;
  d.seed = o.seed;
  d.slow_worker_ms = o.slow_worker_ms;
  if (o.steps > 0) d.eval_every = o.steps;  // a run cut short is scored once, at its end
  std::vector<float> losses;  // this rank's worker, one per step
  d.on_step = [&](int, std::int64_t, float loss) { losses.push_back(loss); };
  d.on_eval = [](int epoch, std::int64_t step, double accuracy, double seconds) {
    std::printf("test_accuracy=%.4f epoch=%d step=%lld seconds=%.1f\n", accuracy, epoch, (long long)step, seconds);
    std::fflush(stdout);
  };
  const auto policy = ps::consistency::parse(o.consistency, o.n_fetch, o.n_push);
  const auto model = dml::nn::mlp<1>(train.features(), std::array{o.hidden}, 10);
  if (printer) {
    std::printf("%d servers (%d replicas), %d workers over comm::%s; %s; server %s lr=%g; filter %s; "
                "MLP %lld-%lld-10, batch %lld per worker\n", o.servers, o.replicas, o.workers, o.comm.c_str(),
                ps::consistency::to_string(policy).c_str(), po.optimizer.name().c_str(), double(po.optimizer.lr),
                o.filter.c_str(), (long long)train.features(), (long long)o.hidden, (long long)o.batch);
    std::fflush(stdout);
  }
  const auto r = std::visit([&](auto p) { return ps::downpour(world, model, train, test, p, po, d); }, policy);

  // The workers hold their totals (downpour sums them over the workers); the stopped servers are counted
  // over the world, each rank adding 1 if it is one.
  std::array<double, 1> stopped{r.server && r.died ? 1.0 : 0.0};
  world.all_reduce(std::span<double>(stopped), dml::comm::reduce_op::sum);
  if (!o.log.empty()) {  // every worker's losses in one table: each rank fills its row, the others add zeros
    std::array<std::int64_t, 1> steps{std::int64_t(losses.size())};
    world.all_reduce(std::span<std::int64_t>(steps), dml::comm::reduce_op::max);
    std::vector<float> all(std::size_t(o.workers * steps[0]), 0.f);
    if (!r.server) std::ranges::copy(losses, all.begin() + (world.rank() - o.servers) * steps[0]);
    world.all_reduce(std::span<float>(all), dml::comm::reduce_op::sum);
    if (printer) {
      const std::string part = o.log + ".part";
      std::ofstream f(part);
      f << "worker,step,loss\n";
      for (int w = 0; w < o.workers; ++w)
        for (std::int64_t s = 0; s < steps[0]; ++s)
          f << w << ',' << s + 1 << ',' << all[std::size_t(w * steps[0] + s)] << '\n';
      if (!f.flush()) dml::fail<dml::io_error>(part, ": cannot write");
      std::filesystem::rename(part, o.log);
    }
  }
  if (printer) {
    const auto& t = r.totals;
    std::printf("idle_fraction=%.4f\nbytes_pushed=%.0f\nbytes_pulled=%.0f\nacknowledged_updates=%.0f\n"
                "acknowledged_updates_lost=%.0f\nservers_stopped=%.0f\n",
                t.idle_fraction(), t.bytes_pushed, t.bytes_pulled, t.acknowledged, t.lost, stopped[0]);
    std::fflush(stdout);
  }
  return r.totals.lost == 0 ? 0 : 1;
}

#if defined(DML_EXAMPLE_WITH_MPI)
int run_mpi(const options& o, const dml::train::dataset& train, const dml::train::dataset& test);
#endif

inline int main(int argc, char** argv) {
  options o;
  auto cli = command_line(o);
  if (const auto status = cli.parse_for_main(argc, argv, [&] { check_across(o, cli); })) return *status;
  try {
    const auto train = dml::train::load_mnist(o.data, dml::train::split::train);
    const auto test = dml::train::load_mnist(o.data, dml::train::split::test);
    if (o.comm == "mpi") {
#if defined(DML_EXAMPLE_WITH_MPI)
      return run_mpi(o, train, test);
#else
      dml::fail<dml::invalid_argument>("--comm mpi: this build has no MPI");
#endif
    }
    std::atomic<int> status = 0;
    dml::comm::local::run(o.servers + o.workers + (o.algorithm == "sandblaster"), [&](dml::comm::local& world) {
      if (run(o, world, train, test) != 0) status = 1;
    });
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "param_server: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace param_server
