// SPDX-License-Identifier: Apache-2.0
// tests/train/test_trainer.cpp — every sharding × group size trains to the same per-step losses as one rank
// with the same global batch; memory follows the ZeRO formulas; bucket reductions overlap backward.
#include <doctest/doctest.h>

#include <cmath>
#include <mutex>
#include <vector>

#include "dml/dml.hpp"

using namespace dml;

namespace {

constexpr std::int64_t features = 24, classes = 5, samples = 512, global_batch = 32;
constexpr int steps = 30;

auto make_model() {
  return nn::sequential{nn::linear{features, 40}, nn::relu{}, nn::layernorm{40}, nn::linear{40, 24}, nn::gelu{},
                        nn::linear{24, classes}};
}

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
const synthetic& data() {
  static const synthetic d;
  return d;
}

struct run_result {
  std::vector<float> losses;
  std::vector<float> params;
  train::memory_report memory;
  std::vector<train::event> events;
};

// Trains `steps` steps on rank r's slices of shuffled global batches; returns rank 0's record.
template <class... P, class C>
run_result train_ranks(C& comm, train::trainer_options opt) {
  const auto& d = data();
  trainer<P...> t(comm, make_model(), opt);
  train::sampler sampler(samples, global_batch, 11);
  run_result out;
  std::vector<float> xb;
  std::vector<std::int32_t> yb;
  for (int s = 0; s < steps; ++s) {
    const auto epoch = static_cast<std::uint64_t>(s / sampler.batches_per_epoch());
    const auto order = sampler.order(epoch);
    const auto idx = train::sampler::slice(order, s % sampler.batches_per_epoch(), global_batch, comm.rank(), comm.size());
    xb.resize(idx.size() * features);
    yb.resize(idx.size());
    for (std::size_t i = 0; i < idx.size(); ++i) {
      std::copy_n(d.x.data() + idx[i] * features, features, xb.data() + i * features);
      yb[i] = d.y[static_cast<std::size_t>(idx[i])];
    }
    const auto r = t.step(tensor_view<const float>(xb.data(), {static_cast<std::int64_t>(idx.size()), features}),
                          yb.data(), global_batch);
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

template <class... P>
run_result train_local(int ranks, train::trainer_options opt) {
  run_result r0;
  std::mutex m;
  comm::local::run(ranks, [&](comm::local& c) {
    auto r = train_ranks<P...>(c, opt);
    if (c.rank() == 0) {
      std::lock_guard lk(m);
      r0 = std::move(r);
    }
  });
  return r0;
}

void check_same(const run_result& ref, const run_result& got, double bound) {
  REQUIRE(ref.losses.size() == got.losses.size());
  double max_rel = 0, max_w = 0;
  for (std::size_t i = 0; i < ref.losses.size(); ++i)
    max_rel = std::max(max_rel, std::abs(double(ref.losses[i]) - got.losses[i]) / std::abs(double(ref.losses[i])));
  REQUIRE(ref.params.size() == got.params.size());
  for (std::size_t i = 0; i < ref.params.size(); ++i) max_w = std::max(max_w, double(std::abs(ref.params[i] - got.params[i])));
  MESSAGE("max_rel_loss_diff=" << max_rel << " max_abs_param_diff=" << max_w);
  CHECK(max_rel <= bound);
  CHECK(max_w <= 1e-4);
}

train::trainer_options options() {
  train::trainer_options o;
  o.seed = 5;
  o.bucket_mb = 100.0 * sizeof(float) / (1024.0 * 1024.0);  // ~100 floats: three buckets
  o.lr = [](std::int64_t step) { return step <= 5 ? 2e-3f * float(step) : 1e-2f; };
  o.clip_norm = 1.0f;
  return o;
}

}  // namespace

TEST_CASE_TEMPLATE("sharding x group size: per-step losses equal one rank with the same global batch", S,
                   parallel::replicate, parallel::zero<1>, parallel::zero<2>, parallel::zero<3>) {
  const auto ref = train_local<parallel::replicate, optim::adamw>(1, options());
  MESSAGE("one rank: loss " << ref.losses.front() << " -> " << ref.losses.back());
  CHECK(ref.losses.back() < 0.6 * ref.losses.front());  // it learns
  for (int ranks : {1, 2, 3, 4}) {
    CAPTURE(ranks);
    check_same(ref, train_local<S, optim::adamw>(ranks, options()), 1e-5);
  }
}

TEST_CASE("policies come in any order; SGD with momentum shards the same way") {
  auto o = options();
  const auto ref = train_local<optim::sgd, parallel::replicate>(1, o);
  check_same(ref, train_local<optim::sgd, parallel::zero<3>>(4, o), 1e-5);
  check_same(ref, train_local<parallel::zero<2>, precision::fp32, optim::sgd>(2, o), 1e-5);
}

TEST_CASE("micro-batches accumulate to the same step as one batch") {
  const auto ref = train_local<parallel::replicate>(2, options());
  for (int k : {2, 4}) {
    auto o = options();
    o.micro_batches = k;
    check_same(ref, train_local<parallel::replicate>(2, o), 1e-5);
    check_same(ref, train_local<parallel::zero<2>>(2, o), 1e-5);
    check_same(ref, train_local<parallel::zero<3>>(2, o), 1e-5);
  }
}

TEST_CASE("memory per rank follows the ZeRO formulas") {
  // fp32 with Adam: 4 bytes of parameter and of gradient, K = 8 bytes of optimizer state per element.
  for (int n : {1, 2, 4}) {
    CAPTURE(n);
    const auto ddp = train_local<parallel::replicate>(n, options()).memory;
    const auto z1 = train_local<parallel::zero<1>>(n, options()).memory;
    const auto z2 = train_local<parallel::zero<2>>(n, options()).memory;
    const auto z3 = train_local<parallel::zero<3>>(n, options()).memory;
    const std::int64_t psi = ddp.padded;  // Ψ including the padding to equal per-rank parts
    CHECK(ddp.numel == 24 * 40 + 40 + 80 + 40 * 24 + 24 + 24 * 5 + 5);
    CHECK(psi >= ddp.numel);
    CHECK(psi % (16 * n) == 0);
    CHECK(ddp.params == 4 * psi);
    CHECK(ddp.grads == 4 * psi);
    CHECK(ddp.optimizer == 8 * psi);
    CHECK(z1.params == 4 * psi);
    CHECK(z1.grads == 4 * psi);
    CHECK(z1.optimizer == 8 * psi / n);
    CHECK(z2.params == 4 * psi);
    CHECK(z2.grads == 4 * psi / n);
    CHECK(z2.optimizer == 8 * psi / n);
    CHECK(z3.params == 4 * psi / n);
    CHECK(z3.grads == 4 * psi / n);
    CHECK(z3.optimizer == 8 * psi / n);
    CHECK(z2.buffers > 0);
    CHECK(z3.buffers > z2.buffers);  // gather buffers besides the gradient staging
  }
}

TEST_CASE("a bucket's reduction starts before backward ends (event log)") {
  auto o = options();
  o.record_events = true;
  for (int stage = 0; stage < 3; ++stage) {
    const auto r = stage == 0 ? train_local<parallel::replicate>(2, o)
                              : stage == 1 ? train_local<parallel::zero<1>>(2, o) : train_local<parallel::zero<2>>(2, o);
    // In the last step: the first bucket launch must come before backward_end.
    std::size_t begin = 0;
    for (std::size_t i = 0; i < r.events.size(); ++i)
      if (r.events[i].kind == train::event_kind::backward_begin) begin = i;
    int launched_before_end = 0, buckets = 0;
    bool ended = false;
    for (std::size_t i = begin; i < r.events.size(); ++i) {
      if (r.events[i].kind == train::event_kind::backward_end) ended = true;
      if (r.events[i].kind == train::event_kind::bucket_launch) {
        ++buckets;
        if (!ended) ++launched_before_end;
      }
    }
    CAPTURE(stage);
    CHECK(buckets >= 3);
    CHECK(launched_before_end == buckets);  // every bucket launched during backward, the first long before its end
  }
}

TEST_CASE("bad options get errors") {
  comm::local::run(1, [](comm::local& c) {
    train::trainer_options o;
    o.micro_batches = 0;
    CHECK_THROWS_AS(trainer<>(c, make_model(), o), invalid_argument);
  });
}
