// SPDX-License-Identifier: Apache-2.0
// dml/train/engine.hpp — the trainer's engine: a sequencer. parallelize() places the model; the engine runs
// this rank's program, handing forward and backward to the pipeline and gradient work to the sharding's
// sync, then clips, scales and updates. Sits on parallel/parallelize.hpp and optim/; train/trainer.hpp is
// the typed façade over it. See DESIGN.md §1 and §9.
#pragma once

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dml/optim/layerwise.hpp"
#include "dml/parallel/group_scalars.hpp"
#include "dml/parallel/parallelize.hpp"
#include "dml/parallel/routing.hpp"
#include "dml/parallel/ties.hpp"
#include "dml/parallel/trace.hpp"
#include "dml/train/checkpoint_io.hpp"
#include "dml/train/options.hpp"

namespace dml::train {

using parallel::event, parallel::event_kind, parallel::hidden_communication, parallel::memory_report;

namespace detail {

template <class Space>
struct engine_base {
  virtual ~engine_base() = default;
  virtual step_result step(tensor_view<const float, Space> x, const std::int32_t* y, std::int64_t global_batch,
                           const std::int64_t* doc_start) = 0;
  virtual state_snapshot snapshot() = 0;
  virtual void restore(const state_snapshot&) = 0;
  virtual state_pieces export_pieces() = 0;
  virtual void import_pieces(std::span<const state_pieces> sources) = 0;
  virtual std::int64_t correct(tensor_view<const float, Space> x, const std::int32_t* y) = 0;
  virtual std::vector<float> full_parameters() = 0;
  virtual void load_full_parameters(std::span<const float> full) = 0;
  virtual memory_report memory() const = 0;
  virtual const nn::param_layout& layout() const = 0;
  virtual const std::vector<event>& events() const = 0;
  virtual std::int64_t steps() const = 0;
  virtual std::span<const parallel::bucket> buckets() const = 0;
  virtual void save_checkpoint(const std::filesystem::path& dir, const std::map<std::string, std::string>& user,
                               save_mode mode) = 0;
  virtual bool wait_checkpoint() = 0;
  virtual bool checkpoint_pending() const = 0;
  virtual std::map<std::string, std::string> load_checkpoint(const std::filesystem::path& dir) = 0;
  virtual const schedule::table& schedule_table(std::int64_t micro_batches) = 0;
  virtual const parallel::program& program(std::int64_t micro_batches) = 0;
  virtual std::pair<std::int64_t, std::int64_t> activation_peaks() const = 0;  // bytes, sets
  virtual void release_activations() = 0;
  virtual const nn::rank_group* tensor_parallel_group() const = 0;            // null without tensor parallelism
  virtual void write_trace() = 0;
};

template <class Space, class Comm, class Plan, class Optimizer, class Precision, class... Layers>
class engine final : public engine_base<Space> {
  using T = typename Precision::type;
  using Sharding = typename Plan::sharding;
  using net_type = nn::basic_network<Space, T, Layers...>;
  using sync_type = typename Sharding::template sync<Space, Comm, Optimizer, Precision, net_type>;
  static_assert(parallel::diagnose_sharding_sync<sync_type, Comm, net_type>());

