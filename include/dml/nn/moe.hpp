// SPDX-License-Identifier: Apache-2.0
// dml/nn/moe.hpp — a mixture-of-experts MLP: a router sends each token to its top-k of E GELU or SwiGLU MLPs,
// beside shared experts that every token passes through.
// Sits on nn/layer.hpp, nn/rank_group.hpp and core/gemm.hpp; gpt_block runs it in place of its dense MLP.
// Its parts: nn/detail/moe_kernels.hpp (the per-element functors) and nn/detail/moe_routing.hpp (routing and
// the router's gradient, on the host).
//
// Routing follows Switch (k = 1, gate p_top1), GShard and Mixtral (k >= 2, gates renormalised over the k) or
// DeepSeek-V3 (sigmoid scores, renormalised, scaled), with an expert capacity of ceil(capacity_factor · N · k / E)
// assignments over the N tokens of the global micro-batch, the load-balancing loss E · Σ_e f_e · P_e, the
// router z-loss mean(logsumexp²) (ST-MoE), and DeepSeek-V3's loss-free balancing: a per-expert bias added to
// the scores for choosing only, moved after each step toward equal load (parallel::update_router_bias).
// Every decision that depends on other ranks' tokens is made from global counts (one all-reduce of a small
// array of doubles over the data group), so a batch split over data-parallel ranks drops, routes and
// balances exactly as one rank holding all of it would.
//
// Expert parallelism (set_expert_split): rank r of the expert group holds experts [r·E/ep, (r+1)·E/ep); tokens
// travel to them and back with two all-to-alls per pass. Routing is decided on the host from a host copy of
// the router logits (a few numbers per token); every per-element pass runs as a functor in the layer's space.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/buffer.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/gemm.hpp"
#include "dml/nn/activation.hpp"
#include "dml/nn/detail/moe_kernels.hpp"
#include "dml/nn/detail/rows.hpp"
#include "dml/nn/layer.hpp"
#include "dml/nn/rank_group.hpp"
#include "dml/nn/swiglu.hpp"

namespace dml::nn {

// An expert's MLP: c_fc → GELU-tanh → c_proj (GPT), or SwiGLU with gate and up as one c_fc of 2·hidden rows
// (Mixtral, Qwen3-MoE, DeepSeek-V3).
enum class expert_mlp : std::uint8_t { gelu, swiglu };
// The router's scores from its logits: softmax over the experts, or each expert's sigmoid (DeepSeek-V3).
enum class router_score : std::uint8_t { softmax, sigmoid };

struct moe_config {
  std::int64_t dim = 0, hidden = 0;  // hidden: each expert's width (fine-grained experts: below 4·dim); 0: 4·dim
  std::int64_t experts = 8;
  int top_k = 2;                     // 1 to experts
  float capacity_factor = 1.25f;     // <= 0: dropless
  float aux_loss_weight = 0.01f, z_loss_weight = 0.001f;
  bool bias = false;                 // biases in the experts' Linears
  float proj_std = 0.02f;            // c_proj's init std (a GPT passes its scaled residual init)
  std::vector<float> logit_bias{};   // empty, or one constant per expert added to the router logits
  expert_mlp mlp = expert_mlp::gelu;
  std::int64_t shared = 0;           // shared experts: one MLP of shared · hidden beside the routed ones
  router_score score = router_score::softmax;
  std::optional<bool> normalize{};   // gates renormalised over the top-k; unset: k > 1 (Switch keeps p_top1)
  float route_scale = 1.f;           // gates times this (DeepSeek-V3's routed_scaling_factor: 2.5)
  float bias_rate = 0.f;             // > 0: loss-free balancing, the selection bias's step per training step
};

// Router logit offsets that skew the load on purpose (benchmarks, tests): expert e gets scale · (−s · ln(e+1)),
// a Zipf-like preference for low experts; s = 0 gives none, and a large scale sends every token's top-1
// choice to expert 0.
inline std::vector<float> skewed_logit_bias(std::int64_t experts, double s, double scale) {
  if (experts <= 0) fail<invalid_argument>("dml::nn::skewed_logit_bias: expected a positive number of experts, found ", experts);
  std::vector<float> out(static_cast<std::size_t>(experts));
  for (std::int64_t e = 0; e < experts; ++e)
    out[static_cast<std::size_t>(e)] = static_cast<float>(scale * (-s * std::log(static_cast<double>(e + 1))));
  return out;
}

namespace detail::moe_impl {
// Indices into the plan's meta array of doubles; the per-expert f_e and P_e follow.
enum meta_index : int { tokens, share, aux, z, capacity, received, sent, meta_fixed };
}  // namespace detail::moe_impl

// A mixture-of-experts MLP on [..., dim] rows: models nn::layer, and gpt_block calls its row-level entry
// points (forward_rows, backward_rows) on its ln_2 output.
struct moe {
  static constexpr std::int64_t static_in = dynamic;
  static constexpr std::int64_t static_out = dynamic;
  static constexpr bool preserves_width = true;
  static constexpr bool uses_row_index = true;  // the routing record is keyed by the micro-batch's first row
  static constexpr const char* kind = "moe";

