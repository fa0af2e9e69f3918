// SPDX-License-Identifier: Apache-2.0
// dml/train/trainer.hpp — trainer<Policies...>: a plan (or a sharding and a schedule), a precision and an
// optimizer, composed. The typed façade over train/engine.hpp, which parallelize() places and which runs
// this rank's program. See DESIGN.md §1 and §9.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dml/optim/adam.hpp"
#include "dml/parallel/policy.hpp"
#include "dml/train/engine.hpp"

namespace dml {

// trainer<Policies...>: policies in any order, at most one per family. Defaults: replicate, AdamW,
// fp32, host, and schedule::automatic (single on one stage, 1F1B on a pipeline). The kinds of parallelism
// come either as a plan (parallel::plan<data<S>, pipe<Sched>, tensor<>, experts, context<>>: only those
// kinds may get a degree above 1) or, without one, as a sharding and a schedule with every kind open to
// trainer_options' degrees.
template <class... Policies>
class trainer {
  static_assert(check_policies<Policies...>);
  using given_plan = find_policy_t<plan_family, void, Policies...>;
  static_assert(std::is_void_v<given_plan> ||
                    (count_policies<sharding_family, Policies...> == 0 && count_policies<schedule_family, Policies...> == 0),
                "dml::trainer: a plan names the sharding (parallel::data<S>) and the schedule (parallel::pipe<S>); "
                "give them there, not beside it");

 public:
  using plan_policy = std::conditional_t<
      std::is_void_v<given_plan>,
      parallel::any_plan<find_policy_t<sharding_family, parallel::replicate, Policies...>,
                         find_policy_t<schedule_family, schedule::automatic, Policies...>>,
      given_plan>;
  using sharding_policy = typename plan_policy::sharding;
  using schedule_policy = typename plan_policy::schedule;
  using optimizer_policy = find_policy_t<optimizer_family, optim::adamw, Policies...>;
  using precision_policy = find_policy_t<precision_family, dml::precision::fp32, Policies...>;
  using space = find_policy_t<space_family, host, Policies...>;
  static_assert(parallel::diagnose_sharding<sharding_policy>());
  static_assert(optim::diagnose_optimizer<optimizer_policy>());
  static_assert(diagnose_precision<precision_policy>());
  static_assert(schedule::diagnose_schedule<schedule_policy>());
  static_assert(std::same_as<typename precision_policy::type, float> || optim::writes_working_copy_v<optimizer_policy>,
                "dml::trainer: bf16 and fp16 need an optimizer that writes the working copy "
                "(`static constexpr bool writes_working_copy = true`: sgd, adam, adamw)");

  // The degrees come from options (tensor_parallel, pipeline_stages, expert_parallel, context_parallel,
  // replicas; the rest of the world is data parallel). Collective: every rank of comm constructs one.
  template <comm::communicator C, class... L>
  trainer(C& comm, const nn::sequential<L...>& model, train::trainer_options options = {}, optimizer_policy opt = {})
      : engine_((static_cast<void>(parallel::plan_fits<plan_policy, L...>()), static_cast<void>(same_space<C>()),
                 std::make_unique<train::detail::engine<space, C, plan_policy, optimizer_policy, precision_policy, L...>>(
                     comm, model, std::move(options), opt))) {}

  // One optimizer step. x and y are this rank's rows of the global batch (the trainer's loss divides by
  // global_batch, so ranks may hold different row counts; pipeline stages of one data-parallel rank
  // pass the same rows). Collective: every rank calls it. doc_start, for packed sequences of token ids x [rows, T]:
  // for every token the position its document starts at (in x's space), so that attention stays within documents.
  train::step_result step(tensor_view<const float, space> x, const std::int32_t* y, std::int64_t global_batch,
                          const std::int64_t* doc_start = nullptr) {
    return engine_->step(x, y, global_batch, doc_start);
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
  // Gives back the activation storage this rank keeps between steps (memory().activations_held; the next step
  // allocates it again): before what comes after training (a gather of the whole model, evaluation, sampling) holds
  // memory of its own. Not collective.
  void release_activations() { engine_->release_activations(); }
  // The tensor-parallel group the layers talk to, with its per-pass call counts; null without one.
  const nn::rank_group* tensor_parallel_group() const { return engine_->tensor_parallel_group(); }
  // Writes the timeline recorded so far at trainer_options::trace (rank 0 writes; every rank's events, one process per
  // rank, its clock started at construction): Chrome trace-event JSON for Perfetto UI or chrome://tracing. Collective;
  // each call rewrites the file with everything recorded since construction.
  void write_trace() { engine_->write_trace(); }

  // Sharded checkpoint of parameters, optimizer state, step and seed, with the caller's position in
  // `user_meta`: writes dir/step-<step>/, then points dir/latest at it (train/checkpoint.hpp). Collective.
  // save_mode::async copies this rank's pieces to host memory (memory().checkpoint_staging) and returns; threads
  // write the files while training goes on, and latest moves once every rank's file is complete and synced (found
  // at the start of a step, one flag's all-reduce). A save, a load or wait_checkpoint() first finishes the save
  // before; an error of a save in the background is thrown there, on every rank.
  void save_checkpoint(const std::filesystem::path& dir, const std::map<std::string, std::string>& user_meta = {},
                       train::save_mode mode = train::save_mode::sync) {
    engine_->save_checkpoint(dir, user_meta, mode);
  }
  // Finishes the save in the background, if any: its files durable and dir/latest naming it. Collective; call it
  // before training ends (a trainer destroyed with a save unfinished leaves latest at the save before). Returns
  // whether there was one.
  bool wait_checkpoint() { return engine_->wait_checkpoint(); }
  // Whether this rank's part of a save in the background is still running (rank 0: until latest names it).
  // Not collective.
  bool checkpoint_pending() const { return engine_->checkpoint_pending(); }
  // Loads dir/latest, whatever layout (dp × pp, sharding) wrote it, and returns its user_meta. Collective; a
  // bad checkpoint throws the same dml::error on every rank and leaves this trainer unchanged.
  std::map<std::string, std::string> load_checkpoint(const std::filesystem::path& dir) { return engine_->load_checkpoint(dir); }
  // What this rank holds (parameters, optimizer state, step, seed), in memory; not collective. restore() takes a
  // snapshot of the same layout and rank (this one's, or a peer's that holds the same part: a replica).
  train::state_snapshot snapshot() { return engine_->snapshot(); }
  void restore(const train::state_snapshot& s) { engine_->restore(s); }
  // What this rank owns (its pieces of parameters and optimizer state) in the global index space of checkpoints,
  // in memory; not collective. import_pieces() fills this rank from states of one step exported by any layout
  // of the same model (another world size, sharding or pipeline cut), as load_checkpoint does from files; an
  // element none of them holds is an error, and the trainer is left as it was.
  train::state_pieces export_pieces() { return engine_->export_pieces(); }
  void import_pieces(std::span<const train::state_pieces> sources) { engine_->import_pieces(sources); }

 private:
  // The trainer's memory is the communicator's: dml::cuda over comm::nccl, dml::host over comm::local or comm::mpi.
  template <class C>
  static consteval bool same_space() {
    static_assert(std::same_as<comm::memory_space_t<C>, space>,
                  "dml::trainer: the communicator moves memory of another space than the trainer's: train dml::cuda "
                  "over comm::nccl, dml::host over comm::local or comm::mpi");
    return true;
  }
  std::unique_ptr<train::detail::engine_base<space>> engine_;
};

}  // namespace dml
