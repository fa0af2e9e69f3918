// SPDX-License-Identifier: Apache-2.0
// dml/core/algorithm.hpp — run DML_HOST_DEVICE functors over index ranges in a space, via Thrust.
// Sits on core/space.hpp; every fused element-wise kernel of nn/ and optim/ goes through here.
#pragma once

#include <cstdint>
#include <vector>

#include "dml/core/config.hpp"
#include "dml/core/space.hpp"

#if defined(_OPENMP)
#  include <omp.h>
#endif
#if DML_HAS_CUDA
#  include "dml/core/stream.hpp"
#  include <thrust/execution_policy.h>
#  include <thrust/for_each.h>
#  include <thrust/iterator/counting_iterator.h>
#  include <thrust/system/cuda/execution_policy.h>
#  include <thrust/transform_reduce.h>
#endif

namespace dml {

namespace detail {
inline int& thread_budget_slot() {
  thread_local int n = 0;
  return n;
}
// Below this many elements a parallel region costs more than it saves.
inline constexpr std::int64_t parallel_grain = 1 << 15;
}  // namespace detail

// Host loops split across a rank's threads with OpenMP, except under ThreadSanitizer: libgomp is not
// instrumented, so TSan cannot see its barriers and reports every buffer an OpenMP worker wrote and the rank's
// own thread later freed. A TSan build runs each rank's loops on the rank's thread; the races it looks for are
// between ranks and between a rank and its communicator's threads.
#if defined(__SANITIZE_THREAD__)  // GCC's; clang's below
#  define DML_TSAN 1
#elif defined(__has_feature)
#  if __has_feature(thread_sanitizer)
#    define DML_TSAN 1
#  endif
#endif
#if defined(_OPENMP) && !defined(DML_TSAN)
#  define DML_HOST_PARALLEL 1
#else
#  define DML_HOST_PARALLEL 0
#endif

// Host threads the calling thread (one rank) may use for kernels and GEMMs. Ranks that are
// threads of one process each get their share, so the process never oversubscribes its cores.
inline int thread_budget() {
  int n = detail::thread_budget_slot();
#if defined(_OPENMP)
  if (n == 0) n = omp_get_max_threads();
#endif
  return n > 0 ? n : 1;
}
inline void set_thread_budget(int n) {
  detail::thread_budget_slot() = n < 1 ? 1 : n;
#if defined(_OPENMP)
  omp_set_num_threads(n < 1 ? 1 : n);  // per-thread ICV: also what oneDNN's OpenMP runtime reads
#endif
}
// Sets the calling thread's budget to n (n < 1: leaves it as it is) and gives the thread its previous budget back
// when the scope ends.
class thread_budget_scope {
 public:
  explicit thread_budget_scope(int n) : old_(thread_budget()) {
    if (n > 0) set_thread_budget(n);
  }
  ~thread_budget_scope() { set_thread_budget(old_); }
  thread_budget_scope(const thread_budget_scope&) = delete;
  thread_budget_scope& operator=(const thread_budget_scope&) = delete;

 private:
  int old_;
};

namespace detail {
// Host loops are compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA) and the baseline, and the
// loader picks the widest this CPU runs (GCC's function multiversioning): element-wise passes
// vectorise at the machine's width with no -march, so one binary runs well on every x86-64 CPU.
// A clone may contract a·b + c into an FMA, so results can differ in the last bit between CPUs
// (never between the ranks of one machine). DML_NO_HOST_CLONES turns it off.
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && defined(__x86_64__) && \
    !defined(DML_NO_HOST_CLONES) && !defined(DML_TSAN)
#  define DML_HOST_CLONES [[gnu::target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")]]
#else
#  define DML_HOST_CLONES
#endif

// Plain loops rather than Thrust's host back ends: Thrust's loop bodies do not vectorise, and an
// element-wise pass is memory-bound only once it does.
template <class F>
DML_HOST_CLONES void host_for_each_index(std::int64_t n, F f) {
#if DML_HOST_PARALLEL
  const int threads = thread_budget();
  if (n >= parallel_grain && threads > 1) {
#  pragma omp parallel for simd schedule(static) num_threads(threads)
    for (std::int64_t i = 0; i < n; ++i) f(i);
    return;
  }
#endif
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) f(i);
}
}  // namespace detail

// f(i) for every i in [0, n), in any order, possibly concurrently. Calls must be independent: on the
// host the loop is vectorised (omp simd) as well as split across the rank's threads.
template <execution_space Space, class F>
void for_each_index(std::int64_t n, F f) {
  if (n <= 0) return;
  if constexpr (std::same_as<Space, host>) {
    detail::host_for_each_index(n, f);
  } else {
#if DML_HAS_CUDA
    thrust::counting_iterator<std::int64_t> first(0);
    thrust::for_each(thrust::cuda::par_nosync.on(current_stream()), first, first + n, f);  // no host wait
#else
    static_assert(sizeof(F) == 0, "dml: the cuda space needs a translation unit compiled by nvcc");
#endif
  }
}

