// SPDX-License-Identifier: Apache-2.0
// dml/train/trainer.hpp — trainer<Policies...>: a sharding, a schedule, a precision and an optimizer, composed.
// Sits on parallel/ (sharding, pipeline, schedule, mesh) and optim/. The engine only sequences: it runs this
// rank's list of the schedule, handing forward and backward to the pipeline and gradient work to the
// sharding's sync, then clips, scales and updates. See DESIGN.md §1.
#pragma once

#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dml/optim/adam.hpp"
#include "dml/parallel/mesh.hpp"
#include "dml/parallel/pipeline.hpp"
#include "dml/parallel/policy.hpp"
#include "dml/parallel/program.hpp"
#include "dml/parallel/routing.hpp"
#include "dml/parallel/ties.hpp"
#include "dml/parallel/tensor.hpp"
#include "dml/train/checkpoint_io.hpp"
#include "dml/train/options.hpp"

namespace dml {
namespace train {

using parallel::event, parallel::event_kind, parallel::hidden_communication, parallel::memory_report;

namespace detail {

template <class Space>
struct engine_base {
  virtual ~engine_base() = default;
  virtual step_result step(tensor_view<const float, Space> x, const std::int32_t* y, std::int64_t global_batch) = 0;
  virtual std::int64_t correct(tensor_view<const float, Space> x, const std::int32_t* y) = 0;
  virtual std::vector<float> full_parameters() = 0;
  virtual void load_full_parameters(std::span<const float> full) = 0;
  virtual memory_report memory() const = 0;
  virtual const nn::param_layout& layout() const = 0;
  virtual const std::vector<event>& events() const = 0;
  virtual std::int64_t steps() const = 0;
  virtual std::span<const parallel::bucket> buckets() const = 0;
  virtual void save_checkpoint(const std::filesystem::path& dir, const std::map<std::string, std::string>& user) = 0;
  virtual std::map<std::string, std::string> load_checkpoint(const std::filesystem::path& dir) = 0;
  virtual const schedule::table& schedule_table(std::int64_t micro_batches) = 0;
  virtual const parallel::program& program(std::int64_t micro_batches) = 0;
  virtual std::pair<std::int64_t, std::int64_t> activation_peaks() const = 0;  // bytes, sets
  virtual const nn::tensor_group* tensor_parallel_group() const = 0;            // null without tensor parallelism
};

using make_schedule = std::function<schedule::table(int stages, int micro_batches)>;

template <class Space, class Comm, class Sharding, class Optimizer, class Precision, class... Layers>
class engine final : public engine_base<Space> {
  using T = typename Precision::type;
  using net_type = nn::basic_network<Space, T, Layers...>;
  using sync_type = typename Sharding::template sync<Space, Comm, Optimizer, Precision, net_type>;
  static_assert(parallel::diagnose_sharding_sync<sync_type>());

 public:
  engine(Comm& world, const nn::sequential<Layers...>& model, trainer_options opt, Optimizer optimizer, make_schedule made)
      : world_(world), opt_(checked(std::move(opt))), optimizer_(optimizer), made_(std::move(made)),
        mesh_(parallel::trainer_mesh(world, opt_.tensor_parallel, opt_.pipeline_stages, opt_.expert_parallel,
                                     opt_.context_parallel, opt_.replicas)),
        dp_(mesh_ ? mesh_->dp() : world), tp_(group_of(opt_.tensor_parallel, &parallel::mesh<Comm>::tp)),
        ep_(group_of(opt_.expert_parallel, &parallel::mesh<Comm>::ep)),
        cp_(group_of(opt_.context_parallel, &parallel::mesh<Comm>::cp)),
        data_(dp_.size() > 1 ? std::make_unique<parallel::tensor_group<Comm>>(dp_) : nullptr), log_(opt_.record_events),
        net_(model_part(model), opt_.seed, with_chunks(model)), full_layout_(nn::make_layout(model, net_.layout().padding_unit)),
        sync_(groups(), net_, {.seed = opt_.seed, .bucket_mb = opt_.bucket_mb, .chunks = chunks_, .log = &log_, .per_step = per_step_}),
        pipe_(opt_.pipeline_stages == 1 ? nullptr : &mesh_->pp(), net_, opt_.pipeline_stages, pp_rank(), chunks_,
              opt_.recompute, log_, tp_.get()),
        ties_(parallel::find_ties(net_.layout(), full_layout_, mesh_ ? &mesh_->pp() : nullptr)) {
    if constexpr (Precision::loss_scaling) scaler_ = optim::loss_scaler({.init_scale = opt_.initial_loss_scale});
    pipe_.set_layer_context({.ep = ep_.get(), .cp = cp_.get(), .cp_zigzag = opt_.cp_zigzag, .data = data_.get()});
    for (const auto& s : net_.layout().slots)  // counted by another rank (tensor rank 0), or by the tie's target
      uncounted_.push_back((tp_rank() > 0 && !s.spec.shard.tensor_sharded()) || !s.spec.tied_to.empty());
    program_of(opt_.micro_batches);  // a bad schedule fails here, before any work
  }

