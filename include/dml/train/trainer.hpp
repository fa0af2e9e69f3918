// SPDX-License-Identifier: Apache-2.0
// dml/train/trainer.hpp — trainer<Policies...>: data parallelism and ZeRO stages 1–3 over any communicator.
// Sits on nn/, optim/, comm/ and parallel/policy.hpp. The flat buffers of nn::network are cut into
// buckets (whole layers, in backward order); every bucket splits into one equal part per rank, and a
// rank's shard is its part of every bucket. See DESIGN.md §1, §2 and §5.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/nn/loss.hpp"
#include "dml/nn/network.hpp"
#include "dml/optim/adam.hpp"
#include "dml/optim/clip.hpp"
#include "dml/optim/loss_scaler.hpp"
#include "dml/core/cast.hpp"
#include "dml/parallel/buckets.hpp"
#include "dml/parallel/partition.hpp"
#include "dml/parallel/policy.hpp"
#include "dml/parallel/schedule.hpp"
#include "dml/train/checkpoint.hpp"

namespace dml {

namespace train {

struct trainer_options {
  std::uint64_t seed = 0;           // initial weights and dropout masks
  double bucket_mb = 25.0;          // gradient bucket size in MiB (whole layers; at least one layer each)
  std::int64_t micro_batches = 1;   // the local batch is split into this many; gradients accumulate
  float clip_norm = 0.f;            // global-norm clipping; 0 turns it off
  std::function<float(std::int64_t step)> lr;  // learning rate per step (from 1); empty: the optimizer's lr
  bool record_events = false;       // keep an event log of backward and communication (tests, tracing)
  float initial_loss_scale = 65536.f;  // fp16: where dynamic loss scaling starts (PyTorch's default)
  // Pipeline parallelism: the group's ranks form pipeline_stages stages of size()/pipeline_stages
  // data-parallel ranks each (Megatron's order: data-parallel rank fastest).
  int pipeline_stages = 1;
  // First layer of each stage after the first ("--cuts 3,5": stages start at 0, 3, 5); empty: stages
  // balanced by per-layer cost (parameters plus activation bytes of cost_rows rows).
  std::vector<std::size_t> stage_cuts;
  std::int64_t cost_rows = 64;
  // The schedule by name ("gpipe", "1f1b", "interleaved:2", "zb") or a CSV file; empty: the trainer's
  // schedule policy. Checked (schedule::check) before any work.
  std::string schedule;
  bool recompute = false;  // keep only each stage's inputs; recompute its forward inside backward
};

struct step_result {
  float loss = 0.f;        // mean over the global batch, the same on every rank (every stage too)
  double grad_norm = 0.0;  // global gradient norm before clipping (computed when clipping is on)
  bool skipped = false;    // fp16: the gradients overflowed, the update was skipped and the scale shrank
  float loss_scale = 1.f;  // fp16: the loss scale after this step
};

// Per-rank bytes of model state, computed from the sizes the trainer allocates.
struct memory_report {
  std::int64_t numel = 0;        // Ψ: parameters of the model
  std::int64_t padded = 0;       // parameters including padding to equal, aligned per-rank parts
  std::int64_t params = 0, grads = 0, optimizer = 0;  // bytes held for the whole run
  std::int64_t buffers = 0;      // bytes of staging and gather buffers (ZeRO-2/3)
  std::int64_t total() const { return params + grads + optimizer + buffers; }
};

// What the event log records, in the order it happened on this rank. compute_begin/compute_end
// bracket every forward and backward action of a pipeline schedule (bucket: the action's index).
enum class event_kind { backward_begin, bucket_launch, backward_end, comm_done, step_end, compute_begin, compute_end };
struct event {
  event_kind kind;
  int bucket = -1;
  double t = 0;  // seconds since the trainer was made
};

// Share of gradient communication that ran during backward, from an event log (trainer_options::
// record_events), skipping the first `skip_steps` steps: each bucket's communication lasts from its
// launch to the first moment it was seen complete (polled after every layer's backward, so the
// estimate errs by at most one layer); what lasted past backward's end is exposed. Returns
// 1 − exposed / total, or −1 when the log has no communication.
inline double hidden_communication(std::span<const event> log, std::int64_t skip_steps = 0) {
  double total = 0, exposed = 0;
  std::int64_t steps = 0;
  double backward_end = 0;
  std::vector<double> launched;
  for (const auto& e : log) {
    if (e.kind == event_kind::step_end) ++steps;
    if (steps < skip_steps) continue;
    switch (e.kind) {
      case event_kind::backward_begin: launched.clear(); break;
      case event_kind::bucket_launch:
        if (e.bucket >= 0) {
          launched.resize(std::max(launched.size(), static_cast<std::size_t>(e.bucket) + 1), -1.0);
          launched[static_cast<std::size_t>(e.bucket)] = e.t;
        }
        break;
      case event_kind::backward_end: backward_end = e.t; break;
      case event_kind::comm_done:
        if (e.bucket >= 0 && static_cast<std::size_t>(e.bucket) < launched.size() && launched[e.bucket] >= 0) {
          total += e.t - launched[static_cast<std::size_t>(e.bucket)];
          exposed += std::max(0.0, e.t - std::max(backward_end, launched[static_cast<std::size_t>(e.bucket)]));
        }
        break;
      default: break;
    }
  }
  return total > 0 ? 1.0 - exposed / total : -1.0;
}

namespace detail {

using parallel::bucket;

template <class T>
struct add_into {
  T* dst;
  const T* src;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    dst[i] = T(static_cast<float>(dst[i]) + static_cast<float>(src[i]));
  }
};

template <class Space>
class engine_base {
 public:
  virtual ~engine_base() = default;
  virtual step_result step(tensor_view<const float, Space> x, const std::int32_t* y, std::int64_t global_batch) = 0;
  virtual std::int64_t correct(tensor_view<const float, Space> x, const std::int32_t* y) = 0;
  virtual std::vector<float> full_parameters() = 0;
  virtual void load_full_parameters(std::span<const float> full) = 0;
  virtual memory_report memory() const = 0;
  virtual const nn::param_layout& layout() const = 0;
  virtual const std::vector<event>& events() const = 0;
  virtual std::int64_t steps() const = 0;
  virtual std::span<const bucket> buckets() const = 0;
  virtual void save_checkpoint(const std::filesystem::path& dir, const std::map<std::string, std::string>& user) = 0;
  virtual std::map<std::string, std::string> load_checkpoint(const std::filesystem::path& dir) = 0;
  virtual const schedule::table& schedule_table(std::int64_t micro_batches) = 0;
  virtual std::int64_t peak_activation_bytes() const = 0;
  virtual std::int64_t peak_in_flight() const = 0;
};

template <class Space, class Comm, class Sharding, class Optimizer, class Precision, class... Layers>
class engine final : public engine_base<Space>, nn::layer_hooks {
  static constexpr int stage = Sharding::stage;
  // The working type of parameters, activations and gradients; master weights and state are float.
  using T = typename Precision::type;
  static constexpr bool mixed = !std::same_as<T, float>;
  // Where the float parameters live: a shard (ZeRO-3, and every mixed ZeRO stage, whose master
  // weights are sharded with the optimizer state), master_ (mixed DDP), or the network itself.
  static constexpr bool sharded_master = stage == 3 || (mixed && stage >= 1);
  using net_type = nn::basic_network<Space, T, Layers...>;
  // A bucket's communication in flight.
  struct inflight {
    comm::request r;
    int bucket = -1;
    bool seen = false;  // its completion is already in the event log
  };

