// SPDX-License-Identifier: Apache-2.0
// examples/learn/04_custom_layer.cpp — a layer written outside dml: Swish with a learnable β per feature.
//
// What it teaches: what the dml::nn::layer concept asks for (static widths and a kind, a shape rule, named
// parameters with their initialiser, forward, and a backward that writes dx when asked and the parameter
// gradients, adding to them under context::accumulate as micro-batches do); how dml::nn::check_gradients
// checks a backward against central finite differences; and that sequential and trainer take the new layer
// as they take dml's own.
// swish(x) = x·σ(βx) (Ramachandran et al. 2017); β starts at 1, where it is SiLU.
// Run: learn_04_custom_layer
#include <cmath>
#include <cstdio>
#include <vector>

#include "dml/dml.hpp"

struct swish {
  static constexpr std::int64_t static_in = dml::nn::dynamic, static_out = dml::nn::dynamic;
  static constexpr const char* kind = "swish";
  std::int64_t width;

  std::vector<dml::nn::param_spec> parameters() const { return {{"beta", {width}, dml::nn::init_kind::ones}}; }
  dml::shape output_shape(dml::shape x) const {
    if (x.cols() != width) dml::fail<dml::shape_error>("swish: expected ", width, " columns, found shape ", x);
    return x;
  }
  // T is the network's working type (float, or bf16/fp16 under mixed precision): arithmetic is in float.
  // Host loops; for CUDA the bodies would be DML_HOST_DEVICE functors run by dml::for_each_index<S>.
  template <dml::execution_space S, class T>
  void forward(const dml::nn::context&, dml::nn::layer_params<T> p, dml::tensor_view<const T, S> x,
               dml::tensor_view<T, S> y) const {
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      const float v = float(x.data[i]);
      y.data[i] = T(v / (1.f + std::exp(-float(p.w[0][i % width]) * v)));
    }
  }
  template <dml::execution_space S, class T>
  void backward(const dml::nn::context& c, dml::nn::layer_params<T> p, dml::tensor_view<const T, S> x,
                dml::tensor_view<const T, S>, dml::tensor_view<const T, S> dy, dml::tensor_view<T, S> dx) const {
    std::vector<float> dbeta(std::size_t(width), 0.f);  // summed over rows in float, whatever T is
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      const float v = float(x.data[i]), b = float(p.w[0][i % width]), s = 1.f / (1.f + std::exp(-b * v));
      const float d = float(dy.data[i]);
      if (dx.data) dx.data[i] = T(d * (s + b * v * s * (1.f - s)));  // ∂y/∂x
      dbeta[std::size_t(i % width)] += d * v * v * s * (1.f - s);     // ∂y/∂β
    }
    for (std::int64_t j = 0; j < width; ++j)
      p.g[0][j] = T((c.accumulate ? float(p.g[0][j]) : 0.f) + dbeta[std::size_t(j)]);
  }
};
static_assert(dml::nn::layer<swish>);  // as dml's own layers; dml::nn::diagnose_layer<swish>() names any gap

int main() {
  // backward against central finite differences at every input and every β, with β moved off its initial 1.
  const auto check = dml::nn::check_gradients(swish{4}, {3, 4}, {.perturb = 0.5f, .per_tensor = 0});
  std::printf("finite differences: max_abs_diff=%.2e\n", check.max_abs);
  if (check.max_abs > 1e-3) return 1;
  // The layer inside a model, trained on 2 data-parallel ranks (each takes half of every full batch).
  constexpr std::int64_t samples = 256, features = 8, half = samples / 2;
  std::vector<float> x(samples * features);
  std::vector<std::int32_t> y(samples);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = dml::rng_stream{42, 0}.uniform(i, -1.f, 1.f);
  for (std::int64_t s = 0; s < samples; ++s) y[s] = (x[s * features] > 0) + 2 * (x[s * features + 1] > 0);
  dml::comm::local::run(2, [&](dml::comm::local& comm) {
    const auto model = dml::nn::sequential{dml::nn::linear{features, 16}, swish{16}, dml::nn::linear{16, 4}};
    dml::trainer<> trainer(comm, model, {}, dml::optim::adamw({.lr = 1e-2f}));  // default policies: DDP, AdamW
    const std::int64_t first = comm.rank() * half;
    for (int step = 1; step <= 150; ++step) {
      const float loss = trainer.step({x.data() + first * features, {half, features}}, y.data() + first, samples).loss;
      if (comm.rank() == 0 && (step == 1 || step % 50 == 0)) std::printf("step %d loss %.4f\n", step, double(loss));
    }
  });
  return 0;
}
