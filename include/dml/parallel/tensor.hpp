// SPDX-License-Identifier: Apache-2.0
// dml/parallel/tensor.hpp — Megatron tensor parallelism: a communicator's tensor group as the nn::rank_group
// that layers talk to, and the map between one rank's parts of the parameters and the whole model's.
// Sits on comm/communicator.hpp and nn/network.hpp; train/trainer.hpp builds the group from the mesh's tp axis.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/core/cast.hpp"
#include "dml/nn/network.hpp"

namespace dml::parallel {

// Comm's group seen as the type-erased, counting group of nn/rank_group.hpp. The typed pointers a layer
// passes are in the network's memory space, which is the communicator's (train/engine.hpp checks it); the
// counts and statistics (all_to_all of int64, all_reduce_sum of doubles) are host memory, staged where the
// communicator moves device memory.
template <comm::communicator Comm>
class rank_group final : public nn::rank_group {
 public:
  explicit rank_group(Comm& group) : nn::rank_group(group.rank(), group.size()), comm_(group) {}

 private:
  template <class T>
  static comm::span_for<Comm, T> view(T* p, std::int64_t n) {
    return comm::span_for<Comm, T>(p, static_cast<std::size_t>(n));
  }
  void do_all_reduce(typed_ptr x, std::int64_t n) override {
    dml::detail::visit_float_like(x.type, "dml::parallel::rank_group", [&]<class T>(T) {
      comm_.all_reduce(view(x.as<T>(), n), comm::reduce_op::sum);
    });
  }
  void do_all_reduce_max(float* x, std::int64_t n) override { comm_.all_reduce(view(x, n), comm::reduce_op::max); }
  void do_all_gather(const_typed_ptr in, typed_ptr out, std::int64_t n) override {
    dml::detail::visit_float_like(in.type, "dml::parallel::rank_group", [&]<class T>(T) {
      comm_.all_gather(view(in.as<T>(), n), view(out.as<T>(), n * size()));
    });
  }
  void do_reduce_scatter(const_typed_ptr in, typed_ptr out, std::int64_t n) override {
    dml::detail::visit_float_like(in.type, "dml::parallel::rank_group", [&]<class T>(T) {
      comm_.reduce_scatter(view(in.as<T>(), n * size()), view(out.as<T>(), n), comm::reduce_op::sum);
    });
  }
  void do_all_reduce_sum(double* x, std::int64_t n) override {
    comm::all_reduce_host(comm_, std::span<double>(x, static_cast<std::size_t>(n)), comm::reduce_op::sum);
  }
  void do_all_to_allv(const_typed_ptr send, const std::int64_t* send_counts, typed_ptr recv,
                      const std::int64_t* recv_counts) override {
    const auto p = static_cast<std::size_t>(size());
    std::vector<std::size_t> sc(send_counts, send_counts + p), rc(recv_counts, recv_counts + p);
    std::int64_t ns = 0, nr = 0;
    for (std::size_t r = 0; r < p; ++r) ns += static_cast<std::int64_t>(sc[r]), nr += static_cast<std::int64_t>(rc[r]);
    dml::detail::visit_float_like(send.type, "dml::parallel::rank_group::all_to_allv", [&]<class T>(T) {
      comm_.all_to_allv(view(send.as<T>(), ns), std::span<const std::size_t>(sc), view(recv.as<T>(), nr),
                        std::span<const std::size_t>(rc));
    });
  }
  void do_all_to_all(const std::int64_t* send, std::int64_t* recv, std::int64_t n) override {
    const auto total = static_cast<std::size_t>(n * size());
    comm::all_to_all_host(comm_, std::span<const std::int64_t>(send, total), std::span<std::int64_t>(recv, total));
  }
  // comm's request moves into the returned one; shared_ptr because std::function needs a copyable target.
  static nn::group_request wrap(auto r) {
    auto held = std::make_shared<decltype(r)>(std::move(r));
    return nn::group_request([held] { held->wait(); });
  }
  nn::group_request do_isend(const_typed_ptr x, std::int64_t n, int peer, int tag) override {
    return dml::detail::visit_float_like(x.type, "dml::parallel::rank_group::isend", [&]<class T>(T) {
      return wrap(comm_.isend(view(x.as<T>(), n), peer, tag));
    });
  }
  nn::group_request do_irecv(typed_ptr x, std::int64_t n, int peer, int tag) override {
    return dml::detail::visit_float_like(x.type, "dml::parallel::rank_group::irecv", [&]<class T>(T) {
      return wrap(comm_.irecv(view(x.as<T>(), n), peer, tag));
    });
  }
  nn::group_request do_isendrecv(const_typed_ptr send, int to, typed_ptr recv, int from, std::int64_t n, int tag) override {
    return dml::detail::visit_float_like(send.type, "dml::parallel::rank_group::isendrecv", [&]<class T>(T) {
      return wrap(comm::isendrecv(comm_, view(send.as<T>(), n), to, view(recv.as<T>(), n), from, tag));
    });
  }
  Comm& comm_;
};
template <comm::communicator Comm>
using tensor_group [[deprecated("dml: parallel::tensor_group is parallel::rank_group")]] = rank_group<Comm>;

// The whole model's parameters from each rank's parts: every rank writes its slots (tensor- or expert-parallel
// parts where the whole parameter's elements are; parameters not split along a group only from rank 0 of that
// group) into the whole layout, and `groups` (the tensor, pipeline and expert groups) sum the rest in.
// `values`: host memory, in `mine`'s layout. Collective over each group.
template <class Space, class... Groups>
std::vector<float> whole_model(const nn::param_layout& mine, const nn::param_layout& whole, std::span<const float> values,
                               int tp_rank, int ep_rank, Groups&... groups) {
  buffer<float, Space> full(static_cast<std::size_t>(whole.total));
  fill_n<Space>(full.data(), whole.total, 0.f);
  std::vector<float> out(full.size(), 0.f);
  for (const auto& s : mine.slots) {
    if ((!s.spec.shard.tensor_sharded() && tp_rank > 0) || (!s.spec.shard.expert_sharded() && ep_rank > 0)) continue;
    const std::int64_t at = whole.slots[s.id].offset;
    for (std::int64_t i = 0; i < s.shape.numel(); ++i)
      out[static_cast<std::size_t>(at + s.spec.shard.whole_index(i))] = values[static_cast<std::size_t>(s.offset + i)];
  }
  dml::copy_n(out.data(), out.size(), full.data());
  (groups.all_reduce(full.span(), comm::reduce_op::sum), ...);
  dml::copy_n(full.data(), out.size(), out.data());
  return out;
}

// This rank's slots of a whole-model parameter vector, in its own layout (its tensor-parallel parts).
inline std::vector<float> part_of_whole(const nn::param_layout& mine, const nn::param_layout& whole,
                                        std::span<const float> full) {
  std::vector<float> out(static_cast<std::size_t>(mine.total), 0.f);
  for (const auto& s : mine.slots) {
    const std::int64_t at = whole.slots[s.id].offset;
    for (std::int64_t i = 0; i < s.shape.numel(); ++i)
      out[static_cast<std::size_t>(s.offset + i)] = full[static_cast<std::size_t>(at + s.spec.shard.whole_index(i))];
  }
  return out;
}

}  // namespace dml::parallel
