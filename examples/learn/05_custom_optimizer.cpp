// SPDX-License-Identifier: Apache-2.0
// examples/learn/05_custom_optimizer.cpp — an optimizer written outside dml: Lion, trained under ZeRO-2.
//
// What it teaches:
//  - what the dml::optim::optimizer concept asks for: a name, the floats of state it keeps per parameter
//    (state_slots), a default learning rate, and update(step_args): one pass over a range of the flat
//    buffers, with that range's gradients and state;
//  - that the trainer shards the new optimizer's state as it shards AdamW's: under zero<2> each of the 4
//    ranks holds the state of its quarter of the parameters only, and the memory report counts it, all
//    from state_slots, with nothing in dml told about Lion.
// Lion (Chen et al. 2023, arXiv 2302.06675): c = β1·m + (1−β1)·g, w −= lr·(sign(c) + λ·w), m = β2·m + (1−β2)·g.
// Run: learn_05_custom_optimizer
#include <cstdio>
#include <vector>

#include "dml/dml.hpp"

struct lion {
  using policy_family = dml::optim::optimizer_family;  // lets trainer<...> find it among its policies
  static constexpr const char* name = "lion";
  static constexpr int state_slots = 1;  // the momentum m
  float lr = 3e-3f, beta1 = 0.9f, beta2 = 0.99f, weight_decay = 0.f;

  float default_lr() const { return lr; }
  // a.w, a.g and a.state[0] hold a.n elements: the whole model on one rank, this rank's shard under ZeRO.
  // Gradients arrive unscaled: a.grad_scale (averaging over ranks, clipping) multiplies them here.
  // Without `writes_working_copy = true` the trainer refuses bf16/fp16 at compile time, so g is float.
  template <dml::execution_space S>
  void update(const dml::optim::step_args& a) const {
    const float* g = a.g.as<float>();
    float *w = a.w, *m = a.state[0];
    const float step_lr = a.lr, scale = a.grad_scale, b1 = beta1, b2 = beta2, wd = weight_decay;
    dml::for_each_index<S>(a.n, [=](std::int64_t i) {
      const float gi = g[i] * scale, c = b1 * m[i] + (1.f - b1) * gi;
      w[i] -= step_lr * (float((c > 0.f) - (c < 0.f)) + wd * w[i]);
      m[i] = b2 * m[i] + (1.f - b2) * gi;
    });
  }
};
static_assert(dml::optim::optimizer<lion>);  // dml::optim::diagnose_optimizer<lion>() would name a missing part

constexpr std::int64_t samples = 512, features = 8, batch = 64;

int main() {
  std::vector<float> x(samples * features);  // example 01's data
  std::vector<std::int32_t> y(samples);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = dml::rng_stream{42, 0}.uniform(i, -1.f, 1.f);
  for (std::int64_t s = 0; s < samples; ++s) y[s] = (x[s * features] > 0) + 2 * (x[s * features + 1] > 0);

  dml::comm::local::run(4, [&](dml::comm::local& comm) {
    const auto model = dml::nn::sequential{dml::nn::linear{features, 64}, dml::nn::relu{}, dml::nn::linear{64, 4}};
    dml::trainer<dml::parallel::zero<2>, lion> trainer(comm, model);
    const dml::train::sampler sampler(samples, batch, 1);
    std::vector<float> xb;
    std::vector<std::int32_t> yb;
    for (int step = 1; step <= 150; ++step) {
      const auto rows = sampler.gather(step - 1, comm.rank(), comm.size(), x.data(), features, y.data(), xb, yb);
      const float loss = trainer.step({xb.data(), {rows, features}}, yb.data(), batch).loss;
      if (comm.rank() == 0 && (step == 1 || step % 50 == 0)) std::printf("step %d loss %.4f\n", step, double(loss));
    }
    // Ψ parameters, padded to equal aligned parts: under zero<2> a rank keeps state_slots floats for Ψ/4 of them.
    const auto mem = trainer.memory();
    const std::int64_t expected = lion::state_slots * mem.padded / comm.size() * std::int64_t(sizeof(float));
    const dml::trainer<dml::parallel::zero<2>> adamw(comm, model);  // the default optimizer, for comparison
    if (comm.rank() == 0)
      std::printf("optimizer state per rank: lion %lld bytes (1 slot x %lld/%d parameters x 4 bytes = %lld), "
                  "adamw %lld bytes\n", (long long)mem.optimizer, (long long)mem.padded, comm.size(),
                  (long long)expected, (long long)adamw.memory().optimizer);
    if (mem.optimizer != expected) dml::fail<dml::error>("lion's state is not sharded as zero<2> shards state");
  });
  return 0;
}
