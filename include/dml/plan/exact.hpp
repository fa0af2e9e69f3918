// SPDX-License-Identifier: Apache-2.0
// dml/plan/exact.hpp — dml's own bytes for a model it can build, per rank and before building it: model states
// from the flat layout's arithmetic and the trainer's own bucket plan (staging and gather buffers included), an
// activation set from the layers' shape rules and saved_bytes, and a pipeline rank's activation peak from its
// schedule. Uses the functions the trainer places a model with (make_layout, make_buckets, stage_chunks, lower),
// without a communicator or a parameter. Used by tests and tools/dml-plan. See DESIGN.md §7.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "dml/nn/gpt.hpp"
#include "dml/nn/llama.hpp"
#include "dml/nn/network.hpp"
#include "dml/nn/param_layout.hpp"
#include "dml/nn/sequential.hpp"
#include "dml/parallel/buckets.hpp"
#include "dml/parallel/pipeline.hpp"
#include "dml/parallel/program.hpp"
#include "dml/parallel/schedule.hpp"
#include "dml/parallel/sharding.hpp"
#include "dml/plan/cost.hpp"

namespace dml::cost {

// What parallel::replicate and parallel::zero<Stage>'s memory() report, computed before building them.
struct state_bytes {
  std::int64_t numel = 0, padded = 0, params = 0, grads = 0, optimizer = 0;  // optimizer: state + master weights
  std::int64_t buffers = 0;  // ZeRO's staging, gather and aside-reduction buffers, and ZeRO-3's resident chunks
  std::int64_t master = 0;   // of optimizer: the float master weights of mixed precision
  // Of buffers, what construction does not allocate: the aside shard later micro-batches reduce into (allocated
  // by the first step, then kept), and ZeRO-3's resident chunks (allocated at unshard, freed at reshard).
  std::int64_t aside = 0, resident = 0;
  // Not held between steps: the float sum of the largest tied parameter's gradient piece this rank holds
  // (parallel::sum_ties, after the reductions), a transient at the high-water mark.
  std::int64_t tie_sum = 0;
  std::int64_t total() const { return params + grads + optimizer + buffers; }
  friend bool operator==(const state_bytes&, const state_bytes&) = default;
};

// One rank's sharding as the trainer places it (parallel::placement): what model_states needs besides the model,
// which must carry this rank's tensor- and expert-parallel part already (nn::set_tensor_split, set_expert_split).
struct rank_sharding {
  int zero = 0;                        // 0: replicate; 1 to 3: ZeRO's stage
  parallel::shard_ranks shards{};      // ranks sharding dense and expert parameters: dp / replicas, and that / ep
  std::int64_t working_bytes = 4;      // 4 (fp32) or 2 (bf16, fp16: float master weights beside the state)
  int slots = 2;                       // the optimizer's state_slots
  bool per_step = false;               // gradients reduced once per step (pipelines, split backward), not per pass
  std::int64_t micro_batches = 1;      // backward passes per step
  double bucket_mb = 25.0;             // trainer_options::bucket_mb
  std::span<const nn::layer_range> chunks = {};  // the layers this rank holds (empty: all)
  const schedule::table* table = nullptr;        // pipelines under ZeRO-3: which chunks are resident at once
  int pp_rank = 0;
};

// The bytes memory() reports for rank `r` (numel and padded are of the layers it holds).
template <class... L>
state_bytes model_states(const nn::sequential<L...>& model, const rank_sharding& r) {
  if (r.zero < 0 || r.zero > 3 || r.shards.dense < 1 || r.shards.expert < 1 || r.shards.dense % r.shards.expert != 0)
    fail<invalid_argument>("dml::cost::model_states: expected zero 0 to 3 and shard ranks dense >= 1 divisible by "
                           "expert >= 1, found ", r.zero, ", ", r.shards.dense, " and ", r.shards.expert);
  const std::int64_t w = r.working_bytes, f = sizeof(float);
  const bool mixed = w != 4;
  const auto lay = nn::make_layout(model, nn::param_layout::alignment * r.shards.dense, r.chunks);
  state_bytes s{.numel = lay.numel, .padded = lay.total};
  // This rank's slots of each tie (the tied copy and its target), as parallel::find_ties finds them.
  std::vector<std::size_t> tied;
  const auto targets = parallel::detail::tie_targets(model);
  if (!targets.empty())
    for (const auto& ws : nn::make_layout(model, nn::param_layout::alignment * r.shards.dense).slots) {
      if (ws.spec.tied_to.empty()) continue;
      for (std::size_t i = 0; i < lay.slots.size(); ++i)
        if (lay.slots[i].id == ws.id || lay.slots[i].id == ws.init_id) tied.push_back(i);
    }
  if (r.zero == 0) {  // parallel::replicate: whole copies, the float master weights of mixed precision beside them
    s.params = s.grads = lay.total * w;
    s.master = mixed ? lay.total * f : 0;
    s.optimizer = lay.total * r.slots * f + s.master;
    for (auto i : tied) s.tie_sum = std::max(s.tie_sum, lay.slots[i].shape.numel() * f);
    return s;
  }
  const auto plan = parallel::make_buckets(lay, model.depth(),
                                           static_cast<std::int64_t>(r.bucket_mb * 1024.0 * 1024.0 / sizeof(float)),
                                           r.shards, r.chunks, parallel::tied_slots(lay, targets));
  for (auto i : tied)  // a tied slot and its target are each a run alone: the piece is this rank's part of it
    for (const auto& b : plan.buckets)
      for (const auto& rn : b.runs)
        if (rn.first_slot == i) s.tie_sum = std::max(s.tie_sum, rn.part * f);
  const bool streams = r.zero >= 2 && !r.per_step;
  s.params = (r.zero == 3 ? plan.shard : lay.total) * w;
  s.grads = (streams ? plan.shard : lay.total + plan.shard) * w;  // else whole, and the shard they reduce into
  s.master = mixed ? plan.shard * f : 0;
  s.optimizer = plan.shard * r.slots * f + s.master;
  std::int64_t widest = 0;
  for (const auto& b : plan.buckets) widest = std::max(widest, b.hi - b.lo);
  std::int64_t floats = 0;
  if (streams) floats += 2 * widest;                                              // staging
  if (streams && r.micro_batches > 1) s.aside = plan.shard * w;                    // later passes reduce aside
  if (r.zero == 3 && !r.per_step) floats += 2 * widest;                         // gathered buckets
  s.buffers = floats * w + s.aside;
  if (r.zero == 3 && r.per_step) {  // the chunks resident at once, unshard to reshard
    std::vector<nn::layer_range> whole{{0, model.depth()}};
    const std::span<const nn::layer_range> chunks = r.chunks.empty() ? std::span<const nn::layer_range>(whole) : r.chunks;
    auto chunk_floats = [&](int c) {
      const auto range = chunks[static_cast<std::size_t>(c)];
      const std::size_t s0 = lay.first_slot[range.first], s1 = lay.first_slot[range.end];
      return s0 == s1 ? 0 : (s1 < lay.slots.size() ? lay.slots[s1].offset : lay.total) - lay.slots[s0].offset;
    };
    std::int64_t live = 0, peak = 0;
    for (int c = 0; c < static_cast<int>(chunks.size()); ++c) peak = std::max(peak, chunk_floats(c));  // before a step
    if (r.table) {
      for (const auto& in : parallel::lower(*r.table, r.pp_rank, {.per_micro_batch = false, .ties = false})) {
        if (in.what == parallel::instruction::kind::unshard) peak = std::max(peak, live += chunk_floats(in.chunk));
        if (in.what == parallel::instruction::kind::reshard) live -= chunk_floats(in.chunk);
      }
    }
    s.resident = peak * w;
    s.buffers += s.resident;
  }
  return s;
}

// Bytes of one activation set of layers [first, end) (network::activations::bytes(), the storage it holds): the
// layer outputs (a relu fused into its linear has none), what each layer keeps for backward rounded up to floats,
// and the input in the working type where the network casts it (not the float input read in place).
// x: the range's input shape. recompute: what a pipeline keeps of a set between its forward and its backward
// under activation recomputation, the input alone.
template <class... L>
std::int64_t activation_set_bytes(const nn::sequential<L...>& model, dml::shape x, std::int64_t working_bytes,
                                  nn::layer_range range = {}, bool recompute = false) {
  using net = nn::basic_network<host, float, L...>;
  const auto absorbed = net::absorbed_layers(model);
  if (range.end == 0) range.end = model.depth();
  std::int64_t values = 0, kept = 0;
  constexpr bool first_takes_float = requires { requires std::tuple_element_t<0, std::tuple<L...>>::float_input; };
  if (range.first > 0 || (working_bytes != 4 && !first_takes_float)) values += x.numel();
  model.for_each_layer([&](std::size_t i, const auto& l) {
    if (!range.contains(i)) return;
    const std::int64_t saved = nn::saved_bytes(l, x, static_cast<std::size_t>(working_bytes));
    kept += (saved + 3) / 4 * 4;
    x = l.output_shape(x);
    if (!recompute && !absorbed[i]) values += x.numel();
  });
  return values * working_bytes + (recompute ? 0 : kept);
}

// The chunks (layer ranges) of pipeline rank `rank` as the trainer cuts `model`: at `cuts`, or balanced by predicted time
// over `cost_rows` rows (trainer_options' stage_cuts and cost_rows); virtual_stages > 1 for interleaving.
template <class... L>
std::vector<nn::layer_range> stage_chunks(const nn::sequential<L...>& model, int stages, int virtual_stages, int rank,
                                          std::vector<std::size_t> cuts = {}, std::int64_t cost_rows = 64) {
  return parallel::stage_chunks<nn::basic_network<host, float, L...>>(
      model, {.stages = stages, .virtual_stages = virtual_stages, .cuts = std::move(cuts), .cost_rows = cost_rows}, rank);
}

namespace detail {
// Bytes of the (micro-batch, chunk) sets of a pipeline rank over rows of shape x cut into t's micro-batches as
// parallel::pipeline cuts them; each (rows, chunk) size computed once.
template <class... L>
class set_sizes {
 public:
  set_sizes(const nn::sequential<L...>& model, const schedule::table& t, std::span<const nn::layer_range> chunks,
            dml::shape x, std::int64_t working_bytes, bool recompute)
      : model_(model), chunks_(chunks), x_(x), micro_batches_(t.micro_batches), w_(working_bytes), recompute_(recompute) {
    dml::shape y = x;
    model.for_each_layer([&](std::size_t, const auto& l) { shapes_.push_back(y = l.output_shape(y)); });
  }
  std::int64_t operator()(int micro, int chunk) {
    const auto range = chunks_[static_cast<std::size_t>(chunk)];
    dml::shape in = range.first == 0 ? x_ : shapes_[range.first - 1];
    in[0] = x_[0] * (micro + 1) / micro_batches_ - x_[0] * micro / micro_batches_;
    auto [at, fresh] = cache_.try_emplace({in[0], chunk}, 0);
    if (fresh) at->second = activation_set_bytes(model_, in, w_, range, recompute_);
    return at->second;
  }

