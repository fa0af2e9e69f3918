// SPDX-License-Identifier: Apache-2.0
// dml/comm/nccl.hpp — communicator over NCCL on GPUs, bootstrapped over comm::mpi or from a unique id that a
// coordinator hands out. Sits on comm/mpi.hpp, core/stream.hpp and the CUDA runtime; it moves device memory
// (dml::device_span) and keeps the order contract of comm/communicator.hpp against the compute stream. Its NCCL
// communicators are non-blocking (config.blocking = 0), so that initialisation, enqueueing and shrinking are
// bounded by the timeout too; abort() and shrink() are the recovery of DESIGN.md §11. See DESIGN.md §4.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/comm/mpi.hpp"
#include "dml/core/space.hpp"
#include "dml/core/stream.hpp"

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

// A point-to-point transfer posted by isend or irecv and not yet issued: they are issued together, as one
// NCCL group, at the next wait, test or operation on the communicator.
struct pending_p2p {
  bool send = false;
  void* data = nullptr;
  std::size_t count = 0;
  ncclDataType_t type = ncclUint8;
  int peer = 0;
};
// The posts issued by one flush share its completion event.
struct p2p_batch {
  cudaEvent_t done = nullptr;
  bool issued = false;
  std::string failed;  // why issuing it failed: every request of the batch throws it
  ~p2p_batch() {
    if (done) cudaEventDestroy(done);
  }
};

// The communicator, its stream, a scratch word for barrier and the posts not yet issued; shared with
// pending requests so that a timeout seen through a request can abort the communicator.
struct state {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  bool owns_stream = false;
  int* scratch = nullptr;
  cudaEvent_t input_ready = nullptr;
  int rank = 0, size = 1;
  std::chrono::milliseconds timeout{};
  std::atomic<bool> aborted{false};
  // Guards comm against abort() from another thread while a thread uses it (live, wait, settle).
  mutable std::mutex lifetime;
  std::vector<pending_p2p> pending;
  std::shared_ptr<p2p_batch> batch;

  // A communicator that does not finalise within the timeout (a peer gone) is aborted instead.
  ~state() {
    if (comm) {
      bool clean = false;
      try {
        clean = poll(ncclCommFinalize(comm), "finalisation") == ncclSuccess;
      } catch (...) {
      }
      if (clean) ncclCommDestroy(comm);
      else ncclCommAbort(comm);
    }
    if (scratch) cudaFree(scratch);
    if (input_ready) cudaEventDestroy(input_ready);
    if (owns_stream && stream) cudaStreamDestroy(stream);
  }

  ncclComm_t live() const {
    std::lock_guard lock(lifetime);
    if (!comm || aborted) fail<comm_error>("dml::comm::nccl: rank ", rank, ": the communicator was aborted");
    return comm;
  }

  // NCCL's state of the communicator, read under the lock; throws once it was aborted.
  ncclResult_t async_state(const char* op) {
    std::lock_guard lock(lifetime);
    if (aborted || !comm)
      throw comm_error(dml::detail::cat("dml::comm::nccl: rank ", rank, " in ", op, ": the communicator was aborted"));
    ncclResult_t async = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(comm, &async);
    return rc == ncclSuccess ? async : rc;
  }

