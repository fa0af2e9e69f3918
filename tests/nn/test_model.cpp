// SPDX-License-Identifier: Apache-2.0
// tests/nn/test_model.cpp — sequential naming, flat layout, initialisation, shape errors and mlp building.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "dml/dml.hpp"

namespace test_model {

using namespace dml;

TEST_CASE("sequential names parameters as PyTorch's nn.Sequential state dict") {
  auto model = nn::sequential{nn::linear{4, 3}, nn::relu{}, nn::layernorm{3}, nn::linear{3, 2, false}};
  nn::network<host, nn::linear<>, nn::relu, nn::layernorm, nn::linear<>> net(model, 1);
  const auto& slots = net.layout().slots;
  REQUIRE(slots.size() == 5);
  CHECK(slots[0].name == "0.weight");
  CHECK(slots[0].shape == shape{3, 4});
  CHECK(slots[1].name == "0.bias");
  CHECK(slots[2].name == "2.weight");
  CHECK(slots[3].name == "2.bias");
  CHECK(slots[4].name == "3.weight");
  CHECK(slots[4].shape == shape{2, 3});
  // Every slot starts on the alignment; the total covers the last slot.
  for (const auto& s : slots) CHECK(s.offset % nn::param_layout::alignment == 0);
  CHECK(net.layout().numel == 12 + 3 + 3 + 3 + 6);
  CHECK(net.layout().total == 5 * nn::param_layout::alignment);
}

TEST_CASE("pack drops the padding of any alignment; unpack puts the values back into another layout") {
  auto model = nn::sequential{nn::linear{5, 3}, nn::relu{}, nn::linear{3, 7}};
  const auto small = nn::make_layout(model), wide = nn::make_layout(model, 16 * 3);  // one rank, and 3 shards
  REQUIRE(small.numel == 5 * 3 + 3 + 3 * 7 + 7);
  CHECK(wide.total > small.total);
  std::vector<float> a(static_cast<std::size_t>(small.total), -1.f);
  float v = 0.f;
  for (const auto& slot : small.slots)
    for (std::int64_t i = 0; i < slot.shape.numel(); ++i) a[static_cast<std::size_t>(slot.offset + i)] = v++;
  const auto packed = nn::pack(small, a);
  REQUIRE(packed.size() == static_cast<std::size_t>(small.numel));
  for (std::size_t i = 0; i < packed.size(); ++i) CHECK(packed[i] == static_cast<float>(i));  // no padding in it
  const auto b = nn::unpack(wide, packed);
  CHECK(b.size() == static_cast<std::size_t>(wide.total));
  CHECK(nn::pack(wide, b) == packed);
  CHECK_THROWS_WITH_AS(nn::pack(wide, a), doctest::Contains("(padding included)"), invalid_argument);
  CHECK_THROWS_WITH_AS(nn::unpack(small, a), doctest::Contains("(no padding)"), invalid_argument);
}

TEST_CASE("initialisation follows PyTorch's distributions and depends on the seed alone") {
  auto model = nn::sequential{nn::linear{400, 300}, nn::layernorm{300}, nn::embedding{50, 20}};
  nn::network<host, nn::linear<>, nn::layernorm, nn::embedding> a(model, 5), b(model, 5), c(model, 6);
  CHECK(std::equal(a.params().begin(), a.params().end(), b.params().begin()));
  CHECK(!std::equal(a.params().begin(), a.params().end(), c.params().begin()));
  const auto& L = a.layout();
  const float bound = 1.f / std::sqrt(400.f);
  double sum = 0, sq = 0, mx = 0;
  const float* w = a.params().data() + L.find("0.weight").offset;
  for (int i = 0; i < 120000; ++i) {
    sum += w[i];
    sq += double(w[i]) * w[i];
    mx = std::max(mx, double(std::abs(w[i])));
  }
  CHECK(mx <= bound);
  CHECK(mx > 0.99 * bound);
  CHECK(std::abs(sum / 120000) < 0.01 * bound);
  CHECK(sq / 120000 == doctest::Approx(bound * bound / 3).epsilon(0.02));  // variance of U(-b, b)
  const float* g = a.params().data() + L.find("1.weight").offset;
  const float* beta = a.params().data() + L.find("1.bias").offset;
  CHECK(std::all_of(g, g + 300, [](float v) { return v == 1.f; }));
  CHECK(std::all_of(beta, beta + 300, [](float v) { return v == 0.f; }));
  const float* e = a.params().data() + L.find("2.weight").offset;
  double es = 0, esq = 0;
  for (int i = 0; i < 1000; ++i) {
    es += e[i];
    esq += double(e[i]) * e[i];
  }
  CHECK(std::abs(es / 1000) < 0.12);                       // N(0, 1): mean within ~4 standard errors
  CHECK(esq / 1000 == doctest::Approx(1.0).epsilon(0.15));
  // Padding between slots stays zero.
  const auto& s0 = L.find("0.bias");
  for (std::int64_t i = s0.offset + 300; i < L.find("1.weight").offset; ++i) CHECK(a.params()[i] == 0.f);
}

TEST_CASE("layer shapes that do not chain get a shape_error naming the layer") {
  auto model = nn::sequential{nn::linear{8, 16}, nn::relu{}, nn::linear{32, 4}};
  CHECK_THROWS_WITH_AS(model.output_shape({2, 8}),
                       doctest::Contains("layer 2 (linear) does not accept its input: dml::nn::linear: expected input "
                                         "with last dimension 32, found shape [2, 16]"),
                       shape_error);
  nn::network<host, nn::linear<>, nn::relu, nn::linear<>> net(model, 0);
  std::vector<float> x(16);
  CHECK_THROWS_WITH_AS(net.forward(tensor_view<const float>(x.data(), {2, 8})),
                       doctest::Contains("layer 2 (linear)"), shape_error);
  // The wrong input width is caught at the first layer.
  auto ok = nn::sequential{nn::linear{8, 4}};
  nn::network<host, nn::linear<>> net2(ok, 0);
  CHECK_THROWS_WITH_AS(net2.forward(tensor_view<const float>(x.data(), {4, 4})),
                       doctest::Contains("expected input with last dimension 8, found shape [4, 4]"), shape_error);
}

TEST_CASE("static widths chain at compile time") {
  // linear<784, 256> → relu → linear<256, 10> is accepted; the mismatching chain is rejected by a
  // static_assert, checked by the compile-fail test test_static_shapes_mismatch.
  auto model = nn::sequential{nn::linear<784, 256>{}, nn::relu{}, nn::linear<256, 10>{}};
  CHECK(model.output_shape({3, 784}) == shape{3, 10});
  CHECK(nn::detail::static_widths_chain<nn::linear<4, 8>, nn::relu, nn::linear<8, 2>>());
  CHECK(!nn::detail::static_widths_chain<nn::linear<4, 8>, nn::gelu, nn::linear<9, 2>>());
  CHECK(nn::detail::static_widths_chain<nn::linear<4, 8>, nn::embedding, nn::linear<9, 2>>());  // width unknown
  CHECK_THROWS_AS((nn::linear<4, 8>(4, 9)), shape_error);
}

TEST_CASE("bad layer arguments and bad data get errors saying what was expected") {
  CHECK_THROWS_WITH_AS(nn::linear(0, 3), doctest::Contains("widths must be positive, found in=0"), invalid_argument);
  CHECK_THROWS_AS(nn::dropout(1.f), invalid_argument);
  CHECK_THROWS_AS(nn::layernorm(0), invalid_argument);
  nn::network<host, nn::embedding> net(nn::sequential{nn::embedding{5, 2}}, 0);
  std::vector<float> ids{0, 7};
  CHECK_THROWS_WITH_AS(net.forward(tensor_view<const float>(ids.data(), {2})),
                       doctest::Contains("expected integer ids in [0, 5), found 7"), invalid_argument);
  std::vector<float> logits(6);
  std::vector<std::int32_t> labels{0, 3};
  std::vector<float> row(2);
  CHECK_THROWS_WITH_AS(nn::softmax_cross_entropy{}.forward_backward<host>(
                           tensor_view<const float>(logits.data(), {2, 3}), labels.data(), tensor_view<float>{}, row.data()),
                       doctest::Contains("expected labels in [0, 3), found 3 in row 1"), invalid_argument);
}

TEST_CASE("the cross-entropy equals a plain double-precision reference, and in place equals out of place") {
  // Rows of 3 (the MLP's shape of thing) and of 1,000 (a vocabulary's): loss = logsumexp(x) - x[label] averaged,
  // dx = (softmax(x) - onehot(label)) / rows.
  for (const std::int64_t n : {std::int64_t{3}, std::int64_t{1000}}) {
    CAPTURE(n);
    const std::int64_t rows = 5;
    std::vector<float> x(static_cast<std::size_t>(rows * n));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::sin(0.7 * static_cast<double>(i)) * 4);
    std::vector<std::int32_t> labels(static_cast<std::size_t>(rows));
    for (std::int64_t r = 0; r < rows; ++r) labels[static_cast<std::size_t>(r)] = static_cast<std::int32_t>((r * 7) % n);
    std::vector<float> dx(x.size()), row(static_cast<std::size_t>(rows));
    const float loss = nn::softmax_cross_entropy{}.forward_backward<host>(tensor_view<const float>(x.data(), {rows, n}),
                                                                          labels.data(), tensor_view<float>(dx.data(), {rows, n}),
                                                                          row.data());
    double want = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* xr = x.data() + r * n;
      double mx = xr[0], sum = 0;
      for (std::int64_t j = 1; j < n; ++j) mx = std::max(mx, double(xr[j]));
      for (std::int64_t j = 0; j < n; ++j) sum += std::exp(double(xr[j]) - mx);
      want += std::log(sum) - (double(xr[labels[static_cast<std::size_t>(r)]]) - mx);
      for (std::int64_t j = 0; j < n; ++j) {
        const double g = (std::exp(double(xr[j]) - mx) / sum - (j == labels[static_cast<std::size_t>(r)] ? 1 : 0)) / rows;
        CHECK(dx[static_cast<std::size_t>(r * n + j)] == doctest::Approx(g).epsilon(1e-5).scale(1e-6));
      }
    }
    CHECK(loss == doctest::Approx(want / rows).epsilon(1e-6));
    std::vector<float> inplace = x;  // the gradient written over the logits it is computed from
    const float loss2 = nn::softmax_cross_entropy{}.forward_backward<host>(
        tensor_view<const float>(inplace.data(), {rows, n}), labels.data(), tensor_view<float>(inplace.data(), {rows, n}),
        row.data());
    CHECK(loss2 == loss);
    CHECK(inplace == dx);
  }
}

