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
// Per row: loss = logsumexp(x) − x[label]; dx = (softmax(x) − onehot(label)) · scale.
struct softmax_xent_row {
  const float* x;
  const std::int32_t* labels;
  float* dx;          // may be null: loss only
  float* row_loss;
  std::int64_t n;
  float scale;
  DML_HOST_DEVICE void operator()(std::int64_t r) const {
    const float* xr = x + r * n;
    float mx = xr[0];
    for (std::int64_t j = 1; j < n; ++j) mx = xr[j] > mx ? xr[j] : mx;
    float sum = 0.f;
    for (std::int64_t j = 0; j < n; ++j) sum += expf(xr[j] - mx);
    const std::int64_t label = labels[r];
    row_loss[r] = softmax_xent_loss(sum, xr[label], mx);
    if (dx) {
      const float inv = 1.f / sum;
      float* dr = dx + r * n;
      for (std::int64_t j = 0; j < n; ++j) dr[j] = softmax_xent_grad(xr[j], mx, inv, j == label, scale);
    }
  }
};
struct argmax_hit {
  const float* x;
  const std::int32_t* labels;
  std::int64_t n;
  DML_HOST_DEVICE std::int64_t operator()(std::int64_t r) const {
    const float* xr = x + r * n;
    std::int64_t best = 0;
    for (std::int64_t j = 1; j < n; ++j)
      if (xr[j] > xr[best]) best = j;
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
  template <execution_space S>
  float forward_backward(tensor_view<const float, S> logits, const std::int32_t* labels, tensor_view<float, S> dlogits,
                         float* row_loss, std::int64_t scale_rows = 0) const {
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
#if DML_HAS_CUDA
    if constexpr (std::same_as<S, cuda>)  // one block per row instead of one thread
      detail::softmax_xent_cuda(logits.data, labels, dlogits.data, row_loss, rows, n, 1.f / static_cast<float>(denom));
    else
#endif
      for_each_index<S>(rows, kernels::softmax_xent_row{logits.data, labels, dlogits.data, row_loss, n,
                                                        1.f / static_cast<float>(denom)});
    const double total = transform_reduce_index<S>(rows, kernels::read_float{row_loss}, 0.0);
    return static_cast<float>(total / static_cast<double>(denom));
  }
};

// Rows whose largest logit is at the label.
template <execution_space S>
std::int64_t count_correct(tensor_view<const float, S> logits, const std::int32_t* labels) {
  return transform_reduce_index<S>(logits.rows(), kernels::argmax_hit{logits.data, labels, logits.cols()},
                                   std::int64_t{0});
}

}  // namespace dml::nn
