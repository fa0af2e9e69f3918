// SPDX-License-Identifier: Apache-2.0
// tests/core/test_math.cpp — the vectorising exp and tanh against libm over the float range, and at its edges.
#include <doctest/doctest.h>

#include <cmath>
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

}  // namespace test_math
