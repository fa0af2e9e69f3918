// SPDX-License-Identifier: Apache-2.0
// dml/parallel/replicate.hpp — data parallelism (DDP): every rank holds everything; buckets all-reduce during backward.
// Sits on parallel/sharding.hpp; train/trainer.hpp runs it through the sharding_sync interface.
#pragma once

#include <algorithm>
#include <array>
#include <span>
#include <vector>

#include "dml/optim/layerwise.hpp"
#include "dml/parallel/sharding.hpp"

namespace dml::parallel {

namespace detail {

template <class Space, class Comm, class Optimizer, class Precision, class Net>
class replicate_sync final : public data_parallel<Space, Comm, Optimizer, Precision, Net> {
  using base = data_parallel<Space, Comm, Optimizer, Precision, Net>;
  using typename base::T;
  using base::net_, base::state_, base::pending_, base::log_, base::mixed;

 public:
  static constexpr bool streams_gradients = false;  // reduces once per step, at each chunk's last backward
  static nn::network_options network_options(int ranks, bool /*per_step*/) {
    return {.alignment = nn::param_layout::alignment * ranks, .own_params = true, .own_grads = true, .layers = {}};
  }

  replicate_sync(shard_groups<Comm> g, Net& net, const sync_options& o) : base(g, net, o) {
    const auto total = net_.layout().total;
    state_.resize(total, this->offload_);
    if constexpr (mixed) {
      master_.resize(static_cast<std::size_t>(total));
      init_master(net_, this->seed_, master_.data());
    }
  }

  // Each run all-reduces over its group: experts over the ranks that hold them, the rest over every rank.
  void after_backward(std::size_t layer) override {
    this->poll();
    const auto* bk = this->ends_bucket(layer);
    if (!bk) return;
    const int b = this->bucket_index(*bk);
    (*log_)(event_kind::bucket_launch, b);
    typename base::inflight f{.r = {}, .bucket = b, .seen = false};
    for (const auto& rn : bk->runs) {
      this->count_dense(rn, 2);
      if constexpr (std::same_as<T, float> && std::same_as<Space, host>) {
        if (this->compress_) {  // blocking: compressed messages are not overlapped with backward
          this->compressor_.all_reduce(this->group(rn), net_.grads().subspan(rn.lo, rn.hi - rn.lo),
                                       static_cast<std::size_t>(rn.lo), static_cast<std::size_t>(rn.shard_offset));
          zero_padding(rn);
          continue;
        }
      }
      f.r.push_back(this->group(rn).iall_reduce(net_.grads().subspan(rn.lo, rn.hi - rn.lo), comm::reduce_op::sum));
    }
    pending_.push_back(std::move(f));
  }
  void reduce(int, bool) {
    for (auto& f : pending_) this->complete(f);
    pending_.clear();
    this->current_ = -1;
  }
  // The gradient of slot s as this rank holds it after the reductions: whole.
  span_in<T, Space> grad_piece(std::size_t s) {
    return {net_.grad(s), static_cast<std::size_t>(net_.layout().slots[s].shape.numel())};
  }

  // The squares of what this rank owns (its part of each run), but slots with skip[s] set (a tensor rank's copy
  // of a parameter that tensor rank 0 counts, a tied copy): summed over the world, each element counts once.
  double grad_squared_norm(const std::vector<bool>& skip = {}) {
    double n = 0;
    for (const auto& p : this->owned_pieces())
      if (skip.empty() || !skip[p.slot]) n += optim::squared_norm<Space>(net_.grads().data() + p.flat, p.end - p.begin);
    return n;
  }
  bool has_overflow() const { return optim::has_nonfinite<Space>(net_.grads().data(), net_.layout().total); }

  // One fused pass: unscale and clip (grad_scale), the update of the float weights, and under mixed
  // precision the cast into the working copy.
  void update(Optimizer& opt, float lr, std::int64_t t, float grad_scale) {
    optim::step_args a{.n = net_.layout().total, .w = master(), .g = net_.grads().data(), .step = t, .lr = lr,
                       .grad_scale = grad_scale};
    if constexpr (mixed) a.working = net_.params().data();
    if constexpr (optim::layerwise_v<Optimizer>) {
      // Layer-wise (LAMB, LARS): every rank holds whole tensors, so their norms need no reduction. Their state is
      // in memory (the engine refuses offload with them).
      if (optim::uses_layerwise(opt)) {
        if (pieces_.empty()) pieces_ = optim::whole_tensors(net_.layout());
        a.state = state_.pointers();
        return optim::update_tensors<Space>(opt, a, pieces_);
      }
    }
    state_.begin_step();
    state_.update(opt, a, 0);
    state_.end_step();
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
            .optimizer = state_.bytes() + static_cast<std::int64_t>(master_.size() * sizeof(float)),
            .offloaded = state_.disk_bytes()};
  }

  // Checkpoints: a rank writes its part of every run, and reads whole parameters and state.
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
  // 1-bit messages give padding entries a value; backward leaves them, and they would feed back next step.
  void zero_padding(const run& rn) {
    const auto& L = net_.layout();
    for (std::size_t s = rn.first_slot; s < rn.end_slot; ++s) {
      const std::int64_t end = s + 1 < rn.end_slot ? L.slots[s + 1].offset : rn.hi;
      std::fill(net_.grads().data() + L.slots[s].offset + L.slots[s].shape.numel(), net_.grads().data() + end, T{});
    }
  }
  buffer<float, Space> master_;  // mixed precision: the float weights beside the working copy
  std::vector<optim::tensor_piece> pieces_;  // layer-wise optimizers: each slot whole
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
