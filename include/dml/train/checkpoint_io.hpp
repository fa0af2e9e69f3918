// SPDX-License-Identifier: Apache-2.0
// dml/train/checkpoint_io.hpp — a sharding's parameters and optimizer state to and from a sharded checkpoint.
// Sits on train/checkpoint.hpp (the format) and the sharding_sync interface of parallel/sharding.hpp.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/nn/network.hpp"
#include "dml/optim/loss_scaler.hpp"
#include "dml/parallel/buckets.hpp"
#include "dml/train/checkpoint.hpp"
#include "dml/train/options.hpp"

namespace dml::train {

// What a rank holds in the global index space of checkpoints (train/checkpoint.hpp), in memory: meta.values
// holds the elements of `ranges`, in order. Any layout of the same model restores from a set of these (of one
// step) that covers every element: a restart at another world size reshards them as it reshards checkpoints.
struct state_pieces {
  state_snapshot meta;
  std::vector<checkpoint_range> ranges;
};

}  // namespace dml::train

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
// Loss-free balancing's selection biases (nn::routing_log::router_bias), one reserved key per layer, each float in
// its shortest form that reads back to the same bits.
inline void put_router_bias(checkpoint_info& info, const std::map<std::uint64_t, std::vector<float>>& bias) {
  for (const auto& [layer, b] : bias) {
    std::string s;
    char buf[32];
    for (float v : b) {
      const auto r = std::to_chars(buf, buf + sizeof buf, v);
      if (!s.empty()) s += ',';
      s.append(buf, r.ptr);
    }
    info.user["dml.router_bias." + std::to_string(layer)] = s;
  }
}
inline std::map<std::uint64_t, std::vector<float>> take_router_bias(checkpoint_info& info) {
  static const std::string prefix = "dml.router_bias.";
  std::map<std::uint64_t, std::vector<float>> out;
  for (auto it = info.user.lower_bound(prefix); it != info.user.end() && it->first.starts_with(prefix);) {
    auto& b = out[std::stoull(it->first.substr(prefix.size()))];
    const std::string& s = it->second;
    for (const char *p = s.data(), *end = s.data() + s.size(); p < end;) {
      float v = 0;
      const auto r = std::from_chars(p, end, v);
      if (r.ec != std::errc{})
        fail<invalid_argument>("dml::load_checkpoint: ", it->first, ": expected comma-separated floats, found '", s, "'");
      b.push_back(v);
      p = r.ptr + (r.ptr < end && *r.ptr == ',' ? 1 : 0);
    }
    it = info.user.erase(it);
  }
  return out;
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
// each run. A part of a split parameter (tensor or expert parallelism; the slot's shard says which part) maps
// to several runs, a whole one to one.
template <class F>
void whole_runs(const nn::param_shard& shard, std::int64_t begin, std::int64_t end, F&& f) {
  if (!shard.sharded()) {
    if (begin < end) f(begin, end, begin);
    return;
  }
  for (std::int64_t i = begin; i < end;) {
    const std::int64_t w = shard.whole_index(i);
    std::int64_t j = i + 1;
    while (j < end && shard.whole_index(j) == w + (j - i)) ++j;
    f(w, w + (j - i), i);
    i = j;
  }
}
// Tensor ranks other than 0 hold copies of the parameters that tensor parallelism does not split (experts
// included: they are whole on every tensor rank): only rank 0 writes them.
inline bool writes_slot(const nn::param_slot& s, int tp_rank) { return tp_rank == 0 || s.spec.shard.tensor_sharded(); }

// Every rank's ranges, from each rank's own: one all_gather of counts, one of (tensor, begin, end) triples
// padded to the longest list. A tensor travels as its index among `names`.
template <class Comm>
std::vector<std::vector<checkpoint_range>> gather_ranges(Comm& comm, const std::vector<checkpoint_range>& mine,
                                                         const std::vector<std::string>& names) {
  const auto n = static_cast<std::size_t>(comm.size());
  const auto own = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> sizes(n);
  comm::all_gather_host(comm, std::span<const std::int64_t>(&own, 1), std::span<std::int64_t>(sizes));
  const auto most = static_cast<std::size_t>(std::max<std::int64_t>(1, *std::ranges::max_element(sizes)));
  std::vector<std::int64_t> triples(3 * most, 0);
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const auto at = std::ranges::find(names, mine[i].tensor);
    triples[3 * i] = at - names.begin();
    triples[3 * i + 1] = mine[i].begin;
    triples[3 * i + 2] = mine[i].end;
  }
  std::vector<std::int64_t> every(3 * most * n);
  comm::all_gather_host(comm, std::span<const std::int64_t>(triples), std::span<std::int64_t>(every));
  std::vector<std::vector<checkpoint_range>> out(n);
  for (std::size_t r = 0; r < n; ++r)
    for (std::int64_t i = 0; i < sizes[r]; ++i) {
      const auto* t = every.data() + 3 * (most * r + static_cast<std::size_t>(i));
      out[r].push_back({names.at(static_cast<std::size_t>(t[0])), t[1], t[2]});
    }
  return out;
}

