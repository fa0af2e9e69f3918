// SPDX-License-Identifier: Apache-2.0
// dml/nn/network.hpp — a sequential given flat parameter/gradient storage and activations in one space.
// Sits on nn/param_layout.hpp and nn/sequential.hpp; optim/ updates its flat buffers and train/ drives forward and
// backward.
#pragma once

#include <algorithm>
#include <array>
#include <tuple>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/rng.hpp"
#include "dml/nn/activation.hpp"
#include "dml/nn/linear.hpp"
#include "dml/nn/param_layout.hpp"
#include "dml/nn/sequential.hpp"

namespace dml::nn {

// Called around each layer by forward and backward: sharded trainers gather parameters and launch
// gradient reductions here. Layers are numbered as in the sequential.
struct layer_hooks {
  virtual ~layer_hooks() = default;
  virtual void before_forward(std::size_t) {}
  virtual void before_backward(std::size_t) {}
  virtual void after_backward(std::size_t) {}
};

struct network_options {
  std::int64_t alignment = param_layout::alignment;  // see make_layout
  bool own_params = true;  // false: the owner points every slot at its storage (ZeRO-3)
  bool own_grads = true;   // false: the owner points every slot's gradient at its storage (ZeRO-2/3)
  std::vector<layer_range> layers{};  // the layers this network holds parameters for; empty: all
};

// Which gradients a backward pass computes. Split backward (zero-bubble pipelines) runs `input`
// first, keeping each splitting layer's output gradient, and `weight` later from what was kept;
// layers that cannot split compute everything in the `input` pass.
enum class backward_part : std::uint8_t { full, input, weight };

template <class L>
inline constexpr bool splits_backward_v = requires { requires L::splits_backward; };

// A splitting layer with more to keep between its passes than its output gradient (a block whose weight
// gradients need its inner layers' output gradients) declares stash_bytes(x, value_bytes); the network keeps that
// many bytes for it, passes them as context::stash to both passes, and keeps no copy of its output gradient.
template <class L>
concept stashes_backward = requires(const L& l, dml::shape x, std::size_t value_bytes) {
  { l.stash_bytes(x, value_bytes) } -> std::convertible_to<std::int64_t>;
};

// Elements of the working type (value_bytes each) a splitting layer keeps from its input pass to its weight pass,
// on input x and output y: its stash, or a copy of its output gradient.
template <class L>
std::int64_t split_kept_elements(const L& l, const dml::shape& x, const dml::shape& y, std::size_t value_bytes) {
  if constexpr (stashes_backward<L>) {
    const auto v = static_cast<std::int64_t>(value_bytes);
    return (l.stash_bytes(x, value_bytes) + v - 1) / v;
  } else {
    return y.numel();
  }
}

// The activations of one forward pass over a layer range: what its backward reads. A pipeline stage
// keeps one set per micro-batch in flight, so the count of live sets is its activation memory.
template <class T, execution_space Space>
struct activations {
  std::vector<tensor<T, Space>> out;                // per layer of the model; sized only in the range
  std::vector<tensor<T, Space>> dy;                 // split backward: output gradients kept for `weight`
  std::vector<buffer<float, Space>> saved;          // per layer: what it keeps for backward (saved_bytes)
  tensor<T, Space> input;                           // the range's input in the working type
  tensor_view<const float, Space> input_float{};    // the caller's input, for a range that starts at layer 0
  dml::shape input_shape{};
  std::int64_t bytes() const {  // storage held: tensors left unsized hold none
    std::int64_t b = input.bytes();
    for (const auto& t : out) b += t.bytes();
    for (const auto& t : dy) b += t.bytes();
    for (const auto& t : saved) b += static_cast<std::int64_t>(t.bytes());
    return b;
  }
  // Drops the layer outputs and kept gradients, keeping the input (activation recomputation).
  void release_outputs() {
    for (auto& t : out) t = {};
    for (auto& t : dy) t = {};
    for (auto& t : saved) t = {};
  }
};

// A sequential with storage in Space; T is the working type of parameters, gradients and activations
// (float, or bf16/fp16 when a mixed-precision trainer keeps float master weights elsewhere). Inputs
// are float: cast to T on entry, except for a first layer that takes float input (embedding ids).
// forward/backward run the whole model on the network's own activations; forward_range and
// backward_range run a layer range (a pipeline stage) on activations the caller keeps per micro-batch.
template <execution_space Space, class T, class... Layers>
class basic_network {
 public:
  using model_type = sequential<Layers...>;
  using space = Space;
  using value_type = T;
  using activation_set = activations<T, Space>;
  static constexpr std::size_t elements = sizeof...(Layers);

