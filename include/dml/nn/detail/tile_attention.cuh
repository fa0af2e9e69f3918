// SPDX-License-Identifier: Apache-2.0
// dml/nn/detail/tile_attention.cuh — tile attention on CUDA: shared-memory tiles of queries and keys, one thread per
// row, an online softmax in forward and the probabilities recomputed from the log-sum-exp in backward (dK/dV by key
// tiles, dQ by query tiles: no atomics, the same bits every run). Part of nn/tile_attention.hpp, which includes it
// under nvcc after the mask it reuses.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>

#include "dml/core/algorithm.hpp"
#include "dml/core/error.hpp"

namespace dml::nn::detail {

// Rows per block and per shared tile. A shared row holds head_dim floats and one of padding, so that threads
// reading rows at a stride hit different banks.
inline constexpr int cuda_query_rows = 32;  // threads of a forward or dQ block: one query each
inline constexpr int cuda_key_rows = 32;    // keys per shared tile; threads of a dK/dV block: one key each
inline constexpr int cuda_backward_query_rows = 16;  // queries per shared tile of a dK/dV block

__device__ inline std::int64_t tile_min(std::int64_t a, std::int64_t b) { return a < b ? a : b; }
__device__ inline std::int64_t tile_max(std::int64_t a, std::int64_t b) { return a < b ? b : a; }

__device__ inline float tile_dot(const float* a, const float* b, int hd) {
  float s = 0.f;
  for (int d = 0; d < hd; ++d) s += a[d] * b[d];
  return s;
}

// Rows [r0, r0 + rows) of a strided T matrix into shared floats (times mul; 0 past the sequence), by the block.
template <class T>
__device__ inline void tile_load(float* to, int hp, const T* from, std::int64_t ld, std::int64_t r0, int rows,
                                 std::int64_t L, int hd, float mul) {
  for (int e = threadIdx.x; e < rows * hd; e += blockDim.x) {
    const int j = e / hd, d = e % hd;
    to[j * hp + d] = r0 + j < L ? mul * static_cast<float>(from[(r0 + j) * ld + d]) : 0.f;
  }
}

// Grid (query tiles, heads, batch); thread i owns query q0 + i: its q (scaled) and output accumulator in shared rows.
template <class T>
__global__ void __launch_bounds__(cuda_query_rows)
    tile_attention_forward_kernel(tile_attention_shape s, const T* __restrict__ qkv, T* __restrict__ y,
                                  float* __restrict__ lse, kernels::attention_mask mask) {
  extern __shared__ float smem[];
  const int hd = static_cast<int>(s.head_dim), hp = hd + 1;
  float* qs = smem;
  float* os = qs + cuda_query_rows * hp;
  float* ks = os + cuda_query_rows * hp;
  float* vs = ks + cuda_key_rows * hp;
  __shared__ unsigned long long first_key;
  const std::int64_t b = blockIdx.z, h = blockIdx.y, q0 = std::int64_t(blockIdx.x) * cuda_query_rows, L = s.seq;
  const std::int64_t ld = s.row(), kvh = h / s.group();
  const int i = threadIdx.x;
  const std::int64_t t = q0 + i;
  const bool live = t < L;
  const T* base = qkv + b * L * ld;
  if (i == 0) first_key = ULLONG_MAX;
  tile_load(qs, hp, base + h * hd, ld, q0, cuda_query_rows, L, hd, rsqrtf(static_cast<float>(hd)));
  for (int d = 0; d < hd; ++d) os[i * hp + d] = 0.f;
  __syncthreads();
  const std::int64_t first = live ? mask.first(b, t) : L, last = live ? mask.last(t) : -1;
  if (live) atomicMin(&first_key, static_cast<unsigned long long>(first));
  __syncthreads();
  const std::int64_t k_end = tile_min(L, mask.last(tile_min(q0 + cuda_query_rows, L) - 1) + 1);
  float m = kernels::attention_no_key, l = 0.f;
  float p[cuda_key_rows];
  for (std::int64_t k0 = std::int64_t(first_key) / cuda_key_rows * cuda_key_rows; k0 < k_end; k0 += cuda_key_rows) {
    __syncthreads();
    tile_load(ks, hp, base + (s.heads + kvh) * hd, ld, k0, cuda_key_rows, L, hd, 1.f);
    tile_load(vs, hp, base + (s.heads + s.kv() + kvh) * hd, ld, k0, cuda_key_rows, L, hd, 1.f);
    __syncthreads();
    const std::int64_t lo = tile_max(first - k0, 0), hi = tile_min(tile_min(last - k0 + 1, L - k0), cuda_key_rows);
    if (lo >= hi) continue;
    float mx = m;
    for (int j = 0; j < cuda_key_rows; ++j) {
      p[j] = j >= lo && j < hi ? tile_dot(qs + i * hp, ks + j * hp, hd) : 0.f;
      if (j >= lo && j < hi) mx = fmaxf(mx, p[j]);
    }
    const float alpha = l > 0.f ? expf(m - mx) : 0.f;
    float add = 0.f;
    for (int j = 0; j < cuda_key_rows; ++j) {
      p[j] = j >= lo && j < hi ? expf(p[j] - mx) : 0.f;
      add += p[j];
    }
    m = mx;
    l = l * alpha + add;
    for (int d = 0; d < hd; ++d) {
      float o = os[i * hp + d] * alpha;
      for (int j = 0; j < cuda_key_rows; ++j) o += p[j] * vs[j * hp + d];
      os[i * hp + d] = o;
    }
  }
  if (!live) return;
  const float inv = l > 0.f ? 1.f / l : 0.f;
  T* out = y + (b * L + t) * s.width() + h * hd;
  for (int d = 0; d < hd; ++d) out[d] = T(os[i * hp + d] * inv);
  lse[(b * s.heads + h) * L + t] = l > 0.f ? m + logf(l) : kernels::attention_no_key;
}

// Grid (key tiles, kv heads, batch); thread j owns key k0 + j and sums its dK and dV over the queries of every head
// that reads it.
template <class T>
__global__ void __launch_bounds__(cuda_key_rows)
    tile_attention_dkv_kernel(tile_attention_shape s, const T* __restrict__ qkv, const float* __restrict__ lse,
                              const float* __restrict__ dot, const T* __restrict__ dy, T* __restrict__ dqkv,
                              kernels::attention_mask mask) {
  extern __shared__ float smem[];
  constexpr int qn = cuda_backward_query_rows;
  const int hd = static_cast<int>(s.head_dim), hp = hd + 1;
  float* ks = smem;
  float* vs = ks + cuda_key_rows * hp;
  float* dks = vs + cuda_key_rows * hp;
  float* dvs = dks + cuda_key_rows * hp;
  float* qs = dvs + cuda_key_rows * hp;
  float* dos = qs + qn * hp;
  __shared__ float lse_s[qn], dot_s[qn];
  const std::int64_t b = blockIdx.z, kvh = blockIdx.y, k0 = std::int64_t(blockIdx.x) * cuda_key_rows, L = s.seq;
  const std::int64_t ld = s.row(), w = s.width();
  const std::int64_t kc = (s.heads + kvh) * hd, vc = (s.heads + s.kv() + kvh) * hd;
  const int j = threadIdx.x;
  const std::int64_t key = k0 + j;
  const T* base = qkv + b * L * ld;
  tile_load(ks, hp, base + kc, ld, k0, cuda_key_rows, L, hd, 1.f);
  tile_load(vs, hp, base + vc, ld, k0, cuda_key_rows, L, hd, 1.f);
  for (int d = 0; d < hd; ++d) dks[j * hp + d] = dvs[j * hp + d] = 0.f;
  const float scale = rsqrtf(static_cast<float>(hd));
  for (std::int64_t h = kvh * s.group(); h < (kvh + 1) * s.group(); ++h)
    for (std::int64_t q0 = mask.first_query(k0) / qn * qn; q0 < L; q0 += qn) {
      __syncthreads();
      tile_load(qs, hp, base + h * hd, ld, q0, qn, L, hd, scale);
      tile_load(dos, hp, dy + b * L * w + h * hd, w, q0, qn, L, hd, 1.f);
      if (j < qn && q0 + j < L) {
        lse_s[j] = lse[(b * s.heads + h) * L + q0 + j];
        dot_s[j] = dot[(b * s.heads + h) * L + q0 + j];
      }
      __syncthreads();
      if (key >= L) continue;
      for (int i = 0; i < qn && q0 + i < L; ++i) {
        const std::int64_t t = q0 + i;
        if (key < mask.first(b, t) || key > mask.last(t)) continue;
        const float p = expf(tile_dot(qs + i * hp, ks + j * hp, hd) - lse_s[i]);
        const float ds = p * (tile_dot(dos + i * hp, vs + j * hp, hd) - dot_s[i]);
        for (int d = 0; d < hd; ++d) {
          dvs[j * hp + d] += p * dos[i * hp + d];
          dks[j * hp + d] += ds * qs[i * hp + d];
        }
      }
    }
  if (key >= L) return;
  T* row = dqkv + (b * L + key) * ld;
  for (int d = 0; d < hd; ++d) {
    row[kc + d] = T(dks[j * hp + d]);
    row[vc + d] = T(dvs[j * hp + d]);
  }
}

// Grid (query tiles, heads, batch); thread i owns query q0 + i and sums its dQ over every key it sees.
template <class T>
__global__ void __launch_bounds__(cuda_query_rows)
    tile_attention_dq_kernel(tile_attention_shape s, const T* __restrict__ qkv, const float* __restrict__ lse,
                             const float* __restrict__ dot, const T* __restrict__ dy, T* __restrict__ dqkv,
                             kernels::attention_mask mask) {
  extern __shared__ float smem[];
  const int hd = static_cast<int>(s.head_dim), hp = hd + 1;
  float* qs = smem;
  float* dos = qs + cuda_query_rows * hp;
  float* dqs = dos + cuda_query_rows * hp;
  float* ks = dqs + cuda_query_rows * hp;
  float* vs = ks + cuda_key_rows * hp;
  const std::int64_t b = blockIdx.z, h = blockIdx.y, q0 = std::int64_t(blockIdx.x) * cuda_query_rows, L = s.seq;
  const std::int64_t ld = s.row(), w = s.width(), kvh = h / s.group();
  const int i = threadIdx.x;
  const std::int64_t t = q0 + i;
  const bool live = t < L;
  const T* base = qkv + b * L * ld;
  const float scale = rsqrtf(static_cast<float>(hd));
  tile_load(qs, hp, base + h * hd, ld, q0, cuda_query_rows, L, hd, scale);
  tile_load(dos, hp, dy + b * L * w + h * hd, w, q0, cuda_query_rows, L, hd, 1.f);
  for (int d = 0; d < hd; ++d) dqs[i * hp + d] = 0.f;
  const std::int64_t first = live ? mask.first(b, t) : L, last = live ? mask.last(t) : -1;
  const float li = live ? lse[(b * s.heads + h) * L + t] : 0.f, di = live ? dot[(b * s.heads + h) * L + t] : 0.f;
  const std::int64_t k_end = tile_min(L, mask.last(tile_min(q0 + cuda_query_rows, L) - 1) + 1);
  for (std::int64_t k0 = 0; k0 < k_end; k0 += cuda_key_rows) {
    __syncthreads();
    tile_load(ks, hp, base + (s.heads + kvh) * hd, ld, k0, cuda_key_rows, L, hd, 1.f);
    tile_load(vs, hp, base + (s.heads + s.kv() + kvh) * hd, ld, k0, cuda_key_rows, L, hd, 1.f);
    __syncthreads();
    const std::int64_t lo = tile_max(first - k0, 0), hi = tile_min(tile_min(last - k0 + 1, L - k0), cuda_key_rows);
    for (std::int64_t j = lo; j < hi; ++j) {
      const float p = expf(tile_dot(qs + i * hp, ks + j * hp, hd) - li);
      const float ds = p * (tile_dot(dos + i * hp, vs + j * hp, hd) - di);
      for (int d = 0; d < hd; ++d) dqs[i * hp + d] += ds * ks[j * hp + d];
    }
  }
  if (!live) return;
  T* row = dqkv + (b * L + t) * ld + h * hd;
  for (int d = 0; d < hd; ++d) row[d] = T(scale * dqs[i * hp + d]);
}

inline dim3 tile_grid(const char* what, std::int64_t tiles, std::int64_t heads, std::int64_t batch) {
  if (tiles > INT_MAX || heads > 65535 || batch > 65535)
    fail<invalid_argument>(what, ": expected at most ", INT_MAX, " tiles, 65535 heads and 65535 sequences, found ", tiles,
                           ", ", heads, " and ", batch);
  return dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(heads), static_cast<unsigned>(batch));
}
// Dynamic shared memory past 48 KiB needs the kernel's consent, asked once per size.
template <class K>
std::size_t tile_shared_bytes(K kernel, std::int64_t rows, std::int64_t hd) {
  const std::size_t bytes = static_cast<std::size_t>(rows * (hd + 1)) * sizeof(float);
  DML_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  return bytes;
}