  // A non-blocking communicator answers ncclInProgress while a call completes in the background: polls its
  // state (sleeping between polls) until it is no longer in progress, for at most the timeout. Returns the
  // final state, or ncclInProgress past the deadline; any other rc is returned as it is.
  ncclResult_t poll(ncclResult_t rc, const char* op) {
    if (rc != ncclInProgress) return rc;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto nap = std::chrono::microseconds(2);
    for (;;) {
      rc = async_state(op);
      if (rc != ncclInProgress || std::chrono::steady_clock::now() > deadline) return rc;
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
  }

  // After a call on the communicator (call: its text, for the message): waits out ncclInProgress; a call that
  // failed throws comm_error; a communicator that broke meanwhile, or is still busy past the timeout, is
  // aborted, and throws comm_error naming the rank and op.
  void settle(ncclResult_t rc, const char* call, const char* file, int line, const char* op) {
    if (rc != ncclInProgress) {
      if (rc != ncclSuccess) fail_nccl(rc, call, file, line);
      return;
    }
    rc = poll(rc, op);
    if (rc == ncclInProgress)
      abort(dml::detail::cat("dml::comm::nccl: rank ", rank, " of ", size, ": ", op, " did not complete within ",
                             std::chrono::duration<double>(timeout).count(), " s; the communicator was aborted"));
    if (rc != ncclSuccess)
      abort(dml::detail::cat("dml::comm::nccl: rank ", rank, " of ", size, " in ", op, ": ", ncclGetErrorString(rc),
                             "; the communicator was aborted"));
  }

  // The order contract's first half: what the calling thread's compute stream has queued so far happens
  // before what this communicator enqueues next.
  void after_compute() {
    const cudaStream_t compute = current_stream();
    if (compute == stream) return;
    DML_CHECK_CUDA(cudaEventRecord(input_ready, compute));
    DML_CHECK_CUDA(cudaStreamWaitEvent(stream, input_ready, 0));
  }

  // A new post joins the batch the next flush issues; returns that batch.
  std::shared_ptr<p2p_batch> post(const pending_p2p& p) {
    if (!batch) {
      batch = std::make_shared<p2p_batch>();
      DML_CHECK_CUDA(cudaEventCreateWithFlags(&batch->done, cudaEventDisableTiming));
    }
    pending.push_back(p);
    return batch;
  }

  // Issues the posts as one group (a send and a receive between two ranks, posted in either order on
  // both, cannot deadlock), after the compute queued so far.
  void flush() {
    if (pending.empty()) return;
    auto b = std::move(batch);
    auto posts = std::move(pending);
    pending.clear();
    after_compute();
    b->issued = true;
    try {
      const ncclComm_t c = live();
      DML_CHECK_NCCL(ncclGroupStart());
      ncclResult_t rc = ncclSuccess;
      for (const auto& p : posts) {
        rc = p.send ? ncclSend(p.data, p.count, p.type, p.peer, c, stream) : ncclRecv(p.data, p.count, p.type, p.peer, c, stream);
        if (rc != ncclSuccess && rc != ncclInProgress) break;
      }
      const ncclResult_t end = ncclGroupEnd();
      if (rc != ncclInProgress) DML_CHECK_NCCL(rc);
      settle(end, "ncclGroupEnd()", __FILE__, __LINE__, "send/recv");
      DML_CHECK_CUDA(cudaEventRecord(b->done, stream));
    } catch (const std::exception& e) {
      b->failed = e.what();
      throw;
    }
  }

  // Ends whatever the communicator runs (ncclCommAbort); afterwards every operation throws comm_error.
  void abort_now() noexcept {
    std::lock_guard lock(lifetime);
    if (comm && !aborted) {
      aborted = true;
      ncclCommAbort(comm);
      comm = nullptr;
    }
    aborted = true;
  }
  [[noreturn]] void abort(const std::string& why) {
    abort_now();
    throw comm_error(why);
  }

  // Sleeps between polls (a GPU collective can take long; a spinning host thread helps nobody),
  // watches NCCL's asynchronous errors, and aborts the communicator past the timeout.
  void wait(cudaEvent_t done, const char* op) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto nap = std::chrono::microseconds(2);
    for (;;) {
      const cudaError_t rc = cudaEventQuery(done);
      if (rc == cudaSuccess) {
        // The contract's second half: work the thread issues from now on comes after the operation.
        if (current_stream() != stream) DML_CHECK_CUDA(cudaStreamWaitEvent(current_stream(), done, 0));
        return;
      }
      if (rc != cudaErrorNotReady) fail_cuda(rc, "cudaEventQuery", __FILE__, __LINE__);
      const ncclResult_t async = async_state(op);
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

// A device copy of host data for the host-staged operations: stream-ordered allocation and copies on the
// communicator's stream.
template <class T>
struct staging {
  cudaStream_t stream;
  T* p = nullptr;
  std::size_t n;
  staging(cudaStream_t s, std::size_t count) : stream(s), n(count) {
    if (n) DML_CHECK_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&p), n * sizeof(T), stream));
  }
  ~staging() {
    if (p) cudaFreeAsync(p, stream);
  }
  staging(const staging&) = delete;
  staging& operator=(const staging&) = delete;
  device_span<T> span() { return {p, n}; }
  void from_host(std::span<const T> h) {
    if (n) DML_CHECK_CUDA(cudaMemcpyAsync(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  // After the operation has completed (the plain forms wait for it, with the communicator's timeout).
  void to_host(std::span<T> h) {
    if (!n) return;
    DML_CHECK_CUDA(cudaMemcpyAsync(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
    DML_CHECK_CUDA(cudaStreamSynchronize(stream));
  }
};

// An isend or irecv: issued with its batch at the first wait or test that needs it (or earlier, by the
// next operation on the communicator).
struct p2p_request final : request_state {
  std::shared_ptr<state> s;
  std::shared_ptr<p2p_batch> b;
  const char* op = "";
  p2p_request(std::shared_ptr<state> st, std::shared_ptr<p2p_batch> batch, const char* name)
      : s(std::move(st)), b(std::move(batch)), op(name) {}
  bool test() override {
    if (!b->issued) s->flush();
    if (!b->failed.empty()) throw comm_error(b->failed);
    const cudaError_t rc = cudaEventQuery(b->done);
    if (rc == cudaErrorNotReady) return false;
    if (rc != cudaSuccess) fail_cuda(rc, "cudaEventQuery", __FILE__, __LINE__);
    return true;
  }
  void wait() override {
    if (!b->issued) s->flush();
    if (!b->failed.empty()) throw comm_error(b->failed);
    s->wait(b->done, op);
  }
};

template <class A>
struct is_device_span : std::false_type {};
template <class T>
struct is_device_span<device_span<T>> : std::true_type {};
// Memory a host container or std::span holds (but not the host arrays of counts that v-collectives take).
template <class A>
concept host_data =
    !is_device_span<std::remove_cvref_t<A>>::value && requires(A& a) {
      std::data(a);
      std::size(a);
    } && !std::same_as<std::remove_cvref_t<decltype(*std::data(std::declval<A&>()))>, std::size_t>;
template <class... A>
concept any_host_data = (host_data<A> || ...);
template <class... A>
inline constexpr bool never = false;

}  // namespace detail::nccl_impl

// An NCCL call that enqueues on the communicator: ncclInProgress (non-blocking) is waited out, with the timeout.
#define DML_NCCL_ENQUEUE(expr, op) s_->settle((expr), #expr, __FILE__, __LINE__, (op))

// Every operation of comm::nccl that receives host memory lands here and stops the build with one line.
#define DML_NCCL_DEVICE_MEMORY_ONLY(op)                                                                          \
  template <class... A>                                                                                         \
    requires detail::nccl_impl::any_host_data<A...>                                                             \
  request op(A&&...) {                                                                                          \
    static_assert(detail::nccl_impl::never<A...>,                                                               \
                  "dml::comm::nccl::" #op " moves device memory: pass a dml::device_span (buffer<T, dml::cuda>::span() or " \
                  "dml::make_span<dml::cuda>(p, n)); host data goes through comm::all_reduce_host and its siblings"); \
    return {};                                                                                                  \
  }

struct nccl_options {
  // A blocking call or wait() longer than this aborts the communicator and throws comm_error; so does an
  // initialisation (all ranks joining) or a shrink that has not completed within it.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // The CUDA device; -1: the rank's node-local rank (nccl::node_local_device) when built over comm::mpi, the
  // calling thread's current device when built from a unique id.
  int device = -1;
};

// Operations take device memory only (dml::device_span; comm/communicator.hpp's contract) and are enqueued
// on stream() in call order, each after the compute stream's queued work. The i-forms return a request that
// completes when the GPU has finished (an event), so the host can compute meanwhile; the plain forms wait.
// isend and irecv are issued together at the next wait, test or operation (one NCCL group).
// NCCL has no message tags: send/recv between two ranks match in the order they are issued,
// and the tag argument is accepted for interface compatibility only.
// Threads: one thread issues the operations; abort() may come from any thread, and ends a wait() in another.
class nccl {
 public:
  using options = nccl_options;
  using space = dml::cuda;
  static constexpr bool has_tags = false;  // messages between two ranks match in call order

  // The CUDA device of this rank: its rank among the ranks on its node (MPI's shared-memory split), which
  // must be below the node's device count. Collective over bootstrap: if any rank has no device, every
  // rank throws the same error, so none waits for it.
  static int node_local_device(const mpi& bootstrap) {
    const auto [local, local_size] = place_on_node(bootstrap.native());
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
    // [the first rank without a device, its node-local rank, its node's ranks, its node's devices]
    int mine[4] = {local < devices ? bootstrap.size() : bootstrap.rank(), local, local_size, devices}, first = 0;
    DML_CHECK_MPI(MPI_Allreduce(mine, &first, 1, MPI_INT, MPI_MIN, bootstrap.native()));
    if (first < bootstrap.size()) {
      int who[4] = {};
      if (bootstrap.rank() == first) std::copy(mine, mine + 4, who);
      DML_CHECK_MPI(MPI_Bcast(who, 4, MPI_INT, first, bootstrap.native()));
      fail<comm_error>("dml::comm::nccl: rank ", first, " is rank ", who[1], " of ", who[2], " on its node, which has ",
                       who[3], " CUDA device", who[3] == 1 ? "" : "s", ": run at most ", who[3],
                       " ranks per node (one GPU each), or give nccl_options::device");
    }
    return local;
  }

  // Collective over bootstrap's ranks: selects the rank's device (nccl_options::device, or the node-local
  // rank's), then rank 0 creates the unique id and MPI broadcasts it. With no stream given, the
  // communicator makes its own.
  explicit nccl(const mpi& bootstrap, cudaStream_t stream = nullptr, options opt = {})
      : s_(std::make_shared<detail::nccl_impl::state>()) {
    s_->rank = bootstrap.rank();
    s_->size = bootstrap.size();
    s_->timeout = opt.timeout;
    DML_CHECK_CUDA(cudaSetDevice(opt.device >= 0 ? opt.device : node_local_device(bootstrap)));
    ncclUniqueId id{};
    if (s_->rank == 0) id = new_unique_id();
    DML_CHECK_MPI(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, bootstrap.native()));
    init_comm(id);
    init_stream(stream);
  }

  // Rank `rank` of `size` from a unique id that someone else made with new_unique_id() and handed to every
  // rank (a coordinator, after a failure: the survivors' new communicator). Collective over the size ranks,
  // each its own process or thread with its own device (nccl_options::device, else the current one); past
  // the timeout without all of them it aborts and throws comm_error.
  nccl(ncclUniqueId id, int rank, int size, options opt = {}, cudaStream_t stream = nullptr)
      : s_(std::make_shared<detail::nccl_impl::state>()) {
    if (size < 1 || rank < 0 || rank >= size)
      fail<invalid_argument>("dml::comm::nccl: expected 0 <= rank < size, found rank ", rank, " and size ", size);
    s_->rank = rank;
    s_->size = size;
    s_->timeout = opt.timeout;
    if (opt.device >= 0) DML_CHECK_CUDA(cudaSetDevice(opt.device));
    init_comm(id);
    init_stream(stream);
  }

  // A fresh id for nccl(id, rank, size): made once (by rank 0 or a coordinator) and sent to every rank.
  static ncclUniqueId new_unique_id() {
    ncclUniqueId id{};
    DML_CHECK_NCCL(ncclGetUniqueId(&id));
    return id;
  }

  nccl(nccl&&) noexcept = default;
  nccl& operator=(nccl&&) noexcept = default;

  int rank() const noexcept { return s_->rank; }
  int size() const noexcept { return s_->size; }
  ncclComm_t native() const noexcept { return s_->comm; }
  cudaStream_t stream() const noexcept { return s_->stream; }

  // Ends the communicator at once (ncclCommAbort): a collective blocked on a dead peer ends, a wait() in
  // another thread throws, and every operation from now on throws comm_error ("... aborted"). Local, not
  // collective; the survivors go on with shrink() (before aborting) or nccl(id, rank, size) (after).
  void abort() noexcept { s_->abort_now(); }
  bool aborted() const noexcept { return s_->aborted; }

  // ---- all_reduce
  template <reducible T>
  request iall_reduce(device_span<const std::type_identity_t<T>> send, device_span<T> recv, reduce_op op) {
    check_reduce<T>(op, "dml::comm::nccl::all_reduce");
    expect_size("all_reduce", "recv", recv.size(), send.size());
    const ncclComm_t c = begin();
    DML_NCCL_ENQUEUE(ncclAllReduce(send.data(), recv.data(), recv.size(), dt<T>(), red(op), c, stream()), "all_reduce");
    return done("all_reduce");
  }
  template <reducible T>
  request iall_reduce(device_span<T> data, reduce_op op) {
    return iall_reduce(device_span<const T>(data), data, op);
  }
  template <reducible T>
  void all_reduce(device_span<const std::type_identity_t<T>> send, device_span<T> recv, reduce_op op) {
    iall_reduce(send, recv, op).wait();
  }
  template <reducible T>
  void all_reduce(device_span<T> data, reduce_op op) {
    iall_reduce(data, op).wait();
  }

  // ---- reduce_scatter
  template <reducible T>
  request ireduce_scatter(device_span<const std::type_identity_t<T>> send, device_span<T> recv, reduce_op op) {
    check_reduce<T>(op, "dml::comm::nccl::reduce_scatter");
    expect_size("reduce_scatter", "send", send.size(), recv.size() * size());
    const ncclComm_t c = begin();
    DML_NCCL_ENQUEUE(ncclReduceScatter(send.data(), recv.data(), recv.size(), dt<T>(), red(op), c, stream()),
                     "reduce_scatter");
    return done("reduce_scatter");
  }
  template <reducible T>
  void reduce_scatter(device_span<const std::type_identity_t<T>> send, device_span<T> recv, reduce_op op) {
    ireduce_scatter(send, recv, op).wait();
  }
  // In place: the result lands in block rank() of data (returned).
  template <reducible T>
  device_span<T> reduce_scatter(device_span<T> data, reduce_op op) {
    auto mine = own_block(data, "reduce_scatter");
    ireduce_scatter(device_span<const T>(data), mine, op).wait();
    return mine;
  }

  // ---- all_gather
  template <transferable T>
  request iall_gather(device_span<const std::type_identity_t<T>> send, device_span<T> recv) {
    expect_size("all_gather", "recv", recv.size(), send.size() * size());
    const ncclComm_t c = begin();
    DML_NCCL_ENQUEUE(ncclAllGather(send.data(), recv.data(), send.size() * units<T>(), dt<T>(), c, stream()),
                     "all_gather");
    return done("all_gather");
  }
  template <transferable T>
  void all_gather(device_span<const std::type_identity_t<T>> send, device_span<T> recv) {
    iall_gather(send, recv).wait();
  }
  template <transferable T>
  void all_gather(device_span<T> data) {
    auto mine = own_block(data, "all_gather");
    iall_gather(device_span<const T>(mine), data).wait();
  }
  // One broadcast per rank, fused in a group.
  template <transferable T>
  void all_gatherv(device_span<const std::type_identity_t<T>> send, device_span<T> recv,
                   std::span<const std::size_t> counts) {
    expect_size("all_gatherv", "counts", counts.size(), std::size_t(size()));
    expect_size("all_gatherv", "send", send.size(), counts[rank()]);
    expect_size("all_gatherv", "recv", recv.size(), std::accumulate(counts.begin(), counts.end(), std::size_t(0)));
    const ncclComm_t c = begin();
    DML_CHECK_NCCL(ncclGroupStart());
    std::size_t off = 0;
    for (int p = 0; p < size(); ++p) {
      const ncclResult_t rc = ncclBroadcast(p == rank() ? static_cast<const void*>(send.data()) : nullptr,
                                            recv.data() + off, counts[p] * units<T>(), dt<T>(), p, c, stream());
      if (rc != ncclSuccess && rc != ncclInProgress) {
        ncclGroupEnd();
        DML_CHECK_NCCL(rc);
      }
      off += counts[p];
    }
    DML_NCCL_ENQUEUE(ncclGroupEnd(), "all_gatherv");
    done("all_gatherv").wait();
  }

  // ---- broadcast
  template <transferable T>
  request ibroadcast(device_span<T> data, int root) {
    check_rank(root, "broadcast", "root");
    const ncclComm_t c = begin();
    DML_NCCL_ENQUEUE(ncclBroadcast(data.data(), data.data(), data.size() * units<T>(), dt<T>(), root, c, stream()),
                     "broadcast");
    return done("broadcast");
  }
  template <transferable T>
  void broadcast(device_span<T> data, int root) {
    ibroadcast(data, root).wait();
  }

  // ---- reduce (recv is used at the root only)
  template <reducible T>
  request ireduce(device_span<const std::type_identity_t<T>> send, device_span<T> recv, reduce_op op, int root) {
    check_reduce<T>(op, "dml::comm::nccl::reduce");
    check_rank(root, "reduce", "root");
    if (rank() == root) expect_size("reduce", "recv", recv.size(), send.size());
    const ncclComm_t c = begin();
    DML_NCCL_ENQUEUE(ncclReduce(send.data(), rank() == root ? recv.data() : nullptr, send.size(), dt<T>(), red(op),
                                root, c, stream()),
                     "reduce");
    return done("reduce");
  }
  template <reducible T>
  void reduce(device_span<const std::type_identity_t<T>> send, device_span<T> recv, reduce_op op, int root) {
    ireduce(send, recv, op, root).wait();
  }
  template <reducible T>
  void reduce(device_span<T> data, reduce_op op, int root) {
    ireduce(device_span<const T>(data), rank() == root ? data : device_span<T>{}, op, root).wait();
  }

  // ---- all_to_all and all_to_allv: grouped point-to-point
  template <transferable T>
  request iall_to_all(device_span<const std::type_identity_t<T>> send, device_span<T> recv) {
    if (send.size() % size() != 0 || recv.size() != send.size())
      fail<invalid_argument>("dml::comm::nccl::all_to_all: expected send and recv of equal size divisible by the "
                             "group size ", size(), ", found ", send.size(), " and ", recv.size());
    const std::size_t m = send.size() / size();
    std::vector<std::size_t> counts(size(), m);
    exchange("all_to_all", send, counts, recv, counts);
    return done("all_to_all");
  }
  template <transferable T>
  void all_to_all(device_span<const std::type_identity_t<T>> send, device_span<T> recv) {
    iall_to_all(send, recv).wait();
  }
  template <transferable T>
  void all_to_allv(device_span<const std::type_identity_t<T>> send, std::span<const std::size_t> send_counts,
                   device_span<T> recv, std::span<const std::size_t> recv_counts) {
    expect_size("all_to_allv", "send_counts", send_counts.size(), std::size_t(size()));
    expect_size("all_to_allv", "recv_counts", recv_counts.size(), std::size_t(size()));
    expect_size("all_to_allv", "send", send.size(), std::accumulate(send_counts.begin(), send_counts.end(), std::size_t(0)));
    expect_size("all_to_allv", "recv", recv.size(), std::accumulate(recv_counts.begin(), recv_counts.end(), std::size_t(0)));
    exchange("all_to_allv", send, send_counts, recv, recv_counts);
    done("all_to_allv").wait();
  }

  // ---- point to point (tag unused: see the class comment). Posted, and issued as one group with the other
  // posts at the next wait, test or operation; isendrecv issues at once.
  template <transferable T>
  request isend(device_span<const T> data, int peer, int /*tag*/) {
    check_rank(peer, "send", "peer");
    return post(true, const_cast<T*>(data.data()), data.size() * units<T>(), dt<T>(), peer, "send");
  }
  template <transferable T>
  request isend(device_span<T> data, int peer, int tag) {
    return isend(device_span<const T>(data), peer, tag);
  }
  template <transferable T>
  void send(device_span<const T> data, int peer, int tag) {
    isend(data, peer, tag).wait();
  }
  template <transferable T>
  void send(device_span<T> data, int peer, int tag) {
    isend(device_span<const T>(data), peer, tag).wait();
  }
  template <transferable T>
  request irecv(device_span<T> data, int peer, int /*tag*/) {
    check_rank(peer, "recv", "peer");
    return post(false, data.data(), data.size() * units<T>(), dt<T>(), peer, "recv");
  }
  template <transferable T>
  void recv(device_span<T> data, int peer, int tag) {
    irecv(data, peer, tag).wait();
  }
  template <transferable T>
  request isendrecv(device_span<const std::type_identity_t<T>> send, int to, device_span<T> recv, int from, int /*tag*/) {
    check_rank(to, "sendrecv", "destination");
    check_rank(from, "sendrecv", "source");
    s_->post({.send = true, .data = const_cast<T*>(send.data()), .count = send.size() * units<T>(), .type = dt<T>(), .peer = to});
    request r = post(false, recv.data(), recv.size() * units<T>(), dt<T>(), from, "sendrecv");
    s_->flush();
    return r;
  }
  template <transferable T>
  void sendrecv(device_span<const std::type_identity_t<T>> send, int to, device_span<T> recv, int from, int tag) {
    isendrecv(send, to, recv, from, tag).wait();
  }

  // ---- host memory, staged through device memory on the communicator's stream (small data: flags, counts)
  template <reducible T>
  void all_reduce_host(std::span<T> data, reduce_op op) {
    detail::nccl_impl::staging<T> d(stream(), data.size());
    d.from_host(data);
    all_reduce(d.span(), op);
    d.to_host(data);
  }
  template <transferable T>
  void broadcast_host(std::span<T> data, int root) {
    detail::nccl_impl::staging<T> d(stream(), data.size());
    d.from_host(data);
    broadcast(d.span(), root);
    d.to_host(data);
  }
  template <transferable T>
  void all_gather_host(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    detail::nccl_impl::staging<T> in(stream(), send.size()), out(stream(), recv.size());
    in.from_host(send);
    all_gather(device_span<const T>(in.span()), out.span());
    out.to_host(recv);
  }
  template <transferable T>
  void all_to_all_host(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    detail::nccl_impl::staging<T> in(stream(), send.size()), out(stream(), recv.size());
    in.from_host(send);
    all_to_all(device_span<const T>(in.span()), out.span());
    out.to_host(recv);
  }

  // Host memory given to any operation above: one line saying what to pass instead.
  DML_NCCL_DEVICE_MEMORY_ONLY(all_reduce)
  DML_NCCL_DEVICE_MEMORY_ONLY(iall_reduce)
  DML_NCCL_DEVICE_MEMORY_ONLY(reduce_scatter)
  DML_NCCL_DEVICE_MEMORY_ONLY(ireduce_scatter)
  DML_NCCL_DEVICE_MEMORY_ONLY(all_gather)
  DML_NCCL_DEVICE_MEMORY_ONLY(iall_gather)
  DML_NCCL_DEVICE_MEMORY_ONLY(all_gatherv)
  DML_NCCL_DEVICE_MEMORY_ONLY(broadcast)
  DML_NCCL_DEVICE_MEMORY_ONLY(ibroadcast)
  DML_NCCL_DEVICE_MEMORY_ONLY(reduce)
  DML_NCCL_DEVICE_MEMORY_ONLY(ireduce)
  DML_NCCL_DEVICE_MEMORY_ONLY(all_to_all)
  DML_NCCL_DEVICE_MEMORY_ONLY(iall_to_all)
  DML_NCCL_DEVICE_MEMORY_ONLY(all_to_allv)
  DML_NCCL_DEVICE_MEMORY_ONLY(send)
  DML_NCCL_DEVICE_MEMORY_ONLY(isend)
  DML_NCCL_DEVICE_MEMORY_ONLY(recv)
  DML_NCCL_DEVICE_MEMORY_ONLY(irecv)
  DML_NCCL_DEVICE_MEMORY_ONLY(sendrecv)
  DML_NCCL_DEVICE_MEMORY_ONLY(isendrecv)

  void barrier() {
    const ncclComm_t c = begin();
    DML_NCCL_ENQUEUE(ncclAllReduce(s_->scratch, s_->scratch, 1, ncclInt32, ncclSum, c, stream()), "barrier");
    done("barrier").wait();
  }

  // Ranks with the same color form a group, ordered by (key, rank); the new communicator gets
  // its own stream so that groups can run concurrently. Collective.
  nccl split(int color, int key) const {
    if (color < 0) fail<invalid_argument>("dml::comm::nccl::split: expected a color >= 0, found ", color);
    s_->flush();
    auto config = non_blocking();
    return child("split", "ncclCommSplit",
                 [&](ncclComm_t* out) { return ncclCommSplit(s_->live(), color, key, out, &config); });
  }

  // The communicator of the ranks not in exclude_ranks (ranks of this one), renumbered in order: what the
  // survivors build after the ranks in exclude_ranks died. Collective over the remaining ranks; the excluded
  // ones do not call it. after_error = false (NCCL_SHRINK_DEFAULT) needs this communicator healthy with nothing
  // in flight; after_error = true (NCCL_SHRINK_ABORT) first ends what it still runs (a collective hung on a
  // dead rank), for a communicator in error: it is unusable afterwards, so abort() or destroy it. One that was
  // already aborted (abort(), or by the timeout) cannot shrink: build a new one with nccl(id, rank, size).
  // Needs NCCL 2.27 or later (ncclCommShrink); with an older NCCL it throws comm_error.
  nccl shrink(std::span<const int> exclude_ranks, bool after_error = false) const {
    std::vector<int> excluded(exclude_ranks.begin(), exclude_ranks.end());
    if (excluded.empty()) fail<invalid_argument>("dml::comm::nccl::shrink: expected at least one rank to exclude");
    for (int r : excluded) {
      check_rank(r, "shrink", "rank to exclude");
      if (r == rank())
        fail<invalid_argument>("dml::comm::nccl::shrink: rank ", r, " excludes itself; an excluded rank does not "
                               "call shrink");
    }
    std::sort(excluded.begin(), excluded.end());
    if (std::adjacent_find(excluded.begin(), excluded.end()) != excluded.end())
      fail<invalid_argument>("dml::comm::nccl::shrink: expected distinct ranks to exclude, found one twice");
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
    if (!after_error) s_->flush();
    auto config = non_blocking();
    const int flags = after_error ? NCCL_SHRINK_ABORT : NCCL_SHRINK_DEFAULT;
    return child("shrink", "ncclCommShrink", [&](ncclComm_t* out) {
      return ncclCommShrink(s_->live(), excluded.data(), static_cast<int>(excluded.size()), out, &config, flags);
    });
#else
    (void)after_error;
    fail<comm_error>("dml::comm::nccl::shrink needs NCCL 2.27 or later (ncclCommShrink); this build has NCCL ",
                     NCCL_MAJOR, ".", NCCL_MINOR, ".", NCCL_PATCH);
#endif
  }

 private:
  nccl() : s_(std::make_shared<detail::nccl_impl::state>()) {}

  static ncclConfig_t non_blocking() {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    return config;
  }

  // Non-blocking initialisation: ncclCommInitRankConfig returns at once, and the communicator is ready when
  // its state leaves ncclInProgress (every rank joined), which settle waits for with the timeout.
  void init_comm(const ncclUniqueId& id) {
    auto config = non_blocking();
    const ncclResult_t rc = ncclCommInitRankConfig(&s_->comm, s_->size, id, s_->rank, &config);
    if (rc != ncclSuccess && rc != ncclInProgress && s_->comm) s_->abort_now();
    s_->settle(rc, "ncclCommInitRankConfig", __FILE__, __LINE__,
               s_->size == 1 ? "initialisation" : "initialisation (waiting for every rank to join)");
  }

  // A communicator made from this one by make(&handle) (split, shrink), with its own stream. Non-blocking,
  // NCCL stores the new handle from a thread of its own once the new communicator is built (polling this
  // one's state completes the call), so it lands in a slot of its own: when the call fails or runs past the
  // timeout (this communicator is then aborted) the slot is left behind (a few bytes), since NCCL may still
  // write it.
  template <class F>
  nccl child(const char* op, const char* call, F make) const {
    auto* slot = new ncclComm_t(nullptr);
    const ncclResult_t rc = make(slot);
    if (rc != ncclSuccess && rc != ncclInProgress) detail::nccl_impl::fail_nccl(rc, call, __FILE__, __LINE__);
    const auto deadline = std::chrono::steady_clock::now() + s_->timeout;
    auto nap = std::chrono::microseconds(2);
    ncclComm_t made = nullptr;
    while (!(made = std::atomic_ref<ncclComm_t>(*slot).load(std::memory_order_acquire))) {
      // This one's state: ncclInProgress until the call completes, an error after NCCL_SHRINK_ABORT (by design).
      (void)s_->async_state(op);
      if (std::chrono::steady_clock::now() > deadline)
        s_->abort(dml::detail::cat("dml::comm::nccl: rank ", s_->rank, " of ", s_->size, ": ", op,
                                   " did not complete within ", std::chrono::duration<double>(s_->timeout).count(),
                                   " s; the communicator was aborted"));
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
    delete slot;
    nccl out;
    out.s_->timeout = s_->timeout;
    out.s_->rank = s_->rank;
    out.s_->size = s_->size;
    out.s_->comm = made;
    out.s_->settle(ncclInProgress, call, __FILE__, __LINE__, op);
    (void)s_->poll(ncclInProgress, op);  // joins NCCL's record of the call on this one, when it is healthy
    DML_CHECK_NCCL(ncclCommCount(out.s_->comm, &out.s_->size));
    DML_CHECK_NCCL(ncclCommUserRank(out.s_->comm, &out.s_->rank));
    out.init_stream(nullptr);
    return out;
  }

  void init_stream(cudaStream_t stream) {
    if (stream) {
      s_->stream = stream;
    } else {
      DML_CHECK_CUDA(cudaStreamCreateWithFlags(&s_->stream, cudaStreamNonBlocking));
      s_->owns_stream = true;
    }
    DML_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&s_->scratch), sizeof(int)));
    DML_CHECK_CUDA(cudaEventCreateWithFlags(&s_->input_ready, cudaEventDisableTiming));
  }

  // Before an operation is enqueued: the posts before it are issued, and it comes after the compute.
  ncclComm_t begin() {
    s_->flush();
    s_->after_compute();
    return s_->live();
  }
  request post(bool send, void* data, std::size_t count, ncclDataType_t type, int peer, const char* op) {
    auto batch = s_->post({.send = send, .data = data, .count = count, .type = type, .peer = peer});
    return request(std::make_unique<detail::nccl_impl::p2p_request>(s_, std::move(batch), op));
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
  device_span<T> own_block(device_span<T> data, const char* op) const {
    if (data.size() % size() != 0)
      fail<invalid_argument>("dml::comm::nccl::", op, ": expected a size divisible by the group size ", size(),
                             ", found ", data.size());
    const std::size_t m = data.size() / size();
    return data.subspan(m * rank(), m);
  }

  template <class T>
  void exchange(const char* op, device_span<const T> send, std::span<const std::size_t> sc, device_span<T> recv,
                std::span<const std::size_t> rc) {
    if (!send.empty() && static_cast<const void*>(send.data()) == static_cast<const void*>(recv.data()))
      fail<invalid_argument>("dml::comm::nccl::", op, ": expected distinct send and recv buffers, found the same");
    const ncclComm_t c = begin();
    DML_CHECK_NCCL(ncclGroupStart());
    std::size_t so = 0, ro = 0;
    ncclResult_t rc_all = ncclSuccess;
    const auto queued = [](ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; };
    for (int p = 0; p < size() && queued(rc_all); ++p) {
      if (sc[p]) rc_all = ncclSend(send.data() + so, sc[p] * units<T>(), dt<T>(), p, c, stream());
      if (queued(rc_all) && rc[p]) rc_all = ncclRecv(recv.data() + ro, rc[p] * units<T>(), dt<T>(), p, c, stream());
      so += sc[p];
      ro += rc[p];
    }
    const ncclResult_t end = ncclGroupEnd();
    if (!queued(rc_all)) DML_CHECK_NCCL(rc_all);
    DML_NCCL_ENQUEUE(end, op);
  }

  std::shared_ptr<detail::nccl_impl::state> s_;
};

static_assert(diagnose_communicator<nccl>());
#undef DML_NCCL_DEVICE_MEMORY_ONLY
#undef DML_NCCL_ENQUEUE

}  // namespace dml::comm
