// SPDX-License-Identifier: Apache-2.0
// tests/comm/test_compression.cpp — dml::comm's compression filters: error feedback keeps every value,
// message sizes and contents, round trips, rejected messages and the run-time choice from a flag.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dml/comm/compression.hpp"
#include "support.hpp"

namespace test_compression {

namespace {

using dml::comm::any_filter;
using dml::comm::filter_kind;
using dml::comm::message_header_bytes;
using dml::comm::no_filter;
using dml::comm::onebit_filter;
using dml::comm::significant_filter;
using dml::comm::topk_filter;
using bytes = std::vector<std::byte>;

using dml_test::normal_vector;

template <class F>
bytes encode(const F& f, std::vector<float>& acc) {
  bytes out;
  f.encode(std::span(acc), out);
  return out;
}

template <class F>
std::vector<float> decode(const F& f, const bytes& msg, std::size_t n) {
  std::vector<float> dst(n, 0.f);
  CHECK(f.decode(std::span<const std::byte>(msg), std::span(dst)) == msg.size());
  return dst;
}

std::uint32_t header_count(const bytes& msg) {
  std::uint32_t c;
  std::memcpy(&c, msg.data() + 5, 4);
  return c;
}

float ulp(float x) {
  const float a = std::abs(x);
  return std::nextafter(a, std::numeric_limits<float>::infinity()) - a;
}

// 50 rounds of acc += g_t; encode; decode into `sent`. Per round, sent + acc_after must give back
// acc_before: bit for bit where the filter copies values, and within the one rounding of
// acc_before - mean (half an ulp of acc_after) for onebit. At the end, sum_t g_t == everything sent
// + the final residual, up to the float rounding of acc += g.
template <class F>
void check_error_feedback(const F& f, std::size_t n, bool copies_values) {
  constexpr int rounds = 50;
  std::mt19937 gen(20140914);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> acc(n, 0.f), g(n), before(n);
  std::vector<double> g_total(n, 0.0), g_abs(n, 0.0), sent_total(n, 0.0);
  std::size_t not_exact = 0, sent_entries = 0;
  double max_ulps = 0;
  for (int t = 0; t < rounds; ++t) {
    for (std::size_t i = 0; i < n; ++i) {
      g[i] = dist(gen);
      acc[i] += g[i];
      g_total[i] += g[i];
      g_abs[i] += std::abs(double{g[i]});
    }
    before = acc;
    const bytes msg = encode(f, acc);
    const std::vector<float> sent = decode(f, msg, n);
    for (std::size_t i = 0; i < n; ++i) {
      sent_total[i] += sent[i];
      sent_entries += sent[i] != 0.f;
      if (copies_values) {
        not_exact += !(sent[i] + acc[i] == before[i]);
      } else {
        const double err = std::abs(double{sent[i]} + double{acc[i]} - double{before[i]});
        max_ulps = std::max(max_ulps, err / ulp(acc[i]));
      }
    }
  }
  double max_rel = 0;
  for (std::size_t i = 0; i < n; ++i)
    max_rel = std::max(max_rel, std::abs(g_total[i] - (sent_total[i] + double{acc[i]})) / g_abs[i]);
  INFO(f.name(), " n=", n, " sent_entries=", sent_entries, " not_exact=", not_exact, " max_ulps=", max_ulps,
       " max_rel=", max_rel);
  MESSAGE(f.name(), " n=", n, ": max_rel=", max_rel, " max_ulps_of_acc_after=", max_ulps);
  CHECK(sent_entries > 0);
  CHECK(not_exact == 0);
  CHECK(max_ulps <= 0.5);
  CHECK(max_rel <= 1e-5);
}

// onebit's wire form, read back field by field: the block size, (mean_pos, mean_neg) per block, the bits.
struct onebit_fields {
  std::uint32_t block;
  std::vector<std::pair<float, float>> means;
  bytes bits;
};
onebit_fields onebit_fields_of(const bytes& msg, std::size_t n) {
  onebit_fields f{};
  std::memcpy(&f.block, msg.data() + message_header_bytes, 4);
  f.means.resize((n + f.block - 1) / f.block);
  const std::byte* m = msg.data() + message_header_bytes + 4;
  for (std::size_t b = 0; b < f.means.size(); ++b) {
    std::memcpy(&f.means[b].first, m + 8 * b, 4);
    std::memcpy(&f.means[b].second, m + 8 * b + 4, 4);
  }
  const std::byte* bits = m + 8 * f.means.size();
  f.bits.assign(bits, bits + (n + 7) / 8);
  return f;
}

// The (index, value) pairs of a significant or topk message, in message order.
std::vector<std::pair<std::uint32_t, float>> pairs_of(const bytes& msg) {
  std::vector<std::pair<std::uint32_t, float>> p(header_count(msg));
  for (std::size_t j = 0; j < p.size(); ++j) {
    std::memcpy(&p[j].first, msg.data() + message_header_bytes + 8 * j, 4);
    std::memcpy(&p[j].second, msg.data() + message_header_bytes + 8 * j + 4, 4);
  }
  return p;
}

}  // namespace

TEST_CASE("error feedback: what a filter sends plus what it keeps is what it was given") {
  // 1003 leaves a partial byte of onebit's bits.
  const auto each_n = [](const auto& f, bool copies_values) {
    for (std::size_t n : {std::size_t{1000}, std::size_t{1003}}) check_error_feedback(f, n, copies_values);
  };
  SUBCASE("none") { each_n(no_filter{}, true); }
  SUBCASE("significant") { each_n(significant_filter{1.5f}, true); }
  SUBCASE("topk count") { each_n(topk_filter{17}, true); }
  SUBCASE("topk fraction") { each_n(topk_filter{0.05}, true); }
  SUBCASE("onebit") { each_n(onebit_filter{}, false); }
  SUBCASE("onebit, several blocks") {
    each_n(onebit_filter{64}, false);  // 16 blocks, the last of 40 or 43 entries
    check_error_feedback(onebit_filter{1024}, 4000, false);  // 4 blocks, the last of 928
    check_error_feedback(onebit_filter{}, 9000, false);      // 3 blocks of the default 4096, the last of 808
  }
  SUBCASE("any_filter") { each_n(any_filter::parse("topk:0.01"), true); }
}

TEST_CASE("message sizes and contents of each filter") {
  constexpr std::size_t n = 1000;
  const std::vector<float> x = normal_vector(n, 7);

  SUBCASE("none: header + 4 bytes per entry") {
    auto acc = x;
    const bytes msg = encode(no_filter{}, acc);
    CHECK(msg.size() == message_header_bytes + 4 * n);
    CHECK(msg[0] == std::byte{1});
    CHECK(std::all_of(acc.begin(), acc.end(), [](float v) { return v == 0.f; }));
  }

  SUBCASE("significant: exactly the entries above the threshold") {
    const float threshold = 1.25f;
    std::vector<float> y = x;
    y[3] = threshold;  // at the threshold: kept, not sent
    y[4] = -threshold;
    y[5] = std::nextafter(threshold, 2.f);  // just above: sent
    std::size_t above = 0;
    for (float v : y) above += std::abs(v) > threshold;
    REQUIRE(above > 50);
    auto acc = y;
    const bytes msg = encode(significant_filter{threshold}, acc);
    CHECK(msg.size() == message_header_bytes + 8 * above);
    CHECK(header_count(msg) == above);
    const std::vector<float> sent = decode(significant_filter{}, msg, n);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const bool big = std::abs(y[i]) > threshold;
      wrong += big ? !(sent[i] == y[i] && acc[i] == 0.f) : !(sent[i] == 0.f && acc[i] == y[i]);
    }
    CHECK(wrong == 0);
    const auto p = pairs_of(msg);
    CHECK(std::is_sorted(p.begin(), p.end()));
  }

