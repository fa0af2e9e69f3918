// SPDX-License-Identifier: Apache-2.0
// dml/ps/downpour.hpp — trains a classifier with a parameter server (Downpour SGD, Dean et al. 2012): servers
// hold the parameters and apply pushed gradients with their optimizer; each worker holds a model replica,
// pulls, computes a gradient on its share of every global batch, and pushes, at the cadence and under the
// staleness bound its consistency policy sets.
// Sits on ps/server.hpp, ps/worker.hpp, nn/ and train/{idx,sampler}.hpp; used by examples/param_server and
// benchmarks/ps_throughput.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <numeric>
#include <span>
#include <thread>
#include <vector>

#include "dml/nn/loss.hpp"
#include "dml/nn/network.hpp"
#include "dml/ps/consistency.hpp"
#include "dml/ps/server.hpp"
#include "dml/ps/worker.hpp"
#include "dml/train/idx.hpp"
#include "dml/train/sampler.hpp"

namespace dml::ps {

struct downpour_options {
  int epochs = 1;
  std::int64_t steps = 0;        // per worker; 0: as many as the epochs give
  std::int64_t batch = 64;       // per worker: a global batch is workers × batch rows
  std::uint64_t seed = 0;        // initial values and data order
  int slow_worker_ms = 0;        // the last worker sleeps this long every step
  std::int64_t eval_every = 0;   // worker 0 also measures test accuracy every this many steps (0: each epoch)
  int die_worker = -1;           // fault hook: this worker stops without a word ...
  std::int64_t die_step = 0;     // ... before this step
  // Called on each worker after every step, and on worker 0 after every evaluation.
  std::function<void(int worker, std::int64_t step, float loss)> on_step;
  std::function<void(int epoch, std::int64_t step, double accuracy, double seconds)> on_eval;
};

struct downpour_result {
  bool server = false;          // this rank served
  bool died = false;            // this rank's fault hook fired
  std::int64_t steps = 0;
  std::vector<double> accuracy; // worker 0: after each evaluation
  double seconds = 0;           // worker: its training loop
  ps::traffic traffic;          // worker: what it pushed and pulled and how long it waited
  std::int64_t acknowledged = 0, lost = 0;  // worker: (range, push) pairs acknowledged, and missing from the
                                            // final primaries' logs (must be 0)
  // Workers that finish: the sums over the workers that finished, gathered by the servers (stopped: how many
  // workers did not finish).
  struct totals_t {
    double acknowledged = 0, lost = 0, bytes_pushed = 0, bytes_pulled = 0, idle_s = 0, seconds = 0, stopped = 0;
    double idle_fraction() const { return seconds > 0 ? idle_s / seconds : 0.0; }
  } totals;
};

// The parameter-server keys of a model: one per parameter, spanning its slot of the flat buffer (padding
// included), so a worker pushes and pulls its whole flat buffer as one span.
inline std::vector<std::int64_t> key_lengths(const nn::param_layout& l) {
  std::vector<std::int64_t> out;
  for (std::size_t i = 0; i < l.slots.size(); ++i)
    out.push_back((i + 1 < l.slots.size() ? l.slots[i + 1].offset : l.total) - l.slots[i].offset);
  return out;
}

template <class Net>
double accuracy(Net& net, const dml::train::dataset& d, std::int64_t batch = 1000) {
  std::int64_t right = 0;
  const std::int64_t width = d.features();
  for (std::int64_t first = 0; first < d.size(); first += batch) {
    const std::int64_t n = std::min(batch, d.size() - first);
    auto logits = net.forward(tensor_view<const float>(d.images.data() + first * width, {n, width}));
    const std::int64_t k = logits.cols();
    for (std::int64_t r = 0; r < n; ++r) {
      const float* row = logits.data + r * k;
      right += std::int32_t(std::max_element(row, row + k) - row) == d.labels[std::size_t(first + r)];
    }
  }
  return d.size() ? double(right) / double(d.size()) : 0.0;
}

// Collective over `world`: ranks [0, o.servers) serve, the others train. Every rank returns its own result.
template <class P, comm::communicator C, class... Layers>
downpour_result downpour(C& world, const nn::sequential<Layers...>& model, const dml::train::dataset& train,
                         const dml::train::dataset& test, P policy, options o, const downpour_options& d) {
  static_assert(diagnose_consistency<P>());
  using net_type = nn::basic_network<host, float, Layers...>;
  o.staleness = policy.staleness();
  const int workers = world.size() - o.servers;
  if (o.servers < 1 || workers < 1)
    fail<invalid_argument>("dml::ps::downpour: expected at least one server and one worker, found ", o.servers,
                           " servers of ", world.size(), " ranks");
  if (o.staleness == 0 && policy.push_every() != 1)
    fail<invalid_argument>("dml::ps::downpour: bsp pushes every step, found push_every ", policy.push_every());
  const auto lengths = key_lengths(nn::make_layout(model));
  downpour_result res;
  if (world.rank() < o.servers) {
    server<C> srv(world, lengths, o);
    srv.serve();
    res.server = true;
    res.died = srv.stopped();
    return res;
  }
  kv_worker<C> kv(world, lengths, o);
  const int me = kv.index();
  net_type net(model, d.seed);
  std::vector<key> keys(lengths.size());
  std::iota(keys.begin(), keys.end(), key(0));
  kv.init(keys, net.params());

  const dml::train::sampler smp(train.size(), d.batch * workers, d.seed, true, true);
  const std::int64_t per_epoch = smp.batches_per_epoch();
  if (per_epoch == 0)
    fail<invalid_argument>("dml::ps::downpour: expected at least one global batch of ", d.batch * workers,
                           " rows, found ", train.size(), " training rows");
  const std::int64_t total = d.steps > 0 ? d.steps : per_epoch * d.epochs;
  const std::int64_t width = train.features();
  std::vector<float> xb, acc(net.grads().size(), 0.f);
  std::vector<std::int32_t> yb;
  std::vector<std::int64_t> order;
  std::vector<float> row_loss;
  tensor<float> dlogits;
  nn::softmax_cross_entropy loss_fn;
  std::vector<std::int64_t> acked;  // seqs of pushes acknowledged
  std::int64_t in_flight = 0, in_flight_seq = 0;
  const float scale = 1.f / float(workers);  // a step's pushes sum to the global batch's mean gradient
  const auto t0 = std::chrono::steady_clock::now();
  auto evaluate = [&](std::int64_t step) {
    const auto ts = kv.pull(keys, net.params());
    kv.wait(ts);
    const double a = accuracy(net, test);
    res.accuracy.push_back(a);
    if (d.on_eval)
      d.on_eval(int(step / per_epoch), step, a, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  };
  std::int64_t step = 0;
  for (; step < total; ++step) {
    if (me == d.die_worker && step == d.die_step) {
      res.died = true;
      res.traffic = kv.stats();
      break;
    }
    if (step % per_epoch == 0) order = smp.order(std::uint64_t(step / per_epoch));
    if (step % policy.pull_every() == 0) kv.wait(kv.pull(keys, net.params()));
    const auto idx = dml::train::sampler::slice(order, step % per_epoch, smp.batch, me, workers);
    const auto n = std::int64_t(idx.size());
    xb.resize(std::size_t(n * width));
    yb.resize(std::size_t(n));
    for (std::int64_t i = 0; i < n; ++i) {
      const auto row = std::size_t(idx[std::size_t(i)]);
      std::copy_n(train.images.data() + row * std::size_t(width), width, xb.data() + i * width);
      yb[std::size_t(i)] = train.labels[row];
    }
    net.zero_grad();
    auto logits = net.forward(tensor_view<const float>(xb.data(), {n, width}));
    if (dlogits.shape() != logits.shape) dlogits = tensor<float>(logits.shape);
    row_loss.resize(std::size_t(n));
    const float loss = loss_fn.forward_backward<host>(logits, yb.data(), dlogits.view(), row_loss.data());
    net.backward(dlogits.cview());
    const auto g = net.grads();
    for (std::size_t i = 0; i < acc.size(); ++i) acc[i] += scale * g[i];
    if (d.slow_worker_ms > 0 && me == workers - 1)
      std::this_thread::sleep_for(std::chrono::milliseconds(d.slow_worker_ms));
    if ((step + 1) % policy.push_every() == 0) {
      if (in_flight) {
        kv.wait(in_flight);
        acked.push_back(in_flight_seq);
      }
      in_flight = kv.push(keys, acc);
      in_flight_seq = kv.pushes();
      std::fill(acc.begin(), acc.end(), 0.f);
    }
    if (d.on_step) d.on_step(me, step, loss);
    const bool epoch_end = (step + 1) % per_epoch == 0;
    if (me == 0 && (d.eval_every > 0 ? (step + 1) % d.eval_every == 0 : epoch_end)) evaluate(step + 1);
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  res.steps = step;
  if (res.died) {
    kv.die();
    return res;
  }
  if (in_flight) {
    kv.wait(in_flight);
    acked.push_back(in_flight_seq);
  }
  // Every acknowledged push must be in the log of each range's final primary.
  for (const auto& rep : kv.report()) {
    const auto& mine = rep.applied[std::size_t(me)];
    for (auto q : acked) {
      ++res.acknowledged;
      if (!std::ranges::binary_search(mine, std::uint64_t(q))) ++res.lost;
    }
  }
  res.traffic = kv.stats();
  const double mine[6] = {double(res.acknowledged), double(res.lost), double(res.traffic.bytes_pushed),
                          double(res.traffic.bytes_pulled), res.traffic.idle_s, res.seconds};
  const auto v = kv.leave(mine);  // the servers sum them over the workers that finish
  res.totals = {v[1], v[2], v[3], v[4], v[5], v[6], double(workers) - v[0]};
  return res;
}

}  // namespace dml::ps
