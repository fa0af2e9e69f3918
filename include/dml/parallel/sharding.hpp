// SPDX-License-Identifier: Apache-2.0
// dml/parallel/sharding.hpp — the sharding family: who holds which parameters, gradients and optimizer state.
// Sits on nn/, comm/ and optim/; replicate.hpp and zero.hpp model it, and train/trainer.hpp sequences a model's calls.
//
// A sharding policy P names a class template P::sync<Space, Comm, Optimizer, Precision, Network>: the
// data-parallel state of one rank (buckets, gradients, optimizer state, float master weights) and
// its work: layer hooks that launch bucket reductions during backward, finish(), the update, and
// where each parameter and state element lives for full parameters and checkpoints.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/core/cast.hpp"
#include "dml/nn/network.hpp"
#include "dml/optim/clip.hpp"
#include "dml/optim/loss_scaler.hpp"
#include "dml/optim/optimizer.hpp"
#include "dml/parallel/buckets.hpp"
#include "dml/parallel/events.hpp"
#include "dml/parallel/master_weights.hpp"

namespace dml {

struct sharding_family {};

namespace parallel {

// Per-rank bytes of model state, computed from the sizes the sharding allocates.
struct memory_report {
  std::int64_t numel = 0;        // Ψ: parameters of the model (of this pipeline stage)
  std::int64_t padded = 0;       // parameters including padding to equal, aligned per-rank parts
  std::int64_t params = 0, grads = 0, optimizer = 0;  // bytes held for the whole run
  std::int64_t buffers = 0;      // bytes of staging and gather buffers (ZeRO-2/3)
  // Bytes of activations at the last step's peak: layer outputs and what layers keep for backward, of every
  // micro-batch in flight (filled by the trainer; not part of total(), which is the model state).
  std::int64_t activations = 0;
  std::int64_t total() const { return params + grads + optimizer + buffers; }
};

// What a sharding's state is built from.
struct sync_options {
  std::uint64_t seed = 0;  // initial weights: element i of parameter p follows (seed, p, i) on every layout
  double bucket_mb = 25.0;
  std::span<const nn::layer_range> chunks;  // the layers this rank holds (pipeline chunks)
  event_log* log = nullptr;
};

// The concept, in named parts so that a failure names the missing one.
template <class P>
concept in_sharding_family = requires { typename P::policy_family; } &&
                             std::same_as<typename P::policy_family, sharding_family>;
template <class P>
concept has_sharding_name = requires {
  { P::name } -> std::convertible_to<const char*>;
};
template <class P>
concept has_shards = requires {
  { P::shards_optimizer_state } -> std::convertible_to<bool>;
  { P::shards_gradients } -> std::convertible_to<bool>;
  { P::shards_parameters } -> std::convertible_to<bool>;
};
template <class P>
concept sharding_policy = in_sharding_family<P> && has_sharding_name<P> && has_shards<P>;

// What a trainer calls on P::sync<...>; checked where the trainer instantiates it.
template <class S>
concept sharding_sync = std::derived_from<S, nn::layer_hooks> && requires(S& s, const S& cs, typename S::optimizer_type& o) {
  { S::reduces_every_backward } -> std::convertible_to<bool>;
  { S::sharded_gradients } -> std::convertible_to<bool>;
  s.finish();
  s.update(o, 1.f, std::int64_t{1}, 1.f);
  { s.grad_squared_norm() } -> std::convertible_to<double>;
  { s.has_overflow() } -> std::convertible_to<bool>;
  { s.parameters() } -> std::same_as<std::vector<float>>;
  { cs.memory() } -> std::same_as<memory_report>;
};

// static_assert(diagnose_sharding<P>()) names the first missing part.
template <class P>
consteval bool diagnose_sharding() {
  static_assert(in_sharding_family<P>, "dml: a sharding policy needs `using policy_family = dml::sharding_family;`");
  static_assert(has_sharding_name<P>, "dml: a sharding policy needs `static constexpr const char* name`");
  static_assert(has_shards<P>,
                "dml: a sharding policy needs `static constexpr bool shards_optimizer_state, shards_gradients, "
                "shards_parameters`");
  return true;
}
template <class S>
consteval bool diagnose_sharding_sync() {
  static_assert(std::derived_from<S, nn::layer_hooks>, "dml: a sharding's sync must derive from dml::nn::layer_hooks");
  static_assert(sharding_sync<S>,
                "dml: a sharding's sync needs reduces_every_backward, sharded_gradients, finish(), update(optimizer&, "
                "lr, step, grad_scale), grad_squared_norm(), has_overflow(), parameters() and memory()");
  return true;
}

namespace detail {

template <class T>
struct add_into {
  T* dst;
  const T* src;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    dst[i] = T(static_cast<float>(dst[i]) + static_cast<float>(src[i]));
  }
};

// What every bucketed data-parallel sharding keeps: the group, the network, its buckets, the
// optimizer state, and the bucket communications in flight.
template <class Space, class Comm, class Optimizer, class Precision, class Net>
class data_parallel : public nn::layer_hooks {
 public:
  using optimizer_type = Optimizer;
  using T = typename Precision::type;
  static constexpr bool mixed = !std::same_as<T, float>;