  SUBCASE("topk: exactly k entries, the largest in magnitude") {
    for (double k : {37.0, 0.05, 1e-6, 1.0}) {
      const std::size_t expect = k >= 1 ? static_cast<std::size_t>(k) : std::max<std::size_t>(1, std::size_t(k * n));
      CAPTURE(k);
      CHECK(topk_filter{k}.entries(n) == expect);
      auto acc = x;
      const bytes msg = encode(topk_filter{k}, acc);
      CHECK(msg.size() == message_header_bytes + 8 * expect);
      const auto p = pairs_of(msg);
      REQUIRE(p.size() == expect);
      std::vector<bool> chosen(n, false);
      float smallest_sent = std::numeric_limits<float>::infinity();
      for (std::size_t j = 0; j < p.size(); ++j) {
        CHECK(p[j].second == x[p[j].first]);
        if (j > 0) CHECK(p[j - 1].first < p[j].first);
        chosen[p[j].first] = true;
        smallest_sent = std::min(smallest_sent, std::abs(p[j].second));
      }
      float largest_kept = 0.f;
      for (std::size_t i = 0; i < n; ++i)
        if (!chosen[i]) largest_kept = std::max(largest_kept, std::abs(x[i]));
      CHECK(smallest_sent > largest_kept);
      // What is largest by magnitude, computed another way: the expect-th largest |x|.
      std::vector<float> mags(n);
      for (std::size_t i = 0; i < n; ++i) mags[i] = std::abs(x[i]);
      std::sort(mags.begin(), mags.end(), std::greater<>{});
      CHECK(smallest_sent == mags[expect - 1]);
    }
  }

