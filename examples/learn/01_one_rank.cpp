// SPDX-License-Identifier: Apache-2.0
// examples/learn/01_one_rank.cpp — the training loop with nothing hidden: one rank, no trainer, no communicator.
//
// What it teaches:
//  - a model is a dml::nn::sequential of layers; dml::nn::make_network gives it one flat buffer of parameters
//    and a mirror of it for gradients;
//  - a step is forward, the fused softmax + cross-entropy (the loss and its gradient in one pass),
//    backward, and one fused optimizer pass over the whole flat buffer; optim::state holds the
//    optimizer's per-parameter floats (AdamW's two moments) in the same layout;
//  - dml::trainer (example 02) runs this same step on any number of ranks.
// Run: learn_01_one_rank [steps]
#include <cstdio>
#include <vector>

// Each header brings what it names (dml/dml.hpp brings everything, at about twice the compile time).
#include "dml/nn/loss.hpp"
#include "dml/nn/network.hpp"
#include "dml/optim/adam.hpp"
#include "dml/train/flags.hpp"
#include "dml/train/sampler.hpp"

constexpr std::int64_t samples = 512, features = 8, classes = 4, batch = 64;

// Points in [-1, 1)^8 whose class is the quadrant of their first two coordinates: learnable by a small
// MLP, and the same on every machine (Philox draws depend on their index only).
void make_data(std::vector<float>& x, std::vector<std::int32_t>& y) {
  const dml::rng_stream rng{42, 0};
  x.resize(samples * features);
  y.resize(samples);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = rng.uniform(i, -1.f, 1.f);
  for (std::int64_t s = 0; s < samples; ++s) y[s] = (x[s * features] > 0) + 2 * (x[s * features + 1] > 0);
}

int main(int argc, char** argv) {
  int steps = 200;  // the command line (dml/train/flags.hpp): --help describes it, a bad number is refused
  dml::flags cli("learn_01_one_rank");
  cli.positional("STEPS", steps, "optimizer steps").min(0);
  if (const auto status = cli.parse_for_main(argc, argv)) return *status;
  std::vector<float> x, xb;
  std::vector<std::int32_t> y, yb;
  make_data(x, y);

  const auto model = dml::nn::sequential{dml::nn::linear{features, 32}, dml::nn::relu{}, dml::nn::linear{32, classes}};
  auto net = dml::nn::make_network(model, /*seed=*/1);  // on the host; parameters start as PyTorch's would
  const dml::optim::adamw opt({.lr = 1e-2f});
  dml::optim::state<dml::optim::adamw> state(net.layout().total);
  const dml::nn::softmax_cross_entropy loss_fn;
  const dml::train::sampler sampler(samples, batch, /*seed=*/1);  // a fresh shuffle every epoch
  dml::tensor<float> dlogits;
  std::vector<float> row_loss(batch);  // the loss's per-row scratch

  for (int step = 1; step <= steps; ++step) {
    const std::int64_t rows = sampler.gather(step - 1, 0, 1, x.data(), features, y.data(), xb, yb);
    const auto logits = net.forward({xb.data(), {rows, features}});
    dlogits.resize(logits.shape);
    const float loss = loss_fn.forward_backward<dml::host>(logits, yb.data(), dlogits.view(), row_loss.data());
    net.backward(dlogits.cview());  // writes every parameter's gradient into net.grads()
    opt.update<dml::host>({.n = net.layout().total, .w = net.params().data(), .g = net.grads().data(),
                           .state = state.pointers(), .step = step, .lr = opt.default_lr()});
    if (step % 50 == 0) std::printf("step %d loss %.4f\n", step, static_cast<double>(loss));
  }

  // Inference: training = false turns dropout (if any) off.
  const auto logits = net.forward({x.data(), {samples, features}}, {.training = false});
  const auto correct = dml::nn::count_correct<dml::host>(logits, y.data());
  std::printf("%lld parameters, accuracy=%.3f\n", static_cast<long long>(net.layout().numel),
              static_cast<double>(correct) / samples);
  return 0;
}