// f(r) for every row r in [0, n), rows split across the rank's threads but not vectorised across: for row
// functors whose inner loops over a row vectorise themselves (DML_SIMD_SUM, DML_SIMD_MAX). row_size, the
// elements a call touches, keeps small passes on one thread (below parallel_grain in all); without it, any two
// rows are split.
namespace detail {
template <class F>
DML_HOST_CLONES void host_for_each_row(std::int64_t n, F f, std::int64_t row_size) {
#if DML_HOST_PARALLEL
  const int threads = thread_budget();
  if (threads > 1 && n > 1 && n * row_size >= parallel_grain) {
#  pragma omp parallel for schedule(static) num_threads(threads)
    for (std::int64_t r = 0; r < n; ++r) f(r);
    return;
  }
#endif
  for (std::int64_t r = 0; r < n; ++r) f(r);
}
}  // namespace detail
template <execution_space Space, class F>
void for_each_row(std::int64_t n, F f, std::int64_t row_size = detail::parallel_grain) {
  if (n <= 0) return;
  if constexpr (std::same_as<Space, host>) detail::host_for_each_row(n, f, row_size);
  else for_each_index<Space>(n, f);
}

// Host only: f(j0, width) for blocks [j0, j0 + width) of n columns, width <= column_block, blocks split across the
// rank's threads as rows of `rows` × column_block elements. For sums over the rows of a [rows, n] matrix by
// column (a bias's gradient): each block keeps column_block float sums, adds the rows in order with a contiguous
// inner loop, and every column's sum runs in the order a column-per-call functor's does (the same bits).
inline constexpr std::int64_t column_block = 256;
template <class F>
void for_each_column_block(std::int64_t n, std::int64_t rows, F f) {
  for_each_row<host>((n + column_block - 1) / column_block, [=](std::int64_t b) {
    const std::int64_t j0 = b * column_block;
    f(j0, n - j0 < column_block ? n - j0 : column_block);
  }, rows * column_block);
}
// One column block's sums: v[j] (+)= Σ x[r·ld + j] over rows r = first, first + stride, ... < rows, for j in
// [j0, j0 + width), width <= column_block; float sums, the rows added in order. What a bias's gradient runs in each of
// for_each_column_block's blocks, and a position's gradient over its tokens (every t-th row) serially.
template <class T>
DML_HOST_DEVICE void sum_rows_block(const T* x, std::int64_t ld, std::int64_t first, std::int64_t stride, std::int64_t rows,
                                    T* v, std::int64_t j0, std::int64_t width, bool accumulate) {
  float s[column_block];
  for (std::int64_t j = 0; j < width; ++j) s[j] = accumulate ? static_cast<float>(v[j0 + j]) : 0.f;
  for (std::int64_t r = first; r < rows; r += stride) {
    const T* xr = x + r * ld + j0;
    DML_SIMD
    for (std::int64_t j = 0; j < width; ++j) s[j] += static_cast<float>(xr[j]);
  }
  for (std::int64_t j = 0; j < width; ++j) v[j0 + j] = T(s[j]);
}

// reduce(op, init, f(0), ..., f(n-1)); op must be associative and commutative. On the host each thread
// folds one contiguous chunk and the chunks are folded in order, so a result depends on the thread
// budget only through the grouping of the sum (Thrust's OpenMP reduce trips UBSan, hence plain loops).
// The reductions transform_reduce_index folds with, in both spaces (Thrust's own would bring its headers into every
// host unit).
struct plus_op {
  template <class T>
  DML_HOST_DEVICE T operator()(const T& a, const T& b) const { return a + b; }
};
struct max_op {
  template <class T>
  DML_HOST_DEVICE T operator()(const T& a, const T& b) const { return a < b ? b : a; }
};

template <execution_space Space, class T, class F, class Op = plus_op>
T transform_reduce_index(std::int64_t n, F f, T init, Op op = {}) {
  if (n <= 0) return init;
  if constexpr (std::same_as<Space, host>) {
#if DML_HOST_PARALLEL
    const int threads = thread_budget();
    if (n >= detail::parallel_grain && threads > 1) {
      // n >= parallel_grain > threads, so every chunk is non-empty and writes its partial.
      std::vector<T> partial(static_cast<std::size_t>(threads), init);
      int teams = 1;
#  pragma omp parallel num_threads(threads)
      {
        const int t = omp_get_thread_num(), used = omp_get_num_threads();
        if (t == 0) teams = used;
        const std::int64_t lo = n * t / used, hi = n * (t + 1) / used;
        if (lo < hi) {
          T acc = f(lo);
          for (std::int64_t i = lo + 1; i < hi; ++i) acc = op(acc, f(i));
          partial[static_cast<std::size_t>(t)] = acc;
        }
      }
      T out = init;
      for (int t = 0; t < teams; ++t) out = op(out, partial[static_cast<std::size_t>(t)]);
      return out;
    }
#endif
    T acc = init;
    for (std::int64_t i = 0; i < n; ++i) acc = op(acc, f(i));
    return acc;
  } else {
#if DML_HAS_CUDA
    thrust::counting_iterator<std::int64_t> first(0);
    // The host needs the value: this one waits for the stream.
    return thrust::transform_reduce(thrust::cuda::par.on(current_stream()), first, first + n, f, init, op);
#else
    static_assert(sizeof(F) == 0, "dml: the cuda space needs a translation unit compiled by nvcc");
#endif
  }
}

namespace detail {
template <class T>
struct fill_value {
  T* p;
  T value;
  DML_HOST_DEVICE void operator()(std::int64_t i) const { p[i] = value; }
};
}  // namespace detail

// p[0..n) = value in the given space.
template <execution_space Space, class T>
void fill_n(T* p, std::int64_t n, T value) {
  for_each_index<Space>(n, detail::fill_value<T>{p, value});
}

}  // namespace dml
