// SPDX-License-Identifier: Apache-2.0
// dml/nn/sequential.hpp — a model as a tuple of layers, named as PyTorch's nn.Sequential names them.
// Sits on nn/layer.hpp; nn/network.hpp gives it storage and runs it in an execution space.
#pragma once

#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dml/nn/layer.hpp"

namespace dml::nn {

// A run of one layer type whose length is known only at run time: GPT's blocks h.0, h.1, ... A
// sequential counts each member as a layer of its own (flat layer indices), so pipeline stages may
// cut between any two, and names their parameters "<name>.<j>.<parameter>".
template <class L>
struct stack {
  std::string name;
  std::vector<L> layers;
};
template <class E>
inline constexpr bool is_stack_v = false;
template <class L>
inline constexpr bool is_stack_v<stack<L>> = true;

namespace detail {
template <class E>
struct element_layer {
  using type = E;
};
template <class L>
struct element_layer<stack<L>> {
  using type = L;
};
}  // namespace detail
// The layer type of a sequential's element: L for stack<L>.
template <class E>
using element_layer_t = typename detail::element_layer<E>::type;

// Layers that name their parameters themselves ("wte.weight") carry `std::string prefix`; the rest
// are named by their flat index, as nn.Sequential names them ("0.weight").
template <class L>
concept has_prefix = requires(const L& l) {
  { l.prefix } -> std::convertible_to<std::string>;
};

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
  static_assert((diagnose_layer<element_layer_t<Layers>>() && ...));
  static_assert(!is_stack_v<std::tuple_element_t<0, std::tuple<Layers...>>>,
                "dml::nn::sequential: the first element takes the model's input and cannot be a stack");
  static_assert(detail::static_widths_chain<element_layer_t<Layers>...>(),
                "dml::nn::sequential: a layer's static input width differs from the static output width before "
                "it; make linear<In, Out> widths agree along the chain");

 public:
  static constexpr std::size_t size = sizeof...(Layers);  // elements; a stack is one
  static constexpr bool uses_row_index = (uses_row_index_v<element_layer_t<Layers>> || ...);
  std::tuple<Layers...> layers;

  constexpr explicit sequential(Layers... ls) : layers(std::move(ls)...) {}

  template <std::size_t I>
  const auto& get() const {
    return std::get<I>(layers);
  }

  // Layers, counting each member of a stack.
  std::size_t depth() const {
    std::size_t n = 0;
    for_each_layer([&](std::size_t, const auto&) { ++n; });
    return n;
  }

  // f(flat index, layer) for every layer in order, members of stacks one by one.
  template <class F>
  void for_each_layer(F&& f) const {
    std::size_t index = 0;
    std::apply([&](const auto&... e) { (visit_element(e, index, f), ...); }, layers);
  }
  // The same over a mutable sequential (a tensor-parallel trainer configures each layer's part).
  template <class F>
  void for_each_layer(F&& f) {
    std::size_t index = 0;
    std::apply([&](auto&... e) { (visit_element(e, index, f), ...); }, layers);
  }

  // Output shape for input shape x; a shape_error names the layer that does not fit.
  dml::shape output_shape(dml::shape x) const {
    for_each_layer([&](std::size_t index, const auto& l) { x = checked_shape(l, x, index); });
    return x;
  }

  // (flat layer index, spec) for every parameter, named as PyTorch's state dict names them: "i." for
  // layer i, "<name>.<j>." for member j of a stack, or the layer's own prefix.
  std::vector<std::pair<std::size_t, param_spec>> parameters() const {
    std::vector<std::pair<std::size_t, param_spec>> out;
    std::size_t index = 0;
    std::apply(
        [&](const auto&... e) {
          (
              [&] {
                using E = std::remove_cvref_t<decltype(e)>;
                if constexpr (is_stack_v<E>) {
                  for (std::size_t j = 0; j < e.layers.size(); ++j)
                    add_parameters(out, index++, e.layers[j], e.name + "." + std::to_string(j) + ".");
                } else if constexpr (has_prefix<E>) {
                  add_parameters(out, index++, e, std::string(e.prefix));
                } else {
                  add_parameters(out, index, e, std::to_string(index) + ".");
                  ++index;
                }
              }(),
              ...);
        },
        layers);
    return out;
  }

  // The kind of every layer ("linear", "relu", ...), one entry per flat layer.
  std::vector<std::string> describe() const {
    std::vector<std::string> out;
    for_each_layer([&](std::size_t, const auto& l) { out.push_back(l.kind); });
    return out;
  }

 private:
  template <class E, class F>
  static void visit_element(E& e, std::size_t& index, F& f) {
    if constexpr (is_stack_v<std::remove_const_t<E>>) {
      for (auto& l : e.layers) f(index++, l);
    } else {
      f(index++, e);
    }
  }
  template <class L>
  static void add_parameters(std::vector<std::pair<std::size_t, param_spec>>& out, std::size_t index, const L& l,
                             const std::string& prefix) {
    for (auto spec : l.parameters()) {
      spec.name = prefix + spec.name;
      out.emplace_back(index, std::move(spec));
    }
  }
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

// Gives every layer that has a tensor-parallel form (`set_split`) its part; the others run replicated:
// every rank of the group computes all of them.
template <class... L>
void set_tensor_split(sequential<L...>& model, tensor_split s) {
  model.for_each_layer([&](std::size_t, auto& l) {
    if constexpr (requires { l.set_split(s); }) l.set_split(s);
  });
}

// Gives every layer that holds experts (`set_expert_split`) its share of them: rank of ranks, and the ranks whose
// tokens their capacity counts (batch_ranks; 0: unknown).
template <class... L>
void set_expert_split(sequential<L...>& model, int ranks, int rank, int batch_ranks = 0) {
  model.for_each_layer([&](std::size_t, auto& l) {
    if constexpr (requires { l.set_expert_split(ranks, rank, batch_ranks); }) l.set_expert_split(ranks, rank, batch_ranks);
  });
}

// Tells every layer whose shapes follow context parallelism (`set_context_split`) its chunk of the sequence.
template <class... L>
void set_context_split(sequential<L...>& model, context_split s) {
  model.for_each_layer([&](std::size_t, auto& l) {
    if constexpr (requires { l.set_context_split(s); }) l.set_context_split(s);
  });
}

}  // namespace dml::nn
