// SPDX-License-Identifier: Apache-2.0
// dml/parallel/pipeline.hpp — pipeline stages: cutting a layer sequence, and running one rank's forward,
// backward, send and receive actions on activations kept per (micro-batch, chunk).
// Sits on nn/network.hpp, parallel/partition.hpp and parallel/schedule.hpp; train/trainer.hpp sequences it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/nn/loss.hpp"
#include "dml/nn/network.hpp"
#include "dml/parallel/events.hpp"
#include "dml/parallel/partition.hpp"
#include "dml/parallel/schedule.hpp"

namespace dml::parallel {

struct pipeline_options {
  int stages = 1;                       // K
  int virtual_stages = 1;               // V: chunks per rank (interleaved)
  std::vector<std::size_t> cuts;        // first layer of each (virtual) stage after the first; empty: balanced
  std::int64_t cost_rows = 64;          // rows of the input the balancing prices each layer's FLOPs at
  bool recompute = false;               // keep only each stage's inputs; recompute forward inside backward
};

// Each layer's FLOPs for `rows` input rows: its forward (nn::forward_flops), its input gradient (as much; none for
// the first layer, which a network never asks for) and its weight gradient (as much again, for a layer with
// parameters): 3x the forward for a linear layer, 2x for a relu. Their sum per layer is what a pipeline's stages
// are balanced by (layer_training_flops).
struct layer_flops {
  double forward = 0, input_gradient = 0, weight_gradient = 0;
  double total() const { return forward + input_gradient + weight_gradient; }
};
template <class Model>
std::vector<layer_flops> each_layer_flops(const Model& model, std::int64_t rows) {
  std::vector<layer_flops> out(model.depth());
  const auto& head = std::get<0>(model.layers);
  std::int64_t width = 1;
  if constexpr (requires { head.input_width(); }) width = head.input_width();
  else if constexpr (requires { head.in; }) width = head.in;
  dml::shape x{rows, width};
  model.for_each_layer([&](std::size_t l, const auto& layer) {
    const double f = nn::forward_flops(layer, x);
    out[l] = {f, l > 0 ? f : 0.0, layer.parameters().empty() ? 0.0 : f};
    x = layer.output_shape(x);
  });
  return out;
}
template <class Model>
std::vector<double> layer_training_flops(const Model& model, std::int64_t rows) {
  std::vector<double> cost;
  for (const auto& f : each_layer_flops(model, rows)) cost.push_back(f.total());
  return cost;
}

// The layer ranges of virtual stages c·K + rank (c = 0..V−1) of a sequential cut into K·V stages: at
// `cuts`, or balanced by predicted time: each layer's FLOPs for a forward and backward of `cost_rows` input rows
// (layer_training_flops), as dml::cost prices a step. Parameter counts
// would misprice embeddings (a lookup, however large the table), attention (T² work without parameters) and
// experts (each token runs top_k of them). A relu fused into the linear before it never starts a stage.
template <class Net>
std::vector<nn::layer_range> stage_chunks(const typename Net::model_type& model, const pipeline_options& o, int rank) {
  const std::size_t depth = model.depth();
  const std::size_t n = static_cast<std::size_t>(o.stages) * static_cast<std::size_t>(o.virtual_stages);
  if (n == 1) return {{0, depth}};
  std::vector<bool> cuttable = Net::absorbed_layers(model);
  cuttable.flip();
  std::vector<std::size_t> first;
  if (!o.cuts.empty()) {
    if (o.cuts.size() + 1 != n)
      fail<invalid_argument>("dml::parallel::pipeline: expected ", n - 1, " stage cuts for ", n,
                             " (virtual) stages, found ", o.cuts.size());
    first = check_cuts(o.cuts, depth, cuttable, "separates a relu from the linear it is fused into; cut one layer later");
  } else {
    first = balance_stages(layer_training_flops(model, o.cost_rows), static_cast<int>(n), cuttable);
  }
  std::vector<nn::layer_range> out;
  for (std::size_t v = static_cast<std::size_t>(rank); v < n; v += static_cast<std::size_t>(o.stages))
    out.push_back({first[v], v + 1 < n ? first[v + 1] : depth});
  return out;
}

// One rank of a pipeline: its chunks of the network, the activations of every (micro-batch, chunk) in
// flight, and the sends and receives between stages. Sends are non-blocking (several micro-batches in
// flight); a receive blocks until its message is there, as schedule::check assumes.
template <class Space, class Comm, class Net>
class pipeline {
  using T = typename Net::value_type;

