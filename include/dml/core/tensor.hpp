// SPDX-License-Identifier: Apache-2.0
// dml/core/tensor.hpp — shapes, strided tensor views and owning tensors (row-major).
// Sits on core/buffer.hpp; layers take and return these. See DESIGN.md §2.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "dml/core/buffer.hpp"

namespace dml {

inline constexpr int max_rank = 4;

// A row-major shape of up to max_rank dimensions. rows() x cols() is the 2-D view that
// layers acting on the last dimension use.
struct shape {
  int rank = 0;
  std::array<std::int64_t, max_rank> dims{};

  constexpr shape() = default;
  constexpr shape(std::initializer_list<std::int64_t> d) {
    if (d.size() > max_rank) throw shape_error(detail::cat("dml::shape: rank ", d.size(), " exceeds ", max_rank));
    for (auto x : d) dims[rank++] = x;
  }
  static shape from(std::span<const std::int64_t> d) {
    if (d.size() > max_rank) throw shape_error(detail::cat("dml::shape: rank ", d.size(), " exceeds ", max_rank));
    shape s;
    for (auto x : d) s.dims[s.rank++] = x;
    return s;
  }
  constexpr std::int64_t operator[](int i) const { return dims[i]; }
  constexpr std::int64_t& operator[](int i) { return dims[i]; }
  constexpr std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= dims[i];
    return n;
  }
  constexpr std::int64_t cols() const { return rank ? dims[rank - 1] : 1; }
  constexpr std::int64_t rows() const { return cols() ? numel() / cols() : 0; }
  std::vector<std::int64_t> vec() const { return {dims.begin(), dims.begin() + rank}; }
  // The same leading dimensions with the last one replaced.
  constexpr shape with_cols(std::int64_t c) const {
    shape s = *this;
    if (s.rank == 0) s.rank = 1;
    s.dims[s.rank - 1] = c;
    return s;
  }
  friend constexpr bool operator==(const shape& a, const shape& b) {
    if (a.rank != b.rank) return false;
    for (int i = 0; i < a.rank; ++i)
      if (a.dims[i] != b.dims[i]) return false;
    return true;
  }
  friend std::ostream& operator<<(std::ostream& os, const shape& s) {
    os << '[';
    for (int i = 0; i < s.rank; ++i) os << (i ? ", " : "") << s.dims[i];
    return os << ']';
  }
};

// A non-owning view: pointer, shape and element strides (row-major contiguous by default).
template <class T, execution_space Space = host>
struct tensor_view {
  using value_type = T;
  using space = Space;

  T* data = nullptr;
  dml::shape shape{};
  std::array<std::int64_t, max_rank> stride{};

  constexpr tensor_view() = default;
  constexpr tensor_view(T* p, dml::shape s) : data(p), shape(s), stride(contiguous_strides(s)) {}
  constexpr tensor_view(T* p, dml::shape s, std::array<std::int64_t, max_rank> st) : data(p), shape(s), stride(st) {}
  // A view of non-const T converts to a view of const T.
  template <class U>
    requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>)
  constexpr tensor_view(const tensor_view<U, Space>& o) : data(o.data), shape(o.shape), stride(o.stride) {}

  static constexpr std::array<std::int64_t, max_rank> contiguous_strides(const dml::shape& s) {
    std::array<std::int64_t, max_rank> st{};
    std::int64_t acc = 1;
    for (int i = s.rank - 1; i >= 0; --i) {
      st[i] = acc;
      acc *= s.dims[i];
    }
    return st;
  }
  constexpr bool contiguous() const { return stride == contiguous_strides(shape); }
  constexpr std::int64_t numel() const { return shape.numel(); }
  constexpr std::int64_t rows() const { return shape.rows(); }
  constexpr std::int64_t cols() const { return shape.cols(); }
  // Same data, new shape; the view must be contiguous and the sizes equal.
  tensor_view reshape(dml::shape s) const {
    if (!contiguous() || s.numel() != numel())
      throw shape_error(detail::cat("dml::tensor_view::reshape: cannot view ", shape, " as ", s));
    return {data, s};
  }
  std::span<T> span() const { return {data, static_cast<std::size_t>(numel())}; }
};

// An owning tensor: a buffer and its shape.
template <class T, execution_space Space = host>
class tensor {
 public:
  tensor() = default;
  explicit tensor(dml::shape s) { resize(s); }
  void resize(dml::shape s) {
    if (s.numel() != static_cast<std::int64_t>(buf_.size())) buf_.resize(static_cast<std::size_t>(s.numel()));
    shape_ = s;
  }
  const dml::shape& shape() const { return shape_; }
  std::int64_t numel() const { return shape_.numel(); }
  std::int64_t bytes() const { return static_cast<std::int64_t>(buf_.bytes()); }  // storage held (none unsized)
  T* data() { return buf_.data(); }
  const T* data() const { return buf_.data(); }
  tensor_view<T, Space> view() { return {buf_.data(), shape_}; }
  tensor_view<const T, Space> view() const { return {buf_.data(), shape_}; }
  tensor_view<const T, Space> cview() const { return view(); }
  operator tensor_view<T, Space>() { return view(); }
  operator tensor_view<const T, Space>() const { return view(); }
  T& operator[](std::size_t i)
    requires std::same_as<Space, host>
  {
    return buf_[i];
  }
  const T& operator[](std::size_t i) const
    requires std::same_as<Space, host>
  {
    return buf_[i];
  }

 private:
  buffer<T, Space> buf_;
  dml::shape shape_{};
};

}  // namespace dml