  SUBCASE("topk: ties go to the lower index, so encoding is deterministic") {
    std::vector<float> acc = {1, -1, 1, -1, 1, -1, 0.5f, -2};
    const bytes msg = encode(topk_filter{3}, acc);
    const auto p = pairs_of(msg);
    REQUIRE(p.size() == 3);
    CHECK(p[0].first == 0);
    CHECK(p[1].first == 1);
    CHECK(p[2].first == 7);
  }

  SUBCASE("onebit: header + block size + one pair of means + ceil(n/8), LSB-first sign bits") {
    std::vector<float> acc = {1, -1, 2, -2, 3, 0, -0.5f, 4, -8};
    const bytes msg = encode(onebit_filter{}, acc);
    REQUIRE(msg.size() == message_header_bytes + 4 + 8 + 2);
    CHECK(header_count(msg) == 9);
    const onebit_fields f = onebit_fields_of(msg, 9);
    CHECK(f.block == 4096);
    REQUIRE(f.means.size() == 1);
    CHECK(f.means[0].first == 2.f);        // (1 + 2 + 3 + 0 + 4) / 5
    CHECK(f.means[0].second == -2.875f);   // (-1 - 2 - 0.5 - 8) / 4
    CHECK(f.bits[0] == std::byte{0x4a});   // entries 1, 3 and 6 negative
    CHECK(f.bits[1] == std::byte{0x01});   // entry 8 negative
    const std::vector<float> expect_acc = {-1, 1.875f, 0, 0.875f, 1, -2, 2.375f, 2, -5.125f};
    CHECK(acc == expect_acc);
  }

