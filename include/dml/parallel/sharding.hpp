// SPDX-License-Identifier: Apache-2.0
// dml/parallel/sharding.hpp — the sharding family: who holds which parameters, gradients and optimizer state.
// Sits on nn/, comm/ and optim/; replicate.hpp and zero.hpp model it, and train/trainer.hpp sequences a model's calls.
//
// A sharding policy P names a class template P::sync<Space, Comm, Optimizer, Precision, Network>: the
// data-parallel state of one rank (buckets, gradients, optimizer state, float master weights) and
// its work: layer hooks that launch bucket reductions during backward, the program's unshard, reduce and
// reshard of each chunk, gradient pieces for tied parameters, the update, and what the rank owns (for
// gradient norms and checkpoints).
#pragma once

#include <concepts>
#include <cstdint>
#include <span>
#include <string>
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
  // How gradients reach the shards. Per micro-batch (false): every backward reduces its buckets as it leaves
  // them (ZeRO-2/3's lowest memory; backward must not be split). Per step (true): backward passes accumulate
  // into whole gradients and a chunk's last pass reduces them once; ZeRO-3 holds a chunk's parameters from
  // its unshard to its reshard. Pipelines and split backward run per step.
  bool per_step = true;
};

// The groups a sharding reduces and gathers over. dense: the data-parallel ranks that shard dense parameters
// (with hybrid sharding, one replica's); expert: the ranks that hold this rank's experts, within the replica
// (null: dense); replicate: the ranks holding the same shard in other replicas (null: one replica).
template <class Comm>
struct shard_groups {
  Comm& dense;
  Comm* expert = nullptr;
  Comm* replicate = nullptr;
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

// What a trainer calls on P::sync<...>; checked where the trainer instantiates it. The program (parallel/
// program.hpp) drives it: unshard(c) before chunk c computes, begin_backward(first) before each backward pass
// given the hooks, reduce(c, final) once the chunk's reductions were launched, reshard(c) after its last
// compute; then gradient pieces for ties, the norm, and the update.
template <class S>
concept sharding_sync = std::derived_from<S, nn::layer_hooks> && requires(S& s, const S& cs, typename S::optimizer_type& o) {
  s.unshard(0);
  s.reshard(0);
  s.begin_backward(true);
  s.reduce(0, true);
  s.grad_piece(std::size_t{0});
  s.update(o, 1.f, std::int64_t{1}, 1.f);
  { s.grad_squared_norm() } -> std::convertible_to<double>;
  { s.has_overflow() } -> std::convertible_to<bool>;
  { s.parameters() } -> std::same_as<std::vector<float>>;
  { cs.memory() } -> std::same_as<memory_report>;
  { cs.owned_pieces() } -> std::same_as<std::vector<owned_piece>>;
  { cs.writes_checkpoint() } -> std::convertible_to<bool>;
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
                "dml: a sharding's sync needs unshard(chunk), reshard(chunk), begin_backward(first), reduce(chunk, "
                "final), grad_piece(slot), update(optimizer&, lr, step, grad_scale), grad_squared_norm(), "
                "has_overflow(), parameters(), memory(), owned_pieces() and writes_checkpoint()");
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

// The names of the parameters that another parameter of the model is tied to.
template <class Model>
std::vector<std::string> tie_targets(const Model& model) {
  std::vector<std::string> out;
  for (const auto& [layer, spec] : model.parameters())
    if (!spec.tied_to.empty()) out.push_back(spec.tied_to);
  return out;
}

// What every bucketed data-parallel sharding keeps: the groups, the network, its buckets and their runs, the
// optimizer state, and the communications in flight.
template <class Space, class Comm, class Optimizer, class Precision, class Net>
class data_parallel : public nn::layer_hooks {
 public:
  using optimizer_type = Optimizer;
  using T = typename Precision::type;
  static constexpr bool mixed = !std::same_as<T, float>;

