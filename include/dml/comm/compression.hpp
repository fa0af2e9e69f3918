// SPDX-License-Identifier: Apache-2.0
// dml/comm/compression.hpp — compression filters with error feedback: dense, threshold, top-k and 1-bit messages.
// Sits on comm/filter.hpp (the concept) and comm/detail/filter_wire.hpp; ps/ encodes what it pushes and pulls with
// them. See DESIGN.md §2 and §4.
#pragma once

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "dml/comm/detail/filter_wire.hpp"
#include "dml/comm/filter.hpp"
#include "dml/core/config.hpp"
#include "dml/core/error.hpp"

namespace dml::comm {

// ---------------------------------------------------------------------------------------------
// none: every entry, 4 bytes each; the accumulator ends all zeros.
struct no_filter {
  static constexpr filter_kind kind = filter_kind::none;

  std::string name() const { return "none"; }

  void encode(std::span<float> acc, std::vector<std::byte>& out) const {
    encode_copy(acc, out);
    std::fill(acc.begin(), acc.end(), 0.f);
  }
  // The same message, from values that need no accumulator: a dense filter sends everything, so a
  // sender that keeps no residual (the parameter server's workers) copies once instead of three times.
  static void encode_copy(std::span<const float> values, std::vector<std::byte>& out) {
    const std::uint32_t n = detail::message_length(values.size(), "dml::comm::no_filter::encode");
    detail::append_message(out, kind, n, n, 0);
    const auto* p = reinterpret_cast<const std::byte*>(values.data());
    out.insert(out.end(), p, p + 4 * std::size_t{n});  // into kept capacity, without zero-filling it first
  }

  // The n values of a message where they lie (4 bytes each, at any address), checked as decode checks them.
  static std::span<const std::byte> values(std::span<const std::byte> in, std::size_t n) {
    constexpr const char* where = "dml::comm::no_filter::decode";
    const detail::message_header h = detail::read_header(in, kind, n, where);
    if (h.count != h.n)
      fail<invalid_argument>(where, ": expected a count equal to the length ", h.n, ", found ", h.count);
    detail::check_fits(in, message_header_bytes + 4 * std::uint64_t{h.n}, "header + 4 per entry", where);
    return in.subspan(message_header_bytes, 4 * std::size_t{h.n});
  }

  static std::size_t decode(std::span<const std::byte> in, std::span<float> dst) {
    const auto v = values(in, dst.size());
    const std::byte* p = v.data();
    float* d = dst.data();
    DML_SIMD
    for (std::size_t i = 0; i < dst.size(); ++i) d[i] += detail::wire_get<float>(p + 4 * i);
    return message_header_bytes + v.size();
  }
};

// ---------------------------------------------------------------------------------------------
// significant: the entries with |acc_i| > threshold (Strom 2015), as (index, value) pairs. A NaN is
// always sent: a diverging run then shows at the receiver instead of hiding in the residual.
struct significant_filter {
  static constexpr filter_kind kind = filter_kind::significant;
  float threshold = 0.f;

  std::string name() const { return "significant:" + detail::shortest(threshold); }

  void encode(std::span<float> acc, std::vector<std::byte>& out) const {
    check();
    const std::uint32_t n = detail::message_length(acc.size(), "dml::comm::significant_filter::encode");
    float* a = acc.data();
    const float t = threshold;
    // Count first, so the message is sized once and the pairs are written in one pass.
    std::size_t count = 0;
    DML_SIMD_SUM(count)
    for (std::size_t i = 0; i < n; ++i) count += !(std::abs(a[i]) <= t);
    std::byte* p = detail::append_message(out, kind, n, static_cast<std::uint32_t>(count), 8 * count);
    for (std::uint32_t i = 0; i < n; ++i) {
      if (std::abs(a[i]) <= t) continue;
      detail::wire_put(p, i);
      detail::wire_put(p + 4, a[i]);
      a[i] = 0.f;
      p += 8;
    }
  }

  static std::size_t decode(std::span<const std::byte> in, std::span<float> dst) {
    return detail::decode_pairs(in, dst, kind, "dml::comm::significant_filter::decode");
  }

  void check() const {
    if (!(threshold >= 0.f) || !std::isfinite(threshold))
      fail<invalid_argument>("dml::comm::significant_filter: expected a finite threshold >= 0, found ", threshold);
  }
};

// ---------------------------------------------------------------------------------------------
// topk: the k entries largest in magnitude (Aji & Heafield 2017), as (index, value) pairs with
// indices ascending. k >= 1 is a count per message; 0 < k < 1 a fraction of acc.size(), at least 1.
struct topk_filter {
  static constexpr filter_kind kind = filter_kind::topk;
  double k = 1;

