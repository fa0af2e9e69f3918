// SPDX-License-Identifier: Apache-2.0
// tests/train/test_idx.cpp — IDX reader and MNIST loader (synthetic files, raw and gzip, and
// Debian's Fashion-MNIST when installed); the sampler's slices and gather.
#include <doctest/doctest.h>

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "dml/train/idx.hpp"
#include "dml/train/sampler.hpp"
#include "support.hpp"

namespace test_idx {

namespace fs = std::filesystem;

namespace {

struct temp_dir : dml_test::temp_dir {
  temp_dir() : dml_test::temp_dir("dml-idx") {}
};

std::vector<std::uint8_t> idx_bytes(std::uint8_t type, const std::vector<std::uint32_t>& dims,
                                    const std::vector<std::uint8_t>& data) {
  std::vector<std::uint8_t> out{0, 0, type, static_cast<std::uint8_t>(dims.size())};
  for (auto d : dims)
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<std::uint8_t>(d >> s));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

void write_raw(const fs::path& p, const std::vector<std::uint8_t>& bytes) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// mode "wb" starts a file, "ab" appends another gzip member to it.
void write_gz(const fs::path& p, const std::vector<std::uint8_t>& bytes, const char* mode = "wb") {
  gzFile f = gzopen(p.c_str(), mode);
  REQUIRE(f != nullptr);
  if (!bytes.empty()) REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == int(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

std::vector<std::uint8_t> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint8_t> v(n);
  for (auto& x : v) x = static_cast<std::uint8_t>(rng() & 0xFF);
  return v;
}

using dml_test::error_of;

}  // namespace

TEST_CASE("read_idx reads raw and gzip files") {
  temp_dir dir;
  const std::vector<std::uint32_t> dims{3, 2, 5};
  const auto data = random_bytes(30, 1);
  const auto bytes = idx_bytes(0x08, dims, data);
  write_raw(dir / "a-idx3-ubyte", bytes);
  write_gz(dir / "a-idx3-ubyte.gz", bytes);
  for (std::string name : {"a-idx3-ubyte", "a-idx3-ubyte.gz"}) {
    CAPTURE(name);
    auto a = dml::train::read_idx(dir / name);
    CHECK(a.dims == std::vector<std::int64_t>{3, 2, 5});
    CHECK(a.numel() == 30);
    CHECK(a.data == data);
  }
}

TEST_CASE("read_idx reads a gzip file of several members and a large payload") {
  temp_dir dir;
  // 300 KB spans several zlib output chunks; splitting it over two gzip members checks that
  // concatenated members (valid gzip) are read to the end.
  const auto data = random_bytes(300 * 1000, 2);
  const auto bytes = idx_bytes(0x08, {300, 1000}, data);
  const std::vector<std::uint8_t> first(bytes.begin(), bytes.begin() + 123457);
  const std::vector<std::uint8_t> second(bytes.begin() + 123457, bytes.end());
  write_gz(dir / "b.gz", first, "wb");
  write_gz(dir / "b.gz", second, "ab");
  auto a = dml::train::read_idx(dir / "b.gz");
  CHECK(a.dims == std::vector<std::int64_t>{300, 1000});
  CHECK(a.data == data);
}

TEST_CASE("read_idx rejects a wrong magic number") {
  temp_dir dir;
  auto bytes = idx_bytes(0x08, {4}, {1, 2, 3, 4});
  bytes[0] = 0x12;
  bytes[1] = 0x34;
  write_raw(dir / "bad", bytes);
  const auto msg = error_of<dml::format_error>([&] { dml::train::read_idx(dir / "bad"); });
  CHECK(msg.find("bad") != std::string::npos);
  CHECK(msg.find("wrong magic number") != std::string::npos);
  CHECK(msg.find("00 00") != std::string::npos);
  CHECK(msg.find("12 34") != std::string::npos);
}

TEST_CASE("read_idx rejects type codes other than unsigned byte") {
  temp_dir dir;
  write_gz(dir / "floats.gz", idx_bytes(0x0D, {2}, std::vector<std::uint8_t>(8, 0)));
  write_raw(dir / "odd", idx_bytes(0x42, {2}, {0, 0}));
  auto msg = error_of<dml::format_error>([&] { dml::train::read_idx(dir / "floats.gz"); });
  CHECK(msg.find("floats.gz") != std::string::npos);
  CHECK(msg.find("unsigned byte (0x08)") != std::string::npos);
  CHECK(msg.find("float (0x0D)") != std::string::npos);
  msg = error_of<dml::format_error>([&] { dml::train::read_idx(dir / "odd"); });
  CHECK(msg.find("unknown type code 0x42") != std::string::npos);
}

TEST_CASE("read_idx rejects truncated files") {
  temp_dir dir;
  const auto bytes = idx_bytes(0x08, {10, 28, 28}, random_bytes(7840, 3));
  const std::vector<std::uint8_t> cut(bytes.begin(), bytes.end() - 40);  // 7800 of 7840 data bytes
  write_raw(dir / "cut", cut);
  write_gz(dir / "cut.gz", cut);
  for (std::string name : {"cut", "cut.gz"}) {
    CAPTURE(name);
    const auto msg = error_of<dml::format_error>([&] { dml::train::read_idx(dir / name); });
    CHECK(msg.find(name) != std::string::npos);
    CHECK(msg.find("truncated") != std::string::npos);
    CHECK(msg.find("10 x 28 x 28") != std::string::npos);
    CHECK(msg.find("7840") != std::string::npos);
    CHECK(msg.find("7800") != std::string::npos);
  }
  // A header that promises more dimensions than the file holds.
  write_raw(dir / "short-header", {0, 0, 0x08, 3, 0, 0, 0, 1});
  auto msg = error_of<dml::format_error>([&] { dml::train::read_idx(dir / "short-header"); });
  CHECK(msg.find("truncated IDX header") != std::string::npos);
  // Dimensions whose product would overflow 64 bits are still just "truncated".
  write_raw(dir / "huge", idx_bytes(0x08, {0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF}, {1, 2, 3}));
  msg = error_of<dml::format_error>([&] { dml::train::read_idx(dir / "huge"); });
  CHECK(msg.find("truncated") != std::string::npos);
  // Extra bytes after the payload mean the dims do not describe the file.
  write_raw(dir / "long", idx_bytes(0x08, {3}, {1, 2, 3, 4}));
  msg = error_of<dml::format_error>([&] { dml::train::read_idx(dir / "long"); });
  CHECK(msg.find("trailing") != std::string::npos);
}

TEST_CASE("read_idx rejects a cut gzip stream at every length") {
  temp_dir dir;
  write_gz(dir / "whole.gz", idx_bytes(0x08, {50, 20}, random_bytes(1000, 4)));
  std::ifstream in(dir / "whole.gz", std::ios::binary);
  const std::vector<std::uint8_t> gz((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  REQUIRE(gz.size() > 20);
  for (std::size_t n = 2; n < gz.size(); ++n) {
    CAPTURE(n);
    write_raw(dir / "part.gz", std::vector<std::uint8_t>(gz.begin(), gz.begin() + static_cast<std::ptrdiff_t>(n)));
    CHECK_THROWS_AS(dml::train::read_idx(dir / "part.gz"), dml::format_error);
  }
}

TEST_CASE("read_idx names a missing file") {
  temp_dir dir;
  const auto msg = error_of<dml::io_error>([&] { dml::train::read_idx(dir / "nothing-here.gz"); });
  CHECK(msg.find("nothing-here.gz") != std::string::npos);
  CHECK(msg.find("no such file") != std::string::npos);
}

TEST_CASE("load_mnist scales pixels by 1/255 and pairs them with labels") {
  temp_dir dir;
  const std::uint32_t n = 7, rows = 3, cols = 4;
  const auto pixels = random_bytes(n * rows * cols, 5);
  std::vector<std::uint8_t> labels(n);
  for (std::uint32_t i = 0; i < n; ++i) labels[i] = static_cast<std::uint8_t>((i * 3) % 10);
  // One file raw and one compressed: both names are accepted.
  write_raw(dir / "train-images-idx3-ubyte", idx_bytes(0x08, {n, rows, cols}, pixels));
  write_gz(dir / "train-labels-idx1-ubyte.gz", idx_bytes(0x08, {n}, labels));
  write_gz(dir / "t10k-images-idx3-ubyte.gz", idx_bytes(0x08, {2, rows, cols}, random_bytes(24, 6)));
  write_raw(dir / "t10k-labels-idx1-ubyte", idx_bytes(0x08, {2}, {9, 0}));

  const auto train = dml::train::load_mnist(dir.path, dml::train::split::train);
  CHECK(train.size() == n);
  CHECK(train.features() == rows * cols);
  CHECK(train.images.shape() == dml::shape{n, rows * cols});
  for (std::size_t i = 0; i < pixels.size(); ++i) {
    const float want = float(pixels[i]) / 255.0f;
    if (train.images[i] != want) FAIL_CHECK("pixel " << i << ": " << train.images[i] << " != " << want);
  }
  REQUIRE(train.labels.size() == n);
  for (std::uint32_t i = 0; i < n; ++i) CHECK(train.labels[i] == int(labels[i]));

  const auto test = dml::train::load_mnist(dir.path, dml::train::split::test);
  CHECK(test.size() == 2);
  CHECK(test.labels == std::vector<std::int32_t>{9, 0});
}

TEST_CASE("load_mnist reports missing files and count mismatches") {
  temp_dir dir;
  auto msg = error_of<dml::io_error>([&] { dml::train::load_mnist(dir.path, dml::train::split::train); });
  CHECK(msg.find("train-images-idx3-ubyte.gz") != std::string::npos);
  CHECK(msg.find("train-images-idx3-ubyte") != std::string::npos);

  write_gz(dir / "t10k-images-idx3-ubyte.gz", idx_bytes(0x08, {5, 2, 2}, random_bytes(20, 7)));
  write_gz(dir / "t10k-labels-idx1-ubyte.gz", idx_bytes(0x08, {4}, {1, 2, 3, 4}));
  msg = error_of<dml::format_error>([&] { dml::train::load_mnist(dir.path, dml::train::split::test); });
  CHECK(msg.find("5 images") != std::string::npos);
  CHECK(msg.find("4 labels") != std::string::npos);
  CHECK(msg.find("t10k-labels-idx1-ubyte.gz") != std::string::npos);

  // Images stored as a 2-D array are not MNIST images.
  write_gz(dir / "t10k-images-idx3-ubyte.gz", idx_bytes(0x08, {4, 4}, random_bytes(16, 8)));
  msg = error_of<dml::format_error>([&] { dml::train::load_mnist(dir.path, dml::train::split::test); });
  CHECK(msg.find("expected 3 dimensions") != std::string::npos);
}

TEST_CASE("Fashion-MNIST from Debian loads with the published sizes and balanced classes") {
  const fs::path dir = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(dir / "train-images-idx3-ubyte.gz")) {
    dml_test::skip(dir.string() + " is not installed (Debian package dataset-fashion-mnist)");
    return;
  }
  struct expect {
    dml::train::split split;
    std::int64_t size;
  };
  for (auto [split, size] : {expect{dml::train::split::train, 60000}, expect{dml::train::split::test, 10000}}) {
    CAPTURE(size);
    const auto ds = dml::train::load_mnist(dir, split);
    CHECK(ds.size() == size);
    CHECK(ds.features() == 784);
    REQUIRE(ds.labels.size() == std::size_t(size));
    float lo = 1e9f, hi = -1e9f;
    double sum = 0;
    const float* p = ds.images.data();
    for (std::int64_t i = 0; i < ds.images.numel(); ++i) {
      lo = std::min(lo, p[i]);
      hi = std::max(hi, p[i]);
      sum += p[i];
    }
    CHECK(lo == 0.0f);
    CHECK(hi == 1.0f);
    // Every pixel is k/255 for an integer k.
    for (std::int64_t i = 0; i < ds.images.numel(); i += 997) {
      const float k = std::round(p[i] * 255.0f);
      if (p[i] != k / 255.0f) FAIL_CHECK("pixel " << i << " = " << p[i] << " is not k/255");
    }
    const double mean = sum / double(ds.images.numel());
    MESSAGE("mean pixel " << mean);
    CHECK(mean > 0.2);  // Fashion-MNIST's mean is about 0.286; an all-zero decode would be 0
    CHECK(mean < 0.4);
    std::array<std::int64_t, 10> hist{};
    for (auto l : ds.labels) {
      REQUIRE(l >= 0);
      REQUIRE(l < 10);
      ++hist[std::size_t(l)];
    }
    for (int c = 0; c < 10; ++c) {
      CAPTURE(c);
      CHECK(hist[std::size_t(c)] == size / 10);
    }
  }
}

TEST_CASE("read_idx reads bytes in memory as it reads a file") {
  temp_dir dir;
  const auto data = random_bytes(30, 7);
  const auto bytes = idx_bytes(0x08, {3, 2, 5}, data);
  write_gz(dir / "a.gz", bytes);
  std::ifstream in(dir / "a.gz", std::ios::binary);
  const std::vector<std::uint8_t> gz((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const auto* b : {&bytes, &gz}) {
    const auto a = dml::train::read_idx(*b, "in-memory");
    CHECK(a.dims == std::vector<std::int64_t>{3, 2, 5});
    CHECK(a.data == data);
  }
  const auto msg = error_of<dml::format_error>([&] {
    dml::train::read_idx(std::vector<std::uint8_t>(gz.begin(), gz.end() - 5), "cut-in-memory");
  });
  CHECK(msg.find("cut-in-memory") != std::string::npos);
}

TEST_CASE("read_idx rejects a zero dimension beside dimensions that multiply past 2^63") {
  // Found by fuzzing: the array was accepted as empty, and numel() then overflowed.
  const auto msg = error_of<dml::format_error>([&] {
    dml::train::read_idx(idx_bytes(0x08, {0xFFFFFFFF, 0xFFFFFFFF, 0}, {}), "zero");
  });
  CHECK(msg.find("4294967295 x 4294967295 x 0") != std::string::npos);
  CHECK(msg.find("2^63") != std::string::npos);
  const auto a = dml::train::read_idx(idx_bytes(0x08, {0x7FFFFFFF, 0, 4}, {}), "fits");
  CHECK(a.numel() == 0);
}

TEST_CASE("sampler: rank slices cover each global batch once, and gather copies those rows") {
  constexpr std::int64_t n = 37, width = 3, batch = 8;
  std::vector<float> x(n * width);
  std::vector<std::int32_t> y(n);
  for (std::int64_t i = 0; i < n; ++i) {
    y[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i);
    for (std::int64_t j = 0; j < width; ++j) x[static_cast<std::size_t>(i * width + j)] = float(i * 10 + j);
  }
  const dml::train::sampler s(n, batch, 3);
  CHECK(s.batches_per_epoch() == 5);  // the short last batch is kept
  for (int ranks : {1, 2, 3}) {
    std::vector<int> seen(n, 0);
    for (std::int64_t step = 0; step < s.batches_per_epoch(); ++step) {
      std::int64_t rows_in_batch = 0;
      for (int r = 0; r < ranks; ++r) {
        std::vector<float> xb;
        std::vector<std::int32_t> yb;
        const std::int64_t rows = s.gather(step, r, ranks, x.data(), width, y.data(), xb, yb);
        REQUIRE(static_cast<std::int64_t>(yb.size()) == rows);
        REQUIRE(static_cast<std::int64_t>(xb.size()) == rows * width);
        rows_in_batch += rows;
        for (std::int64_t i = 0; i < rows; ++i) {
          const std::int32_t id = yb[static_cast<std::size_t>(i)];
          ++seen[static_cast<std::size_t>(id)];
          for (std::int64_t j = 0; j < width; ++j) CHECK(xb[static_cast<std::size_t>(i * width + j)] == float(id * 10 + j));
        }
      }
      CHECK(rows_in_batch == std::min<std::int64_t>(batch, n - step * batch));
    }
    CHECK(std::ranges::all_of(seen, [](int c) { return c == 1; }));  // one epoch: every sample once
  }
  // The order is a function of (seed, epoch) alone: step 5 starts epoch 1, in another order.
  CHECK(s.order(0) != s.order(1));
  CHECK(s.order(1) == dml::train::sampler(n, batch, 3).order(1));
}

}  // namespace test_idx
