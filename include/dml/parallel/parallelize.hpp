// SPDX-License-Identifier: Apache-2.0
// dml/parallel/parallelize.hpp — parallelize(mesh, model, plan): the one place where a model is placed on a
// rank. It splits the model (tensor, expert and context parts), cuts it into this rank's pipeline chunks,
// hands out the groups of one mesh (tensor, expert, context, the data group, and the dense, expert and
// replicate groups a sharding reduces over), and lowers the schedule into this rank's checked program.
// Sits on parallel/{plan,mesh,pipeline,program,tensor}.hpp; train/trainer.hpp builds its engine on it.
// See DESIGN.md §9.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dml/nn/network.hpp"
#include "dml/parallel/mesh.hpp"
#include "dml/parallel/pipeline.hpp"
#include "dml/parallel/plan.hpp"
#include "dml/parallel/program.hpp"
#include "dml/parallel/sharding.hpp"
#include "dml/parallel/tensor.hpp"

namespace dml::parallel {

// What placing a model needs besides the plan and the mesh.
struct placement_options {
  std::int64_t micro_batches = 1;          // of a step: the schedule at this count fixes the chunks per rank
  std::vector<std::size_t> stage_cuts{};   // first layer of each (virtual) stage after the first; empty: balanced
  std::int64_t cost_rows = 64;             // input rows the stage balancing prices each layer's FLOPs at
  std::string schedule{};                  // a schedule by name or CSV file; empty: the plan's schedule policy
  // For plans that leave them to run time (any_plan); a plan that names tensor<> or context<> decides.
  bool sequence_parallel = false;
  bool cp_zigzag = true;
  bool cp_all_gather = false;  // K/V all-gathered over the context group, not passed round it
  // The sharding can reduce gradients per micro-batch (ZeRO-2/3): it does where the program allows it (one
  // stage, backward not split); otherwise a chunk's gradients are reduced once per step.
  bool streams_gradients = false;
  bool micro_batch_residency = false;  // such a sharding streams on pipelines too (trainer_options' doc)
};

// A model placed on this rank by a plan: its part of the model and of the pipeline, its groups, and its
// program for any number of micro-batches. Owns the mesh (none when the world is one data-parallel group).
template <plan_policy Plan, comm::communicator Comm, class... Layers>
class placement {
 public:
  using model_type = nn::sequential<Layers...>;

  placement(Comm& world, std::optional<parallel::mesh<Comm>> m, const model_type& model, placement_options o)
      : world_(world), mesh_(std::move(m)), o_(checked(std::move(o))), part_(model) {
    check_degrees<Plan>(shape());
    const auto s = shape();
    if (s.tp > 1) nn::set_tensor_split(part_, {.ranks = s.tp, .rank = mesh_->tp_rank(), .sequence = sequence()});
    // Experts learn their rank of the expert group and the ranks one micro-batch's capacity counts (the data group,
    // and under sequence parallelism the tensor group's slices of it), which bound their buffers.
    nn::set_expert_split(part_, s.ep, s.ep > 1 ? mesh_->ep_rank() : 0, data().size() * (sequence() ? s.tp : 1));
    if (s.cp > 1)
      nn::set_context_split(part_, {.ranks = s.cp, .rank = mesh_->cp_rank(), .zigzag = zigzag(), .all_gather = gathers_kv()});
    tp_ = group(s.tp, &parallel::mesh<Comm>::tp);
    ep_ = group(s.ep, &parallel::mesh<Comm>::ep);
    cp_ = group(s.cp, &parallel::mesh<Comm>::cp);
    if (data().size() > 1) data_ = std::make_unique<rank_group<Comm>>(data());
    const auto t = make_table(o_.micro_batches);
    virtual_stages_ = t.virtual_stages;
    per_step_ = !o_.streams_gradients || (s.pp > 1 && !o_.micro_batch_residency) || schedule::splits_backward(t);
    chunks_ = stage_chunks<nn::basic_network<host, float, Layers...>>(
        part_, {.stages = s.pp, .virtual_stages = virtual_stages_, .cuts = o_.stage_cuts, .cost_rows = o_.cost_rows},
        pp_rank());
  }
  // The groups refer into the mesh this object holds: it stays where it was made.
  placement(const placement&) = delete;
  placement& operator=(const placement&) = delete;

  // ---- where this rank sits
  Comm& world() { return world_; }
  mesh_shape shape() const {
    return mesh_ ? mesh_->shape() : mesh_shape{.dp = world_.size()};
  }
  parallel::mesh<Comm>* mesh() { return mesh_ ? &*mesh_ : nullptr; }  // null: one data-parallel group
  int pp_rank() const { return mesh_ ? mesh_->pp_rank() : 0; }
  int tp_rank() const { return mesh_ ? mesh_->tp_rank() : 0; }
  int ep_rank() const { return mesh_ ? mesh_->ep_rank() : 0; }
  bool sequence() const { return Plan::any_degree ? o_.sequence_parallel : plan_sequence(); }
  bool zigzag() const { return Plan::any_degree ? o_.cp_zigzag : plan_zigzag(); }
  bool gathers_kv() const { return Plan::any_degree ? o_.cp_all_gather : plan_gathers_kv(); }

  // ---- the model
  const model_type& part() const { return part_; }                    // this rank's tp/ep/cp part
  std::span<const nn::layer_range> chunks() const { return chunks_; }  // the layers this rank runs
  int virtual_stages() const { return virtual_stages_; }
  bool per_step() const { return per_step_; }  // gradients reduced once per step (else per micro-batch)

