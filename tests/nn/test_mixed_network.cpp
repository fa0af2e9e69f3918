// SPDX-License-Identifier: Apache-2.0
// tests/nn/test_mixed_network.cpp — a network whose parameters, gradients and activations are bf16 or fp16
// computes what the fp32 network computes, to the precision of the type.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "dml/dml.hpp"

namespace test_mixed_network {

using namespace dml;

namespace {

auto make_model() {
  return nn::sequential{nn::linear{20, 32}, nn::relu{}, nn::layernorm{32}, nn::linear{32, 16}, nn::gelu{},
                        nn::linear{16, 5}};
}

// max |a − b| / max |b|
template <class A>
double rel_diff(std::span<const A> a, std::span<const float> b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    num = std::max(num, std::abs(double(static_cast<float>(a[i])) - b[i]));
    den = std::max(den, std::abs(double(b[i])));
  }
  return num / den;
}

}  // namespace

TEST_CASE_TEMPLATE("a low-precision network tracks the fp32 network", T, bf16, fp16) {
  const double tol = std::is_same_v<T, bf16> ? 3e-2 : 5e-3;  // 8 and 11 significant bits
  nn::basic_network<host, float, nn::linear<>, nn::relu, nn::layernorm, nn::linear<>, nn::gelu, nn::linear<>> ref(
      make_model(), 4);
  nn::basic_network<host, T, nn::linear<>, nn::relu, nn::layernorm, nn::linear<>, nn::gelu, nn::linear<>> low(
      make_model(), 4);
  // Same initial values, rounded once.
  for (std::size_t i = 0; i < ref.params().size(); ++i) CHECK(low.params()[i] == T(ref.params()[i]));
  // Give the fp32 network the rounded weights, so only the arithmetic differs.
  for (std::size_t i = 0; i < ref.params().size(); ++i) ref.params()[i] = static_cast<float>(low.params()[i]);

  const rng_stream rng{1, 2};
  std::vector<float> x(8 * 20);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = rng.normal(i);
  std::vector<std::int32_t> y{0, 1, 2, 3, 4, 0, 1, 2};
  const tensor_view<const float> xv(x.data(), {8, 20});

  auto ly = ref.forward(xv);
  auto lo = low.forward(xv);
  const double fwd = rel_diff<T>(lo.span(), ly.span());
  std::vector<float> row(8);
  tensor<float> dref({8, 5});
  tensor<T> dlow({8, 5});
  nn::softmax_cross_entropy loss;
  const float l32 = loss.forward_backward<host>(ly, y.data(), dref.view(), row.data());
  const float l16 = loss.forward_backward<host>(lo, y.data(), dlow.view(), row.data());
  ref.backward(dref.cview());
  low.backward(dlow.cview());
  const double bwd = rel_diff<T>(low.grads(), ref.grads());
  MESSAGE("forward max_rel_diff=" << fwd << " loss " << l16 << " vs " << l32 << " grads max_rel_diff=" << bwd);
  CHECK(fwd < tol);
  CHECK(std::abs(l16 - l32) < tol * l32);
  CHECK(bwd < 4 * tol);
  CHECK(nn::count_correct<host>(lo, y.data()) == nn::count_correct<host>(ly, y.data()));
}

TEST_CASE("embedding ids stay exact under bf16: the first layer reads the float input") {
  nn::basic_network<host, bf16, nn::embedding, nn::linear<>> net(nn::sequential{nn::embedding{1000, 4}, nn::linear{4, 3}}, 2);
  std::vector<float> ids{999, 513, 257, 0};  // not representable in bf16 (8 significant bits)
  auto out = net.forward(tensor_view<const float>(ids.data(), {4, 1}));
  CHECK(out.shape == shape{4, 1, 3});
  // Row 0 must come from table row 999 exactly: compare with a one-row lookup.
  nn::basic_network<host, bf16, nn::embedding, nn::linear<>> again(nn::sequential{nn::embedding{1000, 4}, nn::linear{4, 3}}, 2);
  std::vector<float> one{999};
  auto single = again.forward(tensor_view<const float>(one.data(), {1, 1}));
  for (int j = 0; j < 3; ++j) CHECK(out.data[j] == single.data[j]);
}

}  // namespace test_mixed_network
