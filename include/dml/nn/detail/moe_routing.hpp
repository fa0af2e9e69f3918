// SPDX-License-Identifier: Apache-2.0
// dml/nn/detail/moe_routing.hpp — how nn::moe routes, on the host: softmax and top-k, global counts over the batch,
// capacity and drops, the auxiliary losses, the dispatch order and counts exchange, and the router's gradient.
// Sits on nn/moe.hpp, which declares these members; used by nn/moe.hpp, which includes it at its end (included
// alone, it includes nn/moe.hpp first).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "dml/nn/moe.hpp"

namespace dml::nn {

// Scores and top-k of each token's logits (probs holds the logits on entry): the softmax always (the z-loss and
// softmax scoring read it), the sigmoid where it scores. The top-k are chosen by score plus the balancing bias
// (null: none; without it by logit, the same order), ties to the lower expert; the gates are the chosen scores,
// renormalised over the k where the config says, times route_scale.
inline void moe::route(const plan_view& v, std::int64_t n, const float* bias) const {
  const std::int64_t E = cfg.experts, K = cfg.top_k;
  const bool shifted = !cfg.logit_bias.empty(), sigmoid = cfg.score == router_score::sigmoid, norm = normalized();
  std::vector<float> key(static_cast<std::size_t>(E));
  std::vector<std::int64_t> order(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < n; ++t) {
    float* l = v.probs + t * E;
    if (shifted)
      for (std::int64_t e = 0; e < E; ++e) l[e] += cfg.logit_bias[static_cast<std::size_t>(e)];
    float* sc = sigmoid ? v.sig + t * E : l;
    if (sigmoid)
      for (std::int64_t e = 0; e < E; ++e) sc[e] = 1.f / (1.f + std::exp(-l[e]));
    if (!bias) std::copy(l, l + E, key.begin());
    float m = l[0];
    for (std::int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
    float s = 0.f;
    for (std::int64_t e = 0; e < E; ++e) s += (l[e] = std::exp(l[e] - m));
    for (std::int64_t e = 0; e < E; ++e) l[e] /= s;
    v.lse[t] = m + std::log(s);
    if (bias)
      for (std::int64_t e = 0; e < E; ++e) key[static_cast<std::size_t>(e)] = sc[e] + bias[e];
    for (std::int64_t e = 0; e < E; ++e) order[static_cast<std::size_t>(e)] = e;
    std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](std::int64_t a, std::int64_t b) {
      const float ka = key[static_cast<std::size_t>(a)], kb = key[static_cast<std::size_t>(b)];
      return ka > kb || (ka == kb && a < b);
    });
    float sum = 0.f;
    for (std::int64_t j = 0; j < K; ++j) sum += sc[order[static_cast<std::size_t>(j)]];
    for (std::int64_t j = 0; j < K; ++j) {
      const std::int64_t e = order[static_cast<std::size_t>(j)];
      v.expert[t * K + j] = e;
      v.gate[t * K + j] = cfg.route_scale * (norm ? sc[e] / sum : sc[e]);
    }
  }
}

// Where this rank's tokens sit in the global micro-batch: ranks of the data group in order, then (sequence
// parallel) of the tensor group.
inline int moe::stat_ranks(const context& c) const {
  return (c.data ? c.data->size() : 1) * (sequence() ? c.tp->size() : 1);
}
inline int moe::stat_rank(const context& c) const {
  return (c.data ? c.data->rank() : 0) * (sequence() ? c.tp->size() : 1) + (sequence() ? c.tp->rank() : 0);
}
inline void moe::sum_over_batch(const context& c, std::vector<double>& s) const {
  const auto n = static_cast<std::int64_t>(s.size());
  if (c.data && c.data->size() > 1) c.data->all_reduce_sum(s.data(), n);
  if (sequence()) c.tp->all_reduce_sum(s.data(), n);
}