  // Runs this rank's program: the schedule's compute and transfers, the sharding's unshard, reshard and
  // reductions per chunk, the tie sums and the update.
  step_result step(tensor_view<const float, Space> x, const std::int32_t* y, std::int64_t global_batch) override {
    if (x.shape.rank < 1 || global_batch <= 0)
      fail<invalid_argument>("dml::trainer::step: expected a batch of rows and global_batch > 0, found shape ",
                             x.shape, " and global_batch ", global_batch);
    ++step_;
    const std::int64_t rows = x.shape[0], m = std::min(opt_.micro_batches, std::max<std::int64_t>(rows, 1));
    pipe_.begin_step({.x = x, .y = y, .global_batch = global_batch, .rows = rows, .micro_batches = m,
                      .first_row = sync_.first_global_row(dp_, rows, opt_.context_parallel), .seed = opt_.seed,
                      .step = static_cast<std::uint64_t>(step_), .loss_scale = loss_scale()});
    float local_loss = 0.f;
    step_result out;
    using k = parallel::instruction::kind;
    const auto& program = program_of(m);
    for (std::size_t i = 0; i < program.size(); ++i) {
      const auto& x = program[i];
      const auto& a = x.a;
      switch (x.what) {
        case k::unshard: sync_.unshard(x.chunk); break;
        case k::reshard: sync_.reshard(x.chunk); break;
        case k::reduce_gradients: sync_.reduce(x.chunk, x.final); break;
        case k::tie_gradients: parallel::sum_ties<Space, T>(std::span(ties_), [&](std::size_t s) { return sync_.grad_piece(s); }); break;
        case k::update: out = update(local_loss); break;
        case k::run:
          if (!schedule::is_compute(a.kind)) {
            if (a.kind == schedule::op::send_activation || a.kind == schedule::op::send_gradient) pipe_.send(a);
            else pipe_.receive(a);
            break;
          }
          log_(event_kind::compute_begin, static_cast<int>(i));
          sync_.begin_pass();
          if (a.kind == schedule::op::forward) {
            local_loss += pipe_.forward(a, &sync_);
          } else {
            if (x.reduces) sync_.begin_backward(x.first);
            // Per step, passes after a chunk's first add into its gradients; per micro-batch each writes its own.
            pipe_.backward(a, !x.first && per_step_, x.reduces ? &sync_ : nullptr);
          }
          log_(event_kind::compute_end, static_cast<int>(i));
          break;
      }
    }
    pipe_.end_step();
    return out;
  }

  std::int64_t correct(tensor_view<const float, Space> x, const std::int32_t* y) override {
    sync_.begin_pass();
    for (std::size_t c = 0; c < chunks_.size(); ++c) sync_.unshard(static_cast<int>(c));
    const auto n = pipe_.correct(x, y, &sync_);
    for (std::size_t c = 0; c < chunks_.size(); ++c) sync_.reshard(static_cast<int>(c));
    return n;
  }
  std::vector<float> full_parameters() override {
    if (!mesh_) return sync_.parameters();
    return parallel::whole_model<Space>(net_.layout(), full_layout_, sync_.parameters(), mesh_->tp_rank(),
                                        mesh_->ep_rank(), mesh_->tp(), mesh_->pp(), mesh_->ep());
  }
  void load_full_parameters(std::span<const float> full) override {
    if (static_cast<std::int64_t>(full.size()) != full_layout_.total)
      fail<shape_error>("dml::trainer: expected ", full_layout_.total, " parameters (padding included), found ", full.size());
    if (!mesh_) return sync_.load_parameters(full);
    sync_.load_parameters(parallel::part_of_whole(net_.layout(), full_layout_, full));
  }
  const nn::tensor_group* tensor_parallel_group() const override { return tp_.get(); }
  memory_report memory() const override {
    auto m = sync_.memory();
    m.activations = pipe_.peak_bytes();
    return m;
  }
  // The whole model's layout, whatever stage this rank runs: what full_parameters fills.
  const nn::param_layout& layout() const override { return full_layout_; }
  const std::vector<event>& events() const override { return log_.events(); }
  std::int64_t steps() const override { return step_; }
  std::span<const parallel::bucket> buckets() const override { return sync_.buckets(); }
  const schedule::table& schedule_table(std::int64_t m) override { return table_of(m); }
  const parallel::program& program(std::int64_t m) override { return program_of(m); }
  std::pair<std::int64_t, std::int64_t> activation_peaks() const override { return {pipe_.peak_bytes(), pipe_.peak_sets()}; }

