// SPDX-License-Identifier: Apache-2.0
// tests/nn/test_tile_attention.cpp — tile attention: forward and every input gradient against the definition in
// double (grouped-query heads, causal and document masks, partial tiles), that definition's gradient against finite
// differences, agreement with the T×T attention, bf16 against float, what it keeps, argument checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dml/core/dtype.hpp"
#include "dml/nn/attention.hpp"
#include "dml/nn/tile_attention.hpp"
#include "support.hpp"

namespace test_tile_attention {

using dml::nn::tile_attention_shape;
using dml_test::random_vector;

namespace {

std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

// The definition, in double: y, and the gradient of Σ dy·y with respect to qkv.
struct reference {
  std::vector<double> y, dqkv;
};
reference attention_in_double(const tile_attention_shape& s, const std::vector<float>& qkv, const std::vector<float>& dy,
                              const std::vector<std::int64_t>& doc) {
  const std::int64_t hd = s.head_dim, ld = s.row(), w = s.width(), L = s.seq;
  reference r{std::vector<double>(sz(s.batch * L * w)), std::vector<double>(qkv.size())};
  const double scale = 1 / std::sqrt(double(hd));
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t h = 0; h < s.heads; ++h) {
      const std::int64_t kvh = h / s.group();
      const auto q = [&](std::int64_t t) { return sz((b * L + t) * ld + h * hd); };
      const auto k = [&](std::int64_t t) { return sz((b * L + t) * ld + (s.heads + kvh) * hd); };
      const auto v = [&](std::int64_t t) { return sz((b * L + t) * ld + (s.heads + s.kv() + kvh) * hd); };
      const auto o = [&](std::int64_t t) { return sz((b * L + t) * w + h * hd); };
      for (std::int64_t t = 0; t < L; ++t) {
        const std::int64_t lo = doc.empty() ? 0 : doc[sz(b * L + t)], hi = s.causal ? t : L - 1;
        std::vector<double> p(sz(L), 0.0);
        double mx = -1e300, sum = 0;
        for (std::int64_t u = lo; u <= hi; ++u) {
          double dot = 0;
          for (std::int64_t d = 0; d < hd; ++d) dot += double(qkv[q(t) + sz(d)]) * qkv[k(u) + sz(d)];
          p[sz(u)] = dot * scale;
          mx = std::max(mx, p[sz(u)]);
        }
        for (std::int64_t u = lo; u <= hi; ++u) sum += (p[sz(u)] = std::exp(p[sz(u)] - mx));
        for (std::int64_t u = lo; u <= hi; ++u) p[sz(u)] /= sum;
        // y = Σ p v; dp_u = dy·v_u; ds_u = p_u (dp_u − Σ p dp); dq = scale Σ ds k; dk_u += scale ds q; dv_u += p dy.
        double dot_all = 0;
        std::vector<double> dp(sz(L), 0.0);
        for (std::int64_t u = lo; u <= hi; ++u) {
          for (std::int64_t d = 0; d < hd; ++d) {
            r.y[o(t) + sz(d)] += p[sz(u)] * qkv[v(u) + sz(d)];
            dp[sz(u)] += double(dy[o(t) + sz(d)]) * qkv[v(u) + sz(d)];
          }
          dot_all += p[sz(u)] * dp[sz(u)];
        }
        for (std::int64_t u = lo; u <= hi; ++u) {
          const double ds = p[sz(u)] * (dp[sz(u)] - dot_all) * scale;
          for (std::int64_t d = 0; d < hd; ++d) {
            r.dqkv[q(t) + sz(d)] += ds * qkv[k(u) + sz(d)];
            r.dqkv[k(u) + sz(d)] += ds * qkv[q(t) + sz(d)];
            r.dqkv[v(u) + sz(d)] += p[sz(u)] * dy[o(t) + sz(d)];
          }
        }
      }
    }
  return r;
}

template <class T>
struct run {
  std::vector<float> y, lse, dqkv;
};
template <class T>
run<T> tile_run(const tile_attention_shape& s, const std::vector<float>& qkv_f, const std::vector<float>& dy_f,
                const std::vector<std::int64_t>& doc) {
  const std::vector<T> qkv(qkv_f.begin(), qkv_f.end()), dy(dy_f.begin(), dy_f.end());
  std::vector<T> y(dy.size()), dqkv(qkv.size(), T(7.f));  // backward overwrites
  std::vector<float> lse(sz(dml::nn::tile_attention_saved_size(s))), ws(sz(dml::nn::tile_attention_workspace_size(s)), 3.f);
  const std::int64_t* d = doc.empty() ? nullptr : doc.data();
  dml::nn::tile_attention_forward<dml::host>(s, qkv.data(), y.data(), lse.data(), d);
  dml::nn::tile_attention_backward<dml::host>(s, qkv.data(), y.data(), lse.data(), dy.data(), dqkv.data(), ws.data(), d);
  return {std::vector<float>(y.begin(), y.end()), lse, std::vector<float>(dqkv.begin(), dqkv.end())};
}

// max |a − b| / max |b|
double rel_diff(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return num / den;
}

// Documents of random lengths packed into each sequence: every token's document start.
std::vector<std::int64_t> random_documents(const tile_attention_shape& s, unsigned seed) {
  std::vector<std::int64_t> doc(sz(s.batch * s.seq));
  std::uint32_t x = seed;
  for (std::int64_t b = 0; b < s.batch; ++b) {
    std::int64_t start = 0;
    for (std::int64_t t = 0; t < s.seq; ++t) {
      x = x * 1664525u + 1013904223u;
      if (t > 0 && (x >> 24) % 37 == 0) start = t;  // documents of about 37 tokens, some across tile edges
      doc[sz(b * s.seq + t)] = start;
    }
  }
  return doc;
}

}  // namespace

