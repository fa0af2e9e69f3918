// SPDX-License-Identifier: Apache-2.0
// dml/nn/embedding.hpp — a lookup table: ids [..] → vectors [.., dim], weight [num, dim] as in PyTorch.
// Sits on core/algorithm.hpp. Ids travel as floats like every activation (exact below 2^24).
#pragma once

#include "dml/core/algorithm.hpp"
#include "dml/nn/layer.hpp"

namespace dml::nn {

namespace kernels {
struct embedding_forward {
  const float* ids;
  const float* w;
  float* y;
  std::int64_t dim;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t t = i / dim, d = i % dim;
    y[i] = w[static_cast<std::int64_t>(ids[t]) * dim + d];
  }
};
// One column of the table per call: tokens that share an id add into the same row without races.
struct embedding_backward {
  const float* ids;
  const float* dy;
  float* dw;
  std::int64_t tokens, num, dim;
  bool accumulate;
  DML_HOST_DEVICE void operator()(std::int64_t d) const {
    if (!accumulate)
      for (std::int64_t r = 0; r < num; ++r) dw[r * dim + d] = 0.f;
    for (std::int64_t t = 0; t < tokens; ++t) dw[static_cast<std::int64_t>(ids[t]) * dim + d] += dy[t * dim + d];
  }
};
}  // namespace kernels

struct embedding {
  static constexpr std::int64_t static_in = dynamic;
  static constexpr std::int64_t static_out = dynamic;
  static constexpr const char* kind = "embedding";

  std::int64_t num = 0, dim = 0;

  embedding(std::int64_t num_embeddings, std::int64_t embedding_dim) : num(num_embeddings), dim(embedding_dim) {
    if (num <= 0 || dim <= 0)
      fail<invalid_argument>("dml::nn::embedding: sizes must be positive, found num=", num, " dim=", dim);
  }

  std::vector<param_spec> parameters() const { return {{"weight", {num, dim}, init_kind::normal, 0.f, 1.f}}; }

  dml::shape output_shape(dml::shape x) const {
    if (x.rank >= max_rank)
      fail<shape_error>("dml::nn::embedding: input of rank ", x.rank, " would give rank ", x.rank + 1,
                        ", above the maximum ", max_rank);
    dml::shape y = x;
    y.dims[y.rank++] = dim;
    return y;
  }

  template <execution_space S>
  void forward(const context&, layer_params p, tensor_view<const float, S> x, tensor_view<float, S> y) const {
    if constexpr (std::same_as<S, host>) check_ids(x);
    for_each_index<S>(x.numel() * dim, kernels::embedding_forward{x.data, p.w[0], y.data, dim});
  }
  template <execution_space S>
  void backward(const context& c, layer_params p, tensor_view<const float, S> x, tensor_view<const float, S>,
                tensor_view<const float, S> dy, tensor_view<float, S>) const {
    // Ids have no gradient: dx stays untouched.
    for_each_index<S>(dim, kernels::embedding_backward{x.data, dy.data, p.g[0], x.numel(), num, dim, c.accumulate});
  }

 private:
  void check_ids(tensor_view<const float, host> x) const {
    for (std::int64_t t = 0; t < x.numel(); ++t) {
      const float id = x.data[t];
      if (!(id >= 0.f && id < static_cast<float>(num)) || id != static_cast<float>(static_cast<std::int64_t>(id)))
        fail<invalid_argument>("dml::nn::embedding: expected integer ids in [0, ", num, "), found ", id,
                               " at position ", t);
    }
  }
};

}  // namespace dml::nn