 public:
  engine(Comm& world, const nn::sequential<Layers...>& model, trainer_options opt, Optimizer optimizer)
      : account_(opt.memory_limit), constructing_(&account_), world_(world), opt_(std::move(opt)), optimizer_(validated(std::move(optimizer))),
        place_(world,
               parallel::trainer_mesh(world, opt_.tensor_parallel, opt_.pipeline_stages, opt_.expert_parallel,
                                      opt_.context_parallel, opt_.replicas),
               model, placement_options(opt_)),
        log_(opt_.record_events, !opt_.trace.empty()), net_(place_.part(), opt_.seed, network_options()),
        full_layout_(nn::make_layout(model, net_.layout().padding_unit)),
        sync_(place_.shards(), net_, {.seed = opt_.seed, .bucket_mb = opt_.bucket_mb, .chunks = place_.chunks(),
                                      .log = &log_, .per_step = place_.per_step(),
                                      .compress = compression(),
                                      .offload = offload_options(world), .defer_gather = static_cast<bool>(opt_.commit)}),
        pipe_(place_.pipe(), net_, opt_.pipeline_stages, place_.pp_rank(), {place_.chunks().begin(), place_.chunks().end()},
              opt_.recompute, log_, place_.tensor()),
        ties_(parallel::find_ties(net_.layout(), full_layout_, place_.mesh() ? &place_.mesh()->pp() : nullptr)),
        uncounted_(parallel::uncounted_slots(net_.layout(), place_.tp_rank())) {
    if constexpr (!requires { sync_.gradient_bytes(); })
      if (parallel::gradient_compression::parse(opt_.compress).on())
        fail<invalid_argument>("dml::trainer: compress ", opt_.compress,
                               ": expected a sharding that compresses (replicate, zero<1|2|3>), found one that does not");
    if constexpr (Precision::loss_scaling) scaler_ = optim::loss_scaler({.init_scale = opt_.initial_loss_scale});
    if (optim::uses_layerwise(optimizer_) && (opt_.tensor_parallel > 1 || opt_.expert_parallel > 1))
      fail<invalid_argument>("dml::trainer: layer-wise optimizers (lamb, lars) need whole tensors per data-parallel "
                             "group; expected tensor_parallel = expert_parallel = 1, found ", opt_.tensor_parallel,
                             " and ", opt_.expert_parallel);
    if (optim::uses_layerwise(optimizer_) && !opt_.offload.empty())
      fail<invalid_argument>("dml::trainer: offload ", opt_.offload, ": expected no offload with a layer-wise "
                             "optimizer, found lamb or lars (their trust ratios read the state in memory)");
    if (!opt_.micro_batch_rows.empty() &&
        (std::ssize(opt_.micro_batch_rows) != opt_.micro_batches ||
         std::ranges::any_of(opt_.micro_batch_rows, [](std::int64_t r) { return r < 1; })))
      fail<invalid_argument>("dml::trainer: micro_batch_rows: expected ", opt_.micro_batches,
                             " row counts of at least 1 (one per micro-batch), found ", opt_.micro_batch_rows.size(),
                             " of which ", std::ranges::count_if(opt_.micro_batch_rows, [](std::int64_t r) { return r < 1; }),
                             " below 1");
    pipe_.set_layer_context(place_.layer_groups());
    program(opt_.micro_batches);  // a bad schedule fails here, before any work
    if (log_.tracing()) start_trace();
    constructing_.end();
  }

  // Where the sharding keeps optimizer state: files named by process, trainer and rank, so that trainers
  // and processes sharing a directory never share a file.
  parallel::offload_options offload_options(Comm& world) const {
    const bool master = parallel::offload_master(opt_.offload);
    if (master && std::same_as<T, float>)
      fail<invalid_argument>("dml::trainer: offload ", opt_.offload, ": expected mixed precision (bf16, fp16) for "
                             "the master weights on disk, found fp32 (its weights are the working copy)");
    return {.dir = parallel::offload_directory(opt_.offload), .stem = parallel::offload_stem(world.rank()),
            .bucket_mb = opt_.offload_bucket_mb, .master = master};
  }

