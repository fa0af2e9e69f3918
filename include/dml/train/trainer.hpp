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
      : world_(world), opt_(std::move(opt)), optimizer_(optimizer), made_(std::move(made)),
        mesh_(parallel::trainer_mesh(world, opt_.tensor_parallel, opt_.pipeline_stages, opt_.expert_parallel,
                                     opt_.context_parallel)),
        dp_(mesh_ ? mesh_->dp() : world), tp_(tensor_group()), ep_(group_of(opt_.expert_parallel, &parallel::mesh<Comm>::ep)),
        cp_(group_of(opt_.context_parallel, &parallel::mesh<Comm>::cp)),
        data_(dp_.size() > 1 ? std::make_unique<parallel::tensor_group<Comm>>(dp_) : nullptr), schedules_(),
        log_(opt_.record_events),
        net_(tensor_part(model), opt_.seed, with_chunks(sync_type::network_options(dp_.size()), tensor_part(model))),
        full_layout_(mesh_ ? nn::make_layout(model, net_.layout().padding_unit) : net_.layout()),
        sync_(dp_, net_, {.seed = opt_.seed, .bucket_mb = opt_.bucket_mb, .chunks = chunks_, .log = &log_}),
        pipe_(opt_.pipeline_stages == 1 ? nullptr : &mesh_->pp(), net_, opt_.pipeline_stages, pp_rank(), chunks_,
              opt_.recompute, log_, tp_.get()) {
    if (opt_.micro_batches < 1) fail<invalid_argument>("dml::trainer: expected micro_batches >= 1, found ", opt_.micro_batches);
    if (opt_.pipeline_stages > 1 && sync_type::reduces_every_backward)
      fail<invalid_argument>("dml::trainer: pipeline stages compose with replicate or zero<1> across data-parallel "
                             "ranks; found ", Sharding::name, " with ", opt_.pipeline_stages, " stages");
    find_tied();
    if (!tied_.empty() && sync_type::sharded_gradients)
      fail<invalid_argument>("dml::trainer: tied parameters (", full_layout_.slots[tied_[0].whole].name, ") need whole "
                             "gradients on each rank to sum; use replicate, not ", Sharding::name);
    if constexpr (Precision::loss_scaling) scaler_ = optim::loss_scaler({.init_scale = opt_.initial_loss_scale});
    if (opt_.expert_parallel > 1) {
      if constexpr (requires { sync_.set_expert_group(mesh_->edp()); }) sync_.set_expert_group(mesh_->edp());
      else
        fail<invalid_argument>("dml::trainer: expert parallelism reduces experts' gradients over the ranks that hold "
                               "them, which replicate supports; found ", Sharding::name, " with expert_parallel ",
                               opt_.expert_parallel);
    }
    pipe_.set_layer_context({.ep = ep_.get(), .cp = cp_.get(), .cp_zigzag = opt_.cp_zigzag, .data = data_.get()});
    schedule_of(opt_.micro_batches);  // a bad schedule fails here, before any work
  }

  // Runs this rank's list of the schedule, then clips, scales and updates.
  step_result step(tensor_view<const float, Space> x, const std::int32_t* y, std::int64_t global_batch) override {
    if (x.shape.rank < 1 || global_batch <= 0)
      fail<invalid_argument>("dml::trainer::step: expected a batch of rows and global_batch > 0, found shape ",
                             x.shape, " and global_batch ", global_batch);
    ++step_;
    const std::int64_t rows = x.shape[0], m = std::min(opt_.micro_batches, std::max<std::int64_t>(rows, 1));
    pipe_.begin_step({.x = x, .y = y, .global_batch = global_batch, .rows = rows, .micro_batches = m,
                      .first_row = sync_.first_global_row(rows, opt_.context_parallel), .seed = opt_.seed, .step = static_cast<std::uint64_t>(step_),
                      .loss_scale = loss_scale()});
    const auto& plan = schedule_of(m).ranks[static_cast<std::size_t>(pipe_.rank())];
    // A chunk's gradients are complete after its last backward (or weight pass): that one reduces.
    std::vector<std::size_t> last(chunks_.size()), done(chunks_.size()), weights(chunks_.size());
    for (std::size_t i = 0; i < plan.size(); ++i)
      if (plan[i].kind == schedule::op::backward || plan[i].kind == schedule::op::backward_weight) last[plan[i].chunk] = i;
    float local_loss = 0.f;
    step_result out;
    for (std::size_t i = 0; i < plan.size(); ++i) {
      const auto& a = plan[i];
      const auto c = static_cast<std::size_t>(a.chunk);
      if (schedule::is_compute(a.kind)) {
        log_(event_kind::compute_begin, static_cast<int>(i));
        sync_.begin_pass();
      }
      switch (a.kind) {
        case schedule::op::forward: local_loss += pipe_.forward(a, &sync_); break;
        case schedule::op::backward:
        case schedule::op::backward_input:
        case schedule::op::backward_weight: {
          auto& n = a.kind == schedule::op::backward_weight ? weights[c] : done[c];
          const bool reduce = sync_type::reduces_every_backward || last[c] == i;
          sync_.set_backward_index(static_cast<std::int64_t>(n));
          pipe_.backward(a, n++ > 0 && !sync_type::reduces_every_backward, reduce ? &sync_ : nullptr);
          if constexpr (sync_type::reduces_every_backward) sync_.finish();
          break;
        }
        case schedule::op::send_activation:
        case schedule::op::send_gradient: pipe_.send(a); break;
        case schedule::op::recv_activation:
        case schedule::op::recv_gradient: pipe_.receive(a); break;
        case schedule::op::reduce_gradients: sync_.finish(); break;
        case schedule::op::update: out = update(local_loss); break;
      }
      if (schedule::is_compute(a.kind)) log_(event_kind::compute_end, static_cast<int>(i));
    }
    pipe_.end_step();
    return out;
  }

  std::int64_t correct(tensor_view<const float, Space> x, const std::int32_t* y) override {
    sync_.begin_pass();
    return pipe_.correct(x, y, &sync_);
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
  const schedule::table& schedule_table(std::int64_t m) override { return schedule_of(m); }
  std::pair<std::int64_t, std::int64_t> activation_peaks() const override { return {pipe_.peak_bytes(), pipe_.peak_sets()}; }

  void save_checkpoint(const std::filesystem::path& dir, const std::map<std::string, std::string>& user) override {
    refuse_expert_checkpoint();
    auto info = description();
    info.user = user;
    put_trainer_meta(info, optimizer_step_, Precision::loss_scaling ? &scaler_ : nullptr);
    const auto ranges = every_rank_pieces<Optimizer::state_slots>(net_, pipeline_options(), dp_.size(), sync_.bucket_target(),
                                                                  opt_.tensor_parallel);
    save_sharded<Space, Optimizer::state_slots>(world_, sync_, dp_.rank(), dir, std::move(info), ranges, net_.layout(), tp_rank());
  }
  std::map<std::string, std::string> load_checkpoint(const std::filesystem::path& dir) override {
    refuse_expert_checkpoint();
    auto info = load_sharded<Optimizer::state_slots>(world_, sync_, dp_.rank(), net_.layout(), dir, description(), tp_rank());
    step_ = info.step;
    opt_.seed = info.seed;  // dropout masks follow (seed, step)
    optimizer_step_ = take_trainer_meta(info, Precision::loss_scaling ? &scaler_ : nullptr);
    sync_.refresh_working();
    return info.user;
  }

 private:
  int pp_rank() const { return mesh_ ? mesh_->pp_rank() : 0; }
  int ep_rank() const { return mesh_ ? mesh_->ep_rank() : 0; }
  void refuse_expert_checkpoint() const {
    if (opt_.expert_parallel > 1)
      fail<invalid_argument>("dml::trainer: sharded checkpoints of experts split over ", opt_.expert_parallel,
                             " expert-parallel ranks are not supported yet; save with expert_parallel 1, or save "
                             "full_parameters()");
  }
  std::unique_ptr<parallel::tensor_group<Comm>> group_of(int degree, Comm& (parallel::mesh<Comm>::*axis)()) {
    if (degree == 1) return nullptr;
    return std::make_unique<parallel::tensor_group<Comm>>(((*mesh_).*axis)());
  }
  int tp_rank() const { return mesh_ ? mesh_->tp_rank() : 0; }

  // Tied parameters (GPT's LM head and token embedding): each copy takes the sum of both gradients, so both
  // take the same updates. The copies may sit on different pipeline stages; the pipeline group sums.
  struct tie {
    std::size_t whole;          // the tied parameter's slot in the whole model
    std::ptrdiff_t mine, to;    // its slot and its target's on this rank, or −1
  };
  void find_tied() {
    auto local = [&](std::size_t id) {
      for (std::size_t i = 0; i < net_.layout().slots.size(); ++i)
        if (net_.layout().slots[i].id == id) return static_cast<std::ptrdiff_t>(i);
      return std::ptrdiff_t{-1};
    };
    for (const auto& s : full_layout_.slots)
      if (!s.spec.tied_to.empty()) tied_.push_back({s.id, local(s.id), local(s.init_id)});
  }
  void tie_gradients() {
    for (const auto& t : tied_) {
      // A stage that holds neither copy adds zeros to the pipeline's sum; the copies are split like wte.
      const std::ptrdiff_t held = t.mine >= 0 ? t.mine : t.to;
      const std::int64_t count = held >= 0 ? net_.layout().slots[static_cast<std::size_t>(held)].shape.numel()
                                           : full_layout_.slots[t.whole].shape.numel() / opt_.tensor_parallel;
      buffer<float, Space> sum(static_cast<std::size_t>(count));
      fill_n<Space>(sum.data(), count, 0.f);
      const std::ptrdiff_t copies[] = {t.mine, t.to};  // an array: nvcc's host pass cannot range over a braced list
      for (auto slot : copies)
        if (slot >= 0) accumulate_n<Space>(static_cast<const T*>(net_.grad(static_cast<std::size_t>(slot))), sum.data(), count);
      if (mesh_ && mesh_->pp_size() > 1) mesh_->pp().all_reduce(sum.span(), comm::reduce_op::sum);
      for (auto slot : copies)
        if (slot >= 0) cast_n<Space>(sum.data(), net_.grad(static_cast<std::size_t>(slot)), count);
    }
  }
  // Every slot but this rank's experts (tensor ranks other than 0 leave theirs out: experts are whole on each).
  const std::vector<bool>& non_expert_slots() {
    if (non_expert_.empty())
      for (const auto& s : net_.layout().slots) non_expert_.push_back(!s.spec.shard.expert_sharded() || tp_rank() > 0);
    return non_expert_;
  }
  // The step's routing records summed over micro-batches and layers, then over the pipeline's stages (each
  // stage holds its own layers; every rank of a stage holds the same records).
  train::routing_summary summarise_routing() {
    const auto& records = pipe_.routing().records;
    // The model's expert count, learnt at the first step (one collective over the stages, not one per step).
    if (experts_ < 0) {
      std::int64_t e = 0;
      for (const auto& [key, r] : records) e = std::max<std::int64_t>(e, static_cast<std::int64_t>(r.tokens.size()));
      experts_ = mesh_ && mesh_->pp_size() > 1 ? max_over_pp(e) : e;
    }
    const std::int64_t experts = experts_;
    std::int64_t bytes = 0;
    train::routing_summary out;
    if (experts == 0) return out;
    // [aux, z, tokens..., dropped...] as doubles: exact for counts below 2^53.
    std::vector<double> v(static_cast<std::size_t>(2 + 2 * experts), 0.0);
    for (const auto& [key, r] : records) {
      v[0] += r.share * r.aux_loss;
      v[1] += r.share * r.z_loss;
      for (std::size_t e = 0; e < r.tokens.size(); ++e) {
        v[2 + e] += static_cast<double>(r.tokens[e]);
        v[2 + static_cast<std::size_t>(experts) + e] += static_cast<double>(r.dropped[e]);
      }
      bytes += r.a2a_bytes;
    }
    if (mesh_ && mesh_->pp_size() > 1) {
      buffer<double, Space> d(v.size());
      dml::copy_n(v.data(), v.size(), d.data());
      mesh_->pp().all_reduce(d.span(), comm::reduce_op::sum);
      dml::copy_n(d.data(), v.size(), v.data());
    }
    out.aux_loss = v[0];
    out.z_loss = v[1];
    for (std::int64_t e = 0; e < experts; ++e) {
      out.tokens.push_back(static_cast<std::int64_t>(v[static_cast<std::size_t>(2 + e)]));
      out.dropped.push_back(static_cast<std::int64_t>(v[static_cast<std::size_t>(2 + experts + e)]));
    }
    out.a2a_bytes = bytes;
    return out;
  }
  std::int64_t max_over_pp(std::int64_t n) {
    buffer<std::int64_t, Space> d(1);
    dml::copy_n(&n, 1, d.data());
    mesh_->pp().all_reduce(d.span(), comm::reduce_op::max);
    dml::copy_n(d.data(), 1, &n);
    return n;
  }
  const std::vector<bool>& uncounted_slots() {
    if (uncounted_.empty())
      for (const auto& s : net_.layout().slots)
        uncounted_.push_back((tp_rank() > 0 && !s.spec.shard.tensor_sharded()) || !s.spec.tied_to.empty() ||
                             s.spec.shard.expert_sharded());
    return uncounted_;
  }
  // This rank's part of the model: layers with a tensor-parallel form hold 1/tp of their parameters.
  // So do layers with experts under expert parallelism (1/ep of the experts); under context parallelism the
  // layers learn their chunk of each sequence.
  nn::sequential<Layers...> tensor_part(nn::sequential<Layers...> model) const {
    if (opt_.tensor_parallel > 1)
      nn::set_tensor_split(model, {.ranks = opt_.tensor_parallel, .rank = mesh_->tp_rank(), .sequence = opt_.sequence_parallel});
    if (opt_.expert_parallel > 1) nn::set_expert_split(model, opt_.expert_parallel, mesh_->ep_rank());
    if (opt_.context_parallel > 1)
      nn::set_context_split(model, {.ranks = opt_.context_parallel, .rank = mesh_->cp_rank(), .zigzag = opt_.cp_zigzag});
    return model;
  }
  std::unique_ptr<parallel::tensor_group<Comm>> tensor_group() {
    if (opt_.tensor_parallel == 1) return nullptr;
    return std::make_unique<parallel::tensor_group<Comm>>(mesh_->tp());
  }
  nn::network_options with_chunks(nn::network_options o, const nn::sequential<Layers...>& model) {
    virtual_stages_ = make_table(std::max<std::int64_t>(opt_.micro_batches, 1)).virtual_stages;
    chunks_ = parallel::stage_chunks<net_type>(model, pipeline_options(), pp_rank());
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
  const schedule::table& schedule_of(std::int64_t micro_batches) {
    if (auto it = schedules_.find(micro_batches); it != schedules_.end()) return it->second;
    auto t = schedule::checked(make_table(micro_batches), opt_.pipeline_stages, static_cast<int>(micro_batches),
                               static_cast<int>(chunks_.size()));
    if (sync_type::reduces_every_backward && schedule::splits_backward(t))
      fail<invalid_argument>("dml::trainer: ", Sharding::name, " reduces gradients during backward and cannot split "
                             "it; use replicate or zero<1> with a zero-bubble schedule");
    return schedules_.emplace(micro_batches, std::move(t)).first->second;
  }
  checkpoint_info description() const {
    return describe_checkpoint<Optimizer>(full_layout_, step_, opt_.seed, world_.size(), Sharding::name);
  }

  // ---- the step's tail: loss over every rank, clipping, loss scaling, the update
  step_result update(float local_loss) {
    step_result out{.loss = sync_.sum(world_, local_loss)};  // only last stages hold a loss
    tie_gradients();
    float scale = 1.f;
    if (opt_.clip_norm > 0.f) {
      // Sharded gradients sum over every rank; replicated ones once per stage, over the stages.
      // Sharded gradients sum over every rank; replicated ones once per stage and tensor rank. Tensor ranks
      // other than 0 leave out their copies of the parameters that are not split, and a tied copy is left out.
      // Experts differ across the expert group: their part sums over it too.
      double local = sync_.grad_squared_norm(uncounted_slots());
      if (opt_.expert_parallel > 1) local += sync_.sum(mesh_->ep(), sync_.grad_squared_norm(non_expert_slots()));
      out.grad_norm = std::sqrt(sync_type::sharded_gradients ? sync_.sum(world_, local)
                                : mesh_ ? sync_.sum(mesh_->pp(), sync_.sum(mesh_->tp(), local)) : local);
      out.grad_norm /= loss_scale();  // the norm of the true gradients, not of the scaled ones
      scale = optim::clip_scale(out.grad_norm, opt_.clip_norm);
    }
    if constexpr (Precision::loss_scaling) {
      // Every rank sees the same verdict: the overflow flag is summed over ranks.
      out.skipped = !scaler_.update(sync_.sum(world_, static_cast<int>(sync_.has_overflow())) > 0);
      out.loss_scale = scaler_.scale();
    }
    out.routing = summarise_routing();
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
  std::optional<parallel::mesh<Comm>> mesh_;  // tp × dp × pp groups, with tensor or pipeline parallelism
  Comm& dp_;                                  // the data-parallel group of this rank's stage
  std::unique_ptr<parallel::tensor_group<Comm>> tp_;  // what the layers talk to, with tensor parallelism
  // ... with expert and context parallelism; and the data-parallel group, over which MoE layers sum their load
  std::unique_ptr<parallel::tensor_group<Comm>> ep_, cp_, data_;
  std::map<std::int64_t, schedule::table> schedules_;
  parallel::event_log log_;
  int virtual_stages_ = 1;
  std::vector<nn::layer_range> chunks_;  // filled while net_ is made: the layers this rank runs
  net_type net_;
  nn::param_layout full_layout_;
  sync_type sync_;
  parallel::pipeline<Space, Comm, net_type> pipe_;
  optim::loss_scaler scaler_;
  std::int64_t step_ = 0, optimizer_step_ = 0;  // steps taken; updates applied (fp16 skips some)
  std::vector<bool> uncounted_;  // per slot of this rank: left out of the gradient norm (counted elsewhere)
  std::vector<bool> non_expert_;
  std::int64_t experts_ = -1;  // experts per MoE layer of the model (0: none); −1 until the first step
  std::vector<tie> tied_;
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
