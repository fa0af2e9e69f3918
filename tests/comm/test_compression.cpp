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
#include <utility>
#include <vector>

#include "dml/comm/compression.hpp"

namespace {

using dml::comm::any_filter;
using dml::comm::filter_kind;
using dml::comm::message_header_bytes;
using dml::comm::no_filter;
using dml::comm::onebit_filter;
using dml::comm::significant_filter;
using dml::comm::topk_filter;
using bytes = std::vector<std::byte>;

std::vector<float> normal_vector(std::size_t n, std::uint32_t seed, float scale = 1.f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> x(n);
  for (auto& v : x) v = dist(gen);
  return x;
}

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

  SUBCASE("onebit: header + ceil(n/8) + 8, LSB-first sign bits and the two means") {
    std::vector<float> acc = {1, -1, 2, -2, 3, 0, -0.5f, 4, -8};
    const bytes msg = encode(onebit_filter{}, acc);
    REQUIRE(msg.size() == message_header_bytes + 2 + 8);
    float mean_pos, mean_neg;
    std::memcpy(&mean_pos, msg.data() + message_header_bytes, 4);
    std::memcpy(&mean_neg, msg.data() + message_header_bytes + 4, 4);
    CHECK(mean_pos == 2.f);        // (1 + 2 + 3 + 0 + 4) / 5
    CHECK(mean_neg == -2.875f);    // (-1 - 2 - 0.5 - 8) / 4
    CHECK(msg[message_header_bytes + 8] == std::byte{0x4a});  // entries 1, 3 and 6 negative
    CHECK(msg[message_header_bytes + 9] == std::byte{0x01});  // entry 8 negative
    const std::vector<float> expect_acc = {-1, 1.875f, 0, 0.875f, 1, -2, 2.375f, 2, -5.125f};
    CHECK(acc == expect_acc);

    // Whole 32-bit words and a tail: every bit where the per-entry rule puts it.
    for (std::size_t m : {std::size_t{1}, std::size_t{8}, std::size_t{40}, std::size_t{1003}}) {
      CAPTURE(m);
      auto y = normal_vector(m, 11);
      bytes expect_bits((m + 7) / 8, std::byte{0});
      for (std::size_t i = 0; i < m; ++i)
        if (y[i] < 0) expect_bits[i / 8] |= std::byte(1u << (i % 8));
      const bytes ym = encode(onebit_filter{}, y);
      REQUIRE(ym.size() == message_header_bytes + (m + 7) / 8 + 8);
      CHECK(std::equal(expect_bits.begin(), expect_bits.end(), ym.begin() + message_header_bytes + 8));
    }
  }

  SUBCASE("onebit decodes to the mean of each sign's entries") {
    auto acc = x;
    double sp = 0, sn = 0;
    std::size_t np = 0, nn = 0;
    for (float v : x) {
      if (v < 0) {
        sn += v;
        ++nn;
      } else {
        sp += v;
        ++np;
      }
    }
    const bytes msg = encode(onebit_filter{}, acc);
    const std::vector<float> sent = decode(onebit_filter{}, msg, n);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i)
      wrong += sent[i] != static_cast<float>(x[i] < 0 ? sn / double(nn) : sp / double(np));
    CHECK(wrong == 0);
  }

  SUBCASE("onebit cuts a large message at least 30x") {
    constexpr std::size_t big = 100000;
    auto a = normal_vector(big, 3), b = a;
    const std::size_t dense = encode(no_filter{}, a).size();
    const std::size_t packed = encode(onebit_filter{}, b).size();
    const double ratio = double(dense) / double(packed);
    MESSAGE("n=", big, " none=", dense, " bytes, onebit=", packed, " bytes, ratio=", ratio);
    CHECK(packed == message_header_bytes + big / 8 + 8);
    CHECK(ratio >= 30);
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
      CHECK(msg.size() == message_header_bytes + (f.kind() == filter_kind::onebit ? 8 : 0));
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

  SUBCASE("filters with parameters out of range refuse to encode") {
    auto acc = x;
    bytes out;
    CHECK_THROWS_WITH_AS(topk_filter{2.5}.encode(acc, out), doctest::Contains("expected k a whole count"),
                         invalid_argument);
    CHECK_THROWS_AS(topk_filter{0}.encode(acc, out), invalid_argument);
    CHECK_THROWS_WITH_AS(significant_filter{-1.f}.encode(acc, out),
                         doctest::Contains("expected a finite threshold >= 0, found -1"), invalid_argument);
    CHECK(out.empty());
    CHECK(acc == x);
  }
}

TEST_CASE("any_filter::parse reads the four forms and rejects everything else") {
  CHECK(any_filter::parse("none").kind() == filter_kind::none);
  CHECK(any_filter::parse("onebit").kind() == filter_kind::onebit);
  const any_filter s = any_filter::parse("significant:0.01");
  CHECK(s.kind() == filter_kind::significant);
  CHECK(std::get<significant_filter>(s.variant()).threshold == 0.01f);
  const any_filter t = any_filter::parse("topk:100");
  CHECK(std::get<topk_filter>(t.variant()).k == 100);
  CHECK(std::get<topk_filter>(any_filter::parse("topk:0.25").variant()).k == 0.25);
  CHECK(std::get<topk_filter>(any_filter::parse("topk:1e3").variant()).k == 1000);
  for (const char* spec : {"none", "onebit", "significant:0.01", "significant:0", "topk:100", "topk:0.001"}) {
    CAPTURE(spec);
    CHECK(any_filter::parse(spec).name() == spec);
    CHECK(any_filter::parse(any_filter::parse(spec).name()).name() == spec);
  }

  using dml::invalid_argument;
  CHECK_THROWS_WITH_AS(any_filter::parse("bogus"),
                       "dml::comm::any_filter::parse: expected none, significant:T, topk:K or onebit, found 'bogus'",
                       invalid_argument);
  for (const char* spec : {"", "None", "topk", "significant", "onebit:1", "none:0", "top:5"}) {
    CAPTURE(spec);
    CHECK_THROWS_WITH_AS(any_filter::parse(spec), doctest::Contains("expected none, significant:T, topk:K or onebit"),
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