  // A step that throws (a failed collective, a failed write of offloaded optimizer state) or that
  // trainer_options::commit abandons leaves the step counters and the loss scale as they were, so that it can run
  // again: the update has not run (offload: the state it read is still on disk; restore the parameters).
  step_result step(tensor_view<const float, Space> x, const std::int32_t* y, std::int64_t global_batch,
                   const std::int64_t* doc_start) override {
    if (x.shape.rank < 1 || global_batch <= 0)
      fail<invalid_argument>("dml::trainer::step: expected a batch of rows and global_batch > 0, found shape ",
                             x.shape, " and global_batch ", global_batch);
    if (doc_start) check_documents(x.shape, doc_start);
    const memory_account::charging charge(&account_);
    // A save in the background is published once every rank's file is written (one flag's all-reduce per step).
    if (saving_ && saving_->polling() && saving_->written_everywhere(world_)) saving_->publish(world_, true);
    if (opt_.commit) released_by_checkpoint();  // ZeRO-1/2 gather the updated parts before the first pass
    const auto counters = std::pair{step_, optimizer_step_};
    const auto scaler = scaler_;
    auto undo = [&] {
      std::tie(step_, optimizer_step_) = counters;
      scaler_ = scaler;
    };
    try {
      auto out = run_step(x, y, global_batch, doc_start);
      if (!out.committed) undo();
      return out;
    } catch (...) {
      undo();
      throw;
    }
  }
  // Runs this rank's program: the schedule's compute and transfers, the sharding's unshard, reshard and
  // reductions per chunk, the tie sums and the update.
  step_result run_step(tensor_view<const float, Space> x, const std::int32_t* y, std::int64_t global_batch,
                       const std::int64_t* doc_start) {
    ++step_;
    const float lr = step_lr();  // a bad one fails here, before any work
    const std::int64_t rows = x.shape[0];
    const bool given = !opt_.micro_batch_rows.empty();
    const std::int64_t m = given ? opt_.micro_batches : std::min(opt_.micro_batches, std::max<std::int64_t>(rows, 1));
    pipe_.begin_step({.x = x, .y = y, .doc_start = doc_start, .global_batch = global_batch, .rows = rows, .micro_batches = m,
                      .micro_rows = opt_.micro_batch_rows, .first_row = first_row(rows),
                      .seed = opt_.seed, .step = static_cast<std::uint64_t>(step_), .loss_scale = loss_scale(),
                      .table = &place_.table(m)});
    float local_loss = 0.f;
    step_result out;
    using k = parallel::instruction::kind;
    const auto& prog = program(m);
    for (std::size_t i = 0; i < prog.size(); ++i) {
      const auto& [what, a, chunk, first, reduces, final] = prog[i];
      const double began = log_.tracing() ? log_.now() : 0.0;
      std::int64_t moved = -1;
      switch (what) {
        case k::unshard: sync_.unshard(chunk); break;
        case k::reshard: sync_.reshard(chunk); break;
        case k::reduce_gradients: sync_.reduce(chunk, final); break;
        case k::tie_gradients: parallel::sum_ties<Space, T>(std::span(ties_), [&](std::size_t s) { return sync_.grad_piece(s); }); break;
        case k::update: out = update(local_loss, lr); break;
        case k::run:
          if (!schedule::is_compute(a.kind)) {
            moved = schedule::is_send(a.kind) ? pipe_.send(a) : pipe_.receive(a);
            break;
          }
          log_(event_kind::compute_begin, static_cast<int>(i));
          sync_.begin_pass();
          if (a.kind == schedule::op::forward) {
            local_loss += pipe_.forward(a, &sync_);
          } else {
            if (reduces) sync_.begin_backward(first);
            // Per step, passes after a chunk's first add into its gradients; per micro-batch each writes its own.
            pipe_.backward(a, !first && place_.per_step(), reduces ? &sync_ : nullptr);
          }
          log_(event_kind::compute_end, static_cast<int>(i));
          break;
      }
      if (log_.tracing()) trace(prog[i], began, moved);
    }
    pipe_.end_step();
    return out;
  }

