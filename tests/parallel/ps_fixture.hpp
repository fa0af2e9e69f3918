// SPDX-License-Identifier: Apache-2.0
// tests/parallel/ps_fixture.hpp — what the parameter-server tests share: a separable data set, a small MLP,
// synchronous data parallel's per-step losses computed on one rank, and the options of a fail-over run.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "dml/nn/loss.hpp"
#include "dml/nn/mlp.hpp"
#include "dml/nn/network.hpp"
#include "dml/ps/ps.hpp"
#include "dml/train/idx.hpp"
#include "dml/train/sampler.hpp"

namespace ps_fixture {

using namespace dml;

// A separable 4-class problem: class c's mean is at 2·e_c in 16 dimensions, plus noise.
inline train::dataset blobs(std::int64_t n, std::uint64_t seed) {
  train::dataset d;
  d.images = tensor<float>(shape{n, 16});
  d.labels.resize(std::size_t(n));
  std::mt19937 g(static_cast<unsigned>(seed));
  std::normal_distribution<float> noise(0.f, 0.7f);
  for (std::int64_t i = 0; i < n; ++i) {
    const int c = int(i % 4);
    d.labels[std::size_t(i)] = c;
    for (int j = 0; j < 16; ++j) d.images.data()[i * 16 + j] = noise(g) + (j == c ? 2.f : 0.f);
  }
  return d;
}

inline auto small_model() {
  const std::int64_t hidden[] = {32};
  return nn::mlp<1>(16, hidden, 4);
}

template <class... L>
auto make_net(const nn::sequential<L...>& m, std::uint64_t seed) {
  return std::make_unique<nn::basic_network<host, float, L...>>(m, seed);
}

// Synchronous data parallel on one rank: global batches of workers × batch rows in the sampler's order,
// plain SGD on the mean gradient; returns the mean of the workers' losses per step.
inline std::vector<double> sync_losses(const train::dataset& train, int workers, std::int64_t batch,
                                       std::int64_t steps, float lr, std::uint64_t seed) {
  std::vector<double> want;
  auto net_ptr = make_net(small_model(), seed);
  auto& net = *net_ptr;
  const train::sampler smp(train.size(), batch * workers, seed, true, true);
  nn::softmax_cross_entropy xent;
  for (std::int64_t s = 0; s < steps; ++s) {
    const auto order = smp.order(std::uint64_t(s / smp.batches_per_epoch()));
    double loss = 0;
    std::vector<float> grad(net.grads().size(), 0.f);
    for (int w = 0; w < workers; ++w) {
      const auto idx = train::sampler::slice(order, s % smp.batches_per_epoch(), smp.batch, w, workers);
      std::vector<float> x;
      std::vector<std::int32_t> y;
      for (auto i : idx) {
        x.insert(x.end(), train.images.data() + i * 16, train.images.data() + (i + 1) * 16);
        y.push_back(train.labels[std::size_t(i)]);
      }
      net.zero_grad();
      auto logits = net.forward(tensor_view<const float>(x.data(), {std::int64_t(idx.size()), 16}));
      tensor<float> dl(logits.shape);
      std::vector<float> rl(idx.size());
      loss += xent.forward_backward<host>(logits, y.data(), dl.view(), rl.data());
      net.backward(dl.cview());
      for (std::size_t i = 0; i < grad.size(); ++i) grad[i] += net.grads()[i] / float(workers);
    }
    want.push_back(loss / workers);
    for (std::size_t i = 0; i < grad.size(); ++i) net.params()[i] -= lr * grad[i];
  }
  return want;
}

// Three servers, one replica of each range, and server 1 stopping at clock 20: the fail-over runs. The timeout is
// long enough that a thread descheduled on a loaded machine (or slowed by ThreadSanitizer) is not taken for
// dead; the stopped server costs one timeout.
inline ps::options failover_options() {
  ps::options o;
  o.servers = 3;
  o.replicas = 1;
  o.max_range = 64;
  o.timeout = std::chrono::milliseconds(1000);
  o.optimizer = {ps::server_optimizer::sgd, 0.2f};
  o.fault = [](int s, std::int64_t clk) { return s == 1 && clk >= 20; };
  return o;
}

}  // namespace ps_fixture
