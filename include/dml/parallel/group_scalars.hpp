// SPDX-License-Identifier: Apache-2.0
// dml/parallel/group_scalars.hpp — scalars a step agrees on over a group: a sum (loss, norm, overflow), a rank's first row.
// Sits on comm/ and core/; train/trainer.hpp calls them. Not a sharding's business: any sharding's step needs them.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/core/algorithm.hpp"
#include "dml/core/buffer.hpp"

namespace dml::parallel {

// Collectives run on the communicator's stream, kernels on the compute stream (current_stream()): before a
// collective on `group` reads or writes memory that kernels touched, the group's stream waits for what the
// compute stream has queued so far. Nothing to do on the host, or for a communicator without a stream.
template <class Space, class Comm>
void order_after_compute([[maybe_unused]] Comm& group) {
#if DML_HAS_CUDA
  if constexpr (std::same_as<Space, cuda> && requires { group.stream(); }) {
    cudaEvent_t done = nullptr;
    DML_CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    DML_CHECK_CUDA(cudaEventRecord(done, current_stream()));
    DML_CHECK_CUDA(cudaStreamWaitEvent(group.stream(), done, 0));
    cudaEventDestroy(done);  // the wait above holds what it needs
  }
#endif
}

// A scalar summed over a group, through memory of the Space (NCCL reads device memory only), ordered after
// the compute queued so far.
template <class Space, class Comm, class V>
V sum_over(Comm& group, V value) {
  if (group.size() == 1) return value;
  buffer<V, Space> v(1);
  dml::copy_n(&value, 1, v.data());
  order_after_compute<Space>(group);
  group.all_reduce(v.span(), comm::reduce_op::sum);
  dml::copy_n(v.data(), 1, &value);
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
  buffer<std::int64_t, Space> mine(1), all(static_cast<std::size_t>(data.size()));
  dml::copy_n(&rows, 1, mine.data());
  order_after_compute<Space>(data);
  data.all_gather(std::span<const std::int64_t>(mine.data(), 1), all.span());
  std::vector<std::int64_t> counts(all.size());
  dml::copy_n(all.data(), counts.size(), counts.data());
  std::int64_t first = 0;
  for (int r = 0; r < data.rank() / cp * cp; r += cp) first += counts[static_cast<std::size_t>(r)];
  return first;
}

}  // namespace dml::parallel
