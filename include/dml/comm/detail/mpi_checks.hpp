// SPDX-License-Identifier: Apache-2.0
// dml/comm/detail/mpi_checks.hpp — comm::mpi's argument checks: ranks, block sizes and received counts on each rank,
// and with options::check_arguments the cross-rank agreement of counts, types, ops and roots. The per-rank checks are
// comm/detail/checks.hpp's, which comm::gloo shares.
// Sits on comm/mpi.hpp, which declares these members; used by comm/mpi.hpp, which includes it at its end (included
// alone, it includes comm/mpi.hpp first).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <span>

#include "dml/comm/mpi.hpp"

namespace dml::comm {

inline void mpi::check_rank(int r, const char* op, const char* what) const { checks().rank_in_range(r, op, what); }
template <class T>
std::span<T> mpi::own_block(std::span<T> data, const char* op) const {
  return checks().own_block(data, op);
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
  checks().all_reduce<T>(send, recv, op);
  agree<T>("all_reduce", send.size(), op, 0);
}
template <reducible T>
void mpi::prepare_reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
  checks().reduce_scatter<T>(send, recv, op);
  agree<T>("reduce_scatter", recv.size(), op, 0);
}
template <class T>
void mpi::prepare_all_gather(std::span<const T> send, std::span<T> recv) {
  checks().all_gather(send, recv);
  agree<T>("all_gather", send.size(), reduce_op::sum, 0);
}
template <reducible T>
void mpi::prepare_reduce(std::span<const T> send, std::span<T> recv, reduce_op op, int root) {
  checks().reduce<T>(send, recv, op, root);
  agree<T>("reduce", send.size(), op, root);
}
template <class T>
int mpi::prepare_all_to_all(std::span<const T> send, std::span<T> recv) {
  const std::size_t block = checks().all_to_all(send, recv);
  agree<T>("all_to_all", send.size(), reduce_op::sum, 0);
  return count<T>(block, "all_to_all");
}

}  // namespace dml::comm