TEST_CASE("tile attention forward and backward match the definition in double") {
  struct c {
    tile_attention_shape s;
    bool docs;
  };
  const c cases[] = {
      {{1, 1, 1, 0, 1}, false},          {{2, 7, 3, 0, 5}, false},          {{1, 64, 2, 0, 16}, false},
      {{2, 65, 4, 2, 8}, false},         {{1, 150, 4, 1, 16}, false},       {{2, 200, 6, 3, 12}, true},
      {{1, 130, 2, 2, 8, false}, false}, {{3, 129, 8, 2, 32}, true},
  };
  unsigned seed = 3;
  for (const auto& [s, docs] : cases) {
    CAPTURE(s.batch);
    CAPTURE(s.seq);
    CAPTURE(s.heads);
    CAPTURE(s.kv_heads);
    CAPTURE(s.head_dim);
    CAPTURE(s.causal);
    CAPTURE(docs);
    const auto qkv = random_vector(sz(s.batch * s.seq * s.row()), seed++, -2.f, 2.f);
    const auto dy = random_vector(sz(s.batch * s.seq * s.width()), seed++);
    const auto doc = docs ? random_documents(s, seed++) : std::vector<std::int64_t>{};
    const auto want = attention_in_double(s, qkv, dy, doc);
    const auto got = tile_run<float>(s, qkv, dy, doc);
    const double fwd = rel_diff(got.y, want.y), bwd = rel_diff(got.dqkv, want.dqkv);
    MESSAGE("forward rel_diff=" << fwd << " backward rel_diff=" << bwd);
    CHECK(fwd < 2e-6);
    CHECK(bwd < 5e-6);
  }
}

TEST_CASE("the double definition's gradient agrees with finite differences") {
  const tile_attention_shape s{1, 70, 4, 2, 4};
  const auto qkv = random_vector(sz(s.seq * s.row()), 91, -1.f, 1.f);
  const auto dy = random_vector(sz(s.seq * s.width()), 92);
  const auto doc = random_documents(s, 93);
  const auto at = [&](const std::vector<float>& x) {
    const auto y = attention_in_double(s, x, dy, doc).y;
    double l = 0;
    for (std::size_t i = 0; i < y.size(); ++i) l += y[i] * dy[i];
    return l;
  };
  const auto grad = attention_in_double(s, qkv, dy, doc).dqkv;
  double worst = 0;
  for (std::size_t i = 0; i < qkv.size(); i += 7) {  // every 7th input: q, k and v columns of every head
    auto x = qkv;
    const float e = 1e-3f;
    x[i] = qkv[i] + e;
    const double up = at(x);
    x[i] = qkv[i] - e;
    const double down = at(x);
    const double fd = (up - down) / (double(qkv[i] + e) - double(qkv[i] - e));
    worst = std::max(worst, std::abs(fd - grad[i]));
  }
  MESSAGE("max |finite difference − gradient| = " << worst);
  CHECK(worst < 1e-6);
}

