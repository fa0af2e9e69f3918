// SPDX-License-Identifier: Apache-2.0
// dml/parallel/mesh.hpp — the rank mesh: one world split once into tensor-, data-, pipeline- and expert-parallel groups.
// Sits on comm/communicator.hpp; pipeline, tensor and expert parallelism and the trainer take their groups from it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "dml/comm/communicator.hpp"
#include "dml/core/error.hpp"

namespace dml::parallel {

// The degrees of a layout. World ranks are laid out as Megatron-LM lays them out: tp fastest, then
// dp, then pp, so
//
//     world rank = tp_rank + tp * (dp_rank + dp * pp_rank)
//
// and a tensor-parallel group is tp consecutive world ranks (one node's GPUs, where the traffic is).
//
// ep (expert parallel) is carved out of dp, as in Megatron-LM: ep divides dp, and an expert group
// is ep consecutive data-parallel ranks (dp_rank / ep the same), which share out the experts of a
// mixture-of-experts layer. The ranks that hold the same experts (dp_rank % ep the same, dp / ep
// of them) form the expert-data-parallel group, which reduces those experts' gradients. Dense
// parameters keep using the whole dp group.
//
// cp (context parallel) is carved out of dp the same way: a context-parallel group is cp consecutive
// data-parallel ranks that hold the same sequences, each a different chunk of their tokens. Every
// parameter is whole on each of them, so gradients still sum over the whole dp group; only the data
// differs (dp / cp distinct slices of the batch).
//
// replicas (hybrid sharding) splits dp into dp / replicas shard ranks (fastest) × replicas: a replica is
// dp / replicas consecutive data-parallel ranks, within which ZeRO shards; the ranks at the same place of
// every replica form the replicate group, over which their shards' gradients sum. ep and cp are carved out of
// a replica. The shard group and the expert shard group (the ranks of a replica that hold the same experts)
// are the dp and edp groups when replicas is 1.
struct mesh_shape {
  int tp = 1, dp = 1, pp = 1, ep = 1, cp = 1, replicas = 1;

  friend bool operator==(const mesh_shape&, const mesh_shape&) = default;
};

// "tp 1 × dp 2 × pp 2"; "tp 1 × dp 4 (ep 2) × pp 1" when ep > 1.
inline std::string to_string(const mesh_shape& s) {
  std::string carved = s.ep > 1 ? detail::cat("ep ", s.ep) : "";
  if (s.cp > 1) carved += detail::cat(carved.empty() ? "" : ", ", "cp ", s.cp);
  if (s.replicas > 1) carved += detail::cat(carved.empty() ? "" : ", ", "replicas ", s.replicas);
  return carved.empty() ? detail::cat("tp ", s.tp, " × dp ", s.dp, " × pp ", s.pp)
                        : detail::cat("tp ", s.tp, " × dp ", s.dp, " (", carved, ") × pp ", s.pp);
}

// Throws invalid_argument unless `s` lays out exactly `world_size` ranks.
inline void check_shape(const mesh_shape& s, int world_size) {
  if (s.tp < 1 || s.dp < 1 || s.pp < 1 || s.ep < 1 || s.cp < 1 || s.replicas < 1)
    fail<invalid_argument>("dml::parallel::mesh: expected every degree >= 1, found tp ", s.tp, ", dp ", s.dp,
                           ", pp ", s.pp, ", ep ", s.ep, ", cp ", s.cp, ", replicas ", s.replicas);
  if (s.dp % s.cp != 0)
    fail<invalid_argument>("dml::parallel::mesh: expected cp to divide dp (a context-parallel group is cp "
                           "consecutive data-parallel ranks), found cp ", s.cp, " and dp ", s.dp);
  if (s.dp % s.ep != 0)
    fail<invalid_argument>("dml::parallel::mesh: expected ep to divide dp (an expert group is ep consecutive "
                           "data-parallel ranks), found ep ",
                           s.ep, " and dp ", s.dp);
  if (s.dp % s.replicas != 0)
    fail<invalid_argument>("dml::parallel::mesh: expected replicas to divide dp (a replica is dp / replicas "
                           "consecutive data-parallel ranks), found replicas ", s.replicas, " and dp ", s.dp);
  if ((s.dp / s.replicas) % s.ep != 0 || (s.dp / s.replicas) % s.cp != 0)
    fail<invalid_argument>("dml::parallel::mesh: expected ep and cp to divide a replica's ", s.dp / s.replicas,
                           " data-parallel ranks, found ep ", s.ep, " and cp ", s.cp);
  const std::int64_t n = std::int64_t(s.tp) * s.dp * s.pp;
  if (n != world_size)
    fail<invalid_argument>("dml::parallel::mesh: expected a world of tp ", s.tp, " × dp ", s.dp, " × pp ", s.pp,
                           " = ", n, " ranks, found ", world_size);
}

// Splits `world` into its groups at construction: a collective, which every rank of the world
// calls with the same shape. Every axis gets a group, also one of size 1, so callers never
// branch on whether a kind of parallelism is in use. Each group's ranks are ordered by that
// axis's coordinate: tp().rank() == tp_rank(), and so on.
//
// The mesh refers to `world`, which must outlive it, and owns the groups.
template <comm::communicator Comm>
class mesh {
 public:
  mesh(Comm& world, mesh_shape shape)
      : world_(&world),
        shape_((check_shape(shape, world.size()), shape)),
        at_(coords_of(world.rank(), shape)),
        // One split per axis, in this order on every rank.
        tp_(split("tp", at_.dp + shape_.dp * at_.pp, at_.tp, shape_.tp)),
        dp_(split("dp", at_.tp + shape_.tp * at_.pp, at_.dp, shape_.dp)),
        pp_(split("pp", at_.tp + shape_.tp * at_.dp, at_.pp, shape_.pp)),
        ep_(split("ep", at_.tp + shape_.tp * (at_.dp / shape_.ep + shape_.dp / shape_.ep * at_.pp), ep_rank(),
                  shape_.ep)),
        edp_(split("edp", at_.tp + shape_.tp * (at_.dp % shape_.ep + shape_.ep * at_.pp), edp_rank(),
                   edp_size())),
        cp_(split("cp", at_.tp + shape_.tp * (at_.dp / shape_.cp + shape_.dp / shape_.cp * at_.pp), cp_rank(),
                  shape_.cp)),
        shard_(split("shard", at_.tp + shape_.tp * (replica_rank() + shape_.replicas * at_.pp), shard_rank(),
                     shard_size())),
        eshard_(split("expert shard",
                      at_.tp + shape_.tp * (ep_rank() + shape_.ep * (replica_rank() + shape_.replicas * at_.pp)),
                      shard_rank() / shape_.ep, shard_size() / shape_.ep)),
        replicate_(split("replicate", at_.tp + shape_.tp * (shard_rank() + shard_size() * at_.pp), replica_rank(),
                         shape_.replicas)) {}