  moe_config cfg;
  std::int64_t hidden = 0;
  int ep_ranks = 1, ep_rank = 0, batch_ranks = 0;  // set_expert_split
  tensor_split split{};
  // The most rows any rank of the expert group passes in one call (0: as many as this one). Buffers are sized
  // for an expert rank receiving every top-k choice of that many rows from each rank of the group.
  std::int64_t group_rows = 0;

  explicit moe(moe_config c) : cfg(std::move(c)), hidden(cfg.hidden ? cfg.hidden : 4 * cfg.dim) {
    if (cfg.dim <= 0 || hidden <= 0 || cfg.experts <= 0)
      fail<invalid_argument>("dml::nn::moe: sizes must be positive, found dim ", cfg.dim, ", hidden ", hidden, ", experts ",
                             cfg.experts);
    if (cfg.top_k < 1)
      fail<invalid_argument>("dml::nn::moe: expected top_k >= 1, found ", cfg.top_k);
    if (cfg.shared < 0)
      fail<invalid_argument>("dml::nn::moe: expected shared experts >= 0, found ", cfg.shared);
    if (!(cfg.bias_rate >= 0.f) || !(cfg.route_scale > 0.f))
      fail<invalid_argument>("dml::nn::moe: expected bias_rate >= 0 and route_scale > 0, found ", cfg.bias_rate, " and ",
                             cfg.route_scale);
    if (cfg.top_k > cfg.experts)
      fail<invalid_argument>("dml::nn::moe: top-k larger than the number of experts: expected top_k <= ", cfg.experts,
                             ", found top_k ", cfg.top_k);
    if (!cfg.logit_bias.empty() && static_cast<std::int64_t>(cfg.logit_bias.size()) != cfg.experts)
      fail<invalid_argument>("dml::nn::moe: expected logit_bias empty or of ", cfg.experts, " values (one per expert), found ",
                             cfg.logit_bias.size());
  }

  // This rank's share of the experts: rank `rank` of an expert-parallel group of `ranks`.
  // batch_ranks: the ranks whose tokens one micro-batch's capacity counts (the data group, times the tensor group
  // under sequence parallelism; 0: unknown), which bounds what a rank can receive when the capacity is finite.
  void set_expert_split(int ranks, int rank, int batch_ranks = 0) {
    if (ranks < 1 || rank < 0 || rank >= ranks)
      fail<invalid_argument>("dml::nn::moe: expected 0 <= expert-parallel rank < ranks, found rank ", rank, " of ", ranks);
    if (cfg.experts % ranks != 0)
      fail<invalid_argument>("dml::nn::moe: experts not divisible by ep: expected a multiple of the expert-parallel degree ",
                             ranks, ", found ", cfg.experts, " experts");
    ep_ranks = ranks;
    ep_rank = rank;
    this->batch_ranks = batch_ranks;
  }
  // Tensor parallelism keeps every expert whole on each tensor rank. Under sequence parallelism the tensor
  // ranks hold different tokens, so the gradients are partial over the tensor group and the router's batch
  // statistics sum over it too.
  void set_split(tensor_split s) {
    if (s.ranks < 1 || s.rank < 0 || s.rank >= s.ranks)
      fail<invalid_argument>("dml::nn::moe: expected 0 <= rank < ranks, found rank ", s.rank, " of ", s.ranks);
    split = s;
  }
  bool sequence() const { return split.sequence && split.ranks > 1; }
  std::int64_t local_experts() const { return cfg.experts / ep_ranks; }
  bool swiglu() const { return cfg.mlp == expert_mlp::swiglu; }
  // c_fc's rows per expert: hidden, or gate and up (2·hidden) for SwiGLU; the shared MLP's width and c_fc rows.
  std::int64_t fc_rows() const { return swiglu() ? 2 * hidden : hidden; }
  std::int64_t shared_hidden() const { return cfg.shared * hidden; }
  std::int64_t shared_fc_rows() const { return cfg.shared * fc_rows(); }
  bool normalized() const { return cfg.normalize.value_or(cfg.top_k > 1); }

