// SPDX-License-Identifier: Apache-2.0
// dml/parallel/zero.hpp — ZeRO stages 1–3: optimizer state, then gradients, then parameters sharded over the ranks.
// Sits on parallel/sharding.hpp. Every bucket splits into one equal part per rank and a rank's shard is its
// part of every bucket: stage 1 reduce-scatters full gradients into it, stages 2 and 3 reduce each bucket
// from a staging buffer as backward leaves it, and stage 3 gathers each bucket's parameters before use.
#pragma once

#include <array>
#include <span>
#include <vector>

#include "dml/parallel/sharding.hpp"

namespace dml::parallel {

namespace detail {

template <int Stage, class Space, class Comm, class Optimizer, class Precision, class Net>
class zero_sync final : public data_parallel<Space, Comm, Optimizer, Precision, Net> {
  using base = data_parallel<Space, Comm, Optimizer, Precision, Net>;
  using typename base::T;
  using base::comm_, base::net_, base::state_, base::pending_, base::reduce_, base::log_, base::mixed,
      base::buckets_, base::layer_bucket_, base::shard_, base::rank_, base::current_;
  // Where the float parameters live: a shard (ZeRO-3, and every mixed stage, whose master weights are
  // sharded with the optimizer state), or the network itself (fp32 stages 1 and 2).
  static constexpr bool sharded_master = Stage == 3 || mixed;

 public:
  static constexpr bool reduces_every_backward = Stage >= 2;
  static constexpr bool sharded_gradients = true;
  static nn::network_options network_options(int ranks) {
    return {.alignment = nn::param_layout::alignment * ranks, .own_params = Stage < 3, .own_grads = Stage < 2, .layers = {}};
  }

  zero_sync(Comm& comm, Net& net, const sync_options& o) : base(comm, net, o) {
    shard_grads_.resize(static_cast<std::size_t>(shard_));
    state_.resize(shard_);
    std::int64_t widest = 0;
    for (const auto& b : buckets_) widest = std::max(widest, b.hi - b.lo);
    if constexpr (Stage >= 2)
      for (auto& s : staging_) s.resize(static_cast<std::size_t>(widest));
    if constexpr (Stage == 3)
      for (auto& g : gathered_) g.resize(static_cast<std::size_t>(widest));
    if constexpr (sharded_master) {
      shard_params_.resize(static_cast<std::size_t>(shard_));
      for (const auto& bk : buckets_) init_master_part(net_, this->seed_, bk, rank_, shard_params_.data());
    }
    if constexpr (mixed && Stage == 3) {
      shard_working_.resize(static_cast<std::size_t>(shard_));
      cast_n<Space>(shard_params_.data(), shard_working_.data(), shard_);
    }
  }

