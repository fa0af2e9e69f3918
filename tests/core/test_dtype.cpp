// SPDX-License-Identifier: Apache-2.0
// tests/core/test_dtype.cpp — bf16/fp16 rounding (hand table, exhaustive decode, PyTorch parity)
// and the dtype tag.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "dml/core/dtype.hpp"

namespace test_dtype {

namespace {

float from_bits32(std::uint32_t u) { return dml::detail::bits_float(u); }
std::string hex(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}
bool is_nan_bf16(std::uint16_t b) { return (b & 0x7fffu) > 0x7f80u; }
bool is_nan_fp16(std::uint16_t b) { return (b & 0x7fffu) > 0x7c00u; }

struct rounding_case {
  std::uint32_t in;
  std::uint16_t bf16, fp16;  // 0xffff: expect a NaN (any payload)
};

// Worked out by hand from the encodings; comments give the value and the rule at work.
constexpr rounding_case table[] = {
    {0x00000000u, 0x0000u, 0x0000u},  // +0
    {0x80000000u, 0x8000u, 0x8000u},  // -0 keeps its sign
    {0x3f800000u, 0x3f80u, 0x3c00u},  // 1
    {0xbf800000u, 0xbf80u, 0xbc00u},  // -1
    {0x3f808000u, 0x3f80u, 0x3c04u},  // 1 + 2^-8: bf16 tie, kept bit even -> down
    {0x3f818000u, 0x3f82u, 0x3c0cu},  // 1 + 3*2^-8: bf16 tie, kept bit odd -> up
    {0x3f808001u, 0x3f81u, 0x3c04u},  // just above the bf16 tie -> up
    {0x3f807fffu, 0x3f80u, 0x3c04u},  // just below the bf16 tie -> down
    {0x3f801000u, 0x3f80u, 0x3c00u},  // 1 + 2^-11: fp16 tie, even -> down
    {0x3f803000u, 0x3f80u, 0x3c02u},  // 1 + 3*2^-11: fp16 tie, odd -> up
    {0x3f801001u, 0x3f80u, 0x3c01u},  // just above the fp16 tie
    {0x40490fdbu, 0x4049u, 0x4248u},  // pi
    {0x3dcccccdu, 0x3dcdu, 0x2e66u},  // 0.1
    {0x00000001u, 0x0000u, 0x0000u},  // smallest f32 subnormal
    {0x00008000u, 0x0000u, 0x0000u},  // f32 subnormal, bf16 tie to even zero
    {0x00018000u, 0x0002u, 0x0000u},  // f32 subnormal, bf16 tie, odd -> up
    {0x007fffffu, 0x0080u, 0x0000u},  // largest f32 subnormal rounds to the smallest normal bf16
    {0x807fffffu, 0x8080u, 0x8000u},
    {0x477fe000u, 0x4780u, 0x7bffu},  // 65504, largest finite fp16
    {0x477fefffu, 0x4780u, 0x7bffu},  // just under 65520 -> stays finite
    {0x477ff000u, 0x4780u, 0x7c00u},  // 65520: tie, odd -> overflows to inf
    {0xc77ff000u, 0xc780u, 0xfc00u},
    {0x47800000u, 0x4780u, 0x7c00u},  // 65536
    {0x7f7f0000u, 0x7f7fu, 0x7c00u},  // largest finite bf16
    {0x7f7f7fffu, 0x7f7fu, 0x7c00u},  // below its rounding tie
    {0x7f7f8000u, 0x7f80u, 0x7c00u},  // tie, odd -> inf
    {0x7f7fffffu, 0x7f80u, 0x7c00u},  // FLT_MAX
    {0xff7fffffu, 0xff80u, 0xfc00u},
    {0x7f800000u, 0x7f80u, 0x7c00u},  // +inf
    {0xff800000u, 0xff80u, 0xfc00u},  // -inf
    {0x38800000u, 0x3880u, 0x0400u},  // 2^-14, smallest normal fp16
    {0x387fc000u, 0x3880u, 0x03ffu},  // 1023 * 2^-24, largest fp16 subnormal
    {0x387fe000u, 0x3880u, 0x0400u},  // 1023.5 * 2^-24: tie, odd -> up into the normals
    {0x33800000u, 0x3380u, 0x0001u},  // 2^-24, smallest fp16 subnormal
    {0x33000000u, 0x3300u, 0x0000u},  // 2^-25: tie between 0 and 2^-24 -> even (0)
    {0x33000001u, 0x3300u, 0x0001u},  // just above -> 2^-24
    {0xb3000001u, 0xb300u, 0x8001u},
    {0x32ffffffu, 0x3300u, 0x0000u},  // just below 2^-25
    {0x33c00000u, 0x33c0u, 0x0002u},  // 1.5 * 2^-24: tie, odd -> 2
    {0x34200000u, 0x3420u, 0x0002u},  // 2.5 * 2^-24: tie, even -> 2
    {0x34300000u, 0x3430u, 0x0003u},  // 2.75 * 2^-24 -> 3
    {0x7fc00000u, 0xffffu, 0xffffu},  // quiet NaN
    {0xffc00000u, 0xffffu, 0xffffu},  // negative quiet NaN
    {0x7f800001u, 0xffffu, 0xffffu},  // signalling NaN whose payload sits in the dropped bits
    {0x7fffffffu, 0xffffu, 0xffffu},
};

// Value of every 16-bit pattern from its definition, in double.
double fp16_reference(std::uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v = e == 0 ? std::ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(1024 + m, e - 25);
  return s ? -v : v;
}
double bf16_reference(std::uint16_t b) {
  const int s = b >> 15, e = (b >> 7) & 0xff, m = b & 0x7f;
  double v = e == 0 ? std::ldexp(m, -133) : e == 255 ? (m ? NAN : INFINITY) : std::ldexp(128 + m, e - 134);
  return s ? -v : v;
}

}  // namespace

TEST_CASE("bf16 and fp16 are trivially copyable 16-bit values") {
  static_assert(std::is_trivially_copyable_v<dml::bf16> && std::is_trivially_copyable_v<dml::fp16>);
  static_assert(std::is_standard_layout_v<dml::bf16> && std::is_standard_layout_v<dml::fp16>);
  static_assert(!std::is_convertible_v<float, dml::bf16>, "construction from float is explicit");
  static_assert(std::is_convertible_v<dml::bf16, float>);
  CHECK(dml::bf16{}.bits == 0);
  CHECK(dml::fp16{}.bits == 0);
  CHECK(dml::bf16::from_bits(0x3f80).bits == 0x3f80);
  CHECK(float(dml::fp16::from_bits(0x3c00)) == 1.0f);
}

TEST_CASE("rounding of a hand-computed table") {
  int checked = 0;
  for (const auto& c : table) {
    const float f = from_bits32(c.in);
    const dml::bf16 b(f);
    const dml::fp16 h(f);
    INFO("input ", hex(c.in), " bf16=", hex(b.bits), " fp16=", hex(h.bits));
    if (c.bf16 == 0xffffu) {
      CHECK(is_nan_bf16(b.bits));
      CHECK(is_nan_fp16(h.bits));
      CHECK(std::isnan(float(b)));
      CHECK(std::isnan(float(h)));
      CHECK((b.bits >> 15) == (c.in >> 31));  // the sign survives
      CHECK((h.bits >> 15) == (c.in >> 31));
    } else {
      CHECK(b.bits == c.bf16);
      CHECK(h.bits == c.fp16);
    }
    ++checked;
  }
  CHECK(checked == static_cast<int>(std::size(table)));
}

TEST_CASE("every 16-bit pattern decodes to its value and encodes back to itself") {
  int bad_fp16 = 0, bad_bf16 = 0;
  for (std::uint32_t p = 0; p <= 0xffffu; ++p) {
    const auto bits = static_cast<std::uint16_t>(p);
    const float h = dml::fp16::from_bits(bits), b = dml::bf16::from_bits(bits);
    const double rh = fp16_reference(bits), rb = bf16_reference(bits);
    if (std::isnan(rh)) {
      bad_fp16 += !std::isnan(h) || !is_nan_fp16(dml::fp16(h).bits);
    } else {
      bad_fp16 += static_cast<double>(h) != rh || std::signbit(h) != std::signbit(rh) ||
                  dml::fp16(h).bits != bits;
    }
    if (std::isnan(rb)) {
      bad_bf16 += !std::isnan(b) || !is_nan_bf16(dml::bf16(b).bits);
    } else {
      bad_bf16 += static_cast<double>(b) != rb || std::signbit(b) != std::signbit(rb) ||
                  dml::bf16(b).bits != bits;
    }
  }
  CHECK(bad_fp16 == 0);
  CHECK(bad_bf16 == 0);
}

TEST_CASE("round_to gives the bits of the constructor for every kind of float") {
  // Every sign and exponent with mantissas at the rounding boundaries (ties, one either side), NaNs and
  // infinities among them, then pseudo-random patterns.
  std::vector<std::uint32_t> patterns;
  for (std::uint32_t top = 0; top < 0x200u; ++top)
    for (std::uint32_t low : {0x0u, 0x1u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, 0x17fffu, 0x18000u, 0xfffu, 0x1000u,
                              0x1001u, 0x2000u, 0x3000u, 0x7fffffu})
      patterns.push_back((top << 23) | (low & 0x7fffffu));
  std::uint32_t x = 12345;
  for (int i = 0; i < 100000; ++i) patterns.push_back(x = x * 1664525u + 1013904223u);
  int bad = 0;
  for (const std::uint32_t u : patterns) {
    const float f = std::bit_cast<float>(u);
    bad += dml::round_to<dml::bf16>(f).bits != dml::bf16(f).bits;
    bad += dml::round_to<dml::fp16>(f).bits != dml::fp16(f).bits;
    bad += std::bit_cast<std::uint32_t>(dml::round_to<float>(f)) != u;
  }
  CHECK(bad == 0);
  CHECK(dml::round_to<double>(0.1f) == static_cast<double>(0.1f));
  CHECK(dml::round_to<dml::bf16>(1.0 + 1.0 / 256).bits == dml::bf16(1.f).bits);  // a double goes through float
}

TEST_CASE("arithmetic and comparison go through float") {
  const dml::bf16 a(1.5f), b(2.25f);
  const dml::fp16 c(0.5f);
  static_assert(std::is_same_v<decltype(a + b), float>);
  CHECK(a + b == 3.75f);
  CHECK(a * c == 0.75f);
  CHECK(b - a == 0.75f);
  CHECK(b / c == 4.5f);
  CHECK(a == dml::bf16(1.5f));
  CHECK(a != b);
  CHECK(a < b);
  CHECK(dml::fp16(0.0f) == dml::fp16(-0.0f));  // IEEE: +0 == -0 although the bits differ
  const dml::fp16 nan(NAN);
  CHECK_FALSE(nan == nan);
}

TEST_CASE("dtype names, sizes and tags") {
  using dml::dtype;
  static_assert(dml::dtype_v<float> == dtype::f32);
  static_assert(dml::dtype_v<double> == dtype::f64);
  static_assert(dml::dtype_v<dml::bf16> == dtype::bf16);
  static_assert(dml::dtype_v<dml::fp16> == dtype::f16);
  static_assert(dml::dtype_v<std::int32_t> == dtype::i32);
  static_assert(dml::dtype_v<std::int64_t> == dtype::i64);
  static_assert(dml::dtype_v<std::uint8_t> == dtype::u8);
  static_assert(dml::dtype_size(dml::dtype_v<dml::bf16>) == sizeof(dml::bf16));
  static_assert(dml::dtype_size(dml::dtype_v<double>) == sizeof(double));
  const std::pair<dtype, const char*> names[] = {{dtype::f32, "F32"}, {dtype::f64, "F64"},
                                                 {dtype::bf16, "BF16"}, {dtype::f16, "F16"},
                                                 {dtype::i32, "I32"}, {dtype::i64, "I64"},
                                                 {dtype::u8, "U8"}};
  const std::size_t sizes[] = {4, 8, 2, 2, 4, 8, 1};
  for (std::size_t i = 0; i < std::size(names); ++i) {
    CHECK(dml::dtype_name(names[i].first) == names[i].second);
    CHECK(dml::dtype_from_name(names[i].second) == names[i].first);
    CHECK(dml::dtype_size(names[i].first) == sizes[i]);
  }
  CHECK(dml::detail::cat(dtype::bf16) == "BF16");
  CHECK_THROWS_AS(dml::dtype_from_name("F8_E4M3"), dml::format_error);
  CHECK_THROWS_WITH(dml::dtype_from_name("f32"), doctest::Contains("found 'f32'"));
}

// The inputs of the PyTorch comparison: the boundary cases of both formats at every bit position
// of every exponent, and random patterns, some confined to where fp16 is neither 0 nor inf.
static std::vector<std::uint32_t> parity_inputs() {
  std::vector<std::uint32_t> v;
  for (const auto& c : table) v.push_back(c.in);
  for (std::uint32_t e = 0; e < 256; ++e)
    for (std::uint32_t k = 0; k < 23; ++k) {
      const std::uint32_t bit = 1u << k;
      for (std::uint32_t m : {bit, bit | (bit << 1), bit - 1, bit + 1, (bit << 1) - 1, 0x7fffffu ^ bit})
        for (std::uint32_t s : {0u, 0x80000000u}) v.push_back(s | (e << 23) | (m & 0x7fffffu));
    }
  std::mt19937 gen(20240607u);
  for (int i = 0; i < 100000; ++i) v.push_back(static_cast<std::uint32_t>(gen()));
  std::uniform_int_distribution<std::uint32_t> exponent(98, 145);
  for (int i = 0; i < 100000; ++i) {
    const std::uint32_t r = static_cast<std::uint32_t>(gen());
    v.push_back((r & 0x807fffffu) | (exponent(gen) << 23));
  }
  return v;
}

TEST_CASE("rounding matches PyTorch bit for bit" * doctest::test_suite("python")) {
  const std::vector<std::uint32_t> in = parity_inputs();
  const std::string dir = DML_TEST_BINARY_DIR;
  const std::string in_path = dir + "/dtype_parity_in.bin", out_path = dir + "/dtype_parity_out.bin";
  {
    std::ofstream f(in_path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(in.data()), static_cast<std::streamsize>(in.size() * 4));
    REQUIRE(f.good());
  }
  const std::string cmd = std::string(DML_TEST_PYTHON) + " " + DML_TEST_SOURCE_DIR +
                          "/dtype_reference.py " + in_path + " " + out_path;
  REQUIRE(std::system(cmd.c_str()) == 0);
  std::vector<std::uint16_t> ref(2 * in.size());
  {
    std::ifstream f(out_path, std::ios::binary);
    f.read(reinterpret_cast<char*>(ref.data()), static_cast<std::streamsize>(ref.size() * 2));
    REQUIRE(f.gcount() == static_cast<std::streamsize>(ref.size() * 2));
  }
  std::size_t bad_bf16 = 0, bad_fp16 = 0, nans = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const float f = from_bits32(in[i]);
    const std::uint16_t b = dml::bf16(f).bits, h = dml::fp16(f).bits;
    const std::uint16_t rb = ref[i], rh = ref[in.size() + i];
    bool ok_b, ok_h;
    if (std::isnan(f)) {
      ++nans;
      ok_b = is_nan_bf16(b) && is_nan_bf16(rb);
      ok_h = is_nan_fp16(h) && is_nan_fp16(rh);
    } else {
      ok_b = b == rb;
      ok_h = h == rh;
    }
    if (!ok_b && bad_bf16++ < 5) MESSAGE("bf16 of ", hex(in[i]), ": dml ", hex(b), ", torch ", hex(rb));
    if (!ok_h && bad_fp16++ < 5) MESSAGE("fp16 of ", hex(in[i]), ": dml ", hex(h), ", torch ", hex(rh));
  }
  MESSAGE("compared ", in.size(), " inputs (", nans, " NaN)");
  CHECK(bad_bf16 == 0);
  CHECK(bad_fp16 == 0);
  std::remove(in_path.c_str());
  std::remove(out_path.c_str());
}

}  // namespace test_dtype