  std::vector<param_spec> parameters() const {
    const std::int64_t C = cfg.dim, H = hidden, E = cfg.experts, el = local_experts();
    const bool sp = sequence();
    auto experts = [&](std::int64_t rows, std::int64_t cols) {
      return param_shard{.rows = rows, .cols = cols, .axis = 0, .blocks = 1, .rank = ep_rank, .ranks = ep_ranks,
                         .group = shard_group::expert};
    };
    std::vector<param_spec> out;
    out.push_back({"router.weight", {E, C}, init_kind::normal, 0.f, 0.02f, {}, sp});
    const std::int64_t F = fc_rows();
    out.push_back({"experts.c_fc.weight", {el * F, C}, init_kind::normal, 0.f, 0.02f, experts(E * F, C), sp});
    if (cfg.bias) out.push_back({"experts.c_fc.bias", {el * F}, init_kind::zeros, 0.f, 0.f, experts(E * F, 1), sp});
    out.push_back({"experts.c_proj.weight", {el * C, H}, init_kind::normal, 0.f, cfg.proj_std, experts(E * C, H), sp});
    if (cfg.bias) out.push_back({"experts.c_proj.bias", {el * C}, init_kind::zeros, 0.f, 0.f, experts(E * C, 1), sp});
    if (cfg.shared > 0) {
      const std::int64_t SF = shared_fc_rows(), SH = shared_hidden();
      out.push_back({"shared.c_fc.weight", {SF, C}, init_kind::normal, 0.f, 0.02f, {}, sp});
      if (cfg.bias) out.push_back({"shared.c_fc.bias", {SF}, init_kind::zeros, 0.f, 0.f, {}, sp});
      out.push_back({"shared.c_proj.weight", {C, SH}, init_kind::normal, 0.f, cfg.proj_std, {}, sp});
      if (cfg.bias) out.push_back({"shared.c_proj.bias", {C}, init_kind::zeros, 0.f, 0.f, {}, sp});
    }
    return out;
  }
  dml::shape output_shape(dml::shape x) const {
    detail::expect_cols(kind, cfg.dim, x);
    return x;
  }
  // The router (2·C·E per token), top_k experts' c_fc and c_proj (2·C·(F + H) per token and choice, F = c_fc's
  // rows) and the shared MLP: the work of a rank's tokens, wherever the all-to-all sends them to be done.
  double forward_flops(dml::shape x) const {
    const double n = static_cast<double>(x.numel() / cfg.dim), c = static_cast<double>(cfg.dim);
    const double expert = 2 * static_cast<double>(fc_rows() + hidden), shared = 2 * static_cast<double>(shared_fc_rows() + shared_hidden());
    return n * c * (2 * static_cast<double>(cfg.experts) + static_cast<double>(cfg.top_k) * expert + shared);
  }

  // Assignments an expert keeps out of a micro-batch of `tokens` global tokens (dropless: no limit).
  std::int64_t capacity(std::int64_t tokens) const {
    if (cfg.capacity_factor <= 0.f) return std::numeric_limits<std::int64_t>::max();
    return static_cast<std::int64_t>(std::ceil(static_cast<double>(cfg.capacity_factor) * static_cast<double>(tokens) *
                                               cfg.top_k / static_cast<double>(cfg.experts)));
  }
  // Rows an expert rank can receive in one pass: every rank of the group sending here each of its tokens' top-k
  // choices that this rank's experts hold (distinct experts: at most min(k, local experts) a token); with a finite
  // capacity and batch_ranks known, no more than its experts keep of the batch ranks' tokens.
  std::int64_t max_received(std::int64_t rows) const {
    const std::int64_t r = std::max(rows, group_rows), el = cfg.experts / ep_ranks;
    const std::int64_t most = ep_ranks * r * std::min<std::int64_t>(cfg.top_k, el);
    if (cfg.capacity_factor <= 0.f || batch_ranks <= 0) return most;
    return std::min(most, el * capacity(batch_ranks * r));
  }

  std::int64_t saved_bytes_rows(std::int64_t rows, std::size_t value_bytes) const {
    detail::carver k;
    saved_parts(k, rows, value_bytes);
    return k.used;
  }
  std::int64_t workspace_rows(std::int64_t rows) const {
    detail::carver k;
    work_parts(k, rows, sizeof(float));  // floats: enough for any working type
    return (k.used + 3) / 4;
  }
  std::int64_t saved_bytes(dml::shape x, std::size_t value_bytes) const { return saved_bytes_rows(x.rows(), value_bytes); }
  std::int64_t workspace_size(dml::shape x) const { return workspace_rows(x.rows()); }

  template <execution_space S, class T>
  void forward(const context& c, layer_params<T> p, tensor_view<const T, S> x, tensor_view<T, S> y) const {
    forward_rows<S>(c, p.w, x.data, y.data, x.shape.rows(), c.saved, c.workspace, tokens_per_row(x.shape));
  }
  template <execution_space S, class T>
  void backward(const context& c, layer_params<T> p, tensor_view<const T, S> x, tensor_view<const T, S>,
                tensor_view<const T, S> dy, tensor_view<T, S> dx) const {
    backward_rows<S>(c, p.w, p.g, x.data, dy.data, dx.data, x.shape.rows(), c.saved, c.workspace, tokens_per_row(x.shape));
  }