TEST_CASE("mlp and with_mlp build the depth asked for at run time") {
  const std::vector<std::int64_t> hidden{32, 16};
  auto m = nn::mlp<2>(10, hidden, 3);
  static_assert(decltype(m)::size == 5);
  CHECK(m.output_shape({7, 10}) == shape{7, 3});
  for (std::size_t depth = 0; depth <= 3; ++depth) {
    std::vector<std::int64_t> h(depth, 8);
    const std::size_t layers = nn::with_mlp(10, h, 3, [](auto model) { return decltype(model)::size; });
    CHECK(layers == 2 * depth + 1);
  }
  std::vector<std::int64_t> too_deep(5, 8);
  CHECK_THROWS_AS(nn::with_mlp(10, too_deep, 3, [](auto) { return 0; }), invalid_argument);
}

TEST_CASE("backward accumulates with context.accumulate, as micro-batches need") {
  nn::network<host, nn::linear<>> net(nn::sequential{nn::linear{3, 2}}, 1);
  std::vector<float> x{1, 2, 3, 4, 5, 6}, dy{1, 0, 0, 1};
  net.forward(tensor_view<const float>(x.data(), {2, 3}));
  net.backward(tensor_view<const float>(dy.data(), {2, 2}));
  std::vector<float> once(net.grads().begin(), net.grads().end());
  net.forward(tensor_view<const float>(x.data(), {2, 3}));
  net.backward(tensor_view<const float>(dy.data(), {2, 2}), {.accumulate = true});
  for (std::size_t i = 0; i < once.size(); ++i) CHECK(net.grads()[i] == doctest::Approx(2 * once[i]));
  // dW = dyᵀ·x: row 0 of dW is x[0], row 1 is x[1]; db = column sums of dy.
  CHECK(once[0] == 1.f);
  CHECK(once[3] == 4.f);
  CHECK(once[16] == 1.f);
  CHECK(once[17] == 1.f);
}

}  // namespace test_model
