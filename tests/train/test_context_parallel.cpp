// SPDX-License-Identifier: Apache-2.0
// tests/train/test_context_parallel.cpp — a GPT under context parallelism (ring attention over chunks of each
// sequence, zig-zag or contiguous; or K/V all-gathered) alone and with data and tensor parallelism: one rank's losses, gradient norms
// and parameters, with dropout on; and the configurations that must be refused.
#include <doctest/doctest.h>

#include <string>

#include "gpt_fixture.hpp"

namespace test_context_parallel {

namespace {

using namespace gpt_fixture;

result run_layout(const layout& l, const nn::gpt_config& g, int n_steps = steps) {
  result out;
  comm::local::run(l.size(), [&](comm::local& c) {
    auto r = train_gpt<parallel::replicate, optim::adamw>(c, l, g, n_steps);
    if (c.rank() == 0) out = std::move(r);
  });
  return out;
}

}  // namespace

TEST_CASE("context parallelism over 2 and 4 ranks, zig-zag or contiguous, with dp and tp, gives one rank's losses") {
  const auto one = run_layout({}, config());
  REQUIRE(one.losses.size() == steps);
  int layouts = 0;
  for (int cp : {2, 4})
    for (bool zigzag : {true, false}) {
      const layout l{.dp = cp, .cp = cp, .zigzag = zigzag};
      check_same(one, run_layout(l, config()), l.name());
      ++layouts;
    }
  // cp carved out of dp beside plain data parallelism, and beside tensor (and sequence) parallelism.
  for (const layout& l : {layout{.dp = 4, .cp = 2}, layout{.tp = 2, .dp = 2, .cp = 2}, layout{.tp = 2, .dp = 2, .sp = true, .cp = 2}}) {
    check_same(one, run_layout(l, config()), l.name());
    ++layouts;
  }
  // K/V all-gathered over the context group, their gradients reduce-scattered back.
  for (const layout& l : {layout{.dp = 2, .cp = 2, .all_gather = true}, layout{.dp = 4, .cp = 4, .zigzag = false, .all_gather = true},
                          layout{.tp = 2, .dp = 2, .sp = true, .cp = 2, .all_gather = true}}) {
    check_same(one, run_layout(l, config()), l.name());
    ++layouts;
  }
  CHECK(layouts == 10);
}

TEST_CASE("context parallelism refuses a sequence that does not cut into its chunks, naming both numbers") {
  comm::local::run(2, [](comm::local& c) {
    train::trainer_options o;
    o.context_parallel = 2;
    trainer<parallel::replicate> t(c, nn::gpt(config()), o);
    std::vector<float> x(2 * 6, 1.f);  // T = 6: zig-zag over 2 ranks needs a multiple of 4
    std::vector<std::int32_t> y(x.size(), 1);
    CHECK_THROWS_WITH_AS(t.step(tensor_view<const float>(x.data(), {2, 6}), y.data(), 2),
                         doctest::Contains("needs T divisible by 4, found T = 6"), dml::shape_error);
  });
}

TEST_CASE("context parallelism must divide the data-parallel ranks") {
  comm::local::run(2, [](comm::local& c) {
    train::trainer_options o;
    o.context_parallel = 4;
    CHECK_THROWS_WITH_AS(trainer<parallel::replicate>(c, nn::gpt(config()), o),
                         doctest::Contains("expected context_parallel to divide the 2 data-parallel ranks, found 4"),
                         dml::invalid_argument);
  });
}

}  // namespace test_context_parallel
