// SPDX-License-Identifier: Apache-2.0
// dml/nn/activation.hpp — element-wise activations (relu, gelu in PyTorch's tanh form) and SiLU's arithmetic.
// Sits on core/algorithm.hpp; the arithmetic is DML_HOST_DEVICE functors shared by host and CUDA.
#pragma once

#include <cmath>

#include "dml/core/algorithm.hpp"
#include "dml/core/math.hpp"
#include "dml/nn/layer.hpp"

namespace dml::nn {

namespace kernels {
// T is the network's working type; arithmetic is in float.
template <class T>
struct relu_forward {
  const T* x;
  T* y;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const float v = static_cast<float>(x[i]);
    y[i] = T(v > 0.f ? v : 0.f);
  }
};
// Uses the output: y > 0 exactly where x > 0.
template <class T>
struct relu_backward {
  const T* y;
  const T* dy;
  T* dx;
  DML_HOST_DEVICE void operator()(std::int64_t i) const { dx[i] = static_cast<float>(y[i]) > 0.f ? dy[i] : T(0.f); }
};

// gelu(x) = x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³)))  (PyTorch approximate="tanh")
struct gelu_tanh {
  static constexpr float k0 = 0.7978845608028654f;  // √(2/π)
  static constexpr float k1 = 0.044715f;
  DML_HOST_DEVICE static float value(float x) {
    const float t = fast_tanh(k0 * (x + k1 * x * x * x));
    return 0.5f * x * (1.f + t);
  }
  DML_HOST_DEVICE static float derivative(float x) {
    const float u = k0 * (x + k1 * x * x * x);
    const float t = fast_tanh(u);
    const float du = k0 * (1.f + 3.f * k1 * x * x);
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * du;
  }
};
// silu(x) = x·σ(x) = x / (1 + e^−x), the gate of SwiGLU (nn/swiglu.hpp); e^−x = +inf below −88 gives −0, not NaN.
struct silu {
  DML_HOST_DEVICE static float sigmoid(float x) { return 1.f / (1.f + fast_exp(-x)); }
  DML_HOST_DEVICE static float value(float x) { return x * sigmoid(x); }
  DML_HOST_DEVICE static float derivative(float x) {  // σ(x)·(1 + x·(1 − σ(x)))
    const float s = sigmoid(x);
    return s * (1.f + x * (1.f - s));
  }
};
template <class T>
struct gelu_forward {
  const T* x;
  T* y;
  DML_HOST_DEVICE void operator()(std::int64_t i) const { y[i] = T(gelu_tanh::value(static_cast<float>(x[i]))); }
};
template <class T>
struct gelu_backward {
  const T* x;
  const T* dy;
  T* dx;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    dx[i] = T(static_cast<float>(dy[i]) * gelu_tanh::derivative(static_cast<float>(x[i])));
  }
};
}  // namespace kernels

// Activations keep the shape and have no parameters.
struct elementwise_base {
  static constexpr std::int64_t static_in = dynamic;
  static constexpr std::int64_t static_out = dynamic;
  static constexpr bool preserves_width = true;
  std::vector<param_spec> parameters() const { return {}; }
  dml::shape output_shape(dml::shape x) const { return x; }
};

struct relu : elementwise_base {
  static constexpr const char* kind = "relu";
  template <execution_space S, class T>
  void forward(const context&, layer_params<T>, tensor_view<const T, S> x, tensor_view<T, S> y) const {
    for_each_index<S>(x.numel(), kernels::relu_forward<T>{x.data, y.data});
  }
  template <execution_space S, class T>
  void backward(const context&, layer_params<T>, tensor_view<const T, S>, tensor_view<const T, S> y,
                tensor_view<const T, S> dy, tensor_view<T, S> dx) const {
    if (dx.data) for_each_index<S>(y.numel(), kernels::relu_backward<T>{y.data, dy.data, dx.data});
  }
};

struct gelu : elementwise_base {
  static constexpr const char* kind = "gelu";
  template <execution_space S, class T>
  void forward(const context&, layer_params<T>, tensor_view<const T, S> x, tensor_view<T, S> y) const {
    for_each_index<S>(x.numel(), kernels::gelu_forward<T>{x.data, y.data});
  }
  template <execution_space S, class T>
  void backward(const context&, layer_params<T>, tensor_view<const T, S> x, tensor_view<const T, S>,
                tensor_view<const T, S> dy, tensor_view<T, S> dx) const {
    if (dx.data) for_each_index<S>(x.numel(), kernels::gelu_backward<T>{x.data, dy.data, dx.data});
  }
};

}  // namespace dml::nn
