// SPDX-License-Identifier: Apache-2.0
// dml/train/text.hpp — a text file as byte tokens (vocabulary 256) and its windows for language-model training.
// Sits on core/rng.hpp and core/error.hpp; a window depends on (seed, step, global index) only, never on the ranks.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "dml/core/error.hpp"
#include "dml/core/rng.hpp"

namespace dml::train {

// The default text when none is given: the GNU GPL version 3 that Debian's base-files package ships
// (present on every Debian system). On Debian 12 (base-files 12.4+deb12u11) it is 35,149 bytes of
// ASCII in 674 lines.
inline constexpr const char* default_text_path = "/usr/share/common-licenses/GPL-3";

namespace detail {

inline std::vector<std::uint8_t> read_text_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    fail<io_error>("dml::train::text_corpus: ", path.string(), ": expected a regular file, found ",
                   std::filesystem::exists(path, ec) ? "something else" : "no such file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail<io_error>("dml::train::text_corpus: ", path.string(), ": cannot open for reading");
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) fail<io_error>("dml::train::text_corpus: ", path.string(), ": cannot read its size: ", ec.message());
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(size));
  in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (static_cast<std::uintmax_t>(in.gcount()) != size)
    fail<io_error>("dml::train::text_corpus: ", path.string(), ": expected ", size, " bytes, read ", in.gcount());
  return bytes;
}

}  // namespace detail

// A text as byte tokens: token t is byte t of the file, so the vocabulary is 256 and nothing needs a
// tokenizer. A training window of `seq` tokens starts anywhere in the text; its targets are the same
// window shifted by one byte.
class text_corpus {
 public:
  static constexpr std::int64_t vocab = 256;

  // The file's bytes as they are (no decoding, no newline translation).
  static text_corpus load(const std::filesystem::path& file) {
    auto bytes = detail::read_text_file(file);
    if (bytes.size() < 2)
      fail<invalid_argument>("dml::train::text_corpus: ", file.string(),
                             ": expected a text of at least 2 bytes (one input and its next token), found ",
                             bytes.size());
    return text_corpus(std::move(bytes));
  }

  explicit text_corpus(std::vector<std::uint8_t> bytes) : bytes_(std::move(bytes)) {
    if (bytes_.size() < 2)
      fail<invalid_argument>(
          "dml::train::text_corpus: expected a text of at least 2 bytes (one input and its next token), found ",
          bytes_.size());
  }

  std::int64_t size() const { return static_cast<std::int64_t>(bytes_.size()); }
  std::span<const std::uint8_t> bytes() const { return bytes_; }

  // The start of sequence `index` of the global batch of step `step`: uniform over [0, size()-seq-1],
  // so that the window and its next tokens fit. Philox block `index` of stream (seed, 2^62 + step) gives
  // 64 bits (streams below 2^62 are parameters' initial values, which the same seed draws); their
  // remainder's bias is below n/2^64, nothing next to sampling noise.
  std::int64_t position(std::uint64_t seed, std::uint64_t step, std::int64_t index, std::int64_t seq) const {
    check_seq(seq, "position");
    const std::uint64_t n = static_cast<std::uint64_t>(size() - seq);
    const auto w = rng_stream{seed, (std::uint64_t{1} << 62) + step}.block(static_cast<std::uint64_t>(index));
    const std::uint64_t r = (std::uint64_t(w[0]) << 32) | w[1];
    return static_cast<std::int64_t>(r % n);
  }

  // Sequences [first, first+count) of the global batch of step `step` (counted from 1): sequence i
  // starts at position(seed, step, i, seq), so any split of the global batch across ranks reads
  // exactly the windows one rank would. x: count*seq floats (token ids as floats, the network's
  // input); y: count*seq int32 next tokens.
  void batch(std::uint64_t seed, std::uint64_t step, std::int64_t first, std::int64_t count, std::int64_t seq,
             float* x, std::int32_t* y) const {
    check_seq(seq, "batch");
    if (first < 0 || count < 0)
      fail<invalid_argument>("dml::train::text_corpus::batch: expected first >= 0 and count >= 0, found first=",
                             first, " count=", count);
    for (std::int64_t i = 0; i < count; ++i) {
      const std::int64_t p = position(seed, step, first + i, seq);
      const std::uint8_t* src = bytes_.data() + p;
      float* xi = x + i * seq;
      std::int32_t* yi = y + i * seq;
      for (std::int64_t j = 0; j < seq; ++j) {
        xi[j] = static_cast<float>(src[j]);
        yi[j] = static_cast<std::int32_t>(src[j + 1]);
      }
    }
  }

  // A held-out tail: {train, validation} cut at size()*(1-fraction). Both parts must keep at least 2
  // bytes; windows never cross the cut, so no validation byte is trained on.
  std::pair<text_corpus, text_corpus> split(double fraction) const {
    if (!(fraction > 0.0 && fraction < 1.0))
      fail<invalid_argument>("dml::train::text_corpus::split: expected a validation fraction in (0, 1), found ",
                             fraction);
    const auto cut = static_cast<std::int64_t>(static_cast<double>(size()) * (1.0 - fraction));
    if (cut < 2 || size() - cut < 2)
      fail<invalid_argument>("dml::train::text_corpus::split: expected both parts of at least 2 bytes, found ", cut,
                             " and ", size() - cut, " bytes (fraction ", fraction, " of ", size(), ")");
    const auto mid = bytes_.begin() + static_cast<std::ptrdiff_t>(cut);
    return {text_corpus(std::vector<std::uint8_t>(bytes_.begin(), mid)),
            text_corpus(std::vector<std::uint8_t>(mid, bytes_.end()))};
  }

 private:
  void check_seq(std::int64_t seq, const char* what) const {
    if (seq < 1 || seq >= size())
      fail<invalid_argument>("dml::train::text_corpus::", what, ": expected 1 <= seq < ", size(),
                             " (the text's size, so that a window and its next tokens fit), found seq=", seq);
  }

  std::vector<std::uint8_t> bytes_;
};

}  // namespace dml::train
