// SPDX-License-Identifier: Apache-2.0
// dml/nn/sequential.hpp — a model as a tuple of layers, named as PyTorch's nn.Sequential names them.
// Sits on nn/layer.hpp; nn/network.hpp gives it storage and runs it in an execution space.
#pragma once

#include <cstddef>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dml/nn/layer.hpp"

namespace dml::nn {

namespace detail {
template <class L>
constexpr bool preserves_width_v = requires { requires L::preserves_width; };

// Walks the layers keeping the last static width; true when every known pair agrees.
template <class... L>
consteval bool static_widths_chain() {
  std::int64_t width = dynamic;
  bool ok = true;
  auto visit = [&]<class X>() {
    if (width != dynamic && X::static_in != dynamic && X::static_in != width) ok = false;
    if (X::static_out != dynamic) width = X::static_out;
    else if (!preserves_width_v<X>) width = dynamic;
  };
  (visit.template operator()<L>(), ...);
  return ok;
}
}  // namespace detail

template <class... Layers>
class sequential {
  static_assert(sizeof...(Layers) > 0, "dml::nn::sequential: needs at least one layer");
  static_assert((diagnose_layer<Layers>() && ...));
  static_assert(detail::static_widths_chain<Layers...>(),
                "dml::nn::sequential: a layer's static input width differs from the static output width before "
                "it; make linear<In, Out> widths agree along the chain");

 public:
  static constexpr std::size_t size = sizeof...(Layers);
  static constexpr bool uses_row_index = (uses_row_index_v<Layers> || ...);
  std::tuple<Layers...> layers;

  constexpr explicit sequential(Layers... ls) : layers(std::move(ls)...) {}

  template <std::size_t I>
  const auto& get() const {
    return std::get<I>(layers);
  }

  // Output shape for input shape x; a shape_error names the layer that does not fit.
  dml::shape output_shape(dml::shape x) const {
    return std::apply(
        [&](const auto&... l) {
          std::size_t index = 0;
          ((x = checked_shape(l, x, index++)), ...);
          return x;
        },
        layers);
  }

  // (layer index, spec) for every parameter, names prefixed "i." as in PyTorch's state dict.
  std::vector<std::pair<std::size_t, param_spec>> parameters() const {
    std::vector<std::pair<std::size_t, param_spec>> out;
    std::apply(
        [&](const auto&... l) {
          std::size_t index = 0;
          (
              [&] {
                for (auto spec : l.parameters()) {
                  spec.name = std::to_string(index) + "." + spec.name;
                  out.emplace_back(index, std::move(spec));
                }
                ++index;
              }(),
              ...);
        },
        layers);
    return out;
  }

  // "linear(784, 256)"-style description, one entry per layer.
  std::vector<std::string> describe() const {
    std::vector<std::string> out;
    std::apply([&](const auto&... l) { (out.push_back(l.kind), ...); }, layers);
    return out;
  }

 private:
  template <class L>
  static dml::shape checked_shape(const L& l, const dml::shape& x, std::size_t index) {
    try {
      return l.output_shape(x);
    } catch (const shape_error& e) {
      fail<shape_error>("dml::nn::sequential: layer ", index, " (", L::kind, ") does not accept its input: ", e.what());
    }
  }
};

template <class... L>
sequential(L...) -> sequential<L...>;

}  // namespace dml::nn
