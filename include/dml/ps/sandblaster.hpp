// SPDX-License-Identifier: Apache-2.0
// dml/ps/sandblaster.hpp — Sandblaster L-BFGS (DistBelief, Dean et al. 2012) on a parameter server: a
// coordinator runs batch L-BFGS, the server shards hold the parameters and the L-BFGS history and do the vector
// operations where the data lives (only scalars reach the coordinator), and workers compute the gradients of
// small portions of the batch, which the coordinator hands out, re-issuing the slowest as backup tasks.
// Sits on ps/transport.hpp (the polling endpoint), nn/loss.hpp and train/idx.hpp; used by examples/param_server
// and benchmarks/ps_sandblaster.
//
// Ranks: 0 coordinates, [1, 1 + servers) are shards (shard s holds the contiguous slice
// [s·n/servers, (s+1)·n/servers) of every vector), the rest are workers. The objective is Σ_p f_p(x) over the
// portions p; a worker evaluates f_p and its gradient with `portion_fn`. A full pass evaluates f and ∇f at the
// trial point XT: the shards zero their GT, workers pull XT, push their portion's gradient into GT (a shard
// takes each portion of a pass once and drops its duplicates), and report f_p; the coordinator counts each
// portion's first report only. Every other step is a batch of vector operations (dot, axpy, copy, scale, swap)
// on the shards, which answer with their partial dot products: the coordinator's traffic per iteration is
// O(history) scalars whatever the parameter count.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/core/error.hpp"
#include "dml/nn/loss.hpp"
#include "dml/ps/transport.hpp"
#include "dml/train/idx.hpp"

