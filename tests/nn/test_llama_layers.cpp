// SPDX-License-Identifier: Apache-2.0
// tests/nn/test_llama_layers.cpp — the kernels of a Llama-class block: RMSNorm (alone and fused with the residual
// add), RoPE with Llama 3.1's frequency scaling, SwiGLU. Forward against plain loops in double, every gradient
// against central finite differences, bf16 against float, the identities each keeps, argument checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <numbers>
#include <random>
#include <utility>
#include <vector>

#include "dml/nn/gradcheck.hpp"
#include "dml/nn/rmsnorm.hpp"
#include "dml/nn/rope.hpp"
#include "dml/nn/swiglu.hpp"
#include "support.hpp"

namespace test_llama_layers {

namespace {

using dml::bf16;
using dml::host;
using dml_test::random_vector;
namespace nn = dml::nn;

template <class T>
std::vector<T> to(const std::vector<float>& v) {
  std::vector<T> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = T(v[i]);
  return r;
}
template <class T>
std::vector<float> to_float(const std::vector<T>& v) {
  std::vector<float> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = static_cast<float>(v[i]);
  return r;
}
// v with every element rounded to bf16 and back: inputs both types hold exactly.
std::vector<float> bf16_exact(std::vector<float> v) {
  for (auto& x : v) x = static_cast<float>(bf16(x));
  return v;
}
template <class A, class B>
bool same_bits(const std::vector<A>& a, const std::vector<B>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(A)) != 0) return false;
  return true;
}
// max over i of |got − want| / (|want| + floor): how far a bf16 result is from the float one, in units of |want|.
double bf16_rel(const std::vector<float>& want, const std::vector<float>& got, double floor) {
  double m = 0;
  for (std::size_t i = 0; i < want.size(); ++i)
    m = std::max(m, std::abs(double(got[i]) - want[i]) / (std::abs(double(want[i])) + floor));
  return m;
}
// bf16 keeps 8 significant bits: one rounding moves a value by at most 2^-8 of itself.
constexpr double bf16_rounding = 1.0 / 256;

// Σ y·g in double: the loss whose gradient with respect to y is g. The finite differences below take it of the
// reference forward in double, so that the quotient sees no float rounding (of a float forward it did: 1e-2
// relative in RMSNorm's wide rows) and the bounds can be tight.
template <class Y>
double dot(const std::vector<Y>& y, const std::vector<float>& g) {
  double s = 0;
  for (std::size_t i = 0; i < y.size(); ++i) s += double(y[i]) * g[i];
  return s;
}
constexpr float fd_step = 1e-3f;

// ---------------------------------------------------------------- RMSNorm

template <class X>
std::vector<double> rmsnorm_reference(const std::vector<X>& x, const std::vector<float>& w, std::int64_t rows,
                                      std::int64_t n, double eps, std::vector<double>& rrms) {
  std::vector<double> y(x.size());
  rrms.assign(static_cast<std::size_t>(rows), 0);
  for (std::int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (std::int64_t j = 0; j < n; ++j) ss += double(x[r * n + j]) * x[r * n + j];
    const double s = 1 / std::sqrt(ss / double(n) + eps);
    rrms[r] = s;
    for (std::int64_t j = 0; j < n; ++j) y[r * n + j] = x[r * n + j] * s * w[j];
  }
  return y;
}

struct norm_shape {
  std::int64_t rows, n;
};

}  // namespace

TEST_CASE("rmsnorm forward matches a loop in double, and keeps each row's 1/rms") {
  // n = 300 and 1000 span more than one column block of the weight's gradient (256).
  const norm_shape shapes[] = {{1, 1}, {3, 7}, {5, 64}, {4, 300}, {2, 1000}};
  const float eps = 1e-5f;
  unsigned seed = 1;
  double worst_y = 0, worst_s = 0;
  for (const auto& [rows, n] : shapes) {
    CAPTURE(rows);
    CAPTURE(n);
    const auto x = random_vector(static_cast<std::size_t>(rows * n), seed++, -2.f, 2.f);
    const auto w = random_vector(static_cast<std::size_t>(n), seed++, 0.5f, 1.5f);
    std::vector<float> y(x.size()), rrms(static_cast<std::size_t>(rows));
    nn::rmsnorm_forward<host>(x.data(), w.data(), y.data(), rrms.data(), rows, n, eps);
    std::vector<double> want_s;
    const auto want = rmsnorm_reference(x, w, rows, n, eps, want_s);
    worst_y = std::max(worst_y, dml_test::max_abs_difference(want, y).value / dml_test::max_abs(want));
    worst_s = std::max(worst_s, dml_test::max_rel_difference(want_s, rrms).value);
  }
  MESSAGE("rmsnorm forward: max |y − ref| / max |ref| = " << worst_y << ", 1/rms max_rel_diff = " << worst_s);
  CHECK(worst_y < 1e-6);  // seen 1.3e-7
  CHECK(worst_s < 5e-7);  // seen 9.0e-8
}

