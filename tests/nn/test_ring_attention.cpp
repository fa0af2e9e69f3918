// SPDX-License-Identifier: Apache-2.0
// tests/nn/test_ring_attention.cpp — ring attention over 1, 2 and 4 thread ranks against full attention (causal
// and not, zig-zag and not), grouped-query and multi-query heads against one rank's tile attention, all-gathered K/V
// and document masks (both exchanges) against it, its gradients against finite differences, the chunk layout,
// errors and memory.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <vector>

#include "dml/comm/local.hpp"
#include "dml/nn/attention.hpp"
#include "dml/nn/gradcheck.hpp"
#include "dml/nn/ring_attention.hpp"
#include "dml/nn/tile_attention.hpp"
#include "dml/parallel/tensor.hpp"
#include "support.hpp"

namespace test_ring_attention {

using dml::comm::local;
using dml::nn::attention_shape;
using dml::nn::cp_layout;
using dml::nn::ring_attention_shape;

namespace {

using dml_test::random_vector;

std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

struct attention_result {
  std::vector<float> y, dqkv;
};

// Full attention on the whole sequence, in double: y = softmax(q·kᵀ/√hd, masked)·v and, for loss Σ y·dy, dqkv.
attention_result reference_loop(const ring_attention_shape& s, const std::vector<float>& qkv,
                                const std::vector<float>& dy) {
  const std::int64_t T = s.seq, hd = s.head_dim, w = s.width(), ld = 3 * w;
  attention_result out{std::vector<float>(sz(s.batch * T * w)), std::vector<float>(qkv.size(), 0.f)};
  std::vector<double> dq(qkv.size(), 0.0);
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t h = 0; h < s.heads; ++h) {
      auto at = [&](std::int64_t t, std::int64_t part, std::int64_t d) { return sz((b * T + t) * ld + part * w + h * hd + d); };
      auto yat = [&](std::int64_t t, std::int64_t d) { return sz((b * T + t) * w + h * hd + d); };
      for (std::int64_t t = 0; t < T; ++t) {
        const std::int64_t n = s.causal ? t + 1 : T;
        std::vector<double> p(sz(n)), dp(sz(n));
        for (std::int64_t u = 0; u < n; ++u) {
          double dot = 0;
          for (std::int64_t d = 0; d < hd; ++d) dot += double(qkv[at(t, 0, d)]) * qkv[at(u, 1, d)];
          p[sz(u)] = dot / std::sqrt(double(hd));
        }
        const double mx = *std::max_element(p.begin(), p.end());
        double sum = 0;
        for (auto& x : p) sum += (x = std::exp(x - mx));
        for (auto& x : p) x /= sum;
        double row = 0;  // Σ_u dP·P
        for (std::int64_t u = 0; u < n; ++u) {
          double acc = 0;
          for (std::int64_t d = 0; d < hd; ++d) acc += double(dy[yat(t, d)]) * qkv[at(u, 2, d)];
          dp[sz(u)] = acc;
          row += acc * p[sz(u)];
        }
        for (std::int64_t d = 0; d < hd; ++d) {
          double acc = 0;
          for (std::int64_t u = 0; u < n; ++u) acc += p[sz(u)] * qkv[at(u, 2, d)];
          out.y[yat(t, d)] = float(acc);
        }
        for (std::int64_t u = 0; u < n; ++u) {
          const double ds = p[sz(u)] * (dp[sz(u)] - row) / std::sqrt(double(hd));
          for (std::int64_t d = 0; d < hd; ++d) {
            dq[at(t, 0, d)] += ds * qkv[at(u, 1, d)];
            dq[at(u, 1, d)] += ds * qkv[at(t, 0, d)];
            dq[at(u, 2, d)] += p[sz(u)] * dy[yat(t, d)];
          }
        }
      }
    }
  for (std::size_t i = 0; i < dq.size(); ++i) out.dqkv[i] = float(dq[i]);
  return out;
}

// The library's own full causal attention.
attention_result reference_causal(const ring_attention_shape& s, const std::vector<float>& qkv,
                                  const std::vector<float>& dy) {
  const attention_shape a{s.batch, s.seq, s.heads, s.head_dim};
  std::vector<float> probs(sz(dml::nn::attention_saved_size(a))), scratch(sz(dml::nn::attention_scratch_size(a)));
  attention_result out{std::vector<float>(sz(s.batch * s.seq * s.width())), std::vector<float>(qkv.size())};
  dml::nn::causal_attention_forward<dml::host>(a, qkv.data(), probs.data(), out.y.data());
  dml::nn::causal_attention_backward<dml::host>(a, qkv.data(), probs.data(), dy.data(), out.dqkv.data(), scratch.data());
  return out;
}

attention_result reference(const ring_attention_shape& s, const std::vector<float>& qkv, const std::vector<float>& dy) {
  return s.causal ? reference_causal(s, qkv, dy) : reference_loop(s, qkv, dy);
}

// One rank's tile attention on the whole sequence: what ring attention gives on any ring, grouped-query heads too.
// doc: document starts of every token [batch, seq] (null: none).
attention_result reference_tile(const ring_attention_shape& s, const std::vector<float>& qkv, const std::vector<float>& dy,
                                const std::vector<std::int64_t>* doc = nullptr) {
  const dml::nn::tile_attention_shape t{.batch = s.batch, .seq = s.seq, .heads = s.heads, .kv_heads = s.kv_heads,
                                        .head_dim = s.head_dim, .causal = s.causal};
  std::vector<float> lse(sz(dml::nn::tile_attention_saved_size(t))), ws(sz(dml::nn::tile_attention_workspace_size(t)));
  attention_result out{std::vector<float>(sz(s.batch * s.seq * s.width())), std::vector<float>(qkv.size())};
  const std::int64_t* d = doc ? doc->data() : nullptr;
  dml::nn::tile_attention_forward<dml::host>(t, qkv.data(), out.y.data(), lse.data(), d);
  dml::nn::tile_attention_backward<dml::host>(t, qkv.data(), out.y.data(), lse.data(), dy.data(), out.dqkv.data(),
                                              ws.data(), d);
  return out;
}

// One rank's rows of a whole [batch, seq, cols] array, by cp_position, and back.
template <class T>
std::vector<T> local_rows(const std::vector<T>& full, const ring_attention_shape& s, const cp_layout& at, std::int64_t cols) {
  const std::int64_t n = s.seq / at.ranks;
  std::vector<T> out(sz(s.batch * n * cols));
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t t = dml::nn::cp_position(at, s.seq, i);
      std::copy_n(full.begin() + (b * s.seq + t) * cols, cols, out.begin() + (b * n + i) * cols);
    }
  return out;
}
template <class T>
void put_rows(std::vector<T>& full, const std::vector<T>& part, const ring_attention_shape& s, const cp_layout& at,
              std::int64_t cols) {
  const std::int64_t n = s.seq / at.ranks;
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t t = dml::nn::cp_position(at, s.seq, i);
      std::copy_n(part.begin() + (b * n + i) * cols, cols, full.begin() + (b * s.seq + t) * cols);
    }
}

