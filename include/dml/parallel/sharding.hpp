// SPDX-License-Identifier: Apache-2.0
// dml/parallel/sharding.hpp — the sharding family: who holds which parameters, gradients and optimizer state.
// Sits on nn/, comm/ and optim/; replicate.hpp and zero.hpp model it, and train/trainer.hpp sequences a model's calls.
//
// A sharding policy P names a class template P::sync<Space, Comm, Optimizer, Precision, Network>: the
// data-parallel state of one rank (buckets, gradients, optimizer state, float master weights) and
// its work: layer hooks that launch bucket reductions during backward, the program's unshard, reduce and
// reshard of each chunk, gradient pieces for tied parameters, the update, and what the rank owns (for
// gradient norms and checkpoints). sharding_sync below is that whole contract, in named parts.
#pragma once

#include <concepts>
#include <cstdint>
#include <cstdio>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/core/cast.hpp"
#include "dml/nn/network.hpp"
#include "dml/optim/clip.hpp"
#include "dml/optim/loss_scaler.hpp"
#include "dml/optim/optimizer.hpp"
#include "dml/parallel/buckets.hpp"
#include "dml/parallel/compressed.hpp"
#include "dml/parallel/events.hpp"
#include "dml/parallel/master_weights.hpp"
#include "dml/parallel/offload.hpp"
#include "dml/parallel/ownership.hpp"

