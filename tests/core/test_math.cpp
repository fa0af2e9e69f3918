// SPDX-License-Identifier: Apache-2.0
// tests/core/test_math.cpp — the vectorising exp and tanh against libm over the float range, and at its edges; the
// ordered bits that a row's max runs on.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/math.hpp"

namespace test_math {

namespace {
struct exp_of {
  const float* x;
  float* y;
  DML_HOST_DEVICE void operator()(std::int64_t i) const { y[i] = dml::fast_exp(x[i]); }
};
}  // namespace

TEST_CASE("fast_exp is within 2 ulp of e^x over the normal range, also inside a vectorised loop") {
  std::vector<float> x, y;
  for (float v = -87.3f; v < 88.37f; v += 0.00071f) x.push_back(v);
  y.resize(x.size());
  dml::for_each_index<dml::host>(static_cast<std::int64_t>(x.size()), exp_of{x.data(), y.data()});
  double worst = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double e = std::exp(double(x[i]));
    worst = std::max(worst, std::abs(y[i] - e) / e);
    // The vector path (an AVX-512 or AVX2 clone, which may contract into FMAs) and the scalar one agree
    // to rounding.
    REQUIRE(std::abs(y[i] - dml::fast_exp(x[i])) <= 2.5e-7 * e);
  }
  MESSAGE("fast_exp max_rel_err=" << worst);
  CHECK(worst < 2.5e-7);  // 2 ulp
}

TEST_CASE("fast_exp and fast_tanh at the edges: saturation, infinities and NaN") {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(dml::fast_exp(0.f) == 1.f);
  CHECK(dml::fast_exp(-100.f) == 0.f);
  CHECK(dml::fast_exp(-1e30f) == 0.f);
  CHECK(dml::fast_exp(-inf) == 0.f);
  CHECK(dml::fast_exp(100.f) == inf);
  CHECK(dml::fast_exp(1e30f) == inf);
  CHECK(dml::fast_exp(inf) == inf);
  CHECK(std::isnan(dml::fast_exp(nan)));
  CHECK(dml::fast_tanh(1e30f) == 1.f);
  CHECK(dml::fast_tanh(-1e30f) == -1.f);
  CHECK(dml::fast_tanh(0.f) == 0.f);
  double worst = 0;
  for (float v = -20.f; v < 20.f; v += 0.0007f) worst = std::max(worst, std::abs(dml::fast_tanh(v) - std::tanh(double(v))));
  MESSAGE("fast_tanh max_abs_err=" << worst);
  CHECK(worst < 3e-7);
}

TEST_CASE("ordered_bits orders as the floats do, round trips, and a row's max through it is the float max") {
  const float inf = std::numeric_limits<float>::infinity(), tiny = std::numeric_limits<float>::denorm_min();
  const std::vector<float> rising{-inf, -3e38f, -1.5f, -1.f, -1e-30f, -tiny, -0.f, 0.f, tiny, 1e-30f, 1.f, 1.5f, 3e38f, inf};
  for (std::size_t i = 0; i < rising.size(); ++i) {
    CAPTURE(rising[i]);
    CHECK(std::bit_cast<std::uint32_t>(dml::from_ordered_bits(dml::ordered_bits(rising[i]))) ==
          std::bit_cast<std::uint32_t>(rising[i]));
    if (i > 0) CHECK(dml::ordered_bits(rising[i - 1]) < dml::ordered_bits(rising[i]));
  }
  // The max of a row as the vectorised row loops find it (an integer max reduction), for rows whose max sits anywhere.
  std::vector<float> row(1000);
  for (std::size_t at = 0; at < row.size(); at += 37) {
    for (std::size_t j = 0; j < row.size(); ++j) row[j] = -50.f + std::sin(static_cast<float>(j)) - (j % 7 == 0 ? inf : 0.f);
    row[at] = 0.75f;
    std::int32_t k = dml::ordered_bits(row[0]);
    DML_SIMD_MAX(k)
    for (std::size_t j = 1; j < row.size(); ++j) k = std::max(k, dml::ordered_bits(row[j]));
    CHECK(dml::from_ordered_bits(k) == 0.75f);
  }
}

}  // namespace test_math