  // ---- the groups
  Comm& data() { return mesh_ ? mesh_->dp() : world_; }  // the data-parallel ranks of this stage
  Comm* pipe() { return s_pp() > 1 ? &mesh_->pp() : nullptr; }
  shard_groups<Comm> shards() {
    if (!mesh_) return {.dense = world_};
    return {.dense = mesh_->shard(), .expert = shape().ep > 1 ? &mesh_->expert_shard() : nullptr,
            .replicate = &mesh_->replicate()};
  }
  // What the layers talk to (null: not in use): the tensor group, and the expert, context and data groups.
  nn::rank_group* tensor() { return tp_.get(); }
  const nn::rank_group* tensor() const { return tp_.get(); }
  nn::context layer_groups() { return {.ep = ep_.get(), .cp = cp_.get(), .cp_zigzag = zigzag(), .data = data_.get()}; }

  // ---- the program
  // The schedule for m micro-batches (checked), and this rank's program: it lowered, with ties or without.
  const schedule::table& table(std::int64_t m) {
    program(m, false);
    return tables_.at(m);
  }
  const parallel::program& program(std::int64_t m, bool ties) {
    const auto key = std::pair{m, ties};
    if (auto it = programs_.find(key); it != programs_.end()) return it->second;
    if (!tables_.contains(m)) {
      auto t = schedule::checked(make_table(m), s_pp(), static_cast<int>(m), static_cast<int>(chunks_.size()));
      if constexpr (!comm::matches_tags<Comm>)
        if (auto e = schedule::verify_in_order(t))
          fail<invalid_argument>("dml::parallelize: this communicator matches the messages between two ranks in the "
                                 "order they are sent (it has no tags), and the schedule for ", m,
                                 " micro-batches reorders them: ", *e, "; choose gpipe, 1f1b or zb, or another micro-batch count");
      tables_.emplace(m, std::move(t));
    }
    const lowering how{.per_micro_batch = !per_step_, .ties = ties};
    auto p = lower(tables_.at(m), pp_rank(), how);
    if (auto e = check(p, static_cast<int>(chunks_.size()), how); !e.empty())
      fail<invalid_argument>("dml::parallelize: the schedule lowered for ", Plan::sharding::name,
                             " is unsound: rank ", pp_rank(), ", ", e);
    return programs_.emplace(key, std::move(p)).first->second;
  }

 private:
  static placement_options checked(placement_options o) {
    if (o.micro_batches < 1) fail<invalid_argument>("dml::trainer: expected micro_batches >= 1, found ", o.micro_batches);
    if constexpr (!Plan::any_degree) {
      if (o.sequence_parallel && !plan_sequence())
        fail<invalid_argument>("dml::parallelize: sequence_parallel is asked for but the plan says tensor<> without "
                               "it; name parallel::tensor<parallel::sequence_parallel> in the plan");
      if (!o.cp_zigzag && plan_zigzag())
        fail<invalid_argument>("dml::parallelize: contiguous chunks are asked for but the plan says context<zigzag>; "
                               "name parallel::context<parallel::contiguous> in the plan");
      if (o.cp_all_gather && !plan_gathers_kv())
        fail<invalid_argument>("dml::parallelize: all-gathered K/V are asked for but the plan's context<> passes them "
                               "round a ring; name parallel::context<Order, parallel::all_gather> in the plan");
    }
    return o;
  }
  static constexpr bool plan_sequence() {
    if constexpr (requires { Plan::sequence; }) return Plan::sequence;
    else return false;
  }
  static constexpr bool plan_gathers_kv() {
    if constexpr (requires { Plan::gathers_kv; }) return Plan::gathers_kv;
    else return false;
  }
  static constexpr bool plan_zigzag() {
    if constexpr (requires { Plan::zigzag_chunks; }) return Plan::zigzag_chunks;
    else return true;
  }
  int s_pp() const { return shape().pp; }
  std::unique_ptr<rank_group<Comm>> group(int degree, Comm& (parallel::mesh<Comm>::*axis)()) {
    if (degree == 1) return nullptr;
    return std::make_unique<rank_group<Comm>>(((*mesh_).*axis)());
  }
  schedule::table make_table(std::int64_t m) const {
    const int k = s_pp();
    return o_.schedule.empty() ? Plan::schedule::make(k, static_cast<int>(m))
                               : schedule::make(o_.schedule, k, static_cast<int>(m));
  }

  Comm& world_;
  std::optional<parallel::mesh<Comm>> mesh_;
  placement_options o_;
  model_type part_;
  std::unique_ptr<rank_group<Comm>> tp_, ep_, cp_, data_;
  int virtual_stages_ = 1;
  bool per_step_ = true;
  std::vector<nn::layer_range> chunks_;
  std::map<std::int64_t, schedule::table> tables_;
  std::map<std::pair<std::int64_t, bool>, parallel::program> programs_;
};

// Places `model` on this rank of `m`'s world by `plan`: a collective only in that the mesh was one.
template <plan_policy Plan, comm::communicator Comm, class... Layers>
placement<Plan, Comm, Layers...> parallelize(mesh<Comm> m, const nn::sequential<Layers...>& model, Plan,
                                             placement_options o = {}) {
  static_assert(plan_fits<Plan, Layers...>());
  Comm& world = m.world();
  return placement<Plan, Comm, Layers...>(world, std::move(m), model, std::move(o));
}

// The same over a world of data-parallel ranks only (no mesh, no groups split off).
template <plan_policy Plan, comm::communicator Comm, class... Layers>
placement<Plan, Comm, Layers...> parallelize(Comm& world, const nn::sequential<Layers...>& model, Plan,
                                             placement_options o = {}) {
  static_assert(plan_fits<Plan, Layers...>());
  return placement<Plan, Comm, Layers...>(world, std::nullopt, model, std::move(o));
}

}  // namespace dml::parallel