struct ring_counts {
  std::int64_t forward_sends = 0, backward_sends = 0, forward_recvs = 0, backward_recvs = 0;
  std::int64_t forward_gathers = 0, backward_gathers = 0, backward_scatters = 0;
};

// Ring attention over `ranks` thread ranks on the whole qkv and dy, each rank taking its rows; the results put
// back at their positions. ranks == 1 runs without a group. With backward false, dqkv stays empty. gather: K/V
// all-gathered (context_split::all_gather); doc: document starts of every token [batch, seq], each rank handing its
// tokens' to the call.
template <class T = float>
attention_result ring(const ring_attention_shape& s, int ranks, bool zigzag, const std::vector<float>& qkv,
                      const std::vector<float>& dy, bool backward = true, ring_counts* counts = nullptr,
                      bool gather = false, const std::vector<std::int64_t>* doc = nullptr) {
  const std::int64_t w = s.width(), ld = s.row();
  attention_result out{std::vector<float>(sz(s.batch * s.seq * w)), std::vector<float>(backward ? qkv.size() : 0)};
  auto body = [&](dml::nn::rank_group* group, int rank) {
    const cp_layout at{.ranks = ranks, .rank = rank, .zigzag = zigzag, .all_gather = gather};
    const std::vector<std::int64_t> docs = doc ? local_rows(*doc, s, at, 1) : std::vector<std::int64_t>{};
    const std::int64_t* d = doc ? docs.data() : nullptr;
    std::vector<T> q, g;
    for (float x : local_rows(qkv, s, at, ld)) q.push_back(T(x));
    for (float x : local_rows(dy, s, at, w)) g.push_back(T(x));
    std::vector<T> y(g.size()), dq(q.size(), T(1000.f));  // filled first: backward must overwrite
    // NaN in every scratch element: a masked score or a part of the workspace read before it is written shows.
    std::vector<float> lse(sz(dml::nn::ring_attention_saved_size(s, at)), NAN);
    std::vector<T> ws(sz(dml::nn::ring_attention_workspace_size(s, at)), T(NAN));
    if (group) group->set_pass(dml::nn::pass::forward);
    dml::nn::ring_attention_forward<dml::host>(s, at, group, q.data(), y.data(), lse.data(), ws.data(), d);
    if (backward) {
      if (group) group->set_pass(dml::nn::pass::backward);
      dml::nn::ring_attention_backward<dml::host>(s, at, group, q.data(), y.data(), lse.data(), g.data(), dq.data(),
                                                  ws.data(), d);
    }
    if (counts && group && rank == 0) {
      using dml::nn::group_op, dml::nn::pass;
      *counts = {group->calls(pass::forward, group_op::send),       group->calls(pass::backward, group_op::send),
                 group->calls(pass::forward, group_op::recv),       group->calls(pass::backward, group_op::recv),
                 group->calls(pass::forward, group_op::all_gather), group->calls(pass::backward, group_op::all_gather),
                 group->calls(pass::backward, group_op::reduce_scatter)};
    }
    std::vector<float> yf(y.begin(), y.end()), dqf(dq.begin(), dq.end());
    put_rows(out.y, yf, s, at, w);  // ranks write disjoint rows
    if (backward) put_rows(out.dqkv, dqf, s, at, ld);
  };
  if (ranks == 1) {
    body(nullptr, 0);
  } else {
    local::run(ranks, [&](local& comm) {
      dml::parallel::rank_group<local> group(comm);
      body(&group, comm.rank());
    });
  }
  return out;
}

