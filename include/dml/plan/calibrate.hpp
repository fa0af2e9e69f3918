// SPDX-License-Identifier: Apache-2.0
// dml/plan/calibrate.hpp — this host as a cost::cluster: a short GEMM probe per precision, a memcpy bandwidth
// probe (what comm::local's collectives do between threads), dml's AdamW update (the memory bandwidth a
// streaming pass reaches) and a one-layer GPT's element-wise passes (elementwise_bandwidth_of).
// Sits on core/gemm.hpp, comm/local.hpp (its thread budget), optim/adam.hpp, nn/gpt.hpp, nn/network.hpp and
// plan/cost.hpp; used by tools/dml-plan (--calibrate), the examples' --plan auto and the benchmarks.
#pragma once

#include <algorithm>
#include <array>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <tuple>
#include <utility>
#include <vector>

#include "dml/comm/local.hpp"
#include "dml/core/algorithm.hpp"
#include "dml/core/dtype.hpp"
#include "dml/core/gemm.hpp"
#include "dml/core/space.hpp"
#include "dml/nn/gpt.hpp"
#include "dml/nn/loss.hpp"
#include "dml/nn/network.hpp"
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
// FLOP/s of T GEMMs of r × n × k for each r of rows, the fastest of `rounds` calls each. The calls go round the
// row counts, one of each per round, so that a slow spell of the host slows one call of every count, not every call
// of one count (the shares of gemm_rows are ratios of these rates: one count timed in a slow spell moved them by 30%).
template <class T>
std::vector<double> gemm_rates(const std::vector<std::int64_t>& rows, std::int64_t n, std::int64_t k, int rounds = 7) {
  struct problem {
    std::int64_t m;
    std::vector<T> a, c;
    double best = std::numeric_limits<double>::infinity();
  };
  const std::vector<T> b(static_cast<std::size_t>(k * n), T(0.25f));
  std::vector<problem> ps;
  for (const std::int64_t m : rows)
    ps.push_back({m, std::vector<T>(static_cast<std::size_t>(m * k), T(0.5f)), std::vector<T>(static_cast<std::size_t>(m * n))});
  auto call = [&](problem& p) {
    dml::gemm<dml::host>({.m = p.m, .n = n, .k = k, .a = p.a.data(), .lda = k, .b = b.data(), .ldb = n, .c = p.c.data(), .ldc = n});
  };
  for (auto& p : ps) call(p);  // warm
  for (int i = 0; i < rounds; ++i)
    for (auto& p : ps) {
      const auto t0 = std::chrono::steady_clock::now();
      call(p);
      p.best = std::min(p.best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  std::vector<double> rates;
  for (const auto& p : ps) rates.push_back(2.0 * static_cast<double>(p.m * n * k) / p.best);
  return rates;
}
template <class T>
double gemm_rate(std::int64_t m, std::int64_t n, std::int64_t k) {
  return gemm_rates<T>({m}, n, k).front();
}
// The fastest round of the slowest rank: per round the largest of the ranks' seconds, then the smallest of these.
// Not each rank's fastest round: a round in which another rank started late overlaps less and runs faster, and the
// ranks' fastest rounds need not be the same one (a GEMM probe read 137 GFLOP/s for one of two ranks so, where it
// read 99-111 in the same run's other probes).
inline double fastest_round(const std::vector<std::vector<double>>& rank_rounds) {
  double best = std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < rank_rounds.front().size(); ++i) {
    double slowest = 0;
    for (const auto& rounds : rank_rounds) slowest = std::max(slowest, rounds[i]);
    best = std::min(best, slowest);
  }
  return best;
}
// Runs probe(sync) on `concurrent` threads at once, each with `threads` threads of its own (ranks share the memory
// system as they share the cores) and `sync` a barrier of `concurrent` for its rounds to start together; returns
// each probe's result in thread order. The calling thread runs the first and has its own budget back after.
template <class Probe>
auto run_at_once(int concurrent, int threads, Probe&& probe) {
  using result = std::invoke_result_t<Probe&, std::barrier<>&>;
  const thread_budget_scope caller(0);  // the caller's budget, back after run(0)
  std::vector<result> each(static_cast<std::size_t>(concurrent));
  std::barrier sync(concurrent);
  auto run = [&](int who) {
    dml::set_thread_budget(threads);
    each[static_cast<std::size_t>(who)] = probe(sync);
  };
  std::vector<std::jthread> others;
  for (int i = 1; i < concurrent; ++i) others.emplace_back(run, i);
  run(0);
  others.clear();
  return each;
}
// Each of `rounds` calls of f after a warm one, timed, with `sync` before each (so that concurrent ranks' calls
// overlap).
template <class F>
std::vector<double> timed_rounds(std::barrier<>& sync, int rounds, F&& f) {
  f();
  std::vector<double> seconds;
  for (int i = 0; i < rounds; ++i) {
    sync.arrive_and_wait();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return seconds;
}

// Bytes per second of dml's fp32 AdamW update over n parameters (update_bytes_per_param: 28 per parameter), each of
// `concurrent` threads on its own arrays.
inline double update_bandwidth(std::int64_t n, int concurrent, int threads) {
  const double seconds = fastest_round(run_at_once(concurrent, threads, [n](std::barrier<>& sync) {
    const auto size = static_cast<std::size_t>(n);
    std::vector<float> w(size, 0.5f), g(size, 0.25f), m(size), v(size);
    float* state[] = {m.data(), v.data()};
    const optim::adamw opt;
    std::int64_t step = 0;
    return timed_rounds(sync, 5, [&] {
      opt.update<dml::host>({.n = n, .w = w.data(), .g = g.data(), .state = state, .step = ++step, .lr = 1e-3f});
    });
  }));
  return update_bytes_per_param("adamw", precision::fp32) * static_cast<double>(n) / seconds;
}

// comm::local's collectives among `ranks` threads, as the cost model's ring prices them: the latency per ring step,
// from the median all-reduce of 16 floats (every call's fixed cost: its barriers, over 2(ranks − 1) ring steps); the
// bandwidth, from the median all-reduce of `bytes` (the bytes each rank moves, 2(ranks − 1)/ranks of them, over what
// the call takes beyond that cost); and the all-gathers' and reduce-scatters' own (cluster::intra_gather_bandwidth),
// from the medians of an all-gather into `bytes` and a reduce-scatter from them ((ranks − 1)/ranks of them each,
// over what the two take beyond their ranks − 1 steps each). The ranks meet at a barrier before each call, so their
// arrival's skew is not timed. Each call finds its buffers out of every cache, as a step's collectives find theirs
// (an activation or gradient written a layer earlier, read by the other rank's core): a 1 MB all-reduce from cache
// took 74-80 µs on a 2-core EPYC where out of cache it took 122-152 µs, and an all-gather into 1 MB 174-218 µs, as
// long as one memcpy of its output (comm::local copies every block, its own too).
struct local_rates {
  double latency = 0, bandwidth = 0, gather_bandwidth = 0;
};
inline local_rates local_collectives(int ranks, std::size_t bytes = std::size_t{1} << 20) {
  if (ranks < 2) fail<invalid_argument>("dml::cost::local_collectives: expected at least 2 ranks, found ", ranks);
  double small = 0, large = 0, gather = 0, scatter = 0;
  comm::local::run(ranks, [&](comm::local& c) {
    const std::size_t n = bytes / sizeof(float), part = n / static_cast<std::size_t>(ranks);
    std::vector<float> few(16, 1.f), many(n, 1.f), whole(part * static_cast<std::size_t>(ranks), 1.f), mine(part, 1.f);
    const auto evict = [](std::vector<float>& x) {
      dml::detail::host_evict(x.data(), 1, static_cast<std::int64_t>(x.size()), static_cast<std::int64_t>(x.size()),
                              sizeof(float));
    };
    const auto median = [&](int calls, auto&& call, auto&... buffers) {
      std::vector<double> seconds;
      for (int i = 0; i < calls; ++i) {
        (evict(buffers), ...);
        c.barrier();
        const auto t0 = std::chrono::steady_clock::now();
        call();
        seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      std::nth_element(seconds.begin(), seconds.begin() + calls / 2, seconds.end());
      return seconds[static_cast<std::size_t>(calls / 2)];
    };
    const auto all_reduce = [&](std::vector<float>& x) { c.all_reduce(std::span<float>(x), comm::reduce_op::sum); };
    const double a = median(41, [&] { all_reduce(few); }, few), b = median(21, [&] { all_reduce(many); }, many);
    const double g = median(21, [&] { c.all_gather(std::span<const float>(mine), std::span<float>(whole)); }, mine, whole);
    const double r = median(21, [&] {
      c.reduce_scatter(std::span<const float>(whole), std::span<float>(mine), comm::reduce_op::sum);
    }, mine, whole);
    if (c.rank() == 0) small = a, large = b, gather = g, scatter = r;
  });
  const double steps = 2.0 * (ranks - 1), moved = steps / ranks * static_cast<double>(bytes);
  const double latency = small / steps;
  const double gather_moved = 2.0 * (ranks - 1) / ranks * static_cast<double>(bytes);  // both calls
  return {latency, moved / std::max(large - small, 1e-9),
          gather_moved / std::max(gather + scatter - 2.0 * (ranks - 1) * latency, 1e-9)};
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
  const thread_budget_scope scope(threads);
  cluster c;
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  std::vector<std::int64_t> probed = rows;
  const auto at_m = std::find(probed.begin(), probed.end(), m);
  const std::size_t mi = static_cast<std::size_t>(at_m - probed.begin());
  if (at_m == probed.end()) probed.push_back(m);
  const auto rates = detail::gemm_rates<float>(probed, n, k);
  c.flops_fp32 = rates[mi];
  c.flops_bf16 = detail::gemm_rate<dml::bf16>(m, n, k);
  for (std::size_t i = 0; i < rows.size(); ++i)
    c.gemm_rows.emplace_back(static_cast<double>(rows[i]), i == mi ? 1.0 : rates[i] / c.flops_fp32);
  std::vector<char> src(copy_bytes, 1), dst(copy_bytes);
  const double copy = detail::seconds_per_call([&] { std::memcpy(dst.data(), src.data(), src.size()); }, 5);
  c.intra_bandwidth = c.inter_bandwidth = static_cast<double>(copy_bytes) / copy;
  c.intra_latency = c.inter_latency = 2e-6;  // calibrate_rank_of times the ranks' own collectives
  // 4M parameters: 112 MB moved per update, beyond the caches of the hosts dml has run on.
  c.memory_bandwidth = detail::update_bandwidth(std::int64_t{1} << 22, concurrent, threads > 0 ? threads : budget);
  c.devices_per_node = 1 << 20;
  c.memory_bytes = 16.0 * (1ull << 30);
  return c;
}

// The rates of one of `ranks` ranks that share this host as comm::local's threads do (each with `threads` threads,
// 0: hardware_concurrency / ranks, at least 1, comm::local's budget; ranks over the cores share them): calibrate() at a rank's
// threads, the GEMM rates scaled down where the ranks' threads outnumber the cores, the copy rate split. The GEMMs
// are 512 × n × k and r × n × k: give the model's own widths (a GPT's c_fc: n = 4C, k = C), since how fast small
// products run depends on them as much as on their rows.
inline cluster calibrate_rank_of(int ranks, std::int64_t n = 1024, std::int64_t k = 1024,
                                 std::vector<std::int64_t> rows = {32, 64, 128, 256, 512, 1024, 2048},
                                 int rank_threads = 0) {
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int threads = rank_threads > 0 ? rank_threads : comm::local::thread_budget(ranks);
  const int at_once = std::clamp(ranks, 1, cores);  // the ranks whose updates run at the same time
  cluster c = calibrate(512, n, k, std::size_t{64} << 20, std::move(rows), threads, at_once);
  const double share = std::min(1.0, static_cast<double>(cores) / (static_cast<double>(ranks) * threads));
  c.memory_bandwidth *= static_cast<double>(at_once) / std::max(ranks, 1);
  c.flops_fp32 *= share;
  c.flops_bf16 *= share;
  c.intra_bandwidth = c.inter_bandwidth = c.intra_bandwidth / std::max(ranks, 1);
  if (ranks > 1) {  // the ranks' collectives and messages: comm::local's own
    const auto rates = detail::local_collectives(ranks);
    c.intra_latency = c.inter_latency = rates.latency;
    c.intra_bandwidth = c.inter_bandwidth = rates.bandwidth;
    c.intra_gather_bandwidth = rates.gather_bandwidth;
  }
  return c;
}

// What nn::gpt of d_model, heads, seq and vocab does on this host with its cross-entropy (a forward, the loss and a
// backward, the fastest of 5), on one of `ranks` ranks sharing this host (each with rank_threads threads, 0:
// comm::local's budget, all at once, as calibrate_rank_of), in working precision p (fp32, or bf16: its products on
// the host's bf16 kernels or widened to f32, its element-wise passes on 16-bit values). It runs 1 and 2 layers, each
// over max(1, 512 / seq) sequences and over a quarter of their tokens (fewer sequences, or shorter ones where there is
// one), and 1 layer over twice the sequences; it fits the step less its traced GEMMs to blocks · block_seconds +
// bytes / elementwise_bandwidth:
// - elementwise_bandwidth: its element-wise passes (LayerNorms, softmax, GELU, dropout, residual adds, the
//   embedding's lookups and the loss: everything but its products), forward and backward together, in bytes per
//   second of its blocks' saved activations (Korthikanti et al.'s sbh(34 + 5as/h), at p's value bytes) and of the
//   passes outside them (gpt_end_values_per_token, at p's value bytes);
// - block_seconds: what each block costs a micro-batch whatever its tokens (its layers' calls, their threads'
//   start and the workspaces they take), cluster::block_seconds; 0 where the fit finds none;
// - gemm_flops: its own products' FLOPs over their traced seconds (1 and 2 layers over every token), each product
//   at the model's shapes (the projections, the MLP, attention's per-head products, the head), where a single probe GEMM
//   runs one shape;
// - gemm_rows: the rate of its products at a quarter of the tokens, all of them and twice as many (one layer), over
//   gemm_flops' ({tokens, share}, as cluster::gemm_rows).
struct gpt_probe {
  double elementwise_bandwidth = 0, gemm_flops = 0, block_seconds = 0;
  std::vector<std::pair<double, double>> gemm_rows;
};
// A GPT's GEMM share by rows: its own products' shares where the probe measured them (model, increasing rows), and
// below the first the share of one GEMM shape (single, cluster::gemm_rows), scaled to meet the model's at its first
// point; held beyond the model's last point, where one shape's rate rising with its rows is not the model's mix
// (per-head attention products do not grow with the micro-batch).
inline std::vector<std::pair<double, double>> gpt_gemm_rows(const std::vector<std::pair<double, double>>& single,
                                                            const std::vector<std::pair<double, double>>& model) {
  if (model.empty()) return single;
  const cluster one{.gemm_rows = single};
  const double scale = model.front().second / one.gemm_share(model.front().first);
  std::vector<std::pair<double, double>> rows;
  for (const auto& [r, s] : single)
    if (r < model.front().first) rows.emplace_back(r, s * scale);
  rows.insert(rows.end(), model.begin(), model.end());
  return rows;
}
// One timed run of a model's element-wise passes: its blocks, the bytes they and the passes outside them move, and
// their seconds.
struct pass_time {
  double blocks = 0, bytes = 0, seconds = 0;
};
// seconds = blocks · block_seconds + bytes / bandwidth, fitted to runs by least squares of the relative error:
// {block_seconds, bandwidth}. Where the fit finds no fixed cost (or no rate), block_seconds is 0 and the bandwidth
// the runs' bytes over their seconds in the same weighting.
inline std::pair<double, double> fit_passes(const std::vector<pass_time>& runs) {
  if (runs.empty()) fail<invalid_argument>("dml::cost::fit_passes: expected at least one run, found none");
  double sll = 0, slb = 0, sbb = 0, slr = 0, sbr = 0;
  for (const auto& [l, b, r] : runs) {
    if (!(r > 0) || !(b > 0) || l < 0)
      fail<invalid_argument>("dml::cost::fit_passes: expected runs of positive seconds and bytes and blocks >= 0, found ",
                             r, " s, ", b, " bytes and ", l, " blocks");
    const double k = 1 / (r * r);
    sll += k * l * l, slb += k * l * b, sbb += k * b * b, slr += k * l * r, sbr += k * b * r;
  }
  const double det = sll * sbb - slb * slb;
  const double f = (slr * sbb - sbr * slb) / det, x = (sll * sbr - slb * slr) / det;
  if (det > 1e-12 * sll * sbb && f > 0 && x > 0) return {f, 1 / x};
  return {0.0, sbb / sbr};
}

namespace detail {
// One run of time_gpts: nn::gpt g over `batch` sequences; what it measured: the fastest round's seconds outside the
// traced products and inside them, and the products' FLOPs.
struct gpt_run {
  nn::gpt_config g;
  std::int64_t batch = 1;
  double rest = 0, gemm = 0, flops = 0;
};
// Times each of `runs` (a forward, the loss and a backward) on `at_once` threads at once, `rounds` rounds after a
// warm one. The rounds go round the runs, one of each per round: a slow spell of the host slows one round of every
// run, not every round of one (timed one run after another, the probe's share at a quarter of the tokens read
// 0.64 and 1.16 in two of eight calibrations where the others read 0.93-0.97).
template <class T>
void time_gpts(std::vector<gpt_run>& runs, int at_once, int threads, int rounds = 6) {
  struct timed {
    std::vector<std::vector<double>> rest, gemm;  // per run, each round's seconds outside and inside the products
    std::vector<double> flops;
  };
  using net_type = nn::basic_network<dml::host, T, nn::gpt_embedding, nn::stack<nn::gpt_block>, nn::gpt_head>;
  const auto each = run_at_once(at_once, threads, [&](std::barrier<>& sync) {
    struct problem {
      net_type net;
      std::vector<float> ids, row_loss;
      std::vector<T> dlogits;
      std::vector<std::int32_t> labels;
    };
    std::vector<std::unique_ptr<problem>> ps;  // a network is not movable
    for (const auto& r : runs) {
      const auto tokens = static_cast<std::size_t>(r.batch * r.g.seq), vocab = static_cast<std::size_t>(r.g.vocab);
      auto& q = *ps.emplace_back(new problem{net_type(nn::gpt(r.g), 1), std::vector<float>(tokens), std::vector<float>(tokens),
                                             std::vector<T>(tokens * vocab), std::vector<std::int32_t>(tokens)});
      for (std::size_t i = 0; i < tokens; ++i) {
        q.ids[i] = static_cast<float>((i * 7) % vocab);
        q.labels[i] = static_cast<std::int32_t>((i * 5) % vocab);
      }
    }
    const nn::context c{.training = true, .seed = 1, .step = 1};
    std::vector<gemm_call> calls;
    timed t{.rest = std::vector<std::vector<double>>(runs.size()), .gemm = std::vector<std::vector<double>>(runs.size()),
            .flops = std::vector<double>(runs.size())};
    const auto once = [&](std::size_t i) {
      auto& q = *ps[i];
      calls.clear();
      dml::detail::host_gemm_trace = &calls;
      const auto t0 = std::chrono::steady_clock::now();
      const auto logits = q.net.forward(tensor_view<const float>(q.ids.data(), {runs[i].batch, runs[i].g.seq}), c);
      const tensor_view<T> dl(q.dlogits.data(), logits.shape);
      nn::softmax_cross_entropy{}.forward_backward<dml::host>(logits, q.labels.data(), dl, q.row_loss.data());
      q.net.backward(tensor_view<const T>(dl), c);
      const double all = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      dml::detail::host_gemm_trace = nullptr;
      double gemm = 0, flops = 0;
      for (const auto& call : calls) {
        gemm += call.seconds;
        flops += 2.0 * static_cast<double>(call.args.m) * static_cast<double>(call.args.n) * static_cast<double>(call.args.k);
      }
      return std::tuple{all - gemm, gemm, flops};
    };
    for (std::size_t i = 0; i < runs.size(); ++i) once(i);  // warm
    for (int round = 0; round < rounds; ++round)
      for (std::size_t i = 0; i < runs.size(); ++i) {
        sync.arrive_and_wait();
        const auto [rest, gemm, flops] = once(i);
        t.rest[i].push_back(rest);
        t.gemm[i].push_back(gemm);
        t.flops[i] = flops;
      }
    return t;
  });
  // Ranks that share the host wait for each other; every rank runs the same products.
  for (std::size_t i = 0; i < runs.size(); ++i) {
    std::vector<std::vector<double>> rest, gemm;
    for (const auto& t : each) {
      rest.push_back(t.rest[i]);
      gemm.push_back(t.gemm[i]);
    }
    runs[i].rest = fastest_round(rest);
    runs[i].gemm = fastest_round(gemm);
    runs[i].flops = each.front().flops[i];
  }
}
template <class T>
gpt_probe probe_gpt_as(std::int64_t d_model, std::int64_t heads, std::int64_t seq, int ranks, std::int64_t vocab,
                       int rank_threads) {
  if (d_model < 1 || heads < 1 || seq < 1 || vocab < 1)
    fail<invalid_argument>("dml::cost::probe_gpt: expected d_model, heads, seq and vocab of at least 1, found ", d_model,
                           ", ", heads, ", ", seq, " and ", vocab);
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int threads = rank_threads > 0 ? rank_threads : comm::local::thread_budget(ranks);
  const int at_once = std::clamp(ranks, 1, cores);
  const double share = std::min(1.0, static_cast<double>(cores) / (static_cast<double>(ranks) * threads));
  const double w = sizeof(T);  // korthikanti_layer_bytes counts 2-byte values
  const auto ends = gpt_end_values_per_token(static_cast<double>(d_model), static_cast<double>(vocab), 1, false);
  const std::int64_t batch = std::max<std::int64_t>(1, 512 / seq);
  // A quarter of the tokens: a quarter of the sequences where there are 4, else shorter ones.
  const std::int64_t few = std::max<std::int64_t>(1, batch / 4), short_seq = std::max<std::int64_t>(1, seq * batch / (4 * few));
  std::vector<pass_time> runs;
  // The products' FLOPs and traced seconds at a quarter of the tokens, all of them and twice as many.
  std::array<double, 3> flops_at{}, gemm_at{};
  const std::array<std::int64_t, 3> tokens_at{short_seq * few, seq * batch, 2 * seq * batch};
  gpt_probe p;
  // {layers, sequence length, sequences, which of tokens_at}: 1 and 2 layers over every token and over a quarter of
  // them, 1 layer over twice as many.
  const std::array<std::array<std::int64_t, 4>, 5> shapes{
      {{1, seq, batch, 1}, {1, short_seq, few, 0}, {2, seq, batch, 1}, {2, short_seq, few, 0}, {1, seq, 2 * batch, 2}}};
  std::vector<gpt_run> timed;
  for (const auto& [layers, s, b, at] : shapes)
    timed.push_back({.g = {.vocab = vocab, .seq = s, .layers = layers, .d_model = d_model, .heads = heads}, .batch = b});
  time_gpts<T>(timed, at_once, threads);
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const auto& [layers, s, b, at] = shapes[i];
    const auto& r = timed[i];
    flops_at[static_cast<std::size_t>(at)] += r.flops, gemm_at[static_cast<std::size_t>(at)] += r.gemm;
    const double bytes = static_cast<double>(layers) *
                             korthikanti_layer_bytes(static_cast<double>(s), static_cast<double>(b), static_cast<double>(d_model),
                                                     static_cast<double>(heads), 1, false, recompute::none) * (w / 2) +
                         static_cast<double>(s * b) * (ends.embedding + ends.head) * w;
    runs.push_back({.blocks = static_cast<double>(layers), .bytes = bytes, .seconds = std::max(r.rest, 1e-9) / share});
  }
  std::tie(p.block_seconds, p.elementwise_bandwidth) = fit_passes(runs);
  const auto rate = [&](std::size_t at) { return flops_at[at] / gemm_at[at]; };
  p.gemm_flops = rate(1) * share;
  for (std::size_t at = 0; at < 3; ++at)
    if (p.gemm_rows.empty() || static_cast<double>(tokens_at[at]) > p.gemm_rows.back().first)
      p.gemm_rows.emplace_back(static_cast<double>(tokens_at[at]), rate(at) / rate(1));
  return p;
}
}  // namespace detail
inline gpt_probe probe_gpt(std::int64_t d_model, std::int64_t heads, std::int64_t seq, int ranks = 1,
                           std::int64_t vocab = 1024, precision p = precision::fp32, int rank_threads = 0) {
  if (p == precision::fp16) fail<invalid_argument>("dml::cost::probe_gpt: expected precision fp32 or bf16, found fp16");
  if (p == precision::bf16) return detail::probe_gpt_as<dml::bf16>(d_model, heads, seq, ranks, vocab, rank_threads);
  return detail::probe_gpt_as<float>(d_model, heads, seq, ranks, vocab, rank_threads);
}
// probe_gpt's element-wise rate: cluster::elementwise_bandwidth.
inline double elementwise_bandwidth_of(std::int64_t d_model, std::int64_t heads, std::int64_t seq, int ranks = 1,
                                       std::int64_t vocab = 1024) {
  return probe_gpt(d_model, heads, seq, ranks, vocab).elementwise_bandwidth;
}

// What dml::cost needs to price a GPT's layouts on this host: calibrate_rank_of at its widths (its c_fc: n = 4C,
// k = C) for the share of the rate at a micro-batch's rows, the copy rate and the update; then probe_gpt at its
// widths and vocabulary, in fp32 and in bf16, for each precision's element-wise rate and the GEMM rate of its own
// products (at the probe's 512 rows), each block's fixed cost, and the share of the rate at a micro-batch's rows
// where the probe ran the model's own products (gpt_gemm_rows: one shape's share below them): bf16's products as this
// host runs them, on native kernels or widened to f32, so that the planner prices bf16 where it is slower as slower. rank_threads: the threads each rank will run (0: comm::local's
// budget for `ranks`), so that one rank run on one thread of a larger host is priced at one thread's rates.
inline cluster calibrate_gpt_rank_of(int ranks, std::int64_t d_model, std::int64_t heads, std::int64_t seq,
                                     std::int64_t vocab, int rank_threads = 0) {
  cluster c = calibrate_rank_of(ranks, 4 * d_model, d_model, {32, 64, 128, 256, 512, 1024, 2048}, rank_threads);
  const gpt_probe p = probe_gpt(d_model, heads, seq, ranks, vocab, precision::fp32, rank_threads);
  const gpt_probe half = probe_gpt(d_model, heads, seq, ranks, vocab, precision::bf16, rank_threads);
  c.elementwise_bandwidth = p.elementwise_bandwidth;
  c.elementwise_bandwidth_bf16 = half.elementwise_bandwidth;
  c.gemm_rows = gpt_gemm_rows(c.gemm_rows, p.gemm_rows);
  c.block_seconds = p.block_seconds;
  c.block_seconds_bf16 = half.block_seconds;
  c.flops_fp32 = p.gemm_flops;
  c.flops_bf16 = half.gemm_flops;
  return c;
}

// ---- which precision runs a sequential faster on this host -------------------------------------------------------

// What `--precision auto` picks for a model that dml::cost does not price in bf16 (any nn::sequential, such as an
// MLP): a forward and a backward of the model over `rows` rows, in fp32 and in bf16, on this host with rank_threads
// threads (0: the calling thread's budget), the two taken in turn, each the fastest of 5 after a warm one. The
// optimizer's update moves the same bytes in either (update_bytes_per_param: 28 per parameter with AdamW), so it is
// not timed: the products decide, native in bf16 or widened to f32, and the element-wise layers beside them.
struct precision_probe {
  precision faster = precision::fp32;
  double fp32_seconds = 0, bf16_seconds = 0;
};
template <class... L>
precision_probe probe_precisions(const nn::sequential<L...>& model, std::int64_t rows, int rank_threads = 0) {
  if (rows < 1) fail<invalid_argument>("dml::cost::probe_precisions: expected rows >= 1, found ", rows);
  const thread_budget_scope scope(rank_threads);
  const auto& head = std::get<0>(model.layers);
  std::int64_t width = 1;
  if constexpr (requires { head.input_width(); }) width = head.input_width();
  else if constexpr (requires { head.in; }) width = head.in;
  std::vector<float> x(static_cast<std::size_t>(rows * width));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 17) / 17.f - 0.5f;
  auto fp32 = nn::make_network<dml::host, float>(model, 1);
  auto bf16 = nn::make_network<dml::host, dml::bf16>(model, 1);
  std::vector<float> dy32;
  std::vector<dml::bf16> dy16;
  const nn::context c{.training = true, .seed = 1, .step = 1};
  const auto seconds = [&]<class T>(nn::basic_network<dml::host, T, L...>& net, std::vector<T>& dy) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto y = net.forward(tensor_view<const float>(x.data(), {rows, width}), c);
    dy.assign(static_cast<std::size_t>(y.shape.numel()), T(1e-3f));
    net.backward(tensor_view<const T>(dy.data(), y.shape), c);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  precision_probe p{.faster = precision::fp32, .fp32_seconds = std::numeric_limits<double>::infinity(),
                    .bf16_seconds = std::numeric_limits<double>::infinity()};
  for (int i = 0; i < 6; ++i) {  // a warm one, then 5
    const double a = seconds(fp32, dy32), b = seconds(bf16, dy16);
    if (i == 0) continue;
    p.fp32_seconds = std::min(p.fp32_seconds, a);
    p.bf16_seconds = std::min(p.bf16_seconds, b);
  }
  p.faster = p.bf16_seconds < p.fp32_seconds ? precision::bf16 : precision::fp32;
  return p;
}

}  // namespace dml::cost