  // ---- hooks: stage 3 gathers parameters around each bucket; every stage launches bucket reductions.
  void before_forward(std::size_t layer) override {
    if constexpr (Stage == 3) {
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
    if constexpr (Stage == 3) {
      current_ = b;
      ensure_gathered(b);
      prefetch(b + 1);  // backward walks buckets upwards
    }
    if constexpr (Stage >= 2) {
      // The staging buffer this bucket takes may still be in flight for bucket b − 2.
      const auto slot = static_cast<std::size_t>(b % 2);
      complete_reduce(reduce_[slot]);
      const auto& bk = buckets_[static_cast<std::size_t>(b)];
      fill_n<Space>(staging_[slot].data(), bk.hi - bk.lo, T(0.f));  // padding must reduce to zero
      for (std::size_t s = bk.first_slot; s < bk.end_slot; ++s)
        net_.set_grad_pointer(s, staging_[slot].data() + (net_.layout().slots[s].offset - bk.lo));
    }
  }
  void after_backward(std::size_t layer) override {
    this->poll();
    const auto* bk = this->ends_bucket(layer);
    if (!bk) return;
    const int b = this->bucket_index(*bk);
    (*log_)(event_kind::bucket_launch, b);
    this->order_after_compute();  // the bucket's gradients come from kernels still in the queue
    if constexpr (Stage == 1) {
      pending_.push_back({comm_.ireduce_scatter(std::span<const T>(net_.grads().data() + bk->lo, bk->hi - bk->lo),
                                                std::span<T>(shard_grads_.data() + bk->shard_offset, bk->part),
                                                comm::reduce_op::sum),
                          b, false});
    } else {
      const auto slot = static_cast<std::size_t>(b % 2);
      T* out = shard_grads_.data() + bk->shard_offset;
      if (this->backward_index_ > 0) {  // later backward passes reduce aside and add into the shard when done
        shard_tmp_.resize(static_cast<std::size_t>(shard_));
        out = shard_tmp_.data() + bk->shard_offset;
      }
      reduce_[slot] = {comm_.ireduce_scatter(std::span<const T>(staging_[slot].data(), bk->hi - bk->lo),
                                             std::span<T>(out, bk->part), comm::reduce_op::sum),
                       b, false};
    }
  }
  void finish() {
    for (auto& f : pending_) this->complete(f);
    pending_.clear();
    for (auto& f : reduce_) complete_reduce(f);
    current_ = -1;
  }

  // skip[s]: leave slot s out (a tensor rank's copy of a parameter that rank 0 counts).
  double grad_squared_norm(const std::vector<bool>& skip = {}) {
    double n = optim::squared_norm<Space>(shard_grads_.data(), shard_);
    if (!skip.empty())
      for (const auto& p : this->owned_pieces(this->rank_))
        if (skip[p.slot]) n -= optim::squared_norm<Space>(shard_grads_.data() + p.shard, p.end - p.begin);
    return n;
  }
  bool has_overflow() const { return optim::has_nonfinite<Space>(shard_grads_.data(), shard_); }

  // One fused pass per range: unscale and clip, the update of the float weights, and under mixed
  // precision the cast into the working copy; stages 1 and 2 then gather every bucket's parts.
  void update(Optimizer& opt, float lr, std::int64_t t, float grad_scale) {
    if constexpr (Stage == 3) {
      optim::step_args a{.n = shard_, .w = shard_params_.data(), .g = shard_grads_.data(), .state = state_.pointers(),
                         .step = t, .lr = lr, .grad_scale = grad_scale};
      if constexpr (mixed) a.working = shard_working_.data();
      opt.template update<Space>(a);
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
        opt.template update<Space>(a);
        this->order_after_compute();  // the update kernels wrote this rank's part
        comm_.all_gather(std::span<T>(w, bk.hi - bk.lo));  // in place: this rank's part is at rank·part
      }
    }
  }

  std::vector<float> parameters() {
    const auto total = static_cast<std::size_t>(net_.layout().total);
    std::vector<float> full(total);
    if constexpr (sharded_master) {
      buffer<float, Space> gathered(total);  // collectives work in the trainer's space
      this->order_after_compute();
      for (const auto& bk : buckets_)
        comm_.all_gather(std::span<const float>(shard_params_.data() + bk.shard_offset, bk.part),
                         std::span<float>(gathered.data() + bk.lo, bk.hi - bk.lo));
      dml::copy_n(gathered.data(), total, full.data());
    } else {
      dml::copy_n(net_.params().data(), total, full.data());
    }
    return full;
  }
  void load_parameters(std::span<const float> full) {
    if constexpr (sharded_master) {
      for (const auto& bk : buckets_)
        dml::copy_n(full.data() + bk.lo + rank_ * bk.part, static_cast<std::size_t>(bk.part),
                    shard_params_.data() + bk.shard_offset);
    } else {
      dml::copy_n(full.data(), full.size(), net_.params().data());
    }
    refresh_working();
  }
  // After the float parameters changed outside an update (load): rewrite the working copy from them.
  void refresh_working() {
    resident_ = {-1, -1};  // gathered copies are stale now
    if constexpr (mixed && Stage == 3) {
      cast_n<Space>(shard_params_.data(), shard_working_.data(), shard_);
    } else if constexpr (mixed) {  // cast this rank's parts, then gather every part
      for (const auto& bk : buckets_) {
        T* w = net_.params().data() + bk.lo;
        cast_n<Space>(shard_params_.data() + bk.shard_offset, w + rank_ * bk.part, bk.part);
        this->order_after_compute();
        comm_.all_gather(std::span<T>(w, bk.hi - bk.lo));
      }
    }
  }