  // The layer on `rows` tokens x [rows, dim] → y [rows, dim]. w: the parameters in parameters() order; saved:
  // saved_bytes_rows(rows) bytes kept for backward_rows; workspace: workspace_rows(rows) floats.
  // tokens_per_row: tokens in one row of the global batch (T for [B, T, C] sequences, 1 for [N, C]), so the
  // auxiliary losses' share of the step's batch is (global tokens / tokens_per_row) / context::global_batch.
  template <execution_space S, class T>
  void forward_rows(const context& c, T* const* w, const T* x, T* y, std::int64_t rows, std::byte* saved, float* workspace,
                    std::int64_t tokens_per_row = 1) const {
    check_context(c);
    namespace mi = detail::moe_impl;
    const std::int64_t N = rows, C = cfg.dim, E = cfg.experts, K = cfg.top_k, P = ep_ranks;
    const auto wt = roles(w);
    const auto sv = saved_parts<T>(saved, N);
    const auto ws = work_parts<T>(workspace, N);

    // The router's logits, then every routing decision on the host.
    gemm<S>({.ta = trans::n, .tb = trans::t, .m = N, .n = E, .k = C, .a = x, .lda = C, .b = static_cast<const T*>(wt.router),
             .ldb = C, .c = ws.logits, .ldc = E});
    host_plan hp(*this, N);
    dml::copy_n(static_cast<const float*>(ws.logits), static_cast<std::size_t>(N * E), hp.v.probs);
    route(hp.v, N, selection_bias(c));
    const routing r = decide(c, hp.v, N, tokens_per_row);
    dml::copy_n(hp.bytes(), static_cast<std::size_t>(hp.v.bytes), saved);
    const plan_view dp = plan_parts(saved, N);

    // Dispatch: x rows in (expert, choice, token) order, over the expert group, into expert-major order.
    T* xe = sv.xe;
    if (P == 1) {
      detail::token_rows<S>(r.sent, C, kernels::moe_gather_rows<T>{x, dp.send_token, nullptr, xe, C});
    } else {
      detail::token_rows<S>(r.sent, C, kernels::moe_gather_rows<T>{x, dp.send_token, nullptr, ws.xs, C});
      exchange(c, ws.xs, r.send_values, ws.xr, r.recv_values);
      detail::token_rows<S>(r.received, C, kernels::moe_gather_rows<T>{ws.xr, dp.perm, nullptr, xe, C});
    }
    // Each local expert on its block of rows: c_fc → GELU-tanh → c_proj. With one expert rank, expert order
    // is dispatch order and the outputs land where the combine reads them.
    T* ye = P == 1 ? sv.yr : ws.ye;
    expert_forward<S>(wt, r, xe, sv.f, ws.h1, ye);
    if (P > 1) {
      detail::token_rows<S>(r.received, C, kernels::moe_gather_rows<T>{ye, dp.inv, nullptr, ws.xr, C});
      exchange(c, ws.xr, r.recv_values, sv.yr, r.send_values);
    }
    // The shared experts write y, the routed ones' gated sum adds to it.
    if (cfg.shared > 0) {
      detail::linear_forward<S>(N, C, shared_fc_rows(), x, static_cast<const T*>(wt.sfc_w), static_cast<const T*>(wt.sfc_b), sv.fs);
      activate<S>(static_cast<const T*>(sv.fs), ws.hs, N, shared_hidden());
      detail::linear_forward<S>(N, shared_hidden(), C, static_cast<const T*>(ws.hs), static_cast<const T*>(wt.sproj_w),
                                static_cast<const T*>(wt.sproj_b), y);
    }
    detail::token_rows<S>(N, C, kernels::moe_combine<T>{sv.yr, dp.slot, dp.gate, y, C, K, cfg.shared > 0});

    if (c.routing) {
      routing_record rec;
      rec.tokens = r.assigned;
      rec.dropped = r.dropped;
      rec.a2a_bytes = r.a2a_bytes * static_cast<std::int64_t>(sizeof(T));
      rec.aux_loss = hp.v.meta[mi::aux];
      rec.z_loss = hp.v.meta[mi::z];
      rec.share = hp.v.meta[mi::share];
      rec.bias_rate = c.training ? cfg.bias_rate : 0.f;
      c.routing->records[{c.layer, c.row_offset}] = std::move(rec);
    }
  }

