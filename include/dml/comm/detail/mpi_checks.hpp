// SPDX-License-Identifier: Apache-2.0
// dml/comm/detail/mpi_checks.hpp — comm::mpi's argument checks: ranks, block sizes and received counts on each rank,
// and with options::check_arguments the cross-rank agreement of counts, types, ops and roots.
// Sits on comm/mpi.hpp, which declares these members; used by comm/mpi.hpp, which includes it at its end (included
// alone, it includes comm/mpi.hpp first).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <span>

#include "dml/comm/mpi.hpp"

namespace dml::comm {

inline void mpi::check_rank(int r, const char* op, const char* what) const {
  if (r < 0 || r >= size_)
    fail<invalid_argument>("dml::comm::mpi::", op, ": expected a ", what, " in [0, ", size_, "), found ", r);
}
template <class T>
std::span<T> mpi::own_block(std::span<T> data, const char* op) const {
  if (data.size() % size_ != 0)
    fail<invalid_argument>("dml::comm::mpi::", op, ": expected a size divisible by the group size ", size_,
                           ", found ", data.size());
  const std::size_t m = data.size() / size_;
  return data.subspan(m * rank_, m);
}

template <class T>
void mpi::check_received(const MPI_Status& st, std::size_t expected, int peer, int tag) {
  int got = 0;
  DML_CHECK_MPI(MPI_Get_count(&st, dt<T>(), &got));
  if (std::size_t(got) != expected * detail::mpi_impl::units<T>())
    fail<invalid_argument>("dml::comm::mpi::recv: expected ", expected, " elements from rank ", peer,
                           " with tag ", tag, ", the message has ", got / detail::mpi_impl::units<T>());
}

// With options::check_arguments, every rank compares (count, type, op, root) with every other:
// the max and the min of each must agree, else all ranks throw together.
template <class T>
void mpi::agree(const char* op, std::size_t n, reduce_op rop, int root) {
  if (!opt_.check_arguments) return;
  const long long mine[4] = {(long long)n, (long long)sizeof(T) * 16 + (long long)reducible<T>,
                             (long long)rop, root};
  long long both[8], out[8];
  for (int i = 0; i < 4; ++i) both[i] = mine[i], both[4 + i] = -mine[i];
  {
    detail::mpi_impl::watch w(*wd_, op);
    DML_CHECK_MPI(MPI_Allreduce(both, out, 8, MPI_LONG_LONG, MPI_MAX, comm_));
  }
  static constexpr const char* what[4] = {"count", "element type", "reduce_op", "root"};
  for (int i = 0; i < 4; ++i)
    if (out[i] != -out[4 + i])
      fail<invalid_argument>("dml::comm::mpi::", op, ": expected the same ", what[i],
                             " on every rank; found values from ", -out[4 + i], " to ", out[i],
                             " (this rank: ", mine[i], ")");
}

template <reducible T>
void mpi::prepare_all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op) {
  check_reduce<T>(op, "dml::comm::mpi::all_reduce");
  if (send.size() != recv.size())
    fail<invalid_argument>("dml::comm::mpi::all_reduce: expected recv of send's size ", send.size(), ", found ",
                           recv.size());
  agree<T>("all_reduce", send.size(), op, 0);
}
template <reducible T>
void mpi::prepare_reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
  check_reduce<T>(op, "dml::comm::mpi::reduce_scatter");
  if (send.size() != recv.size() * size_)
    fail<invalid_argument>("dml::comm::mpi::reduce_scatter: expected send of group size ", size_, " x recv size ",
                           recv.size(), " = ", recv.size() * size_, " elements, found ", send.size());
  agree<T>("reduce_scatter", recv.size(), op, 0);
}
template <class T>
void mpi::prepare_all_gather(std::span<const T> send, std::span<T> recv) {
  if (recv.size() != send.size() * size_)
    fail<invalid_argument>("dml::comm::mpi::all_gather: expected recv of group size ", size_, " x send size ",
                           send.size(), " = ", send.size() * size_, " elements, found ", recv.size());
  agree<T>("all_gather", send.size(), reduce_op::sum, 0);
}
template <reducible T>
void mpi::prepare_reduce(std::span<const T> send, std::span<T> recv, reduce_op op, int root) {
  check_reduce<T>(op, "dml::comm::mpi::reduce");
  check_rank(root, "reduce", "root");
  if (rank_ == root && recv.size() != send.size())
    fail<invalid_argument>("dml::comm::mpi::reduce: expected recv of send's size ", send.size(),
                           " at the root, found ", recv.size());
  agree<T>("reduce", send.size(), op, root);
}
template <class T>
int mpi::prepare_all_to_all(std::span<const T> send, std::span<T> recv) {
  if (send.size() % size_ != 0 || recv.size() != send.size())
    fail<invalid_argument>("dml::comm::mpi::all_to_all: expected send and recv of equal size divisible by the "
                           "group size ", size_, ", found ", send.size(), " and ", recv.size());
  agree<T>("all_to_all", send.size(), reduce_op::sum, 0);
  return count<T>(send.size() / size_, "all_to_all");
}

}  // namespace dml::comm