 public:
  // What one step gives the pipeline: this data-parallel rank's rows, cut into micro-batches.
  struct batch {
    tensor_view<const float, Space> x{};
    const std::int32_t* y = nullptr;
    const std::int64_t* doc_start = nullptr;  // per token of x: where its document starts (null: one per row)
    std::int64_t global_batch = 0, rows = 0, micro_batches = 1;
    std::span<const std::int64_t> micro_rows{};  // each micro-batch's rows, in order; empty: rows split evenly
    std::int64_t first_row = 0;
    std::uint64_t seed = 0, step = 0;
    float loss_scale = 1.f;
    const schedule::table* table = nullptr;  // the step's schedule: when a sent input gradient is known received
  };

  // pp: the pipeline group (rank r holds stage r); null for one stage.
  // tp: the tensor-parallel group the layers talk to (null without tensor parallelism).
  pipeline(Comm* pp, Net& net, int stages, int rank, std::vector<nn::layer_range> chunks, bool recompute, event_log& log,
           nn::rank_group* tp = nullptr)
      : pp_(pp), net_(net), stages_(stages), rank_(rank), chunks_(std::move(chunks)), recompute_(recompute), log_(log),
        spare_(chunks_.size()), spare_gradients_(chunks_.size()), tp_(tp) {}

  std::span<const nn::layer_range> chunks() const { return chunks_; }
  int stages() const { return stages_; }
  int rank() const { return rank_; }
  // Of the last step: the most activation bytes and (micro-batch, chunk) sets this rank held at once.
  std::int64_t peak_bytes() const { return peak_bytes_; }
  std::int64_t peak_sets() const { return peak_sets_; }
  // Bytes of activation storage kept for the next step: the sets in flight at once (a set's storage goes back
  // to its chunk's spares when the backward that ends it is done, and the next set of that chunk takes it).
  std::int64_t held_bytes() const {
    std::int64_t b = 0;
    for (const auto& [key, m] : micro_)
      if (m.holds) b += m.set.acts.bytes();
    for (const auto& chunk : spare_)
      for (const auto& s : chunk) b += s.acts.bytes();
    return b;
  }

  // Gives back the activation storage kept for the next step (held_bytes: the sets' tensors, the gradients' and the
  // handoff's copies); the next step allocates it again. Between steps only (after end_step).
  void release_storage() {
    micro_.clear();
    for (auto& chunk : spare_) chunk.clear();
    for (auto& chunk : spare_gradients_) chunk.clear();
    handoff_ = {};
  }

  // The groups and settings every layer call of this rank sees besides tensor parallelism: expert, context
  // and data groups (nn::context's fields of those names), and the routing log that MoE layers fill.
  void set_layer_context(const nn::context& groups) { groups_ = groups; }
  nn::routing_log& routing() { return routing_; }

