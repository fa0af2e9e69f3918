// SPDX-License-Identifier: Apache-2.0
// dml/train/safetensors.hpp — read and write safetensors files (checkpoints, initial weights).
// Sits on core/ (dtype, errors) and nlohmann-json; used by checkpoints and examples. See DESIGN.md §6.
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#if __has_include(<unistd.h>)
#  include <unistd.h>
#  define DML_SAFETENSORS_HAVE_FSYNC 1
#else
#  define DML_SAFETENSORS_HAVE_FSYNC 0
#endif

#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"

namespace dml::train {

static_assert(std::endian::native == std::endian::little,
              "dml::train::safetensors: the format stores little-endian data; big-endian hosts need byte swaps");

// One tensor of a file: where its bytes lie in the data section (offset from its start).
struct tensor_info {
  std::string name;
  dml::dtype dtype;
  std::vector<std::int64_t> shape;
  std::size_t offset;
  std::size_t bytes;
};

// A tensor to write: name, element type, shape and its bytes (numel x dtype_size of them).
struct tensor_ref {
  std::string name;
  dml::dtype dtype;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;
};

namespace detail {

inline std::string shape_text(std::span<const std::int64_t> s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += dml::detail::cat(i ? ", " : "", s[i]);
  return out + "]";
}

// numel x element size, or false when it does not fit in 64 bits (only a corrupt header does that).
inline bool checked_bytes(std::span<const std::int64_t> shape, std::size_t elem, std::uint64_t& out) {
  std::uint64_t n = elem;
  for (auto d : shape) {
    if (d < 0) return false;
    if (d != 0 && n > std::numeric_limits<std::uint64_t>::max() / static_cast<std::uint64_t>(d)) return false;
    n *= static_cast<std::uint64_t>(d);
  }
  out = n;
  return true;
}

inline std::string temp_suffix() {
  // Unique across processes (random seed) and threads (counter), so concurrent writers of the
  // same target never share a temporary file.
  static std::atomic<std::uint64_t> counter{0};
  static const std::uint64_t seed = [] {
    std::random_device rd;
    return (std::uint64_t(rd()) << 32) ^ rd() ^
           static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }();
  const std::uint64_t v = seed ^ (counter.fetch_add(1) * 0x9e3779b97f4a7c15ull);
  static constexpr char hex[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 0; i < 16; ++i) s[static_cast<std::size_t>(i)] = hex[(v >> (60 - 4 * i)) & 0xF];
  return s;
}

}  // namespace detail

// A safetensors file read whole into memory and validated: every tensor's bytes lie inside
// the data section, match its shape and dtype, and together cover the section exactly.
class safetensors_file {
 public:
  static safetensors_file open(const std::filesystem::path& path) {
    safetensors_file f;
    f.path_ = path;
    f.load();
    return f;
  }

  // The same from a file's contents in memory; `name` stands for the file in path() and errors.
  static safetensors_file from_bytes(std::vector<std::byte> bytes, std::string_view name) {
    safetensors_file f;
    f.path_ = std::filesystem::path(std::string(name));
    f.body_ = std::move(bytes);
    f.parse();
    return f;
  }

  const std::filesystem::path& path() const { return path_; }
  // The tensors in the order their bytes appear in the file.
  const std::vector<tensor_info>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  bool contains(std::string_view name) const { return index_.find(name) != index_.end(); }

  const tensor_info& at(std::string_view name) const {
    auto it = index_.find(name);
    if (it == index_.end()) {
      std::string names;
      for (const auto& t : tensors_) names += dml::detail::cat(names.empty() ? "" : ", ", t.name);
      fail<invalid_argument>(path_.string(), ": no tensor named '", name, "'; the file has ", tensors_.size(),
                             " tensors: ", names.empty() ? "(none)" : names);
    }
    return tensors_[it->second];
  }

  std::span<const std::byte> bytes(std::string_view name) const {
    const auto& t = at(name);
    return std::span<const std::byte>(body_).subspan(data_start_ + t.offset, t.bytes);
  }

  // Copies tensor `name` into `out` after checking that its dtype is T's and its shape is
  // expected_shape.
  template <class T>
  void read(std::string_view name, std::span<T> out, std::span<const std::int64_t> expected_shape) const {
    const auto& t = at(name);
    if (t.dtype != dml::dtype_v<T>)
      fail<format_error>(path_.string(), ": tensor '", name, "': expected dtype ", dml::dtype_name(dml::dtype_v<T>),
                         ", found ", dml::dtype_name(t.dtype));
    if (!std::ranges::equal(t.shape, expected_shape))
      fail<shape_error>(path_.string(), ": tensor '", name, "': expected shape ", detail::shape_text(expected_shape),
                        ", found ", detail::shape_text(t.shape));
    if (out.size_bytes() != t.bytes)
      fail<invalid_argument>(path_.string(), ": tensor '", name, "': output holds ", out.size(), " elements, expected ",
                             t.bytes / sizeof(T));
    if (t.bytes) std::memcpy(out.data(), body_.data() + data_start_ + t.offset, t.bytes);
  }
  template <class T>
  void read(std::string_view name, std::span<T> out, std::initializer_list<std::int64_t> expected_shape) const {
    read(name, out, std::span<const std::int64_t>(expected_shape.begin(), expected_shape.size()));
  }

