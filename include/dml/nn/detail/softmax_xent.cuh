// SPDX-License-Identifier: Apache-2.0
// dml/nn/detail/softmax_xent.cuh — softmax + cross-entropy on CUDA: one block per row, CUB block reductions.
// Part of nn/loss.hpp, which includes it under nvcc after the functors whose arithmetic it reuses.
#pragma once

#include <climits>
#include <cstdint>

#include <cub/block/block_reduce.cuh>

#include "dml/core/algorithm.hpp"
#include "dml/core/error.hpp"

namespace dml::nn::detail {

struct float_max {
  // The host functor's comparison, so both pick the same maximum (NaN handling included).
  DML_HOST_DEVICE float operator()(float a, float b) const { return b > a ? b : a; }
};

// Per row: the max and the sum of exponentials by block reductions, then the loss (thread 0) and
// dx = (softmax − onehot)·scale written coalesced by every thread.
template <int Block>
__global__ void __launch_bounds__(Block)
    softmax_xent_rows(const float* __restrict__ x, const std::int32_t* __restrict__ labels, float* __restrict__ dx,
                      float* __restrict__ row_loss, std::int64_t n, float scale) {
  using reduce = cub::BlockReduce<float, Block>;
  __shared__ typename reduce::TempStorage tmp;
  __shared__ float max_s, sum_s;
  const std::int64_t row = blockIdx.x;
  const float* xr = x + row * n;

  float mx = xr[0];
  for (std::int64_t j = threadIdx.x; j < n; j += Block) mx = float_max{}(mx, xr[j]);
  mx = reduce(tmp).Reduce(mx, float_max{});
  if (threadIdx.x == 0) max_s = mx;
  __syncthreads();  // also frees tmp for the second reduction
  mx = max_s;

  float sum = 0.f;
  for (std::int64_t j = threadIdx.x; j < n; j += Block) sum += expf(xr[j] - mx);
  sum = reduce(tmp).Sum(sum);

  const std::int64_t label = labels[row];
  // The labels live on the device, where throwing is impossible; a NaN loss makes a bad one visible
  // without reading outside the row.
  const bool valid = label >= 0 && label < n;
  if (threadIdx.x == 0) {
    sum_s = sum;
    row_loss[row] = valid ? kernels::softmax_xent_loss(sum, xr[label], mx) : __int_as_float(0x7fc00000);
  }
  if (dx == nullptr) return;
  __syncthreads();
  const float inv = 1.f / sum_s;
  float* dr = dx + row * n;
  for (std::int64_t j = threadIdx.x; j < n; j += Block)
    dr[j] = valid ? kernels::softmax_xent_grad(xr[j], mx, inv, j == label, scale) : __int_as_float(0x7fc00000);
}

// x and labels are device pointers; dx may be null (loss only); row_loss gets one value per row.
inline void softmax_xent_cuda(const float* x, const std::int32_t* labels, float* dx, float* row_loss,
                              std::int64_t rows, std::int64_t n, float scale) {
  if (rows <= 0) return;
  if (n <= 0)
    fail<invalid_argument>("dml::nn::softmax_cross_entropy: expected at least one class, found ", n);
  if (rows > INT_MAX)
    fail<invalid_argument>("dml::nn::softmax_cross_entropy: expected at most ", INT_MAX,
                           " rows (one CUDA block each), found ", rows);
  const auto grid = static_cast<unsigned>(rows);
  cudaStream_t stream = current_stream();
  // A warp for a handful of classes (a classifier head), a wide block for a vocabulary.
  if (n <= 256)
    softmax_xent_rows<32><<<grid, 32, 0, stream>>>(x, labels, dx, row_loss, n, scale);
  else
    softmax_xent_rows<256><<<grid, 256, 0, stream>>>(x, labels, dx, row_loss, n, scale);
  DML_CHECK_CUDA(cudaGetLastError());
}

}  // namespace dml::nn::detail