 public:
  using make_schedule = std::function<schedule::table(int stages, std::int64_t micro_batches)>;
  engine(Comm& comm, const nn::sequential<Layers...>& model, trainer_options opt, Optimizer optimizer,
         make_schedule default_schedule)
      : world_(comm), opt_(std::move(opt)), optimizer_(optimizer), stages_(checked_stages(comm, opt_)),
        pp_rank_(comm.rank() / (comm.size() / stages_)), owned_dp_(split_dp(comm)), owned_pp_(split_pp(comm)),
        comm_(owned_dp_ ? *owned_dp_ : comm), ranks_(comm_.size()), rank_(comm_.rank()),
        default_schedule_(std::move(default_schedule)), model_(model),
        chunks_(stage_chunks(model, virtual_stages())),
        net_(model, opt_.seed,
             {.alignment = nn::param_layout::alignment * ranks_, .own_params = stage < 3, .own_grads = stage < 2,
              .layers = chunks_}),
        full_layout_(stages_ == 1 ? net_.layout() : nn::make_layout(model, nn::param_layout::alignment * ranks_)) {
    if (opt_.micro_batches < 1)
      fail<invalid_argument>("dml::trainer: expected micro_batches >= 1, found ", opt_.micro_batches);
    if (!(opt_.bucket_mb > 0))
      fail<invalid_argument>("dml::trainer: expected bucket_mb > 0, found ", opt_.bucket_mb);
    if (stages_ > 1 && stage >= 2)
      fail<invalid_argument>("dml::trainer: pipeline stages compose with replicate or zero<1> across data-parallel "
                             "ranks; found ", Sharding::name, " with ", stages_, " stages");
    schedule_of(opt_.micro_batches);  // a bad schedule fails here, before any work
    make_buckets();
    const auto& L = net_.layout();
    shard_ = L.total / ranks_;
    if (stage >= 1) shard_grads_.resize(static_cast<std::size_t>(shard_));
    state_.resize(stage >= 1 ? shard_ : L.total);
    std::int64_t widest = 0;
    for (const auto& b : buckets_) widest = std::max(widest, b.hi - b.lo);
    if (stage >= 2)
      for (auto& s : staging_) s.resize(static_cast<std::size_t>(widest));
    if (stage == 3)
      for (auto& g : gathered_) g.resize(static_cast<std::size_t>(widest));
    if constexpr (Precision::loss_scaling) scaler_ = optim::loss_scaler({.init_scale = opt_.initial_loss_scale});
    if (sharded_master) {
      shard_params_.resize(static_cast<std::size_t>(shard_));
      init_shard_params();
    }
    if constexpr (mixed && stage == 0) {
      master_.resize(static_cast<std::size_t>(L.total));
      fill_n<Space>(master_.data(), L.total, 0.f);
      for (std::size_t s = 0; s < L.slots.size(); ++s)
        net_.init_range(opt_.seed, s, 0, L.slots[s].shape.numel(), master_.data() + L.slots[s].offset);
    }
    if constexpr (mixed && stage == 3) {
      shard_working_.resize(static_cast<std::size_t>(shard_));
      cast_n<Space>(shard_params_.data(), shard_working_.data(), shard_);
    }
  }

  ~engine() override {
#if DML_HAS_CUDA
    if (compute_done_) cudaEventDestroy(compute_done_);
#endif
  }
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  // Runs this rank's list of the schedule: forward and backward of (micro-batch, chunk), the sends and
  // receives between stages, the gradient reduction and the update.
  step_result step(tensor_view<const float, Space> x, const std::int32_t* y, std::int64_t global_batch) override {
    if (x.shape.rank < 1 || global_batch <= 0)
      fail<invalid_argument>("dml::trainer::step: expected a batch of rows and global_batch > 0, found shape ",
                             x.shape, " and global_batch ", global_batch);
    ++step_;
    run_ = {.x = x, .y = y, .global_batch = global_batch, .rows = x.shape[0]};
    run_.micro_batches = std::min(opt_.micro_batches, std::max<std::int64_t>(run_.rows, 1));
    run_.first_row = first_global_row(run_.rows);
    const auto& plan = schedule_of(run_.micro_batches).ranks[static_cast<std::size_t>(pp_rank_)];
    last_backward_.assign(chunks_.size(), -1);
    for (std::size_t i = 0; i < plan.size(); ++i)
      if (is_backward(plan[i].kind) && plan[i].kind != schedule::op::backward_input)
        last_backward_[static_cast<std::size_t>(plan[i].chunk)] = static_cast<std::int64_t>(i);
    backwards_done_.assign(chunks_.size(), 0);
    weights_done_.assign(chunks_.size(), 0);
    live_bytes_ = peak_bytes_ = 0;
    live_sets_ = peak_sets_ = 0;
    float local_loss = 0.f;
    step_result out;
    for (std::size_t i = 0; i < plan.size(); ++i) {
      const auto& a = plan[i];
      switch (a.kind) {
        case schedule::op::forward: local_loss += run_forward(a, i); break;
        case schedule::op::backward:
        case schedule::op::backward_input:
        case schedule::op::backward_weight: run_backward(a, i); break;
        case schedule::op::send_activation: send(a, false); break;
        case schedule::op::send_gradient: send(a, true); break;
        case schedule::op::recv_activation: receive(a, false); break;
        case schedule::op::recv_gradient: receive(a, true); break;
        case schedule::op::reduce_gradients: finish_communication(); break;
        case schedule::op::update: out = finish_step(local_loss); break;
      }
    }
    for (auto& [key, m] : micro_) m.sends_done();
    release_all();
    return out;
  }

  std::int64_t correct(tensor_view<const float, Space> x, const std::int32_t* y) override {
    current_ = -1;
    if (stages_ == 1) {
      auto logits = net_.forward(x, {.training = false}, this);
      return nn::count_correct<Space>(logits, y);
    }
    // Through the stages in order, one virtual stage after another; the last counts.
    const int virtual_stages = static_cast<int>(chunks_.size()) * stages_;
    nn::activations<T, Space> a;
    std::int64_t count = 0;
    for (int v = 0; v < virtual_stages; ++v) {
      if (v % stages_ != pp_rank_) continue;
      const auto& range = chunks_[static_cast<std::size_t>(v / stages_)];
      if (v == 0) net_.set_input(a, x);
      else receive_into(a.input, net_.shapes(x.shape)[range.first - 1], pp_tag(false, v, 0), stage_of(v - 1));
      auto out = net_.forward_range(range, a, {.training = false}, this);
      if (v + 1 == virtual_stages) count = nn::count_correct<Space>(out, y);
      else owned_pp_->send(std::span<const T>(out.data, static_cast<std::size_t>(out.numel())), stage_of(v + 1),
                           pp_tag(false, v + 1, 0));
    }
    return count;
  }

