// SPDX-License-Identifier: Apache-2.0
// dml/parallel/compressed.hpp — compressed gradient reductions with error feedback (1-bit SGD, top-k) for DDP and ZeRO.
// Sits on comm/compression.hpp (the filters the parameter server uses); parallel/sharding.hpp runs them. DESIGN.md §9.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "dml/comm/compression.hpp"
#include "dml/core/error.hpp"

namespace dml::parallel {

// What `compress` names: "none" (dense reductions, today's code path), "onebit" (1-bit SGD, blocks of 4096),
// "onebit:B" (blocks of B, a positive multiple of 32) or "topk:F" (the fraction F of each part, 0 < F <= 1).
struct gradient_compression {
  comm::any_filter filter{};

  bool on() const { return filter.kind() != comm::filter_kind::none; }
  std::string name() const { return filter.name(); }

  static gradient_compression parse(std::string_view spec) {
    constexpr const char* where = "dml::trainer: compress";
    if (spec.empty() || spec == "none") return {};
    if (spec.starts_with("topk:")) {
      const std::string_view arg = spec.substr(5);
      double f = 0;
      const auto [p, ec] = std::from_chars(arg.data(), arg.data() + arg.size(), f);
      if (arg.empty() || ec != std::errc{} || p != arg.data() + arg.size() || !(f > 0) || !(f <= 1))
        fail<invalid_argument>(where, ": expected topk:F with a ratio 0 < F <= 1, found '", spec, "'");
      // F = 1 sends every entry: a whole count no part reaches.
      return {comm::topk_filter{f < 1 ? f : 4294967295.0}};
    }
    if (spec == "onebit" || spec.starts_with("onebit:")) {
      try {
        return {comm::any_filter::parse(spec)};
      } catch (const invalid_argument&) {
        fail<invalid_argument>(where, ": expected onebit or onebit:B with B a positive multiple of 32, found '", spec,
                               "'");
      }
    }
    fail<invalid_argument>(where, ": expected none, onebit, onebit:B or topk:F (0 < F <= 1), found '", spec, "'");
  }
};

// Bytes this rank hands to the network for gradient reductions: as compressed, and as the dense reductions
// would (a ring's 2(N-1)/N of the buffer for an all-reduce, (N-1)/N for a reduce-scatter, 4 bytes an entry).
struct wire_bytes {
  std::int64_t sent = 0, dense = 0;
};

// Compressed reductions over one group, with a worker residual per gradient entry and a server residual per
// entry of the part this rank owns (1-bit Adam's two-sided error feedback). A vector of length N·part is cut
// into N parts; part p belongs to rank p.
//   reduce_scatter: acc += grad; each part of acc is compressed (what is not sent stays in acc) and sent to its
//     owner with one all-to-all; the owner decodes the N messages and sums them.
//   all_reduce: the reduce-scatter, then the owner adds its sum to its server residual, compresses that again
//     (the rest stays) and an all-gather hands every rank every owner's message, decoded into grad.
// Every part's message has the same length (a filter's length depends only on the part's size), so the
// exchanges are plain all-to-all and all-gather of bytes. Host memory, fp32 gradients.
class compressed_reducer {
 public:
  compressed_reducer() = default;
  compressed_reducer(gradient_compression c, std::size_t entries, std::size_t owned)
      : filter_(c.filter), worker_(entries, 0.f), server_(owned, 0.f) {}

  // Sums grad over c into out (this rank's part), feeding back through the worker residual at acc_offset.
  template <class Comm>
  void reduce_scatter(Comm& c, std::span<const float> grad, std::size_t acc_offset, std::span<float> out) {
    exchange(c, grad, acc_offset, out);
    bytes_.dense += dense_share(c.size(), grad.size());
  }

  // Sums grad over c in place; the worker residual at acc_offset, the server residual at own_offset.
  template <class Comm>
  void all_reduce(Comm& c, std::span<float> grad, std::size_t acc_offset, std::size_t own_offset) {
    const auto n = static_cast<std::size_t>(c.size());
    const std::size_t part = grad.size() / n;
    sum_.assign(part, 0.f);
    exchange(c, grad, acc_offset, sum_);
    float* s = server_.data() + own_offset;
    for (std::size_t i = 0; i < part; ++i) s[i] += sum_[i];
    out_.clear();
    filter_.encode(std::span<float>(s, part), out_);
    in_.resize(n * out_.size());
    c.all_gather(std::span<const std::byte>(out_), std::span<std::byte>(in_));
    std::fill(grad.begin(), grad.end(), 0.f);
    for (std::size_t p = 0; p < n; ++p)
      filter_.decode(std::span<const std::byte>(in_).subspan(p * out_.size(), out_.size()), grad.subspan(p * part, part));
    bytes_.sent += static_cast<std::int64_t>((n - 1) * out_.size());
    bytes_.dense += 2 * dense_share(c.size(), grad.size());
  }

  const wire_bytes& bytes() const { return bytes_; }
  std::span<const float> worker_residual() const { return worker_; }
  std::span<const float> server_residual() const { return server_; }

 private:
  static std::int64_t dense_share(int n, std::size_t entries) {
    return static_cast<std::int64_t>(4 * entries / static_cast<std::size_t>(n) * static_cast<std::size_t>(n - 1));
  }
  template <class Comm>
  void exchange(Comm& c, std::span<const float> grad, std::size_t acc_offset, std::span<float> out) {
    const auto n = static_cast<std::size_t>(c.size());
    if (grad.size() % n != 0 || out.size() != grad.size() / n || acc_offset + grad.size() > worker_.size())
      fail<invalid_argument>("dml::parallel::compressed_reducer: expected ", n, " equal parts of ", grad.size(),
                             " entries within ", worker_.size(), " and a part of ", grad.size() / n, ", found ",
                             out.size(), " at offset ", acc_offset);
    const std::size_t part = grad.size() / n;
    float* acc = worker_.data() + acc_offset;
    for (std::size_t i = 0; i < grad.size(); ++i) acc[i] += grad[i];
    out_.clear();
    for (std::size_t p = 0; p < n; ++p) filter_.encode(std::span<float>(acc + p * part, part), out_);
    const std::size_t m = out_.size() / n;
    in_.resize(out_.size());
    c.all_to_all(std::span<const std::byte>(out_), std::span<std::byte>(in_));
    std::fill(out.begin(), out.end(), 0.f);
    for (std::size_t p = 0; p < n; ++p) filter_.decode(std::span<const std::byte>(in_).subspan(p * m, m), out);
    bytes_.sent += static_cast<std::int64_t>((n - 1) * m);
  }

  comm::any_filter filter_{};
  std::vector<float> worker_, server_, sum_;
  std::vector<std::byte> out_, in_;
  wire_bytes bytes_{};
};

}  // namespace dml::parallel
