// SPDX-License-Identifier: Apache-2.0
// dml/parallel/replicate.hpp — data parallelism (DDP): every rank holds everything; buckets all-reduce during backward.
// Sits on parallel/sharding.hpp; train/trainer.hpp runs it through the sharding_sync interface.
#pragma once

#include <array>
#include <span>
#include <vector>

#include "dml/parallel/sharding.hpp"

namespace dml::parallel {

namespace detail {

template <class Space, class Comm, class Optimizer, class Precision, class Net>
class replicate_sync final : public data_parallel<Space, Comm, Optimizer, Precision, Net> {
  using base = data_parallel<Space, Comm, Optimizer, Precision, Net>;
  using typename base::T;
  using base::comm_, base::net_, base::state_, base::pending_, base::log_, base::mixed;

 public:
  static constexpr bool reduces_every_backward = false;  // only the last backward of a step reduces
  static constexpr bool sharded_gradients = false;
  static nn::network_options network_options(int ranks) {
    return {.alignment = nn::param_layout::alignment * ranks, .own_params = true, .own_grads = true, .layers = {}};
  }

  replicate_sync(Comm& comm, Net& net, const sync_options& o) : base(comm, net, o) {
    const auto total = net_.layout().total;
    state_.resize(total);
    if constexpr (mixed) {
      master_.resize(static_cast<std::size_t>(total));
      init_master(net_, this->seed_, master_.data());
    }
  }

  // Expert parallelism: the slots holding this rank's experts sum over `edp`, the ranks that hold the same
  // experts, instead of the whole data-parallel group (where other ranks' slots hold other experts).
  void set_expert_group(Comm& edp) { edp_ = &edp; }

  void after_backward(std::size_t layer) override {
    this->poll();
    const auto* bk = this->ends_bucket(layer);
    if (!bk) return;
    const int b = this->bucket_index(*bk);
    (*log_)(event_kind::bucket_launch, b);
    this->order_after_compute();  // the bucket's gradients come from kernels still in the queue
    if (!edp_) {
      pending_.push_back({comm_.iall_reduce(net_.grads().subspan(bk->lo, bk->hi - bk->lo), comm::reduce_op::sum), b, false});
      return;
    }
    // Runs of expert and other slots, each over its group; the bucket's completion is logged once.
    const auto& L = net_.layout();
    bool first = true;
    for (std::size_t s = bk->first_slot; s < bk->end_slot;) {
      const bool expert = L.slots[s].spec.shard.expert_sharded();
      std::size_t e = s + 1;
      while (e < bk->end_slot && L.slots[e].spec.shard.expert_sharded() == expert) ++e;
      const std::int64_t lo = L.slots[s].offset, hi = e < L.slots.size() ? L.slots[e].offset : L.total;
      Comm& group = expert ? *edp_ : comm_;
      pending_.push_back({group.iall_reduce(net_.grads().subspan(lo, hi - lo), comm::reduce_op::sum), b, !first});
      first = false;
      s = e;
    }
  }
  void finish() {
    for (auto& f : pending_) this->complete(f);
    pending_.clear();
    this->current_ = -1;
  }

  // skip[s]: leave slot s out (a tensor rank's copy of a parameter that rank 0 counts).
  double grad_squared_norm(const std::vector<bool>& skip = {}) {
    double n = optim::squared_norm<Space>(net_.grads().data(), net_.layout().total);
    for (std::size_t s = 0; s < skip.size(); ++s)
      if (skip[s]) n -= optim::squared_norm<Space>(net_.grad(s), net_.layout().slots[s].shape.numel());
    return n;
  }
  bool has_overflow() const { return optim::has_nonfinite<Space>(net_.grads().data(), net_.layout().total); }

  // One fused pass: unscale and clip (grad_scale), the update of the float weights, and under mixed
  // precision the cast into the working copy.
  void update(Optimizer& opt, float lr, std::int64_t t, float grad_scale) {
    optim::step_args a{.n = net_.layout().total, .w = master(), .g = net_.grads().data(), .state = state_.pointers(),
                       .step = t, .lr = lr, .grad_scale = grad_scale};
    if constexpr (mixed) a.working = net_.params().data();
    opt.template update<Space>(a);
  }

  std::vector<float> parameters() {
    std::vector<float> full(static_cast<std::size_t>(net_.layout().total));
    dml::copy_n(master(), full.size(), full.data());
    return full;
  }
  void load_parameters(std::span<const float> full) {
    dml::copy_n(full.data(), full.size(), master());
    refresh_working();
  }
  // After the float parameters changed outside an update: rewrite the working copy from them.
  void refresh_working() {
    if constexpr (mixed) cast_n<Space>(master_.data(), net_.params().data(), net_.layout().total);
  }

  memory_report memory() const {
    const auto& L = net_.layout();
    const std::int64_t w = sizeof(T);
    return {.numel = L.numel, .padded = L.total, .params = L.total * w, .grads = L.total * w,
            .optimizer = state_.bytes() + static_cast<std::int64_t>(master_.size() * sizeof(float))};
  }

  // Checkpoints: a rank writes its part of every bucket, and reads whole parameters and state.
  float* held(int k, const owned_piece& p) { return whole(k) + p.flat; }
  static constexpr bool loads_pieces(int) { return false; }
  float* whole(int k) { return k < 0 ? master() : state_.slot(k).data(); }

 private:
  float* master() {
    if constexpr (mixed) return master_.data();
    else return net_.params().data();
  }
  const float* master() const {
    if constexpr (mixed) return master_.data();
    else return net_.params().data();
  }
  buffer<float, Space> master_;  // mixed precision: the float weights beside the working copy
  Comm* edp_ = nullptr;
};

}  // namespace detail

// Data parallel (DDP): every rank holds everything; gradients are all-reduced in buckets during backward.
struct replicate {
  using policy_family = sharding_family;
  static constexpr const char* name = "ddp";
  static constexpr bool shards_optimizer_state = false, shards_gradients = false, shards_parameters = false;
  template <class Space, class Comm, class Optimizer, class Precision, class Net>
  using sync = detail::replicate_sync<Space, Comm, Optimizer, Precision, Net>;
};

}  // namespace dml::parallel
