// SPDX-License-Identifier: Apache-2.0
// tests/plan/test_cost_exact.cpp — dml::cost's bytes for layouts dml runs here equal the trainer's: model states
// (memory(), from allocated sizes) and peak activation bytes, for the MLP of the trainer tests and the GPT of the
// tensor-parallel tests under replicate and ZeRO-1/2/3, fp32 and bf16, AdamW and SGD, dp × tp × sp.
#include <doctest/doctest.h>

#include <string>

#include "../train/gpt_fixture.hpp"
#include "dml/plan/exact.hpp"

namespace {

using namespace dml;

struct observed {
  train::memory_report memory;
  std::int64_t activations = 0;
};

template <class... P, class Model>
observed run(const Model& model, int ranks, train::trainer_options o, dml::shape rows_shape, int steps = 1) {
  observed out;
  comm::local::run(ranks, [&](comm::local& c) {
    trainer<P...> t(c, model, o);
    std::vector<float> x(static_cast<std::size_t>(rows_shape.numel()));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7);
    const std::int64_t labels = std::is_same_v<Model, nn::gpt_model> ? rows_shape.numel() : rows_shape[0];
    std::vector<std::int32_t> y(static_cast<std::size_t>(labels));
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(i % 5);
    for (int s = 0; s < steps; ++s) t.step(tensor_view<const float>(x.data(), rows_shape), y.data(), rows_shape[0] * (ranks / o.tensor_parallel));
    if (c.rank() == 0) out = {t.memory(), t.peak_activation_bytes()};
  });
  return out;
}

template <class Sharding, class Precision, class Opt>
void check_mlp(int ranks) {
  constexpr int zero = std::is_same_v<Sharding, parallel::replicate> ? 0
                     : std::is_same_v<Sharding, parallel::zero<1>>   ? 1
                     : std::is_same_v<Sharding, parallel::zero<2>>   ? 2 : 3;
  const auto model = nn::sequential{nn::linear{24, 40}, nn::relu{}, nn::layernorm{40}, nn::linear{40, 24}, nn::gelu{},
                                    nn::linear{24, 5}};
  const std::int64_t w = std::is_same_v<Precision, precision::fp32> ? 4 : 2;
  const int slots = Opt::state_slots;
  const auto got = run<Sharding, Precision, Opt>(model, ranks, {}, {8, 24});
  const auto want = cost::model_states(model, zero, ranks, w, slots);
  CAPTURE(zero);
  CAPTURE(ranks);
  CAPTURE(w);
  CAPTURE(slots);
  CHECK(got.memory.numel == want.numel);
  CHECK(got.memory.padded == want.padded);
  CHECK(got.memory.params == want.params);
  CHECK(got.memory.grads == want.grads);
  CHECK(got.memory.optimizer == want.optimizer);
  CHECK(got.activations == cost::activation_set_bytes(model, {8, 24}, w));
  CHECK(got.memory.activations == got.activations);
}

}  // namespace

TEST_CASE("model states and activations of the trainer tests' MLP equal the cost model, byte for byte") {
  for (int n : {1, 2, 4}) {
    check_mlp<parallel::replicate, precision::fp32, optim::adamw>(n);
    check_mlp<parallel::zero<1>, precision::fp32, optim::adamw>(n);
    check_mlp<parallel::zero<2>, precision::fp32, optim::adamw>(n);
    check_mlp<parallel::zero<3>, precision::fp32, optim::adamw>(n);
    check_mlp<parallel::replicate, precision::bf16, optim::adamw>(n);
    check_mlp<parallel::zero<1>, precision::bf16, optim::adamw>(n);
    check_mlp<parallel::zero<2>, precision::bf16, optim::sgd>(n);
    check_mlp<parallel::zero<3>, precision::bf16, optim::adamw>(n);
    check_mlp<parallel::zero<1>, precision::fp32, optim::sgd>(n);
  }
}

TEST_CASE("the GPT's activation bytes README quotes (tp 1, tp 2, tp 2 + sp) follow from the layers' shapes") {
  using gpt_fixture::batch;
  using gpt_fixture::seq;
  auto split = [](nn::gpt_config g, int tp, bool sp) {
    auto m = nn::gpt(g);
    if (tp > 1) nn::set_tensor_split(m, {.ranks = tp, .rank = 0, .sequence = sp});
    return m;
  };
  const auto g = gpt_fixture::config(2);
  CHECK(cost::activation_set_bytes(split(g, 1, false), {batch, seq}, 4) == 644'100);
  CHECK(cost::activation_set_bytes(split(g, 2, false), {batch, seq}, 4) == 406'532);
  CHECK(cost::activation_set_bytes(split(g, 2, true), {batch, seq}, 4) == 338'436);
}

TEST_CASE("the GPT under dp × tp × sp, ZeRO and bf16: the trainer's memory() and peak activations equal the cost model") {
  using gpt_fixture::batch;
  using gpt_fixture::seq;
  struct lay {
    int tp, dp;
    bool sp;
  };
  const auto g = gpt_fixture::config(2, 0.f);
  for (const lay l : {lay{1, 1, false}, lay{2, 1, false}, lay{2, 1, true}, lay{1, 2, false}, lay{2, 2, true}, lay{4, 1, true}}) {
    CAPTURE(l.tp);
    CAPTURE(l.dp);
    CAPTURE(l.sp);
    train::trainer_options o;
    o.tensor_parallel = l.tp;
    o.sequence_parallel = l.sp;
    auto part = nn::gpt(g);
    if (l.tp > 1) nn::set_tensor_split(part, {.ranks = l.tp, .rank = 0, .sequence = l.sp});
    const dml::shape rows{batch / l.dp, seq};
    const auto model = nn::gpt(g);
    {
      const auto got = run<parallel::replicate, optim::adamw>(model, l.tp * l.dp, o, rows);
      const auto want = cost::model_states(part, 0, l.dp, 4, 2);
      CHECK(got.memory.padded == want.padded);
      CHECK(got.memory.params + got.memory.grads + got.memory.optimizer == want.params + want.grads + want.optimizer);
      CHECK(got.activations == cost::activation_set_bytes(part, rows, 4));
    }
    {
      const auto got = run<parallel::zero<2>, precision::bf16, optim::adamw>(model, l.tp * l.dp, o, rows);
      const auto want = cost::model_states(part, 2, l.dp, 2, 2);
      CHECK(got.memory.padded == want.padded);
      CHECK(got.memory.params == want.params);
      CHECK(got.memory.grads == want.grads);
      CHECK(got.memory.optimizer == want.optimizer);
      CHECK(got.activations == cost::activation_set_bytes(part, rows, 2));
    }
  }
}