// Each run of what this rank owns (parallel/ownership.hpp) as a range of the whole parameter, parameters (k = -1)
// and each optimizer slot: f(k, slot, whole_begin, whole_end, the run's first element here).
template <int StateSlots, class Sync, class F>
void each_owned_run(Sync& sync, const nn::param_layout& L, F&& f) {
  for (const auto& p : sync.owned_pieces()) {
    const auto& slot = L.slots[p.slot];
    for (int k = -1; k < StateSlots; ++k) {
      const float* held = sync.held(k, p);
      whole_runs(slot.spec.shard, p.begin, p.end, [&](std::int64_t b, std::int64_t e, std::int64_t local) {
        f(k, slot, b, e, held + (local - p.begin));
      });
    }
  }
}

// Every rank writes the elements it owns (parallel/buckets.hpp): its part of each run of its stage, params and
// state alike, under every sharding; tensor ranks but 0 leave out the copies they share, replicas but the first
// write nothing. Each element is written once, whatever the layout; each rank describes its own ranges and the
// descriptions are gathered. Returns the save with its file written (background: being written by a thread while
// training goes on, which reads the rank's pieces in place until their bytes are in the system's hands, so the
// trainer's next update waits for that); the caller publishes and finishes it. A device trainer's pieces are copied
// to the host first, into `copy` (a buffer kept from the save before).
template <class Space, int StateSlots, class Comm, class Sync>
std::unique_ptr<checkpoint_save> save_sharded(Comm& comm, Sync& sync, const std::filesystem::path& dir,
                                              checkpoint_info info, const nn::param_layout& L, int tp_rank,
                                              bool background, std::vector<float> copy = {}) {
  std::vector<const float*> data;
  std::vector<checkpoint_range> mine;
  if (sync.writes_checkpoint())
    each_owned_run<StateSlots>(sync, L, [&](int k, const nn::param_slot& slot, std::int64_t b, std::int64_t e,
                                            const float* src) {
      if (!writes_slot(slot, tp_rank)) return;
      mine.push_back({checkpoint_tensor_name(k, slot.name), b, e});
      data.push_back(src);
    });
  std::vector<std::string> names;
  for (int k = -1; k < StateSlots; ++k)
    for (const auto& m : info.model) names.push_back(checkpoint_tensor_name(k, m.name));
  auto ranges = gather_ranges(comm, mine, names);
  // The writer reads host memory: a device trainer's pieces are copied into one host buffer first, the checkpoint's
  // staging.
  if constexpr (!std::same_as<Space, host>) {
    std::size_t total = 0;
    for (const auto& r : mine) total += static_cast<std::size_t>(r.end - r.begin);
    copy.resize(total);
    float* at = copy.data();
    for (std::size_t i = 0; i < data.size(); ++i) {
      const auto n = static_cast<std::size_t>(mine[i].end - mine[i].begin);
      dml::copy_n(data[i], n, at);
      data[i] = at;
      at += n;
    }
  }
  auto save = std::make_unique<checkpoint_save>(comm, dir, std::move(info), std::move(ranges),
                                                std::span<const float* const>(data), std::move(copy),
                                                background && std::same_as<Space, host>);
  save->write(background);
  return save;
}

