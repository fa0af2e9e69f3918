// SPDX-License-Identifier: Apache-2.0
// dml/nn/network.hpp — a sequential given flat parameter/gradient storage and activations in one space.
// Sits on nn/sequential.hpp; optim/ updates its flat buffers and train/ drives forward and backward.
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
#include "dml/nn/sequential.hpp"

namespace dml::nn {

// Where each parameter lives in the flat buffer. Gradients and optimizer states use the same offsets.
struct param_slot {
  std::string name;
  dml::shape shape;
  std::size_t layer = 0;
  std::int64_t offset = 0;
  param_spec spec;
};

struct param_layout {
  // Each parameter starts on a 64-byte boundary, so a bucket or shard boundary never splits a vector lane.
  static constexpr std::int64_t alignment = 16;
  std::int64_t padding_unit = alignment;  // what each slot was rounded to
  std::vector<param_slot> slots;
  std::vector<std::size_t> first_slot;  // per layer, plus one past the end
  std::int64_t total = 0;               // floats, padding included
  std::int64_t numel = 0;               // floats, padding excluded

  const param_slot& find(std::string_view name) const {
    for (const auto& s : slots)
      if (s.name == name) return s;
    std::string have;
    for (const auto& s : slots) have += (have.empty() ? "" : ", ") + s.name;
    fail<invalid_argument>("dml::nn::param_layout: no parameter named '", name, "'; the model has: ", have);
  }
};

// alignment: floats each parameter's start and the total are rounded to (a multiple of 16; sharded
// trainers pass 16·ranks so every parameter splits into equal, aligned per-rank parts).
template <class... Layers>
param_layout make_layout(const sequential<Layers...>& model, std::int64_t alignment = param_layout::alignment) {
  if (alignment <= 0 || alignment % param_layout::alignment != 0)
    fail<invalid_argument>("dml::nn::make_layout: expected an alignment that is a positive multiple of ",
                           param_layout::alignment, ", found ", alignment);
  param_layout out;
  out.first_slot.assign(sizeof...(Layers) + 1, 0);
  std::int64_t offset = 0;
  for (auto& [layer, spec] : model.parameters()) {
    const std::int64_t n = spec.shape.numel();
    out.slots.push_back({spec.name, spec.shape, layer, offset, spec});
    offset += (n + alignment - 1) / alignment * alignment;
    out.numel += n;
  }
  out.total = offset;
  out.padding_unit = alignment;
  for (std::size_t l = 0, s = 0; l <= sizeof...(Layers); ++l) {
    while (s < out.slots.size() && out.slots[s].layer < l) ++s;
    out.first_slot[l] = s;
  }
  return out;
}

namespace kernels {
template <class T = float>
struct init_param {
  rng_stream rng;
  init_kind kind;
  float a, b;
  T* w;
  DML_HOST_DEVICE static float value(const rng_stream& rng, init_kind kind, float a, float b, std::uint64_t k) {
    switch (kind) {
      case init_kind::ones: return 1.f;
      case init_kind::uniform: return rng.uniform(k, a, b);
      case init_kind::normal: return rng.normal(k, a, b);
      case init_kind::zeros: break;
    }
    return 0.f;
  }
  DML_HOST_DEVICE void operator()(std::int64_t i) const { w[i] = T(value(rng, kind, a, b, static_cast<std::uint64_t>(i))); }
};
// Elements [first, first + n) of a parameter, written to out[0, n).
struct init_param_range {
  rng_stream rng;
  init_kind kind;
  float a, b;
  float* out;
  std::int64_t first;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    out[i] = init_param<>::value(rng, kind, a, b, static_cast<std::uint64_t>(first + i));
  }
};
}  // namespace kernels

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
};

// A sequential with storage in Space; T is the working type of parameters, gradients and activations
// (float, or bf16/fp16 when a mixed-precision trainer keeps float master weights elsewhere). Inputs
// are float: cast to T on entry, except for a first layer that takes float input (embedding ids).
template <execution_space Space, class T, class... Layers>
class basic_network {
 public:
  using model_type = sequential<Layers...>;
  using space = Space;
  using value_type = T;
  static constexpr std::size_t depth = sizeof...(Layers);

  explicit basic_network(model_type model, std::uint64_t seed = 0, network_options opt = {})
      : model_(std::move(model)), layout_(make_layout(model_, opt.alignment)),
        params_(opt.own_params ? layout_.total : 0), grads_(opt.own_grads ? layout_.total : 0),
        w_ptrs_(layout_.slots.size()), g_ptrs_(layout_.slots.size()) {
    for (std::size_t i = 0; i < layout_.slots.size(); ++i) {
      w_ptrs_[i] = opt.own_params ? params_.data() + layout_.slots[i].offset : nullptr;
      g_ptrs_[i] = opt.own_grads ? grads_.data() + layout_.slots[i].offset : nullptr;
    }
    if (opt.own_params) init(seed);
    if (opt.own_grads) zero_grad();
  }
  basic_network(const basic_network&) = delete;
  basic_network& operator=(const basic_network&) = delete;