  SUBCASE("onebit: each block of entries has its own means, bits from the values before they come off") {
    // Blocks of 32 over 100 entries: 3 whole blocks and one of 4. Each block has its own scale and
    // offset, so one pair of means for the message would get every block's means wrong; block 2 has
    // no negative entry (its mean_neg is 0) and the last no non-negative one.
    constexpr std::size_t m = 100;
    constexpr std::uint32_t block = 32;
    std::vector<float> y = normal_vector(m, 13);
    for (std::size_t i = 0; i < m; ++i) {
      const std::size_t b = i / block;
      y[i] = y[i] * float(1 + 3 * b) + (b == 1 ? 0.7f : 0.f);
      if (b == 2) y[i] = std::abs(y[i]);
      if (b == 3) y[i] = -std::abs(y[i]) - 0.25f;
    }
    std::vector<std::pair<float, float>> expect_means;
    for (std::size_t lo = 0; lo < m; lo += block) {
      double sp = 0, sn = 0;
      std::size_t np = 0, nn = 0;
      for (std::size_t i = lo; i < std::min(m, lo + block); ++i) {
        if (y[i] < 0) sn += y[i], ++nn;
        else sp += y[i], ++np;
      }
      expect_means.emplace_back(np ? float(sp / double(np)) : 0.f, nn ? float(sn / double(nn)) : 0.f);
    }
    REQUIRE(expect_means.size() == 4);
    CHECK(expect_means[2].second == 0.f);
    CHECK(expect_means[3].first == 0.f);
    CHECK(expect_means[0].first != expect_means[1].first);

    auto acc = y;
    const bytes msg = encode(onebit_filter{block}, acc);
    REQUIRE(msg.size() == message_header_bytes + 4 + 8 * 4 + (m + 7) / 8);
    const onebit_fields f = onebit_fields_of(msg, m);
    CHECK(f.block == block);
    CHECK(f.means == expect_means);
    bytes expect_bits((m + 7) / 8, std::byte{0});
    for (std::size_t i = 0; i < m; ++i)
      if (y[i] < 0) expect_bits[i / 8] |= std::byte(1u << (i % 8));
    CHECK(f.bits == expect_bits);
    const std::vector<float> sent = decode(onebit_filter{}, msg, m);  // the block travels in the message
    std::size_t wrong_sent = 0, wrong_acc = 0;
    for (std::size_t i = 0; i < m; ++i) {
      const auto [mp, mn] = expect_means[i / block];
      const float mean = y[i] < 0 ? mn : mp;
      wrong_sent += sent[i] != mean;
      wrong_acc += acc[i] != y[i] - mean;
    }
    CHECK(wrong_sent == 0);
    CHECK(wrong_acc == 0);
  }

  SUBCASE("onebit: every bit where the per-entry rule puts it, whole words and a tail, any block") {
    for (std::uint32_t block : {32u, 96u, 1024u, 4096u}) {
      for (std::size_t m : {std::size_t{1}, std::size_t{8}, std::size_t{40}, std::size_t{1003}, std::size_t{2080}}) {
        CAPTURE(block);
        CAPTURE(m);
        auto y = normal_vector(m, 11);
        bytes expect_bits((m + 7) / 8, std::byte{0});
        for (std::size_t i = 0; i < m; ++i)
          if (y[i] < 0) expect_bits[i / 8] |= std::byte(1u << (i % 8));
        const bytes ym = encode(onebit_filter{block}, y);
        const std::size_t nb = (m + block - 1) / block;
        REQUIRE(ym.size() == message_header_bytes + 4 + 8 * nb + (m + 7) / 8);
        CHECK(ym.size() == message_header_bytes + onebit_filter::payload_bytes(m, block));
        CHECK(onebit_fields_of(ym, m).bits == expect_bits);
      }
    }
  }

  SUBCASE("onebit decodes to the mean of each sign's entries in each block") {
    for (std::uint32_t block : {64u, 1024u}) {  // 1000 entries: 16 blocks (the last of 40) or one
      CAPTURE(block);
      auto acc = x;
      const bytes msg = encode(onebit_filter{block}, acc);
      const std::vector<float> sent = decode(onebit_filter{}, msg, n);
      std::size_t wrong = 0;
      for (std::size_t lo = 0; lo < n; lo += block) {
        const std::size_t hi = std::min(n, lo + block);
        double sp = 0, sn = 0;
        std::size_t np = 0, nn = 0;
        for (std::size_t i = lo; i < hi; ++i) {
          if (x[i] < 0) sn += x[i], ++nn;
          else sp += x[i], ++np;
        }
        for (std::size_t i = lo; i < hi; ++i)
          wrong += sent[i] != static_cast<float>(x[i] < 0 ? sn / double(nn) : sp / double(np));
      }
      CHECK(wrong == 0);
    }
  }

