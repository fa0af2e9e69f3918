// SPDX-License-Identifier: Apache-2.0
// dml/core/math.hpp — exp, tanh and a row's max that vectorise on the host, for the element-wise kernels (GELU, softmax).
// Sits on core/config.hpp. glibc's expf/tanhf have no vector forms without -ffast-math, so an omp simd
// loop that calls them runs one element at a time; these are branch-free polynomials instead. On the
// device, and under -ffast-math, they are expf and tanhf.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "dml/core/config.hpp"

namespace dml {

// e^x within 2 ulp (Cephes' expf: x = n·ln 2 + r with |r| <= ln 2 / 2, a polynomial in r, then n into the
// exponent bits); 0 below −87.3 (no subnormals), +inf from 88.38, NaN for NaN.
DML_HOST_DEVICE float fast_exp(float x) {
#if defined(__CUDA_ARCH__) || defined(__FAST_MATH__)  // -ffast-math vectorises expf itself (and would fold t − 1.5·2^23)
  return expf(x);
#else
  // Only integer selects and no float-to-int conversion: with -ftrapping-math (the default), GCC 12
  // vectorises neither a select on a float comparison nor such a conversion below AVX-512. Adding 1.5·2^23
  // rounds x·log2(e) to the integer n, held in the low bits of t (exactly while |n| < 2^22).
  const std::int32_t n0 = std::bit_cast<std::int32_t>(x * 1.44269504088896341f + 12582912.f) - 0x4B400000;
  const bool low = n0 < -126, high = n0 > 127;
  // Outside the normal exponents the polynomial runs on 0 instead (or on the NaN), and 2^n becomes 0 or +inf.
  const std::int32_t xb = std::bit_cast<std::int32_t>(x);
  const bool nan = (xb & 0x7FFFFFFF) > 0x7F800000;
  // A mask, not a select: GCC turns a select of bits into a select of floats, which it will not vectorise.
  const std::int32_t keep = static_cast<std::int32_t>((low | high) & !nan) - 1;  // 0 or all ones
  const float xs = std::bit_cast<float>(xb & keep);
  const float t = xs * 1.44269504088896341f + 12582912.f;
  const std::int32_t n = std::bit_cast<std::int32_t>(t) - 0x4B400000;
  const float fn = t - 12582912.f;
  const float r = xs - fn * 0.693359375f + fn * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.f;
  return e * std::bit_cast<float>(low ? 0 : (high ? 0x7F800000 : (n + 127) << 23));
#endif
}

// The bits of x as an integer that orders as the floats do (−0 just below +0, NaNs beyond ±inf), and back. The
// largest of a row's floats is the largest of these integers: an integer max vectorises with AVX2, where GCC leaves a
// float select (x > m ? x : m) scalar below AVX-512 under -ftrapping-math, the default.
DML_HOST_DEVICE std::int32_t ordered_bits(float x) {
#if defined(__CUDA_ARCH__)
  const std::int32_t b = __float_as_int(x);
#else
  const auto b = std::bit_cast<std::int32_t>(x);
#endif
  return b ^ ((b >> 31) & 0x7FFFFFFF);
}
DML_HOST_DEVICE float from_ordered_bits(std::int32_t k) {
  const std::int32_t b = k ^ ((k >> 31) & 0x7FFFFFFF);
#if defined(__CUDA_ARCH__)
  return __int_as_float(b);
#else
  return std::bit_cast<float>(b);
#endif
}

// tanh(x) = 1 − 2 / (e^{2x} + 1): exact at the saturating ends, within 1e-7 absolute elsewhere.
DML_HOST_DEVICE float fast_tanh(float x) {
#if defined(__CUDA_ARCH__) || defined(__FAST_MATH__)
  return tanhf(x);
#else
  return 1.f - 2.f / (fast_exp(2.f * x) + 1.f);
#endif
}

}  // namespace dml