// max |a − b| / max(1, |b|): absolute for values up to 1, relative above.
double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < b.size(); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - b[i]) / std::max(1.0, std::abs(double(b[i]))));
  return worst;
}

}  // namespace

TEST_CASE("the reference loop agrees with causal_attention_forward and backward") {
  const ring_attention_shape s{.batch = 2, .seq = 9, .heads = 2, .head_dim = 5, .causal = true};
  const auto qkv = random_vector(sz(s.batch * s.seq * 3 * s.width()), 3, -2.f, 2.f);
  const auto dy = random_vector(sz(s.batch * s.seq * s.width()), 4);
  const auto a = reference_loop(s, qkv, dy), b = reference_causal(s, qkv, dy);
  MESSAGE("y max_abs_diff=" << max_diff(a.y, b.y) << " dqkv max_abs_diff=" << max_diff(a.dqkv, b.dqkv));
  CHECK(max_diff(a.y, b.y) < 3e-6);  // seen: 2.0e-7 and 1.2e-7
  CHECK(max_diff(a.dqkv, b.dqkv) < 3e-6);
}

TEST_CASE("ring attention matches full attention on 1, 2 and 4 ranks, both masks, zig-zag or not") {
  for (bool causal : {true, false})
    for (bool zigzag : {true, false})
      for (int ranks : {1, 2, 4}) {
        CAPTURE(causal);
        CAPTURE(zigzag);
        CAPTURE(ranks);
        const ring_attention_shape s{.batch = 2, .seq = 16, .heads = 2, .head_dim = 8, .causal = causal};
        const auto qkv = random_vector(sz(s.batch * s.seq * 3 * s.width()), 7, -2.f, 2.f);
        const auto dy = random_vector(sz(s.batch * s.seq * s.width()), 8);
        const auto want = reference(s, qkv, dy);
        ring_counts counts;
        const auto got = ring(s, ranks, zigzag, qkv, dy, true, &counts);
        const double dy_diff = max_diff(got.y, want.y), dq_diff = max_diff(got.dqkv, want.dqkv);
        MESSAGE("causal=" << causal << " zigzag=" << zigzag << " cp=" << ranks << ": y max_abs_diff=" << dy_diff
                          << " dqkv max_abs_diff=" << dq_diff);
        // Seen: up to 5.4e-7 (the worst of these 12 layouts): the bound is under 10x that.
        CHECK(dy_diff < 3e-6);
        CHECK(dq_diff < 3e-6);
        if (ranks > 1) {  // K/V go round once forward; K/V once more and dK/dV a full turn backward
          CHECK(counts.forward_sends == ranks - 1);
          CHECK(counts.forward_recvs == ranks - 1);
          CHECK(counts.backward_sends == 2 * ranks - 1);
          CHECK(counts.backward_recvs == 2 * ranks - 1);
        }
      }
}

