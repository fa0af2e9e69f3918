// SPDX-License-Identifier: Apache-2.0
// tests/train/test_compress_adam.cpp — trainer_options.compress = "onebit-adam:W" (1-bit Adam): warm-up steps are
// dense AdamW bit for bit, then the momentum goes 1-bit with the bytes exact, the second moment stays frozen, and
// replicate, ZeRO-1 and ZeRO-2 on 2 ranks train close to dense; bad settings throw.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "support.hpp"
#include "trainer_fixture.hpp"

namespace test_compress_adam {

using namespace trainer_fixture;

namespace {

struct adam_run {
  run_result r;
  std::vector<std::int64_t> bytes, dense;  // per step
  std::vector<std::int64_t> parts;         // every run's part
};

train::trainer_options adam_options(const std::string& compress) {
  auto o = options();
  o.clip_norm = 0.f;  // 1-bit Adam hands the optimizer its momentum unscaled
  o.compress = compress;
  return o;
}

template <class S>
adam_run train_adam(const std::string& compress, int steps) {
  return on_ranks<adam_run>(2, [&](comm::local& c) {
    const auto& d = data();
    trainer<S, optim::adamw> t(c, make_model(), adam_options(compress));
    train::sampler sampler(samples, global_batch, 11);
    adam_run out;
    std::vector<float> xb;
    std::vector<std::int32_t> yb;
    for (int s = 0; s < steps; ++s) {
      const std::int64_t rows = sampler.gather(s, c.rank(), c.size(), d.x.data(), features, d.y.data(), xb, yb);
      const auto r = t.step(tensor_view<const float>(xb.data(), {rows, features}), yb.data(), global_batch);
      out.r.losses.push_back(r.loss);
      out.bytes.push_back(r.gradient_bytes);
      out.dense.push_back(r.dense_gradient_bytes);
    }
    out.r.params = t.full_parameters();
    for (const auto& bk : t.buckets())
      for (const auto& rn : bk.runs) out.parts.push_back(rn.part);
    return out;
  });
}

float mean_of_last(const std::vector<float>& v, std::size_t k) {
  float s = 0;
  for (std::size_t i = v.size() - k; i < v.size(); ++i) s += v[i];
  return s / static_cast<float>(k);
}

}  // namespace

TEST_CASE("adamw freeze_variance_after: the same steps before, the second moment unchanged after") {
  constexpr std::int64_t n = 257, w = 3;
  optim::adamw plain{}, frozen{{.freeze_variance_after = w}};
  optim::state<optim::adamw, host> sp(n), sf(n);
  auto wp = dml_test::random_vector(n, 1), wf = wp;
  std::vector<float> v_at_w;
  for (std::int64_t t = 1; t <= 2 * w; ++t) {
    const auto g = dml_test::random_vector(n, 100 + static_cast<unsigned>(t));
    plain.update<host>({.n = n, .w = wp.data(), .g = g.data(), .state = sp.pointers(), .step = t, .lr = 1e-2f});
    frozen.update<host>({.n = n, .w = wf.data(), .g = g.data(), .state = sf.pointers(), .step = t, .lr = 1e-2f});
    const auto v = sf.slot(1);
    if (t <= w) {
      CHECK(wp == wf);
      CHECK(std::equal(v.begin(), v.end(), sp.slot(1).begin()));
      if (t == w) v_at_w.assign(v.begin(), v.end());
    } else {
      CHECK(std::equal(v.begin(), v.end(), v_at_w.begin()));  // frozen
      CHECK(!std::equal(v.begin(), v.end(), sp.slot(1).begin()));
      CHECK(std::equal(sf.slot(0).begin(), sf.slot(0).end(), sp.slot(0).begin()));  // the momentum moves as Adam's
    }
  }
  CHECK_THROWS_WITH_AS(optim::adamw({.freeze_variance_after = -1}), doctest::Contains("freeze_variance_after"),
                       invalid_argument);
}

TEST_CASE_TEMPLATE("compress onebit-adam: dense warm-up bit for bit, then 1-bit momentum close to dense, bytes exact",
                   S, parallel::replicate, parallel::zero<1>, parallel::zero<2>, parallel::zero<3>) {
  constexpr int warmup = 10, long_steps = 100;
  const auto dense = train_adam<S>("none", long_steps);
  const auto warm = train_adam<S>("onebit-adam:" + std::to_string(warmup), warmup);
  const auto ref = train_adam<S>("none", warmup);
  CHECK(warm.r.losses == ref.r.losses);
  CHECK(warm.r.params == ref.r.params);
  // The warm-up all-reduces (ZeRO too, so every rank learns the whole second moment).
  const std::int64_t passes = std::same_as<S, parallel::replicate> ? 2 : 1;
  for (int s = 0; s < warmup; ++s) CHECK(warm.bytes[s] == ref.dense[s] * 2 / passes);

  const auto got = train_adam<S>("onebit-adam:" + std::to_string(warmup), long_steps);
  // (N-1) = 1 message of each run's part per pass: u32 block, a pair of means per 4096, a bit per entry, 9 header.
  std::int64_t want = 0;
  for (const auto part : got.parts) want += passes * (9 + 4 + 8 * ((part + 4095) / 4096) + (part + 7) / 8);
  for (int s = 0; s < long_steps; ++s) {
    CAPTURE(s);
    CHECK(got.dense[s] == dense.dense[s]);
    CHECK(got.bytes[s] == (s < warmup ? dense.dense[s] * 2 / passes : want));
  }
  const float first = dense.r.losses.front(), last = mean_of_last(dense.r.losses, 10);
  const float mean = mean_of_last(got.r.losses, 10);
  MESSAGE("onebit-adam: loss " << first << " -> " << mean << " (last 10 steps' mean; dense " << last << ")");
  CHECK(mean < 0.2f * first);
  CHECK(std::abs(mean - last) <= 0.2f);
}

TEST_CASE("compress onebit-adam: replicate and ZeRO-1/2/3 take the same steps, bit for bit, after warm-up too") {
  // Every rank of replicate decodes what each part's owner decodes under ZeRO, in the same order, and the update
  // is per entry: the same parameters (replicate's all-reduce does not compress the owner's sum a second time).
  constexpr int warmup = 5, long_steps = 40;
  const std::string spec = "onebit-adam:" + std::to_string(warmup);
  const auto ddp = train_adam<parallel::replicate>(spec, long_steps);
  const auto z1 = train_adam<parallel::zero<1>>(spec, long_steps);
  const auto z2 = train_adam<parallel::zero<2>>(spec, long_steps);
  const auto z3 = train_adam<parallel::zero<3>>(spec, long_steps);
  CHECK(ddp.r.losses == z1.r.losses);
  CHECK(ddp.r.params == z1.r.params);
  CHECK(ddp.r.losses == z2.r.losses);
  CHECK(ddp.r.params == z2.r.params);
  CHECK(ddp.r.losses == z3.r.losses);
  CHECK(ddp.r.params == z3.r.params);
  const auto dense = train_adam<parallel::replicate>("none", long_steps);
  CHECK(ddp.r.params != dense.r.params);  // compressed after warm-up
}

TEST_CASE("compress onebit-adam: bad settings fail at construction naming the setting") {
  const auto model = make_model();
  comm::local::run(1, [&](comm::local& c) {
    for (const char* bad : {"onebit-adam:0", "onebit-adam:", "onebit-adam:x", "onebit-adam:-3"}) {
      CAPTURE(bad);
      CHECK_THROWS_WITH_AS((trainer<parallel::replicate, optim::adamw>(c, model, adam_options(bad))),
                           doctest::Contains("compress: expected onebit-adam:W"), invalid_argument);
    }
    CHECK_THROWS_WITH_AS((trainer<parallel::replicate, optim::sgd>(c, model, adam_options("onebit-adam:5"))),
                         doctest::Contains("expected adam or adamw, found sgd"), invalid_argument);
    auto o = adam_options("onebit-adam:5");
    o.clip_norm = 1.f;
    CHECK_THROWS_WITH_AS((trainer<parallel::replicate, optim::adamw>(c, model, o)),
                         doctest::Contains("compress onebit-adam:5: expected micro_batches = 1 and clip_norm = 0"),
                         invalid_argument);
  });
}

TEST_CASE("onebit-adam reducer: entries without a gradient in warm-up stay 0 after it; the others move") {
  // 2 ranks, 64 entries, entries 0..7 never have a gradient; warm-up of 2 steps, then 3 compressed ones.
  constexpr std::size_t n = 64, dead = 8;
  comm::local::run(2, [&](comm::local& c) {
    auto spec = parallel::gradient_compression::parse("onebit-adam:2");
    parallel::compressed_reducer r(spec, n, n / 2);
    for (int step = 0; step < 5; ++step) {
      std::vector<float> sum(n, 0.f), g;
      for (int k = 0; k < 2; ++k) {
        auto gk = dml_test::random_vector(n, 10u * static_cast<unsigned>(step) + static_cast<unsigned>(k));
        std::fill_n(gk.begin(), dead, 0.f);
        for (std::size_t i = 0; i < n; ++i) sum[i] += gk[i];
        if (k == c.rank()) g = gk;
      }
      r.all_reduce(c, std::span<float>(g), 0, 0);
      for (std::size_t i = 0; i < dead; ++i) CHECK(g[i] == 0.f);
      if (step < 2) CHECK(g == sum);  // warm-up: the dense sum
      else CHECK(std::count(g.begin() + dead, g.end(), 0.f) == 0);
    }
  });
}

TEST_CASE("onebit-adam reducer: an entry whose warm-up gradient was tiny does not set its block's step") {
  // 2 ranks, 64 entries in one 1-bit block; warm-up of 2 steps where entry 5 has gradients 1e6 times smaller than
  // the others', then a step where it has the others' size. Unfloored, its m / √v̂ (~1e5 against ~0.1 for the
  // others) would set the block's positive and negative means, and every entry's momentum would come back about
  // 1e5 times too large. With the floor (a tenth of the run's mean √v̂), every entry's momentum stays of the
  // size of the dense one's.
  constexpr std::size_t n = 64, tiny = 5;
  comm::local::run(2, [&](comm::local& c) {
    parallel::compressed_reducer r(parallel::gradient_compression::parse("onebit-adam:2"), n, n / 2);
    for (int step = 0; step < 3; ++step) {
      auto g = dml_test::random_vector(n, 100u * static_cast<unsigned>(step) + static_cast<unsigned>(c.rank()));
      if (step < 2) g[tiny] *= 1e-6f;
      r.all_reduce(c, std::span<float>(g), 0, 0);
      if (step < 2) continue;
      // What comes back is the gradient that makes the optimizer's momentum the decoded one: its entries are of
      // the size of (1 - β1)⁻¹ times a momentum of inputs in [-1, 1], a few units; unfloored they reach ~1e5.
      float worst = 0;
      for (const float v : g) worst = std::max(worst, std::abs(v));
      MESSAGE("largest returned entry " << worst);
      CHECK(worst < 100.f);
    }
  });
}

}  // namespace test_compress_adam