  std::string name() const { return "topk:" + detail::shortest(k); }

  // How many entries a message about n values carries.
  std::size_t entries(std::size_t n) const {
    check();
    if (n == 0) return 0;
    if (k >= static_cast<double>(n)) return n;
    if (k >= 1) return static_cast<std::size_t>(k);
    return std::max<std::size_t>(1, static_cast<std::size_t>(k * static_cast<double>(n)));
  }

  void encode(std::span<float> acc, std::vector<std::byte>& out) const {
    const std::uint32_t n = detail::message_length(acc.size(), "dml::comm::topk_filter::encode");
    const std::size_t count = entries(n);
    float* a = acc.data();
    std::vector<std::uint32_t> chosen(count);
    if (count == n) {
      for (std::uint32_t i = 0; i < n; ++i) chosen[i] = i;
    } else if (count > 0) {
      // One 64-bit key per entry: |a_i|'s bits (ordered as the magnitudes are, NaN above infinity)
      // over the complement of i, so equal magnitudes prefer the lower index. Keys are distinct, so
      // the chosen set does not depend on how nth_element breaks ties, and no comparison chases an
      // index back into acc.
      std::vector<std::uint64_t> keys(n);
      std::uint64_t* kp = keys.data();
      DML_SIMD
      for (std::uint32_t i = 0; i < n; ++i) {
        const std::uint32_t mag = std::bit_cast<std::uint32_t>(a[i]) & 0x7fffffffu;
        kp[i] = (std::uint64_t{mag} << 32) | (0xffffffffu - i);
      }
      const auto kth = keys.begin() + static_cast<std::ptrdiff_t>(count - 1);
      std::nth_element(keys.begin(), kth, keys.end(), std::greater<>{});
      for (std::size_t j = 0; j < count; ++j) chosen[j] = 0xffffffffu - static_cast<std::uint32_t>(keys[j]);
      std::sort(chosen.begin(), chosen.end());
    }
    std::byte* p = detail::append_message(out, kind, n, static_cast<std::uint32_t>(count), 8 * count);
    for (std::size_t j = 0; j < count; ++j) {
      const std::uint32_t i = chosen[j];
      detail::wire_put(p + 8 * j, i);
      detail::wire_put(p + 8 * j + 4, a[i]);
      a[i] = 0.f;
    }
  }

  static std::size_t decode(std::span<const std::byte> in, std::span<float> dst) {
    return detail::decode_pairs(in, dst, kind, "dml::comm::topk_filter::decode");
  }

  void check() const {
    if (!(k > 0) || !std::isfinite(k) || (k >= 1 && k != std::floor(k)))
      fail<invalid_argument>("dml::comm::topk_filter: expected k a whole count >= 1 or a fraction 0 < k < 1, found ",
                             k);
  }
};

// ---------------------------------------------------------------------------------------------
// onebit: 1-bit SGD (Seide et al. 2014). One bit per entry, set where acc_i < 0, packed LSB first,
// and per block of `block` entries two reconstruction values: the mean of the block's non-negative
// entries and the mean of its negative ones. The receiver adds its block's mean_pos or mean_neg per
// entry; the sender subtracts the same. Means per block, not per message: one pair for a whole
// parameter-server range (65536 values) is too coarse to train as well as dense pushes do.
// Payload: u32 block, ceil(n / block) pairs (f32 mean_pos, f32 mean_neg), ceil(n / 8) bytes of bits
// (unused high bits of the last zero). block is a positive multiple of 32, so no 32-entry word of
// bits straddles two blocks. Per entry 1/8 + 8/block bytes: 31.5x fewer than dense at the default
// 4096, 30.1x at 1024; the default keeps a parameter server's pushes 30x smaller than dense ones
// with their headers, small ranges and dense initial values counted (benchmarks/README.md).
struct onebit_filter {
  static constexpr filter_kind kind = filter_kind::onebit;
  static constexpr std::uint32_t default_block = 4096;
  std::uint32_t block = default_block;

  std::string name() const { return block == default_block ? "onebit" : "onebit:" + std::to_string(block); }

  // Payload bytes of a message about n values with blocks of `block` (a positive multiple of 32).
  static std::uint64_t payload_bytes(std::uint64_t n, std::uint32_t block) {
    return 4 + 8 * ((n + block - 1) / block) + (n + 7) / 8;
  }