  SUBCASE("onebit cuts a large message at least 30x") {
    // 100000 values, and one parameter-server range at its default max_range, 65536 values; blocks of
    // the default 4096 and of 1024.
    constexpr std::size_t big = 100000, range = 65536;
    for (const auto& [m, block, blocks] :
         {std::tuple{big, 4096u, 25u}, std::tuple{big, 1024u, 98u}, std::tuple{range, 4096u, 16u},
          std::tuple{range, 1024u, 64u}}) {
      auto a = normal_vector(m, 3), b = a;
      const std::size_t dense = encode(no_filter{}, a).size();
      const std::size_t packed = encode(onebit_filter{block}, b).size();
      const double ratio = double(dense) / double(packed);
      MESSAGE("n=", m, " none=", dense, " bytes, onebit:", block, "=", packed, " bytes, ratio=", ratio);
      CHECK(packed == message_header_bytes + 4 + 8 * blocks + m / 8);
      CHECK(ratio >= 30);
    }
    const std::size_t dense = message_header_bytes + 4 * big;
    auto c = normal_vector(big, 3);
    const std::size_t top = encode(topk_filter{0.01}, c).size();
    MESSAGE("n=", big, " topk:0.01=", top, " bytes, ratio=", double(dense) / double(top));
    CHECK(top == message_header_bytes + 8 * (big / 100));
  }

  SUBCASE("an empty vector is a header alone") {
    for (const any_filter& f : {any_filter::parse("none"), any_filter::parse("significant:0"),
                                any_filter::parse("topk:5"), any_filter::parse("onebit")}) {
      std::vector<float> empty;
      const bytes msg = encode(f, empty);
      CHECK(msg.size() == message_header_bytes + (f.kind() == filter_kind::onebit ? 4 : 0));  // its block size
      CHECK(decode(f, msg, 0).empty());
    }
  }
}

TEST_CASE("round trips: none and topk with k = n reconstruct their input exactly") {
  const std::size_t n = 4099;
  std::vector<float> x = normal_vector(n, 5, 3.f);
  x[17] = 0.f;
  x[18] = -0.f;
  x[19] = std::numeric_limits<float>::denorm_min();
  x[20] = std::numeric_limits<float>::max();
  for (const any_filter& f : {any_filter{no_filter{}}, any_filter{topk_filter{double(n)}},
                              any_filter{topk_filter{10.0 * n}}}) {
    CAPTURE(f.name());
    auto acc = x;
    const bytes msg = encode(f, acc);
    const std::vector<float> y = decode(f, msg, n);
    // Bit for bit, but for -0: decoding adds into dst, and +0 + -0 is +0.
    std::size_t differ = 0;
    for (std::size_t i = 0; i < n; ++i)
      differ += i == 18 ? !(y[i] == 0.f) : std::memcmp(&x[i], &y[i], 4) != 0;
    CHECK(differ == 0);
    CHECK(std::all_of(acc.begin(), acc.end(), [](float v) { return v == 0.f; }));
  }
}

TEST_CASE("messages delimit themselves and encoding is deterministic") {
  const std::vector<float> x = normal_vector(300, 9);
  const std::vector<any_filter> filters = {no_filter{}, significant_filter{0.5f}, topk_filter{0.1}, onebit_filter{}};
  bytes stream;
  std::vector<std::vector<float>> residuals;
  for (const any_filter& f : filters) {
    auto a = x, b = x;
    const std::size_t before = stream.size();
    f.encode(std::span(a), stream);
    const bytes again = encode(f, b);
    CHECK(std::equal(stream.begin() + std::ptrdiff_t(before), stream.end(), again.begin(), again.end()));
    CHECK(a == b);
    residuals.push_back(a);
  }
  std::span<const std::byte> rest(stream);
  for (std::size_t j = 0; j < filters.size(); ++j) {
    CAPTURE(filters[j].name());
    std::vector<float> dst(x.size(), 0.f);
    const std::size_t used = filters[j].decode(rest, std::span(dst));
    rest = rest.subspan(used);
    // What the message carried plus what stayed behind is the input (onebit up to one rounding).
    double worst = 0;
    for (std::size_t i = 0; i < x.size(); ++i)
      worst = std::max(worst, std::abs(double{dst[i]} + residuals[j][i] - x[i]) / ulp(residuals[j][i]));
    CHECK(worst <= 0.5);
  }
  CHECK(rest.empty());
}

