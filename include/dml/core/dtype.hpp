// SPDX-License-Identifier: Apache-2.0
// dml/core/dtype.hpp — the 16-bit float types bf16 and fp16, and the dtype tag of stored tensors.
// Sits on core/config.hpp; used by tensors, kernels, communicators and checkpoints. See DESIGN.md §2.
#pragma once

#include <cstdint>
#include <cstring>
#include <ostream>
#include <string_view>
#include <type_traits>

#include "dml/core/config.hpp"
#include "dml/core/error.hpp"

namespace dml {

namespace detail {

// memcpy rather than std::bit_cast: it is callable from device code without relaxed constexpr.
DML_HOST_DEVICE std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
DML_HOST_DEVICE float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round-to-nearest-even float -> bf16. Integer arithmetic, so host and device give the same
// bits as CUDA's __float2bfloat16_rn for every non-NaN input. Adding 0x7fff plus the lowest
// kept bit rounds ties to even; a carry out of the mantissa bumps the exponent, and from the
// largest finite binade it lands exactly on infinity, as IEEE round-to-nearest requires.
DML_HOST_DEVICE std::uint16_t float_to_bf16_bits(float f) {
  const std::uint32_t u = float_bits(f);
  // Branch-free so that loops of conversions vectorise. NaN: keep sign and top payload, force the
  // quiet bit; otherwise round to nearest even.
  const std::uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<std::uint16_t>(nan ? ((u >> 16) | 0x0040u) : (rounded >> 16));
}

DML_HOST_DEVICE float bf16_bits_to_float(std::uint16_t h) {
  return bits_float(static_cast<std::uint32_t>(h) << 16);
}

// Round-to-nearest-even float -> IEEE binary16, bit-exact with CUDA's __float2half_rn for every
// non-NaN input, including results that are fp16 subnormals and overflow to infinity.
DML_HOST_DEVICE std::uint16_t float_to_fp16_bits(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u)  // NaN: keep sign and the top of the payload, force the quiet bit
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x03ffu));
  if (a >= 0x38800000u) {  // |f| >= 2^-14: a normal fp16, or infinity
    if (a >= 0x47800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 2^16 or inf
    // Rebias the exponent (127 -> 15) in place; the 13 dropped bits round as for bf16, and a
    // carry from 65520 upwards walks into the exponent field to give exactly 0x7c00 (inf).
    const std::uint32_t r = a - (112u << 23);
    return static_cast<std::uint16_t>(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13));
  }
  // Below 2^-25 everything rounds to zero; 2^-25 itself is the tie between 0 and 2^-24 -> 0.
  if (a <= 0x33000000u) return static_cast<std::uint16_t>(sign);
  // fp16 subnormal: the result counts units of 2^-24. f = m * 2^(e-150), so the count is
  // m >> (126 - e) before rounding; e is in [102, 112] here, so the shift is 14..24.
  const std::uint32_t e = a >> 23;
  const std::uint32_t m = (a & 0x007fffffu) | 0x00800000u;
  const std::uint32_t shift = 126u - e;
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // q may reach 0x400: the smallest normal
  return static_cast<std::uint16_t>(sign | q);
}

DML_HOST_DEVICE float fp16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu;
  const std::uint32_t m = h & 0x03ffu;
  if (e == 0x1fu) return bits_float(sign | 0x7f800000u | (m << 13));  // inf, NaN with payload
  if (e != 0) return bits_float(sign | ((e + 112u) << 23) | (m << 13));
  // Zero or subnormal: m * 2^-24 is exact in float, and cheaper to read than a normalising loop.
  const float mag = static_cast<float>(m) * 5.9604644775390625e-8f;
  return sign ? -mag : mag;
}

}  // namespace detail

// bfloat16: float's exponent with 8 significant bits. Storage only; arithmetic goes through
// float (the implicit conversion), so `a + b` is a float and rounding happens once, on store.
// The constructor is explicit so that `x == 1.0f` compares as floats instead of being ambiguous.
struct bf16 {
  std::uint16_t bits;

  bf16() = default;
  DML_HOST_DEVICE explicit bf16(float f) : bits(detail::float_to_bf16_bits(f)) {}
  DML_HOST_DEVICE operator float() const { return detail::bf16_bits_to_float(bits); }

