// SPDX-License-Identifier: Apache-2.0
// dml/comm/detail/filter_wire.hpp — the wire form every filter's messages share: header writing and checked reading,
// little-endian fields, the sparse filters' (index, value) pairs, and the shortest text of a filter's parameter.
// Sits on comm/filter.hpp and core/error.hpp; used by comm/compression.hpp.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "dml/comm/filter.hpp"
#include "dml/core/config.hpp"
#include "dml/core/error.hpp"

namespace dml::comm::detail {

template <class T>
DML_HOST_DEVICE void wire_put(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof v);
}
template <class T>
DML_HOST_DEVICE T wire_get(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Indices travel as u32, so one message covers at most 2^32 - 1 entries.
inline std::uint32_t message_length(std::size_t n, const char* where) {
  if (n > std::numeric_limits<std::uint32_t>::max())
    fail<invalid_argument>(where, ": expected at most ", std::numeric_limits<std::uint32_t>::max(),
                           " entries per message, found ", n);
  return static_cast<std::uint32_t>(n);
}

// Appends the header and room for the payload; returns where the payload starts.
inline std::byte* append_message(std::vector<std::byte>& out, filter_kind kind, std::uint32_t n,
                                 std::uint32_t count, std::size_t payload_bytes) {
  const std::size_t at = out.size();
  out.resize(at + message_header_bytes + payload_bytes);
  std::byte* p = out.data() + at;
  p[0] = static_cast<std::byte>(kind);
  wire_put(p + 1, n);
  wire_put(p + 5, count);
  return p + message_header_bytes;
}

struct message_header {
  std::uint32_t n, count;
};

inline message_header read_header(std::span<const std::byte> in, filter_kind expected, std::size_t dst_size,
                                  const char* where) {
  if (in.size() < message_header_bytes)
    fail<invalid_argument>(where, ": expected a message of at least ", message_header_bytes,
                           " bytes (its header), found ", in.size());
  const auto kind = static_cast<unsigned>(in[0]);
  if (kind != static_cast<unsigned>(expected)) {
    const auto found = static_cast<filter_kind>(kind);
    if (kind >= 1 && kind <= 4)
      fail<invalid_argument>(where, ": expected a ", comm::name(expected), " message (kind ",
                             static_cast<unsigned>(expected), "), found a ", comm::name(found), " message (kind ", kind,
                             ")");
    fail<invalid_argument>(where, ": expected a ", comm::name(expected), " message (kind ",
                           static_cast<unsigned>(expected), "), found kind ", kind, ", which no dml filter writes");
  }
  const message_header h{wire_get<std::uint32_t>(in.data() + 1), wire_get<std::uint32_t>(in.data() + 5)};
  if (h.n != dst_size)
    fail<invalid_argument>(where, ": expected a message of ", dst_size, " entries (the destination's size), found one of ",
                           h.n);
  return h;
}

inline void check_fits(std::span<const std::byte> in, std::uint64_t need, const char* what, const char* where) {
  if (in.size() < need)
    fail<invalid_argument>(where, ": expected ", need, " bytes (", what, "), found ", in.size());
}

// bit32[t] == 1 << t, loaded rather than shifted so that onebit's loops vectorise on any x86-64.
inline constexpr std::uint32_t bit32[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,  1u << 8,  1u << 9,  1u << 10,
    1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15, 1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21,
    1u << 22, 1u << 23, 1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};

// Shortest text that reads back to the same value, so parse(f.name()) == f.
template <class T>
std::string shortest(T v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

// The sparse filters' common wire form: (u32 index, f32 value) pairs, indices ascending.
inline std::size_t decode_pairs(std::span<const std::byte> in, std::span<float> dst, filter_kind kind,
                                const char* where) {
  const message_header h = read_header(in, kind, dst.size(), where);
  if (h.count > h.n)
    fail<invalid_argument>(where, ": expected at most ", h.n, " entries, found ", h.count);
  const std::uint64_t need = message_header_bytes + 8 * std::uint64_t{h.count};
  check_fits(in, need, "header + 8 per entry", where);
  const std::byte* p = in.data() + message_header_bytes;
  // Check every index before adding any value, so a bad message leaves dst as it was.
  for (std::uint32_t j = 0; j < h.count; ++j) {
    const auto i = wire_get<std::uint32_t>(p + 8 * std::size_t{j});
    if (i >= h.n)
      fail<invalid_argument>(where, ": expected indices below ", h.n, ", found ", i, " in entry ", j);
  }
  for (std::uint32_t j = 0; j < h.count; ++j) {
    const std::byte* e = p + 8 * std::size_t{j};
    dst[wire_get<std::uint32_t>(e)] += wire_get<float>(e + 4);
  }
  return static_cast<std::size_t>(need);
}

}  // namespace dml::comm::detail
