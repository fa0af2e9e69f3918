// SPDX-License-Identifier: Apache-2.0
// tests/train/trainer_fixture.hpp — a small model, synthetic data and a training loop over any communicator,
// shared by the comm::local and MPI trainer tests.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <mutex>
#include <vector>

#include "dml/dml.hpp"
#include "support.hpp"

namespace trainer_fixture {

using namespace dml;


constexpr std::int64_t features = 24, classes = 5, samples = 512, global_batch = 32;
constexpr int steps = 30;

// Deep enough for 8 virtual pipeline stages (12 places to cut; a relu fused into its linear is not one).
inline auto make_deep_model(float p) {
  return nn::sequential{nn::linear{features, 32}, nn::relu{},   nn::dropout{p}, nn::linear{32, 32}, nn::gelu{},
                        nn::dropout{p},           nn::layernorm{32}, nn::linear{32, 32}, nn::relu{},
                        nn::linear{32, 32},       nn::gelu{},   nn::dropout{p}, nn::linear{32, 32}, nn::relu{},
                        nn::linear{32, classes}};
}

inline auto make_model() {
  return nn::sequential{nn::linear{features, 40}, nn::relu{}, nn::layernorm{40}, nn::linear{40, 24}, nn::gelu{},
                        nn::linear{24, classes}};
}
// The same model with dropout after each activation (p = 0 gives make_model's losses).
inline auto make_dropout_model(float p) {
  return nn::sequential{nn::linear{features, 40}, nn::relu{}, nn::dropout{p}, nn::layernorm{40}, nn::linear{40, 24},
                        nn::gelu{}, nn::dropout{p}, nn::linear{24, classes}};
}
using model_type = decltype(make_model());

struct synthetic {
  std::vector<float> x;
  std::vector<std::int32_t> y;
  synthetic() : x(samples * features), y(samples) {
    const rng_stream rng{2024, 7};
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = rng.normal(i);
    // Labels depend on the inputs, so there is something to learn.
    for (std::int64_t s = 0; s < samples; ++s) {
      float best = -1e9f;
      for (std::int64_t c = 0; c < classes; ++c) {
        const float v = x[s * features + c] + 0.5f * x[s * features + c + classes];
        if (v > best) {
          best = v;
          y[s] = static_cast<std::int32_t>(c);
        }
      }
    }
  }
};
inline const synthetic& data() {
  static const synthetic d;
  return d;
}

struct run_result {
  std::vector<float> losses;
  std::vector<float> params;
  train::memory_report memory;
  std::vector<train::event> events;
};

// Runs fn on `ranks` local ranks; returns what rank 0 returned.
template <class R, class F>
R on_ranks(int ranks, F fn) {
  R out{};
  std::mutex m;
  comm::local::run(ranks, [&](comm::local& c) {
    auto r = fn(c);
    if (c.rank() == 0) {
      std::lock_guard lk(m);
      out = std::move(r);
    }
  });
  return out;
}

// Trains `steps` steps of `model` on rank r's slices of shuffled global batches; returns rank 0's record.
template <class... P, class C, class Model = model_type>
run_result train_ranks(C& comm, train::trainer_options opt, const Model& model = make_model(), int steps = steps) {
  const auto& d = data();
  trainer<P...> t(comm, model, opt);
  train::sampler sampler(samples, global_batch, 11);
  run_result out;
  std::vector<float> xb;
  std::vector<std::int32_t> yb;
  // Pipeline stages share their data-parallel rank's rows (Megatron's order: dp rank fastest).
  const int dp = comm.size() / opt.pipeline_stages, dp_rank = comm.rank() % dp;
  for (int s = 0; s < steps; ++s) {
    const std::int64_t rows = sampler.gather(s, dp_rank, dp, d.x.data(), features, d.y.data(), xb, yb);
    const auto r = t.step(tensor_view<const float>(xb.data(), {rows, features}), yb.data(), global_batch);
    out.losses.push_back(r.loss);
  }
  out.params = t.full_parameters();
  out.memory = t.memory();
  out.events = t.events();
  // Strip the per-layout padding: compare parameters slot by slot.
  std::vector<float> packed;
  for (const auto& slot : t.layout().slots)
    packed.insert(packed.end(), out.params.begin() + slot.offset, out.params.begin() + slot.offset + slot.shape.numel());
  out.params = std::move(packed);
  return out;
}

// fp32 layouts against one rank: README quotes 2.3e-7 (train_trainer; train_pipeline measures 1.7e-7). The bound
// is under 10x that, so a regression by an order of magnitude fails.
constexpr double fp32_bound = 2e-6;

inline void check_same(const run_result& ref, const run_result& got, double bound) {
  REQUIRE(ref.losses.size() == got.losses.size());
  const auto max_rel = dml_test::max_rel_difference(ref.losses, got.losses);
  REQUIRE(ref.params.size() == got.params.size());
  const auto max_w = dml_test::max_abs_difference(ref.params, got.params);
  MESSAGE("max_rel_loss_diff=" << max_rel << " max_abs_param_diff=" << max_w);
  CHECK(max_rel.value <= bound);
  CHECK(max_w.value <= 1e-4);
}

inline train::trainer_options options() {
  train::trainer_options o;
  o.seed = 5;
  o.bucket_mb = 100.0 * sizeof(float) / (1024.0 * 1024.0);  // ~100 floats: three buckets
  o.lr = [](std::int64_t step) { return step <= 5 ? 2e-3f * float(step) : 1e-2f; };
  o.clip_norm = 1.0f;
  return o;
}

}  // namespace trainer_fixture
