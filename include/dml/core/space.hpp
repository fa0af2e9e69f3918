// SPDX-License-Identifier: Apache-2.0
// dml/core/space.hpp — execution spaces: where data lives and where kernels run.
// Sits on core/config.hpp; buffer, algorithm and gemm dispatch on these tags. See DESIGN.md §3.
#pragma once

#include <concepts>
#include <cstddef>
#include <span>
#include <type_traits>

#include "dml/core/config.hpp"

namespace dml {

// Spaces are policies too: dml::trainer<dml::cuda, ...> trains on the GPU.
struct space_family {};

// The CPU: Thrust's CPP/OpenMP back ends, oneDNN for GEMM.
struct host {
  using policy_family = space_family;
  static constexpr const char* name = "host";
};
// An NVIDIA GPU: Thrust's CUDA back end, cuBLAS for GEMM. Usable where nvcc compiles.
struct cuda {
  using policy_family = space_family;
  static constexpr const char* name = "cuda";
};

template <class S>
concept execution_space = std::same_as<S, host> || std::same_as<S, cuda>;

// A view of device memory: std::span's shape without its host-side conversions. It is made from a pointer
// and a count only (never from a std::vector, std::array or std::span), and has no element access or
// iterators, so host code cannot read through it and host memory cannot pass for it. buffer<T, cuda>::span()
// returns one; a communicator over device memory (comm::nccl) takes nothing else.
template <class T>
class device_span {
 public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;
  using space = cuda;

  constexpr device_span() noexcept = default;
  constexpr device_span(T* data, std::size_t size) noexcept : data_(data), size_(size) {}
  template <class U>
    requires(!std::same_as<U, T> && std::is_convertible_v<U (*)[], T (*)[]>)
  constexpr device_span(device_span<U> o) noexcept : data_(o.data()), size_(o.size()) {}

  constexpr T* data() const noexcept { return data_; }
  constexpr std::size_t size() const noexcept { return size_; }
  constexpr std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  constexpr bool empty() const noexcept { return size_ == 0; }
  constexpr device_span subspan(std::size_t offset, std::size_t count) const noexcept { return {data_ + offset, count}; }
  constexpr device_span subspan(std::size_t offset) const noexcept { return {data_ + offset, size_ - offset}; }
  constexpr device_span first(std::size_t count) const noexcept { return {data_, count}; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

// The view of n elements at p in Space's memory: std::span on the host, device_span on the GPU. Generic code
// that hands a Space's memory to a communicator names its space here, so a communicator over the other
// space's memory does not compile.
template <class T, execution_space Space>
using span_in = std::conditional_t<std::same_as<Space, host>, std::span<T>, device_span<T>>;
template <execution_space Space, class T>
constexpr span_in<T, Space> make_span(T* p, std::size_t n) noexcept {
  return span_in<T, Space>(p, n);
}

}  // namespace dml