  // ---- the trace (trainer_options::trace)
  // Checks the file can be written, starts every rank's clock after that collective, and has the layers' groups
  // report their calls.
  void start_trace() {
    parallel::open_trace(world_, opt_.trace);
    log_.restart();
    if (auto* tp = place_.tensor()) tp->observe(&log_, "tp");
    const auto g = place_.layer_groups();
    const std::pair<nn::rank_group*, const char*> groups[] = {{g.ep, "ep"}, {g.cp, "cp"}, {g.data, "dp"}};
    for (const auto& [group, name] : groups)
      if (group) group->observe(&log_, name);
  }
  // An instruction as a slice: forward, backward, the tie sums and the update on the compute track; unshard,
  // reshard, gradient reductions and pipeline transfers (with their bytes; none for a hand-over in memory) on the
  // communication track. Then the counters.
  void trace(const parallel::instruction& in, double began, std::int64_t moved) {
    using k = parallel::instruction::kind;
    const bool run = in.what == k::run;
    const bool compute = run ? schedule::is_compute(in.a.kind) : in.what == k::tie_gradients || in.what == k::update;
    if (moved == 0) return;
    const bool whole = in.what == k::tie_gradients || in.what == k::update;
    log_.add({.name = run ? dml::detail::cat(schedule::name(in.a.kind), " c", in.a.chunk, " m", in.a.micro)
                          : parallel::to_string(in),
              .begin = began, .end = log_.now(),
              .on = compute ? parallel::track::compute : parallel::track::communication,
              .micro = run ? in.a.micro : -1, .chunk = whole ? -1 : in.chunk, .bytes = moved,
              .group = moved > 0 ? "pp" : nullptr});
    log_.count("memory allocated (bytes)", static_cast<double>(account_.live()));
    if (Precision::loss_scaling && in.what == k::update) log_.count("loss scale", static_cast<double>(scaler_.scale()));
  }
  void write_trace() override {
    if (!log_.tracing())
      fail<invalid_argument>("dml::trainer::write_trace: expected trainer_options::trace to name a file, found none");
    parallel::trace_rank r{.name = dml::detail::cat("rank ", world_.rank(), " (pp ", place_.pp_rank(), ", tp ",
                                                    place_.tp_rank(), ")"),
                           .bucket_bytes = {}};
    for (const auto& b : sync_.buckets()) r.bucket_bytes.push_back((b.hi - b.lo) * static_cast<std::int64_t>(sizeof(T)));
    parallel::write_trace(world_, opt_.trace, log_, r);
  }

  std::int64_t correct(tensor_view<const float, Space> x, const std::int32_t* y) override {
    const memory_account::charging charge(&account_);
    const int chunks = static_cast<int>(place_.chunks().size());
    sync_.begin_pass();
    for (int c = 0; c < chunks; ++c) sync_.unshard(c);
    const auto n = pipe_.correct(x, y, &sync_);
    for (int c = 0; c < chunks; ++c) sync_.reshard(c);
    return n;
  }
  std::vector<float> full_parameters() override {
    const memory_account::charging charge(&account_);
    auto* m = place_.mesh();
    if (!m) return sync_.parameters();
    return parallel::whole_model<Space>(net_.layout(), full_layout_, sync_.parameters(), m->tp_rank(), m->ep_rank(),
                                        m->tp(), m->pp(), m->ep());
  }
  void load_full_parameters(std::span<const float> full) override {
    released_by_checkpoint();
    const memory_account::charging charge(&account_);
    if (static_cast<std::int64_t>(full.size()) != full_layout_.total)
      fail<shape_error>("dml::trainer: expected ", full_layout_.total, " parameters (padding included), found ", full.size());
    if (!place_.mesh()) return sync_.load_parameters(full);
    sync_.load_parameters(parallel::part_of_whole(net_.layout(), full_layout_, full));
  }
  const nn::rank_group* tensor_parallel_group() const override { return place_.tensor(); }
  memory_report memory() const override {
    auto m = sync_.memory();
    m.activations = pipe_.peak_bytes();
    m.activations_held = pipe_.held_bytes();
    m.allocated = account_.live();
    m.allocated_peak = account_.peak();
    m.checkpoint_staging = static_cast<std::int64_t>(staging_.capacity() * sizeof(float));
    if (saving_) m.checkpoint_staging = saving_->staged_bytes();
    return m;
  }
  // The whole model's layout, whatever stage this rank runs: what full_parameters fills.
  const nn::param_layout& layout() const override { return full_layout_; }
  const std::vector<event>& events() const override { return log_.events(); }
  std::int64_t steps() const override { return step_; }
  std::span<const parallel::bucket> buckets() const override { return sync_.buckets(); }
  const schedule::table& schedule_table(std::int64_t m) override { return place_.table(m); }
  const parallel::program& program(std::int64_t m) override { return place_.program(m, !ties_.empty()); }
  std::pair<std::int64_t, std::int64_t> activation_peaks() const override { return {pipe_.peak_bytes(), pipe_.peak_sets()}; }
  void release_activations() override {
    const memory_account::charging charge(&account_);
    pipe_.release_storage();
  }