namespace dml {

struct sharding_family {};

namespace parallel {

// Per-rank bytes of model state, computed from the sizes the sharding allocates.
struct memory_report {
  std::int64_t numel = 0;        // Ψ: parameters of the model (of this pipeline stage)
  std::int64_t padded = 0;       // parameters including padding to equal, aligned per-rank parts
  std::int64_t params = 0, grads = 0, optimizer = 0;  // bytes held for the whole run
  std::int64_t buffers = 0;      // bytes of staging and gather buffers (ZeRO-2/3)
  std::int64_t offloaded = 0;    // bytes of optimizer state on disk (offload); not part of total()
  // Bytes of activations at the last step's peak: layer outputs and what layers keep for backward, of every
  // micro-batch in flight (filled by the trainer; not part of total(), which is the model state).
  std::int64_t activations = 0;
  // Bytes of activation storage this rank keeps between steps (filled by the trainer): the sets' tensors stay
  // allocated for the next step, as many as the schedule has in flight at once.
  std::int64_t activations_held = 0;
  // Bytes of dml buffers the trainer holds, counted as they are allocated and freed (core/buffer.hpp's
  // memory_account; filled by the trainer): now, and at the most since it was constructed (the high-water mark).
  // Model state, activation storage and the network's workspaces; not the communicator's or a GEMM library's own.
  std::int64_t allocated = 0, allocated_peak = 0;
  // Bytes of host memory a device trainer's checkpoint saves write from (a copy of this rank's pieces, kept for the
  // next save; filled by the trainer; a host trainer writes its memory in place). Outside dml's buffers: not in
  // allocated.
  std::int64_t checkpoint_staging = 0;
  std::int64_t total() const { return params + grads + optimizer + buffers; }
  // Every category in MiB and their high-water mark: "params 1.23 MiB, grads ..., activations at peak ..., workspace
  // and transients ...; total=... MiB" (the workspace is what the high-water mark holds beyond the categories).
  std::string by_category() const {
    const auto mib = [](std::int64_t b) { return static_cast<double>(b) / 1048576.0; };
    char line[256];
    std::snprintf(line, sizeof line,
                  "params %.2f MiB, grads %.2f, optimizer %.2f, buffers %.2f, activations at peak %.2f, workspace and "
                  "transients %.2f; total=%.2f MiB",
                  mib(params), mib(grads), mib(optimizer), mib(buffers), mib(activations),
                  mib(allocated_peak - (params + grads + optimizer + buffers + activations)), mib(allocated_peak));
    if (checkpoint_staging == 0) return line;
    char staging[96];
    std::snprintf(staging, sizeof staging, "; checkpoint staging %.2f MiB (host, outside the total)",
                  mib(checkpoint_staging));
    return std::string(line) + staging;
  }
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
  gradient_compression compress{};  // none: dense reductions; else compressed with error feedback (fp32, host)
  offload_options offload{};  // optimizer state on disk (dir set) instead of memory
  // Steps as transactions (trainer_options::commit): nothing after the vote may wait for a peer, so ZeRO-1/2
  // gather the updated parts before the next pass instead of after the update (settle()).
  bool defer_gather = false;
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

// ---- The sync: S = P::sync<Space, Comm, Optimizer, Precision, Net>, one per rank, is the whole contract the
// trainer (train/trainer.hpp) and checkpoints (train/checkpoint_io.hpp) use; a sharding written against these
// parts alone works with every schedule and layout the trainer runs (examples/learn/09_custom_sharding.cpp).
// The trainer asks sync_setup before building the network, builds S (sync_construction), then runs each
// step's program (parallel/program.hpp): begin_pass before every compute pass; unshard(c) before chunk c's
// first compute and reshard(c) after its last; begin_backward(first) before a backward pass that gets the
// hooks; reduce(c, final) once the chunk's reductions were launched; grad_piece for tied parameters; then
// grad_squared_norm, has_overflow and update. "Owns" below: what a rank counts and writes, so that over the
// world each element counts once (DESIGN.md §9, ownership).

// How the network is laid out for S; static, asked before S and the network exist.
template <class S>
concept sync_setup = requires(int ranks, bool per_step) {
  // true: S can take gradients per micro-batch (each backward hands them over as it leaves a bucket), and the
  // trainer lets it where the program allows (one stage, backward not split); false: once per step.
  { S::streams_gradients } -> std::convertible_to<bool>;
  // The network's alignment and whether it owns parameters and gradients (else S points each slot at its own
  // storage), for `ranks` ranks in the shard group; per_step: how this run hands gradients over.
  { S::network_options(ranks, per_step) } -> std::convertible_to<nn::network_options>;
};

// S(groups, net, options): the groups to reduce over, the network (whose layout is S's flat index space) and
// sync_options (chunks, per_step, seed, bucket size, event log). Once per trainer, before the first step.
template <class S, class Comm, class Net>
concept sync_construction = std::constructible_from<S, shard_groups<Comm>, Net&, const sync_options&>;

// Where parameters are whole while layers compute (ZeRO-3 gathers them; others hold them whole already).
template <class S>
concept sync_residency = requires(S& s, int chunk) {
  s.begin_pass();     // before every forward or backward pass (and correct()'s forward)
  s.unshard(chunk);   // before chunk's first compute of the step: its parameters must be readable
  s.reshard(chunk);   // after chunk's last compute of the step: S may free what unshard gathered
};

// Gradients from backward to where the update reads them. S is the backward's nn::layer_hooks (before_forward,
// before_backward, after_backward per layer): it may launch reductions while backward runs.
template <class S>
concept sync_gradients = std::derived_from<S, nn::layer_hooks> &&
                         requires(S& s, bool first, int chunk, bool last, std::size_t slot) {
  s.begin_backward(first);  // before a backward pass that gets the hooks; first: the chunk's first of the step
  s.reduce(chunk, last);    // complete the chunk's reductions; last: the chunk's final reduce of the step
  // After the reductions: the gradient elements of a slot this rank holds, as a span of the working type in
  // the trainer's space (tied parameters sum their copies' pieces in place).
  s.grad_piece(slot).data();
  s.grad_piece(slot).size();
};

// The step's tail, after every reduction and tie sum.
template <class S>
concept sync_update = requires(S& s, typename S::optimizer_type& o, float lr, std::int64_t step, float scale,
                               const std::vector<bool>& skip) {
  // Squared norm of the gradients this rank owns, leaving out slots with skip[slot] (counted on another rank).
  { s.grad_squared_norm(skip) } -> std::convertible_to<double>;
  { s.has_overflow() } -> std::convertible_to<bool>;  // a non-finite gradient this rank holds (fp16)
  // One optimizer step (the step-th applied) over what this rank updates: gradients times grad scale.
  s.update(o, lr, step, scale);
};

// The parameters and memory as the trainer reports and sets them.
template <class S>
concept sync_state = requires(S& s, const S& cs, std::span<const float> full) {
  { s.parameters() } -> std::same_as<std::vector<float>>;  // every float parameter of the layout (collective)
  s.load_parameters(full);                                 // the reverse, also rewriting the working copy
  s.refresh_working();  // the float parameters changed outside an update (a checkpoint load): recast them
  { cs.memory() } -> std::same_as<memory_report>;          // bytes held, from allocated sizes
  { cs.buckets() } -> std::convertible_to<std::span<const bucket>>;  // its gradient buckets (may be none)
};

// Checkpoints: each rank writes what it owns; reading fills what the layout holds, by pieces or whole.
template <class S>
concept sync_checkpoint = requires(S& s, const S& cs, int k, const owned_piece& piece) {
  { cs.owned_pieces() } -> std::same_as<std::vector<owned_piece>>;  // the elements this rank owns
  { cs.writes_checkpoint() } -> std::convertible_to<bool>;          // false: this rank writes nothing
  // k = −1: the float parameters; k ≥ 0: optimizer state slot k.
  { s.held(k, piece) } -> std::same_as<float*>;         // where the piece's first element lives
  { s.loads_pieces(k) } -> std::convertible_to<bool>;   // true: read owned pieces; false: read whole(k)
  { s.whole(k) } -> std::same_as<float*>;               // every element of the layout (when not by pieces)
};

template <class S>
concept sharding_sync = sync_setup<S> && sync_residency<S> && sync_gradients<S> && sync_update<S> &&
                        sync_state<S> && sync_checkpoint<S>;

// static_assert(diagnose_sharding_sync<S, Comm, Net>()) names each missing part and its members (construction
// only when Comm and Net are given).
template <class S, class Comm = void, class Net = void>
consteval bool diagnose_sharding_sync() {
  if constexpr (!std::is_void_v<Comm>)
    static_assert(sync_construction<S, Comm, Net>,
                  "dml: a sharding's sync needs (sync_construction) a constructor "
                  "`sync(dml::parallel::shard_groups<Comm>, Net&, const dml::parallel::sync_options&)`");
  static_assert(sync_setup<S>, "dml: a sharding's sync needs (sync_setup) `static constexpr bool streams_gradients` "
                               "and `static dml::nn::network_options network_options(int ranks, bool per_step)`");
  static_assert(sync_residency<S>, "dml: a sharding's sync needs (sync_residency) `void begin_pass()`, "
                                   "`void unshard(int chunk)` and `void reshard(int chunk)`");
  static_assert(sync_gradients<S>,
                "dml: a sharding's sync needs (sync_gradients) to derive from `dml::nn::layer_hooks`, and "
                "`void begin_backward(bool first)`, `void reduce(int chunk, bool final)` and "
                "`dml::span_in<T, Space> grad_piece(std::size_t slot)`");
  static_assert(sync_update<S>,
                "dml: a sharding's sync needs (sync_update) `using optimizer_type = Optimizer`, "
                "`double grad_squared_norm(const std::vector<bool>& skip)`, `bool has_overflow()` and "
                "`void update(Optimizer&, float lr, std::int64_t step, float grad_scale)`");
  static_assert(sync_state<S>,
                "dml: a sharding's sync needs (sync_state) `std::vector<float> parameters()`, "
                "`void load_parameters(std::span<const float>)`, `void refresh_working()`, "
                "`dml::parallel::memory_report memory() const` and "
                "`std::span<const dml::parallel::bucket> buckets() const`");
  static_assert(sync_checkpoint<S>,
                "dml: a sharding's sync needs (sync_checkpoint) `std::vector<dml::parallel::owned_piece> "
                "owned_pieces() const`, `bool writes_checkpoint() const`, "
                "`float* held(int k, const dml::parallel::owned_piece&)`, `bool loads_pieces(int k)` and "
                "`float* whole(int k)`");
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
        per_step_(o.per_step), chunks_(o.chunks.begin(), o.chunks.end()), offload_(o.offload) {
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
    if (o.compress.on()) {
      if constexpr (!std::same_as<Space, host> || mixed)
        fail<invalid_argument>("dml::trainer: compress ", o.compress.name(),
                               " expected fp32 gradients on dml::host, found another precision or space");
      compressor_ = compressed_reducer(o.compress, static_cast<std::size_t>(net_.layout().total),
                                       static_cast<std::size_t>(shard_));
      compress_ = true;
    }
  }
  ~data_parallel() override = default;
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
  // Bytes this rank has sent for gradient reductions since construction, and what dense ones would send.
  wire_bytes gradient_bytes() const {
    if (compress_) return compressor_.bytes();
    return {dense_bytes_, dense_bytes_};
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
  // Dense reductions count what a ring sends: (N-1)/N of the run per pass, two passes for an all-reduce.
  void count_dense(const run& rn, int passes) {
    const std::int64_t n = group(rn).size();
    dense_bytes_ += passes * static_cast<std::int64_t>(sizeof(T)) * (rn.hi - rn.lo) / n * (n - 1);
  }
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
    replicate_->all_reduce(span_in<T, Space>(shard_grads + lo, static_cast<std::size_t>(hi - lo)), comm::reduce_op::sum);
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
  offload_options offload_;
  optimizer_state<Optimizer, Space> state_;  // in memory, or on disk with offload_.dir set
  std::vector<inflight> pending_;  // one per bucket (DDP, ZeRO-1, and every stage per step)
  inflight reduce_[2];             // one per staging buffer (ZeRO-2/3 per micro-batch)
  bool compress_ = false;          // reductions go through compressor_ (blocking, at the bucket's end)
  compressed_reducer compressor_;
  std::int64_t dense_bytes_ = 0;
};

}  // namespace detail
}  // namespace parallel
}  // namespace dml