  void save_checkpoint(const std::filesystem::path& dir, const std::map<std::string, std::string>& user) override {
    auto info = description();
    info.user = user;
    put_trainer_meta(info, optimizer_step_, Precision::loss_scaling ? &scaler_ : nullptr);
    save_sharded<Space, Optimizer::state_slots>(world_, sync_, dir, std::move(info), net_.layout(), tp_rank());
  }
  std::map<std::string, std::string> load_checkpoint(const std::filesystem::path& dir) override {
    auto info = load_sharded<Optimizer::state_slots>(world_, sync_, net_.layout(), dir, description());
    step_ = info.step;
    opt_.seed = info.seed;  // dropout masks follow (seed, step)
    optimizer_step_ = take_trainer_meta(info, Precision::loss_scaling ? &scaler_ : nullptr);
    sync_.refresh_working();
    return info.user;
  }

 private:
  static trainer_options checked(trainer_options o) {
    if (o.micro_batches < 1) fail<invalid_argument>("dml::trainer: expected micro_batches >= 1, found ", o.micro_batches);
    if constexpr (!requires { requires Sharding::hybrid_sharding; })
      if (o.replicas != 1)
        fail<invalid_argument>("dml::trainer: replicas ", o.replicas, " needs hybrid sharding (parallel::hybrid<",
                               "parallel::zero<S>>); found ", Sharding::name);
    return o;
  }
  int pp_rank() const { return mesh_ ? mesh_->pp_rank() : 0; }
  int tp_rank() const { return mesh_ ? mesh_->tp_rank() : 0; }
  std::unique_ptr<parallel::tensor_group<Comm>> group_of(int degree, Comm& (parallel::mesh<Comm>::*axis)()) {
    if (degree == 1) return nullptr;
    return std::make_unique<parallel::tensor_group<Comm>>(((*mesh_).*axis)());
  }
  parallel::shard_groups<Comm> groups() {
    if (!mesh_) return {.dense = world_};
    return {.dense = mesh_->shard(), .expert = opt_.expert_parallel > 1 ? &mesh_->expert_shard() : nullptr,
            .replicate = &mesh_->replicate()};
  }
  // This rank's part of the model: layers with a tensor-parallel form hold 1/tp of their parameters, layers
  // with experts 1/ep of the experts; under context parallelism the layers learn their chunk of each sequence.
  nn::sequential<Layers...> model_part(nn::sequential<Layers...> model) const {
    if (opt_.tensor_parallel > 1)
      nn::set_tensor_split(model, {.ranks = opt_.tensor_parallel, .rank = mesh_->tp_rank(), .sequence = opt_.sequence_parallel});
    if (opt_.expert_parallel > 1) nn::set_expert_split(model, opt_.expert_parallel, mesh_->ep_rank());
    if (opt_.context_parallel > 1)
      nn::set_context_split(model, {.ranks = opt_.context_parallel, .rank = mesh_->cp_rank(), .zigzag = opt_.cp_zigzag});
    return model;
  }
  // The chunks this rank holds, and how gradients reach the shards: per micro-batch only where the sharding
  // streams them and the program allows it (one stage, backward not split).
  nn::network_options with_chunks(const nn::sequential<Layers...>& model) {
    const auto t = make_table(opt_.micro_batches);
    virtual_stages_ = t.virtual_stages;
    per_step_ = !sync_type::streams_gradients || opt_.pipeline_stages > 1 || schedule::splits_backward(t);
    chunks_ = parallel::stage_chunks<net_type>(model_part(model), pipeline_options(), pp_rank());
    auto o = sync_type::network_options(groups().dense.size(), per_step_);
    o.layers = chunks_;
    return o;
  }
  parallel::pipeline_options pipeline_options() const {
    return {.stages = opt_.pipeline_stages, .virtual_stages = virtual_stages_, .cuts = opt_.stage_cuts,
            .cost_rows = opt_.cost_rows};
  }
  schedule::table make_table(std::int64_t m) const {
    const int k = opt_.pipeline_stages;
    return opt_.schedule.empty() ? made_(k, static_cast<int>(m)) : schedule::make(opt_.schedule, k, static_cast<int>(m));
  }
  const schedule::table& table_of(std::int64_t m) {
    program_of(m);
    return tables_.at(m);
  }
  // The schedule for m micro-batches, checked, lowered into this rank's program and the program checked.
  const parallel::program& program_of(std::int64_t m) {
    if (auto it = programs_.find(m); it != programs_.end()) return it->second;
    auto t = schedule::checked(make_table(m), opt_.pipeline_stages, static_cast<int>(m), static_cast<int>(chunks_.size()));
    const parallel::lowering how{.per_micro_batch = !per_step_, .ties = !ties_.empty()};
    auto p = parallel::lower(t, pipe_.rank(), how);
    if (auto e = parallel::check(p, static_cast<int>(chunks_.size()), how); !e.empty())
      fail<invalid_argument>("dml::trainer: the schedule lowered for ", Sharding::name, " is unsound: rank ",
                             pipe_.rank(), ", ", e);
    tables_.emplace(m, std::move(t));
    return programs_.emplace(m, std::move(p)).first->second;
  }
  checkpoint_info description() const {
    return describe_checkpoint<Optimizer>(full_layout_, step_, opt_.seed, world_.size(), Sharding::name);
  }