 private:
  const nn::sequential<L...>& model_;
  std::span<const nn::layer_range> chunks_;
  dml::shape x_;
  std::int64_t micro_batches_, w_;
  bool recompute_;
  std::vector<dml::shape> shapes_;  // per layer: its output at x's rows
  std::map<std::pair<std::int64_t, int>, std::int64_t> cache_;
};
inline bool ends_set(schedule::op o) { return o == schedule::op::backward || o == schedule::op::backward_weight; }

// Per chunk of pipeline rank `rank`: the most (micro-batch, chunk) sets it holds at once, each from its start (its
// input received, or its forward) to the action that ends it, as parallel::pipeline keeps their storage.
inline std::vector<std::int64_t> sets_in_flight(const schedule::table& t, int rank, std::size_t chunks) {
  std::vector<std::int64_t> live(chunks, 0), most(chunks, 0);
  std::set<std::pair<int, int>> started;
  for (const auto& a : t.ranks.at(static_cast<std::size_t>(rank))) {
    const auto c = static_cast<std::size_t>(a.chunk);
    if ((a.kind == schedule::op::forward || a.kind == schedule::op::recv_activation) &&
        started.insert({a.micro, a.chunk}).second)
      most[c] = std::max(most[c], ++live[c]);
    if (ends_set(a.kind)) --live[c];
  }
  return most;
}

// Per chunk of pipeline rank `rank`: the most copies of input gradients it holds at once, as parallel::pipeline
// keeps them: one from each backward of a chunk past the first virtual stage, back to the chunk's spares once its
// send is known received (schedule::known_received), or its same-rank reader has copied it.
inline std::vector<std::int64_t> gradient_copies(const schedule::table& t, int rank, std::size_t chunks) {
  std::map<std::tuple<schedule::op, int, int>, std::vector<int>> released;  // recv → chunks of the sends it releases
  for (const auto& [at, sent] : schedule::known_received(t, rank, schedule::op::send_gradient))
    released[{at.kind, at.micro, at.chunk}].push_back(sent.chunk);
  const int last = static_cast<int>(chunks) * t.stages - 1;
  std::vector<std::int64_t> held(chunks, 0), spare(chunks, 0);
  for (const auto& a : t.ranks.at(static_cast<std::size_t>(rank))) {
    const auto c = static_cast<std::size_t>(a.chunk);
    const int v = a.chunk * t.stages + rank;
    if (a.kind == schedule::op::backward || a.kind == schedule::op::backward_input) {
      if (v < last && (v + 1) % t.stages == rank) ++spare[c + 1];  // one stage: the next chunk's, copied
      if (v > 0 && spare[c] > 0) --spare[c];
      else if (v > 0) ++held[c];
    }
    if (const auto at = released.find({a.kind, a.micro, a.chunk}); at != released.end())
      for (const int sent : at->second) ++spare[static_cast<std::size_t>(sent)];
  }
  return held;
}
}  // namespace detail

// The most activation bytes pipeline rank `rank` holds at once in a step of schedule `t` over rows of shape `x`
// (x[0] rows): a (micro-batch, chunk) set counts from its forward to the backward that ends it (backward, or
// backward_weight of a split one), as parallel::pipeline keeps them.
template <class... L>
std::int64_t pipeline_activation_peak(const nn::sequential<L...>& model, const schedule::table& t, int rank,
                                      std::span<const nn::layer_range> chunks, dml::shape x, std::int64_t working_bytes,
                                      bool recompute = false) {
  detail::set_sizes size(model, t, chunks, x, working_bytes, recompute);
  std::int64_t live = 0, peak = 0;
  for (const auto& a : t.ranks.at(static_cast<std::size_t>(rank))) {
    if (a.kind == schedule::op::forward) peak = std::max(peak, live += size(a.micro, a.chunk));
    if (detail::ends_set(a.kind)) live -= size(a.micro, a.chunk);
  }
  return peak;
}

// The activation storage pipeline rank `rank` keeps between steps (memory().activations_held): a set's storage is
// reused by the next set of its chunk, so each chunk keeps as many sets as it has in flight at once (micro-batches
// of equal rows).
template <class... L>
std::int64_t pipeline_activation_storage(const nn::sequential<L...>& model, const schedule::table& t, int rank,
                                         std::span<const nn::layer_range> chunks, dml::shape x,
                                         std::int64_t working_bytes, bool recompute = false) {
  const auto most = detail::sets_in_flight(t, rank, chunks.size());
  detail::set_sizes size(model, t, chunks, x, working_bytes, recompute);
  std::int64_t bytes = 0;
  for (std::size_t c = 0; c < chunks.size(); ++c) bytes += most[c] * size(0, static_cast<int>(c));
  return bytes;
}

// The bytes pipeline rank `rank` allocates in a step of schedule `t` over rows of shape `x` besides model state and
// activation sets, all kept for the next step (memory().allocated after a step is the model states, without
// ZeRO-3's resident chunks, plus activations_held plus these):
// - its network's workspaces, sized for the largest of its chunks' passes: two gradient buffers of the widest tensor
//   a pass reads or writes, a row of ones per row of a layer's input, and the layers' shared scratch in floats, one
//   more than the largest a layer asks for;
// - per set of a chunk in flight at once (as for its activations), the gradient of the chunk's output (the loss's,
//   or received) and its output's copy for the send where a later virtual stage follows; per copy of an input
//   gradient held at once (detail::gradient_copies), one of the chunk's input where an earlier stage precedes
//   (micro-batches of equal rows);
// - on the last virtual stage, the loss's per-row scratch for the last micro-batch (4 floats a row under tensor
//   parallelism, tp > 1, else 1).
// A single stage is pp 1 with a table of one rank (schedule::make("gpipe", 1, m)); `model` is this rank's part.
template <class... L>
std::int64_t step_buffers(const nn::sequential<L...>& model, const schedule::table& t, int rank,
                          std::span<const nn::layer_range> chunks, dml::shape x, std::int64_t working_bytes, int tp = 1) {
  const int stages = static_cast<int>(t.ranks.size());
  const std::int64_t m_count = t.micro_batches, w = working_bytes;
  const int last = static_cast<int>(chunks.size()) * stages - 1;
  const auto sets = detail::sets_in_flight(t, rank, chunks.size()), copies = detail::gradient_copies(t, rank, chunks.size());
  std::int64_t widest = 0, rows = 0, work = 0, kept = 0, loss_rows = 0;
  std::set<std::int64_t> seen;  // micro-batch row counts walked (two at most); the last micro-batch always is
  std::vector<dml::shape> shapes;  // per layer: its input at this micro-batch's rows
  for (std::int64_t m = 0; m < m_count; ++m) {
    dml::shape in = x;
    in[0] = x[0] * (m + 1) / m_count - x[0] * m / m_count;
    if (!seen.insert(in[0]).second && m != m_count - 1) continue;
    shapes.clear();
    model.for_each_layer([&](std::size_t, const auto& l) {
      shapes.push_back(in);
      in = l.output_shape(in);
    });
    shapes.push_back(in);
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      const auto range = chunks[c];
      const int v = static_cast<int>(c) * stages + rank;
      widest = std::max(widest, shapes[range.first].numel());
      model.for_each_layer([&](std::size_t i, const auto& l) {
        if (!range.contains(i)) return;
        widest = std::max(widest, shapes[i + 1].numel());
        rows = std::max(rows, shapes[i].rows());
        work = std::max(work, nn::workspace_size(l, shapes[i]));
      });
      const std::int64_t out = shapes[range.end].numel();
      if (m == 0) kept += sets[c] * (out + (v < last ? out : 0)) + copies[c] * (v > 0 ? shapes[range.first].numel() : 0);
      if (v == last && m == m_count - 1) loss_rows = shapes[range.end].rows();
    }
  }
  return (2 * widest + rows + kept) * w + (work + 1 + (tp > 1 ? 4 : 1) * loss_rows) * 4;
}

