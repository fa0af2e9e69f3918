// SPDX-License-Identifier: Apache-2.0
// tests/support.hpp — the helpers the tests share, each written once: random data, finite differences (on
// dml/nn/gradcheck.hpp), the comparison of two vectors (loss curves, parameters), temp dirs and skips.
// Host code only, so the .cu tests include it too; what needs doctest is left out under nvcc, and the
// transfers to and from a device are only there.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "dml/nn/gradcheck.hpp"  // nn::check_gradients, nn::central_difference, nn::gradient_difference
#include "skip.hpp"
#include "temp_dir.hpp"

#ifdef __CUDACC__
#  include "dml/core/buffer.hpp"
#else
#  include <doctest/doctest.h>
#endif

namespace dml_test {

// ---- random data. A test's bounds were measured with its data: keep a test's generator and seeds.

// n values uniform in [lo, hi) drawn from gen in order, as T: tests that draw all their data from one
// generator (the .cu tests, the typed GEMM) keep drawing from it.
template <class T = float, std::uniform_random_bit_generator Gen>
std::vector<T> random_vector(Gen& gen, std::size_t n, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<T> v(n);
  for (auto& x : v) x = T(d(gen));
  return v;
}

// The same from a fresh std::mt19937 seeded with seed.
inline std::vector<float> random_vector(std::size_t n, unsigned seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 gen(seed);
  return random_vector(gen, n, lo, hi);
}

// n values from N(0, stddev²), from a fresh std::mt19937 seeded with seed.
inline std::vector<float> normal_vector(std::size_t n, std::uint32_t seed, float stddev = 1.f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

// ---- comparing two vectors (loss curves, parameters, a layer's output against a reference).

// The worst difference found and where; prints as "2.5e-07 at [3]".
struct difference {
  double value = 0;
  std::size_t index = 0;
};
inline std::ostream& operator<<(std::ostream& out, const difference& d) {
  return out << d.value << " at [" << d.index << "]";
}

namespace detail {
template <class T>
double as_double(const T& x) {
  if constexpr (std::is_arithmetic_v<T>) return static_cast<double>(x);
  else return static_cast<double>(static_cast<float>(x));  // bf16, fp16
}
// max over i of diff(want[i], got[i]); NaN counts as infinite, so it never passes a bound. Vectors of other
// sizes differ infinitely, at the first index one of them lacks.
template <class A, class B, class F>
difference worst(const A& want, const B& got, F diff) {
  difference out;
  if (want.size() != got.size()) return {std::numeric_limits<double>::infinity(), std::min(want.size(), got.size())};
  for (std::size_t i = 0; i < want.size(); ++i) {
    double d = diff(as_double(want[i]), as_double(got[i]));
    if (std::isnan(d)) d = std::numeric_limits<double>::infinity();
    if (d > out.value) out = {d, i};
  }
  return out;
}
}  // namespace detail

// max |got[i] − want[i]|, in double.
template <class A, class B>
difference max_abs_difference(const A& want, const B& got) {
  return detail::worst(want, got, [](double w, double g) { return std::abs(g - w); });
}

// max |got[i] − want[i]| / max(floor, |want[i]|): relative to the reference, want.
template <class A, class B>
difference max_rel_difference(const A& want, const B& got, double floor = 0) {
  return detail::worst(want, got, [floor](double w, double g) { return std::abs(g - w) / std::max(floor, std::abs(w)); });
}

// max |x[i]|: the scale a tolerance relative to a whole vector is taken of.
template <class A>
double max_abs(const A& x) {
  double m = 0;
  for (const auto& v : x) m = std::max(m, std::abs(detail::as_double(v)));
  return m;
}

// ---- files.

// The numbers of a text file, whitespace-separated (a reference's losses written one a line).
inline std::vector<double> read_numbers(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::vector<double> v;
  for (double x; in >> x;) v.push_back(x);
  return v;
}

#ifndef __CUDACC__
// ---- errors (doctest).

// What the exception of type E that f() throws says; a test fails when f throws nothing or another type.
template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected a different exception type, caught: " << e.what());
  }
  FAIL("expected an exception, none was thrown");
  return {};
}
#endif

#ifdef __CUDACC__
// ---- host ↔ device (the .cu tests).

template <class T>
dml::buffer<T, dml::cuda> to_device(const std::vector<T>& v) {
  dml::buffer<T, dml::cuda> b(v.size());
  dml::copy_n(v.data(), v.size(), b.data());
  return b;
}
template <class T>
std::vector<T> to_host(const T* p, std::size_t n) {
  std::vector<T> v(n);
  dml::copy_n(p, n, v.data());
  return v;
}
template <class T>
std::vector<T> to_host(const dml::buffer<T, dml::cuda>& b) {
  return to_host(b.data(), b.size());
}
#endif

}  // namespace dml_test
