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
    row_loss[r] = logf(sum) - (xr[label] - mx);
    if (dx) {
      const float inv = 1.f / sum;
      float* dr = dx + r * n;
      for (std::int64_t j = 0; j < n; ++j) dr[j] = (expf(xr[j] - mx) * inv - (j == label ? 1.f : 0.f)) * scale;
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

// Mean cross-entropy of softmax(logits) against integer labels, as torch.nn.CrossEntropyLoss().
struct softmax_cross_entropy {
  // Returns the mean loss over rows; writes dlogits = ∂loss/∂logits unless dlogits.data is null.
  // `scale_rows` is the row count the mean divides by (the global batch when ranks share one).
  // row_loss: scratch of logits.rows() floats in the same space.
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