  std::vector<float> full_parameters() override {
    if (stages_ > 1) return to_full_layout(stage_parameters());
    return stage_parameters();
  }
  std::vector<float> stage_parameters() {
    const auto& L = net_.layout();
    std::vector<float> full(static_cast<std::size_t>(L.total));
    if constexpr (mixed && stage == 0) {
      dml::copy_n(master_.data(), full.size(), full.data());
    } else if constexpr (sharded_master) {
      buffer<float, Space> gathered(full.size());  // collectives work in the trainer's space
      order_after_compute();
      for (std::size_t b = 0; b < buckets_.size(); ++b) {
        const auto& bk = buckets_[b];
        comm_.all_gather(std::span<const float>(shard_params_.data() + bk.shard_offset, bk.part),
                         std::span<float>(gathered.data() + bk.lo, bk.hi - bk.lo));
      }
      dml::copy_n(gathered.data(), full.size(), full.data());
    } else {
      dml::copy_n(net_.params().data(), full.size(), full.data());
    }
    return full;
  }

  void load_full_parameters(std::span<const float> given) override {
    if (static_cast<std::int64_t>(given.size()) != full_layout_.total)
      fail<shape_error>("dml::trainer: expected ", full_layout_.total, " parameters (padding included), found ",
                        given.size());
    std::vector<float> stage_part;
    auto full = given;
    if (stages_ > 1) {
      stage_part = from_full_layout(given);
      full = stage_part;
    }
    const auto& L = net_.layout();
    if (static_cast<std::int64_t>(full.size()) != L.total)
      fail<shape_error>("dml::trainer: expected ", L.total, " parameters (padding included), found ", full.size());
    if constexpr (mixed && stage == 0) {
      dml::copy_n(full.data(), full.size(), master_.data());
    } else if constexpr (sharded_master) {
      for (const auto& bk : buckets_)
        dml::copy_n(full.data() + bk.lo + rank_ * bk.part, static_cast<std::size_t>(bk.part),
                    shard_params_.data() + bk.shard_offset);
    } else {
      dml::copy_n(full.data(), full.size(), net_.params().data());
    }
    refresh_working();
  }

  memory_report memory() const override {
    const auto& L = net_.layout();
    const std::int64_t w = sizeof(T), f = sizeof(float);
    memory_report m{.numel = L.numel, .padded = L.total};
    m.params = (stage == 3 ? shard_ : L.total) * w;  // the working copy (fp32: the only copy)
    m.grads = (stage >= 2 ? shard_ : L.total) * w;
    // Optimizer state, and under mixed precision the float master weights that go with it.
    m.optimizer = state_.bytes() + (mixed ? static_cast<std::int64_t>(master_.size() + shard_params_.size()) * f : 0);
    m.buffers = static_cast<std::int64_t>((staging_[0].size() + staging_[1].size() + gathered_[0].size() +
                                           gathered_[1].size() + shard_tmp_.size()) * sizeof(T));
    return m;
  }
  // The whole model's layout, whatever stage this rank runs: what full_parameters fills.
  const nn::param_layout& layout() const override { return full_layout_; }
  const std::vector<event>& events() const override { return events_; }
  std::int64_t steps() const override { return step_; }
  std::span<const bucket> buckets() const override { return buckets_; }

  // Every rank writes the elements of its part of each bucket, params and state alike: 1/N of the
  // model under every stage, each element once (stage 0 holds everything but writes its part only).
  void save_checkpoint(const std::filesystem::path& dir, const std::map<std::string, std::string>& user) override {
    no_pipeline("save_checkpoint");
    auto info = checkpoint_description();
    info.user = user;
    // The optimizer's own step count and the loss scale ride along under reserved keys.
    info.user["dml.optimizer_step"] = std::to_string(optimizer_step_);
    if constexpr (Precision::loss_scaling) {
      info.user["dml.loss_scale"] = std::to_string(scaler_.scale());
      info.user["dml.loss_scale_tracker"] = std::to_string(scaler_.growth_tracker());
    }
    const auto& L = net_.layout();
    std::vector<std::vector<checkpoint_range>> ranges(static_cast<std::size_t>(ranks_));
    std::vector<const float*> data;
    for (int r = 0; r < ranks_; ++r)
      for (const auto& p : owned_pieces(r))
        for (int k = -1; k < Optimizer::state_slots; ++k) {
          ranges[static_cast<std::size_t>(r)].push_back({checkpoint_tensor_name(k, L.slots[p.slot].name), p.begin, p.end});
          if (r == rank_) data.push_back(held(k, p));
        }
    // The writer reads host memory: a device trainer stages its pieces first.
    std::vector<std::vector<float>> staged;
    if constexpr (!std::same_as<Space, host>) {
      std::size_t i = 0;
      for (const auto& p : owned_pieces(rank_))
        for (int k = -1; k < Optimizer::state_slots; ++k, ++i) {
          staged.emplace_back(static_cast<std::size_t>(p.end - p.begin));
          dml::copy_n(data[i], staged.back().size(), staged.back().data());
          data[i] = staged.back().data();
        }
    }
    train::detail::write_checkpoint(comm_, dir, std::move(info), ranges, std::span<const float* const>(data));
  }

  // Reads what this layout holds: whole parameters (stages 0–2) or the rank's pieces (stage 3), whole
  // state (stage 0) or the rank's pieces (1–3). Everything lands in scratch first, so a failed load
  // leaves the trainer as it was.
  std::map<std::string, std::string> load_checkpoint(const std::filesystem::path& dir) override {
    no_pipeline("load_checkpoint");
    const auto& L = net_.layout();
    const auto mine = owned_pieces(rank_);
    std::vector<checkpoint_range> need;
    std::vector<float*> dst;
    for (int k = -1; k < Optimizer::state_slots; ++k) {
      if ((k < 0 && sharded_master) || (k >= 0 && stage >= 1)) {
        for (const auto& p : mine) {
          need.push_back({checkpoint_tensor_name(k, L.slots[p.slot].name), p.begin, p.end});
          dst.push_back(held(k, p));
        }
      } else {
        float* base = k < 0 ? full_master() : state_.slot(k).data();
        for (const auto& s : L.slots) {
          need.push_back({checkpoint_tensor_name(k, s.name), 0, s.shape.numel()});
          dst.push_back(base + s.offset);
        }
      }
    }
    std::size_t total = 0;
    for (const auto& q : need) total += static_cast<std::size_t>(q.end - q.begin);
    std::vector<float> scratch(total);
    std::vector<float*> out;
    for (std::size_t i = 0, at = 0; i < need.size(); at += static_cast<std::size_t>(need[i].end - need[i].begin), ++i)
      out.push_back(scratch.data() + at);
    auto info = train::detail::read_checkpoint(comm_, dir, checkpoint_description(), need,
                                               std::span<float* const>(out));
    for (std::size_t i = 0; i < need.size(); ++i)
      dml::copy_n(out[i], static_cast<std::size_t>(need[i].end - need[i].begin), dst[i]);
    step_ = info.step;
    opt_.seed = info.seed;  // dropout masks follow (seed, step)
    optimizer_step_ = step_;
    if (auto it = info.user.find("dml.optimizer_step"); it != info.user.end()) {
      optimizer_step_ = std::stoll(it->second);
      info.user.erase(it);
    }
    if constexpr (Precision::loss_scaling) {
      auto scale = info.user.find("dml.loss_scale"), tracker = info.user.find("dml.loss_scale_tracker");
      if (scale != info.user.end() && tracker != info.user.end())
        scaler_.restore(std::stof(scale->second), std::stoll(tracker->second));
    }
    info.user.erase("dml.loss_scale");
    info.user.erase("dml.loss_scale_tracker");
    refresh_working();
    return info.user;
  }

