// SPDX-License-Identifier: Apache-2.0
// dml/comm/mpi.hpp — communicator over an MPI communicator: one rank per process (Open MPI).
// Sits on comm/communicator.hpp; how CPU training scales past one process. See DESIGN.md §4.
// Its parts, in comm/detail/: mpi_types.hpp (datatypes, ops, DML_CHECK_MPI), mpi_watchdog.hpp (timeouts, lost
// peers, requests) and mpi_checks.hpp (argument checks).
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/comm/detail/checks.hpp"
#include "dml/comm/detail/mpi_types.hpp"
#include "dml/comm/detail/mpi_watchdog.hpp"
#include "dml/comm/detail/reduce.hpp"

namespace dml::comm {

// Outside the class so that `options opt = {}` works as a default argument inside it.
struct mpi_options {
  // A collective or wait running longer than this aborts the whole job (see watchdog).
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // An operation that has waited this long while the process of a peer on this host is gone ends
  // the job with an error naming the operation and the peer (MPI_Abort, exit status 125). 0: never.
  std::chrono::milliseconds peer_check{std::chrono::seconds(1)};
  // On SIGTERM (how mpirun ends the other ranks when one dies), print the operation in flight and
  // the peers on this host that are gone, then let the signal take its course. See "Losing a peer".
  bool report_on_sigterm = true;
  // Compare counts, types, ops and roots across ranks before each collective, so a mismatch
  // is an invalid_argument on every rank instead of undefined behaviour. Costs one small
  // all-reduce per collective; off by default.
  bool check_arguments = false;
};


class mpi {
 public:
  using options = mpi_options;
  using space = dml::host;  // Debian's Open MPI is not CUDA-aware: host memory only

  // Initialises MPI for the process's lifetime (MPI_THREAD_MULTIPLE asked for: the watchdog
  // calls MPI_Abort from its own thread); finalises it unless someone else had initialised it.
  class environment {
   public:
    environment(int* argc, char*** argv, int required = MPI_THREAD_MULTIPLE) {
      int inited = 0;
      MPI_Initialized(&inited);
      if (inited) {
        MPI_Query_thread(&provided_);
        return;
      }
      DML_CHECK_MPI(MPI_Init_thread(argc, argv, required, &provided_));
      owned_ = true;
    }
    environment() : environment(nullptr, nullptr) {}
    environment(const environment&) = delete;
    environment& operator=(const environment&) = delete;
    ~environment() {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (owned_ && !finalized) MPI_Finalize();
    }
    int provided() const { return provided_; }

   private:
    int provided_ = 0;
    bool owned_ = false;
  };

  // Borrows comm (it must outlive this object). Sets MPI_ERRORS_RETURN on it so that MPI errors
  // become comm_error instead of aborting. Collective: the ranks tell each other who they are
  // (process, host), so that a rank can name a peer it has lost.
  explicit mpi(MPI_Comm comm = MPI_COMM_WORLD, options opt = {}) : comm_(comm), opt_(opt) {
    DML_CHECK_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    DML_CHECK_MPI(MPI_Comm_rank(comm_, &rank_));
    DML_CHECK_MPI(MPI_Comm_size(comm_, &size_));
    wd_ = std::make_shared<detail::mpi_impl::watchdog>(rank_, size_, opt_.timeout, opt_.peer_check,
                                                       opt_.report_on_sigterm);
    using detail::mpi_impl::process_id;
    const process_id me = detail::mpi_impl::this_process();
    std::vector<process_id> peers(static_cast<std::size_t>(size_));
    {
      detail::mpi_impl::watch w(*wd_, "construction");
      DML_CHECK_MPI(MPI_Allgather(&me, int(sizeof me), MPI_BYTE, peers.data(), int(sizeof me), MPI_BYTE, comm_));
    }
    wd_->set_peers(std::move(peers));
  }
  // Takes ownership: comm is freed with MPI_Comm_free when this object goes.
  static mpi adopt(MPI_Comm comm, options opt = {}) {
    mpi m(comm, opt);
    m.owned_ = true;
    return m;
  }
  mpi(mpi&& o) noexcept
      : comm_(std::exchange(o.comm_, MPI_COMM_NULL)), owned_(std::exchange(o.owned_, false)),
        rank_(o.rank_), size_(o.size_), opt_(o.opt_), wd_(std::move(o.wd_)) {}
  mpi& operator=(mpi&& o) noexcept {
    if (this != &o) {
      release();
      comm_ = std::exchange(o.comm_, MPI_COMM_NULL);
      owned_ = std::exchange(o.owned_, false);
      rank_ = o.rank_;
      size_ = o.size_;
      opt_ = o.opt_;
      wd_ = std::move(o.wd_);
    }
    return *this;
  }
  ~mpi() { release(); }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  MPI_Comm native() const noexcept { return comm_; }