// The most bytes pipeline rank `rank` holds for a while in a step beyond what it keeps between steps
// (memory().allocated_peak is the kept bytes plus these, ZeRO-3's resident chunks counted at their peak): a split
// backward's output gradients (or a block's stash: nn::split_kept_elements), kept from a set's input pass to its
// weight pass, and under recomputation the set rebuilt for its backward (its outputs and what its layers keep, from
// the backward, or the input pass, to the end of the set).
template <class... L>
std::int64_t pipeline_transient_peak(const nn::sequential<L...>& model, const schedule::table& t, int rank,
                                     std::span<const nn::layer_range> chunks, dml::shape x, std::int64_t working_bytes,
                                     bool recompute) {
  detail::set_sizes full(model, t, chunks, x, working_bytes, false), kept(model, t, chunks, x, working_bytes, true);
  std::map<std::pair<std::int64_t, int>, std::int64_t> split_kept;  // per (rows, chunk): a split backward's bytes
  auto transient = [&](const schedule::action& a) {
    std::int64_t b = recompute ? full(a.micro, a.chunk) - kept(a.micro, a.chunk) : 0;
    if (a.kind != schedule::op::backward_input) return b;
    const auto range = chunks[static_cast<std::size_t>(a.chunk)];
    dml::shape y = x;
    y[0] = x[0] * (a.micro + 1) / t.micro_batches - x[0] * a.micro / t.micro_batches;
    const auto [at, fresh] = split_kept.try_emplace({y[0], a.chunk}, 0);
    std::int64_t& bytes = at->second;  // (clang 14 cannot capture a structured binding)
    if (fresh)
      model.for_each_layer([&](std::size_t i, const auto& l) {
        const dml::shape in = y;
        y = l.output_shape(y);
        if (range.contains(i) && nn::splits_backward_v<std::remove_cvref_t<decltype(l)>>)
          bytes += nn::split_kept_elements(l, in, y, static_cast<std::size_t>(working_bytes)) * working_bytes;
      });
    return b + bytes;
  };
  std::int64_t live = 0, peak = 0;
  std::map<std::pair<int, int>, std::int64_t> until_weight;  // per set: what its input pass holds until its weight pass
  for (const auto& a : t.ranks.at(static_cast<std::size_t>(rank))) {
    if (a.kind == schedule::op::backward) peak = std::max(peak, live + transient(a));
    if (a.kind == schedule::op::backward_input) peak = std::max(peak, live += until_weight[{a.micro, a.chunk}] = transient(a));
    if (a.kind == schedule::op::backward_weight) live -= until_weight[{a.micro, a.chunk}];
  }
  return peak;
}