namespace dml::ps {

struct sandblaster_options {
  int servers = 1;            // shards: ranks [1, 1 + servers)
  int portions = 16;          // portions of the batch per pass, handed out to the workers
  int history = 10;           // L-BFGS pairs (s, y) kept on the shards
  int iterations = 20;        // L-BFGS iterations
  bool backup_tasks = true;   // re-issue outstanding portions to idle workers, taking the first copy done
  int max_copies = 2;         // copies of one portion running at once, with backup tasks
  double c1 = 1e-4;           // Armijo's sufficient decrease
  double backtrack = 0.5;     // step shrink per rejected trial
  int max_trials = 30;        // trials per line search before giving up
  int slow_worker_ms = 0;     // the last worker sleeps this long after each portion (a straggler)
  // Coordinator: after every iteration, the objective at the new iterate and the seconds since the start.
  std::function<void(int iteration, double loss, double seconds)> on_iteration;
};

// f_p(x): fills grad (x's size) with ∇f_p(x) and returns f_p(x). Called on workers only.
using portion_fn = std::function<double(int portion, std::span<const float> x, std::span<float> grad)>;

// f_p of a classifier: the mean cross-entropy over the whole of `train`, portion p holding rows
// [p·N/portions, (p+1)·N/portions) and contributing their losses / N, evaluated `chunk` rows at a time by net
// (one network per worker: the function writes its parameters).
template <class Net>
portion_fn classifier_portions(Net& net, const dml::train::dataset& train, int portions, std::int64_t chunk) {
  if (portions < 1 || chunk < 1)
    fail<invalid_argument>("dml::ps::classifier_portions: expected portions >= 1 and chunk >= 1, found ", portions,
                           " and ", chunk);
  struct scratch {
    tensor<float> dlogits;
    std::vector<float> row_loss;
  };
  return [&net, &train, portions, chunk, sc = std::make_shared<scratch>()](int p, std::span<const float> x,
                                                                          std::span<float> g) {
    const std::int64_t N = train.size(), width = train.features();
    std::ranges::copy(x, net.params().begin());
    std::ranges::fill(g, 0.f);
    double loss = 0;
    const std::int64_t lo = N * p / portions, hi = N * (p + 1) / portions;
    for (std::int64_t first = lo; first < hi; first += chunk) {
      const std::int64_t rows = std::min(chunk, hi - first);
      net.zero_grad();
      auto logits = net.forward(tensor_view<const float>(train.images.data() + first * width, {rows, width}));
      if (sc->dlogits.shape() != logits.shape) sc->dlogits = tensor<float>(logits.shape);
      sc->row_loss.resize(std::size_t(rows));
      loss += nn::softmax_cross_entropy{}.forward_backward<host>(logits, train.labels.data() + first,
                                                                 sc->dlogits.view(), sc->row_loss.data(), N);
      net.backward(sc->dlogits.cview());
      const auto gr = net.grads();
      for (std::size_t i = 0; i < g.size(); ++i) g[i] += gr[i];
    }
    return loss;
  };
}

struct sandblaster_result {
  enum role_t { coordinator, shard, worker } role = worker;
  // Coordinator:
  std::vector<float> x;                 // the final iterate (gathered once, after the last iteration)
  std::vector<double> losses;           // f at the start, then after every iteration
  int iterations = 0, passes = 0;       // iterations done, full passes (line-search trials included)
  std::int64_t portions_counted = 0;    // first results counted: passes × portions
  std::int64_t tasks_issued = 0, backups_issued = 0, late_results = 0;  // late: a portion's later copies
  std::int64_t coordinator_bytes = 0;   // sent and received, headers included, the final gather excluded
  std::int64_t coordinator_messages = 0;
  double seconds = 0;
  double bytes_per_iteration() const { return iterations ? double(coordinator_bytes) / iterations : 0.0; }
  // Shard: portions applied, and duplicates (or stale copies) dropped.
  std::int64_t applied = 0, dropped = 0;
  // Worker: portions computed.
  std::int64_t computed = 0;
};

namespace detail::sandblaster {

enum class msg : std::int64_t { task = 100, done, ops, ops_reply, pull, pull_reply, push, push_ack, gather,
                                 gather_reply };

// One vector operation on every shard's slices. Vectors: 0 X, 1 G, 2 D, 3 XT, 4 GT, then S_i, then Y_i.
struct op {
  enum code_t : std::uint8_t { dot, axpy, scale, copy, swap, begin_pass } code;
  std::uint8_t a = 0, b = 0;
  std::uint8_t pad[5] = {};
  double c = 0;  // axpy: b += c·a; scale: a *= c; begin_pass: the pass
};
static_assert(sizeof(op) == 16);
enum vec : std::uint8_t { X, G, D, XT, GT, first_pair };

inline std::int64_t slice_begin(std::int64_t n, int servers, int s) { return n * s / servers; }

}  // namespace detail::sandblaster

// Collective over `world` (1 + o.servers + workers ranks). x0: the initial parameters, the same on every rank.
template <comm::communicator C>
sandblaster_result sandblaster(C& world, std::span<const float> x0, const portion_fn& f, const sandblaster_options& o) {
  namespace sb = detail::sandblaster;
  using sb::op;
  if (o.servers < 1 || world.size() < o.servers + 2)
    fail<invalid_argument>("dml::ps::sandblaster: expected 1 coordinator, servers >= 1 and at least one worker, "
                           "found servers ", o.servers, " in a world of ", world.size(), " ranks");
  if (o.history < 1) fail<invalid_argument>("dml::ps::sandblaster: expected history >= 1, found ", o.history);
  if (o.history > 100) fail<invalid_argument>("dml::ps::sandblaster: expected history <= 100, found ", o.history);
  if (o.portions < 1) fail<invalid_argument>("dml::ps::sandblaster: expected portions >= 1, found ", o.portions);
  if (o.iterations < 0)
    fail<invalid_argument>("dml::ps::sandblaster: expected iterations >= 0, found ", o.iterations);
  if (o.max_copies < 2) fail<invalid_argument>("dml::ps::sandblaster: expected max_copies >= 2, found ", o.max_copies);
  if (!(o.c1 > 0 && o.c1 < 1))
    fail<invalid_argument>("dml::ps::sandblaster: expected 0 < c1 < 1, found ", o.c1);
  if (!(o.backtrack > 0 && o.backtrack < 1))
    fail<invalid_argument>("dml::ps::sandblaster: expected 0 < backtrack < 1, found ", o.backtrack);
  if (o.max_trials < 1) fail<invalid_argument>("dml::ps::sandblaster: expected max_trials >= 1, found ", o.max_trials);
  if (x0.empty()) fail<invalid_argument>("dml::ps::sandblaster: expected parameters, found none");
  if (std::int64_t(x0.size()) < o.servers)
    fail<invalid_argument>("dml::ps::sandblaster: expected at least one parameter per server, found ", x0.size(),
                           " for ", o.servers, " servers");

  const int me = world.rank(), servers = o.servers, workers = world.size() - 1 - servers;
  const auto n = std::int64_t(x0.size());
  auto is_shard = [&](int r) { return r >= 1 && r <= servers; };
  std::vector<int> everyone;
  for (int r = 0; r < world.size(); ++r)
    if (r != me) everyone.push_back(r);
  std::vector<int> peers;  // workers hear the coordinator and shards; shards the coordinator and workers
  for (int r : everyone)
    if (me == 0 || r == 0 || is_shard(me) != is_shard(r)) peers.push_back(r);
  detail::endpoint<C> ep(world, peers, peers);
  typename detail::endpoint<C>::backoff bo;
  using header = detail::header;
  auto bytes_of = [](const auto& v) {
    std::vector<std::byte> b;
    detail::put_bytes(b, v.data(), v.size() * sizeof(v[0]));
    return detail::share(std::move(b));
  };
  auto read_doubles = [](std::span<const std::byte> p) {
    std::vector<double> v(p.size() / sizeof(double));
    if (!v.empty()) std::memcpy(v.data(), p.data(), v.size() * sizeof(double));
    return v;
  };
  sandblaster_result res;
  const auto t0 = clock::now();

  if (is_shard(me)) {  // ------------------------------------------------------------------------- shard
    res.role = sandblaster_result::shard;
    const int s = me - 1;
    const std::int64_t b = sb::slice_begin(n, servers, s), len = sb::slice_begin(n, servers, s + 1) - b;
    std::vector<std::vector<double>> v(std::size_t(sb::first_pair + 2 * o.history),
                                       std::vector<double>(std::size_t(len), 0.0));
    for (std::int64_t i = 0; i < len; ++i) v[sb::X][std::size_t(i)] = x0[std::size_t(b + i)];
    std::int64_t pass = -1, applied_this_pass = 0;
    std::vector<bool> applied(std::size_t(o.portions), false);
    std::vector<float> xt(static_cast<std::size_t>(len));
    bool stop = false;
    auto vecs = [&](std::uint8_t i) -> std::vector<double>& {
      if (i >= v.size())
        fail<invalid_argument>("dml::ps::sandblaster: expected a vector below ", v.size(), ", found ", int(i));
      return v[i];
    };
    auto on = [&](int p, const header& h, std::span<const std::byte> pl) {
      switch (h.type) {
        case std::int64_t(detail::msg::bye): stop = stop || p == 0; break;
        case std::int64_t(sb::msg::ops): {
          std::vector<double> out;
          for (std::size_t at = 0; at + sizeof(op) <= pl.size(); at += sizeof(op)) {
            op q;
            std::memcpy(&q, pl.data() + at, sizeof(op));
            switch (q.code) {
              case op::dot: {
                const auto &x = vecs(q.a), &y = vecs(q.b);
                double d = 0;
                for (std::int64_t i = 0; i < len; ++i) d += x[std::size_t(i)] * y[std::size_t(i)];
                out.push_back(d);
                break;
              }
              case op::axpy: {
                const auto& x = vecs(q.a);
                auto& y = vecs(q.b);
                for (std::int64_t i = 0; i < len; ++i) y[std::size_t(i)] += q.c * x[std::size_t(i)];
                break;
              }
              case op::scale:
                for (auto& e : vecs(q.a)) e *= q.c;
                break;
              case op::copy: vecs(q.b) = vecs(q.a); break;
              case op::swap: std::swap(vecs(q.a), vecs(q.b)); break;
              case op::begin_pass:
                // The pass before must have taken every portion exactly once.
                if (pass >= 0 && applied_this_pass != o.portions)
                  fail<error>("dml::ps::sandblaster: shard ", s, " expected ", o.portions,
                                    " portions in pass ", pass, ", found ", applied_this_pass);
                pass = std::int64_t(q.c);
                applied_this_pass = 0;
                std::fill(applied.begin(), applied.end(), false);
                std::ranges::fill(v[sb::GT], 0.0);
                for (std::int64_t i = 0; i < len; ++i) xt[std::size_t(i)] = float(v[sb::XT][std::size_t(i)]);
                break;
              default: fail<invalid_argument>("dml::ps::sandblaster: expected an operation code, found ", int(q.code));
            }
          }
          ep.send(0, {std::int64_t(sb::msg::ops_reply), h.id}, bytes_of(out));
          break;
        }
        case std::int64_t(sb::msg::pull): {
          header r{std::int64_t(sb::msg::pull_reply), h.id, pass};
          ep.send(p, r, bytes_of(xt));
          break;
        }
        case std::int64_t(sb::msg::push): {
          const auto portion = std::size_t(h.aux);
          header r{std::int64_t(sb::msg::push_ack), h.id, h.seq};
          if (h.seq == pass && portion < applied.size() && !applied[portion] &&
              pl.size() == std::size_t(len) * sizeof(float)) {
            applied[portion] = true;
            ++applied_this_pass;
            ++res.applied;
            auto& gt = v[sb::GT];
            for (std::int64_t i = 0; i < len; ++i) {
              float g;
              std::memcpy(&g, pl.data() + std::size_t(i) * sizeof(float), sizeof(float));
              gt[std::size_t(i)] += g;
            }
          } else {
            ++res.dropped;
          }
          ep.send(p, r);
          break;
        }
        case std::int64_t(sb::msg::gather): {
          std::vector<float> x(static_cast<std::size_t>(len));
          for (std::int64_t i = 0; i < len; ++i) x[std::size_t(i)] = float(v[sb::X][std::size_t(i)]);
          ep.send(0, {std::int64_t(sb::msg::gather_reply), h.id}, bytes_of(x));
          break;
        }
        default: fail<invalid_argument>("dml::ps::sandblaster: shard ", s, " found message type ", h.type);
      }
    };
    while (!stop) bo.idle(!ep.poll(on));
    ep.finish();
    return res;
  }

  if (me > servers) {  // ------------------------------------------------------------------------ worker
    res.role = sandblaster_result::worker;
    const int w = me - 1 - servers;
    std::vector<float> x(static_cast<std::size_t>(n)), g(static_cast<std::size_t>(n));
    std::int64_t have = -1;  // the pass whose XT x holds
    bool gone = false;       // the coordinator has finished
    std::int64_t task_pass = -1, task_portion = -1, replies = 0, reply_pass = 0, id = 0;
    bool has_task = false;
    auto on = [&](int p, const header& h, std::span<const std::byte> pl) {
      if (h.type == std::int64_t(detail::msg::bye)) {
        gone = gone || p == 0;
      } else if (h.type == std::int64_t(sb::msg::task)) {
        task_pass = h.seq;
        task_portion = h.aux;
        has_task = true;
      } else if (h.type == std::int64_t(sb::msg::pull_reply) && h.id == id) {
        const auto b = sb::slice_begin(n, servers, p - 1);
        if (pl.size() != std::size_t(sb::slice_begin(n, servers, p) - b) * sizeof(float))
          fail<error>("dml::ps::sandblaster: worker ", w, " expected shard ", p - 1, "'s slice, found ",
                            pl.size(), " bytes");
        if (!pl.empty()) std::memcpy(x.data() + b, pl.data(), pl.size());
        if (h.seq != task_pass) reply_pass = h.seq;
        ++replies;
      } else if (h.type == std::int64_t(sb::msg::push_ack) && h.id == id) {
        ++replies;
      }
    };
    auto wait_replies = [&] {
      while (replies < servers && !gone) bo.idle(!ep.poll(on));
    };
    while (!gone) {
      if (!has_task) {
        bo.idle(!ep.poll(on));
        continue;
      }
      has_task = false;
      bool stale = false;
      if (have != task_pass) {
        ++id;
        replies = 0;
        reply_pass = task_pass;
        for (int s = 1; s <= servers; ++s) ep.send(s, {std::int64_t(sb::msg::pull), id, task_pass});
        wait_replies();
        stale = reply_pass != task_pass;  // the shards moved on: this copy is too late to count
        have = stale ? -1 : task_pass;
      }
      double loss = 0;
      if (!stale && !gone) {
        loss = f(int(task_portion), x, g);
        ++res.computed;
        if (o.slow_worker_ms > 0 && w == workers - 1)
          std::this_thread::sleep_for(std::chrono::milliseconds(o.slow_worker_ms));
        ++id;
        replies = 0;
        for (int s = 1; s <= servers; ++s) {
          const auto b = sb::slice_begin(n, servers, s - 1), e = sb::slice_begin(n, servers, s);
          std::vector<std::byte> part;
          detail::put_bytes(part, g.data() + b, std::size_t(e - b) * sizeof(float));
          header h{std::int64_t(sb::msg::push), id, task_pass};
          h.aux = task_portion;
          ep.send(s, h, detail::share(std::move(part)));
        }
        wait_replies();
      }
      if (gone) break;
      header h{std::int64_t(sb::msg::done), 0, task_pass};
      h.aux = task_portion;
      ep.send(0, h, bytes_of(std::vector<double>{loss, stale ? 1.0 : 0.0}));
    }
    ep.finish();
    return res;
  }

  // ---------------------------------------------------------------------------------------------- coordinator
  res.role = sandblaster_result::coordinator;
  auto sent = [&](std::size_t payload) {
    res.coordinator_bytes += std::int64_t(sizeof(header) + payload);
    ++res.coordinator_messages;
  };
  std::int64_t id = 0;
  // Worker state, kept across passes: a worker still running a late copy is busy.
  std::vector<std::int64_t> busy_portion(std::size_t(workers), -1);
  // Runs a batch of operations on every shard; returns the dot products summed over the shards.
  auto run_ops = [&](const std::vector<op>& ops) {
    ++id;
    const auto payload = bytes_of(ops);
    for (int s = 1; s <= servers; ++s) {
      ep.send(s, {std::int64_t(sb::msg::ops), id}, payload);
      sent(payload->size());
    }
    std::vector<double> sum;
    int replies = 0;
    while (replies < servers)
      bo.idle(!ep.poll([&](int peer, const header& h, std::span<const std::byte> pl) {
        sent(pl.size());
        if (h.type == std::int64_t(sb::msg::done)) {  // a late copy from the pass before: its worker is free
          busy_portion[std::size_t(peer - 1 - servers)] = -1;
          ++res.late_results;
          return;
        }
        if (h.type != std::int64_t(sb::msg::ops_reply) || h.id != id)
          fail<error>("dml::ps::sandblaster: the coordinator expected an ops reply, found type ", h.type);
        const auto v = read_doubles(pl);
        if (sum.empty()) sum.assign(v.size(), 0.0);
        for (std::size_t i = 0; i < v.size() && i < sum.size(); ++i) sum[i] += v[i];
        ++replies;
      }));
    return sum;
  };
  std::int64_t pass = -1;
  // One full pass at XT: every portion's f_p summed once; GT = ∇f(XT) on the shards.
  auto evaluate = [&](std::vector<op> ops) {
    ++pass;
    ops.push_back({op::begin_pass, 0, 0, {}, double(pass)});
    run_ops(ops);
    const int P = o.portions;
    std::vector<int> copies(std::size_t(P), 0);
    std::vector<bool> done(std::size_t(P), false);
    std::vector<std::int64_t> issued_at(std::size_t(P), 0);
    std::vector<std::vector<int>> running_on(static_cast<std::size_t>(P));
    int next = 0, finished = 0;
    std::int64_t tick = 0;
    std::vector<double> loss(std::size_t(P), 0.0);  // summed in portion order: the same f whoever finished first
    auto give = [&](int w, int p) {
      header h{std::int64_t(sb::msg::task), 0, pass};
      h.aux = p;
      ep.send(1 + servers + w, h);
      sent(0);
      busy_portion[std::size_t(w)] = p;
      ++copies[std::size_t(p)];
      running_on[std::size_t(p)].push_back(w);
      if (copies[std::size_t(p)] == 1) issued_at[std::size_t(p)] = ++tick;
      ++res.tasks_issued;
    };
    while (finished < P) {
      for (int w = 0; w < workers; ++w) {
        if (busy_portion[std::size_t(w)] >= 0) continue;
        if (next < P) {
          give(w, next++);
          continue;
        }
        if (!o.backup_tasks) break;
        // A backup: the outstanding portion with the fewest copies, the longest running first, not on w.
        int best = -1;
        for (int p = 0; p < P; ++p) {
          if (done[std::size_t(p)] || copies[std::size_t(p)] >= o.max_copies ||
              std::ranges::find(running_on[std::size_t(p)], w) != running_on[std::size_t(p)].end())
            continue;
          const auto c = copies[std::size_t(p)];
          if (best < 0 || c < copies[std::size_t(best)] ||
              (c == copies[std::size_t(best)] && issued_at[std::size_t(p)] < issued_at[std::size_t(best)]))
            best = p;
        }
        if (best >= 0) {
          give(w, best);
          ++res.backups_issued;
        }
      }
      bo.idle(!ep.poll([&](int peer, const header& h, std::span<const std::byte> pl) {
        sent(pl.size());
        if (h.type != std::int64_t(sb::msg::done))
          fail<error>("dml::ps::sandblaster: the coordinator expected a portion report, found type ", h.type);
        const int w = peer - 1 - servers;
        busy_portion[std::size_t(w)] = -1;
        const auto v = read_doubles(pl);
        const auto p = std::size_t(h.aux);
        if (h.seq != pass) {
          ++res.late_results;
          return;
        }
        auto& on = running_on[p];
        on.erase(std::ranges::find(on, w));
        --copies[p];
        if (done[p] || v.size() != 2 || v[1] != 0.0) {
          ++res.late_results;
          return;
        }
        done[p] = true;
        ++finished;
        ++res.portions_counted;
        loss[p] = v[0];
      }));
    }
    ++res.passes;
    double total = 0;
    for (double l : loss) total += l;
    return total;
  };

  const int M = o.history;
  auto S = [&](int i) { return std::uint8_t(sb::first_pair + i); };
  auto Y = [&](int i) { return std::uint8_t(sb::first_pair + M + i); };
  double fx = evaluate({{op::copy, sb::X, sb::XT}});
  run_ops({{op::swap, sb::XT, sb::X}, {op::swap, sb::GT, sb::G}});
  res.losses.push_back(fx);
  std::vector<double> rho(static_cast<std::size_t>(M)), alpha(static_cast<std::size_t>(M));
  int stored = 0, newest = -1;  // pairs held, and the slot of the newest
  double gamma = 1;
  for (int it = 0; it < o.iterations; ++it) {
    // The two-loop recursion, D = -H·G, one round of scalars per pair and loop.
    auto slot = [&](int j) { return (newest - j + M) % M; };  // j = 0: newest
    double gd;
    if (stored == 0) {
      gd = run_ops({{op::copy, sb::G, sb::D}, {op::scale, sb::D, 0, {}, -1.0}, {op::dot, sb::G, sb::D}})[0];
    } else {
      std::vector<op> ops{{op::copy, sb::G, sb::D}, {op::dot, S(slot(0)), sb::D}};
      for (int j = 0; j < stored; ++j) {
        const int i = slot(j);
        alpha[std::size_t(i)] = rho[std::size_t(i)] * run_ops(ops)[0];
        ops = {{op::axpy, Y(i), sb::D, {}, -alpha[std::size_t(i)]}};
        if (j + 1 < stored) ops.push_back({op::dot, S(slot(j + 1)), sb::D});
      }
      ops.push_back({op::scale, sb::D, 0, {}, gamma});
      for (int j = stored - 1; j >= 0; --j) {
        const int i = slot(j);
        ops.push_back({op::dot, Y(i), sb::D});
        const double beta = rho[std::size_t(i)] * run_ops(ops)[0];
        ops = {{op::axpy, S(i), sb::D, {}, alpha[std::size_t(i)] - beta}};
      }
      ops.push_back({op::scale, sb::D, 0, {}, -1.0});
      ops.push_back({op::dot, sb::G, sb::D});
      gd = run_ops(ops)[0];
      if (!(gd < 0)) {  // not a descent direction: forget the history, go down the gradient
        stored = 0;
        gd = run_ops({{op::copy, sb::G, sb::D}, {op::scale, sb::D, 0, {}, -1.0}, {op::dot, sb::G, sb::D}})[0];
      }
    }
    if (!(gd < 0)) break;  // a stationary point
    // Backtracking line search on f alone: each trial is one full pass.
    double t = stored == 0 ? std::min(1.0, 1.0 / std::sqrt(-gd)) : 1.0, ft = 0;
    bool ok = false;
    for (int trial = 0; trial < o.max_trials && !ok; ++trial, t *= (ok ? 1.0 : o.backtrack)) {
      ft = evaluate({{op::copy, sb::X, sb::XT}, {op::axpy, sb::D, sb::XT, {}, t}});
      ok = ft <= fx + o.c1 * t * gd;
      if (ok) break;
    }
    if (!ok) break;
    // Accept: s = XT - X, y = GT - G into the next slot; X, G take XT, GT.
    const int k = (newest + 1) % M;
    const auto sy_yy = run_ops({{op::copy, sb::XT, S(k)}, {op::axpy, sb::X, S(k), {}, -1.0},
                                {op::copy, sb::GT, Y(k)}, {op::axpy, sb::G, Y(k), {}, -1.0},
                                {op::dot, S(k), Y(k)}, {op::dot, Y(k), Y(k)},
                                {op::swap, sb::XT, sb::X}, {op::swap, sb::GT, sb::G}});
    if (sy_yy[0] > 1e-10 * sy_yy[1] && sy_yy[1] > 0) {  // the curvature condition; else skip the pair
      newest = k;
      stored = std::min(stored + 1, M);
      rho[std::size_t(k)] = 1.0 / sy_yy[0];
      gamma = sy_yy[0] / sy_yy[1];
    } else {
      stored = std::min(stored, M - 1);  // slot k held the oldest pair, now overwritten
    }
    fx = ft;
    res.losses.push_back(fx);
    res.iterations = it + 1;
    if (o.on_iteration) o.on_iteration(it, fx, std::chrono::duration<double>(clock::now() - t0).count());
  }
  res.seconds = std::chrono::duration<double>(clock::now() - t0).count();
  // The final iterate, once (not counted in the per-iteration traffic).
  res.x.resize(static_cast<std::size_t>(n));
  ++id;
  for (int s = 1; s <= servers; ++s) ep.send(s, {std::int64_t(sb::msg::gather), id});
  int replies = 0;
  while (replies < servers)
    bo.idle(!ep.poll([&](int p, const header& h, std::span<const std::byte> pl) {
      if (h.type != std::int64_t(sb::msg::gather_reply)) return;  // late portion reports
      const auto b = sb::slice_begin(n, servers, p - 1);
      if (!pl.empty()) std::memcpy(res.x.data() + b, pl.data(), pl.size());
      ++replies;
    }));
  ep.finish();
  return res;
}

}  // namespace dml::ps
