// SPDX-License-Identifier: Apache-2.0
// examples/param_server/param_server.hpp — Downpour training of an MLP on Fashion-MNIST with a parameter server.
// Ranks [0, --servers) hold the parameters and apply the pushed gradients with their optimizer; the --workers
// ranks after them each train a replica. Prints test_accuracy=... after every epoch, then the traffic and the
// check that no acknowledged update was lost. Flags: see usage() below.
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
  int kill_server = -1;         // fault: this server stops once a worker's clock there reaches kill_step
  std::int64_t kill_step = 0;
  int slow_worker_ms = 0;
  std::int64_t epochs = 3, steps = 0, batch = 64, hidden = 256, max_range = 1 << 16, timeout_ms = 2000;
  std::uint64_t seed = 1;
  std::string log;
};

inline void usage(std::FILE* out) {
  std::fputs(
      "usage: param_server [--servers N] [--workers N] [--consistency bsp|ssp:S|async] [--n-fetch N] [--n-push N]\n"
      "                    [--server-optimizer sgd|adagrad] [--lr X] [--filter none|significant:T|topk:K|onebit]\n"
      "                    [--replicas R] [--kill-server RANK@STEP] [--slow-worker MS] [--timeout-ms MS]\n"
      "                    [--max-range N] [--epochs N] [--steps N] [--batch N] [--hidden N] [--seed N]\n"
      "                    [--log FILE.csv] [--data DIR] [--comm local|mpi]\n"
      "--batch is per worker. --n-fetch and --n-push are for async. --steps N stops every worker after N steps\n"
      "(overriding --epochs) and scores the model there. Under mpirun pass --comm mpi; the world must have\n"
      "--servers + --workers ranks.\n",
      out);
}

template <class T>
T parse_number(std::string_view flag, std::string_view text) {
  T v{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc{} || end != text.data() + text.size())
    dml::fail<dml::invalid_argument>(flag, ": expected a number, found '", text, "'");
  return v;
}

inline options parse(int argc, char** argv) {
  options o;
  bool cadence = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) dml::fail<dml::invalid_argument>(a, ": expected a value after it, found the end of the line");
      return argv[++i];
    };
    auto i64 = [&] { return parse_number<std::int64_t>(a, value()); };
    auto i32 = [&] { return parse_number<int>(a, value()); };
    if (a == "--data") o.data = value();
    else if (a == "--comm") o.comm = value();
    else if (a == "--servers") o.servers = i32();
    else if (a == "--workers") o.workers = i32();
    else if (a == "--replicas") o.replicas = i32();
    else if (a == "--consistency") o.consistency = value();
    else if (a == "--n-fetch") o.n_fetch = i32(), cadence = true;
    else if (a == "--n-push") o.n_push = i32(), cadence = true;
    else if (a == "--server-optimizer") o.server_optimizer = value();
    else if (a == "--lr") o.lr = parse_number<float>(a, value());
    else if (a == "--filter") o.filter = value();
    else if (a == "--kill-server") {
      const std::string v = value();
      const auto at = v.find('@');
      if (at == std::string::npos) dml::fail<dml::invalid_argument>(a, ": expected RANK@STEP, found '", v, "'");
      o.kill_server = parse_number<int>(a, std::string_view(v).substr(0, at));
      o.kill_step = parse_number<std::int64_t>(a, std::string_view(v).substr(at + 1));
    } else if (a == "--slow-worker") o.slow_worker_ms = i32();
    else if (a == "--timeout-ms") o.timeout_ms = i64();
    else if (a == "--max-range") o.max_range = i64();
    else if (a == "--epochs") o.epochs = i64();
    else if (a == "--steps") o.steps = i64();
    else if (a == "--batch") o.batch = i64();
    else if (a == "--hidden") o.hidden = i64();
    else if (a == "--seed") o.seed = parse_number<std::uint64_t>(a, value());
    else if (a == "--log") o.log = value();
    else if (a == "--help" || a == "-h") {
      usage(stdout);
      std::exit(0);
    } else dml::fail<dml::invalid_argument>("unknown flag '", a, "'; see --help");
  }
  if (o.comm != "local" && o.comm != "mpi")
    dml::fail<dml::invalid_argument>("--comm: expected local or mpi, found '", o.comm, "'");
  if (o.servers < 1 || o.workers < 1 || o.replicas < 0 || o.replicas >= o.servers)
    dml::fail<dml::invalid_argument>("expected --servers >= 1, --workers >= 1 and 0 <= --replicas < --servers; found ",
                                     o.servers, ", ", o.workers, ", ", o.replicas);
  if (cadence && o.consistency != "async")
    dml::fail<dml::invalid_argument>("--n-fetch and --n-push: expected --consistency async, found '", o.consistency,
                                     "'");
  if (o.kill_server >= o.servers || (o.kill_server >= 0 && o.kill_step < 1))
    dml::fail<dml::invalid_argument>("--kill-server: expected a server rank below ", o.servers,
                                     " and a step >= 1, found ", o.kill_server, "@", o.kill_step);
  if (o.epochs < 1 || o.steps < 0 || o.batch < 1 || o.hidden < 1 || o.max_range < 1 || o.timeout_ms < 1 ||
      o.slow_worker_ms < 0)
    dml::fail<dml::invalid_argument>("expected --epochs, --batch, --hidden, --max-range, --timeout-ms >= 1 and "
                                     "--steps, --slow-worker >= 0; found ", o.epochs, ", ", o.batch, ", ", o.hidden,
                                     ", ", o.max_range, ", ", o.timeout_ms, ", ", o.steps, ", ", o.slow_worker_ms);
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
  return o;
}

// Every rank of `world` runs this: servers serve, workers train; worker 0 (rank --servers) prints. Returns the
// exit status.
template <class Comm>
int run(const options& o, Comm& world, const dml::train::dataset& train, const dml::train::dataset& test) {
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
  try {
    const options o = parse(argc, argv);
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
    dml::comm::local::run(o.servers + o.workers, [&](dml::comm::local& world) {
      if (run(o, world, train, test) != 0) status = 1;
    });
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "param_server: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace param_server