// nn::gpt's configuration for a GPT that dml::cost describes (dropout and the router's loss weights change no byte).
inline nn::gpt_config gpt_config_of(const model& m) {
  return {.vocab = m.vocab, .seq = m.seq, .layers = m.layers, .d_model = m.d_model, .heads = m.heads, .bias = m.bias,
          .tie_weights = m.tie, .experts = m.experts, .top_k = static_cast<int>(m.top_k), .capacity_factor = m.capacity_factor,
          .moe_every = m.moe_every, .expert_ffn = m.expert_ffn, .shared_experts = m.shared_experts,
          .sigmoid_router = m.sigmoid_router};
}

// nn::llama's configuration for a Llama that dml::cost describes (RoPE's theta and norm_eps change no byte), its
// blocks recomputing selectively where `selective`.
inline nn::llama_config llama_config_of(const model& m, bool selective = false) {
  return {.vocab = m.vocab, .seq = m.seq, .d_model = m.d_model, .layers = m.layers, .heads = m.heads,
          .kv_heads = m.kv(), .ffn_hidden = m.ffn_hidden, .tie_embeddings = m.tie, .selective_recompute = selective,
          .experts = m.experts,
          .top_k = static_cast<int>(m.top_k), .capacity_factor = m.capacity_factor, .moe_every = m.moe_every,
          .expert_ffn = m.expert_ffn, .shared_experts = m.shared_experts, .sigmoid_router = m.sigmoid_router,
          .first_dense = m.first_dense, .q_lora_rank = m.q_lora_rank, .kv_lora_rank = m.kv_lora_rank,
          .qk_nope_dim = m.qk_nope_dim, .qk_rope_dim = m.qk_rope_dim, .v_head_dim = m.v_head_dim};
}