TEST_CASE("rmsnorm backward: dx and dw match central finite differences") {
  const norm_shape shapes[] = {{3, 5}, {2, 17}, {4, 260}};
  const float eps = 1e-5f, h = fd_step;
  unsigned seed = 11;
  double worst_x = 0, worst_w = 0;
  for (const auto& [rows, n] : shapes) {
    CAPTURE(rows);
    CAPTURE(n);
    const auto size = static_cast<std::size_t>(rows * n);
    auto x = random_vector(size, seed++);
    auto w = random_vector(static_cast<std::size_t>(n), seed++, 0.5f, 1.5f);
    const auto g = random_vector(size, seed++);  // ∂loss/∂y
    std::vector<float> y(size), rrms(static_cast<std::size_t>(rows));
    nn::rmsnorm_forward<host>(x.data(), w.data(), y.data(), rrms.data(), rows, n, eps);
    // Filled first: dx must be overwritten, dw too (accumulate = false).
    std::vector<float> dx(size, 1000.f), dw(static_cast<std::size_t>(n), 1000.f);
    nn::rmsnorm_backward<host>(x.data(), w.data(), rrms.data(), g.data(), nullptr, dx.data(), dw.data(), rows, n);

    auto loss = [&] {
      std::vector<double> unused;
      return dot(rmsnorm_reference(x, w, rows, n, eps, unused), g);
    };
    for (std::size_t i = 0; i < size; ++i)
      worst_x = std::max(worst_x, nn::gradient_difference(dx[i], nn::central_difference(x[i], h, loss, nn::difference_step::stored)));
    for (std::size_t j = 0; j < w.size(); ++j)
      worst_w = std::max(worst_w, nn::gradient_difference(dw[j], nn::central_difference(w[j], h, loss, nn::difference_step::stored)));
  }
  MESSAGE("rmsnorm backward: dx max_rel_diff = " << worst_x << ", dw max_rel_diff = " << worst_w);
  CHECK(worst_x < 1e-5);  // seen 1.8e-6
  CHECK(worst_w < 5e-5);  // seen 7.5e-6
}

TEST_CASE("fused residual rmsnorm: its gradient, the residual stream's included, matches finite differences") {
  // loss = Σ y·g + Σ r'·d with r' = r + x, y = rmsnorm(r'): ∂loss/∂r = ∂loss/∂x = the norm's dx + d, which
  // rmsnorm_backward writes over d in place (dx = dr).
  const std::int64_t rows = 3, n = 11;
  const float eps = 1e-5f, h = fd_step;
  const auto size = static_cast<std::size_t>(rows * n);
  auto r0 = random_vector(size, 31), x = random_vector(size, 32), w = random_vector(static_cast<std::size_t>(n), 33, 0.5f, 1.5f);
  const auto g = random_vector(size, 34), d = random_vector(size, 35);
  std::vector<float> r = r0, y(size), rrms(static_cast<std::size_t>(rows)), dw(static_cast<std::size_t>(n));
  nn::residual_rmsnorm_forward<host>(r.data(), x.data(), w.data(), y.data(), rrms.data(), rows, n, eps);
  auto dr = d;
  nn::rmsnorm_backward<host>(r.data(), w.data(), rrms.data(), g.data(), dr.data(), dr.data(), dw.data(), rows, n);

  auto loss = [&] {
    std::vector<double> stream(size), unused;
    for (std::size_t i = 0; i < size; ++i) stream[i] = double(r0[i]) + x[i];
    return dot(rmsnorm_reference(stream, w, rows, n, eps, unused), g) + dot(stream, d);
  };
  double worst_r = 0, worst_x = 0, worst_w = 0;
  for (std::size_t i = 0; i < size; ++i) {
    worst_r = std::max(worst_r, nn::gradient_difference(dr[i], nn::central_difference(r0[i], h, loss, nn::difference_step::stored)));
    worst_x = std::max(worst_x, nn::gradient_difference(dr[i], nn::central_difference(x[i], h, loss, nn::difference_step::stored)));
  }
  for (std::size_t j = 0; j < w.size(); ++j)
    worst_w = std::max(worst_w, nn::gradient_difference(dw[j], nn::central_difference(w[j], h, loss, nn::difference_step::stored)));
  MESSAGE("fused rmsnorm backward: d residual max_rel_diff = " << worst_r << ", d branch = " << worst_x
                                                                << ", dw = " << worst_w);
  CHECK(worst_r < 1e-5);  // seen 1.6e-6
  CHECK(worst_x < 1e-5);
  CHECK(worst_w < 5e-7);  // seen 7.3e-8
}

