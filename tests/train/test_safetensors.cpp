// SPDX-License-Identifier: Apache-2.0
// tests/train/test_safetensors.cpp — safetensors round trips in C++ and through PyTorch, and
// a corrupt file of every kind the reader must reject (never crash on).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "dml/train/safetensors.hpp"
#include "support.hpp"

namespace test_safetensors {

namespace fs = std::filesystem;
namespace dt = dml::train;

namespace {

struct temp_dir : dml_test::temp_dir {
  temp_dir() : dml_test::temp_dir("dml-st") {}
};

std::vector<std::uint8_t> slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void spit(const fs::path& p, const std::vector<std::uint8_t>& bytes) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A file built by hand: length field (the header's by default), header text, data.
std::vector<std::uint8_t> raw_file(const std::string& header, std::size_t data_bytes, std::int64_t length = -1) {
  const std::uint64_t n = length < 0 ? header.size() : std::uint64_t(length);
  std::vector<std::uint8_t> out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(n >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  for (std::size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<std::uint8_t>(i * 37));
  return out;
}

using dml_test::error_of;

template <class T>
std::vector<T> read_all(const dt::safetensors_file& f, const std::string& name) {
  const auto& info = f.at(name);
  std::int64_t n = 1;
  for (auto d : info.shape) n *= d;
  std::vector<T> out(static_cast<std::size_t>(n));
  f.read(name, std::span<T>(out), std::span<const std::int64_t>(info.shape));
  return out;
}

bool same_bits(const std::vector<dml::bf16>& a, const std::vector<dml::bf16>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].bits != b[i].bits) return false;
  return true;
}

// The tensors written both by the C++ round trip and for the Python reader; the Python side
// recomputes these formulas on its own (tests/train/safetensors_roundtrip.py).
struct sample {
  std::vector<float> weight, bias{0.5f, -0.5f, 1.0f / 3.0f}, empty, scalar{42.0f};
  std::vector<double> d;
  std::vector<dml::fp16> h;
  std::vector<dml::bf16> bf;
  std::vector<std::int32_t> i32{-7, 0, 2147483647};
  std::vector<std::int64_t> i64{-(std::int64_t(1) << 40), 1, 2, std::int64_t(1) << 50};
  std::vector<std::uint8_t> u8{0, 50, 100, 150, 200};
  std::map<std::string, std::string> meta{{"step", "17"}, {"model", "mlp"}};

  sample() {
    for (int i = 0; i < 12; ++i) weight.push_back(float(i) * 0.25f - 1.0f);
    for (int i = 0; i < 6; ++i) d.push_back(double(i) / 7.0);
    const float sixteen[] = {-0.75f, -0.375f, 0.0f, 1.0f / 3.0f};
    for (float x : sixteen) h.emplace_back(x), bf.emplace_back(x);
    h.emplace_back(65504.0f);
    bf.emplace_back(std::ldexp(1.0f, 100));
  }
  std::vector<dt::tensor_ref> refs() const {
    return {dt::make_tensor_ref<float>("0.weight", weight, {3, 4}),
            dt::make_tensor_ref<float>("0.bias", bias, {3}),
            dt::make_tensor_ref<double>("d", d, {2, 3}),
            dt::make_tensor_ref<dml::fp16>("h", h, {5}),
            dt::make_tensor_ref<dml::bf16>("bf", bf, {5}),
            dt::make_tensor_ref<std::int32_t>("i32", i32, {3}),
            dt::make_tensor_ref<std::int64_t>("i64", i64, {2, 2}),
            dt::make_tensor_ref<std::uint8_t>("u8", u8, {5}),
            dt::make_tensor_ref<float>("empty", empty, {0, 3}),
            dt::make_tensor_ref<float>("scalar", scalar, {})};
  }
};

}  // namespace

TEST_CASE("safetensors round trip in C++: dtypes, empty and scalar tensors, metadata") {
  temp_dir dir;
  const sample s;
  const auto refs = s.refs();
  const auto path = dir / "model.safetensors";
  dt::save_safetensors(path, refs, s.meta);

  // The layout the format prescribes: 8-byte little-endian length, padded JSON, data in order.
  const auto raw = slurp(path);
  REQUIRE(raw.size() >= 8);
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= std::uint64_t(raw[std::size_t(i)]) << (8 * i);
  CHECK(n % 8 == 0);
  std::size_t data_bytes = 0;
  for (const auto& r : refs) data_bytes += r.data.size();
  CHECK(raw.size() == 8 + n + data_bytes);
  CHECK(raw[8] == '{');
  // Only the file itself is left behind: the temporary was renamed over it.
  CHECK(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator{}) == 1);