 private:
  using owned_piece = parallel::owned_piece;
  std::vector<owned_piece> owned_pieces(int r) const { return parallel::owned_pieces(net_.layout(), buckets_, r); }
  // Where this rank keeps a piece: of the parameters (k < 0) or of state slot k.
  float* held(int k, const owned_piece& p) {
    if (k < 0) {
      if constexpr (sharded_master) return shard_params_.data() + p.shard;
      else if constexpr (mixed) return master_.data() + p.flat;
      else return net_.params().data() + p.flat;
    }
    return state_.slot(k).data() + (stage == 0 ? p.flat : p.shard);
  }
  checkpoint_info checkpoint_description() const {
    checkpoint_info info;
    info.optimizer = Optimizer::name;
    info.state_slots = Optimizer::state_slots;
    info.step = step_;
    info.seed = opt_.seed;
    info.world_size = ranks_;
    info.sharding = Sharding::name;
    for (const auto& s : net_.layout().slots) info.model.push_back({s.name, s.shape.vec()});
    return info;
  }

  void make_buckets() {
    const auto target = static_cast<std::int64_t>(opt_.bucket_mb * 1024.0 * 1024.0 / sizeof(float));
    auto plan = parallel::make_buckets(net_.layout(), sizeof...(Layers), target, ranks_, chunks_);
    buckets_ = std::move(plan.buckets);
    layer_bucket_ = std::move(plan.layer_bucket);
  }

  void init_shard_params() {
    buffer<float, Space> tmp;
    const auto& L = net_.layout();
    for (const auto& bk : buckets_) {
      tmp.resize(static_cast<std::size_t>(bk.hi - bk.lo));
      fill_n<Space>(tmp.data(), bk.hi - bk.lo, 0.f);
      for (std::size_t s = bk.first_slot; s < bk.end_slot; ++s)
        net_.init_range(opt_.seed, s, 0, L.slots[s].shape.numel(), tmp.data() + (L.slots[s].offset - bk.lo));
      dml::copy_n(tmp.data() + rank_ * bk.part, static_cast<std::size_t>(bk.part), shard_params_.data() + bk.shard_offset);
    }
  }

  void log(event_kind k, int b = -1) {
    if (opt_.record_events)
      events_.push_back({k, b, std::chrono::duration<double>(std::chrono::steady_clock::now() - born_).count()});
  }
  // With an event log, notes each communication the moment it is seen complete (after every layer).
  void poll() {
    if (!opt_.record_events) return;
    auto look = [&](inflight& f) {
      if (f.bucket >= 0 && !f.seen && f.r.test()) {
        f.seen = true;
        log(event_kind::comm_done, f.bucket);
      }
    };
    for (auto& f : pending_) look(f);
    for (auto& f : reduce_) look(f);
  }

  // ---- hooks: ZeRO-3 gathers parameters around each bucket; every stage launches bucket reductions.
  void point_params(int b) {
    const auto& bk = buckets_[static_cast<std::size_t>(b)];
    T* base = gathered_[static_cast<std::size_t>(b % 2)].data();
    for (std::size_t s = bk.first_slot; s < bk.end_slot; ++s)
      net_.set_param_pointer(s, base + (net_.layout().slots[s].offset - bk.lo));
  }
  void gather(int b, bool async) {
    const auto& bk = buckets_[static_cast<std::size_t>(b)];
    const auto slot = static_cast<std::size_t>(b % 2);
    auto send = std::span<const T>(working_shard() + bk.shard_offset, bk.part);
    auto recv = std::span<T>(gathered_[slot].data(), bk.hi - bk.lo);
    order_after_compute();  // the slot may still be read by kernels of the bucket it held
    if (async) gather_req_[slot] = comm_.iall_gather(send, recv);
    else comm_.all_gather(send, recv);
    resident_[slot] = b;
  }
  void ensure_gathered(int b) {
    const auto slot = static_cast<std::size_t>(b % 2);
    if (resident_[slot] == b) gather_req_[slot].wait();
    else gather(b, false);
    point_params(b);
  }
  void prefetch(int b) {
    if (b < 0 || b >= static_cast<int>(buckets_.size())) return;
    const auto slot = static_cast<std::size_t>(b % 2);
    if (resident_[slot] == b) return;
    gather_req_[slot].wait();
    gather(b, true);
  }
  void before_forward(std::size_t layer) override {
    if constexpr (stage == 3) {
      const int b = layer_bucket_[layer];
      if (b < 0 || b == current_) return;
      current_ = b;
      ensure_gathered(b);
      prefetch(b - 1);  // forward walks buckets from the last index down
    }
  }
  void before_backward(std::size_t layer) override {
    const int b = layer_bucket_[layer];
    if (b < 0 || layer != buckets_[static_cast<std::size_t>(b)].last_layer) return;
    if constexpr (stage == 3) {
      current_ = b;
      ensure_gathered(b);
      prefetch(b + 1);  // backward walks buckets upwards
    }
    if constexpr (stage >= 2) {
      // The staging buffer this bucket takes may still be in flight for bucket b − 2.
      const auto slot = static_cast<std::size_t>(b % 2);
      complete(reduce_[slot]);
      const auto& bk = buckets_[static_cast<std::size_t>(b)];
      fill_n<Space>(staging_[slot].data(), bk.hi - bk.lo, T(0.f));  // padding must reduce to zero
      for (std::size_t s = bk.first_slot; s < bk.end_slot; ++s)
        net_.set_grad_pointer(s, staging_[slot].data() + (net_.layout().slots[s].offset - bk.lo));
    }
  }
  void after_backward(std::size_t layer) override {
    poll();
    const int b = layer_bucket_[layer];
    if (b < 0 || layer != buckets_[static_cast<std::size_t>(b)].first_layer) return;
    const auto& bk = buckets_[static_cast<std::size_t>(b)];
    log(event_kind::bucket_launch, b);
    order_after_compute();  // the bucket's gradients come from kernels still in the queue
    if constexpr (stage == 0) {
      pending_.push_back({comm_.iall_reduce(net_.grads().subspan(bk.lo, bk.hi - bk.lo), comm::reduce_op::sum), b, false});
    } else if constexpr (stage == 1) {
      pending_.push_back({comm_.ireduce_scatter(std::span<const T>(net_.grads().data() + bk.lo, bk.hi - bk.lo),
                                                std::span<T>(shard_grads_.data() + bk.shard_offset, bk.part),
                                                comm::reduce_op::sum),
                          b, false});
    } else {
      const auto slot = static_cast<std::size_t>(b % 2);
      T* out = shard_grads_.data() + bk.shard_offset;
      if (micro_index_ > 0) {  // later micro-batches reduce aside and add into the shard when done
        shard_tmp_.resize(static_cast<std::size_t>(shard_));
        out = shard_tmp_.data() + bk.shard_offset;
      }
      reduce_[slot] = {comm_.ireduce_scatter(std::span<const T>(staging_[slot].data(), bk.hi - bk.lo),
                                             std::span<T>(out, bk.part), comm::reduce_op::sum),
                       b, false};
    }
  }
  void complete(inflight& f) {
    const int b = f.bucket;
    if (b < 0) return;
    f.r.wait();
    if (micro_index_ > 0 && stage >= 2) {
      const auto& bk = buckets_[static_cast<std::size_t>(b)];
      T* dst = shard_grads_.data() + bk.shard_offset;
      const T* src = shard_tmp_.data() + bk.shard_offset;
      for_each_index<Space>(bk.part, add_into<T>{dst, src});
    }
    if (!f.seen) log(event_kind::comm_done, b);
    f.bucket = -1;
  }
  void finish_communication() {
    for (auto& f : pending_) complete(f);
    pending_.clear();
    for (auto& f : reduce_) complete(f);
    current_ = -1;
  }