  DML_HOST_DEVICE static bf16 from_bits(std::uint16_t b) {
    bf16 r;
    r.bits = b;
    return r;
  }
  // IEEE equality: NaN differs from everything, +0 equals -0. Compare .bits for identity.
  DML_HOST_DEVICE friend bool operator==(bf16 a, bf16 b) { return float(a) == float(b); }
};

// IEEE binary16: 5 exponent bits, 11 significant bits, subnormals down to 2^-24, max 65504.
struct fp16 {
  std::uint16_t bits;

  fp16() = default;
  DML_HOST_DEVICE explicit fp16(float f) : bits(detail::float_to_fp16_bits(f)) {}
  DML_HOST_DEVICE operator float() const { return detail::fp16_bits_to_float(bits); }

  DML_HOST_DEVICE static fp16 from_bits(std::uint16_t b) {
    fp16 r;
    r.bits = b;
    return r;
  }
  DML_HOST_DEVICE friend bool operator==(fp16 a, fp16 b) { return float(a) == float(b); }
};

static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2, "dml::bf16 must be exactly 16 bits");
static_assert(sizeof(fp16) == 2 && alignof(fp16) == 2, "dml::fp16 must be exactly 16 bits");

// v as a T: bf16 and fp16 rounded to nearest even (from v as a float), exactly as T(v). Kernels store with it inside vectorised
// loops (DML_SIMD): there GCC gives the temporary that a constructor call T(v) builds its own per-lane array and
// then cannot vectorise the copy out of it, so `y[j] = T(v)` ran one element at a time in bf16 (2-6x slower than
// the same loop in f32); a function's return value has no such temporary.
template <class T, class V>
DML_HOST_DEVICE T round_to(V v) {
  if constexpr (std::is_same_v<T, bf16>) return bf16::from_bits(detail::float_to_bf16_bits(static_cast<float>(v)));
  else if constexpr (std::is_same_v<T, fp16>) return fp16::from_bits(detail::float_to_fp16_bits(static_cast<float>(v)));
  else return static_cast<T>(v);
}

// The element type of a stored or transmitted tensor; the names are safetensors' names.
enum class dtype : std::uint8_t { f32, f64, bf16, f16, i32, i64, u8 };

constexpr std::string_view dtype_name(dtype t) {
  switch (t) {
    case dtype::f32: return "F32";
    case dtype::f64: return "F64";
    case dtype::bf16: return "BF16";
    case dtype::f16: return "F16";
    case dtype::i32: return "I32";
    case dtype::i64: return "I64";
    case dtype::u8: return "U8";
  }
  return "?";
}

DML_HOST_DEVICE constexpr std::size_t dtype_size(dtype t) {
  switch (t) {
    case dtype::f64:
    case dtype::i64: return 8;
    case dtype::f32:
    case dtype::i32: return 4;
    case dtype::bf16:
    case dtype::f16: return 2;
    case dtype::u8: return 1;
  }
  return 0;
}

// The inverse of dtype_name, for reading file headers: a name dml does not know is a format_error.
inline dtype dtype_from_name(std::string_view name) {
  for (dtype t : {dtype::f32, dtype::f64, dtype::bf16, dtype::f16, dtype::i32, dtype::i64, dtype::u8})
    if (dtype_name(t) == name) return t;
  fail<format_error>("dtype name: expected one of F32, F64, BF16, F16, I32, I64, U8; found '", name,
                     "'");
}

inline std::ostream& operator<<(std::ostream& os, dtype t) { return os << dtype_name(t); }

namespace detail {
template <class T>
inline constexpr bool dependent_false = false;

template <class T>
consteval dtype dtype_of() {
  if constexpr (std::is_same_v<T, float>) return dtype::f32;
  else if constexpr (std::is_same_v<T, double>) return dtype::f64;
  else if constexpr (std::is_same_v<T, bf16>) return dtype::bf16;
  else if constexpr (std::is_same_v<T, fp16>) return dtype::f16;
  else if constexpr (std::is_same_v<T, std::int32_t>) return dtype::i32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return dtype::i64;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return dtype::u8;
  else
    static_assert(dependent_false<T>,
                  "dml::dtype_v<T>: T must be float, double, dml::bf16, dml::fp16, std::int32_t, "
                  "std::int64_t or std::uint8_t");
}
}  // namespace detail

// The dtype tag of an element type: dtype_v<float> == dtype::f32.
template <class T>
inline constexpr dtype dtype_v = detail::dtype_of<T>();

}  // namespace dml
