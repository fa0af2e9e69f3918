// SPDX-License-Identifier: Apache-2.0
// dml/parallel/compressed.hpp — compressed gradient reductions with error feedback (1-bit SGD, top-k) for DDP and ZeRO.
// Sits on comm/compression.hpp (the filters the parameter server uses); parallel/sharding.hpp runs them. DESIGN.md §9.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "dml/comm/compression.hpp"
#include "dml/comm/communicator.hpp"
#include "dml/core/error.hpp"

namespace dml::parallel {

// What `compress` names: "none" (dense reductions, today's code path), "onebit" (1-bit SGD, blocks of 4096),
// "onebit:B" (blocks of B, a positive multiple of 32), "topk:F" (the fraction F of each part, 0 < F <= 1) or
// "onebit-adam:W" (1-bit Adam, Tang et al. 2021: W dense steps, then Adam's momentum, not the gradient, goes
// 1-bit with error feedback while the optimizer keeps its second moment frozen; `beta1` is the optimizer's).
struct gradient_compression {
  comm::any_filter filter{};
  std::int64_t adam_warmup = 0;  // > 0: 1-bit Adam after this many dense steps
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;  // the optimizer's

  bool on() const { return filter.kind() != comm::filter_kind::none; }
  std::string name() const { return adam_warmup > 0 ? "onebit-adam:" + std::to_string(adam_warmup) : filter.name(); }

  // The check of a command line's --compress value: empty when parse accepts spec, else what was expected (the
  // examples' and benchmarks' flag tables print it after "expected").
  static std::string spec_problem(std::string_view spec) {
    try {
      (void)parse(spec);
      return {};
    } catch (const invalid_argument&) {
      return "none, onebit, onebit:B (B a positive multiple of 32), topk:F (0 < F <= 1) or onebit-adam:W (W >= 1 "
             "dense steps)";
    }
  }

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
    if (spec.starts_with("onebit-adam:")) {
      const std::string_view arg = spec.substr(12);
      std::int64_t w = 0;
      const auto [p, ec] = std::from_chars(arg.data(), arg.data() + arg.size(), w);
      if (arg.empty() || ec != std::errc{} || p != arg.data() + arg.size() || w < 1)
        fail<invalid_argument>(where, ": expected onebit-adam:W with W >= 1 dense warm-up steps, found '", spec, "'");
      return {.filter = comm::onebit_filter{}, .adam_warmup = w};
    }
    if (spec == "onebit" || spec.starts_with("onebit:")) {
      try {
        return {comm::any_filter::parse(spec)};
      } catch (const invalid_argument&) {
        fail<invalid_argument>(where, ": expected onebit or onebit:B with B a positive multiple of 32, found '", spec,
                               "'");
      }
    }
    fail<invalid_argument>(where, ": expected none, onebit, onebit:B, topk:F (0 < F <= 1) or onebit-adam:W, found '",
                           spec, "'");
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
//     (the rest stays) and an all-gather hands every rank every owner's message, decoded into grad. On 2 ranks
//     (or 1), and under 1-bit Adam after warm-up, every rank's part messages are all-gathered instead and every
//     rank sums as the owners do (gathered_all_reduce): the same steps as ZeRO's. On 2 ranks that sends what the
//     owners' second compression sends (two messages a rank) and loses nothing to it; on N ranks it sends N/2
//     times as much, so from 3 ranks on the owners compress again.
// Every part's message has the same length (a filter's length depends only on the part's size), so the
// exchanges are plain all-to-all and all-gather of bytes. Host memory, fp32 gradients.
// 1-bit Adam (adam_warmup > 0): each rank keeps the momentum of its own gradients, m_i = β1·m_i + (1 − β1)·g_i;
// their sum is the momentum of the summed gradient, so that is what goes through the reductions above, after
// W dense steps (plain all-reduce / reduce-scatter of the gradient). What comes back, the summed momentum M, is
// handed to the optimizer as the gradient that makes its momentum M: (M − β1·M_prev) / (1 − β1). The
// optimizer's second moment is frozen from step W on (adam's freeze_variance_after), as the paper's. The reducer
// tracks that second moment too during warm-up (ZeRO's warm-up all-reduces, so every rank has all of it) and
// compresses m_i / d, d = √v̂ + eps the frozen denominator of the update: one sign and one mean per block are
// then about the step each entry takes, where unscaled an entry with a small v would take the block's mean
// over its own tiny √v (which diverges on Fashion-MNIST). d is the same on every rank, so the sum is M / d.
// Each run (keyed by its offset) must be reduced once per step.
class compressed_reducer {
 public:
  compressed_reducer() = default;
  compressed_reducer(gradient_compression c, std::size_t entries, std::size_t owned)
      : filter_(c.filter), worker_(entries, 0.f), server_(owned, 0.f), warmup_(c.adam_warmup), beta1_(c.beta1),
        beta2_(c.beta2), eps_(c.eps) {
    if (warmup_ > 0) local_m_.assign(entries, 0.f);
  }