  void encode(std::span<float> acc, std::vector<std::byte>& out) const {
    check();
    const std::uint32_t n = detail::message_length(acc.size(), "dml::comm::onebit_filter::encode");
    const std::size_t nb = (std::size_t{n} + block - 1) / block;
    std::byte* p = detail::append_message(out, kind, n, n, static_cast<std::size_t>(payload_bytes(n, block)));
    detail::wire_put(p, block);
    std::byte* means = p + 4;
    std::byte* bits = means + 8 * nb;
    float* a = acc.data();
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t lo = b * block, hi = std::min<std::size_t>(n, lo + block);
      // min of a local copy, not a select on the sign nor min of a[i] by reference: GCC 12 turns
      // those into a branch that random signs mispredict half the time (12x slower at 4M entries).
      double sum_all = 0, sum_neg = 0;
      std::size_t n_neg = 0;
#if defined(_OPENMP)
#  pragma omp simd reduction(+ : sum_all, sum_neg, n_neg)
#endif
      for (std::size_t i = lo; i < hi; ++i) {
        const float x = a[i];
        sum_all += double{x};
        sum_neg += double{std::min(x, 0.f)};
        n_neg += x < 0.f;
      }
      const std::size_t n_pos = hi - lo - n_neg;
      const double sum_pos = sum_all - sum_neg;
      const float mean_pos = n_pos ? static_cast<float>(sum_pos / static_cast<double>(n_pos)) : 0.f;
      const float mean_neg = n_neg ? static_cast<float>(sum_neg / static_cast<double>(n_neg)) : 0.f;
      detail::wire_put(means + 8 * b, mean_pos);
      detail::wire_put(means + 8 * b + 4, mean_neg);
      // The bits from the values before the means come off them. Whole 32-entry words first
      // (little-endian, so byte-wise they are LSB first); lo is a multiple of 32, and only the last
      // block has a tail, set bit by bit into bytes that resize() zeroed. The bits are disjoint, so
      // their sum is their or.
      for (std::size_t w = lo / 32; w < hi / 32; ++w) {
        const float* aw = a + 32 * w;
        std::uint32_t word = 0;
        DML_SIMD_SUM(word)
        for (unsigned t = 0; t < 32; ++t) word += aw[t] < 0.f ? detail::bit32[t] : 0u;
        detail::wire_put(bits + 4 * w, word);
      }
      for (std::size_t i = 32 * (hi / 32); i < hi; ++i)
        if (a[i] < 0.f) bits[i / 8] |= static_cast<std::byte>(1u << (i % 8));
      DML_SIMD
      for (std::size_t i = lo; i < hi; ++i) {
        const float x = a[i];
        a[i] = x - (x < 0.f ? mean_neg : mean_pos);
      }
    }
  }

  static std::size_t decode(std::span<const std::byte> in, std::span<float> dst) {
    constexpr const char* where = "dml::comm::onebit_filter::decode";
    const detail::message_header h = detail::read_header(in, kind, dst.size(), where);
    if (h.count != h.n)
      fail<invalid_argument>(where, ": expected a count equal to the length ", h.n, ", found ", h.count);
    const std::size_t n = h.n;
    detail::check_fits(in, message_header_bytes + 4, "header + block size", where);
    const std::byte* p = in.data() + message_header_bytes;
    const auto block = detail::wire_get<std::uint32_t>(p);
    if (block == 0 || block % 32 != 0)
      fail<invalid_argument>(where, ": expected a block size that is a positive multiple of 32, found ", block);
    const std::size_t nb = (n + block - 1) / block;
    const std::uint64_t need = message_header_bytes + payload_bytes(n, block);
    detail::check_fits(in, need, "header + block size + 8 per block + one bit per entry", where);
    const std::byte* means = p + 4;
    const std::byte* bitp = means + 8 * nb;
    const auto* bits = reinterpret_cast<const unsigned char*>(bitp);
    if (n % 8 != 0 && (bits[n / 8] >> (n % 8)) != 0)
      fail<invalid_argument>(where, ": expected zero padding bits after entry ", n, ", found byte ",
                             unsigned{bits[n / 8]});
    // 32 entries per little-endian word (bit t of the word is entry 32w + t, as the bytes are LSB
    // first), tested against a table of masks: the loop vectorises without a per-entry byte gather
    // or per-lane shifts, which x86-64 has only from AVX2 on.
    float* d = dst.data();
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t lo = b * block, hi = std::min<std::size_t>(n, lo + block);
      const float mean_pos = detail::wire_get<float>(means + 8 * b);
      const float mean_neg = detail::wire_get<float>(means + 8 * b + 4);
      for (std::size_t w = lo / 32; w < hi / 32; ++w) {
        const auto word = detail::wire_get<std::uint32_t>(bitp + 4 * w);
        float* dw = d + 32 * w;
        DML_SIMD
        for (unsigned t = 0; t < 32; ++t) dw[t] += (word & detail::bit32[t]) ? mean_neg : mean_pos;
      }
      for (std::size_t i = 32 * (hi / 32); i < hi; ++i)
        d[i] += ((bits[i >> 3] >> (i & 7)) & 1u) ? mean_neg : mean_pos;
    }
    return static_cast<std::size_t>(need);
  }

  void check() const {
    if (block == 0 || block % 32 != 0)
      fail<invalid_argument>("dml::comm::onebit_filter: expected a block that is a positive multiple of 32, found ",
                             block);
  }
};