  explicit basic_network(model_type model, std::uint64_t seed = 0, network_options opt = {})
      : model_(std::move(model)), depth_(model_.depth()), absorbed_(absorbed_layers(model_)),
        layout_(make_layout(model_, opt.alignment, opt.layers)),
        params_(opt.own_params ? layout_.total : 0), grads_(opt.own_grads ? layout_.total : 0),
        w_ptrs_(layout_.slots.size()), g_ptrs_(layout_.slots.size()) {
    std::size_t index = 0, e = 0;
    std::apply([&](const auto&... el) { ((first_[e++] = index, index += element_size(el)), ...); }, model_.layers);
    for (std::size_t i = 0; i < layout_.slots.size(); ++i) {
      w_ptrs_[i] = opt.own_params ? params_.data() + layout_.slots[i].offset : nullptr;
      g_ptrs_[i] = opt.own_grads ? grads_.data() + layout_.slots[i].offset : nullptr;
    }
    if (opt.own_params) init(seed);
    if (opt.own_grads) zero_grad();
  }
  basic_network(const basic_network&) = delete;
  basic_network& operator=(const basic_network&) = delete;

  // Layers, counting each member of a stack: layer ranges, hooks and slots use these flat indices.
  std::size_t depth() const { return depth_; }
  // absorbed[l]: layer l is a relu that the linear before it applies; no range may start there.
  bool absorbed(std::size_t l) const { return absorbed_[l]; }
  static std::vector<bool> absorbed_layers(const model_type& model) {
    std::vector<bool> out(model.depth(), false);
    std::size_t index = 0;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((out[index] = I > 0 && fuses_relu<(I > 0 ? I - 1 : 0)>(), index += element_size(std::get<I>(model.layers))), ...);
    }(std::make_index_sequence<elements>{});
    return out;
  }

  // Parameter i of the model starts from (seed, i) alone: every rank, thread count, pipeline cut and
  // tensor-parallel part gets the values one rank's model has.
  void init(std::uint64_t seed) {
    fill_n<Space>(params_.data(), layout_.total, T(0.f));
    for (std::size_t i = 0; i < layout_.slots.size(); ++i) {
      const auto& s = layout_.slots[i];
      for_each_index<Space>(s.shape.numel(), kernels::init_param<T>{rng_stream{seed, s.init_id}, s.spec.init, s.spec.a,
                                                                    s.spec.b, w_ptrs_[i], s.spec.shard});
    }
  }
  void zero_grad() { fill_n<Space>(grads_.data(), layout_.total, T(0.f)); }

  const model_type& model() const { return model_; }
  const param_layout& layout() const { return layout_; }
  span_in<T, Space> params() { return params_.span(); }
  span_in<const T, Space> params() const { return params_.span(); }
  span_in<T, Space> grads() { return grads_.span(); }
  span_in<const T, Space> grads() const { return grads_.span(); }
  T* param(std::size_t slot) { return w_ptrs_[slot]; }
  T* grad(std::size_t slot) { return g_ptrs_[slot]; }
  // Where a slot's parameter or gradient lives from now on (storage owned by a sharded trainer).
  void set_param_pointer(std::size_t slot, T* p) { w_ptrs_[slot] = p; }
  void set_grad_pointer(std::size_t slot, T* p) { g_ptrs_[slot] = p; }

  // Writes slot s's initial values for elements [begin, end) to out: the values init() gives, for a
  // trainer that keeps only part of a parameter.
  void init_range(std::uint64_t seed, std::size_t s, std::int64_t begin, std::int64_t end, float* out) const {
    const auto& slot = layout_.slots[s];
    for_each_index<Space>(end - begin, kernels::init_param_range{rng_stream{seed, slot.init_id}, slot.spec.init,
                                                                 slot.spec.a, slot.spec.b, out, begin, slot.spec.shard});
  }

  // Runs every layer; the returned view stays valid until the next forward.
  tensor_view<const T, Space> forward(tensor_view<const float, Space> x, context c = {},
                                      layer_hooks* hooks = nullptr) {
    set_input(own_, x);
    return forward_range({0, depth_}, own_, c, hooks);
  }

  // Backward from ∂loss/∂output; writes (or with c.accumulate adds) parameter gradients.
  // With want_input_grad the gradient with respect to the input is returned, else an empty view.
  tensor_view<const T, Space> backward(tensor_view<const T, Space> dy, context c = {},
                                       bool want_input_grad = false, layer_hooks* hooks = nullptr) {
    return backward_range({0, depth_}, own_, dy, c, backward_part::full, want_input_grad, hooks);
  }

