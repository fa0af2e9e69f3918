// SPDX-License-Identifier: Apache-2.0
// tests/nn/test_gradcheck.cpp — every layer's and the loss's gradients against central finite differences.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "dml/nn/activation.hpp"
#include "dml/nn/dropout.hpp"
#include "dml/nn/embedding.hpp"
#include "dml/nn/gradcheck.hpp"
#include "dml/nn/layernorm.hpp"
#include "dml/nn/linear.hpp"
#include "dml/nn/loss.hpp"
#include "dml/nn/network.hpp"
#include "support.hpp"

namespace test_gradcheck {

namespace {

using dml_test::random_vector;

}  // namespace

TEST_CASE("linear: gradients of weight, bias and input match finite differences") {
  auto rep = dml::nn::check_gradients(dml::nn::linear{13, 7}, {5, 13}, random_vector(65, 1));
  MESSAGE("linear max_rel_diff=" << rep.max_rel << " over " << rep.checked);
  CHECK(rep.checked > 20);
  CHECK(rep.max_rel < 2e-3);
}

TEST_CASE("linear without bias on rank-3 input") {
  auto rep = dml::nn::check_gradients(dml::nn::linear{6, 4, false}, {2, 3, 6}, random_vector(36, 2));
  CHECK(rep.max_rel < 2e-3);
}

TEST_CASE("relu and gelu: input gradients match finite differences") {
  // Inputs kept away from relu's kink, where a difference quotient straddles two slopes.
  auto x = random_vector(40, 3, 0.1f, 1.f);
  for (std::size_t i = 0; i < x.size(); i += 2) x[i] = -x[i];
  auto relu = dml::nn::check_gradients(dml::nn::sequential{dml::nn::linear{8, 8}, dml::nn::relu{}}, {5, 8}, x,
                                       {.h = 1e-3f});
  MESSAGE("relu max_rel_diff=" << relu.max_rel);
  CHECK(relu.max_rel < 1e-2);
  auto gelu = dml::nn::check_gradients(dml::nn::gelu{}, {5, 8}, random_vector(40, 4, -3.f, 3.f));
  MESSAGE("gelu max_rel_diff=" << gelu.max_rel);
  CHECK(gelu.max_rel < 2e-3);
}

TEST_CASE("layernorm: weight, bias and input gradients match finite differences") {
  auto model = dml::nn::sequential{dml::nn::linear{6, 9}, dml::nn::layernorm{9}};
  auto rep = dml::nn::check_gradients(model, {4, 6}, random_vector(24, 5));
  MESSAGE("layernorm max_rel_diff=" << rep.max_rel);
  CHECK(rep.max_rel < 5e-3);
}

TEST_CASE("embedding: table gradient sums over repeated ids") {
  std::vector<float> ids{0, 3, 3, 1, 4, 0};
  auto rep = dml::nn::check_gradients(dml::nn::sequential{dml::nn::embedding{5, 4}, dml::nn::linear{4, 3}}, {2, 3}, ids,
                                      {.check_input = false});
  MESSAGE("embedding max_rel_diff=" << rep.max_rel);
  CHECK(rep.max_rel < 2e-3);
}

TEST_CASE("dropout: backward applies the forward mask, in training and evaluation") {
  dml::nn::context c{.training = true, .seed = 11, .step = 3};
  auto rep = dml::nn::check_gradients(dml::nn::sequential{dml::nn::linear{10, 10}, dml::nn::dropout{0.3f}}, {6, 10},
                                      random_vector(60, 6), {.ctx = c});
  CHECK(rep.max_rel < 2e-3);
  // The mask keeps about 1 − p of the elements and scales them by 1/(1 − p).
  std::vector<float> ones(100000, 1.f), out(100000);
  dml::nn::dropout d{0.3f};
  d.forward<dml::host>(c, {}, dml::tensor_view<const float>(ones.data(), {100000}),
                       dml::tensor_view<float>(out.data(), {100000}));
  double kept = 0, sum = 0;
  for (float v : out) {
    kept += v != 0.f;
    sum += v;
  }
  CHECK(kept / 1e5 == doctest::Approx(0.7).epsilon(0.01));
  CHECK(sum / 1e5 == doctest::Approx(1.0).epsilon(0.02));
  c.training = false;
  d.forward<dml::host>(c, {}, dml::tensor_view<const float>(ones.data(), {100000}),
                       dml::tensor_view<float>(out.data(), {100000}));
  CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == 1.f; }));
}

