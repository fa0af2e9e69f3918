// SPDX-License-Identifier: Apache-2.0
// dml/train/idx.hpp — reader of IDX files (MNIST, Fashion-MNIST), raw or gzip-compressed.
// Sits on core/ (tensor, errors) and zlib; the trainer's data sets. See DESIGN.md §6.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dml/core/error.hpp"
#include "dml/core/tensor.hpp"

namespace dml::train {

// An IDX file of unsigned bytes: its dimensions (outermost first) and its payload, row-major.
struct idx_array {
  std::vector<std::int64_t> dims;
  std::vector<std::uint8_t> data;

  // read_idx guarantees that the non-zero dimensions multiply to less than 2^63.
  std::int64_t numel() const {
    if (std::find(dims.begin(), dims.end(), 0) != dims.end()) return 0;
    std::int64_t n = 1;
    for (auto d : dims) n *= d;
    return n;
  }
};

namespace detail {

inline std::string hex2(unsigned byte) {
  static constexpr char hex[] = "0123456789ABCDEF";
  return {hex[(byte >> 4) & 0xF], hex[byte & 0xF]};
}

inline std::string idx_type_name(unsigned code) {
  switch (code) {
    case 0x08: return "unsigned byte (0x08)";
    case 0x09: return "signed byte (0x09)";
    case 0x0B: return "short (0x0B)";
    case 0x0C: return "int (0x0C)";
    case 0x0D: return "float (0x0D)";
    case 0x0E: return "double (0x0E)";
    default: return "unknown type code 0x" + hex2(code);
  }
}

inline std::vector<std::uint8_t> read_all_bytes(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    fail<io_error>(path.string(), ": expected a regular file, found ",
                   std::filesystem::exists(path, ec) ? "something else" : "no such file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail<io_error>(path.string(), ": cannot open for reading");
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) fail<io_error>(path.string(), ": cannot read its size: ", ec.message());
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(size));
  in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (static_cast<std::uintmax_t>(in.gcount()) != size)
    fail<io_error>(path.string(), ": expected ", size, " bytes, read ", in.gcount());
  return bytes;
}

// Inflates every gzip member in `in` (gzip allows concatenated members). The trailer's ISIZE
// (length mod 2^32) sizes the first allocation, so the common case never reallocates; the
// reserved tail is handed to zlib 4 MiB at a time, so only bytes that get written are touched.
inline std::vector<std::uint8_t> gunzip(std::span<const std::uint8_t> in, const std::string& file) {
  std::vector<std::uint8_t> out;
  if (in.size() >= 18) {
    std::uint32_t isize = 0;
    for (int i = 0; i < 4; ++i) isize |= std::uint32_t(in[in.size() - 4 + i]) << (8 * i);
    // A corrupt trailer must not make us reserve gigabytes: deflate expands at most ~1032:1.
    out.reserve(std::min<std::uint64_t>(isize, std::uint64_t(in.size()) * 1032));
  }
  z_stream zs{};
  // 16 + MAX_WBITS: expect a gzip wrapper, not a zlib one.
  if (inflateInit2(&zs, 16 + MAX_WBITS) != Z_OK) fail<io_error>(file, ": zlib inflateInit2 failed");
  std::size_t in_pos = 0;
  int rc = Z_OK;
  std::array<std::uint8_t, 1 << 16> chunk{};
  while (true) {
    // zlib's counters are 32-bit; feed the input in slices it can count.
    const std::size_t avail = std::min<std::size_t>(in.size() - in_pos, std::numeric_limits<uInt>::max());
    zs.next_in = const_cast<Bytef*>(in.data() + in_pos);
    zs.avail_in = static_cast<uInt>(avail);
    const bool have_room = out.capacity() > out.size();
    std::size_t old = out.size();
    if (have_room) {
      const std::size_t room = std::min<std::size_t>(out.capacity() - old, std::size_t(1) << 22);
      out.resize(old + room);
      zs.next_out = out.data() + old;
      zs.avail_out = static_cast<uInt>(room);
    } else {
      zs.next_out = chunk.data();
      zs.avail_out = static_cast<uInt>(chunk.size());
    }
    const std::size_t room_given = have_room ? out.size() - old : chunk.size();
    rc = inflate(&zs, Z_NO_FLUSH);
    const std::size_t consumed = avail - zs.avail_in;
    const std::size_t produced = room_given - zs.avail_out;
    in_pos += consumed;
    if (have_room) {
      out.resize(old + produced);
    } else {
      out.insert(out.end(), chunk.data(), chunk.data() + produced);
    }
    if (rc == Z_STREAM_END) {
      if (in_pos == in.size()) break;
      inflateReset(&zs);  // another gzip member follows
      continue;
    }
    if (rc == Z_BUF_ERROR && (in_pos == in.size() || (consumed == 0 && produced == 0))) {
      inflateEnd(&zs);
      fail<format_error>(file, ": gzip stream ends early (truncated file): expected more compressed data after ",
                         in.size(), " bytes");
    }
    if (rc != Z_OK && rc != Z_BUF_ERROR) {
      const std::string msg = zs.msg ? zs.msg : "unknown zlib error";
      inflateEnd(&zs);
      fail<format_error>(file, ": corrupt gzip data: ", msg);
    }
  }
  inflateEnd(&zs);
  return out;
}

inline bool is_gzip(std::span<const std::uint8_t> bytes) {
  return bytes.size() >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b;
}

// The file's bytes, inflated when the gzip magic (1f 8b) opens it.
inline std::vector<std::uint8_t> read_maybe_gzip(const std::filesystem::path& path) {
  auto bytes = read_all_bytes(path);
  if (is_gzip(bytes)) return gunzip(bytes, path.string());
  return bytes;
}

inline std::uint32_t load_be32(const std::uint8_t* p) {
  return (std::uint32_t(p[0]) << 24) | (std::uint32_t(p[1]) << 16) | (std::uint32_t(p[2]) << 8) | std::uint32_t(p[3]);
}

}  // namespace detail