  // The input of a range that starts at layer 0: the caller's float rows, read in place (they must
  // outlive the backward), or cast to T under mixed precision unless the first layer takes floats.
  // A later range's input is a.input, which the caller fills (a received tensor).
  void set_input(activation_set& a, tensor_view<const float, Space> x) {
    a.input_float = x;
    a.input_shape = x.shape;
    if constexpr (!std::same_as<T, float> && !first_takes_float) {
      a.input.resize(x.shape);
      cast_n<Space>(x.data, a.input.data(), x.numel());
    }
  }
  // The output shape of every layer from `first` on when layer first's input has shape x (index l:
  // layer l's output; earlier entries are empty).
  std::vector<dml::shape> shapes(const dml::shape& x, std::size_t first = 0) const {
    std::vector<dml::shape> out;
    dml::shape s = x;
    model_.for_each_layer([&](std::size_t index, const auto& l) {
      if (index < first) {
        out.emplace_back();
        return;
      }
      try {
        s = l.output_shape(s);
      } catch (const shape_error& e) {
        fail<shape_error>("dml::nn::network: layer ", index, " (", l.kind,
                          ") does not accept the output of the layer before it: ", e.what());
      }
      out.push_back(s);
    });
    return out;
  }

  // Forward over layers r into a: a.input (or a.input_float for r.first == 0) must be set. The
  // returned view (layer r.end − 1's output) lives in a.
  tensor_view<const T, Space> forward_range(layer_range r, activation_set& a, context c = {},
                                            layer_hooks* hooks = nullptr) {
    check_range(r);
    if (r.first > 0) a.input_shape = a.input.shape();
    prepare(a, r);
    hooks_ = hooks;
    active_ = &a;
    if (c.tp) c.tp->set_pass(pass::forward);
    c.workspace = workspace_.data();
    run_forward(c, r, std::make_index_sequence<elements>{});
    return output_of(a, r.end - 1);
  }

  // Backward over layers r from ∂loss/∂(r's output), reading the activations forward_range left in a.
  // part: all gradients, the input gradient only (each splitting layer keeps its output gradient in
  // a.dy), or the weight gradients from what the input pass kept. Returns ∂loss/∂(r's input) when
  // want_input_grad (valid until the next backward), else an empty view.
  tensor_view<const T, Space> backward_range(layer_range r, activation_set& a, tensor_view<const T, Space> dy,
                                             context c = {}, backward_part part = backward_part::full,
                                             bool want_input_grad = false, layer_hooks* hooks = nullptr) {
    check_range(r);
    hooks_ = hooks;
    active_ = &a;
    if (part != backward_part::weight && !(dy.shape == output_of(a, r.end - 1).shape))
      fail<shape_error>("dml::nn::network::backward: expected a gradient of shape ", output_of(a, r.end - 1).shape,
                        " (the last forward's output), found ", dy.shape);
    if (c.tp) c.tp->set_pass(pass::backward);
    c.ones = ones_.data();
    c.workspace = workspace_.data();
    current_dy_ = dy;
    want_input_grad_ = want_input_grad && part != backward_part::weight;
    part_ = part;
    if (part == backward_part::input) a.dy.resize(depth_);
    run_backward(c, r, std::make_index_sequence<elements>{});
    return want_input_grad_ ? current_dy_ : tensor_view<const T, Space>{};
  }

 private:
  template <class E>
  static std::size_t element_size(const E& e) {
    if constexpr (is_stack_v<E>) return e.layers.size();
    else return 1;
  }
  void check_range(layer_range r) const {
    if (r.first >= r.end || r.end > depth_)
      fail<invalid_argument>("dml::nn::network: expected a layer range within [0, ", depth_, "), found [", r.first,
                             ", ", r.end, ")");
    if (r.first > 0 && absorbed_[r.first])
      fail<invalid_argument>("dml::nn::network: a range cannot start at layer ", r.first,
                             ": it is a relu fused into the linear before it");
  }
  void prepare(activation_set& a, layer_range r) {
    const auto out = shapes(a.input_shape, r.first);
    std::int64_t widest = a.input_shape.numel(), work = 0, rows = a.input_shape.rows();
    a.saved.resize(depth_);
    model_.for_each_layer([&](std::size_t index, const auto& l) {
      if (!r.contains(index)) return;
      const dml::shape x = index == r.first ? a.input_shape : out[index - 1];
      widest = std::max(widest, out[index].numel());
      work = std::max(work, nn::workspace_size(l, x));
      rows = std::max(rows, x.rows());
      const std::int64_t kept = nn::saved_bytes(l, x, sizeof(T));
      a.saved[index].resize(static_cast<std::size_t>((kept + 3) / 4));
    });
    a.out.resize(depth_);
    for (std::size_t i = r.first; i < r.end; ++i) a.out[i].resize(absorbed_[i] ? dml::shape{0} : out[i]);
    if (widest > widest_) {
      for (auto& g : dgrad_) g.resize(static_cast<std::size_t>(widest));
      widest_ = widest;
    }
    if (rows > rows_) {
      ones_.resize(static_cast<std::size_t>(rows));
      fill_n<Space>(ones_.data(), rows, T(1.f));
      rows_ = rows;
    }
    if (work + 1 > static_cast<std::int64_t>(workspace_.size())) workspace_.resize(static_cast<std::size_t>(work + 1));
  }

