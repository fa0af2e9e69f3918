// SPDX-License-Identifier: Apache-2.0
// tests/nn/test_gpt_parity.cpp — dml's GPT against PyTorch (tests/nn/gpt_reference.py): the same initial weights
// (safetensors), the same random token batches, 20 AdamW steps through dml's trainer on one rank; per-step
// losses and final weights, with and without biases; and a bf16 run against PyTorch's fp32 losses.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "dml/dml.hpp"
#include "dml/nn/gpt.hpp"
#include "support.hpp"

namespace test_gpt_parity {

namespace {

namespace fs = std::filesystem;
using namespace dml;

constexpr std::int64_t vocab = 64, seq = 16, layers = 2, d_model = 32, heads = 4, batch = 4;
constexpr int steps = 20;
// PyTorch's AdamW defaults but a larger step, so 20 steps move the weights well away from their start. Both
// sides decay every parameter (dml's update is one pass over the flat buffer; the reference uses one group).
const optim::adamw::options adamw_options{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f};

nn::gpt_config config(bool bias) {
  return {.vocab = vocab, .seq = seq, .layers = layers, .d_model = d_model, .heads = heads, .dropout = 0.f,
          .bias = bias, .eps = 1e-5f};
}

// steps × batch × (seq + 1) tokens from a fixed generator: step s uses rows [batch, seq + 1]. Each row starts
// at a random token and mostly follows t → (5t + 3) mod vocab, with a random token a quarter of the time,
// so there is something to learn (uniform tokens would leave the loss at ln(vocab) from the start).
std::vector<std::int32_t> make_batches() {
  std::mt19937 gen(1234);
  std::uniform_int_distribution<std::int32_t> token(0, static_cast<std::int32_t>(vocab - 1));
  std::uniform_int_distribution<int> quarter(0, 3);
  std::vector<std::int32_t> t(static_cast<std::size_t>(steps * batch * (seq + 1)));
  for (std::size_t i = 0; i < t.size(); ++i) {
    const bool starts_row = i % static_cast<std::size_t>(seq + 1) == 0;
    t[i] = starts_row || quarter(gen) == 0 ? token(gen) : static_cast<std::int32_t>((5 * t[i - 1] + 3) % vocab);
  }
  return t;
}

void write_batches(const fs::path& p, const std::vector<std::int32_t>& tokens) {
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * sizeof(std::int32_t)));
  REQUIRE(out.good());
}

void write_config(const fs::path& p, bool bias) {
  const auto& o = adamw_options;
  std::ofstream out(p);
  out.precision(9);
  out << "{\"vocab\": " << vocab << ", \"seq\": " << seq << ", \"layers\": " << layers << ", \"d_model\": " << d_model
      << ", \"heads\": " << heads << ", \"bias\": " << (bias ? "true" : "false") << ", \"tie\": false, \"eps\": 1e-5"
      << ", \"steps\": " << steps << ", \"batch\": " << batch << ", \"lr\": " << o.lr << ", \"beta1\": " << o.beta1
      << ", \"beta2\": " << o.beta2 << ", \"adam_eps\": " << o.eps << ", \"weight_decay\": " << o.weight_decay << "}\n";
  REQUIRE(out.good());
}

using dml_test::read_numbers;

struct dml_run {
  std::vector<float> init, final_params;
  std::vector<double> losses;
  nn::param_layout layout;
};

// Trains on one rank of comm::local; step s feeds the ids row[:, :seq] (as floats) and targets row[:, 1:].
template <class Precision>
dml_run train_dml(bool bias, const std::vector<std::int32_t>& tokens) {
  dml_run r;
  comm::local::run(1, [&](comm::local& c) {
    train::trainer_options options;
    options.seed = 1;
    trainer<parallel::replicate, optim::adamw, Precision> t{c, nn::gpt(config(bias)), options, optim::adamw{adamw_options}};
    r.layout = t.layout();
    r.init = t.full_parameters();
    std::vector<float> x(static_cast<std::size_t>(batch * seq));
    std::vector<std::int32_t> y(x.size());
    for (int s = 0; s < steps; ++s) {
      for (std::int64_t b = 0; b < batch; ++b)
        for (std::int64_t i = 0; i < seq; ++i) {
          const std::int32_t* row = tokens.data() + (s * batch + b) * (seq + 1);
          x[static_cast<std::size_t>(b * seq + i)] = static_cast<float>(row[i]);
          y[static_cast<std::size_t>(b * seq + i)] = row[i + 1];
        }
      r.losses.push_back(t.step(tensor_view<const float>(x.data(), {batch, seq}), y.data(), batch).loss);
    }
    r.final_params = t.full_parameters();
  });
  return r;
}

struct torch_run {
  std::vector<double> losses;
  std::vector<float> final_params;  // in dml's layout
};