  void save_checkpoint(const std::filesystem::path& dir, const std::map<std::string, std::string>& user,
                       save_mode mode) override {
    wait_checkpoint();
    const memory_account::charging charge(&account_);
    auto info = description();
    info.user = user;
    put_trainer_meta(info, optimizer_step_, Precision::loss_scaling ? &scaler_ : nullptr);
    put_router_bias(info, router_biases());
    saving_ = save_sharded<Space, Optimizer::state_slots>(world_, sync_, dir, std::move(info), net_.layout(),
                                                          place_.tp_rank(), mode == save_mode::async,
                                                          std::move(staging_));
    if (mode == save_mode::sync) wait_checkpoint();
  }
  bool wait_checkpoint() override {
    if (!saving_) return false;
    const auto save = std::move(saving_);
    save->finish(world_);
    staging_ = save->take_copy();  // kept for the next save: a copy into memory already touched
    return true;
  }
  bool checkpoint_pending() const override { return saving_ && !saving_->complete(); }
  // A save in the background reads this rank's state in place until its bytes are written: anything that changes
  // that state waits for that first (the update, a restore, an import).
  void released_by_checkpoint() const {
    if (saving_) saving_->wait_released();
  }
  std::map<std::string, std::string> load_checkpoint(const std::filesystem::path& dir) override {
    wait_checkpoint();
    const memory_account::charging charge(&account_);
    auto info = load_sharded<Optimizer::state_slots>(world_, sync_, net_.layout(), dir, description());
    step_ = info.step;
    opt_.seed = info.seed;  // dropout masks follow (seed, step)
    optimizer_step_ = take_trainer_meta(info, Precision::loss_scaling ? &scaler_ : nullptr);
    pipe_.routing().router_bias = take_router_bias(info);
    sync_.refresh_working();
    return info.user;
  }