  layer_params<T> params_of(std::size_t layer) {
    return {w_ptrs_.data() + layout_.first_slot[layer], g_ptrs_.data() + layout_.first_slot[layer]};
  }
  // A relu fused into the linear before it shares that layer's output buffer.
  tensor_view<T, Space> output_of(activation_set& a, std::size_t i) const {
    if (absorbed_[i]) return {a.out[i - 1].data(), a.out[i - 1].shape()};
    return a.out[i].view();
  }
  // The input of layer `index` of element I: the float input itself for a first layer that takes
  // floats, else of type T.
  template <std::size_t I>
  auto layer_input(std::size_t index, std::size_t first) {
    activation_set& a = *active_;
    if constexpr (I == 0 && (first_takes_float || std::same_as<T, float>)) {
      return a.input_float;
    } else if constexpr (I == 0) {
      return a.input.cview();
    } else {
      if (index == first) return a.input.cview();
      return tensor_view<const T, Space>(output_of(a, index - 1));
    }
  }
  static constexpr bool first_takes_float = requires { requires std::tuple_element_t<0, std::tuple<Layers...>>::float_input; };

  using layer_types = std::tuple<Layers...>;
  // linear followed by relu: the GEMM applies the relu in its epilogue and the relu layer's forward is skipped.
  template <std::size_t I>
  static constexpr bool fuses_relu() {
    if constexpr (I + 1 < elements)
      return is_linear_v<std::tuple_element_t<I, layer_types>> && std::is_same_v<std::tuple_element_t<I + 1, layer_types>, relu>;
    else
      return false;
  }

  // Element I's layer, or each member of a stack (last first in backward). Written without lambdas over
  // the pack: nvcc 13 rejects a pack used inside a lambda within a fold.
  template <std::size_t... I>
  void run_forward(context c, layer_range r, std::index_sequence<I...>) {
    (forward_element<I>(c, r), ...);
  }
  template <std::size_t I>
  void forward_element(const context& c, layer_range r) {
    const auto& e = std::get<I>(model_.layers);
    if constexpr (is_stack_v<std::remove_cvref_t<decltype(e)>>) {
      for (std::size_t j = 0; j < e.layers.size(); ++j) forward_layer<I>(e.layers[j], first_[I] + j, c, r);
    } else {
      forward_layer<I>(e, first_[I], c, r);
    }
  }
  template <std::size_t I, class L>
  void forward_layer(const L& l, std::size_t index, context c, layer_range r) {
    if (!r.contains(index)) return;
    c.layer = index;
    activation_set& a = *active_;
    c.saved = reinterpret_cast<std::byte*>(a.saved[index].data());
    if (hooks_) hooks_->before_forward(index);
    // A fused pair cut at the range's end still fuses: the relu's output is the linear's.
    if constexpr (fuses_relu<I>())
      l.template forward<Space>(c, params_of(index), layer_input<I>(index, r.first), output_of(a, index), epilogue::relu);
    else if (!absorbed_[index])
      l.template forward<Space>(c, params_of(index), layer_input<I>(index, r.first), output_of(a, index));
  }

  template <std::size_t... I>
  void run_backward(context c, layer_range r, std::index_sequence<I...>) {
    (backward_element<sizeof...(I) - 1 - I>(c, r), ...);
  }
  template <std::size_t I>
  void backward_element(const context& c, layer_range r) {
    const auto& e = std::get<I>(model_.layers);
    if constexpr (is_stack_v<std::remove_cvref_t<decltype(e)>>) {
      for (std::size_t j = e.layers.size(); j-- > 0;) backward_layer<I>(e.layers[j], first_[I] + j, c, r);
    } else {
      backward_layer<I>(e, first_[I], c, r);
    }
  }