TEST_CASE("decode rejects messages that are cut short, of another kind, out of range or of the wrong length") {
  constexpr std::size_t n = 13;
  const std::vector<float> x = normal_vector(n, 1);
  const std::vector<any_filter> filters = {no_filter{}, significant_filter{0.1f}, topk_filter{4}, onebit_filter{}};
  std::vector<bytes> msgs;
  for (const any_filter& f : filters) {
    auto acc = x;
    msgs.push_back(encode(f, acc));
  }
  using dml::invalid_argument;
  for (std::size_t j = 0; j < filters.size(); ++j) {
    const any_filter& f = filters[j];
    const bytes& msg = msgs[j];
    CAPTURE(f.name());
    std::vector<float> dst(n, 0.f);
    const auto decode_into = [&](std::span<const std::byte> in, std::size_t size) {
      std::vector<float> d(size, 0.f);
      f.decode(in, std::span(d));
    };
    // Cut short: inside the payload, inside the header, nothing at all.
    CHECK_THROWS_WITH_AS(decode_into(std::span(msg).first(msg.size() - 1), n), doctest::Contains("expected"),
                         invalid_argument);
    CHECK_THROWS_WITH_AS(decode_into(std::span(msg).first(5), n),
                         doctest::Contains("expected a message of at least 9 bytes"), invalid_argument);
    CHECK_THROWS_WITH_AS(decode_into({}, n), doctest::Contains("expected"), invalid_argument);
    // Another filter's message.
    for (std::size_t other = 0; other < msgs.size(); ++other) {
      if (other == j) continue;
      CHECK_THROWS_WITH_AS(decode_into(msgs[other], n),
                           doctest::Contains(("expected a " + std::string(dml::comm::name(f.kind())) + " message").c_str()),
                           invalid_argument);
    }
    bytes junk = msg;
    junk[0] = std::byte{0};
    CHECK_THROWS_WITH_AS(decode_into(junk, n), doctest::Contains("which no dml filter writes"), invalid_argument);
    // A destination of another length.
    CHECK_THROWS_WITH_AS(decode_into(msg, n - 1), doctest::Contains("expected a message of 12 entries"),
                         invalid_argument);
    CHECK_THROWS_WITH_AS(decode_into(msg, n + 1), doctest::Contains("found one of 13"), invalid_argument);
    // The message itself decodes.
    CHECK(f.decode(std::span(msg), std::span(dst)) == msg.size());
  }

  SUBCASE("an index out of range leaves dst as it was") {
    for (std::size_t j : {std::size_t{1}, std::size_t{2}}) {
      bytes bad = msgs[j];
      REQUIRE(header_count(bad) >= 2);
      const std::uint32_t last_index = n;
      std::memcpy(bad.data() + message_header_bytes + 8 * (header_count(bad) - 1), &last_index, 4);
      std::vector<float> dst(n, 1.f);
      CHECK_THROWS_WITH_AS(filters[j].decode(std::span<const std::byte>(bad), std::span(dst)),
                           doctest::Contains("expected indices below 13, found 13"), invalid_argument);
      CHECK(std::all_of(dst.begin(), dst.end(), [](float v) { return v == 1.f; }));
    }
  }

  SUBCASE("a count that does not fit") {
    bytes bad = msgs[2];
    const std::uint32_t count = n + 1;
    std::memcpy(bad.data() + 5, &count, 4);
    std::vector<float> dst(n);
    CHECK_THROWS_WITH_AS(topk_filter::decode(bad, dst), doctest::Contains("expected at most 13 entries, found 14"),
                         invalid_argument);
    bytes dense = msgs[0];
    std::memcpy(dense.data() + 5, &count, 4);
    CHECK_THROWS_WITH_AS(no_filter::decode(dense, dst), doctest::Contains("expected a count equal to the length 13"),
                         invalid_argument);
    bytes bits = msgs[3];
    bits.back() |= std::byte{0x80};  // 13 entries use 5 bits of the second byte
    CHECK_THROWS_WITH_AS(onebit_filter::decode(bits, dst), doctest::Contains("expected zero padding bits"),
                         invalid_argument);
  }

  SUBCASE("onebit: a bad block size or means cut short leave dst as it was") {
    constexpr std::size_t m = 100;
    auto acc = normal_vector(m, 21);
    const bytes good = encode(onebit_filter{32}, acc);  // 4 blocks: means at [13, 45), bits at [45, 58)
    REQUIRE(good.size() == message_header_bytes + 4 + 32 + 13);
    std::vector<float> dst(m, 1.f);
    const auto with_block = [&](std::uint32_t b) {
      bytes bad = good;
      std::memcpy(bad.data() + message_header_bytes, &b, 4);
      return bad;
    };
    CHECK_THROWS_WITH_AS(onebit_filter::decode(with_block(0), dst),
                         doctest::Contains("expected a block size that is a positive multiple of 32, found 0"),
                         invalid_argument);
    CHECK_THROWS_WITH_AS(onebit_filter::decode(with_block(48), dst),
                         doctest::Contains("expected a block size that is a positive multiple of 32, found 48"),
                         invalid_argument);
    CHECK_THROWS_WITH_AS(onebit_filter::decode(with_block(1), dst),
                         doctest::Contains("expected a block size that is a positive multiple of 32, found 1"),
                         invalid_argument);
    // Cut inside the block size, inside the means, and a smaller block claiming more means than there are.
    CHECK_THROWS_WITH_AS(onebit_filter::decode(std::span(good).first(message_header_bytes + 2), dst),
                         doctest::Contains("expected 13 bytes (header + block size), found 11"), invalid_argument);
    CHECK_THROWS_WITH_AS(onebit_filter::decode(std::span(good).first(message_header_bytes + 4 + 20), dst),
                         doctest::Contains("expected 58 bytes (header + block size + 8 per block + one bit per entry), "
                                           "found 33"),
                         invalid_argument);
    CHECK_THROWS_WITH_AS(onebit_filter::decode(std::span(good).first(message_header_bytes + 4 + 32), dst),
                         doctest::Contains("expected 58 bytes"), invalid_argument);
    auto acc64 = normal_vector(m, 21);
    bytes relabelled = encode(onebit_filter{64}, acc64);  // 2 pairs of means, relabelled as blocks of 32
    REQUIRE(relabelled.size() == 42);
    const std::uint32_t b32 = 32;
    std::memcpy(relabelled.data() + message_header_bytes, &b32, 4);
    CHECK_THROWS_WITH_AS(onebit_filter::decode(relabelled, dst), doctest::Contains("expected 58 bytes"),
                         invalid_argument);
    CHECK(std::all_of(dst.begin(), dst.end(), [](float v) { return v == 1.f; }));
    CHECK(onebit_filter::decode(good, dst) == good.size());
  }

  SUBCASE("filters with parameters out of range refuse to encode") {
    auto acc = x;
    bytes out;
    CHECK_THROWS_WITH_AS(topk_filter{2.5}.encode(acc, out), doctest::Contains("expected k a whole count"),
                         invalid_argument);
    CHECK_THROWS_AS(topk_filter{0}.encode(acc, out), invalid_argument);
    CHECK_THROWS_WITH_AS(significant_filter{-1.f}.encode(acc, out),
                         doctest::Contains("expected a finite threshold >= 0, found -1"), invalid_argument);
    for (std::uint32_t b : {0u, 1u, 48u, 1000u})
      CHECK_THROWS_WITH_AS(onebit_filter{b}.encode(acc, out),
                           doctest::Contains(("expected a block that is a positive multiple of 32, found " +
                                              std::to_string(b)).c_str()),
                           invalid_argument);
    CHECK(out.empty());
    CHECK(acc == x);
  }
}

