// SPDX-License-Identifier: Apache-2.0
// dml/nn/detail/rows.hpp — what the row-wise layers of nn/ share: a Linear's three products on row-major rows,
// bias gradients as column sums, GELU's backward in place, element functors run a row at a time on the host
// (token_rows), and a carver of aligned scratch. Sits on core/gemm.hpp and nn/activation.hpp; nn/gpt.hpp and
// nn/moe.hpp use it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/gemm.hpp"
#include "dml/core/space.hpp"
#include "dml/nn/activation.hpp"

namespace dml::nn {

namespace kernels {
// Sum over rows of a [rows, n] matrix into (or onto) v[n]; one column per call.
template <class T>
struct column_sum {
  const T* x;
  T* v;
  std::int64_t rows, n;
  bool accumulate;
  DML_HOST_DEVICE void operator()(std::int64_t j) const {
    float s = accumulate ? static_cast<float>(v[j]) : 0.f;
    for (std::int64_t r = 0; r < rows; ++r) s += static_cast<float>(x[r * n + j]);
    v[j] = T(s);
  }
};
template <class T>
struct gelu_backward_inplace {
  const T* f;
  T* d;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    d[i] = T(static_cast<float>(d[i]) * gelu_tanh::derivative(static_cast<float>(f[i])));
  }
};
}  // namespace kernels

namespace detail {
// An element functor over `rows` rows of n columns that also runs a whole row (f.row(r), the same values as its
// elements' calls): on the device an element per thread, on the host a row per call (what is found once per row,
// a token's id, position or dropout key, a routed row's source, is found once, and the columns vectorise).
template <execution_space S, class F>
void token_rows(std::int64_t rows, std::int64_t n, const F& f) {
  if constexpr (std::same_as<S, host>) for_each_row<S>(rows, [f](std::int64_t r) { f.row(r); }, n);
  else for_each_index<S>(rows * n, f);
}
// Carves 64-byte-aligned arrays out of one block of bytes; with a null base it only counts.
struct carver {
  std::byte* base = nullptr;
  std::int64_t used = 0;
  template <class U>
  U* take(std::int64_t n) {
    U* p = base ? reinterpret_cast<U*>(base + used) : nullptr;
    used += (n * static_cast<std::int64_t>(sizeof(U)) + 63) / 64 * 64;
    return p;
  }
};

// v[j] (+)= Σ_r x[r, j] for a [rows, n] matrix (a bias's gradient): on the device a column per thread
// (column_sum); on the host by column blocks (for_each_column_block: the functor's bits, the inner loop
// contiguous instead of a stride of n per add).
template <execution_space S, class T>
void column_sums(const T* x, T* v, std::int64_t rows, std::int64_t n, bool accumulate) {
  if constexpr (!std::same_as<S, host>) {
    for_each_index<S>(n, kernels::column_sum<T>{x, v, rows, n, accumulate});
  } else {
    for_each_column_block(n, rows, [=](std::int64_t j0, std::int64_t width) {
      sum_rows_block(x, n, 0, 1, rows, v, j0, width, accumulate);
    });
  }
}

// The row-major products of a Linear with weight W [out, in].
template <execution_space S, class T>
void linear_forward(std::int64_t rows, std::int64_t in, std::int64_t out, const T* x, const T* w, const T* bias, T* y) {
  gemm<S>({.ta = trans::n, .tb = trans::t, .m = rows, .n = out, .k = in, .a = x, .lda = in, .b = w, .ldb = in, .c = y,
           .ldc = out, .bias = bias ? const_typed_ptr(bias) : nullptr});
}
template <execution_space S, class T>
void linear_weight_grad(std::int64_t rows, std::int64_t in, std::int64_t out, const T* x, const T* dy, T* dw, bool accumulate) {
  gemm<S>({.ta = trans::t, .tb = trans::n, .m = out, .n = in, .k = rows, .a = dy, .lda = out, .b = x, .ldb = in, .c = dw,
           .ldc = in, .beta = accumulate ? 1.f : 0.f});
}
template <execution_space S, class T>
void linear_input_grad(std::int64_t rows, std::int64_t in, std::int64_t out, const T* dy, const T* w, T* dx,
                       bool accumulate = false) {
  gemm<S>({.ta = trans::n, .tb = trans::n, .m = rows, .n = in, .k = out, .a = dy, .lda = out, .b = w, .ldb = in, .c = dx,
           .ldc = in, .beta = accumulate ? 1.f : 0.f});
}
}  // namespace detail

}  // namespace dml::nn
