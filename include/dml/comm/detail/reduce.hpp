// SPDX-License-Identifier: Apache-2.0
// dml/comm/detail/reduce.hpp — element-wise reduction kernels shared by the host communicators.
// Sits on comm/communicator.hpp; comm::local reduces peers' slices with it, comm::mpi's bf16/fp16 ops and comm::gloo's
// reductions too.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

#include "dml/comm/communicator.hpp"

#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
#  include <emmintrin.h>
#  define DML_COMM_STREAM_STORES 1
#else
#  define DML_COMM_STREAM_STORES 0
#endif

namespace dml::comm::detail {

// bf16/fp16 accumulate in float and round once at the end; int32 in int64 so that a sum of
// many ranks does not overflow before it wraps back to the stored type.
template <class T> struct accumulator { using type = T; };
template <> struct accumulator<bf16> { using type = float; };
template <> struct accumulator<fp16> { using type = float; };
template <> struct accumulator<std::int32_t> { using type = std::int64_t; };
template <class T> using acc_t = typename accumulator<T>::type;

struct sum_fn {
  template <class A> A operator()(A a, A b) const { return a + b; }
};
struct prod_fn {
  template <class A> A operator()(A a, A b) const { return a * b; }
};
struct max_fn {
  template <class A> A operator()(A a, A b) const { return a < b ? b : a; }
};
struct min_fn {
  template <class A> A operator()(A a, A b) const { return b < a ? b : a; }
};

// f(op_fn) with the functor for op; avg reduces as sum and divides afterwards.
template <class F>
decltype(auto) with_op(reduce_op op, F&& f) {
  switch (op) {
    case reduce_op::max: return f(max_fn{});
    case reduce_op::min: return f(min_fn{});
    case reduce_op::prod: return f(prod_fn{});
    case reduce_op::sum:
    case reduce_op::avg: break;
  }
  return f(sum_fn{});
}

// Copies with non-temporal stores where the CPU has them: a large result is not read again soon,
// and streaming it skips the read-for-ownership that a cached store of a cold line costs.
// The caller issues stream_fence() before other threads may read dst.
inline void stream_copy(void* dst, const void* src, std::size_t bytes) {
#if DML_COMM_STREAM_STORES
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const std::size_t head = std::min(bytes, (16 - reinterpret_cast<std::uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  std::size_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  for (; i + 16 <= bytes; i += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  std::memcpy(d + i, s + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}
inline void stream_fence() {
#if DML_COMM_STREAM_STORES
  _mm_sfence();
#endif
}

// Above this many bytes written per call, results are streamed past the cache.
#ifndef DML_COMM_STREAM_THRESHOLD
#  define DML_COMM_STREAM_THRESHOLD (std::size_t(16) << 20)
#endif
inline constexpr std::size_t stream_threshold = DML_COMM_STREAM_THRESHOLD;

// Elements per chunk: a chunk of every source plus the accumulator stays in L1/L2, so each
// source line is read from memory once and each destination line written once.
#ifndef DML_COMM_REDUCE_CHUNK
#  define DML_COMM_REDUCE_CHUNK 4096
#endif
inline constexpr std::size_t reduce_chunk = DML_COMM_REDUCE_CHUNK;

// dst[d][i] = op over p of src[p][i] (then / divisor for avg) for i < count, every d.
// A destination may alias a source: a chunk is fully read before any of it is written.
template <reducible T, class Op>
void reduce_into(const T* const* src, int nsrc, T* const* dst, int ndst, std::size_t count, Op op,
                 int divisor) {
  using A = acc_t<T>;
  A acc[reduce_chunk];
  T out[std::is_same_v<A, T> ? 1 : reduce_chunk];
  const bool stream = count * sizeof(T) * ndst >= stream_threshold;
  for (std::size_t base = 0; base < count; base += reduce_chunk) {
    const std::size_t m = std::min(reduce_chunk, count - base);
    const T* s0 = src[0] + base;
    int p = 1;
    if (nsrc >= 2) {  // the first two sources in one pass: two ranks is the common case
      const T* s1 = src[1] + base;
#pragma omp simd
      for (std::size_t i = 0; i < m; ++i) acc[i] = op(A(s0[i]), A(s1[i]));
      p = 2;
    } else {
#pragma omp simd
      for (std::size_t i = 0; i < m; ++i) acc[i] = A(s0[i]);
    }
    for (; p < nsrc; ++p) {
      const T* s = src[p] + base;
#pragma omp simd
      for (std::size_t i = 0; i < m; ++i) acc[i] = op(acc[i], A(s[i]));
    }
    if (divisor > 1) {
      const A d = A(divisor);
#pragma omp simd
      for (std::size_t i = 0; i < m; ++i) acc[i] = acc[i] / d;
    }
    if (stream) {
      const T* res = nullptr;
      if constexpr (std::is_same_v<A, T>) {
        res = acc;
      } else {
#pragma omp simd
        for (std::size_t i = 0; i < m; ++i) out[i] = round_to<T>(acc[i]);
        res = out;
      }
      for (int q = 0; q < ndst; ++q) stream_copy(dst[q] + base, res, m * sizeof(T));
    } else {
      for (int q = 0; q < ndst; ++q) {
        T* o = dst[q] + base;
#pragma omp simd
        for (std::size_t i = 0; i < m; ++i) o[i] = round_to<T>(acc[i]);
      }
    }
  }
  if (stream) stream_fence();
}

template <reducible T>
void reduce_into(const T* const* src, int nsrc, T* const* dst, int ndst, std::size_t count,
                 reduce_op op) {
  const int divisor = op == reduce_op::avg ? nsrc : 1;
  with_op(op, [&](auto f) { reduce_into(src, nsrc, dst, ndst, count, f, divisor); });
}

// inout[i] = op(in[i], inout[i]): the two-operand form MPI user ops need.
template <reducible T>
void reduce_pair(const T* in, T* inout, std::size_t count, reduce_op op) {
  const T* src[2] = {in, inout};
  T* dst[1] = {inout};
  with_op(op, [&](auto f) { reduce_into(src, 2, dst, 1, count, f, 1); });
}

// x[i] /= n, in the accumulator type: avg where a transport only sums.
template <reducible T>
void divide(std::span<T> x, int n) {
  using A = acc_t<T>;
  for (auto& v : x) v = T(A(v) / A(n));
}

}  // namespace dml::comm::detail
