// SPDX-License-Identifier: Apache-2.0
// dml/nn/detail/layernorm.cuh — layernorm on CUDA: one block per row, sums by CUB's BlockReduce.
// Part of nn/layernorm.hpp, which includes it under nvcc after the functors whose arithmetic it reuses.
#pragma once

#include <climits>
#include <cstdint>

#include <cub/block/block_reduce.cuh>

#include "dml/core/algorithm.hpp"
#include "dml/core/error.hpp"

namespace dml::nn::detail {

// A thread per row leaves most of the GPU idle and reads each row with one thread; a block per row
// reads it coalesced and reduces it in shared memory.
template <int Block>
__device__ kernels::row_stats block_row_stats(const float* xr, std::int64_t n, float eps,
                                              typename cub::BlockReduce<float, Block>::TempStorage& tmp) {
  using reduce = cub::BlockReduce<float, Block>;
  __shared__ float mean_s, rstd_s;
  float sum = 0.f;
  for (std::int64_t j = threadIdx.x; j < n; j += Block) sum += xr[j];
  sum = reduce(tmp).Sum(sum);
  if (threadIdx.x == 0) mean_s = sum / static_cast<float>(n);
  __syncthreads();  // also frees tmp for the second reduction
  const float mean = mean_s;
  // Two passes over the row, as the host functor: E[(x-mean)^2] keeps precision that E[x^2]-mean^2 loses.
  float sq = 0.f;
  for (std::int64_t j = threadIdx.x; j < n; j += Block) sq += (xr[j] - mean) * (xr[j] - mean);
  sq = reduce(tmp).Sum(sq);
  if (threadIdx.x == 0) rstd_s = kernels::layernorm_rstd(sq, n, eps);
  __syncthreads();
  return {mean, rstd_s};
}

template <int Block>
__global__ void __launch_bounds__(Block)
    layernorm_forward_rows(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                           float* __restrict__ y, std::int64_t n, float eps) {
  __shared__ typename cub::BlockReduce<float, Block>::TempStorage tmp;
  const std::int64_t row = blockIdx.x;
  const float* xr = x + row * n;
  float* yr = y + row * n;
  const kernels::row_stats s = block_row_stats<Block>(xr, n, eps, tmp);
  for (std::int64_t j = threadIdx.x; j < n; j += Block) yr[j] = kernels::layernorm_affine(xr[j], s, w[j], b[j]);
}

struct float_pair {
  float first, second;
};
struct float_pair_sum {
  DML_HOST_DEVICE float_pair operator()(const float_pair& a, const float_pair& b) const {
    return {a.first + b.first, a.second + b.second};
  }
};

// Writes the row's statistics (the parameter gradients need them) and, when dx is not null, dx.
template <int Block>
__global__ void __launch_bounds__(Block)
    layernorm_backward_rows(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ dy,
                            float* __restrict__ dx, kernels::row_stats* __restrict__ stats, std::int64_t n, float eps) {
  __shared__ typename cub::BlockReduce<float, Block>::TempStorage tmp;
  __shared__ typename cub::BlockReduce<float_pair, Block>::TempStorage tmp_pair;
  __shared__ float_pair sums_s;
  const std::int64_t row = blockIdx.x;
  const float* xr = x + row * n;
  const kernels::row_stats s = block_row_stats<Block>(xr, n, eps, tmp);
  if (threadIdx.x == 0) stats[row] = s;
  if (dx == nullptr) return;
  const float* dyr = dy + row * n;
  float* dxr = dx + row * n;
  float_pair acc{0.f, 0.f};
  for (std::int64_t j = threadIdx.x; j < n; j += Block) {
    const float g = dyr[j] * w[j];
    acc.first += g;
    acc.second += g * kernels::layernorm_xhat(xr[j], s);
  }
  acc = cub::BlockReduce<float_pair, Block>(tmp_pair).Reduce(acc, float_pair_sum{});
  if (threadIdx.x == 0) sums_s = acc;
  __syncthreads();
  const float_pair sums = sums_s;
  const float inv_n = 1.f / static_cast<float>(n);
  for (std::int64_t j = threadIdx.x; j < n; j += Block)
    dxr[j] = kernels::layernorm_dx(dyr[j], w[j], kernels::layernorm_xhat(xr[j], s), s.rstd, sums.first, sums.second,
                                   inv_n);
}

// dw[j] = Σ_rows dy·x̂ and db[j] = Σ_rows dy. A block owns Cols adjacent columns (coalesced reads of
// each row); its Rows thread rows split the batch rows and meet in shared memory, so every column
// is summed in a fixed order and written once: deterministic, with no atomics and no scratch.
template <int Cols, int Rows>
__global__ void __launch_bounds__(Cols* Rows)
    layernorm_param_grads(const float* __restrict__ x, const float* __restrict__ dy,
                          const kernels::row_stats* __restrict__ stats, float* __restrict__ dw, float* __restrict__ db,
                          std::int64_t rows, std::int64_t n, bool accumulate) {
  __shared__ float part_w[Rows][Cols + 1], part_b[Rows][Cols + 1];  // +1: no bank conflicts on the column sums
  const int tx = threadIdx.x, ty = threadIdx.y;
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * Cols + tx;
  float gw = 0.f, gb = 0.f;
  if (j < n)
    for (std::int64_t r = ty; r < rows; r += Rows) {
      const float d = dy[r * n + j];
      gw += d * kernels::layernorm_xhat(x[r * n + j], stats[r]);
      gb += d;
    }
  part_w[ty][tx] = gw;
  part_b[ty][tx] = gb;
  __syncthreads();
  if (ty == 0 && j < n) {
    for (int i = 1; i < Rows; ++i) {
      gw += part_w[i][tx];
      gb += part_b[i][tx];
    }
    dw[j] = accumulate ? dw[j] + gw : gw;
    db[j] = accumulate ? db[j] + gb : gb;
  }
}

// Wide rows get more threads; narrow ones would leave most of a big block idle.
inline int layernorm_block_for(std::int64_t n) { return n <= 1024 ? 128 : 512; }

inline void check_grid_rows(const char* what, std::int64_t rows) {
  if (rows > INT_MAX)
    fail<invalid_argument>(what, ": expected at most ", INT_MAX, " rows (one CUDA block each), found ", rows);
}

inline void layernorm_forward_cuda(const float* x, const float* w, const float* b, float* y, std::int64_t rows,
                                   std::int64_t n, float eps) {
  if (rows <= 0) return;
  check_grid_rows("dml::nn::layernorm", rows);
  const auto grid = static_cast<unsigned>(rows);
  if (layernorm_block_for(n) == 128)
    layernorm_forward_rows<128><<<grid, 128, 0, current_stream()>>>(x, w, b, y, n, eps);
  else
    layernorm_forward_rows<512><<<grid, 512, 0, current_stream()>>>(x, w, b, y, n, eps);
  DML_CHECK_CUDA(cudaGetLastError());
}

// stats: rows entries of scratch (the layer's workspace); dx may be null.
inline void layernorm_backward_cuda(const float* x, const float* w, const float* dy, float* dx,
                                    kernels::row_stats* stats, float* dw, float* db, std::int64_t rows,
                                    std::int64_t n, float eps, bool accumulate) {
  if (rows <= 0 || n <= 0) return;
  check_grid_rows("dml::nn::layernorm", rows);
  const auto grid = static_cast<unsigned>(rows);
  cudaStream_t stream = current_stream();
  if (layernorm_block_for(n) == 128)
    layernorm_backward_rows<128><<<grid, 128, 0, stream>>>(x, w, dy, dx, stats, n, eps);
  else
    layernorm_backward_rows<512><<<grid, 512, 0, stream>>>(x, w, dy, dx, stats, n, eps);
  DML_CHECK_CUDA(cudaGetLastError());
  constexpr int cols = 32, row_threads = 16;
  const auto col_blocks = static_cast<unsigned>((n + cols - 1) / cols);
  layernorm_param_grads<cols, row_threads>
      <<<col_blocks, dim3(cols, row_threads), 0, stream>>>(x, dy, stats, dw, db, rows, n, accumulate);
  DML_CHECK_CUDA(cudaGetLastError());
}

}  // namespace dml::nn::detail