  void begin_step(const batch& b) {
    if (!b.micro_rows.empty() &&
        (std::ssize(b.micro_rows) != b.micro_batches || std::reduce(b.micro_rows.begin(), b.micro_rows.end(), std::int64_t{0}) != b.rows))
      fail<invalid_argument>("dml::trainer::step: micro_batch_rows: expected ", b.micro_batches,
                             " micro-batches summing to the ", b.rows, " rows given, found ", b.micro_rows.size(),
                             " summing to ", std::reduce(b.micro_rows.begin(), b.micro_rows.end(), std::int64_t{0}));
    run_ = b;
    bounds_.assign(1, 0);
    for (std::int64_t m = 0; m < b.micro_batches; ++m)
      bounds_.push_back(b.micro_rows.empty() ? b.rows * (m + 1) / b.micro_batches : bounds_.back() + b.micro_rows[m]);
    if (b.table && b.table != released_for_) {
      released_for_ = b.table;
      released_.clear();
      for (const auto& [at, sent] : schedule::known_received(*b.table, rank_, schedule::op::send_gradient))
        released_[key_of(at)].push_back(sent);
    }
    routing_.records.clear();
    live_bytes_ = peak_bytes_ = live_sets_ = peak_sets_ = 0;
    // Each of this rank's tokens: where its document starts in the sequence.
    if (b.doc_start && cp_ranks() > 1) cp_local(b.doc_start, 0, b.rows, b.x.shape[1] / cp_ranks(), cp_docs_);
  }
  // Waits for every send and forgets the step's activations (their storage, and the copies, stay for the next step).
  void end_step() {
    for (auto& [key, m] : micro_) {
      m.activation_send.wait();
      track(m, false);
      release_gradient(m, key.second);
    }
  }

  // Forward of (micro-batch, chunk); returns the loss on the last virtual stage, else 0.
  float forward(const schedule::action& a, nn::layer_hooks* hooks) {
    const int v = virtual_stage(a);
    auto& m = micro(a.micro, a.chunk);
    start_set(m, a.chunk);
    const auto [lo, hi] = rows_of(a.micro);
    if (v == 0) {
      const std::int64_t per_row = run_.x.numel() / std::max<std::int64_t>(run_.rows, 1);
      net_.set_input(m.set.acts, tensor_view<const float, Space>(run_.x.data + lo * per_row, batch_shape(hi - lo)));
    } else if (stage_of(v - 1) == rank_) {  // one stage holding several chunks: handed over in memory
      copy_into(m.set.acts.input, micro(a.micro, a.chunk - 1).set.activation_out.cview());
    }
    auto out = net_.forward_range(chunks_[static_cast<std::size_t>(a.chunk)], m.set.acts, context(a.micro, false, false), hooks);
    float loss = 0.f;
    if (v == last_virtual_stage()) {
      // A row of x may hold several labelled positions (a sequence's tokens): the loss is their mean.
      // Under context parallelism a rank holds a chunk of each row's positions: its labels are gathered to
      // match, and the mean is over every rank's positions (cp of them per row).
      const std::int64_t per = hi > lo ? out.rows() / (hi - lo) : 1;
      m.set.gradient_in.resize(out.shape);
      row_loss_.resize(static_cast<std::size_t>(nn::cross_entropy_scratch(out.rows(), tp_)));
      loss = loss_fn_.template forward_backward<Space>(out, labels(lo, hi, per), m.set.gradient_in.view(), row_loss_.data(),
                                                        run_.global_batch * per * cp_ranks(), run_.loss_scale, tp_);
      if (tp_ && tp_->rank() > 0) loss = 0.f;  // every rank of the group holds it: counted once
    } else {
      m.activation_send.wait();
      copy_into(m.set.activation_out, out);
    }
    if (recompute_) m.set.acts.release_outputs();
    track(m, true);
    return loss;
  }

  // Backward (full, input or weight part) of (micro-batch, chunk). accumulate: add to the gradients.
  void backward(const schedule::action& a, bool accumulate, nn::layer_hooks* hooks) {
    const int v = virtual_stage(a);
    auto& m = micro(a.micro, a.chunk);
    const auto range = chunks_[static_cast<std::size_t>(a.chunk)];
    const auto part = a.kind == schedule::op::backward         ? nn::backward_part::full
                      : a.kind == schedule::op::backward_input ? nn::backward_part::input
                                                               : nn::backward_part::weight;
    if (part != nn::backward_part::weight && v < last_virtual_stage() && stage_of(v + 1) == rank_) {
      auto& next = micro(a.micro, a.chunk + 1);
      copy_into(m.set.gradient_in, next.gradient_out.cview());
      release_gradient(next, a.chunk + 1);
    }
    if (recompute_ && part != nn::backward_part::weight)
      net_.forward_range(range, m.set.acts, context(a.micro, false, false), hooks);
    log_(event_kind::backward_begin);
    // hooks are given to the backward that completes the chunk's gradients (see train/trainer.hpp).
    auto dx = net_.backward_range(range, m.set.acts, m.set.gradient_in.cview(),
                                  context(a.micro, accumulate, hooks != nullptr), part, v > 0, hooks);
    log_(event_kind::backward_end);
    if (v > 0 && part != nn::backward_part::weight) {
      m.gradient_send.wait();  // a copy not given back (a step that threw) may still be in flight
      auto& spare = spare_gradients_[static_cast<std::size_t>(a.chunk)];
      if (m.gradient_out.bytes() == 0 && !spare.empty()) {
        m.gradient_out = std::move(spare.back());
        spare.pop_back();
      }
      copy_into(m.gradient_out, dx);
    }
    if (part != nn::backward_part::input) {
      track(m, false);
      if (recompute_) m.set.acts.release_outputs();
      end_set(m, a.chunk);
    }
  }