TEST_CASE_TEMPLATE("fused residual rmsnorm equals the add followed by rmsnorm, bit for bit", T, float, bf16, dml::fp16) {
  const std::int64_t rows = 6, n = 333;
  const float eps = 1e-6f;
  const auto size = static_cast<std::size_t>(rows * n);
  const auto r0 = to<T>(random_vector(size, 41, -3.f, 3.f)), x = to<T>(random_vector(size, 42));
  const auto w = to<T>(random_vector(static_cast<std::size_t>(n), 43, 0.5f, 1.5f));
  std::vector<T> r = r0, y(size);
  std::vector<float> rrms(static_cast<std::size_t>(rows));
  nn::residual_rmsnorm_forward<host>(r.data(), x.data(), w.data(), y.data(), rrms.data(), rows, n, eps);

  std::vector<T> sum(size), y2(size);
  std::vector<float> rrms2(static_cast<std::size_t>(rows));
  for (std::size_t i = 0; i < size; ++i) sum[i] = T(static_cast<float>(r0[i]) + static_cast<float>(x[i]));
  nn::rmsnorm_forward<host>(sum.data(), w.data(), y2.data(), rrms2.data(), rows, n, eps);
  CHECK(same_bits(r, sum));
  CHECK(same_bits(y, y2));
  CHECK(same_bits(rrms, rrms2));
}

TEST_CASE("rmsnorm backward: dr is added in, dw accumulates on request, and dw has one sum order") {
  const std::int64_t rows = 64, n = 600;  // 3 column blocks of 64 rows: split across threads
  const float eps = 1e-5f;
  const auto size = static_cast<std::size_t>(rows * n);
  const auto x = random_vector(size, 51), g = random_vector(size, 52), dr = random_vector(size, 53);
  const auto w = random_vector(static_cast<std::size_t>(n), 54, 0.5f, 1.5f);
  std::vector<float> y(size), rrms(static_cast<std::size_t>(rows));
  nn::rmsnorm_forward<host>(x.data(), w.data(), y.data(), rrms.data(), rows, n, eps);

  std::vector<float> dx(size), dw(static_cast<std::size_t>(n));
  nn::rmsnorm_backward<host>(x.data(), w.data(), rrms.data(), g.data(), nullptr, dx.data(), dw.data(), rows, n);
  // In float, dx is the norm's own gradient d as computed, and with dr it is float(d + dr): the same bits as the sum.
  std::vector<float> dx_total(size), dw_twice = dw;
  nn::rmsnorm_backward<host>(x.data(), w.data(), rrms.data(), g.data(), dr.data(), dx_total.data(), dw_twice.data(),
                             rows, n, true);
  std::vector<float> sum(size), doubled(dw.size());
  for (std::size_t i = 0; i < size; ++i) sum[i] = dx[i] + dr[i];
  for (std::size_t j = 0; j < dw.size(); ++j) doubled[j] = dw[j] + dw[j];
  CHECK(same_bits(dx_total, sum));
  CHECK(same_bits(dw_twice, doubled));  // accumulate adds the same sum onto the one already there

  // The same bits on one thread and on two, and from the column-per-call functor the device runs.
  std::vector<float> dw1(static_cast<std::size_t>(n)), dw2(static_cast<std::size_t>(n)), dwc(static_cast<std::size_t>(n));
  {
    dml::thread_budget_scope one(1);
    nn::rmsnorm_backward<host>(x.data(), w.data(), rrms.data(), g.data(), nullptr, nullptr, dw1.data(), rows, n);
  }
  {
    dml::thread_budget_scope two(2);
    nn::rmsnorm_backward<host>(x.data(), w.data(), rrms.data(), g.data(), nullptr, nullptr, dw2.data(), rows, n);
  }
  const nn::kernels::rmsnorm_backward_weight<float> column{x.data(), g.data(), rrms.data(), dwc.data(), rows, n, false};
  for (std::int64_t j = 0; j < n; ++j) column(j);
  CHECK(same_bits(dw1, dw));
  CHECK(same_bits(dw2, dw));
  CHECK(same_bits(dwc, dw));
}