TEST_CASE("grouped-query ring attention (kv_heads 2 of 4, and multi-query) matches one rank's tile attention") {
  // K/V blocks of kv_heads·head_dim per token go round the ring; dK and dV sum over the query heads of each group and
  // over the ranks. seq 16: one tile per step; seq 520: local blocks of 260 and 130 tokens, several tiles a step,
  // zig-zag runs of 130 and 65 that start inside a tile.
  double worst_y = 0, worst_d = 0;
  for (std::int64_t seq : {16, 520})
    for (std::int64_t kv : {2, 1})
      for (bool causal : {true, false})
        for (bool zigzag : {true, false})
          for (int ranks : {2, 4}) {
            if (seq > 16 && !causal && kv == 1) continue;
            CAPTURE(seq);
            CAPTURE(kv);
            CAPTURE(causal);
            CAPTURE(zigzag);
            CAPTURE(ranks);
            const ring_attention_shape s{.batch = seq > 16 ? 1 : 2, .seq = seq, .heads = 4, .kv_heads = kv, .head_dim = 8,
                                         .causal = causal};
            const auto qkv = random_vector(sz(s.batch * s.seq * s.row()), 17, -2.f, 2.f);
            const auto dy = random_vector(sz(s.batch * s.seq * s.width()), 18);
            const auto want = reference_tile(s, qkv, dy);
            const auto got = ring(s, ranks, zigzag, qkv, dy);
            const double y_diff = max_diff(got.y, want.y), d_diff = max_diff(got.dqkv, want.dqkv);
            worst_y = std::max(worst_y, y_diff), worst_d = std::max(worst_d, d_diff);
            CHECK(y_diff < 2e-6);  // seen: up to 4.8e-7
            CHECK(d_diff < 2e-6);  // seen: up to 6.9e-7
          }
  MESSAGE("GQA and MQA against tile attention: y max_abs_diff=" << worst_y << " dqkv max_abs_diff=" << worst_d);
}