template <class T>
void tile_attention_forward_cuda(const tile_attention_shape& s, const T* qkv, T* y, float* lse,
                                 const kernels::attention_mask& mask) {
  const auto grid = tile_grid("dml::nn::tile_attention_forward", (s.seq + cuda_query_rows - 1) / cuda_query_rows,
                              s.heads, s.batch);
  auto kernel = tile_attention_forward_kernel<T>;
  const std::size_t bytes = tile_shared_bytes(kernel, 2 * cuda_query_rows + 2 * cuda_key_rows, s.head_dim);
  kernel<<<grid, cuda_query_rows, bytes, current_stream()>>>(s, qkv, y, lse, mask);
  DML_CHECK_CUDA(cudaGetLastError());
}

template <class T>
void tile_attention_backward_cuda(const tile_attention_shape& s, const T* qkv, const float* lse, const float* dot,
                                  const T* dy, T* dqkv, const kernels::attention_mask& mask) {
  constexpr const char* what = "dml::nn::tile_attention_backward";
  auto dkv = tile_attention_dkv_kernel<T>;
  const std::size_t dkv_bytes = tile_shared_bytes(dkv, 4 * cuda_key_rows + 2 * cuda_backward_query_rows, s.head_dim);
  dkv<<<tile_grid(what, (s.seq + cuda_key_rows - 1) / cuda_key_rows, s.kv(), s.batch), cuda_key_rows, dkv_bytes,
        current_stream()>>>(s, qkv, lse, dot, dy, dqkv, mask);
  DML_CHECK_CUDA(cudaGetLastError());
  auto dq = tile_attention_dq_kernel<T>;
  const std::size_t dq_bytes = tile_shared_bytes(dq, 3 * cuda_query_rows + 2 * cuda_key_rows, s.head_dim);
  dq<<<tile_grid(what, (s.seq + cuda_query_rows - 1) / cuda_query_rows, s.heads, s.batch), cuda_query_rows, dq_bytes,
       current_stream()>>>(s, qkv, lse, dot, dy, dqkv, mask);
  DML_CHECK_CUDA(cudaGetLastError());
}

}  // namespace dml::nn::detail