  // Gradients of forward_rows: g (this layer's gradients, parameters() order) written or accumulated per
  // context::accumulate, dx [rows, dim] overwritten (skipped when null). Every rank of the expert group must
  // call it, whatever its rows, as in forward.
  template <execution_space S, class T>
  void backward_rows(const context& c, T* const* w, T* const* g, const T* x, const T* dy, T* dx, std::int64_t rows,
                     std::byte* saved, float* workspace, std::int64_t tokens_per_row = 1) const {
    (void)tokens_per_row;  // the share was fixed in forward
    check_context(c);
    const std::int64_t N = rows, C = cfg.dim, E = cfg.experts, K = cfg.top_k, P = ep_ranks;
    const auto wt = roles(w);
    const auto gt = roles(g);
    const auto sv = saved_parts<T>(saved, N);
    const auto ws = work_parts<T>(workspace, N);
    const bool acc = c.accumulate;

    host_plan hp(*this, N);
    dml::copy_n(static_cast<const std::byte*>(saved), static_cast<std::size_t>(hp.v.host_bytes), hp.bytes());
    const routing r = recall(hp.v);
    const plan_view dp = plan_parts(saved, N);

    // The gates' gradients, for the router, on the host.
    for_each_index<S>(N * K, kernels::moe_gate_grad<T>{dy, sv.yr, dp.slot, ws.dgate, C, K});
    std::vector<float> dgate(static_cast<std::size_t>(N * K));
    dml::copy_n(static_cast<const float*>(ws.dgate), dgate.size(), dgate.data());

    // gate · dy to the experts, in the order the inputs went.
    if (P == 1) {
      detail::token_rows<S>(r.sent, C, kernels::moe_gather_rows<T>{dy, dp.send_token, dp.send_gate, ws.ye, C});
    } else {
      detail::token_rows<S>(r.sent, C, kernels::moe_gather_rows<T>{dy, dp.send_token, dp.send_gate, ws.xs, C});
      exchange(c, ws.xs, r.send_values, ws.xr, r.recv_values);
      detail::token_rows<S>(r.received, C, kernels::moe_gather_rows<T>{ws.xr, dp.perm, nullptr, ws.ye, C});
    }
    expert_backward<S>(wt, gt, r, sv.xe, sv.f, ws.ye, ws.h1, ws.h2, ws.dxe, acc);
    // The input gradients go home (every rank, even one without dx: its experts' rows belong to others).
    const T* dxs = ws.dxe;
    if (P > 1) {
      detail::token_rows<S>(r.received, C, kernels::moe_gather_rows<T>{ws.dxe, dp.inv, nullptr, ws.xr, C});
      exchange(c, ws.xr, r.recv_values, ws.xs, r.send_values);
      dxs = ws.xs;
    }

    // The router: gates, load balancing and z-loss, all through the scores.
    std::vector<T> dlogits(static_cast<std::size_t>(N * E));
    router_grad(c, hp.v, dgate.data(), dlogits.data(), N);
    dml::copy_n(static_cast<const T*>(dlogits.data()), dlogits.size(), ws.dlogits);
    detail::linear_weight_grad<S>(N, C, E, x, static_cast<const T*>(ws.dlogits), gt.router, acc);
    if (dx) {
      detail::linear_input_grad<S>(N, C, E, static_cast<const T*>(ws.dlogits), static_cast<const T*>(wt.router), dx);
      detail::token_rows<S>(N, C, kernels::moe_combine<T>{dxs, dp.slot, nullptr, dx, C, K, true});
    }
    if (cfg.shared > 0) shared_backward<S>(wt, gt, x, dy, dx, N, sv.fs, ws.hs, ws.dsf, acc);
  }

 private:
  // Loss-free balancing's bias for this layer, kept in the routing log across steps (null: none).
  const float* selection_bias(const context& c) const {
    if (cfg.bias_rate <= 0.f || !c.routing) return nullptr;
    auto& b = c.routing->router_bias[c.layer];
    if (static_cast<std::int64_t>(b.size()) != cfg.experts) b.assign(static_cast<std::size_t>(cfg.experts), 0.f);
    return b.data();
  }
  std::int64_t tokens_per_row(const dml::shape& x) const {
    if (x.rank < 3 || x[0] == 0) return 1;
    return x.rows() / x[0] * (sequence() ? split.ranks : 1);
  }
  void check_context(const context& c) const {
    const int have = c.ep ? c.ep->size() : 1;
    if (have != ep_ranks || (c.ep && c.ep->rank() != ep_rank))
      fail<invalid_argument>("dml::nn::moe: split as rank ", ep_rank, " of ", ep_ranks, " expert-parallel ranks but the "
                             "context's expert group is rank ", c.ep ? c.ep->rank() : 0, " of ", have,
                             " (a trainer with expert parallelism sets both)");
    if (sequence() && (!c.tp || c.tp->size() != split.ranks))
      fail<invalid_argument>("dml::nn::moe: split over ", split.ranks, " sequence-parallel ranks but the context's tensor "
                             "group has ", c.tp ? c.tp->size() : 0);
  }