  // Parameter i of the layout starts from (seed, i) alone: every rank and thread count gets the same values.
  void init(std::uint64_t seed) {
    fill_n<Space>(params_.data(), layout_.total, T(0.f));
    for (std::size_t i = 0; i < layout_.slots.size(); ++i) {
      const auto& s = layout_.slots[i];
      for_each_index<Space>(s.shape.numel(),
                            kernels::init_param<T>{rng_stream{seed, i}, s.spec.init, s.spec.a, s.spec.b, w_ptrs_[i]});
    }
  }
  void zero_grad() { fill_n<Space>(grads_.data(), layout_.total, T(0.f)); }

  const model_type& model() const { return model_; }
  const param_layout& layout() const { return layout_; }
  std::span<T> params() { return params_.span(); }
  std::span<const T> params() const { return params_.span(); }
  std::span<T> grads() { return grads_.span(); }
  std::span<const T> grads() const { return grads_.span(); }
  T* param(std::size_t slot) { return w_ptrs_[slot]; }
  T* grad(std::size_t slot) { return g_ptrs_[slot]; }
  // Where a slot's parameter or gradient lives from now on (storage owned by a sharded trainer).
  void set_param_pointer(std::size_t slot, T* p) { w_ptrs_[slot] = p; }
  void set_grad_pointer(std::size_t slot, T* p) { g_ptrs_[slot] = p; }

  // Writes slot s's initial values for elements [begin, end) to out: the values init() gives, for a
  // trainer that keeps only part of a parameter.
  void init_range(std::uint64_t seed, std::size_t s, std::int64_t begin, std::int64_t end, float* out) const {
    const auto& slot = layout_.slots[s];
    for_each_index<Space>(end - begin, kernels::init_param_range{rng_stream{seed, s}, slot.spec.init, slot.spec.a,
                                                                 slot.spec.b, out, begin});
  }

  // Runs every layer; the returned view stays valid until the next forward.
  tensor_view<const T, Space> forward(tensor_view<const float, Space> x, context c = {},
                                      layer_hooks* hooks = nullptr) {
    prepare(x.shape);
    input_float_ = x;
    if constexpr (std::same_as<T, float>) {
      input_ = x;
    } else if constexpr (!first_takes_float) {
      input_cast_.resize(static_cast<std::size_t>(x.numel()));
      cast_n<Space>(x.data, input_cast_.data(), x.numel());
      input_ = tensor_view<const T, Space>(input_cast_.data(), x.shape);
    }
    hooks_ = hooks;
    run_forward(c, std::make_index_sequence<depth>{});
    return output_of(depth - 1);
  }

  // Backward from ∂loss/∂output; writes (or with c.accumulate adds) parameter gradients.
  // With want_input_grad the gradient with respect to the input is returned, else an empty view.
  tensor_view<const T, Space> backward(tensor_view<const T, Space> dy, context c = {},
                                       bool want_input_grad = false, layer_hooks* hooks = nullptr) {
    hooks_ = hooks;
    if (!(dy.shape == output_of(depth - 1).shape))
      fail<shape_error>("dml::nn::network::backward: expected a gradient of shape ", output_of(depth - 1).shape,
                        " (the last forward's output), found ", dy.shape);
    c.ones = ones_.data();
    c.workspace = workspace_.data();
    current_dy_ = dy;
    want_input_grad_ = want_input_grad;
    run_backward(c, std::make_index_sequence<depth>{});
    return want_input_grad ? current_dy_ : tensor_view<const T, Space>{};
  }

 private:
  void prepare(const dml::shape& in) {
    if (in == input_shape_ && !acts_.empty()) return;
    std::vector<dml::shape> shapes;
    dml::shape s = in;
    std::int64_t widest = in.numel(), work = 0, rows = in.rows();
    std::apply(
        [&](const auto&... l) {
          std::size_t index = 0;
          (
              [&] {
                const dml::shape x = s;
                try {
                  s = l.output_shape(x);
                } catch (const shape_error& e) {
                  fail<shape_error>("dml::nn::network: layer ", index, " (", l.kind,
                                    ") does not accept the output of the layer before it: ", e.what());
                }
                ++index;
                shapes.push_back(s);
                widest = std::max(widest, s.numel());
                work = std::max(work, nn::workspace_size(l, x));
                rows = std::max(rows, x.rows());
              }(),
              ...);
        },
        model_.layers);
    acts_.resize(depth);
    for (std::size_t i = 0; i < depth; ++i) acts_[i].resize(absorbed_[i] ? dml::shape{0} : shapes[i]);
    for (auto& g : dgrad_) g.resize(static_cast<std::size_t>(widest));
    ones_.resize(static_cast<std::size_t>(rows));
    fill_n<Space>(ones_.data(), rows, T(1.f));
    workspace_.resize(static_cast<std::size_t>(std::max<std::int64_t>(work, 1)));
    input_shape_ = in;
  }