namespace detail {

// Parses the (inflated) bytes of an IDX file; `file` names them in errors.
inline idx_array parse_idx(std::vector<std::uint8_t> bytes, const std::string& file) {
  if (bytes.size() < 4)
    fail<format_error>(file, ": IDX header is 4 bytes of magic number, found a file of ", bytes.size(), " bytes");
  if (bytes[0] != 0 || bytes[1] != 0)
    fail<format_error>(file, ": wrong magic number: expected an IDX file starting with bytes 00 00, found ",
                       detail::hex2(bytes[0]), " ", detail::hex2(bytes[1]));
  const unsigned type = bytes[2];
  if (type != 0x08)
    fail<format_error>(file, ": expected IDX type unsigned byte (0x08), found ", detail::idx_type_name(type));
  const std::size_t ndims = bytes[3];
  if (ndims == 0) fail<format_error>(file, ": expected at least one IDX dimension, found 0");
  const std::size_t header = 4 + 4 * ndims;
  if (bytes.size() < header)
    fail<format_error>(file, ": truncated IDX header: expected ", header, " bytes for ", ndims, " dimensions, found ",
                       bytes.size());
  idx_array out;
  out.dims.resize(ndims);
  // Up to 255 dimensions of 32 bits each: a corrupt header's product can overflow 64 bits. The
  // product of the non-zero dimensions must fit in int64 even when a zero dimension empties the
  // array, so that numel() and a caller's products of dimensions (rows x cols) cannot overflow.
  constexpr std::uint64_t max_numel = std::numeric_limits<std::int64_t>::max();
  std::uint64_t numel = 1;  // of the non-zero dimensions
  const std::uint64_t payload = bytes.size() - header;
  bool exceeds = false, zero = false;
  for (std::size_t i = 0; i < ndims; ++i) {
    const std::uint32_t d = detail::load_be32(bytes.data() + 4 + 4 * i);
    out.dims[i] = d;
    zero = zero || d == 0;
    if (d != 0 && !exceeds && numel > max_numel / d) exceeds = true;
    if (d != 0 && !exceeds) numel *= d;
  }
  auto dims_text = [&] {
    std::string s;
    for (std::size_t i = 0; i < ndims; ++i) s += dml::detail::cat(i ? " x " : "", out.dims[i]);
    return s;
  };
  if (zero && exceeds)
    fail<format_error>(file, ": IDX dimensions ", dims_text(),
                       ": expected the non-zero dimensions to multiply to less than 2^63, found more");
  if (zero) numel = 0;  // a zero dimension empties the array whatever the others are
  if (exceeds || numel > payload)
    fail<format_error>(file, ": truncated IDX data: dimensions ", dims_text(), " promise ",
                       exceeds ? std::string("2^63 or more") : dml::detail::cat(numel), " bytes, found ", payload);
  if (numel < payload)
    fail<format_error>(file, ": expected ", numel, " bytes of IDX data for dimensions ", dims_text(), ", found ",
                       payload, " (trailing bytes)");
  // Shift the payload to the front instead of copying it into a second buffer.
  bytes.erase(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(header));
  out.data = std::move(bytes);
  return out;
}

}  // namespace detail