  // What this rank holds: whole tensors where the sharding keeps them whole (without the padding, which depends
  // on the world's size: a replica's snapshot restores at any size), else its owned pieces.
  template <class F>
  void each_held(F&& f) {
    for (int k = -1; k < Optimizer::state_slots; ++k) {
      if (sync_.loads_pieces(k)) {
        for (const auto& p : sync_.owned_pieces()) f(sync_.held(k, p), static_cast<std::size_t>(p.end - p.begin));
      } else {
        float* base = sync_.whole(k);
        for (const auto& slot : net_.layout().slots) f(base + slot.offset, static_cast<std::size_t>(slot.shape.numel()));
      }
    }
  }
  state_snapshot snapshot() override {
    state_snapshot s{.step = step_, .optimizer_step = optimizer_step_, .seed = opt_.seed, .loss_scale = scaler_.scale(),
                     .growth_tracker = scaler_.growth_tracker(), .values = {}};
    each_held([&](const float* p, std::size_t n) {
      const auto at = s.values.size();
      s.values.resize(at + n);
      dml::copy_n(p, n, s.values.data() + at);
    });
    return s;
  }
  void restore(const state_snapshot& s) override {
    std::size_t need = 0;
    each_held([&](const float*, std::size_t n) { need += n; });
    if (s.values.size() != need)
      fail<invalid_argument>("dml::trainer::restore: this rank holds ", need, " values, the snapshot has ", s.values.size(),
                             " (a snapshot restores only into the same layout and rank)");
    released_by_checkpoint();
    std::size_t at = 0;
    each_held([&](float* p, std::size_t n) {
      dml::copy_n(s.values.data() + at, n, p);
      at += n;
    });
    step_ = s.step;
    optimizer_step_ = s.optimizer_step;
    opt_.seed = s.seed;
    scaler_.restore(s.loss_scale, s.growth_tracker);
    sync_.refresh_working();
  }
  state_pieces export_pieces() override {
    state_pieces out{.meta = {.step = step_, .optimizer_step = optimizer_step_, .seed = opt_.seed,
                              .loss_scale = scaler_.scale(), .growth_tracker = scaler_.growth_tracker(), .values = {}},
                     .ranges = {}};
    export_owned<Optimizer::state_slots>(sync_, net_.layout(), out);
    return out;
  }
  void import_pieces(std::span<const state_pieces> sources) override {
    released_by_checkpoint();
    if (sources.empty()) fail<invalid_argument>("dml::trainer::import_pieces: expected at least one state, found none");
    const auto& m = sources.front().meta;
    for (const auto& s : sources)
      if (s.meta.step != m.step || s.meta.optimizer_step != m.optimizer_step || s.meta.seed != m.seed)
        fail<invalid_argument>("dml::trainer::import_pieces: expected the states of one step, found steps ", m.step,
                               " and ", s.meta.step);
    const auto [need, dst] = held_ranges<Optimizer::state_slots>(sync_, net_.layout());
    fill_held(need, dst, [&](const std::vector<checkpoint_range>& q, std::vector<float*>& out) {
      read_pieces(sources, q, std::span<float* const>(out));
    });
    step_ = m.step;
    optimizer_step_ = m.optimizer_step;
    opt_.seed = m.seed;
    scaler_.restore(m.loss_scale, m.growth_tracker);
    sync_.refresh_working();
  }

 private:
  static parallel::placement_options placement_options(const trainer_options& o) {
    return {.micro_batches = o.micro_batches, .stage_cuts = o.stage_cuts, .cost_rows = o.cost_rows,
            .schedule = o.schedule, .sequence_parallel = o.sequence_parallel, .cp_zigzag = o.cp_zigzag,
            .cp_all_gather = o.cp_all_gather,
            .streams_gradients = sync_type::streams_gradients,
            .micro_batch_residency = o.micro_batch_residency};
  }
  // Document starts per token: [rows, T] positions, each token's its own or its predecessor's (a document is a run of
  // tokens). Under context parallelism the pipeline hands each rank's chunks theirs (host memory only).
  void check_documents(const dml::shape& x, const std::int64_t* doc) const {
    if (!std::same_as<Space, host> && place_.shape().cp > 1)
      fail<invalid_argument>("dml::trainer::step: document masks: expected whole sequences on each rank of a device "
                             "trainer, found context parallelism over ", place_.shape().cp, " ranks");
    if (x.rank != 2) fail<invalid_argument>("dml::trainer::step: document masks: expected token ids [rows, T], found ", x);
    if constexpr (std::same_as<Space, host>) {
      for (std::int64_t r = 0; r < x[0]; ++r)
        for (std::int64_t t = 0; t < x[1]; ++t) {
          const std::int64_t d = doc[r * x[1] + t];
          if (d != t && (t == 0 || d != doc[r * x[1] + t - 1]))
            fail<invalid_argument>("dml::trainer::step: document masks: expected token ", t, " of row ", r,
                                   " to start a document (", t, ") or continue its predecessor's (",
                                   t == 0 ? std::string("none") : std::to_string(doc[r * x[1] + t - 1]), "), found ", d);
        }
    }
  }
  // Where this rank's rows start in the global batch: only models whose layers read row indices ask.
  std::int64_t first_row(std::int64_t rows) {
    if constexpr (!nn::sequential<Layers...>::uses_row_index) return 0;
    else return parallel::first_global_row<Space>(place_.data(), rows, place_.shape().cp);
  }
  template <class V>
  V sum(V v) { return parallel::sum_over<Space>(world_, v); }
  nn::network_options network_options() {
    auto o = sync_type::network_options(place_.shards().dense.size(), place_.per_step());
    o.layers.assign(place_.chunks().begin(), place_.chunks().end());
    return o;
  }
  checkpoint_info description() const {
    return describe_checkpoint<Optimizer>(full_layout_, step_, opt_.seed, world_.size(), Sharding::name);
  }

