// SPDX-License-Identifier: Apache-2.0
// tests/train/test_text.cpp — byte-level text corpus: windows split across ranks equal one rank's,
// targets are the inputs shifted by one, positions stay in range, split, errors, the default text.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "dml/train/text.hpp"
#include "support.hpp"

namespace test_text {

namespace fs = std::filesystem;
using dml::train::text_corpus;

namespace {

struct temp_dir : dml_test::temp_dir {
  temp_dir() : dml_test::temp_dir("dml-text") {}
};

// Bytes that never repeat a 3-byte pattern nearby, so a window's content tells where it starts.
std::vector<std::uint8_t> sample_bytes(std::size_t n) {
  std::vector<std::uint8_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint8_t>((i * 7 + i / 256 * 13) & 0xFF);
  return v;
}

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary);
  f << text;
}

using dml_test::error_of;

struct windows {
  std::vector<float> x;
  std::vector<std::int32_t> y;
};

// The global batch of a step as `ranks` ranks would read it (contiguous slices, as the sampler cuts
// them), laid side by side.
windows read_split(const text_corpus& c, std::uint64_t seed, std::uint64_t step, std::int64_t batch,
                   std::int64_t seq, int ranks) {
  windows out{std::vector<float>(static_cast<std::size_t>(batch * seq), -1.0f),
              std::vector<std::int32_t>(static_cast<std::size_t>(batch * seq), -1)};
  for (int r = 0; r < ranks; ++r) {
    const std::int64_t lo = batch * r / ranks, hi = batch * (r + 1) / ranks;
    std::vector<float> x(static_cast<std::size_t>((hi - lo) * seq));
    std::vector<std::int32_t> y(x.size());
    c.batch(seed, step, lo, hi - lo, seq, x.data(), y.data());
    std::copy(x.begin(), x.end(), out.x.begin() + lo * seq);
    std::copy(y.begin(), y.end(), out.y.begin() + lo * seq);
  }
  return out;
}

}  // namespace

TEST_CASE("text_corpus: a global batch split across 1, 2 and 3 ranks reads one rank's windows") {
  const text_corpus c(sample_bytes(5000));
  const std::int64_t batch = 7, seq = 33;
  for (std::uint64_t step : {1u, 2u, 17u}) {
    CAPTURE(step);
    const auto one = read_split(c, 1234, step, batch, seq, 1);
    for (int ranks : {2, 3}) {
      CAPTURE(ranks);
      const auto many = read_split(c, 1234, step, batch, seq, ranks);
      CHECK(many.x == one.x);
      CHECK(many.y == one.y);
    }
  }
  // Steps and seeds give other windows.
  const auto a = read_split(c, 1234, 1, batch, seq, 1), b = read_split(c, 1234, 2, batch, seq, 1),
             d = read_split(c, 99, 1, batch, seq, 1);
  CHECK(a.x != b.x);
  CHECK(a.x != d.x);
}

TEST_CASE("text_corpus: y is x shifted by one within the text, and windows stay in range") {
  const auto bytes = sample_bytes(300);
  const text_corpus c(bytes);
  const std::int64_t seq = 40, count = 64;
  std::vector<float> x(static_cast<std::size_t>(count * seq));
  std::vector<std::int32_t> y(x.size());
  std::set<std::int64_t> starts;
  for (std::uint64_t step = 1; step <= 20; ++step) {
    c.batch(7, step, 0, count, seq, x.data(), y.data());
    for (std::int64_t i = 0; i < count; ++i) {
      const std::int64_t p = c.position(7, step, i, seq);
      REQUIRE(p >= 0);
      REQUIRE(p <= c.size() - seq - 1);
      starts.insert(p);
      for (std::int64_t j = 0; j < seq; ++j) {
        const auto k = static_cast<std::size_t>(i * seq + j);
        REQUIRE(x[k] == float(bytes[static_cast<std::size_t>(p + j)]));
        REQUIRE(y[k] == std::int32_t(bytes[static_cast<std::size_t>(p + j + 1)]));
        if (j + 1 < seq) REQUIRE(float(y[k]) == x[k + 1]);
      }
    }
  }
  // 1280 draws over 260 positions: both ends are reached and most positions are.
  CHECK(*starts.begin() == 0);
  CHECK(*starts.rbegin() == c.size() - seq - 1);
  CHECK(starts.size() > 240);

  // The longest window fits exactly: one position, the whole text.
  const text_corpus tiny(std::vector<std::uint8_t>{'a', 'b', 'c'});
  std::vector<float> tx(2);
  std::vector<std::int32_t> ty(2);
  tiny.batch(0, 1, 0, 1, 2, tx.data(), ty.data());
  CHECK(tx == std::vector<float>{'a', 'b'});
  CHECK(ty == std::vector<std::int32_t>{'b', 'c'});
}