// Global counts and sums, capacity, which assignments are kept, the dispatch order, the counts exchange.
inline moe::routing moe::decide(const context& c, const plan_view& v, std::int64_t n, std::int64_t tokens_per_row) const {
  namespace mi = detail::moe_impl;
  const std::int64_t E = cfg.experts, K = cfg.top_k, P = ep_ranks, el = local_experts(), KE = K * E;
  const int ranks = stat_ranks(c), me = stat_rank(c);
  // Each rank fills its slot of per-(choice, expert) counts, then the router's sums: every rank then knows
  // how many assignments to each expert come before its own (the queue order is choice, rank, row).
  std::vector<double> st(static_cast<std::size_t>(ranks * KE + E + 2), 0.0);
  double* mine = st.data() + me * KE;
  double* psum = st.data() + ranks * KE;
  for (std::int64_t t = 0; t < n; ++t) {
    for (std::int64_t j = 0; j < K; ++j) mine[j * E + v.expert[t * K + j]] += 1;
    if (cfg.score == router_score::sigmoid) {  // P_e over the scores normalised per token (DeepSeek-V3)
      const float* sc = v.sig + t * E;
      double total = 0;
      for (std::int64_t e = 0; e < E; ++e) total += sc[e];
      for (std::int64_t e = 0; e < E; ++e) psum[e] += sc[e] / total;
    } else {
      for (std::int64_t e = 0; e < E; ++e) psum[e] += v.probs[t * E + e];
    }
    psum[E] += static_cast<double>(v.lse[t]) * v.lse[t];
  }
  psum[E + 1] = static_cast<double>(n);
  sum_over_batch(c, st);

  routing r;
  const double tokens = psum[E + 1];
  const std::int64_t cap = capacity(static_cast<std::int64_t>(tokens));
  std::vector<std::int64_t> base(static_cast<std::size_t>(KE), 0);
  r.assigned.assign(static_cast<std::size_t>(E), 0);
  r.dropped.assign(static_cast<std::size_t>(E), 0);
  for (int q = 0; q < ranks; ++q)
    for (std::int64_t j = 0; j < K; ++j)
      for (std::int64_t e = 0; e < E; ++e) {
        const auto cnt = static_cast<std::int64_t>(st[static_cast<std::size_t>(q * KE + j * E + e)]);
        r.assigned[static_cast<std::size_t>(e)] += cnt;
        for (std::int64_t j2 = j + 1; j2 < K; ++j2) base[static_cast<std::size_t>(j2 * E + e)] += cnt;
        if (q < me) base[static_cast<std::size_t>(j * E + e)] += cnt;
      }
  for (std::int64_t e = 0; e < E; ++e)
    r.dropped[static_cast<std::size_t>(e)] = std::max<std::int64_t>(0, r.assigned[static_cast<std::size_t>(e)] - cap);

  // The losses, identical on every rank.
  double* meta = v.meta;
  double* f = meta + mi::meta_fixed;
  double* pm = f + E;
  double aux = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    f[e] = tokens > 0 ? static_cast<double>(r.assigned[static_cast<std::size_t>(e)]) / (tokens * static_cast<double>(K)) : 0.0;
    pm[e] = tokens > 0 ? psum[e] / tokens : 0.0;
    aux += f[e] * pm[e];
  }
  meta[mi::tokens] = tokens;
  meta[mi::aux] = static_cast<double>(E) * aux;
  meta[mi::z] = tokens > 0 ? psum[E] / tokens : 0.0;
  meta[mi::share] = c.global_batch > 0 ? tokens / static_cast<double>(tokens_per_row) / static_cast<double>(c.global_batch) : 1.0;
  meta[mi::capacity] = static_cast<double>(cap);

  // Kept assignments in dispatch order: by expert (so by destination rank), then choice, then row.
  std::vector<std::int64_t> kept(static_cast<std::size_t>(KE), 0), seen(static_cast<std::size_t>(KE), 0);
  std::vector<char> keep(static_cast<std::size_t>(n * K), 0);
  for (std::int64_t j = 0; j < K; ++j)
    for (std::int64_t t = 0; t < n; ++t) {
      const std::size_t q = static_cast<std::size_t>(j * E + v.expert[t * K + j]);
      if (base[q] + seen[q]++ < cap) {
        keep[static_cast<std::size_t>(t * K + j)] = 1;
        ++kept[q];
      }
    }
  std::vector<std::int64_t> at(static_cast<std::size_t>(KE), 0);  // first dispatch slot of (expert, choice)
  std::int64_t sent = 0;
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t j = 0; j < K; ++j) {
      at[static_cast<std::size_t>(e * K + j)] = sent;
      sent += kept[static_cast<std::size_t>(j * E + e)];
    }
  std::int64_t* send = v.counts;
  std::int64_t* recv = v.counts + E;
  std::fill(send, send + E, std::int64_t{0});
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t j = 0; j < K; ++j) {
      const std::int64_t i = t * K + j, e = v.expert[i];
      if (!keep[static_cast<std::size_t>(i)]) {
        v.slot[i] = -1;
        continue;
      }
      const std::int64_t s = at[static_cast<std::size_t>(e * K + j)]++;
      v.slot[i] = s;
      v.send_token[s] = t;
      v.send_gate[s] = v.gate[i];
      ++send[e];
    }
  // Every rank exchanges counts, even with nothing to send, so no rank waits on another's rows.
  if (P > 1) c.ep->all_to_all(send, recv, el);
  else std::copy(send, send + E, recv);
  finish(v, r);
  meta[mi::sent] = static_cast<double>(r.sent);
  meta[mi::received] = static_cast<double>(r.received);
  const std::int64_t rmax = max_received(n);
  if (r.received > rmax)
    fail<invalid_argument>("dml::nn::moe: expert rank ", ep_rank, " received ", r.received, " rows, expected at most ", rmax,
                           " (", ep_ranks, " ranks × ", n, " rows × top-", K, ", or its experts' capacity over ",
                           batch_ranks, " ranks' tokens): a rank passes more rows than this one: set group_rows to the "
                           "most any rank passes, and batch_ranks to the ranks the capacity counts");
  // Expert order: for each local expert, its rows from each source rank in rank order.
  std::int64_t p = 0;
  for (std::int64_t le = 0; le < el; ++le)
    for (std::int64_t q = 0; q < P; ++q) {
      std::int64_t from = 0;
      for (std::int64_t q2 = 0; q2 < q; ++q2)
        for (std::int64_t l2 = 0; l2 < el; ++l2) from += recv[q2 * el + l2];
      for (std::int64_t l2 = 0; l2 < le; ++l2) from += recv[q * el + l2];
      for (std::int64_t i = 0; i < recv[q * el + le]; ++i, ++p) {
        v.perm[p] = from + i;
        v.inv[from + i] = p;
      }
    }
  return r;
}
// The sizes that follow from the counts (forward, and backward from the saved plan).
inline void moe::finish(const plan_view& v, routing& r) const {
  const std::int64_t E = cfg.experts, P = ep_ranks, el = local_experts(), C = cfg.dim;
  const std::int64_t* send = v.counts;
  const std::int64_t* recv = v.counts + E;
  r.send_values.assign(static_cast<std::size_t>(P), 0);
  r.recv_values.assign(static_cast<std::size_t>(P), 0);
  r.rows.assign(static_cast<std::size_t>(el), 0);
  r.offset.assign(static_cast<std::size_t>(el), 0);
  r.sent = r.received = 0;
  for (std::int64_t q = 0; q < P; ++q)
    for (std::int64_t le = 0; le < el; ++le) {
      r.send_values[static_cast<std::size_t>(q)] += send[q * el + le] * C;
      r.recv_values[static_cast<std::size_t>(q)] += recv[q * el + le] * C;
      r.rows[static_cast<std::size_t>(le)] += recv[q * el + le];
      r.sent += send[q * el + le];
      r.received += recv[q * el + le];
    }
  for (std::int64_t le = 1; le < el; ++le)
    r.offset[static_cast<std::size_t>(le)] = r.offset[static_cast<std::size_t>(le - 1)] + r.rows[static_cast<std::size_t>(le - 1)];
  if (P > 1) {
    const auto me = static_cast<std::size_t>(ep_rank);
    r.a2a_bytes = (r.sent * C - r.send_values[me]) + (r.received * C - r.recv_values[me]);
  }
}
inline moe::routing moe::recall(const plan_view& v) const {
  routing r;
  finish(v, r);
  return r;
}

