// SPDX-License-Identifier: Apache-2.0
// dml/nn/mlp.hpp — a multilayer perceptron as a sequential: linear, relu, ..., linear.
// Sits on nn/sequential.hpp; the depth is a type (H hidden layers), the widths are values.
#pragma once

#include <array>
#include <cstddef>
#include <span>
#include <tuple>
#include <utility>

#include "dml/nn/activation.hpp"
#include "dml/nn/linear.hpp"
#include "dml/nn/sequential.hpp"

namespace dml::nn {

namespace detail {
template <std::size_t... I>
auto mlp_layers(std::int64_t in, std::span<const std::int64_t> hidden, std::int64_t out, std::index_sequence<I...>) {
  const auto width = [&](std::size_t i) { return i == 0 ? in : hidden[i - 1]; };
  return std::tuple_cat(std::make_tuple(linear{width(I), hidden[I]}, relu{})..., std::make_tuple(linear{width(sizeof...(I)), out}));
}
}  // namespace detail

// mlp<2>(784, {256, 256}, 10) is sequential{linear{784,256}, relu{}, linear{256,256}, relu{}, linear{256,10}},
// named 0.weight, 0.bias, 2.weight, ... as the same nn.Sequential in PyTorch.
template <std::size_t H>
auto mlp(std::int64_t in, std::span<const std::int64_t> hidden, std::int64_t out) {
  if (hidden.size() != H)
    fail<invalid_argument>("dml::nn::mlp<", H, ">: expected ", H, " hidden widths, found ", hidden.size());
  return std::apply([](auto... l) { return sequential{l...}; },
                    detail::mlp_layers(in, hidden, out, std::make_index_sequence<H>{}));
}

// Calls fn(mlp<H>(...)) for the H equal to hidden.size(), for H up to MaxHidden: depth chosen at run
// time, each depth compiled as its own static type.
template <std::size_t MaxHidden = 4, class F>
decltype(auto) with_mlp(std::int64_t in, std::span<const std::int64_t> hidden, std::int64_t out, F&& fn) {
  if (hidden.size() > MaxHidden)
    fail<invalid_argument>("dml::nn::with_mlp: expected at most ", MaxHidden, " hidden layers, found ", hidden.size());
  return [&]<std::size_t... H>(std::index_sequence<H...>) -> decltype(auto) {
    using result = decltype(fn(mlp<0>(in, hidden.first(0), out)));
    if constexpr (std::is_void_v<result>) {
      (void)((hidden.size() == H ? (fn(mlp<H>(in, hidden, out)), true) : false) || ...);
    } else {
      result r{};
      (void)((hidden.size() == H ? (r = fn(mlp<H>(in, hidden, out)), true) : false) || ...);
      return r;
    }
  }(std::make_index_sequence<MaxHidden + 1>{});
}

}  // namespace dml::nn