  // Its settings checked again: they may have changed through its public `opt` since it was built.
  static Optimizer validated(Optimizer o) {
    optim::validate(o);
    return o;
  }
  // This step's learning rate: trainer_options::lr's, else the optimizer's (checked where it was built). A schedule
  // that gives a negative or non-finite rate fails the step that asks for it.
  float step_lr() const {
    if (!opt_.lr) return optimizer_.default_lr();
    const float lr = opt_.lr(step_);
    if (!(lr >= 0.f) || !std::isfinite(lr))
      fail<invalid_argument>("dml::trainer: trainer_options::lr at step ", step_, ": expected a finite lr >= 0, found ",
                             lr);
    return lr;
  }

  // ---- the step's tail: loss over every rank, clipping, loss scaling, the update
  step_result update(float local_loss, float lr) {
    released_by_checkpoint();
    // Only clipping, loss scaling and a commit vote make the update wait on other ranks; without them a rank updates
    // before the loss's all-reduce, so a pipeline stage that finishes its backward early updates while the others
    // compute, rather than wait in the sum for the last stage and then contend with it for memory bandwidth.
    const bool gated = opt_.clip_norm > 0.f || Precision::loss_scaling || static_cast<bool>(opt_.commit);
    if (!gated) sync_.update(optimizer_, lr, ++optimizer_step_, 1.f);
    step_result out{.loss = sum(local_loss)};  // only last stages hold a loss
    float scale = 1.f;
    if (opt_.clip_norm > 0.f) {
      // Each element counts once over the world: what a rank owns, but tensor copies and tied copies.
      out.grad_norm = std::sqrt(sum(sync_.grad_squared_norm(uncounted_))) / loss_scale();
      scale = optim::clip_scale(out.grad_norm, opt_.clip_norm);
    }
    if constexpr (Precision::loss_scaling) {
      // Every rank sees the same verdict: the overflow flag is summed over ranks.
      out.skipped = !scaler_.update(sum(static_cast<int>(sync_.has_overflow())) > 0);
      out.loss_scale = scaler_.scale();
    }
    Comm* pp = place_.pipe();
    if (experts_ < 0) experts_ = parallel::count_experts<Space>(pipe_.routing(), pp);
    out.routing = parallel::summarise_routing<Space>(pipe_.routing(), experts_, pp);
    if (opt_.commit && !opt_.commit()) {
      out.committed = false;
      return out;
    }
    if (!out.skipped) parallel::update_router_bias(pipe_.routing());
    if (gated && !out.skipped)
      sync_.update(optimizer_, lr, ++optimizer_step_, scale / loss_scale());
    if constexpr (requires { sync_.gradient_bytes(); }) {
      const auto b = sync_.gradient_bytes();
      out.gradient_bytes = b.sent - bytes_.sent;
      out.dense_gradient_bytes = b.dense - bytes_.dense;
      bytes_ = b;
    }
    log_(event_kind::step_end);
    return out;
  }
  // Every stage's balancing biases by layer (each stage holds its own layers'; the ranks of a stage hold the same):
  // [present, bias...] per layer summed over the pipeline group, each layer's sum divided by its count (exact).
  std::map<std::uint64_t, std::vector<float>> router_biases() {
    auto biases = pipe_.routing().router_bias;
    Comm* pp = place_.pipe();
    if (!pp || pp->size() == 1) return biases;
    double shape[2] = {biases.empty() ? -1.0 : static_cast<double>(biases.rbegin()->first), 0};
    for (const auto& [layer, b] : biases) shape[1] = std::max(shape[1], static_cast<double>(b.size()));
    comm::all_reduce_host(*pp, std::span<double>(shape, 2), comm::reduce_op::max);
    if (shape[0] < 0) return biases;
    const auto layers = static_cast<std::size_t>(shape[0]) + 1, width = static_cast<std::size_t>(shape[1]) + 1;
    std::vector<double> v(layers * width, 0.0);
    for (const auto& [layer, b] : biases) {
      v[layer * width] = 1;
      for (std::size_t e = 0; e < b.size(); ++e) v[layer * width + 1 + e] = b[e];
    }
    comm::all_reduce_host(*pp, std::span<double>(v), comm::reduce_op::sum);
    biases.clear();
    for (std::size_t l = 0; l < layers; ++l) {
      const double n = v[l * width];
      if (n == 0) continue;
      auto& b = biases[l];
      for (std::size_t e = 1; e < width; ++e) b.push_back(static_cast<float>(v[l * width + e] / n));
    }
    return biases;
  }
  // What trainer_options::compress names; 1-bit Adam also freezes the optimizer's second moment after warm-up.
  parallel::gradient_compression compression() {
    auto c = parallel::gradient_compression::parse(opt_.compress);
    if (c.adam_warmup == 0) return c;
    if (opt_.micro_batches != 1 || opt_.clip_norm > 0.f)
      fail<invalid_argument>("dml::trainer: compress ", opt_.compress, ": expected micro_batches = 1 and clip_norm = 0 "
                             "(the momentum is reduced once a step, unscaled), found ", opt_.micro_batches, " and ",
                             opt_.clip_norm);
    if constexpr (requires { optimizer_.freeze_variance(c.adam_warmup); }) {
      const auto [beta1, beta2, eps] = optimizer_.freeze_variance(c.adam_warmup);
      c.beta1 = beta1;
      c.beta2 = beta2;
      c.eps = eps;
    } else {
      fail<invalid_argument>("dml::trainer: compress ", opt_.compress, ": expected adam or adamw, found ", Optimizer::name);
    }
    return c;
  }
  float loss_scale() const {
    if constexpr (Precision::loss_scaling) return scaler_.scale();
    else return 1.f;
  }