// ∂/∂logits of: the combine through the gates (dgate), and weight · share · loss_scale · (aux or z). The gates'
// and aux's gradients reach the scores first, then the logits through the softmax or the sigmoid; the z-loss's
// through the softmax.
template <class T>
void moe::router_grad(const context& c, const plan_view& v, const float* dgate, T* out, std::int64_t n) const {
  namespace mi = detail::moe_impl;
  const std::int64_t E = cfg.experts, K = cfg.top_k;
  const bool sigmoid = cfg.score == router_score::sigmoid, norm = normalized();
  const double tokens = v.meta[mi::tokens], scale = v.meta[mi::share] * static_cast<double>(c.loss_scale);
  const double w_aux = cfg.aux_loss_weight * scale, w_z = cfg.z_loss_weight * scale, rs = cfg.route_scale;
  const double* f = v.meta + mi::meta_fixed;
  std::vector<double> ds(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < n; ++t) {
    const float* p = v.probs + t * E;
    const float* sc = sigmoid ? v.sig + t * E : p;
    // aux = E Σ_e f_e P_e: ∂aux/∂(token's normalised score e) = E f_e / tokens.
    const double a = w_aux * static_cast<double>(E) / tokens;
    double total = 1, pa = 0;
    if (sigmoid) {
      total = 0;
      for (std::int64_t e = 0; e < E; ++e) total += sc[e];
      for (std::int64_t e = 0; e < E; ++e) pa += a * f[e] * sc[e] / total;
    }
    for (std::int64_t e = 0; e < E; ++e) ds[static_cast<std::size_t>(e)] = (a * f[e] - pa) / total;
    // The gates: g_j = rs · s_j / S (S = Σ of the chosen scores when renormalised, else 1).
    double sum = 0, dot = 0;
    for (std::int64_t j = 0; j < K; ++j) {
      const double sj = sc[v.expert[t * K + j]];
      sum += sj;
      dot += dgate[t * K + j] * sj;
    }
    for (std::int64_t j = 0; j < K; ++j)
      ds[static_cast<std::size_t>(v.expert[t * K + j])] += norm ? rs * (dgate[t * K + j] / sum - dot / (sum * sum)) : rs * dgate[t * K + j];
    // Scores to logits; the z-loss, mean(lse²), adds 2·lse/tokens · softmax.
    const double zc = w_z * 2.0 * v.lse[t] / tokens;
    double dp = 0;
    if (!sigmoid)
      for (std::int64_t e = 0; e < E; ++e) dp += ds[static_cast<std::size_t>(e)] * p[e];
    for (std::int64_t e = 0; e < E; ++e) {
      const double d = ds[static_cast<std::size_t>(e)];
      const double dl = sigmoid ? d * sc[e] * (1.0 - sc[e]) : p[e] * (d - dp);
      out[t * E + e] = T(static_cast<float>(dl + zc * p[e]));
    }
  }
}

}  // namespace dml::nn