namespace detail {
// rank_bytes for the whole model `part` (nn::gpt or nn::llama), split here as the trainer splits it.
template <class... L>
bytes rank_bytes(nn::sequential<L...> part, std::int64_t seq, const layout& l, const training& t) {
  const std::int64_t w = value_bytes(t.prec);
  const int shard = l.dp / l.replicas;
  if (l.tp > 1) nn::set_tensor_split(part, {.ranks = l.tp, .rank = 0, .sequence = l.sp});
  nn::set_expert_split(part, l.ep, 0, l.dp * (l.sp ? l.tp : 1));
  if (l.cp > 1) nn::set_context_split(part, {.ranks = l.cp, .rank = 0, .zigzag = true, .all_gather = l.cp_all_gather});
  const auto table = schedule::make(l.schedule, l.pp, static_cast<int>(l.micro_batches));
  const dml::shape rows{t.global_batch / (l.dp / l.cp), seq};
  bytes most;
  for (int s = 0; s < l.pp; ++s) {
    const auto chunks = stage_chunks(part, l.pp, table.virtual_stages, s);
    const auto st = model_states(part, {.zero = l.zero, .shards = {shard, shard / l.ep}, .working_bytes = w,
                                        .slots = state_slots(t.optimizer),
                                        .per_step = l.zero < 2 || l.pp > 1 || schedule::splits_backward(table),
                                        .micro_batches = l.micro_batches, .chunks = chunks, .table = &table, .pp_rank = s});
    const bool full = l.recomp == recompute::full;
    const std::int64_t peak = pipeline_activation_peak(part, table, s, chunks, rows, w, full);
    const std::int64_t high_water = st.total() + pipeline_activation_storage(part, table, s, chunks, rows, w, full) +
                                    step_buffers(part, table, s, chunks, rows, w, l.tp) +
                                    std::max(pipeline_transient_peak(part, table, s, chunks, rows, w, full), st.tie_sum);
    const bytes b{.params = static_cast<double>(st.params), .grads = static_cast<double>(st.grads),
                  .optimizer = static_cast<double>(st.optimizer - st.master), .master = static_cast<double>(st.master),
                  .activations = static_cast<double>(peak), .buffers = static_cast<double>(st.buffers),
                  .workspace = static_cast<double>(high_water - st.total() - peak)};
    if (b.total() > most.total()) most = b;
  }
  return most;
}

// rank_bytes for the layouts of one model: each whole model (a GPT, a Llama with and without selective recompute)
// built on first use and copied for each layout, its RoPE table shared (at 126 blocks and 8,192 positions, building a
// Llama for every layout took as long as its bytes).
class rank_bytes_of {
 public:
  explicit rank_bytes_of(const model& m) : m_(m) {}
  bytes operator()(const layout& l, const training& t) {
    if (!m_.is_llama()) {
      if (!gpt_) gpt_.emplace(nn::gpt(gpt_config_of(m_)));
      return rank_bytes(*gpt_, m_.seq, l, t);
    }
    const bool selective = l.recomp == recompute::selective;
    auto& whole = llama_[selective ? 1 : 0];
    if (!whole) whole.emplace(nn::llama(llama_config_of(m_, selective)));
    return rank_bytes(*whole, m_.seq, l, t);
  }