// ---------------------------------------------------------------------------------------------
// any_filter: a filter chosen at run time, from a flag. decode accepts only the kind it holds, as
// each filter does, so a sender and a receiver configured differently fail on the first message.
class any_filter {
 public:
  using variant_type = std::variant<no_filter, significant_filter, topk_filter, onebit_filter>;

  any_filter() = default;
  template <class F>
    requires std::same_as<F, no_filter> || std::same_as<F, significant_filter> || std::same_as<F, topk_filter> ||
             std::same_as<F, onebit_filter>
  any_filter(F f) : f_(std::move(f)) {}

  // "none", "significant:T" (T >= 0), "topk:K" (K >= 1 whole, or 0 < K < 1), "onebit" (blocks of
  // 4096) or "onebit:B" (B a positive multiple of 32).
  static any_filter parse(std::string_view spec) {
    constexpr const char* where = "dml::comm::any_filter::parse";
    if (spec == "none") return no_filter{};
    if (spec == "onebit") return onebit_filter{};
    const auto colon = spec.find(':');
    const std::string_view head = spec.substr(0, colon);
    const std::string_view arg = colon == std::string_view::npos ? std::string_view{} : spec.substr(colon + 1);
    if (colon != std::string_view::npos && head == "significant") {
      float t = 0;
      if (!read_number(arg, t) || !(t >= 0.f) || !std::isfinite(t))
        fail<invalid_argument>(where, ": expected significant:T with a finite threshold T >= 0, found '", spec, "'");
      return significant_filter{t};
    }
    if (colon != std::string_view::npos && head == "topk") {
      double k = 0;
      if (!read_number(arg, k) || !(k > 0) || !std::isfinite(k) || (k >= 1 && k != std::floor(k)))
        fail<invalid_argument>(where, ": expected topk:K with K a whole count >= 1 or a fraction 0 < K < 1, found '",
                               spec, "'");
      return topk_filter{k};
    }
    if (colon != std::string_view::npos && head == "onebit") {
      std::uint32_t b = 0;
      if (!read_number(arg, b) || b == 0 || b % 32 != 0)
        fail<invalid_argument>(where, ": expected onebit:B with B a whole positive multiple of 32, found '", spec, "'");
      return onebit_filter{b};
    }
    fail<invalid_argument>(where, ": expected none, significant:T, topk:K, onebit or onebit:B, found '", spec, "'");
  }

  std::string name() const {
    return std::visit([](const auto& f) { return f.name(); }, f_);
  }
  filter_kind kind() const {
    return std::visit([](const auto& f) { return std::decay_t<decltype(f)>::kind; }, f_);
  }
  void encode(std::span<float> acc, std::vector<std::byte>& out) const {
    std::visit([&](const auto& f) { f.encode(acc, out); }, f_);
  }
  std::size_t decode(std::span<const std::byte> in, std::span<float> dst) const {
    return std::visit([&](const auto& f) { return f.decode(in, dst); }, f_);
  }
  const variant_type& variant() const noexcept { return f_; }

 private:
  template <class T>
  static bool read_number(std::string_view s, T& x) {
    const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
    return !s.empty() && ec == std::errc{} && p == s.data() + s.size();
  }

  variant_type f_;
};

static_assert(filter<no_filter> && filter<significant_filter> && filter<topk_filter> && filter<onebit_filter> &&
              filter<any_filter>);

}  // namespace dml::comm