  // ---- all_reduce (in place when send and recv are the same memory)
  template <reducible T>
  void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    prepare_all_reduce<T>(send, recv, op);
    {
      detail::mpi_impl::watch w(*wd_, "all_reduce");
      DML_CHECK_MPI(MPI_Allreduce(in_place(send.data(), recv.data()), recv.data(),
                                  count<T>(recv.size(), "all_reduce"), dt<T>(),
                                  detail::mpi_impl::mpi_op<T>(op), comm_));
    }
    if (op == reduce_op::avg) detail::mpi_impl::divide(recv, size_);
  }
  template <reducible T>
  void all_reduce(std::span<T> data, reduce_op op) {
    all_reduce(std::span<const T>(data), data, op);
  }
  template <reducible T>
  request iall_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    prepare_all_reduce<T>(send, recv, op);
    auto s = state("all_reduce");
    DML_CHECK_MPI(MPI_Iallreduce(in_place(send.data(), recv.data()), recv.data(),
                                 count<T>(recv.size(), "all_reduce"), dt<T>(),
                                 detail::mpi_impl::mpi_op<T>(op), comm_, &s->req));
    if (op == reduce_op::avg) s->after = [recv, n = size_](const MPI_Status&) { detail::mpi_impl::divide(recv, n); };
    return request(std::move(s));
  }
  template <reducible T>
  request iall_reduce(std::span<T> data, reduce_op op) {
    return iall_reduce(std::span<const T>(data), data, op);
  }

  // ---- reduce_scatter: send holds size() blocks of recv's size.
  template <reducible T>
  void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    prepare_reduce_scatter<T>(send, recv, op);
    {
      detail::mpi_impl::watch w(*wd_, "reduce_scatter");
      DML_CHECK_MPI(MPI_Reduce_scatter_block(send.data(), recv.data(), count<T>(recv.size(), "reduce_scatter"),
                                             dt<T>(), detail::mpi_impl::mpi_op<T>(op), comm_));
    }
    if (op == reduce_op::avg) detail::mpi_impl::divide(recv, size_);
  }
  // In place: the result lands in block rank() of data (returned); other blocks are left
  // with unspecified values.
  template <reducible T>
  std::span<T> reduce_scatter(std::span<T> data, reduce_op op) {
    const auto mine = own_block(data, "reduce_scatter");
    prepare_reduce_scatter<T>(std::span<const T>(data), mine, op);
    {
      detail::mpi_impl::watch w(*wd_, "reduce_scatter");
      // MPI leaves an in-place result at the front of the buffer.
      DML_CHECK_MPI(MPI_Reduce_scatter_block(MPI_IN_PLACE, data.data(), count<T>(mine.size(), "reduce_scatter"),
                                             dt<T>(), detail::mpi_impl::mpi_op<T>(op), comm_));
    }
    if (rank_ != 0 && !mine.empty()) std::memmove(mine.data(), data.data(), mine.size_bytes());
    if (op == reduce_op::avg) detail::mpi_impl::divide(mine, size_);
    return mine;
  }
  template <reducible T>
  request ireduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    prepare_reduce_scatter<T>(send, recv, op);
    auto s = state("reduce_scatter");
    DML_CHECK_MPI(MPI_Ireduce_scatter_block(send.data(), recv.data(), count<T>(recv.size(), "reduce_scatter"),
                                            dt<T>(), detail::mpi_impl::mpi_op<T>(op), comm_, &s->req));
    if (op == reduce_op::avg) s->after = [recv, n = size_](const MPI_Status&) { detail::mpi_impl::divide(recv, n); };
    return request(std::move(s));
  }

  // ---- all_gather: recv holds size() blocks of send's size.
  template <transferable T>
  void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    prepare_all_gather<T>(send, recv);
    detail::mpi_impl::watch w(*wd_, "all_gather");
    DML_CHECK_MPI(MPI_Allgather(gather_in_place(send, recv), count<T>(send.size(), "all_gather"), dt<T>(),
                                recv.data(), count<T>(send.size(), "all_gather"), dt<T>(), comm_));
  }
  template <transferable T>
  void all_gather(std::span<T> data) {
    auto mine = own_block(data, "all_gather");
    all_gather(std::span<const T>(mine), data);
  }
  template <transferable T>
  request iall_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    prepare_all_gather<T>(send, recv);
    auto s = state("all_gather");
    DML_CHECK_MPI(MPI_Iallgather(gather_in_place(send, recv), count<T>(send.size(), "all_gather"), dt<T>(),
                                 recv.data(), count<T>(send.size(), "all_gather"), dt<T>(), comm_, &s->req));
    return request(std::move(s));
  }
  template <transferable T>
  void all_gatherv(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                   std::span<const std::size_t> counts) {
    const auto off = checks().all_gatherv(send, recv, counts);
    std::vector<int> c(size_), d(size_);
    for (int p = 0; p < size_; ++p) {
      c[p] = count<T>(counts[p], "all_gatherv");
      d[p] = count<T>(off[p], "all_gatherv");
    }
    agree<T>("all_gatherv", 0, reduce_op::sum, 0);
    const void* in = send.data() == recv.data() + (d[rank_] / detail::mpi_impl::units<T>())
                         ? MPI_IN_PLACE : static_cast<const void*>(send.data());
    detail::mpi_impl::watch w(*wd_, "all_gatherv");
    DML_CHECK_MPI(MPI_Allgatherv(in, c[rank_], dt<T>(), recv.data(), c.data(), d.data(), dt<T>(), comm_));
  }

  // ---- broadcast
  template <transferable T>
  void broadcast(std::span<T> data, int root) {
    check_rank(root, "broadcast", "root");
    agree<T>("broadcast", data.size(), reduce_op::sum, root);
    detail::mpi_impl::watch w(*wd_, "broadcast");
    DML_CHECK_MPI(MPI_Bcast(data.data(), count<T>(data.size(), "broadcast"), dt<T>(), root, comm_));
  }
  template <transferable T>
  request ibroadcast(std::span<T> data, int root) {
    check_rank(root, "broadcast", "root");
    agree<T>("broadcast", data.size(), reduce_op::sum, root);
    auto s = state("broadcast");
    DML_CHECK_MPI(MPI_Ibcast(data.data(), count<T>(data.size(), "broadcast"), dt<T>(), root, comm_, &s->req));
    return request(std::move(s));
  }

  // ---- reduce to root (recv is read at the root only)
  template <reducible T>
  void reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op, int root) {
    prepare_reduce<T>(send, recv, op, root);
    {
      detail::mpi_impl::watch w(*wd_, "reduce");
      DML_CHECK_MPI(MPI_Reduce(rank_ == root ? in_place(send.data(), recv.data()) : send.data(),
                               recv.data(), count<T>(send.size(), "reduce"), dt<T>(),
                               detail::mpi_impl::mpi_op<T>(op), root, comm_));
    }
    if (op == reduce_op::avg && rank_ == root) detail::mpi_impl::divide(recv, size_);
  }
  template <reducible T>
  void reduce(std::span<T> data, reduce_op op, int root) {
    reduce(std::span<const T>(data), rank_ == root ? data : std::span<T>{}, op, root);
  }
  template <reducible T>
  request ireduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op, int root) {
    prepare_reduce<T>(send, recv, op, root);
    auto s = state("reduce");
    DML_CHECK_MPI(MPI_Ireduce(rank_ == root ? in_place(send.data(), recv.data()) : send.data(), recv.data(),
                              count<T>(send.size(), "reduce"), dt<T>(), detail::mpi_impl::mpi_op<T>(op),
                              root, comm_, &s->req));
    if (op == reduce_op::avg && rank_ == root)
      s->after = [recv, n = size_](const MPI_Status&) { detail::mpi_impl::divide(recv, n); };
    return request(std::move(s));
  }

  // ---- all_to_all: block p of send to rank p, block p of recv from rank p.
  template <transferable T>
  void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    const int c = prepare_all_to_all<T>(send, recv);
    detail::mpi_impl::watch w(*wd_, "all_to_all");
    DML_CHECK_MPI(MPI_Alltoall(in_place(send.data(), recv.data()), c, dt<T>(), recv.data(), c, dt<T>(), comm_));
  }
  template <transferable T>
  request iall_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    const int c = prepare_all_to_all<T>(send, recv);
    auto s = state("all_to_all");
    DML_CHECK_MPI(MPI_Ialltoall(in_place(send.data(), recv.data()), c, dt<T>(), recv.data(), c, dt<T>(), comm_,
                                &s->req));
    return request(std::move(s));
  }
  template <transferable T>
  void all_to_allv(std::span<const std::type_identity_t<T>> send, std::span<const std::size_t> send_counts,
                   std::span<T> recv, std::span<const std::size_t> recv_counts) {
    checks().all_to_allv(send, send_counts, recv, recv_counts);
    std::vector<int> sc(size_), sd(size_), rc(size_), rd(size_);
    std::size_t so = 0, ro = 0;
    for (int p = 0; p < size_; ++p) {
      sc[p] = count<T>(send_counts[p], "all_to_allv");
      sd[p] = count<T>(so, "all_to_allv");
      rc[p] = count<T>(recv_counts[p], "all_to_allv");
      rd[p] = count<T>(ro, "all_to_allv");
      so += send_counts[p];
      ro += recv_counts[p];
    }
    if (opt_.check_arguments) {
      // what each rank sends to me must be what I expect from it
      std::vector<int> incoming(size_);
      {
        detail::mpi_impl::watch w(*wd_, "all_to_allv");
        DML_CHECK_MPI(MPI_Alltoall(sc.data(), 1, MPI_INT, incoming.data(), 1, MPI_INT, comm_));
      }
      long long bad = -1;
      for (int p = 0; p < size_; ++p)
        if (incoming[p] != rc[p]) bad = p;
      long long worst = bad;
      {
        detail::mpi_impl::watch w(*wd_, "all_to_allv");
        DML_CHECK_MPI(MPI_Allreduce(&bad, &worst, 1, MPI_LONG_LONG, MPI_MAX, comm_));
      }
      if (worst >= 0)
        fail<invalid_argument>("dml::comm::mpi::all_to_allv: send and receive counts disagree",
                               bad >= 0 ? dml::detail::cat("; rank ", bad, " sends ", incoming[bad],
                                                           " elements to rank ", rank_, ", which expects ", rc[bad])
                                        : std::string());
    }
    detail::mpi_impl::watch w(*wd_, "all_to_allv");
    DML_CHECK_MPI(MPI_Alltoallv(in_place(send.data(), recv.data()), sc.data(), sd.data(), dt<T>(), recv.data(),
                                rc.data(), rd.data(), dt<T>(), comm_));
  }

  // ---- point to point
  template <transferable T>
  void send(std::span<const T> data, int peer, int tag) {
    check_rank(peer, "send", "peer");
    detail::mpi_impl::watch w(*wd_, "send");
    DML_CHECK_MPI(MPI_Send(data.data(), count<T>(data.size(), "send"), dt<T>(), peer, tag, comm_));
  }
  template <transferable T>
  void send(std::span<T> data, int peer, int tag) {
    send(std::span<const T>(data), peer, tag);
  }
  template <transferable T>
  request isend(std::span<const T> data, int peer, int tag) {
    check_rank(peer, "send", "peer");
    auto s = state("send");
    DML_CHECK_MPI(MPI_Isend(data.data(), count<T>(data.size(), "send"), dt<T>(), peer, tag, comm_, &s->req));
    return request(std::move(s));
  }
  template <transferable T>
  request isend(std::span<T> data, int peer, int tag) {
    return isend(std::span<const T>(data), peer, tag);
  }
  template <transferable T>
  void recv(std::span<T> data, int peer, int tag) {
    check_rank(peer, "recv", "peer");
    MPI_Status st;
    {
      detail::mpi_impl::watch w(*wd_, "recv");
      DML_CHECK_MPI(MPI_Recv(data.data(), count<T>(data.size(), "recv"), dt<T>(), peer, tag, comm_, &st));
    }
    check_received<T>(st, data.size(), peer, tag);
  }
  template <transferable T>
  request irecv(std::span<T> data, int peer, int tag) {
    check_rank(peer, "recv", "peer");
    auto s = state("recv");
    s->receive = true;
    DML_CHECK_MPI(MPI_Irecv(data.data(), count<T>(data.size(), "recv"), dt<T>(), peer, tag, comm_, &s->req));
    s->after = [n = data.size(), peer, tag](const MPI_Status& st) { check_received<T>(st, n, peer, tag); };
    return request(std::move(s));
  }

  void barrier() {
    detail::mpi_impl::watch w(*wd_, "barrier");
    DML_CHECK_MPI(MPI_Barrier(comm_));
  }

  // Ranks with the same color form a group, ordered by (key, rank). Collective.
  mpi split(int color, int key) const {
    if (color < 0) fail<invalid_argument>("dml::comm::mpi::split: expected a color >= 0, found ", color);
    MPI_Comm out = MPI_COMM_NULL;
    {
      detail::mpi_impl::watch w(*wd_, "split");
      DML_CHECK_MPI(MPI_Comm_split(comm_, color, key, &out));
    }
    return adopt(out, opt_);
  }

 private:
  template <class T>
  static MPI_Datatype dt() {
    return detail::mpi_impl::datatype<T>();
  }
  template <class T>
  static int count(std::size_t n, const char* op) {
    return detail::mpi_impl::count<T>(n, op);
  }
  static const void* in_place(const void* send, const void* recv) {
    return send == recv ? MPI_IN_PLACE : send;
  }
  template <class T>
  const void* gather_in_place(std::span<const T> send, std::span<T> recv) const {
    return !send.empty() && send.data() == recv.data() + send.size() * rank_ ? MPI_IN_PLACE
                                                                            : static_cast<const void*>(send.data());
  }

  std::unique_ptr<detail::mpi_impl::request_state_mpi> state(const char* op) const {
    auto s = std::make_unique<detail::mpi_impl::request_state_mpi>();
    s->wd = wd_;
    s->op = op;
    return s;
  }

  void release() noexcept {
    wd_.reset();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
    owned_ = false;
  }

  // Argument checks: comm/detail/mpi_checks.hpp, on comm/detail/checks.hpp.
  detail::arg_checks checks() const { return {"dml::comm::mpi", rank_, size_}; }
  void check_rank(int r, const char* op, const char* what) const;
  template <class T>
  std::span<T> own_block(std::span<T> data, const char* op) const;
  template <class T>
  static void check_received(const MPI_Status& st, std::size_t expected, int peer, int tag);
  template <class T>
  void agree(const char* op, std::size_t n, reduce_op rop, int root);
  template <reducible T>
  void prepare_all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op);
  template <reducible T>
  void prepare_reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op);
  template <class T>
  void prepare_all_gather(std::span<const T> send, std::span<T> recv);
  template <reducible T>
  void prepare_reduce(std::span<const T> send, std::span<T> recv, reduce_op op, int root);
  template <class T>
  int prepare_all_to_all(std::span<const T> send, std::span<T> recv);

  MPI_Comm comm_ = MPI_COMM_NULL;
  bool owned_ = false;
  int rank_ = 0;
  int size_ = 1;
  options opt_;
  std::shared_ptr<detail::mpi_impl::watchdog> wd_;
};

static_assert(diagnose_communicator<mpi>());

// This process's rank among the processes of its node, and how many there are (MPI's shared-memory split):
// what picks a rank's GPU. Collective over comm.
struct node_place {
  int rank = 0, size = 1;
};
inline node_place place_on_node(MPI_Comm comm) {
  int rank = 0;
  DML_CHECK_MPI(MPI_Comm_rank(comm, &rank));
  MPI_Comm node = MPI_COMM_NULL;
  DML_CHECK_MPI(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
  node_place out;
  MPI_Comm_rank(node, &out.rank);
  MPI_Comm_size(node, &out.size);
  MPI_Comm_free(&node);
  return out;
}

}  // namespace dml::comm

// The members declared above and defined out of the class.
#include "dml/comm/detail/mpi_checks.hpp"
