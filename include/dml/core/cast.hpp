// SPDX-License-Identifier: Apache-2.0
// dml/core/cast.hpp — float, bf16 and fp16: conversion in an execution space, and pointers that carry their type.
// Sits on core/dtype.hpp and core/algorithm.hpp; used by gemm, optimizers and mixed-precision layers.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "dml/core/algorithm.hpp"
#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"

namespace dml {

// The element types that mixed-precision code moves between. Every one of them converts to float
// exactly, so float is the common ground: any conversion rounds at most once, on the way out.
template <class T>
concept float_like = std::same_as<T, float> || std::same_as<T, bf16> || std::same_as<T, fp16>;

// A pointer to float, bf16 or fp16 elements that carries its element type, for interfaces that take
// any of them (GEMM operands, an optimizer's working copy). The type rides with the pointer rather
// than in a separate field so that the two cannot disagree, and the implicit conversion from T*
// keeps call sites such as `.a = float_ptr` or `.bias = nullptr` as plain as they were.
struct const_typed_ptr {
  const void* ptr = nullptr;
  dtype type = dtype::f32;

  const_typed_ptr() = default;
  const_typed_ptr(std::nullptr_t) {}
  template <float_like T>
  const_typed_ptr(const T* p) : ptr(p), type(dtype_v<T>) {}
  template <float_like T>
  const T* as() const { return static_cast<const T*>(ptr); }
  explicit operator bool() const { return ptr != nullptr; }
};
struct typed_ptr {
  void* ptr = nullptr;
  dtype type = dtype::f32;

  typed_ptr() = default;
  typed_ptr(std::nullptr_t) {}
  template <float_like T>
  typed_ptr(T* p) : ptr(p), type(dtype_v<T>) {}
  template <float_like T>
  T* as() const { return static_cast<T*>(ptr); }
  explicit operator bool() const { return ptr != nullptr; }
  operator const_typed_ptr() const {
    const_typed_ptr r;
    r.ptr = ptr;
    r.type = type;
    return r;
  }
};

namespace kernels {
template <float_like From, float_like To>
struct cast {
  const From* src;
  To* dst;
  DML_HOST_DEVICE void operator()(std::int64_t i) const { dst[i] = To(static_cast<float>(src[i])); }
};
template <float_like From>
struct accumulate {
  const From* src;
  float* dst;
  DML_HOST_DEVICE void operator()(std::int64_t i) const { dst[i] += static_cast<float>(src[i]); }
};
}  // namespace kernels

// dst[i] += float(src[i]) for i in [0, n).
template <execution_space Space, float_like From>
void accumulate_n(const From* src, float* dst, std::int64_t n) {
  for_each_index<Space>(n, kernels::accumulate<From>{src, dst});
}

// dst[i] = To(src[i]) for i in [0, n), rounding to nearest even where To is narrower. src and dst
// must not overlap unless they are the same pointer with From == To.
template <execution_space Space, float_like From, float_like To>
void cast_n(const From* src, To* dst, std::int64_t n) {
  for_each_index<Space>(n, kernels::cast<From, To>{src, dst});
}

namespace detail {
// Calls f(T{}) with T the element type that t names, for code that learns a pointer's type at run
// time (typed GEMM operands, optimizer working copies). what names the caller in the error.
template <class F>
decltype(auto) visit_float_like(dtype t, const char* what, F&& f) {
  switch (t) {
    case dtype::f32: return std::forward<F>(f)(float{});
    case dtype::bf16: return std::forward<F>(f)(bf16{});
    case dtype::f16: return std::forward<F>(f)(fp16{});
    default: break;
  }
  fail<invalid_argument>(what, ": expected an element type of F32, BF16 or F16, found ", t);
}
}  // namespace detail

}  // namespace dml