TEST_CASE("tile attention agrees with the T×T attention") {
  const dml::nn::attention_shape a{2, 150, 3, 16};
  const tile_attention_shape s{2, 150, 3, 0, 16};
  const auto qkv = random_vector(sz(a.batch * a.seq * 3 * a.width()), 11, -2.f, 2.f);
  const auto dy = random_vector(sz(a.batch * a.seq * a.width()), 12);
  std::vector<float> probs(sz(dml::nn::attention_saved_size(a))), y(dy.size()), dqkv(qkv.size()),
      scratch(sz(dml::nn::attention_scratch_size(a)));
  dml::nn::causal_attention_forward<dml::host>(a, qkv.data(), probs.data(), y.data());
  dml::nn::causal_attention_backward<dml::host>(a, qkv.data(), probs.data(), dy.data(), dqkv.data(), scratch.data());
  const auto got = tile_run<float>(s, qkv, dy, {});
  const double fwd = rel_diff(got.y, std::vector<double>(y.begin(), y.end()));
  const double bwd = rel_diff(got.dqkv, std::vector<double>(dqkv.begin(), dqkv.end()));
  MESSAGE("vs T×T: forward rel_diff=" << fwd << " backward rel_diff=" << bwd);
  CHECK(fwd < 2e-6);
  CHECK(bwd < 5e-6);
}

TEST_CASE("tile attention in bf16 stays within bf16's rounding of the float result") {
  const tile_attention_shape s{2, 100, 4, 2, 16};
  const auto qkv = random_vector(sz(s.batch * s.seq * s.row()), 21, -1.f, 1.f);
  const auto dy = random_vector(sz(s.batch * s.seq * s.width()), 22);
  // The float run on bf16-rounded inputs: what is left is the rounding of outputs and of nothing inside.
  const auto rounded = [](std::vector<float> v) {
    for (auto& x : v) x = static_cast<float>(dml::bf16(x));
    return v;
  };
  const auto qkv_r = rounded(qkv), dy_r = rounded(dy);
  const auto f = tile_run<float>(s, qkv_r, dy_r, {});
  const auto h = tile_run<dml::bf16>(s, qkv_r, dy_r, {});
  const double fwd = rel_diff(h.y, std::vector<double>(f.y.begin(), f.y.end()));
  const double bwd = rel_diff(h.dqkv, std::vector<double>(f.dqkv.begin(), f.dqkv.end()));
  MESSAGE("bf16 vs float: forward rel_diff=" << fwd << " backward rel_diff=" << bwd);
  CHECK(fwd < 4e-3);  // one bf16 rounding: 2^-9 of the largest value
  CHECK(bwd < 4e-3);
  CHECK(h.lse == f.lse);  // the statistics stay float
}

TEST_CASE("tile attention keeps one float per row, whatever the sequence length") {
  const tile_attention_shape s{3, 4096, 8, 2, 64};
  CHECK(dml::nn::tile_attention_saved_size(s) == 3 * 8 * 4096);
  CHECK(dml::nn::tile_attention_workspace_size(s) == 3 * 4096 * 8 * 64 + 3 * 8 * 4096);
  // A row that sees no key (its document starts after it cannot happen; no causal mask with documents is refused).
  const std::vector<float> qkv(sz(s.row()), 0.f);
  std::vector<float> y(sz(s.width())), lse(8);
  std::int64_t doc = 0;
  CHECK_THROWS_WITH_AS(dml::nn::tile_attention_forward<dml::host>(tile_attention_shape{1, 1, 8, 2, 64, false}, qkv.data(),
                                                                  y.data(), lse.data(), &doc),
                       "dml::nn::tile_attention_forward: document masks need the causal mask (a document's keys end "
                       "at its query)",
                       dml::invalid_argument);
}

TEST_CASE("tile attention checks its arguments") {
  std::vector<float> v(1024);
  float* p = v.data();
  CHECK_THROWS_WITH_AS(dml::nn::tile_attention_forward<dml::host>(tile_attention_shape{1, 4, 6, 4, 8}, p, p, p),
                       "dml::nn::tile_attention_forward: expected kv_heads dividing heads = 6, found kv_heads = 4",
                       dml::invalid_argument);
  CHECK_THROWS_WITH_AS(dml::nn::tile_attention_forward<dml::host>(tile_attention_shape{1, 0, 2, 0, 8}, p, p, p),
                       "dml::nn::tile_attention_forward: expected seq > 0, found seq = 0", dml::invalid_argument);
  CHECK_THROWS_WITH_AS(dml::nn::tile_attention_backward<dml::host>(tile_attention_shape{1, 4, 2, 0, 8}, p, p, p, p, p,
                                                                   static_cast<float*>(nullptr)),
                       "dml::nn::tile_attention_backward: expected a pointer to workspace, found null",
                       dml::invalid_argument);
}

}  // namespace test_tile_attention
