// SPDX-License-Identifier: Apache-2.0
// tests/train/test_trainer.cpp — every sharding × group size trains to the same per-step losses as one rank
// with the same global batch; memory follows the ZeRO formulas; bucket reductions overlap backward.
#include <doctest/doctest.h>

#include <mutex>

#include "support.hpp"
#include "trainer_fixture.hpp"

namespace test_trainer {

using namespace trainer_fixture;

namespace {

template <class... P, class Model = model_type>
run_result train_local(int ranks, train::trainer_options opt, const Model& model = make_model()) {
  return on_ranks<run_result>(ranks, [&](comm::local& c) { return train_ranks<P...>(c, opt, model); });
}

}  // namespace

TEST_CASE_TEMPLATE("sharding x group size: per-step losses equal one rank with the same global batch", S,
                   parallel::replicate, parallel::zero<1>, parallel::zero<2>, parallel::zero<3>) {
  const auto ref = train_local<parallel::replicate, optim::adamw>(1, options());
  MESSAGE("one rank: loss " << ref.losses.front() << " -> " << ref.losses.back());
  CHECK(ref.losses.back() < 0.6 * ref.losses.front());  // it learns
  for (int ranks : {1, 2, 3, 4}) {
    CAPTURE(ranks);
    check_same(ref, train_local<S, optim::adamw>(ranks, options()), fp32_bound);
  }
}

// Dropout masks follow (seed, step, layer, global row, column): a rank or micro-batch holding rows
// [r, r + n) of the global batch draws the bits one rank draws for them, so layouts still agree.
TEST_CASE_TEMPLATE("dropout: every sharding x group size x micro-batches gives one rank's losses", S,
                   parallel::replicate, parallel::zero<1>, parallel::zero<2>, parallel::zero<3>) {
  const auto model = make_dropout_model(0.2f);
  const auto ref = train_local<parallel::replicate, optim::adamw>(1, options(), model);
  // The masks matter: without them the same steps give other losses.
  const auto plain = train_local<parallel::replicate, optim::adamw>(1, options(), make_dropout_model(0.f));
  const double vs_plain = dml_test::max_rel_difference(plain.losses, ref.losses).value;
  MESSAGE("one rank: loss " << ref.losses.front() << " -> " << ref.losses.back() << "; max_rel_diff_vs_p0="
                            << vs_plain);
  CHECK(vs_plain > 1e-2);
  for (int ranks : {1, 2, 4})
    for (std::int64_t k : {1, 2}) {
      if (ranks == 1 && k == 1 && std::same_as<S, parallel::replicate>) continue;  // the reference itself
      CAPTURE(ranks);
      CAPTURE(k);
      auto o = options();
      o.micro_batches = k;
      check_same(ref, train_local<S, optim::adamw>(ranks, o, model), fp32_bound);
    }
}

TEST_CASE("trainer_options::lr is checked at the step it gives a bad rate; the optimizer where the trainer takes it") {
  comm::local::run(1, [](comm::local& c) {
    const auto& d = data();
    const tensor_view<const float> x(d.x.data(), {global_batch, features});
    auto o = options();
    o.lr = [](std::int64_t step) { return step < 3 ? 1e-2f : -0.5f; };
    trainer<parallel::replicate, optim::adamw> t(c, make_model(), o);
    t.step(x, d.y.data(), global_batch);
    t.step(x, d.y.data(), global_batch);
    CHECK_THROWS_WITH_AS(t.step(x, d.y.data(), global_batch),
                         "dml::trainer: trainer_options::lr at step 3: expected a finite lr >= 0, found -0.5",
                         invalid_argument);
    CHECK(t.steps() == 2);  // the refused step left the counters as they were
    // A setting changed through the optimizer's public `opt` after it was built.
    optim::adamw bad;
    bad.opt.lr = -0.5f;
    o.lr = {};
    CHECK_THROWS_WITH_AS((trainer<parallel::replicate, optim::adamw>(c, make_model(), o, bad)),
                         "dml::optim::adamw: expected lr >= 0, found -0.5", invalid_argument);
  });
}

TEST_CASE("policies come in any order; SGD with momentum shards the same way") {
  auto o = options();
  const auto ref = train_local<optim::sgd, parallel::replicate>(1, o);
  check_same(ref, train_local<optim::sgd, parallel::zero<3>>(4, o), fp32_bound);
  check_same(ref, train_local<parallel::zero<2>, precision::fp32, optim::sgd>(2, o), fp32_bound);
}

TEST_CASE("micro-batches accumulate to the same step as one batch") {
  const auto ref = train_local<parallel::replicate>(2, options());
  for (int k : {2, 4}) {
    auto o = options();
    o.micro_batches = k;
    check_same(ref, train_local<parallel::replicate>(2, o), fp32_bound);
    check_same(ref, train_local<parallel::zero<2>>(2, o), fp32_bound);
    check_same(ref, train_local<parallel::zero<3>>(2, o), fp32_bound);
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
    CHECK(z1.grads == 4 * psi + 4 * psi / n);  // whole gradients, and the shard they reduce into
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

TEST_CASE("a rank that fails mid-training releases the others: run rethrows its error") {
  for (int stage = 0; stage < 4; ++stage) {
    CAPTURE(stage);
    auto body = [&](comm::local& c) {
      const auto& d = data();
      auto go = [&](auto& t) {
        for (int s = 0; s < 6; ++s) {
          if (c.rank() == 1 && s == 3) throw std::runtime_error("rank 1 lost its data");
          t.step(tensor_view<const float>(d.x.data(), {8, features}), d.y.data(), 8 * c.size());
        }
      };
      if (stage == 0) { trainer<parallel::replicate> t(c, make_model(), options()); go(t); }
      if (stage == 1) { trainer<parallel::zero<1>> t(c, make_model(), options()); go(t); }
      if (stage == 2) { trainer<parallel::zero<2>> t(c, make_model(), options()); go(t); }
      if (stage == 3) { trainer<parallel::zero<3>> t(c, make_model(), options()); go(t); }
    };
    CHECK_THROWS_WITH(comm::local::run(3, body), doctest::Contains("rank 1 lost its data"));
  }
}

TEST_CASE("a global batch smaller than the group leaves some ranks with no rows, and still matches one rank") {
  // 4 ranks, global batch 2: ranks 0 and 2 get no rows; they still take part in every collective.
  auto run = [](int ranks) {
    std::vector<float> losses;
    std::mutex m;
    comm::local::run(ranks, [&](comm::local& c) {
      const auto& d = data();
      trainer<parallel::zero<3>> t(c, make_model(), options());
      for (int s = 0; s < 5; ++s) {
        const std::int64_t lo = 2 * c.rank() / ranks, hi = 2 * (c.rank() + 1) / ranks;
        const auto r = t.step(tensor_view<const float>(d.x.data() + (s * 2 + lo) * features, {hi - lo, features}),
                              d.y.data() + s * 2 + lo, 2);
        if (c.rank() == 0) {
          std::lock_guard lk(m);
          losses.push_back(r.loss);
        }
      }
    });
    return losses;
  };
  const auto one = run(1), four = run(4);
  REQUIRE(one.size() == four.size());
  for (std::size_t i = 0; i < one.size(); ++i) CHECK(four[i] == doctest::Approx(one[i]).epsilon(1e-5));
}

// Mixed precision: each sharding in bf16 or fp16 against one rank in the same precision (the reductions
// sum in 16 bits, so agreement is to the precision of the type), and against fp32 to a few percent.
TEST_CASE_TEMPLATE("mixed precision: every sharding x group size tracks one rank", P, precision::bf16, precision::fp16) {
  const double bound = std::is_same_v<P, precision::bf16> ? 2e-2 : 5e-3;
  const auto ref = train_local<parallel::replicate, P>(1, options());
  const auto fp32 = train_local<parallel::replicate>(1, options());
  const double vs32 = dml_test::max_rel_difference(fp32.losses, ref.losses).value;
  MESSAGE(std::string(P::name) << ": one rank vs fp32 max_rel_loss_diff=" << vs32 << "; last loss "
                               << ref.losses.back() << " vs " << fp32.losses.back());
  CHECK(vs32 < 5 * bound);
  CHECK(ref.losses.back() < 0.6 * ref.losses.front());
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    for (const auto& got : {train_local<parallel::replicate, P>(ranks, options()),
                            train_local<parallel::zero<1>, P>(ranks, options()),
                            train_local<parallel::zero<2>, P>(ranks, options()),
                            train_local<parallel::zero<3>, P>(ranks, options())}) {
      const auto max_rel = dml_test::max_rel_difference(ref.losses, got.losses);
      MESSAGE(std::string(P::name) << " max_rel_loss_diff=" << max_rel);
      CHECK(max_rel.value < bound);
    }
  }
}

// ZeRO-1 holds the paper's 4Ψ + KΨ/N and the shard its whole gradients reduce into, 2Ψ/N: 4Ψ + (K + 2)Ψ/N.
TEST_CASE("mixed-precision memory follows (2 + 2 + K)Ψ, 4Ψ + (K + 2)Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N with K = 12 for AdamW") {
  for (int n : {1, 2, 4}) {
    CAPTURE(n);
    const auto ddp = train_local<parallel::replicate, precision::bf16>(n, options()).memory;
    const auto z1 = train_local<parallel::zero<1>, precision::bf16>(n, options()).memory;
    const auto z2 = train_local<parallel::zero<2>, precision::bf16>(n, options()).memory;
    const auto z3 = train_local<parallel::zero<3>, precision::bf16>(n, options()).memory;
    const std::int64_t psi = ddp.padded;
    CHECK(ddp.params + ddp.grads + ddp.optimizer == (2 + 2 + 12) * psi);
    CHECK(z1.params + z1.grads + z1.optimizer == 4 * psi + 14 * psi / n);
    CHECK(z2.params + z2.grads + z2.optimizer == 2 * psi + 14 * psi / n);
    CHECK(z3.params + z3.grads + z3.optimizer == 16 * psi / n);
  }
}

TEST_CASE("fp16 loss scaling: overflowing steps are skipped on every rank and the scale backs off") {
  std::vector<std::vector<train::step_result>> seen(2);
  comm::local::run(2, [&](comm::local& c) {
    const auto& d = data();
    auto o = options();
    o.initial_loss_scale = 16777216.f;  // 2^24: the first scaled gradients overflow fp16
    trainer<parallel::zero<2>, precision::fp16> t(c, make_model(), o);
    for (int s = 0; s < 12; ++s) {
      const std::int64_t lo = 16 * c.rank();
      seen[static_cast<std::size_t>(c.rank())].push_back(
          t.step(tensor_view<const float>(d.x.data() + (32 * s + lo) * features, {16, features}), d.y.data() + 32 * s + lo,
                 32));
    }
  });
  int skipped = 0;
  for (std::size_t s = 0; s < seen[0].size(); ++s) {
    CHECK(seen[0][s].skipped == seen[1][s].skipped);  // one verdict for all ranks
    CHECK(seen[0][s].loss_scale == seen[1][s].loss_scale);
    if (seen[0][s].skipped) {
      ++skipped;
      CHECK(seen[0][s].loss_scale == (s == 0 ? 8388608.f : seen[0][s - 1].loss_scale / 2));
    }
  }
  MESSAGE("fp16: " << skipped << " of 12 steps skipped; scale now " << seen[0].back().loss_scale);
  CHECK(skipped >= 1);
  CHECK(!seen[0].back().skipped);
  CHECK(std::isfinite(seen[0].back().loss));
}

TEST_CASE_TEMPLATE("mixed precision: a checkpoint resumes exactly (master weights, state, loss scale)", P, precision::bf16,
                   precision::fp16) {
  const dml_test::temp_dir tmp("dml-mixed-resume");
  const auto& dir = tmp.path;
  auto run = [&](bool split) {
    std::vector<float> losses;
    std::mutex m;
    comm::local::run(2, [&](comm::local& c) {
      const auto& d = data();
      auto slice = [&](trainer<parallel::zero<1>, P>& t, int s) {
        const std::int64_t lo = 16 * c.rank();
        const auto r = t.step(tensor_view<const float>(d.x.data() + (32 * s + lo) * features, {16, features}),
                              d.y.data() + 32 * s + lo, 32);
        if (c.rank() == 0) {
          std::lock_guard lk(m);
          losses.push_back(r.loss);
        }
      };
      trainer<parallel::zero<1>, P> a(c, make_model(), options());
      for (int s = 0; s < 6; ++s) slice(a, s);
      if (!split) {
        for (int s = 6; s < 12; ++s) slice(a, s);
        return;
      }
      a.save_checkpoint(dir);
      trainer<parallel::zero<1>, P> b(c, make_model(), options());
      b.load_checkpoint(dir);
      for (int s = 6; s < 12; ++s) slice(b, s);
    });
    return losses;
  };
  const auto straight = run(false), resumed = run(true);
  REQUIRE(straight.size() == resumed.size());
  for (std::size_t i = 0; i < straight.size(); ++i) CHECK(straight[i] == resumed[i]);
}

}  // namespace test_trainer