TEST_CASE("rmsnorm in bf16 is the float result rounded once") {
  const std::int64_t rows = 8, n = 320;
  const float eps = 1e-5f;
  const auto size = static_cast<std::size_t>(rows * n);
  const auto x = bf16_exact(random_vector(size, 61, -2.f, 2.f)), g = bf16_exact(random_vector(size, 62));
  const auto w = bf16_exact(random_vector(static_cast<std::size_t>(n), 63, 0.5f, 1.5f));
  std::vector<float> y(size), rrms(static_cast<std::size_t>(rows)), dx(size), dw(static_cast<std::size_t>(n));
  nn::rmsnorm_forward<host>(x.data(), w.data(), y.data(), rrms.data(), rows, n, eps);
  nn::rmsnorm_backward<host>(x.data(), w.data(), rrms.data(), g.data(), nullptr, dx.data(), dw.data(), rows, n);

  const auto xb = to<bf16>(x), wb = to<bf16>(w), gb = to<bf16>(g);
  std::vector<bf16> yb(size), dxb(size), dwb(static_cast<std::size_t>(n));
  std::vector<float> rrmsb(static_cast<std::size_t>(rows));
  nn::rmsnorm_forward<host>(xb.data(), wb.data(), yb.data(), rrmsb.data(), rows, n, eps);
  nn::rmsnorm_backward<host>(xb.data(), wb.data(), rrmsb.data(), gb.data(), nullptr, dxb.data(), dwb.data(), rows, n);
  const double ry = bf16_rel(y, to_float(yb), 1e-30), rdx = bf16_rel(dx, to_float(dxb), 1e-30),
               rdw = bf16_rel(dw, to_float(dwb), 1e-30);
  const double rs = dml_test::max_rel_difference(rrms, rrmsb).value;
  MESSAGE("rmsnorm bf16 against float, relative per element: y " << ry << ", dx " << rdx << ", dw " << rdw
                                                               << "; 1/rms (float in both) " << rs);
  CHECK(rs < 1e-6);  // seen 1.4e-7
  CHECK(ry <= bf16_rounding);
  CHECK(rdx <= bf16_rounding);
  CHECK(rdw <= bf16_rounding);
}

TEST_CASE("rmsnorm argument checks name what was expected and what was found") {
  std::vector<float> a(8), b(8), c(8), s(2);
  CHECK_THROWS_WITH_AS(nn::rmsnorm_forward<host>(a.data(), b.data(), c.data(), s.data(), 2, 0, 1e-5f),
                       "dml::nn::rmsnorm_forward: expected n > 0, found n = 0", dml::invalid_argument);
  CHECK_THROWS_WITH_AS(nn::residual_rmsnorm_forward<host>(a.data(), static_cast<const float*>(nullptr), b.data(),
                                                          c.data(), s.data(), 2, 4, 1e-5f),
                       "dml::nn::residual_rmsnorm_forward: expected a pointer to x, found null", dml::invalid_argument);
  CHECK_THROWS_WITH_AS(nn::rmsnorm_backward<host>(a.data(), b.data(), nullptr, c.data(), nullptr, c.data(), b.data(), 2, 4),
                       "dml::nn::rmsnorm_backward: expected a pointer to rrms, found null", dml::invalid_argument);
}

// ---------------------------------------------------------------- RoPE

