// SPDX-License-Identifier: Apache-2.0
// dml/nn/loss.hpp — softmax + cross-entropy fused: one pass gives the mean loss and d(loss)/d(logits).
// Sits on core/algorithm.hpp; used by train/ after the last layer of a sequential.
#pragma once

#include <cmath>
#include <cstdint>

#include "dml/core/algorithm.hpp"
#include "dml/core/tensor.hpp"

namespace dml::nn {

namespace kernels {
// Per-element arithmetic shared by the functor below and the CUDA kernel of nn/detail/softmax_xent.cuh.
DML_HOST_DEVICE float softmax_xent_loss(float sum_exp, float x_label, float mx) { return logf(sum_exp) - (x_label - mx); }
DML_HOST_DEVICE float softmax_xent_grad(float x, float mx, float inv_sum, bool is_label, float scale) {
  return (expf(x - mx) * inv_sum - (is_label ? 1.f : 0.f)) * scale;
}
// Per row: loss = logsumexp(x) − x[label]; dx = (softmax(x) − onehot(label)) · scale. Logits of the
// working type T; arithmetic in float.
template <class T>
struct softmax_xent_row {
  const T* x;
  const std::int32_t* labels;
  T* dx;              // may be null: loss only
  float* row_loss;
  std::int64_t n;
  float scale;
  DML_HOST_DEVICE void operator()(std::int64_t r) const {
    const T* xr = x + r * n;
    float mx = static_cast<float>(xr[0]);
    for (std::int64_t j = 1; j < n; ++j) mx = static_cast<float>(xr[j]) > mx ? static_cast<float>(xr[j]) : mx;
    float sum = 0.f;
    for (std::int64_t j = 0; j < n; ++j) sum += expf(static_cast<float>(xr[j]) - mx);
    const std::int64_t label = labels[r];
    row_loss[r] = softmax_xent_loss(sum, static_cast<float>(xr[label]), mx);
    if (dx) {
      const float inv = 1.f / sum;
      T* dr = dx + r * n;
      for (std::int64_t j = 0; j < n; ++j)
        dr[j] = T(softmax_xent_grad(static_cast<float>(xr[j]), mx, inv, j == label, scale));
    }
  }
};
template <class T>
struct argmax_hit {
  const T* x;
  const std::int32_t* labels;
  std::int64_t n;
  DML_HOST_DEVICE std::int64_t operator()(std::int64_t r) const {
    const T* xr = x + r * n;
    std::int64_t best = 0;
    for (std::int64_t j = 1; j < n; ++j)
      if (static_cast<float>(xr[j]) > static_cast<float>(xr[best])) best = j;
    return best == labels[r] ? 1 : 0;
  }
};
struct read_float {
  const float* x;
  DML_HOST_DEVICE double operator()(std::int64_t i) const { return x[i]; }
};
}  // namespace kernels

}  // namespace dml::nn

#if DML_HAS_CUDA
#  include "dml/nn/detail/softmax_xent.cuh"
#endif

namespace dml::nn {

// Mean cross-entropy of softmax(logits) against integer labels, as torch.nn.CrossEntropyLoss().
struct softmax_cross_entropy {
  // Returns the mean loss over rows; writes dlogits = ∂loss/∂logits unless dlogits.data is null.
  // `scale_rows` is the row count the mean divides by (the global batch when ranks share one).
  // row_loss: scratch of logits.rows() floats in the same space.
  // On CUDA the labels are in device memory and are not checked on the host: a label outside [0, n)
  // makes its row's loss (and so the mean) NaN instead of raising an error.
  // loss_scale multiplies dlogits only (fp16 loss scaling); the returned loss is unscaled.
  template <execution_space S, class T>
  float forward_backward(tensor_view<const T, S> logits, const std::int32_t* labels, tensor_view<T, S> dlogits,
                         float* row_loss, std::int64_t scale_rows = 0, float loss_scale = 1.f) const {
    const std::int64_t rows = logits.rows(), n = logits.cols();
    if (dlogits.data && !(dlogits.shape == logits.shape))
      fail<shape_error>("dml::nn::softmax_cross_entropy: dlogits shape ", dlogits.shape, " differs from logits ",
                        logits.shape);
    if constexpr (std::same_as<S, host>)
      for (std::int64_t r = 0; r < rows; ++r)
        if (labels[r] < 0 || labels[r] >= n)
          fail<invalid_argument>("dml::nn::softmax_cross_entropy: expected labels in [0, ", n, "), found ",
                                 labels[r], " in row ", r);
    const std::int64_t denom = scale_rows > 0 ? scale_rows : rows;
    const float scale = loss_scale / static_cast<float>(denom);
#if DML_HAS_CUDA
    if constexpr (std::same_as<S, cuda> && std::same_as<T, float>)  // one block per row instead of one thread
      detail::softmax_xent_cuda(logits.data, labels, dlogits.data, row_loss, rows, n, scale);
    else
#endif
      for_each_index<S>(rows, kernels::softmax_xent_row<T>{logits.data, labels, dlogits.data, row_loss, n, scale});
    const double total = transform_reduce_index<S>(rows, kernels::read_float{row_loss}, 0.0);
    return static_cast<float>(total / static_cast<double>(denom));
  }
};

// Rows whose largest logit is at the label.
template <execution_space S, class T>
std::int64_t count_correct(tensor_view<const T, S> logits, const std::int32_t* labels) {
  return transform_reduce_index<S>(logits.rows(), kernels::argmax_hit<T>{logits.data, labels, logits.cols()},
                                   std::int64_t{0});
}

}  // namespace dml::nn