  // send and receive return the bytes they move (0: handed over in memory).
  std::int64_t send(const schedule::action& a) {
    const bool gradient = a.kind == schedule::op::send_gradient;
    const int to = virtual_stage(a) + (gradient ? -1 : 1);
    if (stage_of(to) == rank_) return 0;  // handed over in memory
    auto& m = micro(a.micro, a.chunk);
    const auto& t = gradient ? m.gradient_out : m.set.activation_out;
    (gradient ? m.gradient_send : m.activation_send) =
        pp_->isend(span_in<const T, Space>(t.data(), static_cast<std::size_t>(t.numel())), stage_of(to),
                   tag(gradient, to, a.micro));
    return t.numel() * static_cast<std::int64_t>(sizeof(T));
  }
  std::int64_t receive(const schedule::action& a) {
    const bool gradient = a.kind == schedule::op::recv_gradient;
    const int v = virtual_stage(a), from = v + (gradient ? 1 : -1);
    if (stage_of(from) == rank_) return 0;
    auto& m = micro(a.micro, a.chunk);
    const auto range = chunks_[static_cast<std::size_t>(a.chunk)];
    const auto [lo, hi] = rows_of(a.micro);
    const auto shapes = net_.shapes(batch_shape(hi - lo));
    if (gradient) receive_into(m.set.gradient_in, shapes[range.end - 1], tag(true, v, a.micro), stage_of(from));
    else receive_into(start_set(m, a.chunk).input, shapes[range.first - 1], tag(false, v, a.micro), stage_of(from));
    // The sender has received the input gradients it sent before this message: their copies go back to the spares.
    if (const auto at = released_.find(key_of(a)); at != released_.end())
      for (const auto& sent : at->second) release_gradient(micro(sent.micro, sent.chunk), sent.chunk);
    return (gradient ? shapes[range.end - 1] : shapes[range.first - 1]).numel() * static_cast<std::int64_t>(sizeof(T));
  }

  // Inference through every stage in order; the last virtual stage counts rows whose largest logit is
  // the label, the others return 0.
  std::int64_t correct(tensor_view<const float, Space> x, const std::int32_t* y, nn::layer_hooks* hooks) {
    nn::activations<T, Space> a;
    std::int64_t count = 0;
    for (int v = rank_; v <= last_virtual_stage(); v += stages_) {
      const auto& range = chunks_[static_cast<std::size_t>(v / stages_)];
      if (v == 0) net_.set_input(a, x);
      else if (stage_of(v - 1) != rank_) receive_into(a.input, net_.shapes(x.shape)[range.first - 1], tag(false, v, 0), stage_of(v - 1));
      else copy_into(a.input, handoff_.cview());
      nn::context c = groups_;
      c.training = false;
      c.tp = tp_;
      auto out = net_.forward_range(range, a, c, hooks);
      if (v == last_virtual_stage()) {
        if (tp_ && tp_->size() > 1)
          fail<invalid_argument>("dml::trainer::correct: counts the largest logit of whole rows; a vocabulary-parallel "
                                 "head holds 1/", tp_->size(), " of each row");
        count = nn::count_correct<Space>(out, y);
      }
      else if (stage_of(v + 1) != rank_)
        pp_->send(span_in<const T, Space>(out.data, static_cast<std::size_t>(out.numel())), stage_of(v + 1), tag(false, v + 1, 0));
      else copy_into(handoff_, out);
    }
    return count;
  }