  // The parameters (or gradients) by role; biases null without bias.
  template <class T>
  struct roles_t {
    T *router, *fc_w, *fc_b, *proj_w, *proj_b;
    T *sfc_w, *sfc_b, *sproj_w, *sproj_b;  // the shared experts (null without)
  };
  template <class T>
  roles_t<T> roles(T* const* v) const {
    std::size_t i = 0;
    auto next = [&](bool present) { return present ? v[i++] : static_cast<T*>(nullptr); };
    roles_t<T> r{};
    r.router = next(true), r.fc_w = next(true), r.fc_b = next(cfg.bias), r.proj_w = next(true), r.proj_b = next(cfg.bias);
    const bool sh = cfg.shared > 0;
    r.sfc_w = next(sh), r.sfc_b = next(sh && cfg.bias), r.sproj_w = next(sh), r.sproj_b = next(sh && cfg.bias);
    return r;
  }

  // The routing of one forward, as arrays that live on the host while it is decided and are then copied
  // into the saved block, where functors read them; backward copies back the prefix the host needs.
  struct plan_view {
    double* meta;               // meta_index values, then f_e [E] and P_e [E]
    std::int64_t* counts;       // [2E]: rows sent to each expert (its rank, its local index); rows received
                                //       from each (source rank, local expert)
    float* probs;               // [N, E] the router's softmax (the logits while they are routed)
    float* sig;                 // [N, E] the sigmoid scores (sigmoid scoring; else empty)
    float* lse;                 // [N] logsumexp of the logits
    std::int64_t* expert;       // [N, k] the top-k experts
    float* gate;                // [N, k]
    std::int64_t* slot;         // [N, k] place in dispatch order, −1: dropped
    std::int64_t* send_token;   // [N·k] the token of each dispatched row
    float* send_gate;           // [N·k] its gate
    std::int64_t* perm;         // [received] expert-order row → received row
    std::int64_t* inv;          // [received] received row → expert-order row
    std::int64_t host_bytes = 0, bytes = 0;
  };
  plan_view plan_parts(detail::carver& k, std::int64_t n) const {
    const std::int64_t E = cfg.experts, K = cfg.top_k, rmax = max_received(n);
    plan_view v{};
    v.meta = k.take<double>(detail::moe_impl::meta_fixed + 2 * E);
    v.counts = k.take<std::int64_t>(2 * E);
    v.probs = k.take<float>(n * E);
    v.sig = k.take<float>(cfg.score == router_score::sigmoid ? n * E : 0);
    v.lse = k.take<float>(n);
    v.expert = k.take<std::int64_t>(n * K);
    v.gate = k.take<float>(n * K);
    v.slot = k.take<std::int64_t>(n * K);
    v.host_bytes = k.used;
    v.send_token = k.take<std::int64_t>(n * K);
    v.send_gate = k.take<float>(n * K);
    v.perm = k.take<std::int64_t>(rmax);
    v.inv = k.take<std::int64_t>(rmax);
    v.bytes = k.used;
    return v;
  }
  plan_view plan_parts(std::byte* base, std::int64_t n) const {
    detail::carver k{base};
    return plan_parts(k, n);
  }
  // The plan's host copy: doubles, so that every array in it is aligned for its type.
  struct host_plan {
    std::vector<double> storage;
    plan_view v;
    host_plan(const moe& m, std::int64_t n) {
      detail::carver k;
      const std::int64_t bytes = m.plan_parts(k, n).bytes;
      storage.assign(static_cast<std::size_t>((bytes + 7) / 8), 0.0);
      v = m.plan_parts(reinterpret_cast<std::byte*>(storage.data()), n);
    }
    std::byte* bytes() { return reinterpret_cast<std::byte*>(storage.data()); }
  };