  data_parallel(shard_groups<Comm> g, Net& net, const sync_options& o)
      : comm_(g.dense), replicate_(g.replicate && g.replicate->size() > 1 ? g.replicate : nullptr), net_(net),
        log_(o.log ? o.log : &no_log_), ranks_(g.dense.size()), rank_(g.dense.rank()), seed_(o.seed),
        per_step_(o.per_step), chunks_(o.chunks.begin(), o.chunks.end()) {
    groups_[0] = &g.dense;
    groups_[1] = g.expert ? g.expert : &g.dense;
    if (!(o.bucket_mb > 0)) fail<invalid_argument>("dml::trainer: expected bucket_mb > 0, found ", o.bucket_mb);
    if (chunks_.empty()) chunks_.push_back({0, net_.depth()});
    target_ = static_cast<std::int64_t>(o.bucket_mb * 1024.0 * 1024.0 / sizeof(float));
    const auto targets = tie_targets(net_.model());
    auto plan = make_buckets(net_.layout(), net_.depth(), target_, ranks(), o.chunks,
                             tied_slots(net_.layout(), targets));
    buckets_ = std::move(plan.buckets);
    layer_bucket_ = std::move(plan.layer_bucket);
    shard_ = plan.shard;
  }
  ~data_parallel() override {
#if DML_HAS_CUDA
    if (compute_done_) cudaEventDestroy(compute_done_);
#endif
  }
  data_parallel(const data_parallel&) = delete;
  data_parallel& operator=(const data_parallel&) = delete;

  std::span<const bucket> buckets() const { return buckets_; }
  // This rank's index in each shard group, and the groups' sizes.
  shard_ranks rank() const { return {groups_[0]->rank(), groups_[1]->rank()}; }
  shard_ranks ranks() const { return {groups_[0]->size(), groups_[1]->size()}; }
  // What this rank owns of every run: its part. Under hybrid sharding the replicas hold equal parts and
  // replica 0 writes checkpoints.
  std::vector<owned_piece> owned_pieces() const { return parallel::owned_pieces(net_.layout(), buckets_, rank()); }
  bool writes_checkpoint() const { return !replicate_ || replicate_->rank() == 0; }
  void begin_pass() { current_ = -1; }
  // Before a backward pass that gets the hooks: first is the chunk's first pass of this kind in the step.
  void begin_backward(bool first) { first_ = first; }
  void unshard(int) {}
  void reshard(int) {}

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
  // The global index of this rank's first row among the `data` ranks (the data-parallel group): ranks pass
  // contiguous slices of the global batch in rank order (train::sampler::slice), so it is the sum of the
  // earlier ranks' row counts; one all_gather, made only for models with a layer that reads it (dropout).
  // Under context parallelism the cp consecutive ranks of a group pass the same rows, which count once.
  std::int64_t first_global_row(Comm& data, std::int64_t rows, int cp = 1) {
    if (!Net::model_type::uses_row_index || data.size() == 1) return 0;
    buffer<std::int64_t, Space> mine(1), all(static_cast<std::size_t>(data.size()));
    dml::copy_n(&rows, 1, mine.data());
    order_after_compute();
    data.all_gather(std::span<const std::int64_t>(mine.data(), 1), all.span());
    std::vector<std::int64_t> counts(all.size());
    dml::copy_n(all.data(), counts.size(), counts.data());
    std::int64_t first = 0;
    for (int r = 0; r < data.rank() / cp * cp; r += cp) first += counts[static_cast<std::size_t>(r)];
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
      Comm* const groups[] = {groups_[0], groups_[1], replicate_};  // an array: nvcc cannot range over a braced list
      for (Comm* c : groups)
        if (c) DML_CHECK_CUDA(cudaStreamWaitEvent(c->stream(), compute_done_, 0));
    }
#endif
  }

