// SPDX-License-Identifier: Apache-2.0
// dml/parallel/group_scalars.hpp — scalars a step agrees on over a group: a sum (loss, norm, overflow), a rank's first row.
// Sits on comm/ and core/; train/trainer.hpp calls them. Not a sharding's business: any sharding's step needs them.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dml/comm/communicator.hpp"

namespace dml::parallel {

// A scalar summed over a group (staged through device memory where the group moves device memory).
template <class Space, class Comm, class V>
V sum_over(Comm& group, V value) {
  if (group.size() == 1) return value;
  comm::all_reduce_host(group, std::span<V>(&value, 1), comm::reduce_op::sum);
  return value;
}

// The global index of this rank's first row among the `data` ranks (the data-parallel group): ranks pass
// contiguous slices of the global batch in rank order (train::sampler::slice), so it is the sum of the
// earlier ranks' row counts, from one all_gather. Under context parallelism the cp consecutive ranks of a
// group pass the same rows, which count once. Collective; the trainer calls it only for models with a layer
// that reads the row index (dropout, MoE routing).
template <class Space, class Comm>
std::int64_t first_global_row(Comm& data, std::int64_t rows, int cp = 1) {
  if (data.size() == 1) return 0;
  std::vector<std::int64_t> counts(static_cast<std::size_t>(data.size()));
  comm::all_gather_host(data, std::span<const std::int64_t>(&rows, 1), std::span<std::int64_t>(counts));
  std::int64_t first = 0;
  for (int r = 0; r < data.rank() / cp * cp; r += cp) first += counts[static_cast<std::size_t>(r)];
  return first;
}

}  // namespace dml::parallel