  // ---- the step's tail: loss over every rank, clipping, loss scaling, the update
  step_result update(float local_loss) {
    step_result out{.loss = sync_.sum(world_, local_loss)};  // only last stages hold a loss
    float scale = 1.f;
    if (opt_.clip_norm > 0.f) {
      // Each element counts once over the world: what a rank owns, but tensor copies and tied copies.
      out.grad_norm = std::sqrt(sync_.sum(world_, sync_.grad_squared_norm(uncounted_))) / loss_scale();
      scale = optim::clip_scale(out.grad_norm, opt_.clip_norm);
    }
    if constexpr (Precision::loss_scaling) {
      // Every rank sees the same verdict: the overflow flag is summed over ranks.
      out.skipped = !scaler_.update(sync_.sum(world_, static_cast<int>(sync_.has_overflow())) > 0);
      out.loss_scale = scaler_.scale();
    }
    Comm* pp = mesh_ && mesh_->pp_size() > 1 ? &mesh_->pp() : nullptr;
    if (experts_ < 0) experts_ = parallel::count_experts<Space>(pipe_.routing(), pp);
    out.routing = parallel::summarise_routing<Space>(pipe_.routing(), experts_, pp);
    if (!out.skipped) sync_.update(optimizer_, opt_.lr ? opt_.lr(step_) : optimizer_.default_lr(), ++optimizer_step_,
                                   scale / loss_scale());
    log_(event_kind::step_end);
    return out;
  }
  float loss_scale() const {
    if constexpr (Precision::loss_scaling) return scaler_.scale();
    else return 1.f;
  }
  Comm& world_;
  trainer_options opt_;
  Optimizer optimizer_;
  make_schedule made_;
  std::optional<parallel::mesh<Comm>> mesh_;  // the groups, with any parallelism besides plain data parallelism
  Comm& dp_;                                  // the data-parallel group of this rank's stage
  // What the layers talk to: the tensor, expert and context groups, and the data-parallel group over which
  // MoE layers sum their load.
  std::unique_ptr<parallel::tensor_group<Comm>> tp_, ep_, cp_, data_;
  std::map<std::int64_t, schedule::table> tables_;
  std::map<std::int64_t, parallel::program> programs_;
  parallel::event_log log_;
  int virtual_stages_ = 1;
  bool per_step_ = true;
  std::vector<nn::layer_range> chunks_;  // filled while net_ is made: the layers this rank runs
  net_type net_;
  nn::param_layout full_layout_;
  sync_type sync_;
  parallel::pipeline<Space, Comm, net_type> pipe_;
  std::vector<parallel::tie<Comm>> ties_;
  optim::loss_scaler scaler_;
  std::int64_t step_ = 0, optimizer_step_ = 0;  // steps taken; updates applied (fp16 skips some)
  std::vector<bool> uncounted_;  // per slot of this rank: left out of the gradient norm (counted elsewhere)
  std::int64_t experts_ = -1;    // experts per MoE layer of the model (0: none); −1 until the first step
};

}  // namespace detail
}  // namespace train

// trainer<Policies...>: policies in any order, at most one per family. Defaults: replicate, AdamW,
// fp32, host, and schedule::automatic (single on one stage, 1F1B on a pipeline).
template <class... Policies>
class trainer {
  static_assert(check_policies<Policies...>);