  // What forward keeps: the plan, the experts' inputs and c_fc outputs (expert order), the experts' outputs
  // back home (dispatch order), which the gates' gradients need, and the shared experts' c_fc outputs.
  template <class T>
  struct saved_set {
    T *xe, *f, *yr, *fs;
  };
  saved_set<std::byte> saved_parts(detail::carver& k, std::int64_t n, std::size_t vb) const {
    const std::int64_t C = cfg.dim, F = fc_rows(), rmax = max_received(n), b = static_cast<std::int64_t>(vb);
    plan_parts(k, n);
    saved_set<std::byte> s{};
    s.xe = k.take<std::byte>(rmax * C * b);
    s.f = k.take<std::byte>(rmax * F * b);
    s.yr = k.take<std::byte>(n * cfg.top_k * C * b);
    s.fs = k.take<std::byte>(n * shared_fc_rows() * b);
    return s;
  }
  template <class T>
  saved_set<T> saved_parts(std::byte* base, std::int64_t n) const {
    detail::carver k{base};
    const auto s = saved_parts(k, n, sizeof(T));
    auto as = [](std::byte* p) { return reinterpret_cast<T*>(p); };
    return {as(s.xe), as(s.f), as(s.yr), as(s.fs)};
  }
  template <class T>
  struct work_set {
    float* logits;  // [N, E]
    T *xs, *xr;     // dispatch-order rows sent, rows received
    T *ye, *dxe;    // expert order: outputs (forward) or their gradients (backward); input gradients
    T *h1, *h2;     // [received, H] the activation's output; [received, F] c_fc's output gradient
    float* dgate;   // [N, k]
    T* dlogits;     // [N, E]
    T *hs, *dsf;    // the shared experts: [N, shared·H] the activation's output, [N, shared·F] c_fc's gradient
  };
  work_set<std::byte> work_parts(detail::carver& k, std::int64_t n, std::size_t vb) const {
    const std::int64_t C = cfg.dim, H = hidden, F = fc_rows(), E = cfg.experts, K = cfg.top_k, rmax = max_received(n),
                       b = static_cast<std::int64_t>(vb);
    work_set<std::byte> w{};
    w.logits = k.take<float>(n * E);
    w.xs = k.take<std::byte>(n * K * C * b);
    w.xr = k.take<std::byte>(rmax * C * b);
    w.ye = k.take<std::byte>(rmax * C * b);
    w.dxe = k.take<std::byte>(rmax * C * b);
    w.h1 = k.take<std::byte>(rmax * H * b);
    w.h2 = k.take<std::byte>(rmax * F * b);
    w.dgate = k.take<float>(n * K);
    w.dlogits = k.take<std::byte>(n * E * b);
    w.hs = k.take<std::byte>(n * shared_hidden() * b);
    w.dsf = k.take<std::byte>(n * shared_fc_rows() * b);
    return w;
  }
  template <class T>
  work_set<T> work_parts(float* base, std::int64_t n) const {
    detail::carver k{reinterpret_cast<std::byte*>(base)};
    const auto w = work_parts(k, n, sizeof(T));
    auto as = [](std::byte* p) { return reinterpret_cast<T*>(p); };
    return {w.logits, as(w.xs), as(w.xr), as(w.ye), as(w.dxe), as(w.h1), as(w.h2), w.dgate, as(w.dlogits), as(w.hs), as(w.dsf)};
  }

  // What the host knows once routing is decided.
  struct routing {
    std::vector<std::int64_t> assigned, dropped;      // per expert, global
    std::vector<std::int64_t> send_values, recv_values;  // per expert-group rank, in elements (rows · dim)
    std::vector<std::int64_t> rows, offset;           // per local expert: rows received, first in expert order
    std::int64_t sent = 0, received = 0, a2a_bytes = 0;  // a2a_bytes: values sent to other ranks (both ways)
  };

  // Routing on the host, and the router's gradient: nn/detail/moe_routing.hpp.
  void route(const plan_view& v, std::int64_t n, const float* bias) const;
  int stat_ranks(const context& c) const;
  int stat_rank(const context& c) const;
  void sum_over_batch(const context& c, std::vector<double>& s) const;
  routing decide(const context& c, const plan_view& v, std::int64_t n, std::int64_t tokens_per_row) const;
  void finish(const plan_view& v, routing& r) const;
  routing recall(const plan_view& v) const;
  template <class T>
  void router_grad(const context& c, const plan_view& v, const float* dgate, T* out, std::int64_t n) const;

  template <class T>
  void exchange(const context& c, const T* send, const std::vector<std::int64_t>& send_values, T* recv,
                const std::vector<std::int64_t>& recv_values) const {
    c.ep->all_to_allv(const_typed_ptr(send), send_values.data(), typed_ptr(recv), recv_values.data());
  }

  // The experts' activation: g [rows, h] from c_fc's output f [rows, F]; and its gradient, from dh [rows, h] to
  // c_fc's output gradient (GELU: in place in dh, which it returns; SwiGLU: into dfc [rows, 2h]).
  template <execution_space S, class T>
  void activate(const T* f, T* g, std::int64_t rows, std::int64_t h) const {
    if (swiglu()) detail::token_rows<S>(rows, h, kernels::swiglu_forward<T>{f, g, h});
    else for_each_index<S>(rows * h, kernels::gelu_forward<T>{f, g});
  }
  template <execution_space S, class T>
  T* activate_backward(const T* f, T* dh, T* dfc, std::int64_t rows, std::int64_t h) const {
    if (!swiglu()) {
      for_each_index<S>(rows * h, kernels::gelu_backward_inplace<T>{f, dh});
      return dh;
    }
    detail::token_rows<S>(rows, h, kernels::swiglu_backward<T>{f, dh, dfc, h});
    return dfc;
  }