  const auto f = dt::safetensors_file::open(path);
  REQUIRE(f.tensors().size() == refs.size());
  std::size_t offset = 0;
  for (std::size_t i = 0; i < refs.size(); ++i) {
    const auto& t = f.tensors()[i];
    CAPTURE(refs[i].name);
    CHECK(t.name == refs[i].name);  // tensors() follows the data order, which is the order given
    CHECK(t.dtype == refs[i].dtype);
    CHECK(t.shape == refs[i].shape);
    CHECK(t.offset == offset);
    CHECK(t.bytes == refs[i].data.size());
    const auto b = f.bytes(t.name);
    CHECK(std::equal(b.begin(), b.end(), refs[i].data.begin(), refs[i].data.end()));
    offset += t.bytes;
  }
  CHECK(read_all<float>(f, "0.weight") == s.weight);
  CHECK(read_all<float>(f, "0.bias") == s.bias);
  CHECK(read_all<double>(f, "d") == s.d);
  const auto h = read_all<dml::fp16>(f, "h");
  REQUIRE(h.size() == s.h.size());
  for (std::size_t i = 0; i < h.size(); ++i) CHECK(h[i].bits == s.h[i].bits);
  CHECK(same_bits(read_all<dml::bf16>(f, "bf"), s.bf));
  CHECK(read_all<std::int32_t>(f, "i32") == s.i32);
  CHECK(read_all<std::int64_t>(f, "i64") == s.i64);
  CHECK(read_all<std::uint8_t>(f, "u8") == s.u8);
  CHECK(read_all<float>(f, "empty").empty());
  CHECK(f.at("scalar").shape.empty());
  CHECK(read_all<float>(f, "scalar") == s.scalar);
  CHECK(f.metadata() == s.meta);
  CHECK(f.contains("d"));
  CHECK_FALSE(f.contains("__metadata__"));
  CHECK_FALSE(f.contains("missing"));

  // Saving again replaces the file whole.
  const std::vector<float> other{1, 2};
  dt::save_safetensors(path, {dt::make_tensor_ref<float>("x", other, {2})});
  const auto g = dt::safetensors_file::open(path);
  REQUIRE(g.tensors().size() == 1);
  CHECK(read_all<float>(g, "x") == other);
  CHECK(g.metadata().empty());
}

TEST_CASE("safetensors with no tensors at all") {
  temp_dir dir;
  dt::save_safetensors(dir / "none", std::span<const dt::tensor_ref>{}, {{"k", "v"}});
  const auto f = dt::safetensors_file::open(dir / "none");
  CHECK(f.tensors().empty());
  CHECK(f.metadata().at("k") == "v");
}

TEST_CASE("safetensors read checks dtype and shape and lists the names it has") {
  temp_dir dir;
  const std::vector<float> w(6, 1.0f);
  const std::vector<std::int64_t> idx{1, 2};
  dt::save_safetensors(dir / "f", {dt::make_tensor_ref<float>("w", w, {2, 3}),
                                   dt::make_tensor_ref<std::int64_t>("idx", idx, {2})});
  const auto f = dt::safetensors_file::open(dir / "f");
  std::vector<double> dd(6);
  auto msg = error_of<dml::format_error>([&] { f.read<double>("w", dd, {2, 3}); });
  CHECK(msg.find("expected dtype F64, found F32") != std::string::npos);
  std::vector<float> ff(6);
  msg = error_of<dml::shape_error>([&] { f.read<float>("w", ff, {3, 2}); });
  CHECK(msg.find("expected shape [3, 2], found [2, 3]") != std::string::npos);
  std::vector<float> small(5);
  CHECK_THROWS_AS(f.read<float>("w", small, {2, 3}), dml::error);
  msg = error_of<dml::error>([&] { (void)f.at("bias"); });
  CHECK(msg.find("'bias'") != std::string::npos);
  CHECK(msg.find("w, idx") != std::string::npos);
}

TEST_CASE("safetensors writer rejects inconsistent tensors and leaves no file") {
  temp_dir dir;
  const std::vector<float> w(6);
  CHECK_THROWS_AS(dt::make_tensor_ref<float>("w", w, {4, 2}), dml::shape_error);
  const std::vector<std::byte> five(5);
  auto msg = error_of<dml::invalid_argument>(
      [&] { dt::save_safetensors(dir / "x", {dt::tensor_ref{"w", dml::dtype::f32, {2}, five}}); });
  CHECK(msg.find("has 5 bytes, expected 8") != std::string::npos);
  msg = error_of<dml::invalid_argument>([&] {
    dt::save_safetensors(dir / "x", {dt::make_tensor_ref<float>("w", w, {6}), dt::make_tensor_ref<float>("w", w, {6})});
  });
  CHECK(msg.find("twice") != std::string::npos);
  CHECK_THROWS_AS(dt::save_safetensors(dir / "x", {dt::make_tensor_ref<float>("__metadata__", w, {6})}),
                  dml::invalid_argument);
  CHECK(fs::is_empty(dir.path));
  CHECK_THROWS_AS(dt::save_safetensors(dir / "no-such-dir" / "x", {dt::make_tensor_ref<float>("w", w, {6})}),
                  dml::io_error);
}

