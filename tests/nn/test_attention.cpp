// SPDX-License-Identifier: Apache-2.0
// tests/nn/test_attention.cpp — causal multi-head attention: forward against a triple loop in double,
// every input gradient against finite differences, causality, bf16 against float, argument checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dml/nn/attention.hpp"
#include "dml/nn/gradcheck.hpp"
#include "support.hpp"

namespace test_attention {

using dml::nn::attention_shape;

namespace {

using dml_test::random_vector;

std::size_t qkv_size(const attention_shape& s) { return static_cast<std::size_t>(s.batch * s.seq * 3 * s.width()); }
std::size_t y_size(const attention_shape& s) { return static_cast<std::size_t>(s.batch * s.seq * s.width()); }

// The definition, written out: for each (b, h, t), logits over s <= t, softmax, weighted sum of v.
std::vector<double> reference_forward(const attention_shape& s, const std::vector<float>& qkv) {
  const std::int64_t w = s.width(), ld = 3 * w, hd = s.head_dim;
  std::vector<double> y(y_size(s));
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t h = 0; h < s.heads; ++h)
      for (std::int64_t t = 0; t < s.seq; ++t) {
        auto at = [&](std::int64_t tok, std::int64_t part, std::int64_t d) {
          return double(qkv[static_cast<std::size_t>((b * s.seq + tok) * ld + part * w + h * hd + d)]);
        };
        std::vector<double> logit(static_cast<std::size_t>(t + 1));
        for (std::int64_t u = 0; u <= t; ++u) {
          double dot = 0;
          for (std::int64_t d = 0; d < hd; ++d) dot += at(t, 0, d) * at(u, 1, d);
          logit[static_cast<std::size_t>(u)] = dot / std::sqrt(double(hd));
        }
        const double mx = *std::max_element(logit.begin(), logit.end());
        double sum = 0;
        for (auto& l : logit) sum += (l = std::exp(l - mx));
        for (std::int64_t d = 0; d < hd; ++d) {
          double acc = 0;
          for (std::int64_t u = 0; u <= t; ++u) acc += logit[static_cast<std::size_t>(u)] / sum * at(u, 2, d);
          y[static_cast<std::size_t>((b * s.seq + t) * w + h * hd + d)] = acc;
        }
      }
  return y;
}

template <class T>
struct attention_run {
  std::vector<T> probs, y;
};
template <class T>
attention_run<T> forward(const attention_shape& s, const std::vector<T>& qkv) {
  attention_run<T> r{std::vector<T>(static_cast<std::size_t>(dml::nn::attention_saved_size(s))),
                     std::vector<T>(y_size(s))};
  dml::nn::causal_attention_forward<dml::host>(s, qkv.data(), r.probs.data(), r.y.data());
  return r;
}
template <class T>
std::vector<T> backward(const attention_shape& s, const std::vector<T>& qkv, const std::vector<T>& probs,
                        const std::vector<T>& dy, float prefill = 0.f) {
  std::vector<T> dqkv(qkv.size(), T(prefill)), scratch(static_cast<std::size_t>(dml::nn::attention_scratch_size(s)));
  dml::nn::causal_attention_backward<dml::host>(s, qkv.data(), probs.data(), dy.data(), dqkv.data(), scratch.data());
  return dqkv;
}

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

// max |a − b| / max |b|
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    num = std::max(num, std::abs(double(a[i]) - b[i]));
    den = std::max(den, std::abs(double(b[i])));
  }
  return num / den;
}

}  // namespace

TEST_CASE("causal attention forward matches a triple loop in double") {
  const attention_shape shapes[] = {{1, 1, 1, 1},  {2, 1, 3, 4},  {1, 7, 1, 5},  {3, 9, 2, 13},
                                    {3, 17, 4, 8}, {2, 33, 3, 20}, {1, 64, 2, 16}};
  unsigned seed = 1;
  for (const auto& s : shapes) {
    CAPTURE(s.batch);
    CAPTURE(s.seq);
    CAPTURE(s.heads);
    CAPTURE(s.head_dim);
    const auto qkv = random_vector(qkv_size(s), seed++, -2.f, 2.f);
    const auto run = forward(s, qkv);
    const auto want = reference_forward(s, qkv);
    double max_abs_diff = 0;
    for (std::size_t i = 0; i < want.size(); ++i) max_abs_diff = std::max(max_abs_diff, std::abs(run.y[i] - want[i]));
    MESSAGE("forward max_abs_diff=" << max_abs_diff);
    CHECK(max_abs_diff < 1e-5);

    // Each probability row sums to one and is zero above the diagonal.
    double worst_sum = 0;
    bool zero_above = true;
    for (std::int64_t r = 0; r < s.batch * s.heads * s.seq; ++r) {
      const std::int64_t t = r % s.seq;
      double sum = 0;
      for (std::int64_t u = 0; u < s.seq; ++u) {
        const float p = run.probs[static_cast<std::size_t>(r * s.seq + u)];
        if (u > t) zero_above = zero_above && p == 0.f;
        else sum += p;
      }
      worst_sum = std::max(worst_sum, std::abs(sum - 1.0));
    }
    CHECK(worst_sum < 1e-5);
    CHECK(zero_above);
  }
}

