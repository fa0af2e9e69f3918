// SPDX-License-Identifier: Apache-2.0
// dml/train/checkpoint_io.hpp — a sharding's parameters and optimizer state to and from a sharded checkpoint.
// Sits on train/checkpoint.hpp (the format) and the sharding_sync interface of parallel/sharding.hpp.
#pragma once

#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/nn/network.hpp"
#include "dml/optim/loss_scaler.hpp"
#include "dml/parallel/buckets.hpp"
#include "dml/parallel/pipeline.hpp"
#include "dml/train/checkpoint.hpp"

namespace dml::train::detail {

// What a checkpoint says about its run: the whole model's names and shapes (so any layout of the model
// reads what any other wrote), the optimizer, step and seed, and (informative) the world and sharding.
template <class Optimizer>
checkpoint_info describe_checkpoint(const nn::param_layout& whole, std::int64_t step, std::uint64_t seed, int world,
                                    const char* sharding) {
  checkpoint_info info;
  info.optimizer = Optimizer::name;
  info.state_slots = Optimizer::state_slots;
  info.step = step;
  info.seed = seed;
  info.world_size = world;
  info.sharding = sharding;
  for (const auto& s : whole.slots) info.model.push_back({s.name, s.shape.vec()});
  return info;
}

// The optimizer's own step count and the loss scale (fp16) ride along under reserved keys.
inline void put_trainer_meta(checkpoint_info& info, std::int64_t optimizer_step, const optim::loss_scaler* scaler) {
  info.user["dml.optimizer_step"] = std::to_string(optimizer_step);
  if (scaler) {
    info.user["dml.loss_scale"] = std::to_string(scaler->scale());
    info.user["dml.loss_scale_tracker"] = std::to_string(scaler->growth_tracker());
  }
}
// Takes the reserved keys out of info.user, restores the scaler from them, and returns the optimizer's
// step count (the step itself where an older checkpoint has none).
inline std::int64_t take_trainer_meta(checkpoint_info& info, optim::loss_scaler* scaler) {
  std::int64_t optimizer_step = info.step;
  if (auto it = info.user.find("dml.optimizer_step"); it != info.user.end()) optimizer_step = std::stoll(it->second);
  auto scale = info.user.find("dml.loss_scale"), tracker = info.user.find("dml.loss_scale_tracker");
  if (scaler && scale != info.user.end() && tracker != info.user.end())
    scaler->restore(std::stof(scale->second), std::stoll(tracker->second));
  for (const char* k : {"dml.optimizer_step", "dml.loss_scale", "dml.loss_scale_tracker"}) info.user.erase(k);
  return optimizer_step;
}

// Elements [begin, end) of a slot as ranges of the whole parameter: f(whole_begin, whole_end, local_begin) for
// each run. A tensor-parallel part (`shard` of tensor rank tp_rank) maps to several runs, a whole one to one.
template <class F>
void whole_runs(nn::param_shard shard, int tp_rank, std::int64_t begin, std::int64_t end, F&& f) {
  shard.rank = shard.tensor_sharded() ? tp_rank : 0;
  for (std::int64_t i = begin; i < end;) {
    const std::int64_t w = shard.whole_index(i);
    std::int64_t j = i + 1;
    while (j < end && shard.whole_index(j) == w + (j - i)) ++j;
    f(w, w + (j - i), i);
    i = j;
  }
}
// Tensor ranks other than 0 hold copies of the parameters that are not split: only rank 0 writes them.
inline bool writes_slot(const nn::param_slot& s, int tp_rank) { return tp_rank == 0 || s.spec.shard.tensor_sharded(); }

// The (tensor, element range) pieces that data-parallel rank r of a stage (tensor rank tp_rank) writes: its
// part of every bucket, parameters (k = −1) and each state slot, as whole-parameter ranges, in the order
// save_sharded passes their data.
template <int StateSlots>
std::vector<checkpoint_range> checkpoint_pieces(const nn::param_layout& L, std::span<const parallel::bucket> buckets, int r,
                                                int tp_rank = 0) {
  std::vector<checkpoint_range> out;
  for (const auto& p : parallel::owned_pieces(L, buckets, r)) {
    const auto& slot = L.slots[p.slot];
    if (!writes_slot(slot, tp_rank)) continue;
    for (int k = -1; k < StateSlots; ++k)
      whole_runs(slot.spec.shard, tp_rank, p.begin, p.end, [&](std::int64_t b, std::int64_t e, std::int64_t) {
        out.push_back({checkpoint_tensor_name(k, slot.name), b, e});
      });
  }
  return out;
}

// Every rank's pieces of a tp × dp × pp run, in world-rank order (tensor rank fastest, then dp): each stage's
// layout and buckets, made as that stage's ranks made them (tensor ranks' parts have equal shapes).
template <int StateSlots, class Net>
std::vector<std::vector<checkpoint_range>> every_rank_pieces(const Net& net, const parallel::pipeline_options& o,
                                                             int dp, std::int64_t bucket_target, int tp = 1) {
  std::vector<std::vector<checkpoint_range>> out;
  for (int p = 0; p < o.stages; ++p) {
    const auto chunks = parallel::stage_chunks<Net>(net.model(), o, p);
    const auto layout = nn::make_layout(net.model(), net.layout().padding_unit, chunks);
    const auto plan = parallel::make_buckets(layout, net.depth(), bucket_target, dp, chunks);
    for (int d = 0; d < dp; ++d)
      for (int t = 0; t < tp; ++t) out.push_back(checkpoint_pieces<StateSlots>(layout, plan.buckets, d, t));
  }
  return out;
}

// Every rank writes the elements of its part of each bucket of its stage, params and state alike: 1/N
// of the model under every sharding, each element once (replicate holds everything but writes its part
// only). ranges: every rank of comm's pieces (checkpoint_pieces); dp_rank: this rank's within its stage.
template <class Space, int StateSlots, class Comm, class Sync>
void save_sharded(Comm& comm, Sync& sync, int dp_rank, const std::filesystem::path& dir, checkpoint_info info,
                  const std::vector<std::vector<checkpoint_range>>& ranges, const nn::param_layout& L, int tp_rank = 0) {
  std::vector<const float*> data;
  for (const auto& p : sync.owned_pieces(dp_rank)) {
    const auto& slot = L.slots[p.slot];
    if (!writes_slot(slot, tp_rank)) continue;
    for (int k = -1; k < StateSlots; ++k) {
      const float* held = sync.held(k, p);
      whole_runs(slot.spec.shard, tp_rank, p.begin, p.end,
                 [&](std::int64_t, std::int64_t, std::int64_t local) { data.push_back(held + (local - p.begin)); });
    }
  }
  // The writer reads host memory: a device trainer stages its pieces first.
  std::vector<std::vector<float>> staged;
  if constexpr (!std::same_as<Space, host>) {
    const auto& mine = ranges[static_cast<std::size_t>(comm.rank())];
    for (std::size_t i = 0; i < data.size(); ++i) {
      staged.emplace_back(static_cast<std::size_t>(mine[i].end - mine[i].begin));
      dml::copy_n(data[i], staged.back().size(), staged.back().data());
      data[i] = staged.back().data();
    }
  }
  write_checkpoint(comm, dir, std::move(info), ranges, std::span<const float* const>(data));
}

// Reads what this layout holds: whole parameters or state where the sharding keeps them whole, else
// the rank's pieces. Everything lands in scratch first, so a failed load leaves the sharding as it was.
template <int StateSlots, class Comm, class Sync>
checkpoint_info load_sharded(Comm& comm, Sync& sync, int dp_rank, const nn::param_layout& L,
                             const std::filesystem::path& dir, const checkpoint_info& want, int tp_rank = 0) {
  const auto mine = sync.owned_pieces(dp_rank);
  std::vector<checkpoint_range> need;
  std::vector<float*> dst;
  auto add = [&](int k, const nn::param_slot& s, std::int64_t begin, std::int64_t end, float* to) {
    whole_runs(s.spec.shard, tp_rank, begin, end, [&](std::int64_t b, std::int64_t e, std::int64_t local) {
      need.push_back({checkpoint_tensor_name(k, s.name), b, e});
      dst.push_back(to + (local - begin));
    });
  };
  for (int k = -1; k < StateSlots; ++k) {
    if (sync.loads_pieces(k)) {
      for (const auto& p : mine) add(k, L.slots[p.slot], p.begin, p.end, sync.held(k, p));
    } else {
      float* base = sync.whole(k);
      for (const auto& s : L.slots) add(k, s, 0, s.shape.numel(), base + s.offset);
    }
  }
  std::size_t total = 0;
  for (const auto& q : need) total += static_cast<std::size_t>(q.end - q.begin);
  std::vector<float> scratch(total);
  std::vector<float*> out;
  for (std::size_t i = 0, at = 0; i < need.size(); at += static_cast<std::size_t>(need[i].end - need[i].begin), ++i)
    out.push_back(scratch.data() + at);
  auto info = read_checkpoint(comm, dir, want, need, std::span<float* const>(out));
  for (std::size_t i = 0; i < need.size(); ++i)
    dml::copy_n(out[i], static_cast<std::size_t>(need[i].end - need[i].begin), dst[i]);
  return info;
}

}  // namespace dml::train::detail