TEST_CASE("all-gathered K/V, and document masks with either exchange, match one rank's tile attention") {
  // All-gather: one all-gather forward; backward one more and one reduce-scatter of every block's dK/dV, no point to
  // point. Documents: row b cut at positions (5 + 3b) mod 11 + 1 and seq / 2 + 3, so documents cross chunks and
  // ranks, and a query sees keys of its own document in blocks of other ranks.
  double worst_y = 0, worst_d = 0;
  for (std::int64_t seq : {16, 520})
    for (std::int64_t kv : {2, 1})
      for (bool zigzag : {true, false})
        for (int ranks : {2, 4})
          for (bool gather : {true, false})
            for (bool documents : {true, false}) {
              if (!gather && !documents) continue;  // the test above
              if (seq > 16 && (kv == 1 || ranks == 4)) continue;
              CAPTURE(seq);
              CAPTURE(kv);
              CAPTURE(zigzag);
              CAPTURE(ranks);
              CAPTURE(gather);
              CAPTURE(documents);
              const ring_attention_shape s{.batch = 2, .seq = seq, .heads = 4, .kv_heads = kv, .head_dim = 8, .causal = true};
              const auto qkv = random_vector(sz(s.batch * s.seq * s.row()), 27, -2.f, 2.f);
              const auto dy = random_vector(sz(s.batch * s.seq * s.width()), 28);
              std::vector<std::int64_t> doc(sz(s.batch * s.seq));
              for (std::int64_t b = 0; b < s.batch; ++b)
                for (std::int64_t t = 0, start = 0; t < s.seq; ++t) {
                  if (t == (5 + 3 * b) % 11 + 1 || t == s.seq / 2 + 3) start = t;
                  doc[sz(b * s.seq + t)] = start;
                }
              const auto* d = documents ? &doc : nullptr;
              const auto want = reference_tile(s, qkv, dy, d);
              ring_counts counts;
              const auto got = ring(s, ranks, zigzag, qkv, dy, true, &counts, gather, d);
              const double y_diff = max_diff(got.y, want.y), d_diff = max_diff(got.dqkv, want.dqkv);
              worst_y = std::max(worst_y, y_diff), worst_d = std::max(worst_d, d_diff);
              CHECK(y_diff < 2e-6);
              CHECK(d_diff < 2e-6);
              if (gather) {
                CHECK(counts.forward_sends + counts.backward_sends + counts.forward_recvs + counts.backward_recvs == 0);
                CHECK(counts.forward_gathers == 1);
                CHECK(counts.backward_gathers == 1);
                CHECK(counts.backward_scatters == 1);
              }
            }
  MESSAGE("all-gather and documents against tile attention: y max_abs_diff=" << worst_y << " dqkv max_abs_diff=" << worst_d);
  // Masks change the result: with documents the output differs from without.
  const ring_attention_shape s{.batch = 1, .seq = 16, .heads = 2, .head_dim = 8, .causal = true};
  const auto qkv = random_vector(sz(s.batch * s.seq * s.row()), 29, -2.f, 2.f);
  const auto dy = random_vector(sz(s.batch * s.seq * s.width()), 30);
  std::vector<std::int64_t> doc(16);
  for (std::int64_t t = 0; t < 16; ++t) doc[sz(t)] = t < 9 ? 0 : 9;
  CHECK(max_diff(ring(s, 2, true, qkv, dy, true, nullptr, true, &doc).y, ring(s, 2, true, qkv, dy, true, nullptr, true).y) > 1e-3);
}

TEST_CASE("ring attention over 2 ranks stays finite where exp of the raw logits would overflow") {
  const ring_attention_shape s{.batch = 1, .seq = 8, .heads = 2, .head_dim = 4, .causal = true};
  const auto qkv = random_vector(sz(s.batch * s.seq * 3 * s.width()), 41, -30.f, 30.f);
  const auto dy = random_vector(sz(s.batch * s.seq * s.width()), 42);
  const auto want = reference_loop(s, qkv, dy);
  const auto got = ring(s, 2, true, qkv, dy, false);
  double worst = 0, scale = 0;
  bool finite = true;
  for (std::size_t i = 0; i < want.y.size(); ++i) {
    finite = finite && std::isfinite(got.y[i]);
    worst = std::max(worst, std::abs(double(got.y[i]) - want.y[i]));
    scale = std::max(scale, std::abs(double(want.y[i])));
  }
  MESSAGE("large logits over 2 ranks: max_abs_diff=" << worst << " of max |y| " << scale);
  CHECK(finite);
  CHECK(worst < 1e-3 * scale);
}