  memory_report memory() const {
    const auto& L = net_.layout();
    const std::int64_t w = sizeof(T), f = sizeof(float);
    memory_report m{.numel = L.numel, .padded = L.total};
    m.params = (Stage == 3 ? shard_ : L.total) * w;  // the working copy (fp32: the only copy)
    m.grads = (Stage >= 2 ? shard_ : L.total) * w;
    // Optimizer state, and under mixed precision the float master weights that go with it.
    m.optimizer = state_.bytes() + (mixed ? static_cast<std::int64_t>(shard_params_.size()) * f : 0);
    m.buffers = static_cast<std::int64_t>((staging_[0].size() + staging_[1].size() + gathered_[0].size() +
                                           gathered_[1].size() + shard_tmp_.size()) * sizeof(T));
    return m;
  }

  // Checkpoints: a rank writes and reads its part of every bucket (fp32 stages 1 and 2 hold whole
  // parameters, so they read those whole).
  float* held(int k, const owned_piece& p) {
    if (k >= 0) return state_.slot(k).data() + p.shard;
    if constexpr (sharded_master) return shard_params_.data() + p.shard;
    else return net_.params().data() + p.flat;
  }
  static constexpr bool loads_pieces(int k) { return k >= 0 || sharded_master; }
  float* whole(int) {
    if constexpr (sharded_master) return nullptr;  // never asked: everything loads by pieces
    else return net_.params().data();
  }

 private:
  void complete_reduce(typename base::inflight& f) {
    if constexpr (Stage >= 2) this->complete(f, shard_grads_.data(), shard_tmp_.data());
  }
  // ZeRO-3 gathers the working copy of the shard (the float master itself in fp32).
  const T* working_shard() const {
    if constexpr (mixed) return shard_working_.data();
    else return shard_params_.data();
  }
  void point_params(int b) {
    const auto& bk = buckets_[static_cast<std::size_t>(b)];
    T* at = gathered_[static_cast<std::size_t>(b % 2)].data();
    for (std::size_t s = bk.first_slot; s < bk.end_slot; ++s)
      net_.set_param_pointer(s, at + (net_.layout().slots[s].offset - bk.lo));
  }
  void gather(int b, bool async) {
    const auto& bk = buckets_[static_cast<std::size_t>(b)];
    const auto slot = static_cast<std::size_t>(b % 2);
    auto send = std::span<const T>(working_shard() + bk.shard_offset, bk.part);
    auto recv = std::span<T>(gathered_[slot].data(), bk.hi - bk.lo);
    this->order_after_compute();  // the slot may still be read by kernels of the bucket it held
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

  buffer<float, Space> shard_params_;  // float weights of the shard (stage 3, and mixed stages)
  buffer<T, Space> shard_grads_, shard_tmp_, shard_working_;
  buffer<T, Space> staging_[2], gathered_[2];
  std::array<int, 2> resident_{-1, -1};
  comm::request gather_req_[2];
};

}  // namespace detail

// ZeRO stage 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters).
template <int Stage>
struct zero {
  static_assert(1 <= Stage && Stage <= 3, "dml::parallel::zero<Stage>: Stage is 1, 2 or 3");
  using policy_family = sharding_family;
  static constexpr int stage = Stage;
  static constexpr const char* name = Stage == 1 ? "zero1" : Stage == 2 ? "zero2" : "zero3";
  static constexpr bool shards_optimizer_state = true, shards_gradients = Stage >= 2, shards_parameters = Stage == 3;
  template <class Space, class Comm, class Optimizer, class Precision, class Net>
  using sync = detail::zero_sync<Stage, Space, Comm, Optimizer, Precision, Net>;
};

}  // namespace dml::parallel
