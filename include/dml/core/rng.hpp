// SPDX-License-Identifier: Apache-2.0
// dml/core/rng.hpp — counter-based random numbers (Philox4x32-10) callable on host and device.
// Sits on core/config.hpp; used by initialisers, dropout and samplers in nn/, optim/ and train/.
#pragma once

#include <cmath>
#include <cstdint>

#include "dml/core/config.hpp"

namespace dml {

// Plain aggregates instead of std::array: their operator[] is usable in device code as is.
struct u32x4 {
  std::uint32_t v[4];
  DML_HOST_DEVICE constexpr std::uint32_t& operator[](int i) { return v[i]; }
  DML_HOST_DEVICE constexpr std::uint32_t operator[](int i) const { return v[i]; }
  DML_HOST_DEVICE friend constexpr bool operator==(const u32x4& a, const u32x4& b) {
    return a.v[0] == b.v[0] && a.v[1] == b.v[1] && a.v[2] == b.v[2] && a.v[3] == b.v[3];
  }
};
struct u32x2 {
  std::uint32_t v[2];
  DML_HOST_DEVICE constexpr std::uint32_t& operator[](int i) { return v[i]; }
  DML_HOST_DEVICE constexpr std::uint32_t operator[](int i) const { return v[i]; }
};

namespace detail {
// Multipliers and Weyl key increments of Philox4x32 (Salmon, Moraes, Dror, Shaw, SC'11).
inline constexpr std::uint32_t philox_m0 = 0xD2511F53u;
inline constexpr std::uint32_t philox_m1 = 0xCD9E8D57u;
inline constexpr std::uint32_t philox_w0 = 0x9E3779B9u;
inline constexpr std::uint32_t philox_w1 = 0xBB67AE85u;

DML_HOST_DEVICE constexpr u32x4 philox_round(u32x4 c, u32x2 k) {
  const std::uint64_t p0 = static_cast<std::uint64_t>(philox_m0) * c[0];
  const std::uint64_t p1 = static_cast<std::uint64_t>(philox_m1) * c[2];
  const auto hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
  const auto hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
  return u32x4{{hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0}};
}

// The top 24 bits of a word as a float in [0, 1): every value exact, 1.0 never reached.
DML_HOST_DEVICE constexpr float unit_float(std::uint32_t w) {
  return static_cast<float>(w >> 8) * 5.9604644775390625e-8f;  // 2^-24
}
// A float in (0, 1] with 32 bits behind it, for logarithms: the smallest value is 2^-33, so
// Box-Muller's tail reaches about 6.8 standard deviations instead of stopping at 5.8.
DML_HOST_DEVICE constexpr float unit_float_open0(std::uint32_t w) {
  return static_cast<float>(w) * 2.3283064365386963e-10f + 1.1641532182693481e-10f;  // 2^-32, 2^-33
}

// One standard normal from two words (Box-Muller, cosine branch).
DML_HOST_DEVICE float box_muller(std::uint32_t w0, std::uint32_t w1) {
  const float u1 = unit_float_open0(w0);
  const float u2 = unit_float(w1);
  const float r = ::sqrtf(-2.0f * ::logf(u1));
  return r * ::cosf(6.283185307179586f * u2);
}
}  // namespace detail

// Philox4x32-10: ten rounds, the key bumped by the Weyl increments between rounds. A pure
// function of (counter, key), so any thread can compute any block without shared state.
DML_HOST_DEVICE constexpr u32x4 philox4x32(u32x4 counter, u32x2 key) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key[0] += detail::philox_w0;
      key[1] += detail::philox_w1;
    }
    counter = detail::philox_round(counter, key);
  }
  return counter;
}

// A reproducible random sequence: value `index` of stream `stream` under `seed`. The seed is the
// Philox key and (index, stream) the counter, so a value never depends on how many threads or
// ranks compute the sequence, or in which order: a shard can draw exactly its slice of a
// parameter's initial values. Use one stream per consumer (e.g. the parameter's index).
//
// Host and device give identical bits for block(), uniform() and bernoulli(); normal() goes
// through logf/cosf, whose last bit may differ between the host libm and CUDA's.
struct rng_stream {
  std::uint64_t seed;
  std::uint64_t stream;

  // The four raw words of Philox block `index`.
  DML_HOST_DEVICE constexpr u32x4 block(std::uint64_t index) const {
    const u32x4 counter{{static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(index >> 32),
                         static_cast<std::uint32_t>(stream), static_cast<std::uint32_t>(stream >> 32)}};
    const u32x2 key{{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)}};
    return philox4x32(counter, key);
  }

  // Uniform in [0, 1), on the 2^-24 grid.
  DML_HOST_DEVICE constexpr float uniform(std::uint64_t index) const {
    return detail::unit_float(block(index)[0]);
  }
  // Uniform in [lo, hi) (hi itself only through float rounding of lo + (hi - lo) * u).
  DML_HOST_DEVICE constexpr float uniform(std::uint64_t index, float lo, float hi) const {
    return lo + (hi - lo) * uniform(index);
  }
  // Normal(mean, std): both Box-Muller inputs come from the same block, so value i stays a
  // function of i alone.
  DML_HOST_DEVICE float normal(std::uint64_t index, float mean = 0.0f, float std = 1.0f) const {
    const u32x4 b = block(index);
    return mean + std * detail::box_muller(b[0], b[1]);
  }
  // True with probability p (p <= 0: never; p >= 1: always).
  DML_HOST_DEVICE constexpr bool bernoulli(std::uint64_t index, float p) const {
    return uniform(index) < p;
  }
};

}  // namespace dml