 private:
  template <class... Args>
  [[noreturn]] void bad(const Args&... args) const {
    fail<format_error>(path_.string(), ": not a valid safetensors file: ", args...);
  }

  void load() {
    const std::string file = path_.string();
    std::ifstream in(path_, std::ios::binary);
    if (!in) fail<io_error>(file, ": cannot open for reading (expected an existing, readable safetensors file)");
    std::error_code ec;
    const auto size = std::filesystem::file_size(path_, ec);
    if (ec) fail<io_error>(file, ": cannot read its size: ", ec.message());
    body_.resize(static_cast<std::size_t>(size));
    in.read(reinterpret_cast<char*>(body_.data()), static_cast<std::streamsize>(body_.size()));
    if (static_cast<std::uintmax_t>(in.gcount()) != size)
      fail<io_error>(file, ": expected to read ", size, " bytes, read ", in.gcount());
    parse();
  }

  // Validates body_ (the whole file) and indexes its tensors.
  void parse() {
    if (body_.size() < 8) bad("expected at least 8 bytes (the header length), found ", body_.size());
    std::uint64_t header_len = 0;
    for (int i = 0; i < 8; ++i) header_len |= std::uint64_t(body_[static_cast<std::size_t>(i)]) << (8 * i);
    if (header_len > body_.size() - 8)
      bad("header length ", header_len, " exceeds the ", body_.size() - 8, " bytes that follow it");
    data_start_ = 8 + static_cast<std::size_t>(header_len);
    const std::size_t data_size = body_.size() - data_start_;

    const char* hb = reinterpret_cast<const char*>(body_.data() + 8);
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(hb, hb + header_len);
    } catch (const nlohmann::json::exception& e) {
      bad("expected a JSON header, found text that does not parse: ", e.what());
    }
    if (!header.is_object()) bad("expected a JSON object as header, found a JSON ", header.type_name());

    for (auto it = header.begin(); it != header.end(); ++it) {
      const std::string& key = it.key();
      const auto& v = it.value();
      if (key == "__metadata__") {
        if (!v.is_object()) bad("expected __metadata__ to be an object, found a JSON ", v.type_name());
        for (auto m = v.begin(); m != v.end(); ++m) {
          if (!m.value().is_string())
            bad("expected __metadata__ value '", m.key(), "' to be a string, found a JSON ", m.value().type_name());
          metadata_.emplace(m.key(), m.value().get<std::string>());
        }
        continue;
      }
      tensors_.push_back(parse_entry(key, v));
    }

    // The data section must be covered exactly: sorted by offset, each tensor begins where
    // the previous one ended. Zero-byte tensors sort first among equal offsets.
    std::ranges::sort(tensors_, [](const tensor_info& a, const tensor_info& b) {
      return std::tie(a.offset, a.bytes, a.name) < std::tie(b.offset, b.bytes, b.name);
    });
    std::size_t covered = 0;
    for (const auto& t : tensors_) {
      if (t.offset + t.bytes > data_size)
        bad("tensor '", t.name, "' occupies bytes [", t.offset, ", ", t.offset + t.bytes,
            ") of the data section, but the section has only ", data_size, " bytes (truncated file?)");
      if (t.offset < covered)
        bad("tensor '", t.name, "' starts at byte ", t.offset, ", overlapping the previous tensor, which ends at ",
            covered);
      if (t.offset > covered)
        bad("tensor '", t.name, "' starts at byte ", t.offset, ", expected ", covered,
            " (the data section must be contiguous, found a gap)");
      covered = t.offset + t.bytes;
    }
    if (covered != data_size)
      bad("the tensors cover ", covered, " bytes of the data section, expected all ", data_size,
          " bytes (trailing data)");
    for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  }

  tensor_info parse_entry(const std::string& name, const nlohmann::json& v) const {
    if (!v.is_object()) bad("tensor '", name, "': expected an object, found a JSON ", v.type_name());
    tensor_info t{name, dml::dtype::f32, {}, 0, 0};
    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string()) bad("tensor '", name, "': expected a string field 'dtype'");
    const auto dname = dt->get<std::string>();
    bool known = false;
    for (dml::dtype d : {dml::dtype::f32, dml::dtype::f64, dml::dtype::bf16, dml::dtype::f16, dml::dtype::i32,
                         dml::dtype::i64, dml::dtype::u8})
      if (dml::dtype_name(d) == dname) {
        t.dtype = d;
        known = true;
      }
    if (!known)
      bad("tensor '", name, "': unknown dtype '", dname, "', expected one of F32, F64, BF16, F16, I32, I64, U8");

    auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array()) bad("tensor '", name, "': expected an array field 'shape'");
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned() || d.get<std::uint64_t>() > std::uint64_t(std::numeric_limits<std::int64_t>::max()))
        bad("tensor '", name, "': expected non-negative integer dimensions in 'shape', found ", d.dump());
      t.shape.push_back(static_cast<std::int64_t>(d.get<std::uint64_t>()));
    }

    auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned())
      bad("tensor '", name, "': expected 'data_offsets' as [begin, end] non-negative integers, found ",
          off == v.end() ? std::string("nothing") : off->dump());
    const auto begin = (*off)[0].get<std::uint64_t>();
    const auto end = (*off)[1].get<std::uint64_t>();
    if (end < begin) bad("tensor '", name, "': data_offsets [", begin, ", ", end, "] end before they begin");
    std::uint64_t expected = 0;
    if (!detail::checked_bytes(t.shape, dml::dtype_size(t.dtype), expected))
      bad("tensor '", name, "': shape ", detail::shape_text(t.shape), " x ", dml::dtype_size(t.dtype),
          " bytes overflows 64 bits");
    if (end - begin != expected)
      bad("tensor '", name, "': data_offsets [", begin, ", ", end, "] span ", end - begin, " bytes, expected ",
          expected, " for shape ", detail::shape_text(t.shape), " of ", dml::dtype_name(t.dtype));
    t.offset = static_cast<std::size_t>(begin);
    t.bytes = static_cast<std::size_t>(expected);
    return t;
  }

  std::filesystem::path path_;
  std::vector<std::byte> body_;  // the whole file; tensors start at data_start_
  std::size_t data_start_ = 0;
  std::vector<tensor_info> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

// A tensor_ref over a typed span; checks that the shape's element count matches the span.
template <class T>
tensor_ref make_tensor_ref(std::string name, std::span<const T> data, std::vector<std::int64_t> shape) {
  std::uint64_t bytes = 0;
  if (!detail::checked_bytes(shape, sizeof(T), bytes) || bytes != data.size_bytes())
    fail<shape_error>("dml::train::make_tensor_ref: tensor '", name, "': shape ", detail::shape_text(shape),
                      " needs ", bytes / sizeof(T), " elements, found ", data.size());
  return tensor_ref{std::move(name), dml::dtype_v<T>, std::move(shape), std::as_bytes(data)};
}

// Writes the tensors, in the order given, to `path`. The bytes go to a temporary file beside
// it, which is flushed to disk and then renamed over the target: a crash leaves either the old
// file or the new one under that name, never a half-written one. `written`, if given, is called once the
// tensors' bytes are handed to the system (before the flush to disk): the caller may change them from then on.
inline void save_safetensors(const std::filesystem::path& path, std::span<const tensor_ref> tensors,
                             const std::map<std::string, std::string>& metadata = {},
                             const std::function<void()>& written = {}) {
  const std::string file = path.string();
  // ordered_json keeps the tensors in the caller's order, which is also their order in the data.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    auto& m = header["__metadata__"] = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
  }
  std::set<std::string_view> seen;
  std::size_t offset = 0;
  for (const auto& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__")
      fail<invalid_argument>(file, ": tensor name '", t.name, "' is reserved or empty; expected another name");
    if (!seen.insert(t.name).second)
      fail<invalid_argument>(file, ": tensor name '", t.name, "' appears twice; expected unique names");
    std::uint64_t expected = 0;
    if (!detail::checked_bytes(t.shape, dml::dtype_size(t.dtype), expected) || expected != t.data.size())
      fail<invalid_argument>(file, ": tensor '", t.name, "' has ", t.data.size(), " bytes, expected ", expected,
                             " for shape ", detail::shape_text(t.shape), " of ", dml::dtype_name(t.dtype));
    header[t.name] = {{"dtype", std::string(dml::dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string text = header.dump();
  // Padding keeps the data section 8-byte aligned in the file, so a mapped file can be read in place.
  text.append((8 - text.size() % 8) % 8, ' ');

  std::filesystem::path tmp = path;
  tmp += ".tmp-" + detail::temp_suffix();
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail<io_error>(file, ": cannot create temporary file ", tmp.string(), ": ", std::strerror(errno));
  bool ok = true;
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(std::uint64_t(text.size()) >> (8 * i));
  ok = ok && std::fwrite(len, 1, 8, f) == 8;
  ok = ok && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  for (const auto& t : tensors)
    ok = ok && (t.data.empty() || std::fwrite(t.data.data(), 1, t.data.size(), f) == t.data.size());
  ok = ok && std::fflush(f) == 0;
  if (written) written();
#if DML_SAFETENSORS_HAVE_FSYNC
  ok = ok && ::fsync(::fileno(f)) == 0;
#endif
  const int saved_errno = errno;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::error_code ignore;
    std::filesystem::remove(tmp, ignore);
    fail<io_error>(file, ": writing ", 8 + text.size() + offset, " bytes to ", tmp.string(),
                   " failed: ", std::strerror(saved_errno ? saved_errno : errno));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignore;
    std::filesystem::remove(tmp, ignore);
    fail<io_error>(file, ": cannot rename ", tmp.string(), " over it: ", ec.message());
  }
}

inline void save_safetensors(const std::filesystem::path& path, std::initializer_list<tensor_ref> tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  save_safetensors(path, std::span<const tensor_ref>(tensors.begin(), tensors.size()), metadata);
}

}  // namespace dml::train
