// SPDX-License-Identifier: Apache-2.0
// dml/comm/communicator.hpp — the communicator concept, reduce_op, request and customisation points.
// Sits on core/; comm::local, comm::mpi and comm::nccl model it; parallel/ uses it. See DESIGN.md §4.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"
#include "dml/core/space.hpp"

namespace dml {

// A collective failed as a whole: a peer threw or vanished, the group was aborted, or a wait
// ran past the communicator's timeout. Misuse (wrong sizes, ranks, types) is invalid_argument.
class comm_error : public error {
 public:
  using error::error;
};

namespace comm {

enum class reduce_op { sum, avg, max, min, prod };

constexpr std::string_view name(reduce_op op) {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::avg: return "avg";
    case reduce_op::max: return "max";
    case reduce_op::min: return "min";
    case reduce_op::prod: return "prod";
  }
  return "?";
}

// Element types that collectives reduce. Data movement (gather, broadcast, all-to-all, send)
// takes any trivially copyable type.
template <class T>
concept reducible = std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, bf16> ||
                    std::same_as<T, fp16> || std::same_as<T, std::int32_t> ||
                    std::same_as<T, std::int64_t>;
template <class T>
concept transferable = std::is_trivially_copyable_v<T> && !std::is_const_v<T>;

template <reducible T>
constexpr std::string_view type_name() {
  if constexpr (std::same_as<T, float>) return "float";
  else if constexpr (std::same_as<T, double>) return "double";
  else if constexpr (std::same_as<T, bf16>) return "bf16";
  else if constexpr (std::same_as<T, fp16>) return "half";
  else if constexpr (std::same_as<T, std::int32_t>) return "int32";
  else return "int64";
}

// avg of integers would silently truncate; every model refuses it the same way.
template <reducible T>
void check_reduce(reduce_op op, std::string_view where) {
  if (op == reduce_op::avg && std::integral<T>)
    fail<invalid_argument>(where, ": reduce_op::avg needs a floating-point type, found ",
                           type_name<T>());
}

// ---------------------------------------------------------------------------------------------
// request: the handle of a non-blocking operation. wait() blocks until it has completed and
// rethrows its error; test() says whether it has. A request dropped without wait() waits in its
// destructor (ignoring errors), because the operation still reads or writes the caller's spans.

namespace detail {
struct request_state {
  virtual ~request_state() = default;
  virtual bool test() = 0;  // true once complete; throws the operation's error
  virtual void wait() = 0;  // throws the operation's error
  // A receive not yet matched withdraws and returns true; anything else returns false (then wait()).
  virtual bool cancel() { return false; }
};
}  // namespace detail

class request {
 public:
  request() = default;
  explicit request(std::unique_ptr<detail::request_state> s) : state_(std::move(s)) {}
  request(request&&) noexcept = default;
  request& operator=(request&& o) noexcept {
    if (this != &o) {
      finish_quietly();
      state_ = std::move(o.state_);
    }
    return *this;
  }
  ~request() { finish_quietly(); }

  void wait() {
    if (!state_) return;
    auto s = std::move(state_);
    s->wait();
  }
  bool test() {
    if (!state_) return true;
    bool done = false;
    try {
      done = state_->test();
    } catch (...) {
      state_.reset();
      throw;
    }
    if (done) state_.reset();
    return done;
  }
  // True once wait() or a successful test() has retired the operation.
  bool done() const noexcept { return !state_; }
  // Withdraws a receive that no message has matched yet (MPI_Cancel), so its buffer may go away; any other
  // operation, or a receive already matched, is waited for, ignoring errors. The request is done after.
  void cancel() noexcept {
    if (!state_) return;
    bool withdrawn = false;
    try {
      withdrawn = state_->cancel();
    } catch (...) {
    }
    if (!withdrawn) finish_quietly();
    state_.reset();
  }