  // Sums grad over c into out (this rank's part), feeding back through the worker residual at acc_offset.
  template <class Comm>
  void reduce_scatter(Comm& c, std::span<const float> grad, std::size_t acc_offset, std::span<float> out) {
    bytes_.dense += dense_share(c.size(), grad.size());
    if (warmup_ == 0) return exchange(c, grad, acc_offset, out);
    auto& r = momentum_run(acc_offset, out.size(), grad.size());
    const std::span<float> lm = local_momentum(grad, acc_offset);
    const std::size_t own = static_cast<std::size_t>(c.rank()) * out.size();
    if (r.steps++ < warmup_) {  // all-reduce: every rank learns the whole second moment
      sum_.assign(grad.begin(), grad.end());
      c.all_reduce(std::span<float>(sum_), comm::reduce_op::sum);
      bytes_.sent += 2 * dense_share(c.size(), grad.size());
      std::copy_n(sum_.begin() + static_cast<std::ptrdiff_t>(own), out.size(), out.begin());
      advance(r.m, out);
      return second_moment(r, sum_);
    }
    exchange(c, scaled(r, lm), acc_offset, out);
    as_gradient(r, out, own);
  }

  // Sums grad over c in place; the worker residual at acc_offset, the server residual at own_offset.
  template <class Comm>
  void all_reduce(Comm& c, std::span<float> grad, std::size_t acc_offset, std::size_t own_offset) {
    bytes_.dense += 2 * dense_share(c.size(), grad.size());
    if (warmup_ == 0 && c.size() <= 2) return gathered_all_reduce(c, grad, grad, acc_offset);
    if (warmup_ == 0) return compressed_all_reduce(c, grad, grad, acc_offset, own_offset);
    auto& r = momentum_run(acc_offset, grad.size(), grad.size());
    const std::span<float> lm = local_momentum(grad, acc_offset);
    if (r.steps++ < warmup_) {
      c.all_reduce(grad, comm::reduce_op::sum);
      bytes_.sent += 2 * dense_share(c.size(), grad.size());
      advance(r.m, grad);
      return second_moment(r, grad);
    }
    gathered_all_reduce(c, scaled(r, lm), grad, acc_offset);
    as_gradient(r, grad, 0);
  }

  const wire_bytes& bytes() const { return bytes_; }
  std::span<const float> worker_residual() const { return worker_; }
  std::span<const float> server_residual() const { return server_; }

