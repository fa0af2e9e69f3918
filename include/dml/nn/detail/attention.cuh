// SPDX-License-Identifier: Apache-2.0
// dml/nn/detail/attention.cuh — attention's causal softmax and its backward on CUDA: one block per row, CUB reductions.
// Part of nn/attention.hpp, which includes it under nvcc after the functors whose arithmetic it reuses.
#pragma once

#include <climits>
#include <cstdint>

#include <cub/block/block_reduce.cuh>

#include "dml/core/algorithm.hpp"
#include "dml/core/error.hpp"

namespace dml::nn::detail {

struct attention_max_op {
  DML_HOST_DEVICE float operator()(float a, float b) const { return kernels::attention_max(a, b); }
};

// Row r = ((b·heads + h)·seq + t) of the logits, in place: max and sum of exponentials over s <= t by
// block reductions, then every thread writes its columns coalesced (zeros for s > t).
template <int Block, class T>
__global__ void __launch_bounds__(Block) causal_softmax_rows_kernel(T* __restrict__ p, std::int64_t seq, float scale) {
  using reduce = cub::BlockReduce<float, Block>;
  __shared__ typename reduce::TempStorage tmp;
  __shared__ float max_s, sum_s;
  const std::int64_t r = blockIdx.x;
  const std::int64_t n = r % seq + 1;
  T* row = p + r * seq;

  float mx = scale * static_cast<float>(row[0]);
  for (std::int64_t s = threadIdx.x; s < n; s += Block) mx = kernels::attention_max(mx, scale * static_cast<float>(row[s]));
  mx = reduce(tmp).Reduce(mx, attention_max_op{});
  if (threadIdx.x == 0) max_s = mx;
  __syncthreads();  // also frees tmp for the second reduction
  mx = max_s;

  float sum = 0.f;
  for (std::int64_t s = threadIdx.x; s < n; s += Block) sum += expf(scale * static_cast<float>(row[s]) - mx);
  sum = reduce(tmp).Sum(sum);
  if (threadIdx.x == 0) sum_s = sum;
  __syncthreads();
  const float inv = 1.f / sum_s;
  for (std::int64_t s = threadIdx.x; s < seq; s += Block)
    row[s] = T(s < n ? expf(scale * static_cast<float>(row[s]) - mx) * inv : 0.f);
}

// Row r of d (dP on entry, dS on exit) against the same row of p; columns s > t get 0.
template <int Block, class T>
__global__ void __launch_bounds__(Block)
    causal_softmax_backward_rows_kernel(const T* __restrict__ p, T* __restrict__ d, std::int64_t seq, float scale) {
  using reduce = cub::BlockReduce<float, Block>;
  __shared__ typename reduce::TempStorage tmp;
  __shared__ float dot_s;
  const std::int64_t r = blockIdx.x;
  const std::int64_t n = r % seq + 1;
  const T* pr = p + r * seq;
  T* dr = d + r * seq;

  float dot = 0.f;
  for (std::int64_t s = threadIdx.x; s < n; s += Block) dot += static_cast<float>(dr[s]) * static_cast<float>(pr[s]);
  dot = reduce(tmp).Sum(dot);
  if (threadIdx.x == 0) dot_s = dot;
  __syncthreads();
  dot = dot_s;
  for (std::int64_t s = threadIdx.x; s < seq; s += Block)
    dr[s] = T(s < n ? kernels::attention_softmax_grad(static_cast<float>(pr[s]), static_cast<float>(dr[s]), dot, scale)
                    : 0.f);
}

inline void check_attention_grid(std::int64_t rows) {
  if (rows > INT_MAX)
    fail<invalid_argument>("dml::nn::causal_attention: expected at most ", INT_MAX,
                           " softmax rows (batch·heads·seq, one CUDA block each), found ", rows);
}

// A warp for short sequences, a wider block once a row has enough columns to share out.
inline int attention_block_for(std::int64_t seq) { return seq <= 256 ? 32 : 256; }

// p: rows·seq logits in device memory, turned into probabilities in place.
template <class T>
void causal_softmax_cuda(T* p, std::int64_t rows, std::int64_t seq, float scale) {
  if (rows <= 0) return;
  check_attention_grid(rows);
  const auto grid = static_cast<unsigned>(rows);
  cudaStream_t stream = current_stream();
  if (attention_block_for(seq) == 32)
    causal_softmax_rows_kernel<32, T><<<grid, 32, 0, stream>>>(p, seq, scale);
  else
    causal_softmax_rows_kernel<256, T><<<grid, 256, 0, stream>>>(p, seq, scale);
  DML_CHECK_CUDA(cudaGetLastError());
}

// d: rows·seq values of dP in device memory, turned into dS in place; p: the matching probabilities.
template <class T>
void causal_softmax_backward_cuda(const T* p, T* d, std::int64_t rows, std::int64_t seq, float scale) {
  if (rows <= 0) return;
  check_attention_grid(rows);
  const auto grid = static_cast<unsigned>(rows);
  cudaStream_t stream = current_stream();
  if (attention_block_for(seq) == 32)
    causal_softmax_backward_rows_kernel<32, T><<<grid, 32, 0, stream>>>(p, d, seq, scale);
  else
    causal_softmax_backward_rows_kernel<256, T><<<grid, 256, 0, stream>>>(p, d, seq, scale);
  DML_CHECK_CUDA(cudaGetLastError());
}

}  // namespace dml::nn::detail