 public:
  using sharding_policy = find_policy_t<sharding_family, parallel::replicate, Policies...>;
  using optimizer_policy = find_policy_t<optimizer_family, optim::adamw, Policies...>;
  using precision_policy = find_policy_t<precision_family, dml::precision::fp32, Policies...>;
  using schedule_policy = find_policy_t<schedule_family, schedule::automatic, Policies...>;
  using space = find_policy_t<space_family, host, Policies...>;
  static_assert(parallel::diagnose_sharding<sharding_policy>());
  static_assert(optim::diagnose_optimizer<optimizer_policy>());
  static_assert(diagnose_precision<precision_policy>());
  static_assert(schedule::diagnose_schedule<schedule_policy>());
  static_assert(std::same_as<typename precision_policy::type, float> || optim::writes_working_copy_v<optimizer_policy>,
                "dml::trainer: bf16 and fp16 need an optimizer that writes the working copy "
                "(`static constexpr bool writes_working_copy = true`: sgd, adam, adamw)");

  template <comm::communicator C, class... L>
  trainer(C& comm, const nn::sequential<L...>& model, train::trainer_options options = {}, optimizer_policy opt = {})
      : engine_(std::make_unique<train::detail::engine<space, C, sharding_policy, optimizer_policy, precision_policy, L...>>(
            comm, model, std::move(options), opt, &schedule_policy::make)) {}

  // One optimizer step. x and y are this rank's rows of the global batch (the trainer's loss divides by
  // global_batch, so ranks may hold different row counts; pipeline stages of one data-parallel rank
  // pass the same rows). Collective: every rank calls it.
  train::step_result step(tensor_view<const float, space> x, const std::int32_t* y, std::int64_t global_batch) {
    return engine_->step(x, y, global_batch);
  }
  // Rows of x whose largest logit is the label (inference; collective under zero<3> and across pipeline
  // stages, where the last stage counts and the others return 0).
  std::int64_t correct(tensor_view<const float, space> x, const std::int32_t* y) { return engine_->correct(x, y); }
  // Every parameter in the whole model's flat layout (collective under zero<3> and pipelines); and the reverse.
  std::vector<float> full_parameters() { return engine_->full_parameters(); }
  void load_full_parameters(std::span<const float> p) { engine_->load_full_parameters(p); }
  train::memory_report memory() const { return engine_->memory(); }  // of this rank's stage
  const nn::param_layout& layout() const { return engine_->layout(); }
  const std::vector<train::event>& events() const { return engine_->events(); }
  std::span<const parallel::bucket> buckets() const { return engine_->buckets(); }
  std::int64_t steps() const { return engine_->steps(); }
  // Every rank's list of the schedule for a step of `micro_batches` (checked).
  const schedule::table& schedule_table(std::int64_t micro_batches) { return engine_->schedule_table(micro_batches); }
  // This rank's program for such a step: the schedule lowered with the sharding's unshard, reshard and
  // reductions per chunk, the tie sums and the update (parallel/program.hpp), checked.
  const parallel::program& program(std::int64_t micro_batches) { return engine_->program(micro_batches); }
  // Of the last step on this rank: the most activation bytes and (micro-batch, chunk) sets held at once.
  std::int64_t peak_activation_bytes() const { return engine_->activation_peaks().first; }
  std::int64_t peak_in_flight() const { return engine_->activation_peaks().second; }
  // The tensor-parallel group the layers talk to, with its per-pass call counts; null without one.
  const nn::tensor_group* tensor_parallel_group() const { return engine_->tensor_parallel_group(); }

  // Sharded checkpoint of parameters, optimizer state, step and seed, with the caller's position in
  // `user_meta`: writes dir/step-<step>/, then points dir/latest at it (train/checkpoint.hpp). Collective.
  void save_checkpoint(const std::filesystem::path& dir, const std::map<std::string, std::string>& user_meta = {}) {
    engine_->save_checkpoint(dir, user_meta);
  }
  // Loads dir/latest, whatever layout (dp × pp, sharding) wrote it, and returns its user_meta. Collective; a
  // bad checkpoint throws the same dml::error on every rank and leaves this trainer unchanged.
  std::map<std::string, std::string> load_checkpoint(const std::filesystem::path& dir) { return engine_->load_checkpoint(dir); }

 private:
  std::unique_ptr<train::detail::engine_base<space>> engine_;
};

}  // namespace dml
