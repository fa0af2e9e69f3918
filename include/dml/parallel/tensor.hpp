// SPDX-License-Identifier: Apache-2.0
// dml/parallel/tensor.hpp — Megatron tensor parallelism: a communicator's tensor group as the nn::tensor_group
// that layers talk to, and the map between one rank's parts of the parameters and the whole model's.
// Sits on comm/communicator.hpp and nn/network.hpp; train/trainer.hpp builds the group from the mesh's tp axis.
#pragma once

#include <span>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/core/cast.hpp"
#include "dml/nn/network.hpp"

namespace dml::parallel {

// Comm's group seen as the type-erased, counting group of nn/tensor_group.hpp.
template <comm::communicator Comm>
class tensor_group final : public nn::tensor_group {
 public:
  explicit tensor_group(Comm& group) : nn::tensor_group(group.rank(), group.size()), comm_(group) {}

 private:
  void do_all_reduce(typed_ptr x, std::int64_t n) override {
    dml::detail::visit_float_like(x.type, "dml::parallel::tensor_group", [&]<class T>(T) {
      comm_.all_reduce(std::span<T>(x.as<T>(), static_cast<std::size_t>(n)), comm::reduce_op::sum);
    });
  }
  void do_all_reduce_max(float* x, std::int64_t n) override {
    comm_.all_reduce(std::span<float>(x, static_cast<std::size_t>(n)), comm::reduce_op::max);
  }
  void do_all_gather(const_typed_ptr in, typed_ptr out, std::int64_t n) override {
    dml::detail::visit_float_like(in.type, "dml::parallel::tensor_group", [&]<class T>(T) {
      comm_.all_gather(std::span<const T>(in.as<T>(), static_cast<std::size_t>(n)),
                       std::span<T>(out.as<T>(), static_cast<std::size_t>(n * size())));
    });
  }
  void do_reduce_scatter(const_typed_ptr in, typed_ptr out, std::int64_t n) override {
    dml::detail::visit_float_like(in.type, "dml::parallel::tensor_group", [&]<class T>(T) {
      comm_.reduce_scatter(std::span<const T>(in.as<T>(), static_cast<std::size_t>(n * size())),
                           std::span<T>(out.as<T>(), static_cast<std::size_t>(n)), comm::reduce_op::sum);
    });
  }
  Comm& comm_;
};

// The whole model's parameters from each rank's parts: every rank writes its slots (tensor-parallel parts
// where the whole parameter's elements are, whole parameters from tensor rank 0 only) into the whole
// layout, and `groups` (the tensor and pipeline groups) sum the rest in. `values`: host memory, in `mine`'s
// layout. Collective over each group.
template <class Space, class... Groups>
std::vector<float> whole_model(const nn::param_layout& mine, const nn::param_layout& whole, std::span<const float> values,
                               int tp_rank, Groups&... groups) {
  buffer<float, Space> full(static_cast<std::size_t>(whole.total));
  fill_n<Space>(full.data(), whole.total, 0.f);
  std::vector<float> out(full.size(), 0.f);
  for (const auto& s : mine.slots) {
    if (!s.spec.shard.sharded() && tp_rank > 0) continue;
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
