// SPDX-License-Identifier: Apache-2.0
// tests/train/test_compress.cpp — trainer_options.compress: "none" is today's trainer bit for bit; onebit and topk
// train replicate, ZeRO-1 and ZeRO-2 on 2 ranks close to dense with the bytes step_result reports; bad settings throw.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "support.hpp"
#include "trainer_fixture.hpp"

namespace test_compress {

using namespace trainer_fixture;

namespace {

struct compress_run {
  run_result r;
  std::int64_t bytes = 0, dense = 0, total = 0;  // per step (the same every step), padded parameters
  std::vector<std::int64_t> parts;                // every run's part
  std::vector<float> weights;                     // the parameters without the layout's padding
};

// Message bytes of a part of n entries (comm/filter.hpp's 9-byte header, comm/compression.hpp's payloads).
std::int64_t message_bytes(const std::string& spec, std::int64_t n) {
  if (spec == "onebit") return 9 + 4 + 8 * ((n + 4095) / 4096) + (n + 7) / 8;
  // topk:0.05: a u32 count per block of 65536, then a u16 index and an f32 value per entry (parallel/compressed.hpp).
  return 9 + 4 * ((n + 65535) / 65536) + 6 * std::max<std::int64_t>(1, static_cast<std::int64_t>(0.05 * static_cast<double>(n)));
}
float mean_of_last(const std::vector<float>& v, std::size_t k) {
  float s = 0;
  for (std::size_t i = v.size() - k; i < v.size(); ++i) s += v[i];
  return s / static_cast<float>(k);
}

template <class S, class O = optim::adamw>
compress_run train_compressed(int ranks, train::trainer_options opt, O optimizer = {}, int steps = trainer_fixture::steps) {
  return on_ranks<compress_run>(ranks, [&](comm::local& c) {
    const auto& d = data();
    trainer<S, O> t(c, make_model(), opt, optimizer);
    train::sampler sampler(samples, global_batch, 11);
    compress_run out;
    std::vector<float> xb;
    std::vector<std::int32_t> yb;
    for (int s = 0; s < steps; ++s) {
      const std::int64_t rows = sampler.gather(s, c.rank(), c.size(), d.x.data(), features, d.y.data(), xb, yb);
      const auto r = t.step(tensor_view<const float>(xb.data(), {rows, features}), yb.data(), global_batch);
      out.r.losses.push_back(r.loss);
      if (s > 0) {
        CHECK(r.gradient_bytes == out.bytes);
        CHECK(r.dense_gradient_bytes == out.dense);
      }
      out.bytes = r.gradient_bytes;
      out.dense = r.dense_gradient_bytes;
    }
    out.r.params = t.full_parameters();
    out.total = t.layout().total;
    for (const auto& slot : t.layout().slots)
      out.weights.insert(out.weights.end(), out.r.params.begin() + slot.offset,
                         out.r.params.begin() + slot.offset + slot.shape.numel());
    for (const auto& bk : t.buckets())
      for (const auto& rn : bk.runs) out.parts.push_back(rn.part);
    return out;
  });
}

}  // namespace

TEST_CASE_TEMPLATE("compress none: bit for bit today's trainer, dense bytes of a ring", S, parallel::replicate,
                   parallel::zero<1>, parallel::zero<2>, parallel::zero<3>) {
  auto none = options();
  none.compress = "none";
  const auto ref = train_compressed<S>(2, options());
  const auto got = train_compressed<S>(2, none);
  CHECK(ref.r.losses == got.r.losses);
  CHECK(ref.r.params == got.r.params);
  // A ring on 2 ranks sends half the buffer per pass: 2 passes for an all-reduce, 1 for a reduce-scatter.
  const std::int64_t passes = std::same_as<S, parallel::replicate> ? 2 : 1;
  CHECK(got.dense == passes * 4 * got.total / 2);
  CHECK(got.bytes == got.dense);
}

TEST_CASE_TEMPLATE("compress onebit and topk: 2 ranks train close to dense, bytes exact", S, parallel::replicate,
                   parallel::zero<1>, parallel::zero<2>, parallel::zero<3>) {
  constexpr int long_steps = 100;
  const auto dense = train_compressed<S>(2, options(), optim::adamw{}, long_steps);
  const float first = dense.r.losses.front(), last = mean_of_last(dense.r.losses, 10);
  const std::int64_t passes = std::same_as<S, parallel::replicate> ? 2 : 1;
  for (const std::string spec : {"onebit", "topk:0.05"}) {
    CAPTURE(spec);
    auto o = options();
    o.compress = spec;
    const auto got = train_compressed<S>(2, o, optim::adamw{}, long_steps);
    CHECK(got.r.losses.front() == first);  // before any update
    const float mean = mean_of_last(got.r.losses, 10);
    MESSAGE(spec << ": loss " << first << " -> " << mean << " (last 10 steps' mean; dense " << last
                 << "), bytes per step " << got.bytes << " vs dense " << got.dense);
    CHECK(mean < 0.2f * first);              // it learns: 0.06 to 0.13 of the first loss measured
    CHECK(std::abs(mean - last) <= 0.2f);    // close to dense: 0.04 to 0.15 measured (dense 0.06)
    CHECK(got.dense == dense.dense);
    std::int64_t want = 0;  // each run: (N-1) messages of its part per pass
    for (const auto part : got.parts) want += passes * message_bytes(spec, part);
    CHECK(got.bytes == want);
  }
}

TEST_CASE("compress on 2 ranks: DDP takes ZeRO-2's steps (every rank sums every rank's part messages)") {
  for (const std::string spec : {"onebit", "topk:0.05"}) {
    CAPTURE(spec);
    auto o = options();
    o.compress = spec;
    const auto ddp = train_compressed<parallel::replicate>(2, o, optim::adamw{}, 30);
    const auto zero2 = train_compressed<parallel::zero<2>>(2, o, optim::adamw{}, 30);
    CHECK(ddp.r.losses == zero2.r.losses);
    // The weights; not the padding, where a 1-bit message leaves values that DDP zeroes and ZeRO keeps.
    CHECK(ddp.weights == zero2.weights);
    CHECK(ddp.weights.size() < ddp.r.params.size());
    CHECK(ddp.bytes == 2 * zero2.bytes);  // the same part messages, sent twice: owners' and gathered
  }
}

TEST_CASE("compress: bad settings fail at construction naming the setting") {
  const auto model = make_model();
  comm::local::run(1, [&](comm::local& c) {
    for (const char* bad : {"topk:0", "topk:1.01", "onebit:48", "gzip"}) {
      auto o = options();
      o.compress = bad;
      CAPTURE(bad);
      CHECK_THROWS_WITH_AS((trainer<parallel::replicate, optim::adamw>(c, model, o)), doctest::Contains("compress"),
                           invalid_argument);
    }
    auto o = options();
    o.compress = "onebit";
    CHECK_THROWS_WITH_AS((trainer<parallel::zero<1>, precision::bf16, optim::adamw>(c, model, o)),
                         doctest::Contains("compress onebit expected fp32"), invalid_argument);
  });
}

}  // namespace test_compress
