// SPDX-License-Identifier: Apache-2.0
// dml/parallel/zero.hpp — ZeRO stages 1–3: optimizer state, then gradients, then parameters sharded over the ranks;
// and hybrid sharding: shard within a replica, replicate across replicas (HSDP, MiCS).
// Sits on parallel/sharding.hpp. Every run of a bucket splits into one equal part per rank of its group and a
// rank's shard is its part of every run. Per step (pipelines, split backward) every stage accumulates whole
// gradients and reduce-scatters each bucket at its chunk's last backward, and stage 3 gathers a chunk's
// parameters at its unshard and frees them at its reshard. Per micro-batch (one stage) stages 2 and 3 reduce
// each bucket from a staging buffer as backward leaves it, and stage 3 gathers each bucket's parameters
// before use, two buckets at a time.
#pragma once

#include <array>
#include <span>
#include <vector>

#include "dml/optim/layerwise.hpp"
#include "dml/parallel/sharding.hpp"

namespace dml::parallel {

namespace detail {

template <int Stage, class Space, class Comm, class Optimizer, class Precision, class Net>
class zero_sync final : public data_parallel<Space, Comm, Optimizer, Precision, Net> {
  using base = data_parallel<Space, Comm, Optimizer, Precision, Net>;
  using typename base::T;
  using base::net_, base::state_, base::pending_, base::reduce_, base::log_, base::mixed, base::buckets_,
      base::layer_bucket_, base::shard_, base::current_, base::per_step_;
  // Where the float parameters live: a shard (ZeRO-3, and every mixed stage, whose master weights are
  // sharded with the optimizer state), or the network itself (fp32 stages 1 and 2).
  static constexpr bool sharded_master = Stage == 3 || mixed;

 public:
  static constexpr bool streams_gradients = Stage >= 2;  // per micro-batch where the program allows it
  static nn::network_options network_options(int ranks, bool per_step) {
    return {.alignment = nn::param_layout::alignment * ranks, .own_params = Stage < 3,
            .own_grads = Stage < 2 || per_step, .layers = {}};
  }

  zero_sync(shard_groups<Comm> g, Net& net, const sync_options& o) : base(g, net, o), defer_gather_(o.defer_gather && Stage < 3) {
    shard_grads_.resize(static_cast<std::size_t>(shard_));
    state_.resize(shard_, this->offload_);
    std::int64_t widest = 0;
    for (const auto& b : buckets_) widest = std::max(widest, b.hi - b.lo);
    if (streams())
      for (auto& s : staging_) s.resize(static_cast<std::size_t>(widest));
    if (Stage == 3 && !per_step_)
      for (auto& s : gathered_) s.resize(static_cast<std::size_t>(widest));
    if constexpr (sharded_master) {
      if (!state_.holds_master()) shard_params_.resize(static_cast<std::size_t>(shard_));
      for (const auto& bk : buckets_)  // master weights on disk: written out by the first update
        for (const auto& rn : bk.runs) init_master_part(net_, this->seed_, rn, this->rank_in(rn), shard_master());
    }
    if constexpr (mixed && Stage == 3) {
      shard_working_.resize(static_cast<std::size_t>(shard_));
      cast_n<Space>(shard_master(), shard_working_.data(), shard_);
    }
    resident_chunks_.resize(this->chunks_.size());
  }

  // ---- the program: ZeRO-3 per step holds a chunk's parameters from unshard to reshard.
  void unshard(int c) {
    if constexpr (Stage == 3) {
      if (!per_step_) return;
      const auto [lo, hi] = chunk_range(c);
      if (hi <= lo) return;
      auto& at = resident_chunks_[static_cast<std::size_t>(c)];
      at.resize(static_cast<std::size_t>(hi - lo));
      resident_bytes_ += (hi - lo) * static_cast<std::int64_t>(sizeof(T));
      peak_resident_ = std::max(peak_resident_, resident_bytes_);
      std::vector<comm::request> rs;
      for (const auto& bk : buckets_)
        if (this->chunk_of(bk) == c)
          for (const auto& rn : bk.runs)
            rs.push_back(this->group(rn).iall_gather(span_in<const T, Space>(working_shard() + rn.shard_offset, rn.part),
                                                     span_in<T, Space>(at.data() + (rn.lo - lo), rn.hi - rn.lo)));
      for (auto& r : rs) r.wait();
      const auto& L = net_.layout();
      for (std::size_t s = 0; s < L.slots.size(); ++s)
        if (L.slots[s].offset >= lo && L.slots[s].offset < hi) net_.set_param_pointer(s, at.data() + (L.slots[s].offset - lo));
    }
  }
  void reshard(int c) {
    if constexpr (Stage == 3) {
      if (!per_step_) return;
      auto& at = resident_chunks_[static_cast<std::size_t>(c)];
      resident_bytes_ -= static_cast<std::int64_t>(at.size() * sizeof(T));
      at = buffer<T, Space>();
    }
  }

