// SPDX-License-Identifier: Apache-2.0
// tests/core/test_rng.cpp — Philox4x32-10 known answers, and the statistics and reproducibility
// of dml::rng_stream.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/rng.hpp"

namespace test_rng {

namespace {

constexpr int n_draws = 1000000;

struct moments {
  double mean = 0, var = 0;
};
template <class F>
moments moments_of(int n, F f) {
  double s = 0, s2 = 0;
  for (int i = 0; i < n; ++i) {
    const double x = f(static_cast<std::uint64_t>(i));
    s += x;
    s2 += x * x;
  }
  moments m;
  m.mean = s / n;
  m.var = s2 / n - m.mean * m.mean;
  return m;
}

// Pearson correlation of f(i) and g(i) over n indices.
template <class F, class G>
double correlation(int n, F f, G g) {
  double sx = 0, sy = 0, sxx = 0, syy = 0, sxy = 0;
  for (int i = 0; i < n; ++i) {
    const double x = f(static_cast<std::uint64_t>(i)), y = g(static_cast<std::uint64_t>(i));
    sx += x, sy += y, sxx += x * x, syy += y * y, sxy += x * y;
  }
  const double cov = sxy / n - (sx / n) * (sy / n);
  return cov / std::sqrt((sxx / n - (sx / n) * (sx / n)) * (syy / n - (sy / n) * (sy / n)));
}

}  // namespace

TEST_CASE("Philox4x32-10 reproduces Random123's known answers") {
  using dml::u32x2;
  using dml::u32x4;
  CHECK(dml::philox4x32(u32x4{{0, 0, 0, 0}}, u32x2{{0, 0}}) ==
        u32x4{{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}});
  CHECK(dml::philox4x32(u32x4{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
                        u32x2{{0xffffffffu, 0xffffffffu}}) ==
        u32x4{{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}});
  CHECK(dml::philox4x32(u32x4{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
                        u32x2{{0xa4093822u, 0x299f31d0u}}) ==
        u32x4{{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}});
  // constexpr: a compile-time answer equals the run-time one.
  constexpr u32x4 at_compile_time = dml::philox4x32(u32x4{{0, 0, 0, 0}}, u32x2{{0, 0}});
  static_assert(at_compile_time[0] == 0x6627e8d5u && at_compile_time[3] == 0x9b00dbd8u);
}

TEST_CASE("rng_stream maps (seed, stream, index) onto Philox's key and counter") {
  const dml::rng_stream r{0x299f31d0a4093822ull, 0x0370734413198a2eull};  // key words lo, hi
  // index 0x85a308d3243f6a88 makes the counter of the third known answer.
  CHECK(r.block(0x85a308d3243f6a88ull) == dml::u32x4{{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}});
  CHECK(r.uniform(0x85a308d3243f6a88ull) == static_cast<float>(0xd16cfe09u >> 8) / 16777216.0f);
  // Every one of the 64 bits of seed, stream and index changes the value.
  const dml::rng_stream base{7, 3};
  const float v = base.uniform(11);
  for (int bit = 0; bit < 64; ++bit) {
    const std::uint64_t flip = std::uint64_t{1} << bit;
    CHECK(dml::rng_stream{7 ^ flip, 3}.uniform(11) != v);
    CHECK(dml::rng_stream{7, 3 ^ flip}.uniform(11) != v);
    CHECK(base.uniform(11 ^ flip) != v);
  }
}

TEST_CASE("uniform, normal and bernoulli edges") {
  using dml::detail::unit_float;
  using dml::detail::unit_float_open0;
  CHECK(unit_float(0) == 0.0f);
  CHECK(unit_float(0xffffffffu) < 1.0f);
  CHECK(unit_float(0xffffffffu) == 1.0f - 5.9604644775390625e-8f);
  CHECK(unit_float_open0(0) > 0.0f);  // log() never sees 0
  CHECK(unit_float_open0(0xffffffffu) <= 1.0f);
  for (std::uint32_t w1 : {0u, 0x40000000u, 0x80000000u, 0xffffffffu})
    for (std::uint32_t w0 : {0u, 1u, 0x80000000u, 0xffffffffu}) {
      const float z = dml::detail::box_muller(w0, w1);
      CHECK(std::isfinite(z));
      CHECK(std::fabs(z) < 7.0f);
    }
  // The largest radius: u1 = 2^-33 and cos = 1.
  CHECK(dml::detail::box_muller(0, 0) == doctest::Approx(std::sqrt(66 * std::log(2.0))).epsilon(1e-5));
  const dml::rng_stream r{1, 2};
  for (std::uint64_t i = 0; i < 1000; ++i) {
    CHECK_FALSE(r.bernoulli(i, 0.0f));
    CHECK(r.bernoulli(i, 1.0f));
    const float u = r.uniform(i, -3.0f, 5.0f);
    CHECK((u >= -3.0f && u < 5.0f));
    CHECK(r.normal(i, 2.0f, 0.5f) == doctest::Approx(2.0f + 0.5f * r.normal(i)).epsilon(1e-6));
  }
}

TEST_CASE("uniform draws have the moments and the histogram of U[0,1)") {
  const dml::rng_stream r{42, 0};
  const moments m = moments_of(n_draws, [&](std::uint64_t i) { return r.uniform(i); });
  // Standard errors at n = 1e6: mean 2.9e-4, variance 7.5e-5; the bounds are about 5 of them.
  MESSAGE("uniform mean=", m.mean, " var=", m.var);
  CHECK(std::fabs(m.mean - 0.5) < 1.5e-3);
  CHECK(std::fabs(m.var - 1.0 / 12) < 4e-4);
  // Chi-square over 100 bins: 99 degrees of freedom, mean 99, sd 14.
  std::vector<int> bins(100, 0);
  float lo = 1, hi = 0;
  for (int i = 0; i < n_draws; ++i) {
    const float u = r.uniform(static_cast<std::uint64_t>(i));
    lo = std::min(lo, u), hi = std::max(hi, u);
    ++bins[static_cast<int>(u * 100)];
  }
  CHECK(lo >= 0.0f);
  CHECK(hi < 1.0f);
  double chi2 = 0;
  for (int b : bins) chi2 += (b - n_draws / 100.0) * (b - n_draws / 100.0) / (n_draws / 100.0);
  MESSAGE("uniform chi2(99 dof)=", chi2);
  CHECK(chi2 < 170);
  // Scaled draws.
  const moments s = moments_of(n_draws, [&](std::uint64_t i) { return r.uniform(i, -2.0f, 6.0f); });
  CHECK(std::fabs(s.mean - 2.0) < 1.2e-2);
  CHECK(std::fabs(s.var - 64.0 / 12) < 2.6e-2);
}

TEST_CASE("normal draws have the moments and the shape of N(mean, std)") {
  const dml::rng_stream r{2024, 5};
  const moments m = moments_of(n_draws, [&](std::uint64_t i) { return r.normal(i); });
  // Standard errors: mean 1e-3, variance 1.4e-3.
  MESSAGE("normal mean=", m.mean, " var=", m.var);
  CHECK(std::fabs(m.mean) < 5e-3);
  CHECK(std::fabs(m.var - 1.0) < 7e-3);
  int within1 = 0, within2 = 0, beyond3 = 0;
  double m4 = 0;
  for (int i = 0; i < n_draws; ++i) {
    const double z = r.normal(static_cast<std::uint64_t>(i));
    within1 += std::fabs(z) < 1, within2 += std::fabs(z) < 2, beyond3 += std::fabs(z) > 3;
    m4 += z * z * z * z;
  }
  // Normal probabilities 0.682689, 0.954500, 0.002700; bounds are 5 standard errors.
  CHECK(std::fabs(within1 / double(n_draws) - 0.682689) < 2.4e-3);
  CHECK(std::fabs(within2 / double(n_draws) - 0.954500) < 1.1e-3);
  CHECK(std::fabs(beyond3 / double(n_draws) - 0.002700) < 2.6e-4);
  CHECK(std::fabs(m4 / n_draws - 3.0) < 0.05);  // kurtosis; sd of the estimate is about 0.0098
  const moments s = moments_of(n_draws, [&](std::uint64_t i) { return r.normal(i, -1.5f, 0.02f); });
  CHECK(std::fabs(s.mean + 1.5) < 1e-4);
  CHECK(std::fabs(std::sqrt(s.var) - 0.02) < 1e-4);
}

TEST_CASE("bernoulli draws hit with probability p") {
  const dml::rng_stream r{9, 1};
  for (float p : {0.1f, 0.5f, 0.9f}) {
    int hits = 0;
    for (int i = 0; i < n_draws; ++i) hits += r.bernoulli(static_cast<std::uint64_t>(i), p);
    const double se = std::sqrt(p * (1 - p) / n_draws);
    MESSAGE("p=", p, " frequency=", hits / double(n_draws));
    CHECK(std::fabs(hits / double(n_draws) - p) < 5 * se);
  }
}

TEST_CASE("streams, seeds and neighbouring indices are uncorrelated") {
  const dml::rng_stream a{42, 0}, b{42, 1}, c{43, 0};
  const double bound = 5.0 / std::sqrt(double(n_draws));  // 5 standard errors of r under independence
  const double r_streams = correlation(n_draws, [&](auto i) { return a.uniform(i); }, [&](auto i) { return b.uniform(i); });
  const double r_seeds = correlation(n_draws, [&](auto i) { return a.uniform(i); }, [&](auto i) { return c.uniform(i); });
  const double r_lag1 = correlation(n_draws, [&](auto i) { return a.uniform(i); }, [&](auto i) { return a.uniform(i + 1); });
  const double r_normal = correlation(n_draws, [&](auto i) { return a.normal(i); }, [&](auto i) { return b.normal(i); });
  MESSAGE("r(streams)=", r_streams, " r(seeds)=", r_seeds, " r(lag 1)=", r_lag1, " r(normal)=", r_normal);
  CHECK(std::fabs(r_streams) < bound);
  CHECK(std::fabs(r_seeds) < bound);
  CHECK(std::fabs(r_lag1) < bound);
  CHECK(std::fabs(r_normal) < bound);
  // Streams do not overlap shifted: stream 1 is not stream 0 a few indices on.
  int equal = 0;
  for (std::uint64_t i = 0; i < 10000; ++i)
    for (std::uint64_t shift : {0, 1, 2, 3})
      equal += a.block(i + shift) == b.block(i);
  CHECK(equal == 0);
}

TEST_CASE("a value depends on its index only, not on the order or the threads that compute it") {
  const dml::rng_stream r{123456789, 17};
  constexpr std::int64_t n = 1 << 17;  // above the parallel grain, so the host loop uses threads
  std::vector<float> forward(n), backward(n), parallel(n), strided(n);
  for (std::int64_t i = 0; i < n; ++i) forward[i] = r.normal(static_cast<std::uint64_t>(i));
  for (std::int64_t i = n - 1; i >= 0; --i) backward[i] = r.normal(static_cast<std::uint64_t>(i));
  // Two "ranks", each drawing every other index, as a sharded initialiser would.
  for (int rank = 0; rank < 2; ++rank)
    for (std::int64_t i = rank; i < n; i += 2) strided[i] = r.normal(static_cast<std::uint64_t>(i));
  const int saved = dml::thread_budget();
  dml::set_thread_budget(2);
  float* out = parallel.data();
  dml::for_each_index<dml::host>(n, [=](std::int64_t i) { out[i] = r.normal(static_cast<std::uint64_t>(i)); });
  dml::set_thread_budget(saved);
  int differ = 0;
  for (std::int64_t i = 0; i < n; ++i)
    differ += forward[i] != backward[i] || forward[i] != parallel[i] || forward[i] != strided[i];
  CHECK(differ == 0);
}

}  // namespace test_rng
