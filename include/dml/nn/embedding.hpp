// SPDX-License-Identifier: Apache-2.0
// dml/nn/embedding.hpp — a lookup table: ids [..] → vectors [.., dim], weight [num, dim] as in PyTorch.
// Sits on core/algorithm.hpp. Ids travel as floats like every activation (exact below 2^24).
#pragma once

#include "dml/core/algorithm.hpp"
#include "dml/nn/layer.hpp"

namespace dml::nn {

namespace kernels {
template <class Id, class T>
struct embedding_forward {
  const Id* ids;
  const T* w;
  T* y;
  std::int64_t dim;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t t = i / dim, d = i % dim;
    y[i] = w[static_cast<std::int64_t>(static_cast<float>(ids[t])) * dim + d];
  }
};
// One column of the table per call: tokens that share an id add into the same row without races.
template <class Id, class T>
struct embedding_backward {
  const Id* ids;
  const T* dy;
  T* dw;
  std::int64_t tokens, num, dim;
  bool accumulate;
  DML_HOST_DEVICE void operator()(std::int64_t d) const {
    if (!accumulate)
      for (std::int64_t r = 0; r < num; ++r) dw[r * dim + d] = T(0.f);
    for (std::int64_t t = 0; t < tokens; ++t) {
      T& g = dw[static_cast<std::int64_t>(static_cast<float>(ids[t])) * dim + d];
      g = T(static_cast<float>(g) + static_cast<float>(dy[t * dim + d]));
    }
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

  // Ids arrive as floats (the network's input, exact below 2^24) whatever the working type T.
  static constexpr bool float_input = true;

  template <execution_space S, class Id, class T>
  void forward(const context&, layer_params<T> p, tensor_view<const Id, S> x, tensor_view<T, S> y) const {
    if constexpr (std::same_as<S, host>) check_ids(x);
    for_each_index<S>(x.numel() * dim, kernels::embedding_forward<Id, T>{x.data, p.w[0], y.data, dim});
  }
  template <execution_space S, class Id, class T, class Dx>
  void backward(const context& c, layer_params<T> p, tensor_view<const Id, S> x, tensor_view<const T, S>,
                tensor_view<const T, S> dy, tensor_view<Dx, S>) const {
    // Ids have no gradient: dx stays untouched.
    for_each_index<S>(dim, kernels::embedding_backward<Id, T>{x.data, dy.data, p.g[0], x.numel(), num, dim,
                                                              c.accumulate});
  }

 private:
  template <class Id>
  void check_ids(tensor_view<const Id, host> x) const {
    for (std::int64_t t = 0; t < x.numel(); ++t) {
      const float id = static_cast<float>(x.data[t]);
      if (!(id >= 0.f && id < static_cast<float>(num)) || id != static_cast<float>(static_cast<std::int64_t>(id)))
        fail<invalid_argument>("dml::nn::embedding: expected integer ids in [0, ", num, "), found ", id,
                               " at position ", t);
    }
  }
};

}  // namespace dml::nn