// Reads an IDX file of unsigned bytes (type code 0x08), gzip-compressed or raw.
inline idx_array read_idx(const std::filesystem::path& path) {
  return detail::parse_idx(detail::read_maybe_gzip(path), path.string());
}

// The same from bytes in memory (an IDX file's contents, gzip-compressed or raw); `name` stands
// for the file in error messages.
inline idx_array read_idx(std::span<const std::uint8_t> bytes, std::string_view name) {
  const std::string file(name);
  if (detail::is_gzip(bytes)) return detail::parse_idx(detail::gunzip(bytes, file), file);
  return detail::parse_idx(std::vector<std::uint8_t>(bytes.begin(), bytes.end()), file);
}

enum class split { train, test };

// Images flattened to [N, rows*cols] floats x/255 (what torchvision's ToTensor gives), and labels.
struct dataset {
  dml::tensor<float> images;
  std::vector<std::int32_t> labels;

  std::int64_t size() const { return images.shape().rank ? images.shape()[0] : 0; }
  std::int64_t features() const { return images.shape().rank > 1 ? images.shape()[1] : 0; }
};

namespace detail {

// "<prefix>-<kind>-idx<n>-ubyte" with or without ".gz".
inline std::filesystem::path find_idx_file(const std::filesystem::path& dir, const std::string& stem) {
  const std::filesystem::path candidates[] = {dir / (stem + ".gz"), dir / stem};
  std::error_code ec;
  for (const auto& c : candidates)
    if (std::filesystem::is_regular_file(c, ec)) return c;
  fail<io_error>("dml::train::load_mnist: expected ", candidates[0].string(), " or ", candidates[1].string(),
                 ", found neither");
}

}  // namespace detail

// Loads an MNIST-style data set (MNIST, Fashion-MNIST, KMNIST) from dir: the files
// train-{images-idx3,labels-idx1}-ubyte[.gz] or t10k-... for the test split.
inline dataset load_mnist(const std::filesystem::path& dir, split s) {
  const std::string prefix = s == split::train ? "train" : "t10k";
  const auto images_path = detail::find_idx_file(dir, prefix + "-images-idx3-ubyte");
  const auto labels_path = detail::find_idx_file(dir, prefix + "-labels-idx1-ubyte");
  idx_array images = read_idx(images_path);
  idx_array labels = read_idx(labels_path);
  if (images.dims.size() != 3)
    fail<format_error>(images_path.string(), ": expected 3 dimensions [count, rows, cols], found ", images.dims.size());
  if (labels.dims.size() != 1)
    fail<format_error>(labels_path.string(), ": expected 1 dimension [count], found ", labels.dims.size());
  if (images.dims[0] != labels.dims[0])
    fail<format_error>("dml::train::load_mnist: ", images_path.string(), " has ", images.dims[0], " images but ",
                       labels_path.string(), " has ", labels.dims[0], " labels; expected equal counts");

  dataset out;
  const std::int64_t n = images.dims[0];
  const std::int64_t features = images.dims[1] * images.dims[2];
  out.images.resize(dml::shape{n, features});
  // x / 255 in float, exactly as ToTensor divides; a table makes it one load per pixel.
  std::array<float, 256> scale{};
  for (int i = 0; i < 256; ++i) scale[static_cast<std::size_t>(i)] = static_cast<float>(i) / 255.0f;
  float* dst = out.images.data();
  const std::uint8_t* src = images.data.data();
  const std::size_t total = images.data.size();
  for (std::size_t i = 0; i < total; ++i) dst[i] = scale[src[i]];
  out.labels.assign(labels.data.begin(), labels.data.end());
  return out;
}

}  // namespace dml::train