  template <execution_space S, class T>
  void expert_forward(const roles_t<T>& w, const routing& r, const T* xe, T* f, T* g, T* ye) const {
    const std::int64_t C = cfg.dim, H = hidden, F = fc_rows();
    for (std::size_t le = 0; le < r.rows.size(); ++le) {
      const std::int64_t n = r.rows[le], o = r.offset[le], e = static_cast<std::int64_t>(le);
      detail::linear_forward<S>(n, C, F, xe + o * C, static_cast<const T*>(w.fc_w + e * F * C),
                                w.fc_b ? static_cast<const T*>(w.fc_b + e * F) : nullptr, f + o * F);
    }
    activate<S>(static_cast<const T*>(f), g, r.received, H);
    for (std::size_t le = 0; le < r.rows.size(); ++le) {
      const std::int64_t n = r.rows[le], o = r.offset[le], e = static_cast<std::int64_t>(le);
      detail::linear_forward<S>(n, H, C, static_cast<const T*>(g + o * H), static_cast<const T*>(w.proj_w + e * C * H),
                                w.proj_b ? static_cast<const T*>(w.proj_b + e * C) : nullptr, ye + o * C);
    }
  }
  // dye: gate · dy in expert order; g: [received, H] scratch (then, for SwiGLU, c_proj's input gradient), dfc:
  // [received, F] (c_fc's output gradient; for GELU c_proj's input gradient first); dxe: the experts' input gradients.
  // An expert's rows of g are read by its c_proj weight product before its input product overwrites them.
  template <execution_space S, class T>
  void expert_backward(const roles_t<T>& w, const roles_t<T>& gr, const routing& r, const T* xe, const T* f, const T* dye,
                       T* g, T* dfc, T* dxe, bool acc) const {
    const std::int64_t C = cfg.dim, H = hidden, F = fc_rows();
    T* dh = swiglu() ? g : dfc;
    activate<S>(f, g, r.received, H);
    for (std::size_t le = 0; le < r.rows.size(); ++le) {
      const std::int64_t n = r.rows[le], o = r.offset[le], e = static_cast<std::int64_t>(le);
      detail::linear_weight_grad<S>(n, H, C, static_cast<const T*>(g + o * H), dye + o * C, gr.proj_w + e * C * H, acc);
      if (gr.proj_b) detail::column_sums<S>(dye + o * C, gr.proj_b + e * C, n, C, acc);
      detail::linear_input_grad<S>(n, H, C, dye + o * C, static_cast<const T*>(w.proj_w + e * C * H), dh + o * H);
    }
    const T* dpre = activate_backward<S>(f, dh, dfc, r.received, H);
    for (std::size_t le = 0; le < r.rows.size(); ++le) {
      const std::int64_t n = r.rows[le], o = r.offset[le], e = static_cast<std::int64_t>(le);
      detail::linear_weight_grad<S>(n, C, F, xe + o * C, dpre + o * F, gr.fc_w + e * F * C, acc);
      if (gr.fc_b) detail::column_sums<S>(dpre + o * F, gr.fc_b + e * F, n, F, acc);
      detail::linear_input_grad<S>(n, C, F, dpre + o * F, static_cast<const T*>(w.fc_w + e * F * C), dxe + o * C);
    }
  }
  // The shared experts' gradients, dx (if not null) added to: fs their saved c_fc output, hs [N, shared·H] and dsf
  // [N, shared·F] scratch.
  template <execution_space S, class T>
  void shared_backward(const roles_t<T>& w, const roles_t<T>& gr, const T* x, const T* dy, T* dx, std::int64_t n, const T* fs,
                       T* hs, T* dsf, bool acc) const {
    const std::int64_t C = cfg.dim, SH = shared_hidden(), SF = shared_fc_rows();
    activate<S>(fs, hs, n, SH);
    detail::linear_weight_grad<S>(n, SH, C, static_cast<const T*>(hs), dy, gr.sproj_w, acc);
    if (gr.sproj_b) detail::column_sums<S>(dy, gr.sproj_b, n, C, acc);
    T* dh = swiglu() ? hs : dsf;
    detail::linear_input_grad<S>(n, SH, C, dy, static_cast<const T*>(w.sproj_w), dh);
    const T* dpre = activate_backward<S>(fs, dh, dsf, n, SH);
    detail::linear_weight_grad<S>(n, C, SF, x, dpre, gr.sfc_w, acc);
    if (gr.sfc_b) detail::column_sums<S>(dpre, gr.sfc_b, n, SF, acc);
    if (dx) detail::linear_input_grad<S>(n, C, SF, dpre, static_cast<const T*>(w.sfc_w), dx, true);
  }
};

}  // namespace dml::nn

// The members declared above and defined out of the class.
#include "dml/nn/detail/moe_routing.hpp"