  // Collectives run on the communicator's stream, kernels on the compute stream (current_stream()):
  // before a collective reads or writes memory that kernels touched, its stream waits for what the
  // compute stream has queued so far. (Completion needs no event: wait() blocks the host, and kernels
  // are only queued after it returns.)
  void order_after_compute() {
#if DML_HAS_CUDA
    if constexpr (std::same_as<Space, cuda> && requires(Comm& c) { c.stream(); }) {
      if (!compute_done_) DML_CHECK_CUDA(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
      DML_CHECK_CUDA(cudaEventRecord(compute_done_, current_stream()));
      DML_CHECK_CUDA(cudaStreamWaitEvent(comm_.stream(), compute_done_, 0));
    }
#endif
  }

  // A scalar summed over ranks. Collectives take memory of the trainer's space (NCCL reads device
  // memory only), so a device trainer moves the value through a one-element device buffer.
  template <class V>
  V sum_over(Comm& group, V value) {
    if (group.size() == 1) return value;
    if constexpr (std::same_as<Space, host>) {
      std::array<V, 1> v{value};
      group.all_reduce(std::span<V>(v), comm::reduce_op::sum);
      return v[0];
    } else {
      buffer<V, Space> v(1);
      dml::copy_n(&value, 1, v.data());
      order_after_compute();
      group.all_reduce(std::span<V>(v.data(), 1), comm::reduce_op::sum);
      dml::copy_n(v.data(), 1, &value);
      return value;
    }
  }

  // The global index of this rank's first row. Ranks pass contiguous slices of the global batch in
  // rank order (train::sampler::slice), so it is the sum of the earlier ranks' row counts: one
  // all_gather of an int64, made only for models with a layer that reads it (dropout).
  std::int64_t first_global_row(std::int64_t rows) {
    if constexpr (!nn::sequential<Layers...>::uses_row_index) {
      return 0;
    } else {
      if (ranks_ == 1) return 0;
      std::vector<std::int64_t> counts(static_cast<std::size_t>(ranks_));
      if constexpr (std::same_as<Space, host>) {
        comm_.all_gather(std::span<const std::int64_t>(&rows, 1), std::span<std::int64_t>(counts));
      } else {
        buffer<std::int64_t, Space> mine(1), all(counts.size());
        dml::copy_n(&rows, 1, mine.data());
        order_after_compute();
        comm_.all_gather(std::span<const std::int64_t>(mine.data(), 1), std::span<std::int64_t>(all.data(), counts.size()));
        dml::copy_n(all.data(), counts.size(), counts.data());
      }
      std::int64_t first = 0;
      for (int r = 0; r < rank_; ++r) first += counts[static_cast<std::size_t>(r)];
      return first;
    }
  }

  // ---- precision
  // ZeRO-3 gathers the working copy of the shard (the float master itself in fp32).
  const T* working_shard() const {
    if constexpr (mixed) return shard_working_.data();
    else return shard_params_.data();
  }
  float* full_master() {
    if constexpr (mixed) return master_.data();
    else return net_.params().data();
  }
  float loss_scale() const {
    if constexpr (Precision::loss_scaling) return scaler_.scale();
    else return 1.f;
  }
  bool has_overflow() const {
    if constexpr (stage == 0) return optim::has_nonfinite<Space>(net_.grads().data(), net_.layout().total);
    else return optim::has_nonfinite<Space>(shard_grads_.data(), shard_);
  }
  // After the float parameters changed outside an update (load): rewrite the working copy from them.
  void refresh_working() {
    resident_ = {-1, -1};  // gathered copies are stale now
    if constexpr (mixed && stage == 0) {
      cast_n<Space>(master_.data(), net_.params().data(), net_.layout().total);
    } else if constexpr (mixed && stage == 3) {
      cast_n<Space>(shard_params_.data(), shard_working_.data(), shard_);
    } else if constexpr (mixed) {  // ZeRO-1/2: cast this rank's parts, then gather every part
      for (const auto& bk : buckets_) {
        T* w = net_.params().data() + bk.lo;
        cast_n<Space>(shard_params_.data() + bk.shard_offset, w + rank_ * bk.part, bk.part);
        order_after_compute();
        comm_.all_gather(std::span<T>(w, bk.hi - bk.lo));
      }
    }
  }

  // ---- the update
  float clip_scale(double& norm) {
    if (opt_.clip_norm <= 0.f) return 1.f;
    if constexpr (stage == 0) {
      // Replicated gradients: each stage's norm once, summed over the stages.
      const double local = optim::squared_norm<Space>(net_.grads().data(), net_.layout().total);
      norm = std::sqrt(stages_ > 1 ? sum_over(*owned_pp_, local) : local);
    } else {
      norm = std::sqrt(sum_over(world_, optim::squared_norm<Space>(shard_grads_.data(), shard_)));
    }
    norm /= loss_scale();  // the norm of the true gradients, not of the scaled ones
    return optim::clip_scale(norm, opt_.clip_norm);
  }

  // One fused pass per range: unscale and clip (grad_scale), the optimizer's update of the float
  // weights, and under mixed precision the cast into the working copy.
  void update(float grad_scale) {
    const float lr = opt_.lr ? opt_.lr(step_) : optimizer_.default_lr();
    const std::int64_t t = optimizer_step_;
    if constexpr (stage == 0) {
      optim::step_args a{.n = net_.layout().total, .w = full_master(), .g = net_.grads().data(),
                         .state = state_.pointers(), .step = t, .lr = lr, .grad_scale = grad_scale};
      if constexpr (mixed) a.working = net_.params().data();
      optimizer_.template update<Space>(a);
    } else if constexpr (stage == 3) {
      optim::step_args a{.n = shard_, .w = shard_params_.data(), .g = shard_grads_.data(), .state = state_.pointers(),
                         .step = t, .lr = lr, .grad_scale = grad_scale};
      if constexpr (mixed) a.working = shard_working_.data();
      optimizer_.template update<Space>(a);
      resident_ = {-1, -1};  // gathered copies are stale now
    } else {
      for (const auto& bk : buckets_) {
        std::array<float*, Optimizer::state_slots> st{};
        for (int s = 0; s < Optimizer::state_slots; ++s) st[s] = state_.pointers()[s] + bk.shard_offset;
        T* w = net_.params().data() + bk.lo;
        optim::step_args a{.n = bk.part, .g = shard_grads_.data() + bk.shard_offset, .state = st.data(), .step = t,
                           .lr = lr, .grad_scale = grad_scale};
        if constexpr (mixed) {
          a.w = shard_params_.data() + bk.shard_offset;  // float master shard
          a.working = w + rank_ * bk.part;
        } else {
          a.w = w + rank_ * bk.part;
        }
        optimizer_.template update<Space>(a);
        order_after_compute();  // the update kernels wrote this rank's part
        comm_.all_gather(std::span<T>(w, bk.hi - bk.lo));  // in place: this rank's part is at rank·part
      }
    }
  }

  // ---- the step's tail: loss over every rank, clipping, loss scaling, the update
  step_result finish_step(float local_loss) {
    step_result out{.loss = sum_over(world_, local_loss)};  // only last stages hold a loss
    float scale = clip_scale(out.grad_norm);
    if constexpr (Precision::loss_scaling) {
      // Every rank sees the same verdict: the overflow flag is summed over ranks.
      const bool found_inf = sum_over(world_, static_cast<int>(has_overflow())) > 0;
      out.skipped = !scaler_.update(found_inf);
      out.loss_scale = scaler_.scale();
      if (out.skipped) {
        log(event_kind::step_end);
        return out;
      }
    }
    ++optimizer_step_;
    update(scale / loss_scale());
    log(event_kind::step_end);
    return out;
  }

  // ---- pipeline: stages, chunks and the schedule
  static int checked_stages(const Comm& comm, const trainer_options& o) {
    if (o.pipeline_stages < 1 || comm.size() % o.pipeline_stages != 0)
      fail<invalid_argument>("dml::trainer: expected pipeline_stages >= 1 dividing the group's ", comm.size(),
                             " ranks, found ", o.pipeline_stages);
    return o.pipeline_stages;
  }
  // Megatron's order: data-parallel rank fastest, so world rank = dp + DP·pp.
  std::unique_ptr<Comm> split_dp(Comm& world) const {
    if (stages_ == 1) return nullptr;
    return std::make_unique<Comm>(world.split(pp_rank_, world.rank()));
  }
  std::unique_ptr<Comm> split_pp(Comm& world) const {
    return std::make_unique<Comm>(world.split(world.rank() % (world.size() / stages_), pp_rank_));
  }
  // The layer ranges this rank runs: virtual stage c·K + pp_rank for each chunk c.
  std::vector<nn::layer_range> stage_chunks(const nn::sequential<Layers...>& model, int virtual_stages) const {
    const std::size_t n = static_cast<std::size_t>(stages_) * static_cast<std::size_t>(virtual_stages);
    if (n == 1) return {{0, sizeof...(Layers)}};
    std::vector<bool> cuttable(sizeof...(Layers));
    for (std::size_t l = 0; l < cuttable.size(); ++l) cuttable[l] = !net_type::absorbed_[l];
    std::vector<std::size_t> first;
    if (!opt_.stage_cuts.empty()) {
      if (opt_.stage_cuts.size() + 1 != n)
        fail<invalid_argument>("dml::trainer: expected ", n - 1, " stage cuts for ", n, " (virtual) stages, found ",
                               opt_.stage_cuts.size());
      first = parallel::check_cuts(opt_.stage_cuts, sizeof...(Layers), cuttable);
    } else {
      first = parallel::balance_stages(layer_costs(model), static_cast<int>(n), cuttable);
    }
    std::vector<nn::layer_range> out;
    for (std::size_t v = static_cast<std::size_t>(pp_rank_); v < n; v += static_cast<std::size_t>(stages_))
      out.push_back({first[v], v + 1 < n ? first[v + 1] : sizeof...(Layers)});
    return out;
  }
  // GPipe's partition cost: a layer's parameters plus the activations it writes for cost_rows rows.
  std::vector<double> layer_costs(const nn::sequential<Layers...>& model) const {
    std::vector<double> cost(sizeof...(Layers), 0.0);
    for (const auto& [layer, spec] : model.parameters()) cost[layer] += static_cast<double>(spec.shape.numel());
    return cost_with_activations(model, cost);
  }
  std::vector<double> cost_with_activations(const nn::sequential<Layers...>& model, std::vector<double> cost) const {
    // The first layer's input width is the first static or linear width we can find; shapes follow.
    dml::shape x{opt_.cost_rows, input_width(model)};
    std::size_t l = 0;
    std::apply([&](const auto&... layer) { ((x = layer.output_shape(x), cost[l++] += static_cast<double>(x.numel())), ...); },
               model.layers);
    return cost;
  }
  static std::int64_t input_width(const nn::sequential<Layers...>& model) {
    const auto& first = std::get<0>(model.layers);
    if constexpr (requires { first.in; }) return first.in;
    else return 1;
  }
  // Chunks per rank: the schedule's virtual stages (interleaved<V>: V; the rest 1).
  int virtual_stages() const {
    const auto m = opt_.micro_batches;
    return (opt_.schedule.empty() ? default_schedule_(stages_, m)
                                  : schedule::make(opt_.schedule, stages_, static_cast<int>(m)))
        .virtual_stages;
  }
  const schedule::table& schedule_of(std::int64_t micro_batches) {
    auto it = schedules_.find(micro_batches);
    if (it != schedules_.end()) return it->second;
    auto t = opt_.schedule.empty() ? default_schedule_(stages_, micro_batches)
                                   : schedule::make(opt_.schedule, stages_, static_cast<int>(micro_batches));
    if (t.stages != stages_ || t.micro_batches != micro_batches)
      fail<invalid_argument>("dml::trainer: expected a schedule of ", stages_, " stages and ", micro_batches,
                             " micro-batches, found ", t.stages, " and ", t.micro_batches);
    if (!chunks_.empty() && t.virtual_stages != static_cast<int>(chunks_.size()))
      fail<invalid_argument>("dml::trainer: expected a schedule of ", chunks_.size(), " virtual stages per rank, found ",
                             t.virtual_stages);
    schedule::check(t);
    if constexpr (stage >= 2)
      for (const auto& list : t.ranks)
        for (const auto& a : list)
          if (a.kind == schedule::op::backward_input)
            fail<invalid_argument>("dml::trainer: ", Sharding::name,
                                   " reduces gradients during backward and cannot split it; use replicate or zero<1> "
                                   "with a zero-bubble schedule");
    return schedules_.emplace(micro_batches, std::move(t)).first->second;
  }
  const schedule::table& schedule_table(std::int64_t micro_batches) override { return schedule_of(micro_batches); }
  std::int64_t peak_activation_bytes() const override { return peak_bytes_; }
  std::int64_t peak_in_flight() const override { return peak_sets_; }

  static bool is_backward(schedule::op k) {
    return k == schedule::op::backward || k == schedule::op::backward_input || k == schedule::op::backward_weight;
  }
  int virtual_stage(const schedule::action& a) const { return a.chunk * stages_ + pp_rank_; }
  int last_virtual_stage() const { return static_cast<int>(chunks_.size()) * stages_ - 1; }
  int stage_of(int v) const { return v % stages_; }
  // Messages are matched by identity: (activation or gradient, receiving virtual stage, micro-batch).
  int pp_tag(bool gradient, int v, std::int64_t m) const {
    return 1 + 2 * static_cast<int>(m * (last_virtual_stage() + 1) + v) + (gradient ? 1 : 0);
  }
  std::pair<std::int64_t, std::int64_t> rows_of(std::int64_t m) const {
    return {run_.rows * m / run_.micro_batches, run_.rows * (m + 1) / run_.micro_batches};
  }
  dml::shape batch_shape(std::int64_t rows) const {
    dml::shape s = run_.x.shape;
    s[0] = rows;
    return s;
  }
  nn::context context_of(std::int64_t m, bool accumulate) const {
    return {.training = true, .seed = opt_.seed, .step = static_cast<std::uint64_t>(step_),
            .row_offset = run_.first_row + rows_of(m).first, .accumulate = accumulate};
  }

  // What a (micro-batch, chunk) keeps between its actions. Tensors stay allocated across steps.
  struct micro_state {
    nn::activations<T, Space> acts;
    tensor<T, Space> gradient_in;                     // ∂loss/∂output: the loss gradient, or received
    tensor<T, Space> activation_out, gradient_out;    // kept until their sends complete
    comm::request activation_send, gradient_send;
    std::int64_t counted = -1;                        // activation bytes while live, else −1
    void sends_done() {
      activation_send.wait();
      gradient_send.wait();
    }
  };
  micro_state& micro(const schedule::action& a) { return micro_[{a.micro, a.chunk}]; }
  void track(micro_state& m, bool live) {
    if (m.counted >= 0) {
      live_bytes_ -= m.counted;
      --live_sets_;
      m.counted = -1;
    }
    if (live) {
      m.counted = m.acts.bytes();
      live_bytes_ += m.counted;
      peak_bytes_ = std::max(peak_bytes_, live_bytes_);
      peak_sets_ = std::max(peak_sets_, ++live_sets_);
    }
  }
  void release_all() {
    for (auto& [key, m] : micro_) track(m, false);
  }
  static void copy_into(tensor<T, Space>& dst, tensor_view<const T, Space> src) {
    dst.resize(src.shape);
    dml::copy_n(src.data, static_cast<std::size_t>(src.numel()), dst.data());
  }

  float run_forward(const schedule::action& a, std::size_t index) {
    const int v = virtual_stage(a);
    auto& m = micro(a);
    const auto range = chunks_[static_cast<std::size_t>(a.chunk)];
    const auto [lo, hi] = rows_of(a.micro);
    if (v == 0) {
      const std::int64_t per_row = run_.x.numel() / std::max<std::int64_t>(run_.rows, 1);
      net_.set_input(m.acts, tensor_view<const float, Space>(run_.x.data + lo * per_row, batch_shape(hi - lo)));
    } else if (stage_of(v - 1) == pp_rank_) {  // one stage holding several chunks: handed over in memory
      copy_into(m.acts.input, micro({.kind = a.kind, .micro = a.micro, .chunk = a.chunk - 1}).activation_out.cview());
    }
    log(event_kind::compute_begin, static_cast<int>(index));
    current_ = -1;
    auto out = net_.forward_range(range, m.acts, context_of(a.micro, false), this);
    float loss = 0.f;
    if (v == last_virtual_stage()) {
      m.gradient_in.resize(out.shape);
      row_loss_.resize(static_cast<std::size_t>(out.rows()));
      loss = loss_fn_.template forward_backward<Space>(out, run_.y + lo, m.gradient_in.view(), row_loss_.data(),
                                                        run_.global_batch, loss_scale());
    } else {
      m.activation_send.wait();
      copy_into(m.activation_out, out);
    }
    if (opt_.recompute) m.acts.release_outputs();
    track(m, true);
    log(event_kind::compute_end, static_cast<int>(index));
    return loss;
  }

  void run_backward(const schedule::action& a, std::size_t index) {
    const int v = virtual_stage(a);
    const auto c = static_cast<std::size_t>(a.chunk);
    auto& m = micro(a);
    const auto range = chunks_[c];
    const auto part = a.kind == schedule::op::backward         ? nn::backward_part::full
                      : a.kind == schedule::op::backward_input ? nn::backward_part::input
                                                               : nn::backward_part::weight;
    if (part != nn::backward_part::weight && v < last_virtual_stage() && stage_of(v + 1) == pp_rank_)
      copy_into(m.gradient_in, micro({.kind = a.kind, .micro = a.micro, .chunk = a.chunk + 1}).gradient_out.cview());
    log(event_kind::compute_begin, static_cast<int>(index));
    if (opt_.recompute && part != nn::backward_part::weight) {
      current_ = -1;
      net_.forward_range(range, m.acts, context_of(a.micro, false), this);
    }
    auto& done = part == nn::backward_part::weight ? weights_done_[c] : backwards_done_[c];
    micro_index_ = done;  // ZeRO-2/3: the first backward of the step writes the shard, later ones add
    // ZeRO-2/3 reduce every micro-batch into the shard; DDP and ZeRO-1 after the chunk's last backward.
    const bool communicate =
        stage >= 2 || (part != nn::backward_part::input && last_backward_[c] == static_cast<std::int64_t>(index));
    log(event_kind::backward_begin);
    auto dx = net_.backward_range(range, m.acts, m.gradient_in.cview(), context_of(a.micro, done > 0 && stage < 2),
                                  part, v > 0, communicate ? this : nullptr);
    log(event_kind::backward_end);
    ++done;
    if (v > 0 && part != nn::backward_part::weight) {
      m.gradient_send.wait();
      copy_into(m.gradient_out, dx);
    }
    if (part != nn::backward_part::input) {
      track(m, false);
      if (opt_.recompute) m.acts.release_outputs();
    }
    if constexpr (stage >= 2) finish_communication();
    log(event_kind::compute_end, static_cast<int>(index));
  }

  void send(const schedule::action& a, bool gradient) {
    const int to = virtual_stage(a) + (gradient ? -1 : 1);
    if (stage_of(to) == pp_rank_) return;  // handed over in memory
    auto& m = micro(a);
    const auto& t = gradient ? m.gradient_out : m.activation_out;
    order_after_compute();
    (gradient ? m.gradient_send : m.activation_send) =
        owned_pp_->isend(std::span<const T>(t.data(), static_cast<std::size_t>(t.numel())), stage_of(to),
                         pp_tag(gradient, to, a.micro));
  }
  void receive_into(tensor<T, Space>& t, const dml::shape& s, int tag, int from) {
    t.resize(s);
    owned_pp_->recv(std::span<T>(t.data(), static_cast<std::size_t>(t.numel())), from, tag);
  }
  void receive(const schedule::action& a, bool gradient) {
    const int v = virtual_stage(a), from = v + (gradient ? 1 : -1);
    if (stage_of(from) == pp_rank_) return;
    auto& m = micro(a);
    const auto range = chunks_[static_cast<std::size_t>(a.chunk)];
    const auto [lo, hi] = rows_of(a.micro);
    const auto shapes = net_.shapes(batch_shape(hi - lo));
    if (gradient) receive_into(m.gradient_in, shapes[range.end - 1], pp_tag(true, v, a.micro), stage_of(from));
    else receive_into(m.acts.input, shapes[range.first - 1], pp_tag(false, v, a.micro), stage_of(from));
  }

  // ---- the whole model's layout for pipeline ranks: each stage fills its own slots, the rest sum in.
  std::vector<float> to_full_layout(const std::vector<float>& mine) {
    std::vector<float> full(static_cast<std::size_t>(full_layout_.total), 0.f);
    const auto& L = net_.layout();
    for (const auto& s : L.slots)
      std::copy_n(mine.data() + s.offset, s.shape.numel(), full.data() + full_layout_.slots[s.id].offset);
    buffer<float, Space> staged(full.size());
    dml::copy_n(full.data(), full.size(), staged.data());
    owned_pp_->all_reduce(std::span<float>(staged.data(), full.size()), comm::reduce_op::sum);
    dml::copy_n(staged.data(), full.size(), full.data());
    return full;
  }
  std::vector<float> from_full_layout(std::span<const float> full) const {
    const auto& L = net_.layout();
    std::vector<float> mine(static_cast<std::size_t>(L.total), 0.f);
    for (const auto& s : L.slots)
      std::copy_n(full.data() + full_layout_.slots[s.id].offset, s.shape.numel(), mine.data() + s.offset);
    return mine;
  }
  void no_pipeline(const char* what) const {
    if (stages_ > 1)
      fail<invalid_argument>("dml::trainer::", what, ": checkpoints of a pipeline-parallel trainer (", stages_,
                             " stages) are not supported yet; save full_parameters() instead");
  }

  struct step_inputs {
    tensor_view<const float, Space> x{};
    const std::int32_t* y = nullptr;
    std::int64_t global_batch = 0, rows = 0, micro_batches = 1, first_row = 0;
  };

  Comm& world_;
  trainer_options opt_;
  Optimizer optimizer_;
  int stages_ = 1, pp_rank_ = 0;
  std::unique_ptr<Comm> owned_dp_, owned_pp_;  // the stage's data-parallel group, and the pipeline group
  Comm& comm_;                                 // data-parallel group: buckets, shards, first rows
  int ranks_, rank_;
  make_schedule default_schedule_;
  nn::sequential<Layers...> model_;
  std::vector<nn::layer_range> chunks_;  // this rank's layer ranges, one per chunk
  net_type net_;
  nn::param_layout full_layout_;
  std::map<std::int64_t, schedule::table> schedules_;
  std::map<std::pair<std::int64_t, int>, micro_state> micro_;
  step_inputs run_;
  std::vector<std::int64_t> last_backward_, backwards_done_, weights_done_;
  std::int64_t live_bytes_ = 0, peak_bytes_ = 0, live_sets_ = 0, peak_sets_ = 0;
  nn::softmax_cross_entropy loss_fn_;
  std::vector<bucket> buckets_;
  std::vector<int> layer_bucket_;
  std::int64_t shard_ = 0, step_ = 0, micro_index_ = 0;
  buffer<float, Space> shard_params_, master_;  // float weights: a shard, or all of them (mixed DDP)
  buffer<T, Space> shard_grads_, shard_tmp_, shard_working_;
  buffer<T, Space> staging_[2], gathered_[2];
  optim::loss_scaler scaler_;
  std::int64_t optimizer_step_ = 0;  // updates applied (fp16 skips some steps)
  optim::state<Optimizer, Space> state_;
  std::array<int, 2> resident_{-1, -1};
  int current_ = -1;
  comm::request gather_req_[2];
  std::vector<inflight> pending_;  // DDP and ZeRO-1: one per bucket
  inflight reduce_[2];             // ZeRO-2/3: one per staging buffer
  std::chrono::steady_clock::time_point born_ = std::chrono::steady_clock::now();
#if DML_HAS_CUDA
  cudaEvent_t compute_done_ = nullptr;
#endif
  buffer<float, Space> row_loss_;
  std::vector<event> events_;
};

}  // namespace detail

}  // namespace train

// trainer<Policies...>: policies in any order, at most one per family; defaults replicate, AdamW, fp32.
template <class... Policies>
class trainer {
  static_assert((detail::has_policy_family<Policies> && ...),
                "dml::trainer: every template argument must be a policy (a type with a `policy_family`), e.g. "
                "dml::parallel::zero<2>, dml::optim::adamw, dml::precision::fp32");
  static_assert(count_policies<sharding_family, Policies...> <= 1, "dml::trainer: give at most one sharding policy");
  static_assert(count_policies<optimizer_family, Policies...> <= 1, "dml::trainer: give at most one optimizer");
  static_assert(count_policies<precision_family, Policies...> <= 1, "dml::trainer: give at most one precision policy");
  static_assert(count_policies<space_family, Policies...> <= 1, "dml::trainer: give at most one execution space");
  static_assert(count_policies<schedule_family, Policies...> <= 1, "dml::trainer: give at most one schedule");