  mesh(mesh&&) noexcept = default;
  mesh& operator=(mesh&&) noexcept = default;

  Comm& world() noexcept { return *world_; }
  Comm& tp() noexcept { return tp_; }
  Comm& dp() noexcept { return dp_; }
  Comm& pp() noexcept { return pp_; }
  Comm& ep() noexcept { return ep_; }
  Comm& edp() noexcept { return edp_; }  // expert data parallel: the ranks that hold this rank's experts
  Comm& cp() noexcept { return cp_; }    // context parallel: the ranks holding chunks of the same sequences
  Comm& shard() noexcept { return shard_; }          // this rank's replica: the ranks that shard dense parameters
  Comm& expert_shard() noexcept { return eshard_; }  // the replica's ranks that hold this rank's experts
  Comm& replicate() noexcept { return replicate_; }  // the ranks holding this rank's shard in other replicas
  const Comm& world() const noexcept { return *world_; }
  const Comm& tp() const noexcept { return tp_; }
  const Comm& dp() const noexcept { return dp_; }
  const Comm& pp() const noexcept { return pp_; }
  const Comm& ep() const noexcept { return ep_; }
  const Comm& edp() const noexcept { return edp_; }
  const Comm& cp() const noexcept { return cp_; }

  mesh_shape shape() const noexcept { return shape_; }
  int world_rank() const noexcept { return at_.world; }
  int world_size() const noexcept { return shape_.tp * shape_.dp * shape_.pp; }
  int tp_rank() const noexcept { return at_.tp; }
  int dp_rank() const noexcept { return at_.dp; }
  int pp_rank() const noexcept { return at_.pp; }
  int ep_rank() const noexcept { return at_.dp % shape_.ep; }
  int edp_rank() const noexcept { return at_.dp / shape_.ep; }
  int tp_size() const noexcept { return shape_.tp; }
  int dp_size() const noexcept { return shape_.dp; }
  int pp_size() const noexcept { return shape_.pp; }
  int ep_size() const noexcept { return shape_.ep; }
  int edp_size() const noexcept { return shape_.dp / shape_.ep; }
  int cp_rank() const noexcept { return at_.dp % shape_.cp; }
  int cp_size() const noexcept { return shape_.cp; }
  int shard_rank() const noexcept { return at_.dp % shard_size(); }
  int shard_size() const noexcept { return shape_.dp / shape_.replicas; }
  int replica_rank() const noexcept { return at_.dp / shard_size(); }
  // The data this rank trains on: dp / cp distinct slices of the batch, the cp ranks of a group sharing one.
  int data_rank() const noexcept { return at_.dp / shape_.cp; }
  int data_ranks() const noexcept { return shape_.dp / shape_.cp; }

