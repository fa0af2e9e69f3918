// SPDX-License-Identifier: Apache-2.0
// dml/nn/linear.hpp — y = x·Wᵀ + b on the last dimension, W stored [out, in] as in PyTorch.
// Sits on core/gemm.hpp; bias is fused into the GEMM (oneDNN post-op / cuBLASLt epilogue).
#pragma once

#include <cmath>

#include "dml/core/gemm.hpp"
#include "dml/nn/layer.hpp"

namespace dml::nn {

// linear{784, 256} has run-time widths; linear<784, 256>{} has static ones that sequential checks
// at compile time against its neighbours.
template <std::int64_t In = dynamic, std::int64_t Out = dynamic>
struct linear {
  static constexpr std::int64_t static_in = In;
  static constexpr std::int64_t static_out = Out;
  static constexpr const char* kind = "linear";
  // Input and weight gradients are separate GEMMs: a zero-bubble pipeline runs them apart.
  static constexpr bool splits_backward = true;

  std::int64_t in = In;
  std::int64_t out = Out;
  bool bias = true;

  constexpr linear()
    requires(In != dynamic && Out != dynamic)
  = default;
  constexpr linear(std::int64_t in_features, std::int64_t out_features, bool with_bias = true)
      : in(in_features), out(out_features), bias(with_bias) {
    if (in_features <= 0 || out_features <= 0)
      fail<invalid_argument>("dml::nn::linear: widths must be positive, found in=", in_features,
                             " out=", out_features);
    if ((In != dynamic && in_features != In) || (Out != dynamic && out_features != Out))
      fail<shape_error>("dml::nn::linear<", In, ", ", Out, ">: constructed with ", in_features, ", ",
                        out_features);
  }

  std::vector<param_spec> parameters() const {
    // PyTorch: kaiming_uniform(a=√5) for W and U(±1/√in) for b, both U(±1/√in).
    const float bound = 1.f / std::sqrt(static_cast<float>(in));
    std::vector<param_spec> p{{"weight", {out, in}, init_kind::uniform, -bound, bound}};
    if (bias) p.push_back({"bias", {out}, init_kind::uniform, -bound, bound});
    return p;
  }

  dml::shape output_shape(dml::shape x) const {
    detail::expect_cols(kind, in, x);
    return x.with_cols(out);
  }
  double forward_flops(dml::shape x) const { return 2.0 * static_cast<double>(x.numel() / in) * static_cast<double>(in * out); }

  // ep fuses the activation that follows (network does so for linear → relu) into the GEMM's epilogue.
  template <execution_space S, class T>
  void forward(const context&, layer_params<T> p, tensor_view<const T, S> x, tensor_view<T, S> y,
               epilogue ep = epilogue::none) const {
    gemm<S>({.ta = trans::n, .tb = trans::t, .m = x.rows(), .n = out, .k = in, .a = x.data, .lda = in,
             .b = p.w[0], .ldb = in, .c = y.data, .ldc = out, .bias = bias ? const_typed_ptr(p.w[1]) : nullptr,
             .ep = ep});
  }

  template <execution_space S, class T>
  void backward(const context& c, layer_params<T> p, tensor_view<const T, S> x, tensor_view<const T, S>,
                tensor_view<const T, S> dy, tensor_view<T, S> dx) const {
    const std::int64_t rows = x.rows();
    const float beta = c.accumulate ? 1.f : 0.f;
    // dW[out,in] = dyᵀ·x
    if (c.weight_grads)
      gemm<S>({.ta = trans::t, .tb = trans::n, .m = out, .n = in, .k = rows, .a = dy.data, .lda = out,
               .b = x.data, .ldb = in, .c = p.g[0], .ldc = in, .beta = beta});
    // db[out] = dyᵀ·1, a GEMV that the GEMM library does better than a column loop
    if (bias && c.weight_grads)
      gemm<S>({.ta = trans::t, .tb = trans::n, .m = out, .n = 1, .k = rows, .a = dy.data, .lda = out,
               .b = static_cast<const T*>(c.ones), .ldb = 1, .c = p.g[1], .ldc = 1, .beta = beta});
    // dx[rows,in] = dy·W
    if (dx.data)
      gemm<S>({.ta = trans::n, .tb = trans::n, .m = rows, .n = in, .k = out, .a = dy.data, .lda = out,
               .b = p.w[0], .ldb = in, .c = dx.data, .ldc = in});
  }
};

template <class L>
inline constexpr bool is_linear_v = false;
template <std::int64_t In, std::int64_t Out>
inline constexpr bool is_linear_v<linear<In, Out>> = true;

}  // namespace dml::nn
