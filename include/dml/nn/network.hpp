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

template <class... Layers>
param_layout make_layout(const sequential<Layers...>& model) {
  param_layout out;
  out.first_slot.assign(sizeof...(Layers) + 1, 0);
  std::int64_t offset = 0;
  for (auto& [layer, spec] : model.parameters()) {
    const std::int64_t n = spec.shape.numel();
    out.slots.push_back({spec.name, spec.shape, layer, offset, spec});
    offset += (n + param_layout::alignment - 1) / param_layout::alignment * param_layout::alignment;
    out.numel += n;
  }
  out.total = offset;
  for (std::size_t l = 0, s = 0; l <= sizeof...(Layers); ++l) {
    while (s < out.slots.size() && out.slots[s].layer < l) ++s;
    out.first_slot[l] = s;
  }
  return out;
}

namespace kernels {
struct init_param {
  rng_stream rng;
  init_kind kind;
  float a, b;
  float* w;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const auto k = static_cast<std::uint64_t>(i);
    switch (kind) {
      case init_kind::zeros: w[i] = 0.f; break;
      case init_kind::ones: w[i] = 1.f; break;
      case init_kind::uniform: w[i] = rng.uniform(k, a, b); break;
      case init_kind::normal: w[i] = rng.normal(k, a, b); break;
    }
  }
};
}  // namespace kernels

template <execution_space Space, class... Layers>
class network {
 public:
  using model_type = sequential<Layers...>;
  using space = Space;
  static constexpr std::size_t depth = sizeof...(Layers);

  explicit network(model_type model, std::uint64_t seed = 0)
      : model_(std::move(model)), layout_(make_layout(model_)), params_(layout_.total), grads_(layout_.total),
        w_ptrs_(layout_.slots.size()), g_ptrs_(layout_.slots.size()) {
    for (std::size_t i = 0; i < layout_.slots.size(); ++i) {
      w_ptrs_[i] = params_.data() + layout_.slots[i].offset;
      g_ptrs_[i] = grads_.data() + layout_.slots[i].offset;
    }
    init(seed);
    zero_grad();
  }
  network(const network&) = delete;
  network& operator=(const network&) = delete;

  // Parameter i of the layout starts from (seed, i) alone: every rank and thread count gets the same values.
  void init(std::uint64_t seed) {
    fill_n<Space>(params_.data(), layout_.total, 0.f);
    for (std::size_t i = 0; i < layout_.slots.size(); ++i) {
      const auto& s = layout_.slots[i];
      for_each_index<Space>(s.shape.numel(),
                            kernels::init_param{rng_stream{seed, i}, s.spec.init, s.spec.a, s.spec.b, w_ptrs_[i]});
    }
  }
  void zero_grad() { fill_n<Space>(grads_.data(), layout_.total, 0.f); }

  const model_type& model() const { return model_; }
  const param_layout& layout() const { return layout_; }
  std::span<float> params() { return params_.span(); }
  std::span<const float> params() const { return params_.span(); }
  std::span<float> grads() { return grads_.span(); }
  std::span<const float> grads() const { return grads_.span(); }
  float* param(std::size_t slot) { return w_ptrs_[slot]; }
  float* grad(std::size_t slot) { return g_ptrs_[slot]; }

  // Runs every layer; the returned view stays valid until the next forward.
  tensor_view<const float, Space> forward(tensor_view<const float, Space> x, context c = {}) {
    prepare(x.shape);
    input_ = x;
    run_forward(c, std::make_index_sequence<depth>{});
    return output_of(depth - 1);
  }

  // Backward from ∂loss/∂output; writes (or with c.accumulate adds) parameter gradients.
  // With want_input_grad the gradient with respect to the input is returned, else an empty view.
  tensor_view<const float, Space> backward(tensor_view<const float, Space> dy, context c = {},
                                           bool want_input_grad = false) {
    if (!(dy.shape == output_of(depth - 1).shape))
      fail<shape_error>("dml::nn::network::backward: expected a gradient of shape ", output_of(depth - 1).shape,
                        " (the last forward's output), found ", dy.shape);
    c.ones = ones_.data();
    c.workspace = workspace_.data();
    current_dy_ = dy;
    want_input_grad_ = want_input_grad;
    run_backward(c, std::make_index_sequence<depth>{});
    return want_input_grad ? current_dy_ : tensor_view<const float, Space>{};
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
    fill_n<Space>(ones_.data(), rows, 1.f);
    workspace_.resize(static_cast<std::size_t>(std::max<std::int64_t>(work, 1)));
    input_shape_ = in;
  }

  layer_params params_of(std::size_t layer) {
    return {w_ptrs_.data() + layout_.first_slot[layer], g_ptrs_.data() + layout_.first_slot[layer]};
  }
  // A relu fused into the linear before it shares that layer's output buffer.
  tensor_view<float, Space> output_of(std::size_t i) {
    if (absorbed_[i]) return {acts_[i - 1].data(), acts_[i - 1].shape()};
    return acts_[i].view();
  }
  tensor_view<const float, Space> input_of(std::size_t i) {
    return i == 0 ? input_ : tensor_view<const float, Space>(output_of(i - 1));
  }

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
    if constexpr (fuses_relu<I>())
      l.template forward<Space>(c, params_of(I), input_of(I), output_of(I), epilogue::relu);
    else if (!absorbed_[I])
      l.template forward<Space>(c, params_of(I), input_of(I), output_of(I));
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
    const auto x = input_of(I);
    // The first layer's input gradient is wasted work unless the caller wants it.
    const bool need_dx = I > 0 || want_input_grad_;
    float* dx_data = need_dx ? dgrad_[I % 2].data() : nullptr;
    tensor_view<float, Space> dx{dx_data, x.shape};
    std::get<I>(model_.layers).template backward<Space>(c, params_of(I), x, output_of(I), current_dy_, dx);
    current_dy_ = tensor_view<const float, Space>(dx_data, x.shape);
  }

  model_type model_;
  param_layout layout_;
  buffer<float, Space> params_, grads_;
  std::vector<float*> w_ptrs_, g_ptrs_;
  std::vector<tensor<float, Space>> acts_;
  buffer<float, Space> dgrad_[2];
  buffer<float, Space> ones_, workspace_;
  dml::shape input_shape_{};
  tensor_view<const float, Space> input_{}, current_dy_{};
  bool want_input_grad_ = false;
};

}  // namespace dml::nn