TEST_CASE("dropout: a row's mask depends on its global row, not on the batch it is computed in") {
  dml::nn::dropout d{0.5f};
  for (const dml::shape xs : {dml::shape{9, 13}, dml::shape{6, 3, 5}}) {
    CAPTURE(xs);
    const std::int64_t rows = xs[0], width = xs.numel() / rows, base = 40;
    const auto x = random_vector(static_cast<std::size_t>(xs.numel()), 3);
    dml::nn::context c{.training = true, .seed = 11, .step = 3, .layer = 2, .row_offset = base};
    std::vector<float> y(x.size()), dx(x.size());
    d.forward<dml::host>(c, {}, dml::tensor_view<const float>(x.data(), xs), dml::tensor_view<float>(y.data(), xs));
    d.backward<dml::host>(c, {}, {}, {}, dml::tensor_view<const float>(x.data(), xs),
                          dml::tensor_view<float>(dx.data(), xs));
    CHECK(y == dx);  // backward recomputes the forward mask
    // Every row alone, and rows [r, rows) as a smaller batch, at their global position: the same values.
    std::int64_t mismatches = 0, same_as_row0 = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      for (const std::int64_t n : {std::int64_t{1}, rows - r}) {
        dml::shape s = xs;
        s[0] = n;
        dml::nn::context cr = c;
        cr.row_offset = base + r;
        std::vector<float> part(static_cast<std::size_t>(n * width)), dpart(part.size());
        const float* xr = x.data() + r * width;
        d.forward<dml::host>(cr, {}, dml::tensor_view<const float>(xr, s), dml::tensor_view<float>(part.data(), s));
        d.backward<dml::host>(cr, {}, {}, {}, dml::tensor_view<const float>(xr, s),
                              dml::tensor_view<float>(dpart.data(), s));
        for (std::size_t i = 0; i < part.size(); ++i) {
          mismatches += part[i] != y[static_cast<std::size_t>(r * width) + i];
          mismatches += dpart[i] != y[static_cast<std::size_t>(r * width) + i];
        }
      }
      // Row r's mask is its own: the same row at another position draws other bits.
      if (r > 0) {
        bool same = true;
        for (std::int64_t j = 0; j < width; ++j)
          same = same && (y[static_cast<std::size_t>(r * width + j)] == 0.f) == (y[static_cast<std::size_t>(j)] == 0.f);
        same_as_row0 += same;
      }
    }
    MESSAGE("mismatches=" << mismatches);
    CHECK(mismatches == 0);
    CHECK(same_as_row0 == 0);
  }
  // Gradients still check out at a nonzero offset.
  const dml::nn::context c{.training = true, .seed = 11, .step = 3, .row_offset = 17};
  auto rep = dml::nn::check_gradients(dml::nn::sequential{dml::nn::linear{10, 10}, dml::nn::dropout{0.3f}}, {6, 10},
                                      random_vector(60, 6), {.ctx = c});
  MESSAGE("dropout at row_offset 17 max_rel_diff=" << rep.max_rel);
  CHECK(rep.max_rel < 2e-3);
}

TEST_CASE("softmax cross-entropy: loss and logit gradients match finite differences and a direct formula") {
  const std::int64_t rows = 6, n = 5;
  auto logits = random_vector(rows * n, 8, -3.f, 3.f);
  std::vector<std::int32_t> labels{0, 4, 2, 2, 1, 3};
  std::vector<float> dlogits(rows * n), row_loss(rows);
  dml::nn::softmax_cross_entropy loss;
  auto eval = [&](std::vector<float>& l, float* d) {
    return loss.forward_backward<dml::host>(dml::tensor_view<const float>(l.data(), {rows, n}), labels.data(),
                                            dml::tensor_view<float>(d, {rows, n}), row_loss.data());
  };
  const float value = eval(logits, dlogits.data());
  double direct = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    double z = 0;
    for (std::int64_t j = 0; j < n; ++j) z += std::exp(double(logits[r * n + j]));
    direct += std::log(z) - logits[r * n + labels[r]];
  }
  CHECK(value == doctest::Approx(direct / rows).epsilon(1e-6));
  double max_rel = 0;
  const float h = 1e-2f;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const double numeric = dml::nn::central_difference(logits[i], h, [&] { return eval(logits, nullptr); });
    max_rel = std::max(max_rel, std::abs(numeric - dlogits[i]) / std::max(1e-2, std::abs(numeric)));
  }
  MESSAGE("softmax_xent max_rel_diff=" << max_rel);
  CHECK(max_rel < 5e-3);
}

}  // namespace test_gradcheck