  // Gradients that are one rank's part of a sum over the tensor group (sequence parallelism), summed
  // once the step's last backward has written them.
  void reduce_partial(std::size_t index, const context& c) {
    if (!c.gradients_complete || !c.tp || c.tp->size() == 1) return;
    for (std::size_t s = layout_.first_slot[index]; s < layout_.first_slot[index + 1]; ++s)
      if (layout_.slots[s].spec.partial_over_tensor_group) c.tp->all_reduce(typed_ptr(g_ptrs_[s]), layout_.slots[s].shape.numel());
  }

  template <std::size_t I, class L>
  void backward_layer(const L& l, std::size_t index, context c, layer_range r) {
    if (!r.contains(index)) return;
    c.layer = index;
    activation_set& a = *active_;
    c.saved = reinterpret_cast<std::byte*>(a.saved[index].data());
    const auto x = layer_input<I>(index, r.first);
    const auto y = tensor_view<const T, Space>(output_of(a, index));
    if (part_ == backward_part::weight) {  // only splitting layers have work left
      if constexpr (splits_backward_v<L>) {
        c.weight_grads = true;
        if constexpr (stashes_backward<L>) c.stash = reinterpret_cast<std::byte*>(a.dy[index].data());
        l.template backward<Space>(c, params_of(index), x, y, a.dy[index].cview(), tensor_view<T, Space>{nullptr, x.shape});
        a.dy[index] = {};
      }
      // The pass that completes a step's gradients is a weight pass here, for every layer: a layer that does not
      // split finished its gradients in the input pass, but its partial sums over the tensor group wait for now.
      reduce_partial(index, c);
      if (hooks_) hooks_->after_backward(index);
      return;
    }
    if (hooks_) hooks_->before_backward(index);
    // The first layer's input gradient is wasted work unless the caller wants it.
    const bool need_dx = index > r.first || want_input_grad_;
    T* dx_data = need_dx ? dgrad_[index % 2].data() : nullptr;
    tensor_view<T, Space> dx{dx_data, x.shape};
    bool weights_later = false;
    if constexpr (splits_backward_v<L>) {
      if (part_ == backward_part::input) {
        c.weight_grads = false;
        weights_later = true;
        if constexpr (stashes_backward<L>) {
          a.dy[index].resize(dml::shape{split_kept_elements(l, x.shape, y.shape, sizeof(T))});
          c.stash = reinterpret_cast<std::byte*>(a.dy[index].data());
        } else {
          a.dy[index].resize(current_dy_.shape);
          dml::copy_n(current_dy_.data, static_cast<std::size_t>(current_dy_.numel()), a.dy[index].data());
        }
      }
    }
    l.template backward<Space>(c, params_of(index), x, y, current_dy_, dx);
    if (!weights_later) reduce_partial(index, c);
    current_dy_ = tensor_view<const T, Space>(dx_data, x.shape);
    if (hooks_ && part_ == backward_part::full) hooks_->after_backward(index);
  }

  model_type model_;
  std::size_t depth_;
  std::vector<bool> absorbed_;
  std::array<std::size_t, elements> first_{};  // flat index of each element's first layer
  param_layout layout_;
  buffer<T, Space> params_, grads_;
  std::vector<T*> w_ptrs_, g_ptrs_;
  activation_set own_;
  activation_set* active_ = nullptr;
  buffer<T, Space> dgrad_[2];
  buffer<T, Space> ones_;
  buffer<float, Space> workspace_;
  std::int64_t widest_ = 0, rows_ = 0;
  tensor_view<const T, Space> current_dy_{};
  bool want_input_grad_ = false;
  backward_part part_ = backward_part::full;
  layer_hooks* hooks_ = nullptr;
};

// The fp32 network: what every single-precision user means by "network".
template <execution_space Space, class... Layers>
using network = basic_network<Space, float, Layers...>;

// A network for a model, its layer types deduced: `auto net = make_network(model, seed);` instead of spelling
// out network<host, linear, relu, linear>. (The class is neither copyable nor movable: the result is built in
// place.)
template <execution_space Space = host, class T = float, class... Layers>
basic_network<Space, T, Layers...> make_network(const sequential<Layers...>& model, std::uint64_t seed = 0,
                                                network_options opt = {}) {
  return basic_network<Space, T, Layers...>(model, seed, std::move(opt));
}

}  // namespace dml::nn