  layer_params<T> params_of(std::size_t layer) {
    return {w_ptrs_.data() + layout_.first_slot[layer], g_ptrs_.data() + layout_.first_slot[layer]};
  }
  // A relu fused into the linear before it shares that layer's output buffer.
  tensor_view<T, Space> output_of(std::size_t i) {
    if (absorbed_[i]) return {acts_[i - 1].data(), acts_[i - 1].shape()};
    return acts_[i].view();
  }
  tensor_view<const T, Space> input_of(std::size_t i) {
    return i == 0 ? input_ : tensor_view<const T, Space>(output_of(i - 1));
  }
  // Layer I's input: the float input itself for a first layer that takes floats, else of type T.
  template <std::size_t I>
  auto layer_input() {
    if constexpr (I == 0 && first_takes_float) return input_float_;
    else return input_of(I);
  }
  static constexpr bool first_takes_float = requires { requires std::tuple_element_t<0, std::tuple<Layers...>>::float_input; };

  using layer_types = std::tuple<Layers...>;
  // linear followed by relu: the GEMM applies the relu in its epilogue and the relu layer's forward is skipped.
  template <std::size_t I>
  static constexpr bool fuses_relu() {
    if constexpr (I + 1 < depth)
      return is_linear_v<std::tuple_element_t<I, layer_types>> && std::is_same_v<std::tuple_element_t<I + 1, layer_types>, relu>;
    else
      return false;
  }
  static constexpr std::array<bool, depth> absorbed_ = []<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<bool, depth>{(I > 0 && fuses_relu<(I > 0 ? I - 1 : 0)>())...};
  }(std::make_index_sequence<depth>{});

  template <std::size_t I>
  void forward_layer(context c) {
    c.layer = I;
    const auto& l = std::get<I>(model_.layers);
    if (hooks_) hooks_->before_forward(I);
    if constexpr (fuses_relu<I>())
      l.template forward<Space>(c, params_of(I), layer_input<I>(), output_of(I), epilogue::relu);
    else if (!absorbed_[I])
      l.template forward<Space>(c, params_of(I), layer_input<I>(), output_of(I));
  }

  template <std::size_t... I>
  void run_forward(context c, std::index_sequence<I...>) {
    (forward_layer<I>(c), ...);
  }

  template <std::size_t... I>
  void run_backward(context c, std::index_sequence<I...>) {
    (backward_layer<depth - 1 - I>(c), ...);
  }

  template <std::size_t I>
  void backward_layer(context c) {
    c.layer = I;
    if (hooks_) hooks_->before_backward(I);
    const auto x = layer_input<I>();
    // The first layer's input gradient is wasted work unless the caller wants it.
    const bool need_dx = I > 0 || want_input_grad_;
    T* dx_data = need_dx ? dgrad_[I % 2].data() : nullptr;
    tensor_view<T, Space> dx{dx_data, x.shape};
    std::get<I>(model_.layers).template backward<Space>(c, params_of(I), x, tensor_view<const T, Space>(output_of(I)),
                                                        current_dy_, dx);
    current_dy_ = tensor_view<const T, Space>(dx_data, x.shape);
    if (hooks_) hooks_->after_backward(I);
  }

  model_type model_;
  param_layout layout_;
  buffer<T, Space> params_, grads_;
  std::vector<T*> w_ptrs_, g_ptrs_;
  std::vector<tensor<T, Space>> acts_;
  buffer<T, Space> dgrad_[2];
  buffer<T, Space> ones_, input_cast_;
  buffer<float, Space> workspace_;
  dml::shape input_shape_{};
  tensor_view<const float, Space> input_float_{};
  tensor_view<const T, Space> input_{}, current_dy_{};
  bool want_input_grad_ = false;
  layer_hooks* hooks_ = nullptr;
};

// The fp32 network: what every single-precision user means by "network".
template <execution_space Space, class... Layers>
using network = basic_network<Space, float, Layers...>;

}  // namespace dml::nn
