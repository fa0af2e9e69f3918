// SPDX-License-Identifier: Apache-2.0
// tests/nn/test_torch_parity.cpp — dml against PyTorch: same initial weights (safetensors), same batches in
// file order, 50 steps of SGD (Nesterov momentum, weight decay) and of AdamW; per-step losses and final weights.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dml/dml.hpp"
#include "support.hpp"

namespace test_torch_parity {

namespace {

namespace fs = std::filesystem;
const char* const data_dir = "/usr/share/datasets/fashion-mnist";

struct run_result {
  std::vector<double> losses;
  std::vector<float> weights;
};

template <class O, class Net>
std::vector<double> train_dml(Net& net, const O& opt, const dml::train::dataset& d, int steps, std::int64_t batch) {
  dml::optim::state<O> state(net.layout().total);
  dml::nn::softmax_cross_entropy loss_fn;
  dml::tensor<float> dlogits;
  std::vector<float> row_loss(static_cast<std::size_t>(batch));
  std::vector<double> losses;
  for (int s = 1; s <= steps; ++s) {
    const std::int64_t first = (s - 1) * batch;
    dml::tensor_view<const float> x(d.images.data() + first * d.features(), {batch, d.features()});
    auto logits = net.forward(x);
    dlogits.resize(logits.shape);
    losses.push_back(loss_fn.forward_backward<dml::host>(logits, d.labels.data() + first, dlogits.view(), row_loss.data()));
    net.backward(dlogits.cview());
    opt.template update<dml::host>({.n = net.layout().total, .w = net.params().data(), .g = net.grads().data(),
                                    .state = state.pointers(), .step = s, .lr = opt.default_lr()});
  }
  return losses;
}

using dml_test::read_numbers;

template <class O>
void check_parity(const O& opt, const std::string& torch_name) {
  if (!fs::exists(data_dir)) {
    dml_test::skip(std::string(data_dir) + " is missing (scripts/setup installs dataset-fashion-mnist)");
    return;
  }
  const int steps = 50;
  const std::int64_t batch = 64;
  const std::vector<std::int64_t> hidden{128, 64};
  const auto train = dml::train::load_mnist(data_dir, dml::train::split::train);
  const fs::path dir = fs::path(DML_TEST_BINARY_DIR) / ("parity_" + torch_name);
  fs::create_directories(dir);

  dml::nn::network<dml::host, dml::nn::linear<>, dml::nn::relu, dml::nn::linear<>, dml::nn::relu, dml::nn::linear<>>
      net(dml::nn::mlp<2>(784, hidden, 10), 3);
  dml::train::save_weights(net, dir / "init.safetensors");
  const auto ours = train_dml(net, opt, train, steps, batch);

  const std::string cmd = std::string(DML_TEST_PYTHON) + " " + DML_TEST_SOURCE_DIR + "/torch_parity.py " +
                          (dir / "init.safetensors").string() + " " + data_dir + " " + torch_name + " " +
                          std::to_string(steps) + " " + std::to_string(batch) + " 128,64 " +
                          (dir / "torch_losses.txt").string() + " " + (dir / "torch_final.safetensors").string();
  REQUIRE(std::system(cmd.c_str()) == 0);
  const auto theirs = read_numbers(dir / "torch_losses.txt");
  REQUIRE(theirs.size() == ours.size());

  const double max_rel = dml_test::max_rel_difference(theirs, ours).value;
  // Final weights: load PyTorch's into a second network and compare slot by slot.
  dml::nn::network<dml::host, dml::nn::linear<>, dml::nn::relu, dml::nn::linear<>, dml::nn::relu, dml::nn::linear<>>
      ref(dml::nn::mlp<2>(784, hidden, 10), 0);
  dml::train::load_weights(ref, dir / "torch_final.safetensors");
  double max_w = 0, max_abs_w = 0;
  for (std::int64_t i = 0; i < net.layout().total; ++i) {
    max_w = std::max(max_w, double(std::abs(net.params()[i] - ref.params()[i])));
    max_abs_w = std::max(max_abs_w, double(std::abs(ref.params()[i])));
  }
  MESSAGE(torch_name, ": first loss ", ours.front(), " last loss ", ours.back(), "; max_rel_loss_diff=", max_rel,
          " max_abs_weight_diff=", max_w, " (largest weight ", max_abs_w, ")");
  CHECK(ours.back() < ours.front());  // it trains at all
  // README quotes 3.4e-7 (losses) and 5e-6 (weights): the bounds are under 10x those figures (seen: 3.4e-7 and
  // 1.8e-6, adamw), so a regression by an order of magnitude fails.
  CHECK(max_rel <= 2e-6);
  CHECK(max_w <= 2e-5);
}

}  // namespace

TEST_CASE("parity with PyTorch: SGD with Nesterov momentum and weight decay, 50 steps") {
  check_parity(dml::optim::sgd{{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 1e-4f, .nesterov = true}}, "sgd");
}

TEST_CASE("parity with PyTorch: AdamW with PyTorch's defaults, 50 steps") {
  check_parity(dml::optim::adamw{}, "adamw");
}

TEST_CASE("parity with PyTorch: Adam with L2 weight decay, 50 steps") {
  check_parity(dml::optim::adam{{.lr = 2e-3f, .weight_decay = 1e-3f}}, "adam");
}

TEST_CASE("parity with PyTorch: Adagrad with learning-rate decay and weight decay, 50 steps") {
  check_parity(dml::optim::adagrad{{.lr = 0.02f, .lr_decay = 0.01f, .weight_decay = 1e-3f}}, "adagrad");
}

}  // namespace test_torch_parity