TEST_CASE("causal attention forward stays finite where exp of the raw logits would overflow") {
  const attention_shape s{2, 6, 2, 4};
  // Logits up to about 30·30·4/2 = 1800: exp overflows float unless each row's maximum is taken out first.
  const auto qkv = random_vector(qkv_size(s), 41, -30.f, 30.f);
  const auto run = forward(s, qkv);
  const auto want = reference_forward(s, qkv);
  double max_abs_diff = 0, scale = 0;
  bool finite = true;
  for (std::size_t i = 0; i < want.size(); ++i) {
    finite = finite && std::isfinite(run.y[i]);
    max_abs_diff = std::max(max_abs_diff, std::abs(run.y[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  MESSAGE("large logits: max_abs_diff=" << max_abs_diff << " of max |y| " << scale);
  CHECK(finite);
  CHECK(max_abs_diff < 1e-3 * scale);  // float logits of ~1e3 carry ~1e-4 absolute error into the softmax
}

TEST_CASE("causal attention backward: every element of dqkv matches central finite differences") {
  const attention_shape shapes[] = {{2, 5, 2, 3}, {1, 1, 1, 2}, {3, 4, 1, 5}};
  unsigned seed = 11;
  for (const auto& s : shapes) {
    CAPTURE(s.batch);
    CAPTURE(s.seq);
    CAPTURE(s.heads);
    CAPTURE(s.head_dim);
    auto qkv = random_vector(qkv_size(s), seed++);
    const auto r = random_vector(y_size(s), seed++);
    const auto run = forward(s, qkv);
    // Filled with something else first: backward must overwrite, not add.
    const auto dqkv = backward(s, qkv, run.probs, r, 1000.f);

    // loss = Σ y·r, so ∂loss/∂y = r; summed in double so the quotient sees only the attention's error.
    auto loss = [&] { return dml::nn::projected_loss(forward(s, qkv).y, r); };
    const float h = 1e-2f;
    double max_rel = 0, max_abs = 0;
    for (std::size_t i = 0; i < qkv.size(); ++i) {
      // The step as float stores it, so rounding of qkv[i] ± h does not count as gradient error.
      const double numeric = dml::nn::central_difference(qkv[i], h, loss, dml::nn::difference_step::stored);
      max_abs = std::max(max_abs, std::abs(dqkv[i] - numeric));
      max_rel = std::max(max_rel, dml::nn::gradient_difference(dqkv[i], numeric));
    }
    MESSAGE("backward over " << qkv.size() << " elements: max_rel_diff=" << max_rel << " max_abs_diff=" << max_abs);
    CHECK(max_rel < 2e-3);
  }
}

TEST_CASE("causal attention: a future token's k and v do not change earlier outputs") {
  const attention_shape s{2, 8, 2, 6};
  auto qkv = random_vector(qkv_size(s), 21);
  const auto before = forward(s, qkv).y;
  const std::int64_t changed = 5, w = s.width();
  const auto noise = random_vector(static_cast<std::size_t>(2 * w), 22, -3.f, 3.f);
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t j = 0; j < 2 * w; ++j)
      qkv[static_cast<std::size_t>((b * s.seq + changed) * 3 * w + w + j)] = noise[static_cast<std::size_t>(j)];
  const auto after = forward(s, qkv).y;
  double earlier = 0, later = 0;
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t t = 0; t < s.seq; ++t)
      for (std::int64_t j = 0; j < w; ++j) {
        const auto i = static_cast<std::size_t>((b * s.seq + t) * w + j);
        const double d = std::abs(double(after[i]) - before[i]);
        (t < changed ? earlier : later) = std::max(t < changed ? earlier : later, d);
      }
  MESSAGE("tokens before " << changed << ": max_abs_diff=" << earlier << "; from it on: " << later);
  CHECK(earlier == 0.0);
  CHECK(later > 1e-2);  // the check can see a change where there must be one

  // And the gradient reaching a future token's k and v from earlier outputs alone is zero.
  std::vector<float> dy(y_size(s), 0.f);
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t t = 0; t < changed; ++t)
      for (std::int64_t j = 0; j < w; ++j) dy[static_cast<std::size_t>((b * s.seq + t) * w + j)] = 1.f;
  const auto run = forward(s, qkv);
  const auto dqkv = backward(s, qkv, run.probs, dy);
  double future = 0;
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t t = changed; t < s.seq; ++t)
      for (std::int64_t j = 0; j < 3 * w; ++j)
        future = std::max(future, double(std::abs(dqkv[static_cast<std::size_t>((b * s.seq + t) * 3 * w + j)])));
  CHECK(future == 0.0);
}