TEST_CASE("text_corpus: load reads the file's bytes as they are, split cuts a held-out tail") {
  temp_dir dir;
  const std::string text = "Hello,\r\nbyte\tworld\n\xff\x01";
  write_file(dir / "t.txt", text);
  const auto c = text_corpus::load(dir / "t.txt");
  REQUIRE(c.size() == static_cast<std::int64_t>(text.size()));
  CHECK(std::equal(c.bytes().begin(), c.bytes().end(), text.begin(),
                   [](std::uint8_t a, char b) { return a == static_cast<std::uint8_t>(b); }));

  const text_corpus big(sample_bytes(1000));
  const auto [train, valid] = big.split(0.1);
  CHECK(train.size() == 900);
  CHECK(valid.size() == 100);
  CHECK(std::equal(train.bytes().begin(), train.bytes().end(), big.bytes().begin()));
  CHECK(std::equal(valid.bytes().begin(), valid.bytes().end(), big.bytes().begin() + 900));
}

TEST_CASE("text_corpus: errors say what was expected and what was found") {
  temp_dir dir;
  const auto missing = error_of<dml::io_error>([&] { (void)text_corpus::load(dir / "absent.txt"); });
  CHECK(missing.find("absent.txt") != std::string::npos);
  CHECK(missing.find("expected a regular file, found no such file") != std::string::npos);
  const auto folder = error_of<dml::io_error>([&] { (void)text_corpus::load(dir.path); });
  CHECK(folder.find("expected a regular file, found something else") != std::string::npos);

  write_file(dir / "one.txt", "x");
  const auto short_text = error_of<dml::invalid_argument>([&] { (void)text_corpus::load(dir / "one.txt"); });
  CHECK(short_text.find("one.txt") != std::string::npos);
  CHECK(short_text.find("expected a text of at least 2 bytes") != std::string::npos);
  CHECK(short_text.find("found 1") != std::string::npos);

  const text_corpus c(sample_bytes(100));
  std::vector<float> x(100);
  std::vector<std::int32_t> y(100);
  const auto too_long = error_of<dml::invalid_argument>([&] { c.batch(0, 1, 0, 1, 100, x.data(), y.data()); });
  CHECK(too_long.find("text_corpus::batch: expected 1 <= seq < 100") != std::string::npos);
  CHECK(too_long.find("found seq=100") != std::string::npos);
  const auto zero = error_of<dml::invalid_argument>([&] { c.batch(0, 1, 0, 1, 0, x.data(), y.data()); });
  CHECK(zero.find("found seq=0") != std::string::npos);
  const auto negative = error_of<dml::invalid_argument>([&] { c.batch(0, 1, -1, 1, 10, x.data(), y.data()); });
  CHECK(negative.find("expected first >= 0 and count >= 0, found first=-1 count=1") != std::string::npos);

  const auto fraction = error_of<dml::invalid_argument>([&] { (void)c.split(1.0); });
  CHECK(fraction.find("expected a validation fraction in (0, 1), found 1") != std::string::npos);
  const auto tail = error_of<dml::invalid_argument>([&] { (void)c.split(0.01); });
  CHECK(tail.find("expected both parts of at least 2 bytes, found 99 and 1 bytes") != std::string::npos);
}

TEST_CASE("text_corpus: the default text loads where Debian ships it") {
  if (!fs::exists(dml::train::default_text_path)) {
    dml_test::skip(std::string(dml::train::default_text_path) + " is not installed");
    return;
  }
  const auto c = text_corpus::load(dml::train::default_text_path);
  CHECK(c.size() == static_cast<std::int64_t>(fs::file_size(dml::train::default_text_path)));
  CHECK(c.size() > 10000);
  const std::string head(c.bytes().begin(), c.bytes().begin() + 80);
  CHECK(head.find("GNU GENERAL PUBLIC LICENSE") != std::string::npos);
  std::vector<float> x(4 * 64);
  std::vector<std::int32_t> y(x.size());
  c.batch(0, 1, 0, 4, 64, x.data(), y.data());
  CHECK(std::all_of(y.begin(), y.end(), [](std::int32_t t) { return t >= 0 && t < text_corpus::vocab; }));
}

}  // namespace test_text
