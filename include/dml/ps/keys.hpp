// SPDX-License-Identifier: Apache-2.0
// dml/ps/keys.hpp — the parameter server's key space: keys cut into bounded ranges, and the ranges placed on
// servers by consistent hashing with virtual nodes, each chain-replicated on the next servers of the ring.
// Sits on core/; used by ps/transport.hpp, which places every range with it, and by ps/server.hpp and
// ps/worker.hpp, which route every push and pull through it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "dml/core/error.hpp"

namespace dml::ps {

using key = std::uint64_t;

// Elements [offset, offset + length) of key k. `flat` is where they start in the concatenation of all keys'
// values, which is how a worker lays out the values it pushes and pulls.
struct key_range {
  std::uint32_t id = 0;
  key k = 0;
  std::int64_t offset = 0, length = 0;
  std::int64_t flat = 0;
};

// Keys 0..n-1 with the given lengths, each cut into ranges of at most max_range elements, so one large
// parameter spreads over several servers (ranges of one key have nearly equal lengths).
class key_table {
 public:
  key_table() = default;
  key_table(std::vector<std::int64_t> lengths, std::int64_t max_range) : lengths_(std::move(lengths)) {
    if (max_range <= 0)
      fail<invalid_argument>("dml::ps::key_table: expected a range bound > 0, found ", max_range);
    first_.reserve(lengths_.size() + 1);
    std::int64_t flat = 0;
    for (std::size_t k = 0; k < lengths_.size(); ++k) {
      const std::int64_t n = lengths_[k];
      if (n <= 0)
        fail<invalid_argument>("dml::ps::key_table: expected key ", k, " to have a length > 0, found ",
                               n);
      first_.push_back(static_cast<std::uint32_t>(ranges_.size()));
      const std::int64_t parts = (n + max_range - 1) / max_range;
      for (std::int64_t p = 0; p < parts; ++p) {
        const std::int64_t b = n * p / parts, e = n * (p + 1) / parts;
        ranges_.push_back({static_cast<std::uint32_t>(ranges_.size()), key(k), b, e - b, flat + b});
      }
      flat += n;
    }
    first_.push_back(static_cast<std::uint32_t>(ranges_.size()));
    total_ = flat;
  }

  std::size_t keys() const { return lengths_.size(); }
  std::int64_t length(key k) const { return lengths_[checked(k)]; }
  std::int64_t total() const { return total_; }  // elements over all keys
  std::span<const key_range> ranges() const { return ranges_; }
  const key_range& range(std::uint32_t id) const { return ranges_[id]; }
  // The ranges of key k, in offset order.
  std::span<const key_range> ranges_of(key k) const {
    const auto i = checked(k);
    return std::span(ranges_).subspan(first_[i], first_[i + 1] - first_[i]);
  }
  bool has(key k) const { return k < lengths_.size(); }

 private:
  std::size_t checked(key k) const {
    if (k >= lengths_.size())
      fail<invalid_argument>("dml::ps::key_table: expected a key below ", lengths_.size(),
                             " (the keys the servers hold), found ", k);
    return static_cast<std::size_t>(k);
  }
  std::vector<std::int64_t> lengths_;
  std::vector<std::uint32_t> first_;
  std::vector<key_range> ranges_;
  std::int64_t total_ = 0;
};

namespace detail {
constexpr std::uint64_t mix(std::uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace detail

// Consistent hashing: each server owns `vnodes` points of a 64-bit ring, and a range belongs to the first
// point at or after its own hash. Its replicas are the next distinct servers clockwise, so adding or
// removing a server moves only the ranges next to its points, and a dead server's ranges fall to the
// servers that already hold their replicas.
class ring {
 public:
  ring() = default;
  explicit ring(int servers, int vnodes = 64, std::uint64_t seed = 0) : servers_(servers) {
    if (servers < 1) fail<invalid_argument>("dml::ps::ring: expected at least 1 server, found ", servers);
    if (vnodes < 1) fail<invalid_argument>("dml::ps::ring: expected vnodes >= 1, found ", vnodes);
    points_.reserve(std::size_t(servers) * vnodes);
    for (int s = 0; s < servers; ++s)
      for (int v = 0; v < vnodes; ++v)
        points_.push_back({detail::mix(seed ^ detail::mix((std::uint64_t(s) << 32) | std::uint32_t(v))), s});
    std::ranges::sort(points_);
  }

  int servers() const { return servers_; }

  static std::uint64_t hash(const key_range& r) { return detail::mix(detail::mix(r.k) ^ std::uint64_t(r.offset)); }

  // The servers that hold range r: primary first, then up to `replicas` successors (fewer when the ring has
  // fewer servers). The primary applies updates; each forwards them to the next; the last acknowledges.
  std::vector<int> chain(const key_range& r, int replicas) const {
    std::vector<int> out;
    const std::size_t want = std::size_t(std::min(replicas + 1, servers_));
    auto it = std::ranges::lower_bound(points_, std::pair{hash(r), -1});
    for (std::size_t n = 0; n < points_.size() && out.size() < want; ++n, ++it) {
      if (it == points_.end()) it = points_.begin();
      if (std::ranges::find(out, it->second) == out.end()) out.push_back(it->second);
    }
    return out;
  }
  int owner(const key_range& r) const { return chain(r, 0).front(); }

 private:
  int servers_ = 0;
  std::vector<std::pair<std::uint64_t, int>> points_;
};

}  // namespace dml::ps
