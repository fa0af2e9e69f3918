// SPDX-License-Identifier: Apache-2.0
// dml/comm/filter.hpp — what a compression filter is: the `filter` concept, the message kinds and their header.
// Sits on the standard library alone; comm/compression.hpp holds the filters, comm/detail/filter_wire.hpp the
// message helpers they share.
#pragma once

#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dml::comm {

static_assert(std::endian::native == std::endian::little,
              "dml::comm filters: messages are little-endian; big-endian hosts need byte swaps");

// A filter turns an accumulator (this round's values plus what earlier rounds did not send: error
// feedback) into a self-delimiting message, and subtracts what it sent, so the accumulator keeps
// exactly what the receiver has not seen. Over many rounds nothing is lost, only delayed.
//
//   f.encode(acc, out)   appends one message to out; acc -= what the message carries
//   f.decode(in, dst)    dst += the values of the message at the front of in; returns its bytes
//   f.name()             the spelling any_filter::parse reads back: "none", "topk:0.01", ...
//
// Every message opens with a 9-byte header: u8 kind, u32 n (the length of the encoded vector) and
// u32 count (the entries it carries: n for none and onebit, the (u32 index, f32 value) pairs for
// significant and topk). decode checks the kind, that n is dst.size(), that the payload fits in `in`
// and that every index is below n, and throws invalid_argument before touching dst if one fails.
// Filters hold only their parameters: encode and decode are const, so threads may share one.
enum class filter_kind : std::uint8_t { none = 1, significant = 2, topk = 3, onebit = 4 };

constexpr std::string_view name(filter_kind k) {
  switch (k) {
    case filter_kind::none: return "none";
    case filter_kind::significant: return "significant";
    case filter_kind::topk: return "topk";
    case filter_kind::onebit: return "onebit";
  }
  return "?";
}

inline constexpr std::size_t message_header_bytes = 9;

template <class F>
concept has_filter_name = requires(const F& f) {
  { f.name() } -> std::convertible_to<std::string>;
};
template <class F>
concept has_encode = requires(F& f, std::span<float> acc, std::vector<std::byte>& out) { f.encode(acc, out); };
template <class F>
concept has_decode = requires(const F& f, std::span<const std::byte> in, std::span<float> dst) {
  { f.decode(in, dst) } -> std::same_as<std::size_t>;
};
template <class F>
concept filter = has_filter_name<F> && has_encode<F> && has_decode<F>;

// static_assert(diagnose_filter<F>()) names the first missing operation.
template <class F>
consteval bool diagnose_filter() {
  static_assert(has_filter_name<F>, "dml: a filter needs `std::string name() const`");
  static_assert(has_encode<F>, "dml: a filter needs `encode(std::span<float> acc, std::vector<std::byte>& out)`");
  static_assert(has_decode<F>,
                "dml: a filter needs `std::size_t decode(std::span<const std::byte> in, std::span<float> dst)` "
                "(static or const)");
  return true;
}

}  // namespace dml::comm