  // What this trainer allocates, constructing, stepping, evaluating and loading (memory().allocated); declared
  // first, so it outlives every buffer charged to it. The constructor charges it until its body ends.
  memory_account account_;
  memory_account::charging constructing_;
  Comm& world_;
  trainer_options opt_;
  Optimizer optimizer_;
  parallel::placement<Plan, Comm, Layers...> place_;  // this rank's part of the model, its groups, its programs
  parallel::event_log log_;
  net_type net_;
  nn::param_layout full_layout_;
  sync_type sync_;
  parallel::pipeline<Space, Comm, net_type> pipe_;
  std::vector<parallel::tie<Comm>> ties_;
  optim::loss_scaler scaler_;
  std::int64_t step_ = 0, optimizer_step_ = 0;  // steps taken; updates applied (fp16 skips some)
  std::vector<bool> uncounted_;  // per slot of this rank: left out of the gradient norm (counted elsewhere)
  parallel::wire_bytes bytes_{};  // gradient bytes up to the last step
  std::int64_t experts_ = -1;    // experts per MoE layer of the model (0: none); −1 until the first step
  // An asynchronous save not yet finished (its threads end before anything above is destroyed), and the host copy
  // the saves write from, kept between them.
  std::vector<float> staging_;
  std::unique_ptr<checkpoint_save> saving_;
};

}  // namespace detail
}  // namespace dml::train
