// SPDX-License-Identifier: Apache-2.0
// dml/plan/calibrate.hpp — this host as a cost::cluster: a short GEMM probe per precision, a memcpy bandwidth
// probe (what comm::local's collectives do between threads) and dml's AdamW update (the memory bandwidth a
// streaming pass reaches).
// Sits on core/gemm.hpp, comm/local.hpp (its thread budget), optim/adam.hpp and plan/cost.hpp; used by tools/dml-plan
// (--calibrate), the examples' --plan auto and the benchmarks.
#pragma once

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "dml/comm/local.hpp"
#include "dml/core/algorithm.hpp"
#include "dml/core/dtype.hpp"
#include "dml/core/gemm.hpp"
#include "dml/core/space.hpp"
#include "dml/optim/adam.hpp"
#include "dml/plan/cost.hpp"

namespace dml::cost {

namespace detail {
// The fastest of `repeats` calls after a warm one: other processes and page faults only ever slow a call down,
// so the fastest is the host's rate and the least noisy figure (a mean moved the shares of gemm_rows by ±20%).
template <class F>
double seconds_per_call(F&& f, int repeats) {
  f();  // warm
  double best = 0;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = i == 0 ? s : std::min(best, s);
  }
  return best;
}
template <class T>
double gemm_rate(std::int64_t m, std::int64_t n, std::int64_t k) {
  std::vector<T> a(static_cast<std::size_t>(m * k), T(0.5f)), b(static_cast<std::size_t>(k * n), T(0.25f)),
      c(static_cast<std::size_t>(m * n));
  const double s = seconds_per_call([&] {
    dml::gemm<dml::host>({.m = m, .n = n, .k = k, .a = a.data(), .lda = k, .b = b.data(), .ldb = n, .c = c.data(), .ldc = n});
  }, 7);
  return 2.0 * static_cast<double>(m * n * k) / s;
}
// Bytes per second of dml's fp32 AdamW update over n parameters (update_bytes_per_param: 28 per parameter) on each
// of `concurrent` threads at once, each on its own arrays with `threads` threads of its own (ranks share the
// memory system as they share the cores): each thread's fastest of 5 calls, started together, at the slowest thread's.
inline double update_bandwidth(std::int64_t n, int concurrent, int threads) {
  const auto size = static_cast<std::size_t>(n);
  std::vector<double> seconds(static_cast<std::size_t>(concurrent));
  std::barrier sync(concurrent);
  auto run = [&](int who) {
    dml::set_thread_budget(threads);
    std::vector<float> w(size, 0.5f), g(size, 0.25f), m(size), v(size);
    float* state[] = {m.data(), v.data()};
    const optim::adamw opt;
    std::int64_t step = 0;
    seconds[static_cast<std::size_t>(who)] = seconds_per_call([&] {
      sync.arrive_and_wait();
      opt.update<dml::host>({.n = n, .w = w.data(), .g = g.data(), .state = state, .step = ++step, .lr = 1e-3f});
    }, 5);
  };
  std::vector<std::jthread> others;
  for (int i = 1; i < concurrent; ++i) others.emplace_back(run, i);
  run(0);
  others.clear();
  return update_bytes_per_param("adamw", precision::fp32) * static_cast<double>(n) /
         *std::max_element(seconds.begin(), seconds.end());
}
}  // namespace detail

// GEMMs of m × n × k in fp32 and bf16, memcpy of copy_bytes; one node holding every rank. With rows, fp32 GEMMs
// of r × n × k for each r of rows too: their rates over the m-row one are cluster::gemm_rows (the rate a
// micro-batch of r tokens reaches; bf16 is taken to lose the same share). threads > 0: the GEMMs run on that many
// threads (a rank's set_thread_budget), else on the calling thread's budget.
inline cluster calibrate(std::int64_t m = 512, std::int64_t n = 1024, std::int64_t k = 1024,
                         std::size_t copy_bytes = std::size_t{64} << 20, std::vector<std::int64_t> rows = {},
                         int threads = 0, int concurrent = 1) {
  const int budget = dml::thread_budget();
  if (threads > 0) dml::set_thread_budget(threads);
  struct restore {
    int b;
    ~restore() { dml::set_thread_budget(b); }
  } const keep{budget};
  cluster c;
  c.flops_fp32 = detail::gemm_rate<float>(m, n, k);
  c.flops_bf16 = detail::gemm_rate<dml::bf16>(m, n, k);
  std::sort(rows.begin(), rows.end());
  for (const std::int64_t r : rows)
    c.gemm_rows.emplace_back(static_cast<double>(r), r == m ? 1.0 : detail::gemm_rate<float>(r, n, k) / c.flops_fp32);
  std::vector<char> src(copy_bytes, 1), dst(copy_bytes);
  const double copy = detail::seconds_per_call([&] { std::memcpy(dst.data(), src.data(), src.size()); }, 5);
  c.intra_bandwidth = c.inter_bandwidth = static_cast<double>(copy_bytes) / copy;
  c.intra_latency = c.inter_latency = 2e-6;
  // 4M parameters: 112 MB moved per update, beyond the caches of the hosts dml has run on.
  c.memory_bandwidth = detail::update_bandwidth(std::int64_t{1} << 22, concurrent, threads > 0 ? threads : budget);
  c.devices_per_node = 1 << 20;
  c.memory_bytes = 16.0 * (1ull << 30);
  return c;
}

// The rates of one of `ranks` ranks that share this host as comm::local's threads do (each with
// hardware_concurrency / ranks threads, at least 1; ranks over the cores share them): calibrate() at a rank's
// threads, the GEMM rates scaled down where the ranks' threads outnumber the cores, the copy rate split. The GEMMs
// are 512 × n × k and r × n × k: give the model's own widths (a GPT's c_fc: n = 4C, k = C), since how fast small
// products run depends on them as much as on their rows.
inline cluster calibrate_rank_of(int ranks, std::int64_t n = 1024, std::int64_t k = 1024,
                                 std::vector<std::int64_t> rows = {32, 64, 128, 256, 512, 1024, 2048}) {
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int threads = comm::local::thread_budget(ranks);
  const int at_once = std::clamp(ranks, 1, cores);  // the ranks whose updates run at the same time
  cluster c = calibrate(512, n, k, std::size_t{64} << 20, std::move(rows), threads, at_once);
  const double share = std::min(1.0, static_cast<double>(cores) / (static_cast<double>(ranks) * threads));
  c.memory_bandwidth *= static_cast<double>(at_once) / std::max(ranks, 1);
  c.flops_fp32 *= share;
  c.flops_bf16 *= share;
  c.intra_bandwidth = c.inter_bandwidth = c.intra_bandwidth / std::max(ranks, 1);
  return c;
}

}  // namespace dml::cost