TEST_CASE("ring attention over 2 ranks: every element of dqkv matches central finite differences") {
  for (bool causal : {true, false}) {
    CAPTURE(causal);
    const ring_attention_shape s{.batch = 1, .seq = 8, .heads = 2, .head_dim = 3, .causal = causal};
    auto qkv = random_vector(sz(s.batch * s.seq * 3 * s.width()), 11);
    const auto r = random_vector(sz(s.batch * s.seq * s.width()), 12);
    const auto dqkv = ring(s, 2, true, qkv, r).dqkv;
    // loss = Σ y·r, so ∂loss/∂y = r; summed in double so the quotient sees only the attention's error.
    auto loss = [&] { return dml::nn::projected_loss(ring(s, 2, true, qkv, r, false).y, r); };
    const float h = 1e-2f;
    const std::int64_t w = s.width();
    double max_rel[3] = {0, 0, 0}, max_abs = 0;
    for (std::size_t i = 0; i < qkv.size(); ++i) {
      const double numeric = dml::nn::central_difference(qkv[i], h, loss, dml::nn::difference_step::stored);
      const auto part = sz((std::int64_t(i) % (3 * w)) / w);  // 0: q, 1: k, 2: v
      max_abs = std::max(max_abs, std::abs(dqkv[i] - numeric));
      max_rel[part] = std::max(max_rel[part], dml::nn::gradient_difference(dqkv[i], numeric));
    }
    MESSAGE("causal=" << causal << ": max_rel_diff dq=" << max_rel[0] << " dk=" << max_rel[1] << " dv=" << max_rel[2]
                      << " max_abs_diff=" << max_abs);
    CHECK(max_rel[0] < 2e-3);
    CHECK(max_rel[1] < 2e-3);
    CHECK(max_rel[2] < 2e-3);
  }
}

TEST_CASE("ring attention in bf16 over 2 ranks stays near float") {
  const ring_attention_shape s{.batch = 2, .seq = 16, .heads = 2, .head_dim = 8, .causal = true};
  const auto qkv = random_vector(sz(s.batch * s.seq * 3 * s.width()), 31);
  const auto dy = random_vector(sz(s.batch * s.seq * s.width()), 32);
  const auto want = ring<float>(s, 2, true, qkv, dy);
  const auto got = ring<dml::bf16>(s, 2, true, qkv, dy);
  const double y_diff = max_diff(got.y, want.y), d_diff = max_diff(got.dqkv, want.dqkv);
  MESSAGE("bf16 against float: y max_abs_diff=" << y_diff << " dqkv max_abs_diff=" << d_diff);
  CHECK(y_diff < 3e-2);
  CHECK(d_diff < 3e-2);
}

TEST_CASE("cp_position is a permutation of the sequence over the ranks of the ring, both layouts") {
  for (bool zigzag : {true, false})
    for (int ranks : {1, 2, 3, 4, 8}) {
      CAPTURE(zigzag);
      CAPTURE(ranks);
      const std::int64_t seq = 48, n = seq / ranks;
      std::set<std::int64_t> seen;
      bool in_range = true;
      for (int r = 0; r < ranks; ++r) {
        const cp_layout at{.ranks = ranks, .rank = r, .zigzag = zigzag};
        CHECK_NOTHROW(dml::nn::check_cp_layout(at, seq));
        for (std::int64_t i = 0; i < n; ++i) {
          const std::int64_t p = dml::nn::cp_position(at, seq, i);
          in_range = in_range && p >= 0 && p < seq;
          seen.insert(p);
        }
      }
      CHECK(in_range);
      CHECK(seen.size() == sz(seq));
    }
  // Zig-zag: rank 0 of 2 holds the first and the last quarter.
  const cp_layout first{.ranks = 2, .rank = 0, .zigzag = true};
  CHECK(dml::nn::cp_position(first, 16, 0) == 0);
  CHECK(dml::nn::cp_position(first, 16, 3) == 3);
  CHECK(dml::nn::cp_position(first, 16, 4) == 12);
  CHECK(dml::nn::cp_position(first, 16, 7) == 15);
}