  data_parallel(Comm& comm, Net& net, const sync_options& o)
      : comm_(comm), net_(net), log_(o.log ? o.log : &no_log_), ranks_(comm.size()), rank_(comm.rank()),
        seed_(o.seed) {
    if (!(o.bucket_mb > 0)) fail<invalid_argument>("dml::trainer: expected bucket_mb > 0, found ", o.bucket_mb);
    target_ = static_cast<std::int64_t>(o.bucket_mb * 1024.0 * 1024.0 / sizeof(float));
    auto plan = make_buckets(net_.layout(), net_.depth(), target_, ranks_, o.chunks);
    buckets_ = std::move(plan.buckets);
    layer_bucket_ = std::move(plan.layer_bucket);
    shard_ = net_.layout().total / ranks_;
  }
  ~data_parallel() override {
#if DML_HAS_CUDA
    if (compute_done_) cudaEventDestroy(compute_done_);
#endif
  }
  data_parallel(const data_parallel&) = delete;
  data_parallel& operator=(const data_parallel&) = delete;

  std::span<const bucket> buckets() const { return buckets_; }
  std::int64_t bucket_target() const { return target_; }  // floats per bucket at least
  std::vector<owned_piece> owned_pieces(int r) const { return parallel::owned_pieces(net_.layout(), buckets_, r); }
  // The index of this step's backward pass (per chunk): ZeRO-2/3 write the shard on the first and add later.
  void set_backward_index(std::int64_t i) { backward_index_ = i; }
  void begin_pass() { current_ = -1; }

  // A scalar summed over a group, through memory of the trainer's space (NCCL reads device memory only).
  template <class V>
  V sum(Comm& group, V value) {
    if (group.size() == 1) return value;
    buffer<V, Space> v(1);
    dml::copy_n(&value, 1, v.data());
    order_after_compute();
    group.all_reduce(v.span(), comm::reduce_op::sum);
    dml::copy_n(v.data(), 1, &value);
    return value;
  }
  // The global index of this rank's first row: ranks pass contiguous slices of the global batch in
  // rank order (train::sampler::slice), so it is the sum of the earlier ranks' row counts; one
  // all_gather, made only for models with a layer that reads it (dropout). Under context parallelism the cp
  // consecutive ranks of a group pass the same rows, which count once.
  std::int64_t first_global_row(std::int64_t rows, int cp = 1) {
    if (!Net::model_type::uses_row_index || ranks_ == 1) return 0;
    buffer<std::int64_t, Space> mine(1), all(static_cast<std::size_t>(ranks_));
    dml::copy_n(&rows, 1, mine.data());
    order_after_compute();
    comm_.all_gather(std::span<const std::int64_t>(mine.data(), 1), all.span());
    std::vector<std::int64_t> counts(all.size());
    dml::copy_n(all.data(), counts.size(), counts.data());
    std::int64_t first = 0;
    for (int r = 0; r < rank_ / cp * cp; r += cp) first += counts[static_cast<std::size_t>(r)];
    return first;
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

 protected:
  // A bucket's communication in flight.
  struct inflight {
    comm::request r;
    int bucket = -1;
    bool seen = false;  // its completion is already in the event log
  };
  // With an event log, notes each communication the moment it is seen complete (after every layer).
  void poll() {
    if (!log_->on()) return;
    auto look = [&](inflight& f) {
      if (f.bucket >= 0 && !f.seen && f.r.test()) {
        f.seen = true;
        (*log_)(event_kind::comm_done, f.bucket);
      }
    };
    for (auto& f : pending_) look(f);
    for (auto& f : reduce_) look(f);
  }
  // Waits for f; later backward passes of ZeRO-2/3 reduced aside and add into the shard here.
  void complete(inflight& f, T* shard_grads = nullptr, const T* aside = nullptr) {
    const int b = f.bucket;
    if (b < 0) return;
    f.r.wait();
    if (shard_grads && backward_index_ > 0) {
      const auto& bk = buckets_[static_cast<std::size_t>(b)];
      for_each_index<Space>(bk.part, add_into<T>{shard_grads + bk.shard_offset, aside + bk.shard_offset});
    }
    if (!f.seen) (*log_)(event_kind::comm_done, b);
    f.bucket = -1;
  }
  // The layer ends its bucket's backward (the bucket's lowest layer): time to reduce it.
  const bucket* ends_bucket(std::size_t layer) const {
    const int b = layer_bucket_[layer];
    if (b < 0 || layer != buckets_[static_cast<std::size_t>(b)].first_layer) return nullptr;
    return &buckets_[static_cast<std::size_t>(b)];
  }
  int bucket_index(const bucket& bk) const { return static_cast<int>(&bk - buckets_.data()); }

  Comm& comm_;
  Net& net_;
  event_log no_log_;
  event_log* log_;
  int ranks_, rank_;
  std::uint64_t seed_;
  std::vector<bucket> buckets_;
  std::vector<int> layer_bucket_;
  std::int64_t shard_ = 0, backward_index_ = 0, target_ = 0;
  int current_ = -1;
  optim::state<Optimizer, Space> state_;
  std::vector<inflight> pending_;  // one per bucket (DDP, ZeRO-1)
  inflight reduce_[2];             // one per staging buffer (ZeRO-2/3)
#if DML_HAS_CUDA
  cudaEvent_t compute_done_ = nullptr;
#endif
};

}  // namespace detail
}  // namespace parallel
}  // namespace dml