TEST_CASE_TEMPLATE("causal attention in 16 bits tracks float", T, dml::bf16, dml::fp16) {
  const double tol = std::is_same_v<T, dml::bf16> ? 2e-2 : 3e-3;  // 8 and 11 significant bits
  const attention_shape s{2, 19, 3, 12};
  // The same inputs for both, rounded once to T, so only the arithmetic differs.
  const auto qkv_low = to<T>(random_vector(qkv_size(s), 31, -2.f, 2.f));
  const auto dy_low = to<T>(random_vector(y_size(s), 32));
  const auto qkv = to_float(qkv_low), dy = to_float(dy_low);

  const auto ref = forward(s, qkv);
  const auto low = forward(s, qkv_low);
  const double y_diff = rel_diff(to_float(low.y), ref.y);
  const double p_diff = rel_diff(to_float(low.probs), ref.probs);
  const auto dref = backward(s, qkv, ref.probs, dy);
  const auto dlow = backward(s, qkv_low, low.probs, dy_low);
  const double d_diff = rel_diff(to_float(dlow), dref);
  MESSAGE("relative to float: y " << y_diff << ", probs " << p_diff << ", dqkv " << d_diff);
  CHECK(y_diff < tol);
  CHECK(p_diff < tol);
  CHECK(d_diff < tol);
}

TEST_CASE("causal attention rejects bad sizes and null pointers, saying what it expected") {
  std::vector<float> buf(4096), scratch(4096);
  float* p = buf.data();
  using dml::invalid_argument;
  CHECK_THROWS_WITH_AS(dml::nn::causal_attention_forward<dml::host>(attention_shape{0, 4, 2, 8}, p, p, p),
                       "dml::nn::causal_attention_forward: expected batch > 0, found batch = 0", invalid_argument);
  CHECK_THROWS_WITH_AS(dml::nn::causal_attention_forward<dml::host>(attention_shape{1, -3, 2, 8}, p, p, p),
                       "dml::nn::causal_attention_forward: expected seq > 0, found seq = -3", invalid_argument);
  CHECK_THROWS_WITH_AS(dml::nn::causal_attention_forward<dml::host>(attention_shape{1, 4, 0, 8}, p, p, p),
                       "dml::nn::causal_attention_forward: expected heads > 0, found heads = 0", invalid_argument);
  CHECK_THROWS_WITH_AS(
      dml::nn::causal_attention_backward<dml::host>(attention_shape{1, 4, 2, 0}, p, p, p, p, scratch.data()),
      "dml::nn::causal_attention_backward: expected head_dim > 0, found head_dim = 0", invalid_argument);
  CHECK_THROWS_WITH_AS(
      dml::nn::causal_attention_backward<dml::host>(attention_shape{1, 4, 2, 8}, p, p, p, p, static_cast<float*>(nullptr)),
      "dml::nn::causal_attention_backward: expected a pointer to scratch, found null", invalid_argument);
  CHECK_THROWS_WITH_AS(
      dml::nn::causal_attention_forward<dml::host>(attention_shape{1, 4, 2, 8}, static_cast<const float*>(nullptr), p, p),
      "dml::nn::causal_attention_forward: expected a pointer to qkv, found null", invalid_argument);
  CHECK(dml::nn::attention_saved_size({3, 5, 2, 8}) == 3 * 2 * 5 * 5);
  CHECK(dml::nn::attention_scratch_size({3, 5, 2, 8}) >= 5 * 5);
}

}  // namespace test_attention