TEST_CASE("any_filter::parse reads the five forms and rejects everything else") {
  CHECK(any_filter::parse("none").kind() == filter_kind::none);
  CHECK(any_filter::parse("onebit").kind() == filter_kind::onebit);
  CHECK(std::get<onebit_filter>(any_filter::parse("onebit").variant()).block == 4096);
  CHECK(std::get<onebit_filter>(any_filter::parse("onebit:512").variant()).block == 512);
  CHECK(std::get<onebit_filter>(any_filter::parse("onebit:32").variant()).block == 32);
  CHECK(std::get<onebit_filter>(any_filter::parse("onebit:65536").variant()).block == 65536);
  CHECK(any_filter::parse("onebit:4096").name() == "onebit");  // the default block is spelled without it
  CHECK(any_filter::parse("onebit:1024").name() == "onebit:1024");
  CHECK(onebit_filter{}.name() == "onebit");
  CHECK(onebit_filter{256}.name() == "onebit:256");
  const any_filter s = any_filter::parse("significant:0.01");
  CHECK(s.kind() == filter_kind::significant);
  CHECK(std::get<significant_filter>(s.variant()).threshold == 0.01f);
  const any_filter t = any_filter::parse("topk:100");
  CHECK(std::get<topk_filter>(t.variant()).k == 100);
  CHECK(std::get<topk_filter>(any_filter::parse("topk:0.25").variant()).k == 0.25);
  CHECK(std::get<topk_filter>(any_filter::parse("topk:1e3").variant()).k == 1000);
  for (const char* spec :
       {"none", "onebit", "onebit:1024", "onebit:256", "onebit:32", "significant:0.01", "significant:0", "topk:100", "topk:0.001"}) {
    CAPTURE(spec);
    CHECK(any_filter::parse(spec).name() == spec);
    CHECK(any_filter::parse(any_filter::parse(spec).name()).name() == spec);
  }

  using dml::invalid_argument;
  CHECK_THROWS_WITH_AS(any_filter::parse("bogus"),
                       "dml::comm::any_filter::parse: expected none, significant:T, topk:K, onebit or onebit:B, found "
                       "'bogus'",
                       invalid_argument);
  for (const char* spec : {"", "None", "topk", "significant", "Onebit", "onebit32", "none:0", "top:5"}) {
    CAPTURE(spec);
    CHECK_THROWS_WITH_AS(any_filter::parse(spec),
                         doctest::Contains("expected none, significant:T, topk:K, onebit or onebit:B"), invalid_argument);
  }
  for (const char* spec : {"onebit:1", "onebit:0", "onebit:48", "onebit:1000", "onebit:", "onebit:-32", "onebit:+32",
                           "onebit:32.0", "onebit:1e3", "onebit: 32", "onebit:32x", "onebit:4294967296"}) {
    CAPTURE(spec);
    CHECK_THROWS_WITH_AS(any_filter::parse(spec),
                         doctest::Contains(("expected onebit:B with B a whole positive multiple of 32, found '" +
                                           std::string(spec) + "'").c_str()),
                         invalid_argument);
  }
  for (const char* spec : {"topk:", "topk:-1", "topk:0", "topk:2.5", "topk:5x", "topk:inf", "topk:nan", "topk: 5"}) {
    CAPTURE(spec);
    CHECK_THROWS_WITH_AS(any_filter::parse(spec),
                         doctest::Contains(("expected topk:K with K a whole count >= 1 or a fraction 0 < K < 1, found '" +
                                           std::string(spec) + "'").c_str()),
                         invalid_argument);
  }
  for (const char* spec : {"significant:x", "significant:", "significant:-0.5", "significant:inf", "significant:1e99"}) {
    CAPTURE(spec);
    CHECK_THROWS_WITH_AS(any_filter::parse(spec),
                         doctest::Contains(("expected significant:T with a finite threshold T >= 0, found '" +
                                           std::string(spec) + "'").c_str()),
                         invalid_argument);
  }
}

}  // namespace test_compression