 private:
  model m_;
  std::optional<nn::gpt_model> gpt_;
  std::optional<nn::llama_model> llama_[2];
};
}  // namespace detail

// dml's own bytes for its GPT (nn::gpt) or Llama (nn::llama) under layout l: of the ranks the trainer places (every
// pipeline stage; the ranks of a tensor, expert or context group hold equal parts), the one holding the most, as its
// memory() and activation peak will report them after a step: model states, ZeRO's buffers and the schedule's
// in-flight activations. Throws dml::error where the trainer would refuse the layout.
inline bytes rank_bytes(const model& m, const layout& l, const training& t) { return detail::rank_bytes_of(m)(l, t); }
[[deprecated("dml::cost::gpt_rank_bytes is rank_bytes")]] inline bytes gpt_rank_bytes(const model& m, const layout& l,
                                                                                   const training& t) {
  return rank_bytes(m, l, t);
}

namespace detail {
// evaluate_dml with the bytes of `bytes_of`, which keeps its whole models for the next layout.
inline estimate evaluate_dml(const model& m, const layout& l, const training& t, const cluster& c, int devices,
                             rank_bytes_of& bytes_of) {
  estimate e = evaluate(m, l, t, c, devices);
  if (!m.is_transformer() || !refusal(m, l, t, devices).empty()) return e;
  e.fits = false;
  if (l.recomp == recompute::selective && !m.is_llama()) {
    e.why = "selective recompute is a Llama block's in dml: a GPT recomputes a whole stage (recompute=full) or nothing";
    return e;
  }
  try {
    e.per_rank = bytes_of(l, t);
  } catch (const dml::error& x) {
    e.why = x.what();
    return e;
  }
  check_fit(e, c);
  return e;
}
}  // namespace detail