namespace {

// The rotation written out in double, from the frequencies in double: every q and k head of every token.
std::vector<double> rope_reference(const nn::rope_shape& s, const std::vector<float>& qkv, const std::vector<double>& f,
                                   const std::vector<std::int64_t>* positions) {
  std::vector<double> out(qkv.begin(), qkv.end());
  const std::int64_t half = s.head_dim / 2, ld = s.width();
  for (std::int64_t t = 0; t < s.batch * s.seq; ++t) {
    const double p = double(positions ? (*positions)[t] : t % s.seq);
    for (std::int64_t h = 0; h < s.heads + s.kv_heads; ++h)
      for (std::int64_t i = 0; i < half; ++i) {
        const std::int64_t a = t * ld + h * s.head_dim + i, b = a + half;
        const double c = std::cos(p * f[i]), sn = std::sin(p * f[i]);
        out[a] = qkv[a] * c - qkv[b] * sn;
        out[b] = qkv[b] * c + qkv[a] * sn;
      }
  }
  return out;
}

const nn::rope_config llama31_8b{.theta = 500000, .scaling = nn::rope_scaling{}};  // factor 8, low 1, high 4, 8192

}  // namespace

TEST_CASE("rope forward matches the rotation in double, for sequence positions and given ones") {
  const nn::rope_shape shapes[] = {{2, 5, 4, 2, 8}, {1, 7, 3, 3, 6}, {2, 3, 8, 1, 64}, {1, 1, 1, 1, 2}};
  const nn::rope_config configs[] = {{}, llama31_8b};
  unsigned seed = 101;
  double worst = 0;
  for (const auto& c : configs)
    for (const auto& s : shapes) {
      CAPTURE(s.heads);
      CAPTURE(s.kv_heads);
      CAPTURE(s.head_dim);
      const std::int64_t max_positions = 9000;
      const nn::rope_table table(c, s.head_dim, max_positions);
      const auto f = nn::rope_inverse_frequencies(c, s.head_dim);
      const auto qkv = random_vector(static_cast<std::size_t>(s.batch * s.seq * s.width()), seed++, -2.f, 2.f);
      std::mt19937 gen(seed++);
      std::uniform_int_distribution<std::int64_t> pick(0, max_positions - 1);
      std::vector<std::int64_t> positions(static_cast<std::size_t>(s.batch * s.seq));
      for (auto& p : positions) p = pick(gen);
      for (const std::vector<std::int64_t>* pos : {static_cast<std::vector<std::int64_t>*>(nullptr), &positions}) {
        auto got = qkv;
        nn::rope_forward<host>(s, got.data(), table.view(), pos ? pos->data() : nullptr);
        const auto want = rope_reference(s, qkv, f, pos);
        worst = std::max(worst, dml_test::max_abs_difference(want, got).value / dml_test::max_abs(want));
      }
    }
  MESSAGE("rope forward: max |y − ref| / max |ref| = " << worst);
  CHECK(worst < 5e-7);  // seen 9.6e-8
}

TEST_CASE_TEMPLATE("rope: position 0 is the identity, v is left alone, and given positions t equal none", T, float, bf16,
                   dml::fp16) {
  const nn::rope_shape s{2, 6, 4, 2, 16};
  const nn::rope_table table(llama31_8b, s.head_dim, 64);
  const auto qkv = to<T>(random_vector(static_cast<std::size_t>(s.batch * s.seq * s.width()), 111, -2.f, 2.f));
  const std::vector<std::int64_t> zeros(static_cast<std::size_t>(s.batch * s.seq), 0);
  auto at_zero = qkv;
  nn::rope_forward<host>(s, at_zero.data(), table.view(), zeros.data());
  CHECK(same_bits(at_zero, qkv));

  std::vector<std::int64_t> t_of(zeros.size());
  for (std::size_t i = 0; i < t_of.size(); ++i) t_of[i] = static_cast<std::int64_t>(i) % s.seq;
  auto implicit = qkv, given = qkv;
  nn::rope_forward<host>(s, implicit.data(), table.view());
  nn::rope_forward<host>(s, given.data(), table.view(), t_of.data());
  CHECK(same_bits(implicit, given));
  bool v_kept = true, qk_moved = false;
  const std::int64_t qk = (s.heads + s.kv_heads) * s.head_dim;
  for (std::size_t i = 0; i < qkv.size(); ++i) {
    const bool in_v = static_cast<std::int64_t>(i) % s.width() >= qk;
    const bool same = std::memcmp(&implicit[i], &qkv[i], sizeof(T)) == 0;
    if (in_v) v_kept = v_kept && same;
    else qk_moved = qk_moved || !same;
  }
  CHECK(v_kept);
  CHECK(qk_moved);
}