  // Before every pass: deferred gathers (stages 1 and 2 under steps as transactions) complete the parameters.
  void begin_pass() {
    settle();
    base::begin_pass();
  }
  // Stages 1 and 2 under steps as transactions: after an update (or a restore) every rank's own parts are current
  // and the others' are not until this gathers them. A collective: every rank of the shard group calls it.
  void settle() {
    if (!gather_pending_) return;
    for (const auto& bk : buckets_)
      for (const auto& rn : bk.runs) gather_run(rn);
    gather_pending_ = false;
  }

  // ---- hooks: per micro-batch, stage 3 gathers parameters around each bucket; every stage launches bucket
  // reductions (the program hands the hooks to the backward passes that reduce).
  void before_forward(std::size_t layer) override {
    if constexpr (Stage == 3) {
      if (per_step_) return;
      const int b = layer_bucket_[layer];
      if (b < 0 || b == current_) return;
      current_ = b;
      ensure_gathered(b);
      prefetch(b - 1);  // forward walks buckets from the last index down
    }
  }
  void before_backward(std::size_t layer) override {
    if (per_step_) return;
    const int b = layer_bucket_[layer];
    if (b < 0 || layer != buckets_[static_cast<std::size_t>(b)].last_layer) return;
    if constexpr (Stage == 3) {
      current_ = b;
      ensure_gathered(b);
      prefetch(b + 1);  // backward walks buckets upwards
    }
    if (streams()) {
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
    typename base::inflight f{.r = {}, .bucket = b, .seen = false};
    if (!streams()) {  // whole gradients: each run's part lands in the shard
      for (const auto& rn : bk->runs) {
        this->count_dense(rn, 1);
        if (compressed(rn, net_.grads().data() + rn.lo, shard_grads_.data() + rn.shard_offset)) continue;
        f.r.push_back(this->group(rn).ireduce_scatter(span_in<const T, Space>(net_.grads().data() + rn.lo, rn.hi - rn.lo),
                                                      span_in<T, Space>(shard_grads_.data() + rn.shard_offset, rn.part),
                                                      comm::reduce_op::sum));
      }
      pending_.push_back(std::move(f));
      return;
    }
    const auto slot = static_cast<std::size_t>(b % 2);
    T* out = shard_grads_.data();
    if (!this->first_) {  // later backward passes reduce aside and add into the shard when done
      shard_tmp_.resize(static_cast<std::size_t>(shard_));
      out = shard_tmp_.data();
    }
    for (const auto& rn : bk->runs) {
      this->count_dense(rn, 1);
      if (compressed(rn, staging_[slot].data() + (rn.lo - bk->lo), out + rn.shard_offset)) continue;
      f.r.push_back(this->group(rn).ireduce_scatter(span_in<const T, Space>(staging_[slot].data() + (rn.lo - bk->lo), rn.hi - rn.lo),
                                                    span_in<T, Space>(out + rn.shard_offset, rn.part), comm::reduce_op::sum));
    }
    reduce_[slot] = std::move(f);
  }
  // Waits for the reductions in flight; the chunk's last (final) one sums its shard over the replicas.
  void reduce(int c, bool final) {
    for (auto& f : pending_) this->complete(f);
    pending_.clear();
    for (auto& f : reduce_) complete_reduce(f);
    current_ = -1;
    if (final) this->reduce_replicas(c, shard_grads_.data());
  }
  // This rank's part of slot s's run (a tied slot is a run alone, so both copies' parts cover the same elements).
  span_in<T, Space> grad_piece(std::size_t s) {
    const auto& rn = this->run_of(s);
    return {shard_grads_.data() + rn.shard_offset, static_cast<std::size_t>(rn.part)};
  }

  // The squares of what this rank owns, but slots with skip[s] set (a tensor rank's copy of a parameter that
  // tensor rank 0 counts, a tied copy): summed over the world, each element counts once (replicas but the first
  // count nothing).
  double grad_squared_norm(const std::vector<bool>& skip = {}) {
    if (!this->writes_checkpoint()) return 0;
    double n = 0;
    for (const auto& p : this->owned_pieces())
      if (skip.empty() || !skip[p.slot]) n += optim::squared_norm<Space>(shard_grads_.data() + p.shard, p.end - p.begin);
    return n;
  }
  bool has_overflow() const { return optim::has_nonfinite<Space>(shard_grads_.data(), shard_); }

  // One fused pass per range: unscale and clip, the update of the float weights, and under mixed
  // precision the cast into the working copy; stages 1 and 2 then gather every run's parts.
  void update(Optimizer& opt, float lr, std::int64_t t, float grad_scale) {
    if constexpr (optim::layerwise_v<Optimizer>) {
      if (optim::uses_layerwise(opt)) return update_layerwise(opt, lr, t, grad_scale);
    }
    state_.begin_step();
    if constexpr (Stage == 3) {
      optim::step_args a{.n = shard_, .w = update_master(0), .g = shard_grads_.data(), .step = t, .lr = lr,
                         .grad_scale = grad_scale};
      if constexpr (mixed) a.working = shard_working_.data();
      state_.update(opt, a, 0);
      resident_ = {-1, -1};  // gathered copies are stale now
    } else {
      for (const auto& bk : buckets_)
        for (const auto& rn : bk.runs) {
          T* w = net_.params().data() + rn.lo;
          const std::int64_t mine = this->rank_in(rn) * rn.part;
          optim::step_args a{.n = rn.part, .g = shard_grads_.data() + rn.shard_offset, .step = t, .lr = lr,
                             .grad_scale = grad_scale};
          if constexpr (mixed) {
            a.w = update_master(rn.shard_offset);  // float master shard
            a.working = w + mine;
          } else {
            a.w = w + mine;
          }
          state_.update(opt, a, rn.shard_offset);
          gather_updated(rn);
        }
    }
    state_.end_step();
  }
  // Layer-wise optimizers (LAMB, LARS): a tensor may straddle shards, so each rank adds its pieces' sums, one
  // all-reduce of 2 × tensors doubles over the shard group completes them, and the update follows (stages 1 and
  // 2 then gather as above). Replicas hold the same shards, so the shard group is enough.
  void update_layerwise(Optimizer& opt, float lr, std::int64_t t, float grad_scale) {
    if (layerwise_pieces_.empty()) layerwise_pieces_ = pieces_by_run();
    std::vector<double> sums(2 * net_.layout().slots.size(), 0.0);
    std::size_t k = 0;
    for (const auto& bk : buckets_)
      for (const auto& rn : bk.runs) opt.template prepare<Space>(run_args(rn, lr, t, grad_scale), layerwise_pieces_[k++], sums.data());
    (*log_)(event_kind::norm_reduce);
    if (this->comm_.size() > 1) comm::all_reduce_host(this->comm_, std::span<double>(sums), comm::reduce_op::sum);
    k = 0;
    for (const auto& bk : buckets_)
      for (const auto& rn : bk.runs) {
        opt.template apply<Space>(run_args(rn, lr, t, grad_scale), layerwise_pieces_[k++], sums.data());
        if constexpr (Stage < 3) gather_updated(rn);
      }
    if constexpr (Stage == 3) resident_ = {-1, -1};
  }

  std::vector<float> parameters() {
    const auto total = static_cast<std::size_t>(net_.layout().total);
    std::vector<float> full(total);
    if constexpr (sharded_master) {
      buffer<float, Space> gathered(total);  // collectives work in the trainer's space
      fill_n<Space>(gathered.data(), net_.layout().total, 0.f);
      for (const auto& bk : buckets_)
        for (const auto& rn : bk.runs)
          this->group(rn).all_gather(span_in<const float, Space>(shard_master() + rn.shard_offset, rn.part),
                                     span_in<float, Space>(gathered.data() + rn.lo, rn.hi - rn.lo));
      dml::copy_n(gathered.data(), total, full.data());
    } else {
      settle();
      dml::copy_n(net_.params().data(), total, full.data());
    }
    return full;
  }
  void load_parameters(std::span<const float> full) {
    if constexpr (sharded_master) {
      for (const auto& bk : buckets_)
        for (const auto& rn : bk.runs)
          dml::copy_n(full.data() + rn.lo + this->rank_in(rn) * rn.part, static_cast<std::size_t>(rn.part),
                      shard_master() + rn.shard_offset);
    } else {
      dml::copy_n(full.data(), full.size(), net_.params().data());
    }
    refresh_working();
  }
  // After the float parameters changed outside an update (load, restore): rewrite the working copy from them.
  // Under steps as transactions a restored snapshot's other parts may predate its step (taken while a gather was
  // pending): the next pass gathers them, so that a restore waits for no peer.
  void refresh_working() {
    resident_ = {-1, -1};  // gathered copies are stale now
    if constexpr (mixed && Stage == 3) {
      cast_n<Space>(shard_master(), shard_working_.data(), shard_);
    } else if constexpr (mixed) {  // cast this rank's parts, then gather every part
      for (const auto& bk : buckets_)
        for (const auto& rn : bk.runs) {
          cast_n<Space>(shard_master() + rn.shard_offset, net_.params().data() + rn.lo + this->rank_in(rn) * rn.part, rn.part);
          gather_updated(rn);
        }
    } else if (defer_gather_) {
      gather_pending_ = true;
    }
  }

  // Bytes held for the run, and at their peak the transient ones: staging and gather buffers per micro-batch;
  // per step, whole gradients for the step (ZeRO-1's), and under stage 3 the parameters of the chunks resident
  // at once (one chunk per rank without interleaving).
  memory_report memory() const {
    const auto& L = net_.layout();
    const std::int64_t w = sizeof(T), f = sizeof(float);
    memory_report m{.numel = L.numel, .padded = L.total};
    m.params = (Stage == 3 ? shard_ : L.total) * w;  // the working copy (fp32: the only copy)
    // Streaming, the reduced shard alone; else whole gradients and the shard they reduce into.
    m.grads = (streams() ? shard_ : L.total + shard_) * w;
    // Optimizer state, and under mixed precision the float master weights that go with it.
    m.optimizer = state_.bytes() + (mixed ? static_cast<std::int64_t>(shard_params_.size()) * f : 0);
    m.offloaded = state_.disk_bytes();
    m.buffers = static_cast<std::int64_t>((staging_[0].size() + staging_[1].size() + gathered_[0].size() +
                                           gathered_[1].size() + shard_tmp_.size()) * sizeof(T)) +
                (Stage == 3 && per_step_ ? std::max(peak_resident_, resident_peak_estimate()) : 0);
    return m;
  }

  // Checkpoints: a rank writes and reads its part of every run (fp32 stages 1 and 2 hold whole
  // parameters, so they read those whole).
  float* held(int k, const owned_piece& p) {
    if (k >= 0) return state_.slot(k).data() + p.shard;
    if constexpr (sharded_master) return shard_master() + p.shard;
    else return net_.params().data() + p.flat;
  }
  static constexpr bool loads_pieces(int k) { return k >= 0 || sharded_master; }
  float* whole(int) {
    if constexpr (sharded_master) return nullptr;  // never asked: everything loads by pieces
    else return net_.params().data();
  }

 private:
  bool streams() const { return Stage >= 2 && !per_step_; }
  // The step's view of this rank's part of run rn (what update passes per run).
  optim::step_args run_args(const run& rn, float lr, std::int64_t t, float grad_scale) {
    optim::step_args a{.n = rn.part, .g = shard_grads_.data() + rn.shard_offset, .step = t, .lr = lr,
                       .grad_scale = grad_scale};
    run_state_.assign(state_.pointers(), state_.pointers() + Optimizer::state_slots);
    for (auto& p : run_state_) p += rn.shard_offset;
    a.state = run_state_.data();
    if constexpr (Stage == 3) {
      a.w = shard_params_.data() + rn.shard_offset;
      if constexpr (mixed) a.working = shard_working_.data() + rn.shard_offset;
    } else {
      T* w = net_.params().data() + rn.lo + this->rank_in(rn) * rn.part;
      if constexpr (mixed) {
        a.w = shard_params_.data() + rn.shard_offset;  // float master shard
        a.working = w;
      } else {
        a.w = w;
      }
    }
    return a;
  }
  // Per run, the pieces of the tensors in this rank's part (relative to the part), as owned_pieces cuts them.
  std::vector<std::vector<optim::tensor_piece>> pieces_by_run() const {
    if (this->groups_[1] != this->groups_[0])
      fail<invalid_argument>("dml::parallel::zero<", Stage, ">: layer-wise optimizers (lamb, lars) need one shard "
                             "group, found expert parallelism");
    const auto& L = net_.layout();
    std::vector<std::vector<optim::tensor_piece>> out;
    for (const auto& bk : buckets_)
      for (const auto& rn : bk.runs) {
        auto& v = out.emplace_back();
        const std::int64_t p0 = rn.lo + this->rank_in(rn) * rn.part, p1 = p0 + rn.part;
        for (std::size_t s = rn.first_slot; s < rn.end_slot; ++s) {
          const auto& sl = L.slots[s];
          const std::int64_t b = std::max(sl.offset, p0), e = std::min(sl.offset + sl.shape.numel(), p1);
          if (b < e) v.push_back({b - p0, e - p0, static_cast<std::int64_t>(s), sl.shape.rank > 1});
        }
      }
    return out;
  }
  // With compression on, reduces run rn's gradients at src into its part at dst now (blocking) and says so.
  bool compressed(const run& rn, const T* src, T* dst) {
    if constexpr (std::same_as<T, float> && std::same_as<Space, host>) {
      if (!this->compress_) return false;
      this->compressor_.reduce_scatter(this->group(rn), std::span<const float>(src, static_cast<std::size_t>(rn.hi - rn.lo)),
                                       static_cast<std::size_t>(rn.lo), std::span<float>(dst, static_cast<std::size_t>(rn.part)));
      return true;
    } else {
      return false;
    }
  }
  void complete_reduce(typename base::inflight& f) {
    if (streams()) this->complete(f, shard_grads_.data(), shard_tmp_.data(), !this->first_);
  }
  // The flat range of chunk c's parameters.
  std::pair<std::int64_t, std::int64_t> chunk_range(int c) const {
    const auto& L = net_.layout();
    const auto r = this->chunks_[static_cast<std::size_t>(c)];
    const std::size_t s0 = L.first_slot[r.first], s1 = L.first_slot[r.end];
    if (s0 == s1) return {0, 0};
    return {L.slots[s0].offset, s1 < L.slots.size() ? L.slots[s1].offset : L.total};
  }
  // Before the first step: the largest chunk, which a step will hold resident.
  std::int64_t resident_peak_estimate() const {
    std::int64_t most = 0;
    for (std::size_t c = 0; c < this->chunks_.size(); ++c) {
      const auto [lo, hi] = chunk_range(static_cast<int>(c));
      most = std::max(most, hi - lo);
    }
    return most * static_cast<std::int64_t>(sizeof(T));
  }
  // The shard's float weights: here, or under mixed precision maybe read in from the offload files.
  float* shard_master() { return state_.holds_master() ? state_.master() : shard_params_.data(); }
  // What an update's step_args::w points to at this shard offset: nothing when the master weights are on disk
  // (the update reads them from the files).
  float* update_master(std::int64_t at) { return state_.holds_master() ? nullptr : shard_params_.data() + at; }
  // ZeRO-3 gathers the working copy of the shard (the float master itself in fp32).
  const T* working_shard() const {
    if constexpr (mixed) return shard_working_.data();
    else return shard_params_.data();
  }
  // Stages 1 and 2: every rank of run rn's group gets the others' updated parts, now, or under steps as
  // transactions before the next pass (settle()).
  void gather_updated(const run& rn) {
    if (defer_gather_) gather_pending_ = true;
    else gather_run(rn);
  }
  void gather_run(const run& rn) {  // in place: this rank's part is at rank·part
    this->group(rn).all_gather(span_in<T, Space>(net_.params().data() + rn.lo, rn.hi - rn.lo));
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
    gather_req_[slot].clear();
    for (const auto& rn : bk.runs) {
      auto send = span_in<const T, Space>(working_shard() + rn.shard_offset, rn.part);
      auto recv = span_in<T, Space>(gathered_[slot].data() + (rn.lo - bk.lo), rn.hi - rn.lo);
      if (async) gather_req_[slot].push_back(this->group(rn).iall_gather(send, recv));
      else this->group(rn).all_gather(send, recv);
    }
    resident_[slot] = b;
  }
  void wait_gather(std::size_t slot) {
    for (auto& r : gather_req_[slot]) r.wait();
    gather_req_[slot].clear();
  }
  void ensure_gathered(int b) {
    const auto slot = static_cast<std::size_t>(b % 2);
    if (resident_[slot] == b) wait_gather(slot);
    else gather(b, false);
    point_params(b);
  }
  void prefetch(int b) {
    if (b < 0 || b >= static_cast<int>(buckets_.size())) return;
    const auto slot = static_cast<std::size_t>(b % 2);
    if (resident_[slot] == b) return;
    wait_gather(slot);
    gather(b, true);
  }

  buffer<float, Space> shard_params_;  // float weights of the shard (stage 3, and mixed stages unless on disk)
  buffer<T, Space> shard_grads_, shard_tmp_, shard_working_;
  buffer<T, Space> staging_[2], gathered_[2];
  std::array<int, 2> resident_{-1, -1};
  std::vector<comm::request> gather_req_[2];
  std::vector<buffer<T, Space>> resident_chunks_;  // per step: each chunk's parameters while resident
  std::int64_t resident_bytes_ = 0, peak_resident_ = 0;
  std::vector<std::vector<optim::tensor_piece>> layerwise_pieces_;  // per run (layer-wise optimizers)
  std::vector<float*> run_state_;
  bool defer_gather_ = false, gather_pending_ = false;
};

}  // namespace detail

// ZeRO stage 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters), over every data-parallel rank.
template <int Stage>
struct zero {
  static_assert(1 <= Stage && Stage <= 3, "dml::parallel::zero<Stage>: Stage is 1, 2 or 3");
  using policy_family = sharding_family;
  static constexpr int stage = Stage;
  static constexpr bool hybrid_sharding = false;
  static constexpr const char* name = Stage == 1 ? "zero1" : Stage == 2 ? "zero2" : "zero3";
  static constexpr bool shards_optimizer_state = true, shards_gradients = Stage >= 2, shards_parameters = Stage == 3;
  template <class Space, class Comm, class Optimizer, class Precision, class Net>
  using sync = detail::zero_sync<Stage, Space, Comm, Optimizer, Precision, Net>;
};

// Hybrid sharding (HSDP, MiCS): the data-parallel ranks form `replicas` replicas (trainer_options::replicas,
// a run-time degree); ZeRO shards within each replica and the replicas hold the same shards, whose gradients
// sum over the replicas once per step. Gathers stay within a replica.
template <class Sharding>
struct hybrid {
  static_assert(sizeof(Sharding) == 0, "dml::parallel::hybrid<S>: S is zero<1>, zero<2> or zero<3> (replicate "
                                       "already holds everything on every rank)");
};
// zero<Stage>'s policy, sync included (the trainer hands it the replica group); only the name and the flag differ.
template <int Stage>
struct hybrid<zero<Stage>> : zero<Stage> {
  static constexpr bool hybrid_sharding = true;
  static constexpr const char* name = Stage == 1 ? "hybrid_zero1" : Stage == 2 ? "hybrid_zero2" : "hybrid_zero3";
};

}  // namespace dml::parallel