 protected:
  // A bucket's communications in flight (one per run).
  struct inflight {
    std::vector<comm::request> r;
    int bucket = -1;
    bool seen = false;  // its completion is already in the event log
    bool test() {
      for (auto& q : r)
        if (!q.test()) return false;
      return true;
    }
  };
  Comm& group(const run& rn) { return *groups_[rn.axis == shard_axis::expert ? 1 : 0]; }
  int rank_in(const run& rn) const { return groups_[rn.axis == shard_axis::expert ? 1 : 0]->rank(); }
  // With an event log, notes each communication the moment it is seen complete (after every layer).
  void poll() {
    if (!log_->on()) return;
    auto look = [&](inflight& f) {
      if (f.bucket >= 0 && !f.seen && f.test()) {
        f.seen = true;
        (*log_)(event_kind::comm_done, f.bucket);
      }
    };
    for (auto& f : pending_) look(f);
    for (auto& f : reduce_) look(f);
  }
  // Waits for f; later backward passes of ZeRO-2/3 reduced aside and add into the shard here.
  void complete(inflight& f, T* shard_grads = nullptr, const T* aside = nullptr, bool add = false) {
    const int b = f.bucket;
    if (b < 0) return;
    for (auto& q : f.r) q.wait();
    f.r.clear();
    if (shard_grads && add)
      for (const auto& rn : buckets_[static_cast<std::size_t>(b)].runs)
        for_each_index<Space>(rn.part, add_into<T>{shard_grads + rn.shard_offset, aside + rn.shard_offset});
    if (!f.seen) (*log_)(event_kind::comm_done, b);
    f.bucket = -1;
  }
  // After the step's reductions of a chunk: hybrid sharding sums the chunk's shard over the replicas.
  void reduce_replicas(int chunk, T* shard_grads) {
    if (!replicate_) return;
    std::int64_t lo = -1, hi = -1;
    for (const auto& bk : buckets_)
      if (chunk_of(bk) == chunk)
        for (const auto& rn : bk.runs) {
          lo = lo < 0 ? rn.shard_offset : std::min(lo, rn.shard_offset);
          hi = std::max(hi, rn.shard_offset + rn.part);
        }
    if (lo < 0 || hi <= lo) return;
    order_after_compute();
    replicate_->all_reduce(std::span<T>(shard_grads + lo, static_cast<std::size_t>(hi - lo)), comm::reduce_op::sum);
  }
  int chunk_of(const bucket& bk) const {
    for (std::size_t c = 0; c < chunks_.size(); ++c)
      if (chunks_[c].contains(bk.first_layer)) return static_cast<int>(c);
    return 0;
  }
  // The layer ends its bucket's backward (the bucket's lowest layer): time to reduce it.
  const bucket* ends_bucket(std::size_t layer) const {
    const int b = layer_bucket_[layer];
    if (b < 0 || layer != buckets_[static_cast<std::size_t>(b)].first_layer) return nullptr;
    return &buckets_[static_cast<std::size_t>(b)];
  }
  int bucket_index(const bucket& bk) const { return static_cast<int>(&bk - buckets_.data()); }
  // The run holding slot s (ties: a run alone).
  const run& run_of(std::size_t s) const {
    for (const auto& bk : buckets_)
      for (const auto& rn : bk.runs)
        if (rn.first_slot <= s && s < rn.end_slot) return rn;
    fail<invalid_argument>("dml::parallel: slot ", s, " lies in no bucket");
  }

  Comm& comm_;
  Comm* groups_[2]{};
  Comm* replicate_ = nullptr;
  Net& net_;
  event_log no_log_;
  event_log* log_;
  int ranks_, rank_;
  std::uint64_t seed_;
  bool per_step_ = true, first_ = true;
  std::vector<nn::layer_range> chunks_;
  std::vector<bucket> buckets_;
  std::vector<int> layer_bucket_;
  std::int64_t shard_ = 0, target_ = 0;
  int current_ = -1;
  optim::state<Optimizer, Space> state_;
  std::vector<inflight> pending_;  // one per bucket (DDP, ZeRO-1, and every stage per step)
  inflight reduce_[2];             // one per staging buffer (ZeRO-2/3 per micro-batch)
#if DML_HAS_CUDA
  cudaEvent_t compute_done_ = nullptr;
#endif
};

}  // namespace detail
}  // namespace parallel
}  // namespace dml