TEST_CASE("rope: backward after forward gives the input back, and backward matches finite differences") {
  const nn::rope_shape s{2, 9, 6, 2, 12};
  const nn::rope_table table(llama31_8b, s.head_dim, 9000);
  std::vector<std::int64_t> positions(static_cast<std::size_t>(s.batch * s.seq));
  for (std::size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<std::int64_t>(i * 997 % 9000);
  auto qkv = random_vector(static_cast<std::size_t>(s.batch * s.seq * s.width()), 121, -2.f, 2.f);

  auto round_trip = qkv;
  nn::rope_forward<host>(s, round_trip.data(), table.view(), positions.data());
  nn::rope_backward<host>(s, round_trip.data(), table.view(), positions.data());
  const double back = dml_test::max_abs_difference(qkv, round_trip).value;

  // loss = Σ rope(qkv)·g: the gradient is rope_backward(g), dv = g's v.
  const auto g = random_vector(qkv.size(), 122);
  auto dqkv = g;
  nn::rope_backward<host>(s, dqkv.data(), table.view(), positions.data());
  const auto f = nn::rope_inverse_frequencies(llama31_8b, s.head_dim);
  auto loss = [&] { return dot(rope_reference(s, qkv, f, &positions), g); };
  double worst = 0;
  for (std::size_t i = 0; i < qkv.size(); ++i)
    worst = std::max(worst, nn::gradient_difference(dqkv[i], nn::central_difference(qkv[i], fd_step, loss, nn::difference_step::stored)));
  MESSAGE("rope: backward∘forward max_abs_diff = " << back << " (inputs below 2); backward against finite differences max_rel_diff = " << worst);
  CHECK(back < 1e-6);  // seen 3.6e-7: an ulp and a half of values near 2
  CHECK(worst < 1e-5);  // seen 2.3e-6
}

TEST_CASE("rope in bf16 is the float rotation rounded once") {
  const nn::rope_shape s{2, 5, 4, 4, 32};
  const nn::rope_table table(llama31_8b, s.head_dim, 4096);
  std::vector<std::int64_t> positions(static_cast<std::size_t>(s.batch * s.seq));
  for (std::size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<std::int64_t>(i * 409 % 4096);
  const auto qkv = bf16_exact(random_vector(static_cast<std::size_t>(s.batch * s.seq * s.width()), 131, -2.f, 2.f));
  auto y = qkv, dy = qkv;
  auto yb = to<bf16>(qkv), dyb = yb;
  nn::rope_forward<host>(s, y.data(), table.view(), positions.data());
  nn::rope_forward<host>(s, yb.data(), table.view(), positions.data());
  nn::rope_backward<host>(s, dy.data(), table.view(), positions.data());
  nn::rope_backward<host>(s, dyb.data(), table.view(), positions.data());
  const double ry = bf16_rel(y, to_float(yb), 1e-30), rdy = bf16_rel(dy, to_float(dyb), 1e-30);
  MESSAGE("rope bf16 against float, relative per element: forward " << ry << ", backward " << rdy);
  CHECK(ry <= bf16_rounding);
  CHECK(rdy <= bf16_rounding);
}

TEST_CASE("rope frequencies: plain, and Llama 3.1's scaling in each of its three bands") {
  // theta 10000, head_dim 8: f = 1, 0.1, 0.01, 0.001, wavelengths 2π/f = 6.3, 63, 628, 6283. With original 1000,
  // low 1, high 4, factor 4: below 1000/4 = 250 kept (1, 0.1); above 1000 divided by 4 (0.00025); 628 between:
  // s = (1000/628.3 − 1)/3 = (5/π − 1)/3, f = 0.01·((1 − s)/4 + s) = 0.01·(1 + 3s)/4 = 0.0125/π.
  const auto plain = nn::rope_inverse_frequencies({}, 8);
  const auto scaled = nn::rope_inverse_frequencies(
      {.theta = 10000, .scaling = nn::rope_scaling{.factor = 4, .low_freq_factor = 1, .high_freq_factor = 4,
                                                   .original_max_position_embeddings = 1000}},
      8);
  const double want_plain[] = {1, 0.1, 0.01, 0.001}, want_scaled[] = {1, 0.1, 0.0125 / std::numbers::pi, 0.00025};
  double worst = 0;
  for (std::size_t i = 0; i < 4; ++i) {
    worst = std::max(worst, std::abs(plain[i] - want_plain[i]) / want_plain[i]);
    worst = std::max(worst, std::abs(scaled[i] - want_scaled[i]) / want_scaled[i]);
  }
  // Llama 3.1 8B (theta 500000, head_dim 128, factor 8, low 1, high 4, original 8192): i <= 28 keep f (wavelength
  // below 2048), i >= 35 give f/8 (above 8192; i = 35 is 8218.7), 29..34 in between. Values from the formula in
  // double, by hand.
  const auto f = nn::rope_inverse_frequencies(llama31_8b, 128);
  REQUIRE(f.size() == 64);
  const std::pair<int, double> want_8b[] = {
      {0, 1.0},                      {10, 0.12868737343265052},     {28, 0.0032114459947525913},  // kept
      {29, 0.002166570763503359},    {31, 0.0008567514129196321},   {34, 0.00017850781276799638},  // between
      {35, 9.556212353964683e-05},   {50, 4.411534674558404e-06},   {63, 3.068925988914511e-07}};  // divided by 8
  for (const auto& [i, v] : want_8b) worst = std::max(worst, std::abs(f[static_cast<std::size_t>(i)] - v) / v);
  MESSAGE("rope inverse frequencies: max_rel_diff from the values by hand = " << worst);
  CHECK(worst < 2e-15);  // seen 2.2e-16: pow in double

  // The table: cos and sin of p·f in double, rounded once.
  const nn::rope_table table(llama31_8b, 128, 8192);
  const auto view = table.view();
  double worst_table = 0;
  for (std::int64_t p : {0, 1, 777, 8191})
    for (std::int64_t i = 0; i < 64; ++i) {
      const double a = double(p) * f[static_cast<std::size_t>(i)];
      worst_table = std::max({worst_table, std::abs(view.cos[p * 64 + i] - std::cos(a)), std::abs(view.sin[p * 64 + i] - std::sin(a))});
    }
  MESSAGE("rope table: max_abs_diff from cos and sin in double = " << worst_table);
  CHECK(worst_table <= 0x1p-25);  // half a float ulp of values in [0.5, 1)
}

TEST_CASE("rope argument checks name what was expected and what was found") {
  const nn::rope_table table({}, 8, 16);
  std::vector<float> qkv(2 * 16 * 8 * 8);
  CHECK_THROWS_WITH_AS(nn::rope_forward<host>(nn::rope_shape{1, 4, 2, 2, 7}, qkv.data(), table.view()),
                       "dml::nn::rope_forward: expected an even head_dim, found head_dim = 7", dml::invalid_argument);
  CHECK_THROWS_WITH_AS(nn::rope_forward<host>(nn::rope_shape{1, 4, 6, 4, 8}, qkv.data(), table.view()),
                       "dml::nn::rope_forward: expected kv_heads to divide heads, found heads = 6, kv_heads = 4",
                       dml::invalid_argument);
  const std::vector<std::int64_t> positions{0, 3, 15, 16};
  CHECK_THROWS_WITH_AS(nn::rope_backward<host>(nn::rope_shape{1, 4, 2, 1, 8}, qkv.data(), table.view(), positions.data()),
                       "dml::nn::rope_backward: expected positions in [0, 16), found position 16 at token 3",
                       dml::invalid_argument);
  CHECK_THROWS_WITH_AS(nn::rope_forward<host>(nn::rope_shape{1, 17, 2, 1, 8}, qkv.data(), table.view()),
                       "dml::nn::rope_forward: expected seq <= the table's 16 positions, found seq = 17",
                       dml::invalid_argument);
  CHECK_THROWS_WITH_AS(nn::rope_forward<host>(nn::rope_shape{1, 4, 2, 1, 16}, qkv.data(), table.view()),
                       "dml::nn::rope_forward: expected a table of head_dim / 2 = 8 frequencies, found 4",
                       dml::invalid_argument);
  CHECK_THROWS_WITH_AS(nn::rope_table({}, 5, 16),
                       "dml::nn::rope_inverse_frequencies: expected an even head_dim > 0, found head_dim = 5",
                       dml::invalid_argument);
}

// ---------------------------------------------------------------- SwiGLU

namespace {
double silu(double x) { return x / (1 + std::exp(-x)); }
std::vector<double> swiglu_reference(const std::vector<float>& gu, std::int64_t rows, std::int64_t ff) {
  std::vector<double> h(static_cast<std::size_t>(rows * ff));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < ff; ++j) h[r * ff + j] = silu(gu[r * 2 * ff + j]) * gu[r * 2 * ff + ff + j];
  return h;
}
}  // namespace

TEST_CASE("swiglu forward matches a loop in double, and stays finite at the exponential's ends") {
  const std::int64_t rows = 5, ff = 37;
  auto gu = random_vector(static_cast<std::size_t>(rows * 2 * ff), 201, -6.f, 6.f);
  const float ends[] = {-1000.f, -100.f, -88.8f, -87.f, -20.f, 0.f, 20.f, 87.f, 88.8f, 100.f, 1000.f};
  for (std::size_t i = 0; i < std::size(ends); ++i) gu[i] = ends[i];  // gates of row 0
  std::vector<float> h(static_cast<std::size_t>(rows * ff));
  nn::swiglu_forward<host>(gu.data(), h.data(), rows, ff);
  const auto want = swiglu_reference(gu, rows, ff);
  const auto d = dml_test::max_rel_difference(want, h, 1e-30);
  MESSAGE("swiglu forward: max_rel_diff per element = " << d);
  CHECK(d.value < 1e-6);  // seen 2.5e-7
}

TEST_CASE("swiglu backward matches central finite differences, in place too") {
  const std::int64_t rows = 4, ff = 19;
  auto gu = random_vector(static_cast<std::size_t>(rows * 2 * ff), 211, -4.f, 4.f);
  const auto g = random_vector(static_cast<std::size_t>(rows * ff), 212);
  std::vector<float> dgu(gu.size(), 1000.f);
  nn::swiglu_backward<host>(gu.data(), g.data(), dgu.data(), rows, ff);
  auto loss = [&] { return dot(swiglu_reference(gu, rows, ff), g); };
  double worst = 0;
  for (std::size_t i = 0; i < gu.size(); ++i)
    worst = std::max(worst, nn::gradient_difference(dgu[i], nn::central_difference(gu[i], fd_step, loss, nn::difference_step::stored)));
  auto in_place = gu;
  nn::swiglu_backward<host>(in_place.data(), g.data(), in_place.data(), rows, ff);
  MESSAGE("swiglu backward: max_rel_diff = " << worst);
  CHECK(worst < 1e-5);  // seen 2.4e-6
  CHECK(same_bits(in_place, dgu));
}

TEST_CASE("swiglu in bf16 is the float result rounded once") {
  const std::int64_t rows = 6, ff = 100;
  const auto gu = bf16_exact(random_vector(static_cast<std::size_t>(rows * 2 * ff), 221, -5.f, 5.f));
  const auto g = bf16_exact(random_vector(static_cast<std::size_t>(rows * ff), 222));
  std::vector<float> h(g.size()), dgu(gu.size());
  nn::swiglu_forward<host>(gu.data(), h.data(), rows, ff);
  nn::swiglu_backward<host>(gu.data(), g.data(), dgu.data(), rows, ff);
  const auto gub = to<bf16>(gu), gb = to<bf16>(g);
  std::vector<bf16> hb(g.size()), dgub(gu.size());
  nn::swiglu_forward<host>(gub.data(), hb.data(), rows, ff);
  nn::swiglu_backward<host>(gub.data(), gb.data(), dgub.data(), rows, ff);
  const double rh = bf16_rel(h, to_float(hb), 1e-30), rd = bf16_rel(dgu, to_float(dgub), 1e-30);
  MESSAGE("swiglu bf16 against float, relative per element: h " << rh << ", dgu " << rd);
  CHECK(rh <= bf16_rounding);
  CHECK(rd <= bf16_rounding);
}

TEST_CASE("swiglu argument checks name what was expected and what was found") {
  std::vector<float> a(8), b(4);
  CHECK_THROWS_WITH_AS(nn::swiglu_forward<host>(a.data(), b.data(), 2, 0),
                       "dml::nn::swiglu_forward: expected ff > 0, found ff = 0", dml::invalid_argument);
  CHECK_THROWS_WITH_AS(nn::swiglu_backward<host>(a.data(), b.data(), static_cast<float*>(nullptr), 2, 2),
                       "dml::nn::swiglu_backward: expected a pointer to dgu, found null", dml::invalid_argument);
}

}  // namespace test_llama_layers