torch_run train_torch(bool bias, const dml_run& ours, const std::vector<std::int32_t>& tokens) {
  const dml_test::temp_dir dir("dml-gpt-parity");
  write_config(dir / "config.json", bias);
  train::save_weights(ours.layout, ours.init, dir / "init.safetensors");
  write_batches(dir / "batches.bin", tokens);
  const std::string cmd = std::string(DML_TEST_PYTHON) + " " + DML_TEST_SOURCE_DIR + "/gpt_reference.py " +
                          (dir / "config.json").string() + " " + (dir / "init.safetensors").string() + " " +
                          (dir / "batches.bin").string() + " " + (dir / "losses.txt").string() + " " +
                          (dir / "final.safetensors").string();
  REQUIRE(std::system(cmd.c_str()) == 0);
  torch_run t;
  t.losses = read_numbers(dir / "losses.txt");
  t.final_params.assign(static_cast<std::size_t>(ours.layout.total), 0.f);
  train::load_weights(ours.layout, t.final_params, dir / "final.safetensors");
  return t;
}

// Worst |dml − torch| / |torch| over the steps, each step's printed.
double loss_diff(const std::vector<double>& ours, const std::vector<double>& theirs, const std::string& what) {
  REQUIRE(ours.size() == theirs.size());
  double worst = 0;
  for (std::size_t i = 0; i < ours.size(); ++i) {
    const double rel = std::abs(ours[i] - theirs[i]) / std::abs(theirs[i]);
    MESSAGE(what, " step ", i + 1, ": dml ", ours[i], " torch ", theirs[i], " rel_diff ", rel);
    worst = std::max(worst, rel);
  }
  return worst;
}

void check_parity(bool bias) {
  const auto tokens = make_batches();
  const auto ours = train_dml<precision::fp32>(bias, tokens);
  const auto theirs = train_torch(bias, ours, tokens);
  const std::string what = bias ? "bias=true" : "bias=false";

  const double worst_loss = loss_diff(ours.losses, theirs.losses, what + " fp32");
  // Final weights, tensor by tensor, relative to the tensor's largest magnitude. Float sums in other orders
  // differ in the last bits of each gradient (and dml's vectorised exp and tanh differ from libm's by ~1e-7),
  // and Adam's normalised step carries that into the weights, most where a gradient is near zero: worst seen
  // 1.6e-4 (c_fc.weight of the first block); 5e-4 leaves room for other GEMM kernels, while a wrong gradient
  // moves a weight by up to lr = 3e-3 a step, 0.1 of a 0.03-scale tensor.
  // The key third of c_attn.bias is held apart: softmax ignores a shift common to a query's scores, so its
  // true gradient is exactly zero and both sides step on round-off, which Adam's normalised step may blow up
  // to lr a step (seen: 7.8e-4 of the tensor's scale); there it is checked loosely, that nothing else moves it.
  double worst_w = 0, worst_key_bias = 0;
  std::string worst_name;
  for (const auto& s : ours.layout.slots) {
    const bool key_bias = s.name.ends_with("attn.c_attn.bias");
    double diff = 0, key_diff = 0, scale = 0;
    for (std::int64_t i = s.offset; i < s.offset + s.shape.numel(); ++i) {
      const auto k = static_cast<std::size_t>(i);
      const double d = std::abs(ours.final_params[k] - theirs.final_params[k]);
      const bool in_key = key_bias && i - s.offset >= d_model && i - s.offset < 2 * d_model;
      double& worst = in_key ? key_diff : diff;
      worst = std::max(worst, d);
      scale = std::max(scale, double(std::abs(theirs.final_params[k])));
    }
    if (diff / scale >= worst_w) worst_w = diff / scale, worst_name = s.name;
    worst_key_bias = std::max(worst_key_bias, key_diff / scale);
  }
  MESSAGE(what, " fp32: loss ", ours.losses.front(), " -> ", ours.losses.back(), "; max_rel_loss_diff=", worst_loss,
          " max_rel_weight_diff=", worst_w, " (", worst_name, ")",
          bias ? "; key bias max_rel_weight_diff=" + std::to_string(worst_key_bias) : std::string());
  CHECK(ours.losses.back() < ours.losses.front());  // it trains at all
  // README quotes 1.3e-7 for the losses (seen: 1.27e-7): the bound is 10x that. Weights: seen 1.7e-4, key bias 5.9e-4.
  CHECK(worst_loss <= 1.3e-6);
  CHECK(worst_w <= 5e-4);
  CHECK(worst_key_bias <= 6e-3);

  // bf16: parameters, activations and gradients in bf16 with float master weights; its losses track fp32's
  // to the precision of bf16 (8 bits of mantissa, ~4e-3 per rounding), a few roundings deep.
  const auto half = train_dml<precision::bf16>(bias, tokens);
  const double worst_bf16 = loss_diff(half.losses, theirs.losses, what + " bf16");
  double vs_dml_fp32 = 0;
  for (std::size_t i = 0; i < half.losses.size(); ++i)
    vs_dml_fp32 = std::max(vs_dml_fp32, std::abs(half.losses[i] - ours.losses[i]));
  MESSAGE(what, " bf16: loss ", half.losses.front(), " -> ", half.losses.back(),
          "; vs torch fp32 max_rel_loss_diff=", worst_bf16);
  CHECK(vs_dml_fp32 > 0);  // it did run in bf16
  CHECK(worst_bf16 <= 3e-3);  // seen: 3.0e-4 (bias=false), 1.9e-4 (bias=true)
}

}  // namespace

TEST_CASE("GPT parity with PyTorch: 2 layers without biases, 20 AdamW steps") { check_parity(false); }

TEST_CASE("GPT parity with PyTorch: 2 layers with biases, 20 AdamW steps") { check_parity(true); }

}  // namespace test_gpt_parity