// evaluate() with dml's own bytes (rank_bytes) in place of the papers' formulas, for a GPT or a Llama: what the
// trainer will hold, to the byte. Selective recomputation is a Llama block's (llama_config::selective_recompute); a GPT
// recomputes a whole stage or nothing, so a GPT layout that asks for it is refused, as one the trainer refuses is. A
// model known by its parameter count keeps evaluate()'s model states.
inline estimate evaluate_dml(const model& m, const layout& l, const training& t, const cluster& c, int devices = 0) {
  detail::rank_bytes_of bytes_of(m);
  return detail::evaluate_dml(m, l, t, c, devices, bytes_of);
}

// search() with evaluate_dml's bytes: the layouts dml runs, ranked by what they will hold.
inline std::vector<estimate> search_dml(const model& m, const training& t, const cluster& c, int devices,
                                        std::int64_t micro_batch, int max_cp = 1) {
  auto out = search(m, t, c, devices, micro_batch, max_cp);
  detail::rank_bytes_of bytes_of(m);
  for (auto& e : out) e = detail::evaluate_dml(m, e.lay, t, c, devices, bytes_of);
  rank_estimates(out);
  return out;
}

// ---- any sequential as a pipeline, priced through its schedule -------------------------------------------------

// Each pipeline rank's seconds per micro-batch of `rows` rows, in schedule::simulate's terms: the FLOPs of its chunks'
// layers (parallel::each_layer_flops: forward, input gradient, weight gradient) at the cluster's fp32 rate for
// products of `rows` rows (cluster::gemm_share). Element-wise work runs at the same rate and messages are free.
template <class... L>
std::vector<schedule::costs> pipeline_rank_costs(const nn::sequential<L...>& model, int stages, int virtual_stages,
                                                 std::int64_t rows, const cluster& c) {
  const auto flops = parallel::each_layer_flops(model, rows);
  const double rate = c.flops(precision::fp32) * c.gemm_share(static_cast<double>(rows));
  std::vector<schedule::costs> out;
  for (int r = 0; r < stages; ++r) {
    parallel::layer_flops sum;
    for (const auto& chunk : stage_chunks(model, stages, virtual_stages, r))
      for (std::size_t l = chunk.first; l < chunk.end; ++l) {
        sum.forward += flops[l].forward;
        sum.input_gradient += flops[l].input_gradient;
        sum.weight_gradient += flops[l].weight_gradient;
      }
    out.push_back({.forward = sum.forward / rate, .backward = (sum.input_gradient + sum.weight_gradient) / rate,
                   .backward_input = sum.input_gradient / rate, .backward_weight = sum.weight_gradient / rate});
  }
  return out;
}

// Each pipeline rank's optimizer update in seconds: the parameters of its chunks' layers, each moving
// update_bytes_per_param(optimizer, fp32) at the cluster's memory bandwidth.
template <class... L>
std::vector<double> pipeline_update_seconds(const nn::sequential<L...>& model, int stages, int virtual_stages,
                                            const cluster& c, std::string_view optimizer = "adamw") {
  std::vector<double> params(model.depth());
  model.for_each_layer([&](std::size_t l, const auto& layer) {
    for (const auto& p : layer.parameters()) params[l] += static_cast<double>(p.shape.numel());
  });
  std::vector<double> out;
  for (int r = 0; r < stages; ++r) {
    double n = 0;
    for (const auto& chunk : stage_chunks(model, stages, virtual_stages, r))
      for (std::size_t l = chunk.first; l < chunk.end; ++l) n += params[l];
    out.push_back(n * update_bytes_per_param(optimizer, precision::fp32) / c.memory_bandwidth);
  }
  return out;
}

// The rows of each of m micro-batches of `rows`, split as the trainer splits them when not told
// (trainer_options::micro_batch_rows empty).
inline std::vector<std::int64_t> even_micro_rows(std::int64_t rows, std::int64_t m) {
  std::vector<std::int64_t> out;
  for (std::int64_t i = 0; i < m; ++i) out.push_back(rows * (i + 1) / m - rows * i / m);
  return out;
}