 private:
  struct momentum_state {
    std::int64_t steps = 0;  // reductions so far
    std::vector<float> m;    // the summed momentum as last handed out (the optimizer's, for grad_scale 1)
    std::vector<float> v, d, s;      // the whole run: the second moment in warm-up, then √v̂ + eps, and its floored form
    std::vector<std::uint8_t> live;  // the whole run, after warm-up: 0 where v was 0 (sent as 0, kept at 0)
  };
  momentum_state& momentum_run(std::size_t key, std::size_t n, std::size_t whole) {
    auto& r = momentum_[key];
    if (r.m.size() != n) r.m.assign(n, 0.f);
    if (r.v.size() != whole) r.v.assign(whole, 0.f);
    return r;
  }
  // v = β2·v + (1 − β2)·g², as optim::adam computes it.
  void second_moment(momentum_state& r, std::span<const float> g) const {
    for (std::size_t i = 0; i < r.v.size(); ++i) r.v[i] = r.v[i] * beta2_ + (1.f - beta2_) * g[i] * g[i];
  }
  // lm / s, with d (the frozen denominator, as optim::adam's after step W) made on the first call and s = max(d,
  // floor_share · the mean of d over the run's live entries). Entries with no gradient in warm-up (v = 0: MNIST's
  // blank border pixels; padding) are left out, sent as 0 and kept at 0: over d = eps a later gradient would swamp
  // their block's mean, and the optimizer's step would be m / eps. The floor does the same for entries whose v was
  // tiny but not 0: their lm / d would set their block's mean, and every entry of the block would take that step.
  // as_gradient multiplies the sum by d, so the optimizer's step is M / s: Adam's with the floor under √v̂.
  static constexpr float floor_share = 0.1f;
  std::span<const float> scaled(momentum_state& r, std::span<const float> lm) {
    if (r.d.empty()) {
      const auto bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(static_cast<double>(beta2_),
                                                                        static_cast<double>(warmup_))));
      r.d.resize(r.v.size());
      r.s.resize(r.v.size());
      r.live.resize(r.v.size());
      double sum = 0;
      std::size_t live = 0;
      for (std::size_t i = 0; i < r.v.size(); ++i) {
        r.d[i] = std::sqrt(r.v[i]) / bc2_sqrt + eps_;
        r.live[i] = r.v[i] != 0.f;
        if (r.live[i]) sum += r.d[i], ++live;
      }
      const float floor = live ? floor_share * static_cast<float>(sum / static_cast<double>(live)) : 0.f;
      for (std::size_t i = 0; i < r.v.size(); ++i) r.s[i] = std::max(r.d[i], floor);
    }
    scaled_.resize(lm.size());
    for (std::size_t i = 0; i < lm.size(); ++i) scaled_[i] = r.live[i] ? lm[i] / r.s[i] : 0.f;
    return scaled_;
  }
  // m = β1·m + (1 − β1)·g, as optim::adam computes it (so warm-up keeps M_prev equal to the optimizer's).
  void advance(std::span<float> m, std::span<const float> g) const {
    for (std::size_t i = 0; i < m.size(); ++i) m[i] = m[i] * beta1_ + (1.f - beta1_) * g[i];
  }
  std::span<float> local_momentum(std::span<const float> grad, std::size_t acc_offset) {
    const std::span<float> lm(local_m_.data() + acc_offset, grad.size());
    advance(lm, grad);
    return lm;
  }
  // sum holds the summed momentum M / d of the entries from `first` on: writes the gradient that takes m
  // (M_prev) to M, and keeps M.
  void as_gradient(momentum_state& r, std::span<float> sum, std::size_t first) const {
    for (std::size_t i = 0; i < r.m.size(); ++i) {
      const float next = r.live[first + i] ? sum[i] * r.d[first + i] : 0.f;
      sum[i] = (next - beta1_ * r.m[i]) / (1.f - beta1_);
      r.m[i] = next;
    }
  }
  template <class Comm>
  void compressed_all_reduce(Comm& c, std::span<const float> in, std::span<float> grad, std::size_t acc_offset,
                             std::size_t own_offset) {
    const auto n = static_cast<std::size_t>(c.size());
    const std::size_t part = grad.size() / n;
    sum_.assign(part, 0.f);
    exchange(c, in, acc_offset, sum_);
    float* s = server_.data() + own_offset;
    for (std::size_t i = 0; i < part; ++i) s[i] += sum_[i];
    out_.clear();
    encode(std::span<float>(s, part), out_);
    in_.resize(n * out_.size());
    c.all_gather(std::span<const std::byte>(out_), std::span<std::byte>(in_));
    std::fill(grad.begin(), grad.end(), 0.f);
    for (std::size_t p = 0; p < n; ++p)
      decode(std::span<const std::byte>(in_).subspan(p * out_.size(), out_.size()), grad.subspan(p * part, part));
    bytes_.sent += static_cast<std::int64_t>((n - 1) * out_.size());
  }
  // topk's messages here carry 16-bit indices: the filter picks the entries (the parameter server's (u32 index,
  // f32 value) pairs, in tmp_), rewritten as the 9-byte header, a u32 count per block of 65536 entries, the
  // entries' u16 indices within their block, then their f32 values. 6 bytes an entry instead of 8. Other filters'
  // messages go as they are.
  static constexpr std::size_t index_block = 65536;
  void encode(std::span<float> acc, std::vector<std::byte>& out) {
    if (filter_.kind() != comm::filter_kind::topk) return filter_.encode(acc, out);
    tmp_.clear();
    filter_.encode(acc, tmp_);
    const auto h = comm::detail::read_header(tmp_, comm::filter_kind::topk, acc.size(), where);
    const std::size_t blocks = (acc.size() + index_block - 1) / index_block, count = h.count;
    std::byte* p = comm::detail::append_message(out, comm::filter_kind::topk, h.n, h.count, 4 * blocks + 6 * count);
    const std::byte* pairs = tmp_.data() + comm::message_header_bytes;
    std::vector<std::uint32_t> per_block(blocks, 0);
    for (std::size_t j = 0; j < count; ++j) {
      const auto i = comm::detail::wire_get<std::uint32_t>(pairs + 8 * j);
      ++per_block[i / index_block];
      comm::detail::wire_put(p + 4 * blocks + 2 * j, static_cast<std::uint16_t>(i % index_block));
      comm::detail::wire_put(p + 4 * blocks + 2 * count + 4 * j, comm::detail::wire_get<float>(pairs + 8 * j + 4));
    }
    for (std::size_t b = 0; b < blocks; ++b) comm::detail::wire_put(p + 4 * b, per_block[b]);
  }
  void decode(std::span<const std::byte> in, std::span<float> dst) const {
    if (filter_.kind() != comm::filter_kind::topk) {
      filter_.decode(in, dst);
      return;
    }
    const auto h = comm::detail::read_header(in, comm::filter_kind::topk, dst.size(), where);
    const std::size_t blocks = (dst.size() + index_block - 1) / index_block, count = h.count;
    comm::detail::check_fits(in, comm::message_header_bytes + 4 * blocks + 6 * count,
                             "header, a count per block of 65536 and 6 per entry", where);
    const std::byte* p = in.data() + comm::message_header_bytes;
    std::size_t j = 0;
    for (std::size_t b = 0; b < blocks; ++b) {
      const auto c = comm::detail::wire_get<std::uint32_t>(p + 4 * b);
      const std::size_t end = std::min(dst.size(), (b + 1) * index_block);
      if (c > count - j || c > end - b * index_block)
        fail<invalid_argument>(where, ": expected at most ", std::min(count - j, end - b * index_block),
                               " entries in block ", b, ", found ", c);
      for (std::size_t e = j + c; j < e; ++j) {
        const std::size_t i = b * index_block + comm::detail::wire_get<std::uint16_t>(p + 4 * blocks + 2 * j);
        if (i >= end) fail<invalid_argument>(where, ": expected indices below ", end, ", found ", i, " in entry ", j);
        dst[i] += comm::detail::wire_get<float>(p + 4 * blocks + 2 * count + 4 * j);
      }
    }
    if (j != count) fail<invalid_argument>(where, ": expected the blocks' counts to sum to ", count, ", found ", j);
  }
  static constexpr const char* where = "dml::parallel::compressed_reducer";
  static std::int64_t dense_share(int n, std::size_t entries) {
    return static_cast<std::int64_t>(4 * entries / static_cast<std::size_t>(n) * static_cast<std::size_t>(n - 1));
  }
  // 1-bit Adam's all-reduce, ZeRO's math on every rank: each rank's n messages (one per part, as `exchange`
  // encodes them) go to every rank, which decodes part p from ranks 0..n-1 in order, as p's owner does in
  // `exchange`. No second compression: the owner's sum is not re-encoded (that, with its own residual, made DDP
  // diverge on Fashion-MNIST where ZeRO-2 did not). (n − 1)·n messages of a part per rank: 2 parts' worth on 2 ranks,
  // as the two-pass all-reduce, but growing with n.
  template <class Comm>
  void gathered_all_reduce(Comm& c, std::span<const float> in, std::span<float> grad, std::size_t acc_offset) {
    const auto n = static_cast<std::size_t>(c.size());
    const std::size_t m = encode_parts(n, in, grad.size() / n, acc_offset);
    in_.resize(n * out_.size());
    c.all_gather(std::span<const std::byte>(out_), std::span<std::byte>(in_));
    std::fill(grad.begin(), grad.end(), 0.f);
    const std::size_t part = grad.size() / n;
    for (std::size_t p = 0; p < n; ++p)
      for (std::size_t q = 0; q < n; ++q)
        decode(std::span<const std::byte>(in_).subspan((q * n + p) * m, m), grad.subspan(p * part, part));
    bytes_.sent += static_cast<std::int64_t>((n - 1) * out_.size());
  }
  // acc += grad (the worker residual at acc_offset), then one message per part of acc into out_ (what is not sent
  // stays in acc); gives a message's length.
  std::size_t encode_parts(std::size_t n, std::span<const float> grad, std::size_t out_size, std::size_t acc_offset) {
    if (grad.size() % n != 0 || out_size != grad.size() / n || acc_offset + grad.size() > worker_.size())
      fail<invalid_argument>("dml::parallel::compressed_reducer: expected ", n, " equal parts of ", grad.size(),
                             " entries within ", worker_.size(), " and a part of ", grad.size() / n, ", found ",
                             out_size, " at offset ", acc_offset);
    const std::size_t part = grad.size() / n;
    float* acc = worker_.data() + acc_offset;
    for (std::size_t i = 0; i < grad.size(); ++i) acc[i] += grad[i];
    out_.clear();
    for (std::size_t p = 0; p < n; ++p) encode(std::span<float>(acc + p * part, part), out_);
    return out_.size() / n;
  }
  template <class Comm>
  void exchange(Comm& c, std::span<const float> grad, std::size_t acc_offset, std::span<float> out) {
    const auto n = static_cast<std::size_t>(c.size());
    const std::size_t m = encode_parts(n, grad, out.size(), acc_offset);
    in_.resize(out_.size());
    c.all_to_all(std::span<const std::byte>(out_), std::span<std::byte>(in_));
    std::fill(out.begin(), out.end(), 0.f);
    for (std::size_t p = 0; p < n; ++p) decode(std::span<const std::byte>(in_).subspan(p * m, m), out);
    bytes_.sent += static_cast<std::int64_t>((n - 1) * m);
  }

  comm::any_filter filter_{};
  std::vector<float> worker_, server_, sum_;
  std::vector<std::byte> out_, in_, tmp_;
  wire_bytes bytes_{};
  std::int64_t warmup_ = 0;
  float beta1_ = 0.f;
  float beta2_ = 0.f, eps_ = 0.f;
  std::vector<float> local_m_, scaled_;                          // 1-bit Adam: this rank's momentum of its own gradients
  std::map<std::size_t, momentum_state> momentum_{};    // 1-bit Adam: per run, by its offset
};

}  // namespace dml::parallel
