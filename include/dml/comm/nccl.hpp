// SPDX-License-Identifier: Apache-2.0
// dml/comm/nccl.hpp — communicator over NCCL on GPUs, bootstrapped over comm::mpi.
// Sits on comm/mpi.hpp and the CUDA runtime; spans hold device memory. See DESIGN.md §4.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/comm/mpi.hpp"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#  error "dml::comm::nccl needs NCCL 2.18 or later (ncclCommSplit)"
#endif

namespace dml::comm::detail::nccl_impl {

[[noreturn]] inline void fail_nccl(ncclResult_t rc, const char* call, const char* file, int line) {
  throw comm_error(dml::detail::cat(file, ":", line, ": ", call, " failed: ", ncclGetErrorString(rc)));
}
[[noreturn]] inline void fail_cuda(cudaError_t rc, const char* call, const char* file, int line) {
  throw comm_error(dml::detail::cat(file, ":", line, ": ", call, " failed: ", cudaGetErrorString(rc)));
}

}  // namespace dml::comm::detail::nccl_impl

#define DML_CHECK_NCCL(expr)                                                                 \
  do {                                                                                       \
    const ncclResult_t dml_nccl_rc_ = (expr);                                                \
    if (dml_nccl_rc_ != ncclSuccess)                                                         \
      ::dml::comm::detail::nccl_impl::fail_nccl(dml_nccl_rc_, #expr, __FILE__, __LINE__);     \
  } while (0)
// core/error.hpp defines DML_CHECK_CUDA for nvcc; a g++ translation unit gets this one.
#ifndef DML_CHECK_CUDA
#  define DML_CHECK_CUDA(expr)                                                               \
    do {                                                                                     \
      const cudaError_t dml_cuda_rc_ = (expr);                                               \
      if (dml_cuda_rc_ != cudaSuccess)                                                       \
        ::dml::comm::detail::nccl_impl::fail_cuda(dml_cuda_rc_, #expr, __FILE__, __LINE__);   \
    } while (0)
#endif

namespace dml::comm {

namespace detail::nccl_impl {

template <class T>
ncclDataType_t datatype() {
  if constexpr (std::is_same_v<T, float>) return ncclFloat32;
  else if constexpr (std::is_same_v<T, double>) return ncclFloat64;
  else if constexpr (std::is_same_v<T, bf16>) return ncclBfloat16;
  else if constexpr (std::is_same_v<T, fp16>) return ncclFloat16;
  else if constexpr (std::is_same_v<T, std::int32_t>) return ncclInt32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return ncclInt64;
  else return ncclUint8;  // any other trivially copyable type moves as bytes
}
template <class T>
constexpr std::size_t units() {
  return reducible<T> ? 1 : sizeof(T);
}
inline ncclRedOp_t red_op(reduce_op op) {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::avg: return ncclAvg;
    case reduce_op::max: return ncclMax;
    case reduce_op::min: return ncclMin;
    case reduce_op::prod: return ncclProd;
  }
  return ncclSum;
}

// The communicator, its stream and a scratch word for barrier; shared with pending requests so
// that a timeout seen through a request can abort the communicator.
struct state {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  bool owns_stream = false;
  int* scratch = nullptr;
  int rank = 0, size = 1;
  std::chrono::milliseconds timeout{};
  bool aborted = false;

  ~state() {
    if (comm) {
      if (aborted) ncclCommAbort(comm);
      else ncclCommDestroy(comm);
    }
    if (scratch) cudaFree(scratch);
    if (owns_stream && stream) cudaStreamDestroy(stream);
  }

  [[noreturn]] void abort(const std::string& why) {
    if (comm && !aborted) {
      aborted = true;
      ncclCommAbort(comm);
      comm = nullptr;
    }
    throw comm_error(why);
  }

  // Sleeps between polls (a GPU collective can take long; a spinning host thread helps nobody),
  // watches NCCL's asynchronous errors, and aborts the communicator past the timeout.
  void wait(cudaEvent_t done, const char* op) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto nap = std::chrono::microseconds(2);
    for (;;) {
      const cudaError_t rc = cudaEventQuery(done);
      if (rc == cudaSuccess) return;
      if (rc != cudaErrorNotReady) fail_cuda(rc, "cudaEventQuery", __FILE__, __LINE__);
      if (aborted || !comm)
        throw comm_error(dml::detail::cat("dml::comm::nccl: rank ", rank, " in ", op, ": the communicator was aborted"));
      ncclResult_t async = ncclSuccess;
      DML_CHECK_NCCL(ncclCommGetAsyncError(comm, &async));
      if (async != ncclSuccess && async != ncclInProgress)
        abort(dml::detail::cat("dml::comm::nccl: rank ", rank, " of ", size, " in ", op, ": ",
                               ncclGetErrorString(async), "; the communicator was aborted"));
      if (std::chrono::steady_clock::now() > deadline)
        abort(dml::detail::cat("dml::comm::nccl: rank ", rank, " of ", size, ": ", op, " did not complete within ",
                               std::chrono::duration<double>(timeout).count(), " s; the communicator was aborted"));
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
  }
};

struct event_request final : request_state {
  std::shared_ptr<state> s;
  cudaEvent_t done = nullptr;
  const char* op = "";
  event_request(std::shared_ptr<state> st, const char* name) : s(std::move(st)), op(name) {
    DML_CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    DML_CHECK_CUDA(cudaEventRecord(done, s->stream));
  }
  ~event_request() override {
    if (done) cudaEventDestroy(done);
  }
  bool test() override {
    const cudaError_t rc = cudaEventQuery(done);
    if (rc == cudaErrorNotReady) return false;
    if (rc != cudaSuccess) fail_cuda(rc, "cudaEventQuery", __FILE__, __LINE__);
    return true;
  }
  void wait() override { s->wait(done, op); }
};

}  // namespace detail::nccl_impl

struct nccl_options {
  // A blocking call or wait() longer than this aborts the communicator and throws comm_error.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

// Operations are enqueued on stream() in call order. The i-forms return a request that completes
// when the GPU has finished (an event), so the host can compute meanwhile; the plain forms wait.
// NCCL has no message tags: send/recv between two ranks match in the order they are issued,
// and the tag argument is accepted for interface compatibility only.
class nccl {
 public:
  using options = nccl_options;

  // Collective over bootstrap's ranks, on the current CUDA device: rank 0 creates the unique id
  // and MPI broadcasts it. With no stream given, the communicator makes its own.
  explicit nccl(const mpi& bootstrap, cudaStream_t stream = nullptr, options opt = {})
      : s_(std::make_shared<detail::nccl_impl::state>()) {
    s_->rank = bootstrap.rank();
    s_->size = bootstrap.size();
    s_->timeout = opt.timeout;
    ncclUniqueId id{};
    if (s_->rank == 0) DML_CHECK_NCCL(ncclGetUniqueId(&id));
    DML_CHECK_MPI(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, bootstrap.native()));
    DML_CHECK_NCCL(ncclCommInitRank(&s_->comm, s_->size, id, s_->rank));
    init_stream(stream);
  }

  nccl(nccl&&) noexcept = default;
  nccl& operator=(nccl&&) noexcept = default;

  int rank() const noexcept { return s_->rank; }
  int size() const noexcept { return s_->size; }
  ncclComm_t native() const noexcept { return s_->comm; }
  cudaStream_t stream() const noexcept { return s_->stream; }

  // ---- all_reduce
  template <reducible T>
  request iall_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    check_reduce<T>(op, "dml::comm::nccl::all_reduce");
    expect_size("all_reduce", "recv", recv.size(), send.size());
    DML_CHECK_NCCL(ncclAllReduce(send.data(), recv.data(), recv.size(), dt<T>(), red(op), comm(), stream()));
    return done("all_reduce");
  }
  template <reducible T>
  request iall_reduce(std::span<T> data, reduce_op op) {
    return iall_reduce(std::span<const T>(data), data, op);
  }
  template <reducible T>
  void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    iall_reduce(send, recv, op).wait();
  }
  template <reducible T>
  void all_reduce(std::span<T> data, reduce_op op) {
    iall_reduce(data, op).wait();
  }

  // ---- reduce_scatter
  template <reducible T>
  request ireduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    check_reduce<T>(op, "dml::comm::nccl::reduce_scatter");
    expect_size("reduce_scatter", "send", send.size(), recv.size() * size());
    DML_CHECK_NCCL(ncclReduceScatter(send.data(), recv.data(), recv.size(), dt<T>(), red(op), comm(), stream()));
    return done("reduce_scatter");
  }
  template <reducible T>
  void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    ireduce_scatter(send, recv, op).wait();
  }
  // In place: the result lands in block rank() of data (returned).
  template <reducible T>
  std::span<T> reduce_scatter(std::span<T> data, reduce_op op) {
    auto mine = own_block(data, "reduce_scatter");
    ireduce_scatter(std::span<const T>(data), mine, op).wait();
    return mine;
  }

  // ---- all_gather
  template <transferable T>
  request iall_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    expect_size("all_gather", "recv", recv.size(), send.size() * size());
    DML_CHECK_NCCL(ncclAllGather(send.data(), recv.data(), send.size() * units<T>(), dt<T>(), comm(), stream()));
    return done("all_gather");
  }
  template <transferable T>
  void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    iall_gather(send, recv).wait();
  }
  template <transferable T>
  void all_gather(std::span<T> data) {
    auto mine = own_block(data, "all_gather");
    iall_gather(std::span<const T>(mine), data).wait();
  }
  // One broadcast per rank, fused in a group.
  template <transferable T>
  void all_gatherv(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                   std::span<const std::size_t> counts) {
    expect_size("all_gatherv", "counts", counts.size(), std::size_t(size()));
    expect_size("all_gatherv", "send", send.size(), counts[rank()]);
    expect_size("all_gatherv", "recv", recv.size(), std::accumulate(counts.begin(), counts.end(), std::size_t(0)));
    DML_CHECK_NCCL(ncclGroupStart());
    std::size_t off = 0;
    for (int p = 0; p < size(); ++p) {
      const ncclResult_t rc = ncclBroadcast(p == rank() ? static_cast<const void*>(send.data()) : nullptr,
                                            recv.data() + off, counts[p] * units<T>(), dt<T>(), p, comm(), stream());
      if (rc != ncclSuccess) {
        ncclGroupEnd();
        DML_CHECK_NCCL(rc);
      }
      off += counts[p];
    }
    DML_CHECK_NCCL(ncclGroupEnd());
    done("all_gatherv").wait();
  }

  // ---- broadcast
  template <transferable T>
  request ibroadcast(std::span<T> data, int root) {
    check_rank(root, "broadcast", "root");
    DML_CHECK_NCCL(ncclBroadcast(data.data(), data.data(), data.size() * units<T>(), dt<T>(), root, comm(), stream()));
    return done("broadcast");
  }
  template <transferable T>
  void broadcast(std::span<T> data, int root) {
    ibroadcast(data, root).wait();
  }

  // ---- reduce (recv is used at the root only)
  template <reducible T>
  request ireduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op, int root) {
    check_reduce<T>(op, "dml::comm::nccl::reduce");
    check_rank(root, "reduce", "root");
    if (rank() == root) expect_size("reduce", "recv", recv.size(), send.size());
    DML_CHECK_NCCL(ncclReduce(send.data(), rank() == root ? recv.data() : nullptr, send.size(), dt<T>(), red(op),
                              root, comm(), stream()));
    return done("reduce");
  }
  template <reducible T>
  void reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op, int root) {
    ireduce(send, recv, op, root).wait();
  }
  template <reducible T>
  void reduce(std::span<T> data, reduce_op op, int root) {
    ireduce(std::span<const T>(data), rank() == root ? data : std::span<T>{}, op, root).wait();
  }

  // ---- all_to_all and all_to_allv: grouped point-to-point
  template <transferable T>
  request iall_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    if (send.size() % size() != 0 || recv.size() != send.size())
      fail<invalid_argument>("dml::comm::nccl::all_to_all: expected send and recv of equal size divisible by the "
                             "group size ", size(), ", found ", send.size(), " and ", recv.size());
    const std::size_t m = send.size() / size();
    std::vector<std::size_t> counts(size(), m);
    exchange("all_to_all", send, counts, recv, counts);
    return done("all_to_all");
  }
  template <transferable T>
  void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    iall_to_all(send, recv).wait();
  }
  template <transferable T>
  void all_to_allv(std::span<const std::type_identity_t<T>> send, std::span<const std::size_t> send_counts,
                   std::span<T> recv, std::span<const std::size_t> recv_counts) {
    expect_size("all_to_allv", "send_counts", send_counts.size(), std::size_t(size()));
    expect_size("all_to_allv", "recv_counts", recv_counts.size(), std::size_t(size()));
    expect_size("all_to_allv", "send", send.size(), std::accumulate(send_counts.begin(), send_counts.end(), std::size_t(0)));
    expect_size("all_to_allv", "recv", recv.size(), std::accumulate(recv_counts.begin(), recv_counts.end(), std::size_t(0)));
    exchange("all_to_allv", send, send_counts, recv, recv_counts);
    done("all_to_allv").wait();
  }

  // ---- point to point (tag unused: see the class comment)
  template <transferable T>
  request isend(std::span<const T> data, int peer, int /*tag*/) {
    check_rank(peer, "send", "peer");
    DML_CHECK_NCCL(ncclSend(data.data(), data.size() * units<T>(), dt<T>(), peer, comm(), stream()));
    return done("send");
  }
  template <transferable T>
  request isend(std::span<T> data, int peer, int tag) {
    return isend(std::span<const T>(data), peer, tag);
  }
  template <transferable T>
  void send(std::span<const T> data, int peer, int tag) {
    isend(data, peer, tag).wait();
  }
  template <transferable T>
  void send(std::span<T> data, int peer, int tag) {
    isend(std::span<const T>(data), peer, tag).wait();
  }
  template <transferable T>
  request irecv(std::span<T> data, int peer, int /*tag*/) {
    check_rank(peer, "recv", "peer");
    DML_CHECK_NCCL(ncclRecv(data.data(), data.size() * units<T>(), dt<T>(), peer, comm(), stream()));
    return done("recv");
  }
  template <transferable T>
  void recv(std::span<T> data, int peer, int tag) {
    irecv(data, peer, tag).wait();
  }

  void barrier() {
    DML_CHECK_NCCL(ncclAllReduce(s_->scratch, s_->scratch, 1, ncclInt32, ncclSum, comm(), stream()));
    done("barrier").wait();
  }

  // Ranks with the same color form a group, ordered by (key, rank); the new communicator gets
  // its own stream so that groups can run concurrently. Collective.
  nccl split(int color, int key) const {
    if (color < 0) fail<invalid_argument>("dml::comm::nccl::split: expected a color >= 0, found ", color);
    nccl out;
    out.s_->timeout = s_->timeout;
    DML_CHECK_NCCL(ncclCommSplit(comm(), color, key, &out.s_->comm, nullptr));
    DML_CHECK_NCCL(ncclCommCount(out.s_->comm, &out.s_->size));
    DML_CHECK_NCCL(ncclCommUserRank(out.s_->comm, &out.s_->rank));
    out.init_stream(nullptr);
    return out;
  }

 private:
  nccl() : s_(std::make_shared<detail::nccl_impl::state>()) {}

  void init_stream(cudaStream_t stream) {
    if (stream) {
      s_->stream = stream;
    } else {
      DML_CHECK_CUDA(cudaStreamCreateWithFlags(&s_->stream, cudaStreamNonBlocking));
      s_->owns_stream = true;
    }
    DML_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&s_->scratch), sizeof(int)));
  }

  ncclComm_t comm() const {
    if (!s_->comm || s_->aborted)
      fail<comm_error>("dml::comm::nccl: rank ", s_->rank, ": the communicator was aborted");
    return s_->comm;
  }
  template <class T>
  static ncclDataType_t dt() {
    return detail::nccl_impl::datatype<T>();
  }
  template <class T>
  static constexpr std::size_t units() {
    return detail::nccl_impl::units<T>();
  }
  static ncclRedOp_t red(reduce_op op) { return detail::nccl_impl::red_op(op); }

  request done(const char* op) {
    return request(std::make_unique<detail::nccl_impl::event_request>(s_, op));
  }

  void expect_size(const char* op, const char* what, std::size_t found, std::size_t expected) const {
    if (found != expected)
      fail<invalid_argument>("dml::comm::nccl::", op, ": expected ", what, " of ", expected, " elements, found ",
                             found);
  }
  void check_rank(int r, const char* op, const char* what) const {
    if (r < 0 || r >= size())
      fail<invalid_argument>("dml::comm::nccl::", op, ": expected a ", what, " in [0, ", size(), "), found ", r);
  }
  template <class T>
  std::span<T> own_block(std::span<T> data, const char* op) const {
    if (data.size() % size() != 0)
      fail<invalid_argument>("dml::comm::nccl::", op, ": expected a size divisible by the group size ", size(),
                             ", found ", data.size());
    const std::size_t m = data.size() / size();
    return data.subspan(m * rank(), m);
  }

  template <class T>
  void exchange(const char* op, std::span<const T> send, std::span<const std::size_t> sc, std::span<T> recv,
                std::span<const std::size_t> rc) {
    if (!send.empty() && static_cast<const void*>(send.data()) == static_cast<const void*>(recv.data()))
      fail<invalid_argument>("dml::comm::nccl::", op, ": expected distinct send and recv buffers, found the same");
    DML_CHECK_NCCL(ncclGroupStart());
    std::size_t so = 0, ro = 0;
    ncclResult_t rc_all = ncclSuccess;
    for (int p = 0; p < size() && rc_all == ncclSuccess; ++p) {
      if (sc[p]) rc_all = ncclSend(send.data() + so, sc[p] * units<T>(), dt<T>(), p, comm(), stream());
      if (rc_all == ncclSuccess && rc[p])
        rc_all = ncclRecv(recv.data() + ro, rc[p] * units<T>(), dt<T>(), p, comm(), stream());
      so += sc[p];
      ro += rc[p];
    }
    const ncclResult_t end = ncclGroupEnd();
    DML_CHECK_NCCL(rc_all);
    DML_CHECK_NCCL(end);
  }

  std::shared_ptr<detail::nccl_impl::state> s_;
};

static_assert(diagnose_communicator<nccl>());

}  // namespace dml::comm