 public:
  using sharding_policy = find_policy_t<sharding_family, parallel::replicate, Policies...>;
  using optimizer_policy = find_policy_t<optimizer_family, optim::adamw, Policies...>;
  using precision_policy = find_policy_t<precision_family, dml::precision::fp32, Policies...>;
  using space = find_policy_t<space_family, host, Policies...>;
  // No schedule given: one stage runs schedule::single, a pipeline schedule::one_f_one_b.
  using schedule_policy = find_policy_t<schedule_family, void, Policies...>;
  static_assert(std::is_same_v<precision_policy, dml::precision::fp32> ||
                    std::string_view(optimizer_policy::name) != std::string_view("adagrad"),
                "dml::trainer: bf16 and fp16 need an optimizer that writes the working copy (sgd, adam, adamw)");

  template <comm::communicator C, class... L>
  trainer(C& comm, const nn::sequential<L...>& model, train::trainer_options options = {}, optimizer_policy opt = {})
      : engine_(std::make_unique<train::detail::engine<space, C, sharding_policy, optimizer_policy, precision_policy, L...>>(
            comm, model, std::move(options), opt, [](int stages, std::int64_t m) {
              const int micro = static_cast<int>(m);
              if constexpr (!std::is_void_v<schedule_policy>) return schedule_policy::make(stages, micro);
              else if (stages == 1) return schedule::single::make(1, micro);
              else return schedule::one_f_one_b::make(stages, micro);
            })) {}