TEST_CASE("a sequence that does not split into the layout's chunks is refused with what was expected") {
  using dml::invalid_argument;
  CHECK_THROWS_WITH_AS(dml::nn::check_cp_layout(cp_layout{.ranks = 2, .rank = 0, .zigzag = true}, 6),
                       doctest::Contains("expected seq divisible by 4 (2·ranks, zig-zag over 2 ranks), found seq = 6"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(dml::nn::check_cp_layout(cp_layout{.ranks = 4, .rank = 1, .zigzag = false}, 10),
                       doctest::Contains("expected seq divisible by 4 (ranks over 4 ranks), found seq = 10"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(dml::nn::check_cp_layout(cp_layout{.ranks = 2, .rank = 2}, 8),
                       doctest::Contains("expected a rank in [0, 2), found rank = 2"), invalid_argument);
  CHECK_NOTHROW(dml::nn::check_cp_layout(cp_layout{.ranks = 2, .rank = 1, .zigzag = false}, 6));

  // The call itself checks the layout, and that the group is the ring the layout names.
  const ring_attention_shape s{.batch = 1, .seq = 6, .heads = 1, .head_dim = 2};
  std::vector<float> buf(256);
  float* p = buf.data();
  CHECK_THROWS_WITH_AS(dml::nn::ring_attention_forward<dml::host>(s, cp_layout{.ranks = 2, .rank = 0}, nullptr, p, p, p, p),
                       doctest::Contains("found seq = 6"), invalid_argument);
  const ring_attention_shape s8{.batch = 1, .seq = 8, .heads = 1, .head_dim = 2};
  CHECK_THROWS_WITH_AS(dml::nn::ring_attention_forward<dml::host>(s8, cp_layout{.ranks = 2, .rank = 0}, nullptr, p, p, p, p),
                       doctest::Contains("expected a context-parallel group of 2 ranks, found none"), invalid_argument);
  const ring_attention_shape odd{.batch = 1, .seq = 8, .heads = 4, .kv_heads = 3, .head_dim = 2};
  CHECK_THROWS_WITH_AS(dml::nn::ring_attention_forward<dml::host>(odd, cp_layout{}, nullptr, p, p, p, p),
                       doctest::Contains("expected kv_heads dividing heads = 4, found kv_heads = 3"), invalid_argument);
  local::run(2, [&](local& comm) {
    dml::parallel::rank_group<local> group(comm);
    std::vector<float> mine(256);
    float* q = mine.data();
    CHECK_THROWS_WITH_AS(dml::nn::ring_attention_backward<dml::host>(s8, cp_layout{.ranks = 4, .rank = 0}, &group, q, q,
                                                                     q, q, q, q),
                         doctest::Contains("expected a group of 4 ranks in which this is rank 0, found 2 ranks"),
                         invalid_argument);
  });
}

TEST_CASE("memory: ring attention keeps one float per local row; its scratch is linear in seq, its K/V blocks in kv_heads") {
  using dml::nn::ring_attention_saved_size, dml::nn::ring_attention_workspace_size;
  const auto slack = dml::nn::detail::ring_align_slack;
  const ring_attention_shape s{.batch = 2, .seq = 256, .heads = 4, .head_dim = 8, .causal = true};
  auto gqa = s;
  gqa.kv_heads = 1;
  auto twice = s;
  twice.seq *= 2;
  std::int64_t bytes[3] = {};
  for (int ranks : {1, 2, 4}) {
    CAPTURE(ranks);
    const cp_layout at{.ranks = ranks, .rank = 0, .zigzag = true};
    const cp_layout whole{.ranks = 1, .rank = 0};
    CHECK(ring_attention_saved_size(s, at) * ranks == ring_attention_saved_size(s, whole));
    // No block of scores: twice the tokens, twice the scratch.
    CHECK(ring_attention_workspace_size(twice, at) - slack == 2 * (ring_attention_workspace_size(s, at) - slack));
    if (ranks > 1) CHECK(ring_attention_workspace_size(gqa, at) < ring_attention_workspace_size(s, at));
    bytes[ranks / 2] = (ring_attention_saved_size(s, at) + ring_attention_workspace_size(s, at)) * 4;
  }
  MESSAGE("float bytes, saved + workspace: cp=1 " << bytes[0] << ", cp=2 " << bytes[1] << ", cp=4 " << bytes[2]);
  // Sizes are functions of the shape alone.
  CHECK(bytes[0] == 155'656);
  CHECK(bytes[1] == 536'584);
  CHECK(bytes[2] == 268'296);
}

}  // namespace test_ring_attention