// What this layout holds, as ranges of the global index space and where each lands: whole parameters or state
// where the sharding keeps them whole, else the rank's pieces.
template <int StateSlots, class Sync>
std::pair<std::vector<checkpoint_range>, std::vector<float*>> held_ranges(Sync& sync, const nn::param_layout& L) {
  const auto mine = sync.owned_pieces();
  std::vector<checkpoint_range> need;
  std::vector<float*> dst;
  auto add = [&](int k, const nn::param_slot& s, std::int64_t begin, std::int64_t end, float* to) {
    whole_runs(s.spec.shard, begin, end, [&](std::int64_t b, std::int64_t e, std::int64_t local) {
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
  return {std::move(need), std::move(dst)};
}

// Fills `need` through scratch (read(need, out) fills out[i] with need[i]'s elements), then copies into dst:
// a read that throws leaves the sharding as it was.
template <class Read>
void fill_held(const std::vector<checkpoint_range>& need, const std::vector<float*>& dst, Read&& read) {
  std::size_t total = 0;
  for (const auto& q : need) total += static_cast<std::size_t>(q.end - q.begin);
  std::vector<float> scratch(total);
  std::vector<float*> out;
  for (std::size_t i = 0, at = 0; i < need.size(); at += static_cast<std::size_t>(need[i].end - need[i].begin), ++i)
    out.push_back(scratch.data() + at);
  read(need, out);
  for (std::size_t i = 0; i < need.size(); ++i)
    dml::copy_n(out[i], static_cast<std::size_t>(need[i].end - need[i].begin), dst[i]);
}

// Reads what this layout holds from the newest checkpoint in dir.
template <int StateSlots, class Comm, class Sync>
checkpoint_info load_sharded(Comm& comm, Sync& sync, const nn::param_layout& L, const std::filesystem::path& dir,
                             const checkpoint_info& want) {
  const auto [need, dst] = held_ranges<StateSlots>(sync, L);
  checkpoint_info info;
  fill_held(need, dst, [&](const std::vector<checkpoint_range>& q, std::vector<float*>& out) {
    info = read_checkpoint(comm, dir, want, q, std::span<float* const>(out));
  });
  return info;
}

// The elements a rank owns (parallel/ownership.hpp), parameters and optimizer state, in the global index space
// of checkpoints, with the trainer's counters: what train::state_pieces carries.
template <int StateSlots, class Sync>
void export_owned(Sync& sync, const nn::param_layout& L, state_pieces& out) {
  each_owned_run<StateSlots>(sync, L, [&](int k, const nn::param_slot& slot, std::int64_t b, std::int64_t e,
                                          const float* src) {
    out.ranges.push_back({checkpoint_tensor_name(k, slot.name), b, e});
    const auto at = out.meta.values.size();
    out.meta.values.resize(at + static_cast<std::size_t>(e - b));
    dml::copy_n(src, static_cast<std::size_t>(e - b), out.meta.values.data() + at);
  });
}

// Fills out[i] with the elements of need[i] from any of `sources` (pieces of one step, from any layouts; where
// two hold an element, they hold the same value). An element none holds is an error naming it.
inline void read_pieces(std::span<const state_pieces> sources, const std::vector<checkpoint_range>& need,
                        std::span<float* const> out) {
  struct run { std::int64_t begin, end; const float* data; };
  std::map<std::string_view, std::vector<run>> by_tensor;
  for (const auto& s : sources) {
    std::size_t at = 0;
    for (const auto& r : s.ranges) {
      if (r.end < r.begin || at + static_cast<std::size_t>(r.end - r.begin) > s.meta.values.size())
        fail<format_error>("dml::train: a state's range [", r.begin, ", ", r.end, ") of '", r.tensor,
                           "' runs past its ", s.meta.values.size(), " values");
      by_tensor[r.tensor].push_back({r.begin, r.end, s.meta.values.data() + at});
      at += static_cast<std::size_t>(r.end - r.begin);
    }
  }
  for (auto& [name, runs] : by_tensor) std::ranges::sort(runs, {}, &run::begin);
  for (std::size_t i = 0; i < need.size(); ++i) {
    const auto& q = need[i];
    const auto it = by_tensor.find(q.tensor);
    std::int64_t at = q.begin;
    if (it != by_tensor.end())
      for (const auto& r : it->second) {  // sorted by begin: take each run that reaches past `at`
        if (r.begin > at) break;
        if (r.end <= at) continue;
        const std::int64_t e = std::min(r.end, q.end);
        std::memcpy(out[i] + (at - q.begin), r.data + (at - r.begin), static_cast<std::size_t>(e - at) * sizeof(float));
        at = e;
        if (at == q.end) break;
      }
    if (at != q.end) {
      std::int64_t gap_end = q.end;  // up to the next run that holds something
      if (it != by_tensor.end())
        for (const auto& r : it->second)
          if (r.begin > at) gap_end = std::min(gap_end, r.begin);
      fail<invalid_argument>("dml::train: elements [", at, ", ", gap_end, ") of '", q.tensor,
                             "' are held by none of the ", sources.size(), " states given");
    }
  }
}

}  // namespace dml::train::detail