  // One optimizer step. x and y are this rank's rows of the global batch (the trainer's loss divides by
  // global_batch, so ranks may hold different row counts). Collective: every rank calls it.
  train::step_result step(tensor_view<const float, space> x, const std::int32_t* y, std::int64_t global_batch) {
    return engine_->step(x, y, global_batch);
  }
  // Rows of x whose largest logit is the label (inference; collective under zero<3> and across pipeline
  // stages, where the last stage counts and the others return 0).
  std::int64_t correct(tensor_view<const float, space> x, const std::int32_t* y) { return engine_->correct(x, y); }
  // Every parameter in the flat layout (collective under zero<3>); and the reverse.
  std::vector<float> full_parameters() { return engine_->full_parameters(); }
  void load_full_parameters(std::span<const float> p) { engine_->load_full_parameters(p); }
  train::memory_report memory() const { return engine_->memory(); }
  const nn::param_layout& layout() const { return engine_->layout(); }
  const std::vector<train::event>& events() const { return engine_->events(); }
  std::span<const train::detail::bucket> buckets() const { return engine_->buckets(); }
  std::int64_t steps() const { return engine_->steps(); }
  // This rank's pipeline schedule for a step of `micro_batches` (all ranks' lists; checked).
  const schedule::table& schedule_table(std::int64_t micro_batches) { return engine_->schedule_table(micro_batches); }
  // Of the last step on this rank: the most activation bytes and (micro-batch, chunk) sets held at once.
  std::int64_t peak_activation_bytes() const { return engine_->peak_activation_bytes(); }
  std::int64_t peak_in_flight() const { return engine_->peak_in_flight(); }

  // Sharded checkpoint of parameters, optimizer state, step and seed (which drive the learning rate
  // and dropout), with the caller's own position in `user_meta` (epoch, batch, ...). Collective.
  // Writes dir/step-<step>/ and then points dir/latest at it; see train/checkpoint.hpp.
  void save_checkpoint(const std::filesystem::path& dir, const std::map<std::string, std::string>& user_meta = {}) {
    engine_->save_checkpoint(dir, user_meta);
  }
  // Loads the checkpoint dir/latest names, whatever group size and sharding wrote it, and returns
  // its user_meta. Collective; a bad checkpoint throws the same dml::error on every rank and
  // leaves this trainer unchanged.
  std::map<std::string, std::string> load_checkpoint(const std::filesystem::path& dir) {
    return engine_->load_checkpoint(dir);
  }

 private:
  std::unique_ptr<train::detail::engine_base<space>> engine_;
};

}  // namespace dml