 private:
  void finish_quietly() noexcept {
    if (!state_) return;
    try {
      state_->wait();
    } catch (...) {
    }
    state_.reset();
  }
  std::unique_ptr<detail::request_state> state_;
};

// Waits for every request, then rethrows the first error any of them raised.
inline void wait_all(std::span<request> rs) {
  std::exception_ptr first;
  for (auto& r : rs) {
    try {
      r.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

// ---------------------------------------------------------------------------------------------
// Bus bandwidth as nccl-tests defines it: the per-link traffic of a bandwidth-optimal algorithm,
// so one number compares across group sizes.

enum class collective { all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all };

constexpr std::string_view name(collective c) {
  switch (c) {
    case collective::all_reduce: return "all_reduce";
    case collective::reduce_scatter: return "reduce_scatter";
    case collective::all_gather: return "all_gather";
    case collective::broadcast: return "broadcast";
    case collective::reduce: return "reduce";
    case collective::all_to_all: return "all_to_all";
  }
  return "?";
}

constexpr double bus_factor(collective c, int n) {
  if (n <= 1) return c == collective::broadcast || c == collective::reduce ? 1.0 : 0.0;
  switch (c) {
    case collective::all_reduce: return 2.0 * (n - 1) / n;
    case collective::reduce_scatter:
    case collective::all_gather:
    case collective::all_to_all: return double(n - 1) / n;
    case collective::broadcast:
    case collective::reduce: return 1.0;
  }
  return 1.0;
}

// ---------------------------------------------------------------------------------------------
// The contract every model keeps, and what a caller may rely on.
//
// Memory. A communicator moves memory of one space, its `space` member (host when absent): comm::local and
// comm::mpi take std::span over host memory, comm::nccl takes dml::device_span over device memory (Debian's
// Open MPI is not CUDA-aware, so comm::mpi never takes device memory). A span of the other space does not
// compile: buffer<T, Space>::span() and dml::make_span<Space>(p, n) name the space a pointer lives in, so
// generic code that hands a Space's memory to a communicator compiles only for a communicator of that Space.
// Host data that must cross a communicator over device memory (agreement flags, counts, statistics) goes
// through all_reduce_host, broadcast_host, all_gather_host and all_to_all_host below, which stage it through
// device memory there and are the plain operations elsewhere.
//
// Order. An operation reads its input as the calling thread's work left it when the call was made, and its
// output may be read by any work the thread issues after the plain form returns or the request's wait()
// does. On the host this is program order. On a GPU the communicator keeps it, not the caller: before it
// enqueues, its stream waits for what the thread's compute stream (dml::current_stream()) has queued, and
// on completion the compute stream waits for it. Operations on one communicator run in call order, and
// every rank must call its collectives in the same order.
//
// Pairs. isend and irecv may start only at the next wait, test or operation on the communicator (NCCL
// issues them together then, as one group), so a rank may post a receive and a send to its neighbours in
// any order without deadlock; isendrecv starts both at once. Messages between two ranks on one tag arrive in
// the order they were sent; comm::nccl has no tags, so there the order is that of the calls.

// The memory space a communicator moves, and the span it takes for T.
template <class C>
struct memory_space {
  using type = host;
};
template <class C>
  requires requires { typename C::space; }
struct memory_space<C> {
  using type = typename C::space;
};
template <class C>
using memory_space_t = typename memory_space<std::remove_cvref_t<C>>::type;
template <class C, class T>
using span_for = span_in<T, memory_space_t<C>>;
template <class C>
inline constexpr bool moves_host_memory = std::same_as<memory_space_t<C>, host>;
// Whether messages between two ranks match by tag (comm::local, comm::mpi) or only in the order they were
// sent (a model that says `static constexpr bool has_tags = false`: comm::nccl).
template <class C>
inline constexpr bool matches_tags = !requires { requires !std::remove_cvref_t<C>::has_tags; };

// ---------------------------------------------------------------------------------------------
// The concept, in named parts so a failure names the missing operation. Checked with float in the
// communicator's space; models are templates over every reducible type.

template <class R>
concept request_like = requires(R& r) {
  r.wait();
  { r.test() } -> std::convertible_to<bool>;
};

template <class C>
concept has_topology = requires(const C& c) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
};
template <class C>
concept has_all_reduce =
    requires(C& c, span_for<C, float> s, span_for<C, const float> in, reduce_op op) {
      c.all_reduce(s, op);
      c.all_reduce(in, s, op);
    };
template <class C>
concept has_reduce_scatter =
    requires(C& c, span_for<C, float> s, span_for<C, const float> in, reduce_op op) {
      c.reduce_scatter(in, s, op);
      c.reduce_scatter(s, op);
    };
template <class C>
concept has_all_gather =
    requires(C& c, span_for<C, float> s, span_for<C, const float> in, std::span<const std::size_t> n) {
      c.all_gather(in, s);
      c.all_gather(s);
      c.all_gatherv(in, s, n);
    };
template <class C>
concept has_broadcast = requires(C& c, span_for<C, float> s) { c.broadcast(s, 0); };
template <class C>
concept has_reduce = requires(C& c, span_for<C, float> s, span_for<C, const float> in, reduce_op op) {
  c.reduce(in, s, op, 0);
  c.reduce(s, op, 0);
};
template <class C>
concept has_all_to_all =
    requires(C& c, span_for<C, float> s, span_for<C, const float> in, std::span<const std::size_t> n) {
      c.all_to_all(in, s);
      c.all_to_allv(in, n, s, n);
    };
template <class C>
concept has_point_to_point = requires(C& c, span_for<C, float> s, span_for<C, const float> in) {
  c.send(in, 0, 0);
  c.recv(s, 0, 0);
};
template <class C>
concept has_barrier = requires(C& c) { c.barrier(); };
template <class C>
concept has_split = requires(C& c) {
  { c.split(0, 0) } -> std::same_as<C>;
};
template <class C>
concept has_nonblocking =
    requires(C& c, span_for<C, float> s, span_for<C, const float> in, reduce_op op) {
      { c.iall_reduce(s, op) } -> request_like;
      { c.ireduce_scatter(in, s, op) } -> request_like;
      { c.iall_gather(in, s) } -> request_like;
      { c.ibroadcast(s, 0) } -> request_like;
      { c.isend(in, 0, 0) } -> request_like;
      { c.irecv(s, 0, 0) } -> request_like;
    };
// A communicator over device memory also takes host memory where the name says so (staged).
template <class C>
concept has_host_staging =
    moves_host_memory<C> || requires(C& c, std::span<float> s, std::span<const float> in, reduce_op op) {
      c.all_reduce_host(s, op);
      c.broadcast_host(s, 0);
      c.all_gather_host(in, s);
      c.all_to_all_host(in, s);
    };

template <class C>
concept communicator = has_topology<C> && has_all_reduce<C> && has_reduce_scatter<C> &&
                       has_all_gather<C> && has_broadcast<C> && has_reduce<C> &&
                       has_all_to_all<C> && has_point_to_point<C> && has_barrier<C> &&
                       has_split<C> && has_nonblocking<C> && has_host_staging<C>;

// static_assert(diagnose_communicator<C>()) names the first missing operation.
template <class C>
consteval bool diagnose_communicator() {
  static_assert(has_topology<C>, "dml: a communicator needs `int rank() const` and `int size() const`");
  static_assert(has_all_reduce<C>,
                "dml: a communicator needs `all_reduce(std::span<T>, reduce_op)` and "
                "`all_reduce(std::span<const T>, std::span<T>, reduce_op)`");
  static_assert(has_reduce_scatter<C>,
                "dml: a communicator needs `reduce_scatter(std::span<const T>, std::span<T>, "
                "reduce_op)` and `reduce_scatter(std::span<T>, reduce_op)`");
  static_assert(has_all_gather<C>,
                "dml: a communicator needs `all_gather(std::span<const T>, std::span<T>)`, "
                "`all_gather(std::span<T>)` and `all_gatherv(send, recv, std::span<const size_t>)`");
  static_assert(has_broadcast<C>, "dml: a communicator needs `broadcast(std::span<T>, int root)`");
  static_assert(has_reduce<C>,
                "dml: a communicator needs `reduce(std::span<const T>, std::span<T>, reduce_op, int "
                "root)` and `reduce(std::span<T>, reduce_op, int root)`");
  static_assert(has_all_to_all<C>,
                "dml: a communicator needs `all_to_all(std::span<const T>, std::span<T>)` and "
                "`all_to_allv(send, send_counts, recv, recv_counts)`");
  static_assert(has_point_to_point<C>,
                "dml: a communicator needs `send(std::span<const T>, int peer, int tag)` and "
                "`recv(std::span<T>, int peer, int tag)`");
  static_assert(has_barrier<C>, "dml: a communicator needs `barrier()`");
  static_assert(has_split<C>, "dml: a communicator needs `C split(int color, int key)`");
  static_assert(has_nonblocking<C>,
                "dml: a communicator needs non-blocking forms returning a request (wait/test): "
                "iall_reduce, ireduce_scatter, iall_gather, ibroadcast, isend, irecv");
  static_assert(has_host_staging<C>,
                "dml: a communicator over device memory needs all_reduce_host, broadcast_host, all_gather_host and "
                "all_to_all_host, which take std::span over host memory");
  return true;
}

// ---------------------------------------------------------------------------------------------
// Host data over any communicator: the plain operation where the communicator moves host memory, staged
// through device memory where it moves device memory. For small things (flags, counts, statistics).

template <class C, reducible T>
void all_reduce_host(C& c, std::span<T> data, reduce_op op) {
  if constexpr (moves_host_memory<C>) c.all_reduce(data, op);
  else c.all_reduce_host(data, op);
}
template <class C, transferable T>
void broadcast_host(C& c, std::span<T> data, int root) {
  if constexpr (moves_host_memory<C>) c.broadcast(data, root);
  else c.broadcast_host(data, root);
}
template <class C, transferable T>
void all_gather_host(C& c, std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
  if constexpr (moves_host_memory<C>) c.all_gather(send, recv);
  else c.all_gather_host(send, recv);
}
template <class C, transferable T>
void all_to_all_host(C& c, std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
  if constexpr (moves_host_memory<C>) c.all_to_all(send, recv);
  else c.all_to_all_host(send, recv);
}

// ---------------------------------------------------------------------------------------------
// isendrecv: a send to one peer and a receive from another (or the same), started together; the request
// completes when both have. A model may provide its own (comm::nccl: one group); otherwise an irecv and an
// isend. Ring exchanges use it: every rank sends first and receives first, at once.

namespace detail {
struct request_pair final : request_state {
  request a, b;
  request_pair(request x, request y) : a(std::move(x)), b(std::move(y)) {}
  bool test() override { return a.test() && b.test(); }
  void wait() override {
    std::array<request, 2> both{std::move(a), std::move(b)};
    wait_all(both);
  }
};
}  // namespace detail

template <class C, class Send, class Recv>
request isendrecv(C& c, Send send, int to, Recv recv, int from, int tag) {
  if constexpr (requires { c.isendrecv(send, to, recv, from, tag); }) {
    return c.isendrecv(send, to, recv, from, tag);
  } else {
    request r = c.irecv(recv, from, tag);
    request s = c.isend(send, to, tag);
    return request(std::make_unique<detail::request_pair>(std::move(r), std::move(s)));
  }
}

// ---------------------------------------------------------------------------------------------
// Customisation points: dml::comm::all_reduce(c, ...) forwards to c.all_reduce(...), so generic
// code names operations without naming a model.

#define DML_COMM_CUSTOMISATION_POINT(op)                                                  \
  namespace detail {                                                                      \
  struct op##_fn {                                                                        \
    template <class C, class... A>                                                        \
      requires requires(C& c, A&&... a) { c.op(static_cast<A&&>(a)...); }                 \
    decltype(auto) operator()(C& c, A&&... a) const {                                     \
      return c.op(static_cast<A&&>(a)...);                                                \
    }                                                                                     \
  };                                                                                      \
  }                                                                                       \
  inline constexpr detail::op##_fn op {}

DML_COMM_CUSTOMISATION_POINT(all_reduce);
DML_COMM_CUSTOMISATION_POINT(reduce_scatter);
DML_COMM_CUSTOMISATION_POINT(all_gather);
DML_COMM_CUSTOMISATION_POINT(all_gatherv);
DML_COMM_CUSTOMISATION_POINT(broadcast);
DML_COMM_CUSTOMISATION_POINT(reduce);
DML_COMM_CUSTOMISATION_POINT(all_to_all);
DML_COMM_CUSTOMISATION_POINT(all_to_allv);
DML_COMM_CUSTOMISATION_POINT(send);
DML_COMM_CUSTOMISATION_POINT(recv);
DML_COMM_CUSTOMISATION_POINT(barrier);
DML_COMM_CUSTOMISATION_POINT(split);
DML_COMM_CUSTOMISATION_POINT(iall_reduce);
DML_COMM_CUSTOMISATION_POINT(ireduce_scatter);
DML_COMM_CUSTOMISATION_POINT(iall_gather);
DML_COMM_CUSTOMISATION_POINT(ibroadcast);
DML_COMM_CUSTOMISATION_POINT(isend);
DML_COMM_CUSTOMISATION_POINT(irecv);
#undef DML_COMM_CUSTOMISATION_POINT

}  // namespace comm
}  // namespace dml