TEST_CASE("safetensors reader rejects every kind of corrupt file") {
  temp_dir dir;
  const auto p = dir / "bad.safetensors";
  struct bad_case {
    const char* what;
    std::vector<std::uint8_t> bytes;
    std::vector<std::string> pieces;  // each must appear in the message
  };
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::vector<bad_case> cases{
      {"short file", {1, 2, 3}, {"at least 8 bytes", "found 3"}},
      {"header longer than file", raw_file("{}", 0, 1000), {"header length 1000", "2 bytes"}},
      {"not JSON", raw_file("{\"a\":", 0), {"does not parse"}},
      {"JSON but not an object", raw_file("[1,2]", 0), {"JSON object", "array"}},
      {"entry not an object", raw_file(R"({"a":3})", 0), {"'a'", "expected an object"}},
      {"unknown dtype", raw_file(R"({"a":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}})", 1),
       {"unknown dtype 'F8_E4M3'", "F32"}},
      {"missing dtype", raw_file(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4), {"'dtype'"}},
      {"negative dimension", raw_file(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
       {"non-negative", "-1"}},
      {"fractional dimension", raw_file(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4),
       {"non-negative"}},
      {"offsets do not match shape", raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
       {"span 8 bytes, expected 12", "[3]", "F32"}},
      {"offsets reversed", raw_file(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}})", 8), {"end before"}},
      {"offsets not a pair", raw_file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", 1),
       {"data_offsets"}},
      {"shape overflows",
       raw_file(R"({"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0),
       {"overflows"}},
      {"offsets outside data", raw_file("{" + ok_entry + "}", 4), {"only 4 bytes", "[0, 8)"}},
      {"overlap",
       raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                8),
       {"overlapping", "'b'"}},
      {"gap",
       raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                12),
       {"gap", "starts at byte 8, expected 4"}},
      {"data not starting at 0", raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
       {"expected 0"}},
      {"trailing data", raw_file("{" + ok_entry + "}", 12), {"cover 8 bytes", "12"}},
      {"metadata not an object", raw_file(R"({"__metadata__":[1]})", 0), {"__metadata__"}},
      {"metadata value not a string", raw_file(R"({"__metadata__":{"step":17}})", 0), {"'step'", "string"}},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    spit(p, c.bytes);
    const auto msg = error_of<dml::format_error>([&] { (void)dt::safetensors_file::open(p); });
    CHECK(msg.find(p.string()) != std::string::npos);
    for (const auto& piece : c.pieces) {
      CAPTURE(piece);
      CHECK(msg.find(piece) != std::string::npos);
    }
  }
  // The same entry, well formed, opens: the cases above fail for the reason they name.
  spit(p, raw_file("{" + ok_entry + "}", 8));
  CHECK(dt::safetensors_file::open(p).at("a").bytes == 8);
  CHECK_THROWS_AS(dt::safetensors_file::open(dir / "absent"), dml::io_error);
}

TEST_CASE("safetensors reader rejects a valid file cut at every length and survives corrupt bytes") {
  temp_dir dir;
  const sample s;
  const auto whole_path = dir / "whole";
  dt::save_safetensors(whole_path, s.refs(), s.meta);
  const auto whole = slurp(whole_path);
  const auto p = dir / "cut";
  for (std::size_t n = 0; n < whole.size(); ++n) {
    CAPTURE(n);
    spit(p, std::vector<std::uint8_t>(whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(n)));
    CHECK_THROWS_AS((void)dt::safetensors_file::open(p), dml::format_error);
  }
  // Random byte changes in the length field and header: each either opens or is a format_error,
  // and a file that opens still has every tensor inside its data section.
  std::mt19937 rng(12345);
  std::uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= std::uint64_t(whole[std::size_t(i)]) << (8 * i);
  int opened = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    auto bytes = whole;
    const int flips = 1 + int(rng() % 3);
    for (int k = 0; k < flips; ++k)
      bytes[rng() % (8 + header_len)] = static_cast<std::uint8_t>(rng() & 0xFF);
    spit(p, bytes);
    try {
      const auto f = dt::safetensors_file::open(p);
      ++opened;
      for (const auto& t : f.tensors()) CHECK(f.bytes(t.name).size() == t.bytes);
    } catch (const dml::format_error&) {
    }
  }
  MESSAGE(opened << " of 2000 corrupted files still parsed (e.g. a changed metadata value)");
}