// A pipeline's step under its own schedule: the schedule's table for micro-batches of micro_rows rows each,
// simulated at each rank's costs, then each rank's optimizer update after its last action (makespan: the
// predicted step, when the last rank's update ends; busy includes the update; bubble: the ranks' mean idle share,
// the stages' imbalance included). Costs are priced at the first micro-batch's rows, and another micro-batch's
// actions scaled by its FLOPs (as many per row) at the rate for its rows (cluster::gemm_share).
template <class... L>
schedule::timeline simulate_pipeline(const nn::sequential<L...>& model, int stages, const schedule::table& t,
                                     std::span<const std::int64_t> micro_rows, const cluster& c,
                                     std::string_view optimizer = "adamw") {
  if (std::ssize(micro_rows) != t.micro_batches || std::ranges::any_of(micro_rows, [](std::int64_t r) { return r < 1; }))
    fail<invalid_argument>("dml::cost::simulate_pipeline: expected ", t.micro_batches,
                           " micro-batches of at least 1 row, found ", micro_rows.size());
  const auto seconds_per = [&](std::int64_t rows) {
    return static_cast<double>(rows) / c.gemm_share(static_cast<double>(rows));
  };
  std::vector<double> scale;
  for (const std::int64_t r : micro_rows) scale.push_back(seconds_per(r) / seconds_per(micro_rows[0]));
  auto tl = schedule::simulate(t, pipeline_rank_costs(model, stages, t.virtual_stages, micro_rows[0], c), scale);
  const auto update = pipeline_update_seconds(model, stages, t.virtual_stages, c, optimizer);
  tl.makespan = 0;
  for (std::size_t r = 0; r < update.size(); ++r) {
    const double last = tl.end[r].empty() ? 0 : *std::max_element(tl.end[r].begin(), tl.end[r].end());
    tl.makespan = std::max(tl.makespan, last + update[r]);
    tl.busy[r] += update[r];
  }
  tl.bubble = 0;
  for (const double b : tl.busy) tl.bubble += tl.makespan > 0 ? (tl.makespan - b) / tl.makespan / static_cast<double>(tl.busy.size()) : 0;
  return tl;
}
// The same for `micro_batches` equal micro-batches of a batch of batch_rows rows.
template <class... L>
schedule::timeline simulate_pipeline(const nn::sequential<L...>& model, int stages, const std::string& schedule_name,
                                     std::int64_t micro_batches, std::int64_t batch_rows, const cluster& c,
                                     std::string_view optimizer = "adamw") {
  if (micro_batches < 1 || batch_rows % micro_batches != 0)
    fail<invalid_argument>("dml::cost::simulate_pipeline: expected a micro-batch count that divides the ", batch_rows,
                           " rows, found ", micro_batches);
  return simulate_pipeline(model, stages, schedule::make(schedule_name, stages, static_cast<int>(micro_batches)),
                           even_micro_rows(batch_rows, micro_batches), c, optimizer);
}

// A pipeline the planner picked: its schedule, micro-batch count and rows (empty: equal micro-batches), and
// predicted step and bubble.
struct pipeline_pick {
  std::string schedule;
  std::int64_t micro_batches = 1;
  std::vector<std::int64_t> micro_rows{};
  double step_seconds = 0, bubble = 0;
};
// Every 1F1B and zb pipeline of `stages` ranks at every micro-batch count that divides batch_rows (at most 64),
// fastest first: what a step gains from more micro-batches (a smaller bubble) against what it loses to smaller
// products (cluster::gemm_rows), each through the schedule itself, the stages as the trainer cuts them. Beside each
// even split, the same count with a smaller first micro-batch (down to half the others' rows, in sixteenths of
// them; the rest split evenly): the next stage starts and returns its first input gradient sooner, which fills
// the bubble of a first stage that does more than its share. The first is the pick: of the pipelines within 0.1% of
// the fastest, the one with the fewest micro-batches, equal rows before unequal (where the busiest rank never idles,
// many price alike, and fewer, equal micro-batches cost least of what the model leaves out: messages, per-action
// work).
template <class... L>
std::vector<pipeline_pick> rank_pipelines(const nn::sequential<L...>& model, int stages, std::int64_t batch_rows,
                                          const cluster& c) {
  std::vector<pipeline_pick> out;
  for (const char* name : {"1f1b", "zb"})
    for (std::int64_t m = 1; m <= std::min<std::int64_t>(batch_rows, 64); ++m) {
      if (batch_rows % m != 0) continue;
      const auto t = schedule::make(name, stages, static_cast<int>(m));
      const std::int64_t even = batch_rows / m;
      for (std::int64_t k = 0; k <= (m > 1 ? 8 : 0); ++k) {
        const std::int64_t first = even - k * std::max<std::int64_t>(1, even / 16);
        if (first < 1) break;
        std::vector<std::int64_t> rows{first};
        for (const std::int64_t r : even_micro_rows(batch_rows - first, m - 1)) rows.push_back(r);
        const auto tl = simulate_pipeline(model, stages, t, rows, c);
        out.push_back({name, m, k == 0 ? std::vector<std::int64_t>{} : rows, tl.makespan, tl.bubble});
      }
    }
  detail::stable_sort(out, [](const auto& a, const auto& b) { return a.step_seconds < b.step_seconds; });
  const auto near = std::ranges::find_if(out, [&](const auto& p) { return p.step_seconds > out.front().step_seconds * 1.001; });
  const auto pick = std::min_element(out.begin(), near, [](const auto& a, const auto& b) {
    return std::pair(a.micro_batches, !a.micro_rows.empty()) < std::pair(b.micro_batches, !b.micro_rows.empty());
  });
  std::rotate(out.begin(), pick, pick + 1);
  return out;
}

}  // namespace dml::cost