  // The world rank at these coordinates.
  int world_rank_of(int tp, int dp, int pp) const {
    if (tp < 0 || tp >= shape_.tp || dp < 0 || dp >= shape_.dp || pp < 0 || pp >= shape_.pp)
      fail<invalid_argument>("dml::parallel::mesh::world_rank_of: expected tp in [0, ", shape_.tp, "), dp in [0, ",
                             shape_.dp, "), pp in [0, ", shape_.pp, "), found tp ", tp, " dp ", dp, " pp ", pp);
    return tp + shape_.tp * (dp + shape_.dp * pp);
  }

  // The neighbouring pipeline stages, as ranks of pp(): -1 past the first or the last stage.
  int pp_next() const noexcept { return at_.pp + 1 < shape_.pp ? at_.pp + 1 : -1; }
  int pp_prev() const noexcept { return at_.pp - 1; }

  // "tp 1 × dp 2 × pp 2, this rank: tp 0 dp 1 pp 0" (with "(ep r)" after dp when ep > 1).
  std::string describe() const {
    std::string carved = shape_.ep > 1 ? detail::cat("ep ", ep_rank()) : "";
    if (shape_.cp > 1) carved += detail::cat(carved.empty() ? "" : ", ", "cp ", cp_rank());
    return detail::cat(to_string(shape_), ", this rank: tp ", at_.tp, " dp ", at_.dp,
                       carved.empty() ? "" : detail::cat(" (", carved, ")"), " pp ", at_.pp);
  }

 private:
  struct coords {
    int world, tp, dp, pp;
  };
  static coords coords_of(int r, const mesh_shape& s) {
    return {r, r % s.tp, r / s.tp % s.dp, r / (s.tp * s.dp)};
  }

  // A group whose size or order differs from the shape's means the ranks passed different shapes.
  Comm split(const char* axis, int color, int key, int expected_size) {
    Comm g = world_->split(color, key);
    if (g.size() != expected_size || g.rank() != key)
      fail<invalid_argument>("dml::parallel::mesh: world rank ", at_.world, " expected ", expected_size,
                             " ranks in its ", axis, " group, itself rank ", key, ", for ", to_string(shape_),
                             "; found ", g.size(), " ranks, itself rank ", g.rank(),
                             ": every rank must pass the same shape");
    return g;
  }

  Comm* world_;
  mesh_shape shape_;
  coords at_;
  Comm tp_, dp_, pp_, ep_, edp_, cp_, shard_, eshard_, replicate_;
};

// The tp × dp × pp mesh of a trainer with `tp` tensor-parallel ranks and `stages` pipeline stages over
// world, ep and cp carved out of dp; none when every degree is 1 (the world is the data-parallel group).
template <comm::communicator Comm>
std::optional<mesh<Comm>> trainer_mesh(Comm& world, int tp, int stages, int ep = 1, int cp = 1, int replicas = 1) {
  if (tp < 1 || stages < 1 || world.size() % (tp * stages) != 0)
    fail<invalid_argument>("dml::trainer: expected tensor_parallel × pipeline_stages to divide the group's ", world.size(),
                           " ranks, found tensor_parallel ", tp, " and pipeline_stages ", stages);
  const int dp = world.size() / (tp * stages);
  if (ep < 1 || dp % ep != 0)
    fail<invalid_argument>("dml::trainer: expected expert_parallel to divide the ", dp, " data-parallel ranks, found ", ep);
  if (cp < 1 || dp % cp != 0)
    fail<invalid_argument>("dml::trainer: expected context_parallel to divide the ", dp, " data-parallel ranks, found ", cp);
  if (replicas < 1 || dp % replicas != 0)
    fail<invalid_argument>("dml::trainer: expected replicas to divide the ", dp, " data-parallel ranks, found ", replicas);
  if ((dp / replicas) % ep != 0 || (dp / replicas) % cp != 0)
    fail<invalid_argument>("dml::trainer: expected expert_parallel and context_parallel to divide a replica's ",
                           dp / replicas, " data-parallel ranks (", dp, " over ", replicas, " replicas), found ",
                           "expert_parallel ", ep, " and context_parallel ", cp);
  if (tp == 1 && stages == 1 && ep == 1 && cp == 1 && replicas == 1) return std::nullopt;
  return std::optional<mesh<Comm>>(std::in_place, world,
                                   mesh_shape{.tp = tp, .dp = dp, .pp = stages, .ep = ep, .cp = cp, .replicas = replicas});
}

}  // namespace dml::parallel