TEST_CASE("safetensors round trip through Python and PyTorch") {
  temp_dir dir;
  const sample s;
  const auto from_dml = dir / "from_dml.safetensors";
  const auto from_py = dir / "from_python.safetensors";
  dt::save_safetensors(from_dml, s.refs(), s.meta);
  const std::string cmd = std::string(DML_TEST_PYTHON) + " " + DML_TEST_SOURCE_DIR +
                          "/safetensors_roundtrip.py '" + from_dml.string() + "' '" + from_py.string() + "'";
  INFO(cmd);
  REQUIRE(std::system(cmd.c_str()) == 0);

  const auto f = dt::safetensors_file::open(from_py);
  CHECK(f.metadata() == std::map<std::string, std::string>{{"format", "pt"}, {"writer", "python"}});
  CHECK(f.tensors().size() == 9);

  std::vector<float> w(15);
  f.read<float>("w", w, {5, 3});
  double max_abs_diff = 0;
  for (int i = 0; i < 15; ++i) max_abs_diff = std::max(max_abs_diff, std::abs(double(w[std::size_t(i)]) - std::sin(double(i))));
  MESSAGE("w = sin(i): max_abs_diff=" << max_abs_diff);
  CHECK(max_abs_diff < 1e-6);

  std::vector<double> b(7);
  f.read<double>("b", b, {7});
  for (int i = 0; i < 7; ++i) CHECK(b[std::size_t(i)] == double(i) / 3.0);

  std::vector<dml::fp16> h(5);
  f.read<dml::fp16>("h", h, {5});
  const float hw[] = {0.5f, -1.5f, 2.0f, 65504.0f};
  for (int i = 0; i < 4; ++i) CHECK(float(h[std::size_t(i)]) == hw[i]);
  CHECK(h[4].bits == dml::fp16(1e-3f).bits);  // torch and dml round 1e-3 to the same half

  std::vector<dml::bf16> bf(4);
  f.read<dml::bf16>("bf", bf, {4});
  CHECK(float(bf[0]) == 1.0f);
  CHECK(float(bf[1]) == -2.5f);
  CHECK(float(bf[2]) == 3.140625f);
  CHECK(bf[3].bits == dml::bf16(1e30f).bits);

  std::vector<std::int32_t> i(3);
  f.read<std::int32_t>("i", i, {3});
  CHECK(i == std::vector<std::int32_t>{1, -2, 3});
  std::vector<std::int64_t> l(4);
  f.read<std::int64_t>("l", l, {2, 2});
  CHECK(l == std::vector<std::int64_t>{0, -1, std::int64_t(1) << 40, -(std::int64_t(1) << 40)});
  std::vector<std::uint8_t> u(5);
  f.read<std::uint8_t>("u", u, {5});
  CHECK(u == std::vector<std::uint8_t>{0, 50, 100, 150, 200});
  std::vector<float> e;
  f.read<float>("e", e, {2, 0});
  // torch's transpose of [[0,1,2],[3,4,5]], stored row-major as the format requires.
  std::vector<float> t(6);
  f.read<float>("t", t, {3, 2});
  CHECK(t == std::vector<float>{0, 3, 1, 4, 2, 5});
}

TEST_CASE("safetensors_file::from_bytes reads a file's contents as open reads the file") {
  temp_dir dir;
  const std::vector<float> w{1, 2, 3, 4, 5, 6};
  dt::save_safetensors(dir / "f", {dt::make_tensor_ref<float>("w", w, {2, 3})}, {{"k", "v"}});
  std::ifstream in(dir / "f", std::ios::binary);
  const std::vector<char> text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> bytes(text.size());
  std::memcpy(bytes.data(), text.data(), text.size());
  const auto f = dt::safetensors_file::from_bytes(bytes, "in-memory");
  CHECK(f.path() == "in-memory");
  CHECK(f.metadata().at("k") == "v");
  std::vector<float> got(6);
  f.read<float>("w", got, {2, 3});
  CHECK(got == w);
  bytes.resize(bytes.size() - 1);
  const auto msg = error_of<dml::format_error>([&] { (void)dt::safetensors_file::from_bytes(bytes, "cut"); });
  CHECK(msg.find("cut: not a valid safetensors file") != std::string::npos);
}

}  // namespace test_safetensors