 private:
  // A (micro-batch, chunk)'s activations and the tensors that live as long as they do.
  struct set_storage {
    nn::activations<T, Space> acts;
    tensor<T, Space> gradient_in;     // ∂loss/∂output: the loss gradient, or received
    tensor<T, Space> activation_out;  // the output's copy for the send to the next virtual stage
  };
  // What a (micro-batch, chunk) keeps between its actions.
  struct micro_state {
    set_storage set;
    tensor<T, Space> gradient_out;  // the input gradient's copy for the send to the previous virtual stage
    comm::request activation_send, gradient_send;
    std::int64_t counted = -1;  // activation bytes while live, else −1
    bool holds = false;         // set is this set's storage (from start_set to end_set)
  };
  micro_state& micro(std::int64_t m, int chunk) { return micro_[{m, chunk}]; }
  static std::tuple<schedule::op, int, int> key_of(const schedule::action& a) { return {a.kind, a.micro, a.chunk}; }
  // A set takes its storage (activations, output gradient, output's copy) when it starts (its input is received,
  // or its forward runs) from its chunk's spares, and gives it back when the backward that ends it is done: a rank
  // keeps the storage of the sets in flight at once for the next step, not one per micro-batch (1F1B's memory, not
  // GPipe's). The output's send is complete by then: the next virtual stage received it before it sent the
  // gradient that this backward used. Storage reused across sets is written before it is read, as storage reused
  // across steps is.
  nn::activations<T, Space>& start_set(micro_state& m, int chunk) {
    auto& spare = spare_[static_cast<std::size_t>(chunk)];
    if (!m.holds && !spare.empty()) {
      m.set = std::move(spare.back());
      spare.pop_back();
    }
    m.holds = true;
    return m.set.acts;
  }
  void end_set(micro_state& m, int chunk) {
    m.set.acts.dy.clear();  // a split backward's kept output gradients: released by its weight pass, each empty now
    m.activation_send.wait();
    spare_[static_cast<std::size_t>(chunk)].push_back(std::move(m.set));
    m.set = {};
    m.holds = false;
  }
  // An input gradient's copy goes back to its chunk's spares once its send is known received (schedule::
  // known_received), its same-rank reader has copied it, or the step ends: a rank keeps as many as it has
  // unreceived at once, not one per micro-batch.
  void release_gradient(micro_state& m, int chunk) {
    m.gradient_send.wait();
    if (m.gradient_out.bytes() == 0) return;
    spare_gradients_[static_cast<std::size_t>(chunk)].push_back(std::move(m.gradient_out));
    m.gradient_out = {};
  }
  void track(micro_state& m, bool live) {
    if (m.counted >= 0) {
      live_bytes_ -= m.counted;
      --live_sets_;
      m.counted = -1;
    }
    if (live) {
      m.counted = m.set.acts.bytes();
      live_bytes_ += m.counted;
      peak_bytes_ = std::max(peak_bytes_, live_bytes_);
      peak_sets_ = std::max(peak_sets_, ++live_sets_);
    }
  }
  static void copy_into(tensor<T, Space>& dst, tensor_view<const T, Space> src) {
    dst.resize(src.shape);
    dml::copy_n(src.data, static_cast<std::size_t>(src.numel()), dst.data());
  }
  void receive_into(tensor<T, Space>& t, const dml::shape& s, int message, int from) {
    t.resize(s);
    pp_->recv(span_in<T, Space>(t.data(), static_cast<std::size_t>(t.numel())), from, message);
  }
  int virtual_stage(const schedule::action& a) const { return a.chunk * stages_ + rank_; }
  int last_virtual_stage() const { return static_cast<int>(chunks_.size()) * stages_ - 1; }
  int stage_of(int v) const { return v % stages_; }
  // Messages are matched by identity: (activation or gradient, receiving virtual stage, micro-batch).
  int tag(bool gradient, int v, std::int64_t m) const {
    return 1 + 2 * static_cast<int>(m * (last_virtual_stage() + 1) + v) + (gradient ? 1 : 0);
  }
  std::pair<std::int64_t, std::int64_t> rows_of(std::int64_t m) const {
    return {bounds_[static_cast<std::size_t>(m)], bounds_[static_cast<std::size_t>(m) + 1]};
  }
  dml::shape batch_shape(std::int64_t rows) const {
    dml::shape s = run_.x.shape;
    s[0] = rows;
    return s;
  }
  // Dropout masks follow (seed, step, layer, global row): a micro-batch starts at its global row.
  nn::context context(std::int64_t m, bool accumulate, bool complete) {
    nn::context c = groups_;
    c.training = true;
    c.seed = run_.seed;
    c.step = run_.step;
    c.row_offset = run_.first_row + rows_of(m).first;
    if (run_.doc_start)
      c.doc_start = cp_ranks() > 1 ? cp_docs_.data() + rows_of(m).first * (run_.x.shape[1] / cp_ranks())
                                   : run_.doc_start + rows_of(m).first * run_.x.shape[1];
    c.accumulate = accumulate;
    c.tp = tp_;
    c.gradients_complete = complete;
    c.global_batch = run_.global_batch;
    c.loss_scale = run_.loss_scale;
    c.routing = &routing_;
    return c;
  }
  int cp_ranks() const { return groups_.cp ? groups_.cp->size() : 1; }
  // The labels of rows [lo, hi), `per` of them per row, in the order of this rank's positions.
  const std::int32_t* labels(std::int64_t lo, std::int64_t hi, std::int64_t per) {
    if (cp_ranks() == 1) return run_.y + lo * per;
    cp_local(run_.y, lo, hi, per, cp_labels_);
    return cp_labels_.data();
  }
  // Of rows [lo, hi) of `whole` (per · cp values a row, in sequence order), this rank's `per` a row, in the order of
  // its positions (context parallel), into out.
  template <class U>
  void cp_local(const U* whole, std::int64_t lo, std::int64_t hi, std::int64_t per, std::vector<U>& out) const {
    const nn::context_split at{.ranks = cp_ranks(), .rank = groups_.cp->rank(), .zigzag = groups_.cp_zigzag};
    const std::int64_t t = per * cp_ranks();
    out.resize(static_cast<std::size_t>((hi - lo) * per));
    for (std::int64_t r = lo; r < hi; ++r)
      for (std::int64_t i = 0; i < per; ++i)
        out[static_cast<std::size_t>((r - lo) * per + i)] = whole[r * t + nn::cp_position(at, t, i)];
  }

