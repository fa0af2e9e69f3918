// SPDX-License-Identifier: Apache-2.0
// dml/comm/detail/checks.hpp — the argument checks that a communicator over processes makes on each rank before
// any exchange: ranks in range, block sizes, counts. Each throws invalid_argument naming the model and operation.
// Sits on comm/communicator.hpp; used by comm/mpi.hpp (detail/mpi_checks.hpp) and comm/gloo.hpp.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "dml/comm/communicator.hpp"

namespace dml::comm::detail {

struct arg_checks {
  const char* model;  // "dml::comm::mpi"
  int rank = 0, size = 1;

  void rank_in_range(int r, const char* op, const char* what) const {
    if (r < 0 || r >= size)
      fail<invalid_argument>(model, "::", op, ": expected a ", what, " in [0, ", size, "), found ", r);
  }
  // Block rank of data, whose size must divide by the group size.
  template <class T>
  std::span<T> own_block(std::span<T> data, const char* op) const {
    if (data.size() % size != 0)
      fail<invalid_argument>(model, "::", op, ": expected a size divisible by the group size ", size, ", found ",
                             data.size());
    const std::size_t m = data.size() / size;
    return data.subspan(m * rank, m);
  }
  template <reducible T>
  void all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op) const {
    check_reduce<T>(op, dml::detail::cat(model, "::all_reduce"));
    if (send.size() != recv.size())
      fail<invalid_argument>(model, "::all_reduce: expected recv of send's size ", send.size(), ", found ",
                             recv.size());
  }
  template <reducible T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) const {
    check_reduce<T>(op, dml::detail::cat(model, "::reduce_scatter"));
    if (send.size() != recv.size() * size)
      fail<invalid_argument>(model, "::reduce_scatter: expected send of group size ", size, " x recv size ",
                             recv.size(), " = ", recv.size() * size, " elements, found ", send.size());
  }
  template <class T>
  void all_gather(std::span<const T> send, std::span<T> recv) const {
    if (recv.size() != send.size() * size)
      fail<invalid_argument>(model, "::all_gather: expected recv of group size ", size, " x send size ",
                             send.size(), " = ", send.size() * size, " elements, found ", recv.size());
  }
  template <reducible T>
  void reduce(std::span<const T> send, std::span<T> recv, reduce_op op, int root) const {
    check_reduce<T>(op, dml::detail::cat(model, "::reduce"));
    rank_in_range(root, "reduce", "root");
    if (rank == root && recv.size() != send.size())
      fail<invalid_argument>(model, "::reduce: expected recv of send's size ", send.size(), " at the root, found ",
                             recv.size());
  }
  // Elements per block.
  template <class T>
  std::size_t all_to_all(std::span<const T> send, std::span<T> recv) const {
    if (send.size() % size != 0 || recv.size() != send.size())
      fail<invalid_argument>(model, "::all_to_all: expected send and recv of equal size divisible by the group "
                             "size ", size, ", found ", send.size(), " and ", recv.size());
    return send.size() / size;
  }
  // Offsets of each rank's block in recv (size + 1 entries).
  template <class T>
  std::vector<std::size_t> all_gatherv(std::span<const T> send, std::span<T> recv,
                                       std::span<const std::size_t> counts) const {
    if (counts.size() != std::size_t(size))
      fail<invalid_argument>(model, "::all_gatherv: expected ", size, " counts, found ", counts.size());
    if (send.size() != counts[rank])
      fail<invalid_argument>(model, "::all_gatherv: expected send of counts[", rank, "] = ", counts[rank],
                             " elements, found ", send.size());
    std::vector<std::size_t> off(size + 1, 0);
    for (int p = 0; p < size; ++p) off[p + 1] = off[p] + counts[p];
    if (recv.size() != off[size])
      fail<invalid_argument>(model, "::all_gatherv: expected recv of sum(counts) = ", off[size],
                             " elements, found ", recv.size());
    return off;
  }
  template <class T>
  void all_to_allv(std::span<const T> send, std::span<const std::size_t> send_counts, std::span<T> recv,
                   std::span<const std::size_t> recv_counts) const {
    if (send_counts.size() != std::size_t(size) || recv_counts.size() != std::size_t(size))
      fail<invalid_argument>(model, "::all_to_allv: expected ", size, " send and receive counts, found ",
                             send_counts.size(), " and ", recv_counts.size());
    std::size_t so = 0, ro = 0;
    for (int p = 0; p < size; ++p) so += send_counts[p], ro += recv_counts[p];
    if (send.size() != so || recv.size() != ro)
      fail<invalid_argument>(model, "::all_to_allv: expected send of ", so, " and recv of ", ro,
                             " elements, found ", send.size(), " and ", recv.size());
  }
};

}  // namespace dml::comm::detail