  Comm* pp_;
  Net& net_;
  int stages_, rank_;
  std::vector<nn::layer_range> chunks_;
  bool recompute_;
  event_log& log_;
  batch run_;
  std::vector<std::int64_t> bounds_;  // micro-batch m holds rows [bounds_[m], bounds_[m + 1])
  std::map<std::pair<std::int64_t, int>, micro_state> micro_;
  std::vector<std::vector<set_storage>> spare_;                   // per chunk: storage of ended sets
  std::vector<std::vector<tensor<T, Space>>> spare_gradients_;   // per chunk: input gradients' copies, received
  const schedule::table* released_for_ = nullptr;                // the table released_ was made from
  std::map<std::tuple<schedule::op, int, int>, std::vector<schedule::action>> released_;  // recv → sends known received
  tensor<T, Space> handoff_;
  nn::rank_group* tp_;
  nn::context groups_{};
  nn::routing_log routing_;
  std::vector<std::int32_t> cp_labels_;
  std::vector<std::int64_t> cp_docs_;  // the step's document starts of this rank's tokens (context parallel)
  nn::softmax_cross_entropy loss_fn_;
  buffer<float, Space> row_loss_;
  std::int64_t live_bytes_ = 0, peak_bytes_ = 0, live_sets_ = 0, peak_sets_ = 0;
};

}  // namespace dml::parallel
