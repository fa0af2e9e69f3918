// SPDX-License-Identifier: Apache-2.0
// tests/comm/nccl_check.cu — comm::nccl against a host reference. Every operation (plain, non-blocking and
// host-staged forms; point to point in every order the contract allows; barrier; split) for every element
// type it takes, at 0, 1 and 1023 elements (and 1<<22 for float), on inputs every rank computes for every
// other rank; then the order contract against a compute stream; then recovery: abort(), shrink() and
// communicators from a handed-out unique id. Built wherever nvcc is; run by mpirun (label
// gpu). Without one GPU per rank: `SKIPPED: <reason>`, exit 77, on every rank alike.
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../cuda/gpu_skip.hpp"
#include "../support.hpp"
#include "dml/comm/mpi.hpp"
#include "dml/comm/nccl.hpp"
#include "dml/core/buffer.hpp"
#include "dml/core/stream.hpp"

namespace {

using dml::comm::nccl;
using dml::comm::reduce_op;
template <class T>
using device_buffer = dml::buffer<T, dml::cuda>;

constexpr reduce_op all_ops[] = {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min, reduce_op::prod};

// A struct that data movement carries as bytes; no padding, so == compares every byte that travelled.
struct item {
  std::int32_t id;
  float value;
  std::uint16_t tag[2];
  friend bool operator==(const item&, const item&) = default;
};
static_assert(sizeof(item) == 12 && std::is_trivially_copyable_v<item>);

template <class T>
constexpr bool is_half = std::is_same_v<T, dml::bf16> || std::is_same_v<T, dml::fp16>;

template <class T>
std::string type_name() {
  if constexpr (std::is_same_v<T, item>) return "item";
  else return std::string(dml::comm::type_name<T>());
}
template <class T>
T from_double(double v) {
  if constexpr (is_half<T>) return T(static_cast<float>(v));
  else return static_cast<T>(v);
}
template <class T>
double as_double(T x) {
  if constexpr (is_half<T>) return double(float(x));
  else return double(x);
}
// The spacing of T at 1: what one rounding may cost, relative.
template <class T>
double epsilon() {
  if constexpr (std::is_same_v<T, double>) return DBL_EPSILON;
  else if constexpr (std::is_same_v<T, float>) return FLT_EPSILON;
  else if constexpr (std::is_same_v<T, dml::bf16>) return 1.0 / 128;  // 8 significant bits
  else if constexpr (std::is_same_v<T, dml::fp16>) return 1.0 / 1024;  // 11 significant bits
  else return 0;
}

// ---- the inputs: a function of (rank, index) that every rank evaluates for every other rank -----------------

// Data movement: integers in [-125, 125], exact in every type (bf16 holds integers up to 256).
template <class T>
T moved(int r, std::size_t i) {
  if constexpr (std::is_same_v<T, item>)
    return {static_cast<std::int32_t>(r * 1000003 + static_cast<std::int64_t>(i)), static_cast<float>(i % 1021),
            {static_cast<std::uint16_t>(r), static_cast<std::uint16_t>(i & 0xffff)}};
  else return from_double<T>(double((i * 13 + std::size_t(r) * 101) % 251) - 125);
}
// What an output holds before the operation writes it; no operation below produces it.
template <class T>
T sentinel() {
  if constexpr (std::is_same_v<T, item>) return {-1, -1.f, {0xdead, 0xbeef}};
  else return from_double<T>(200);
}
// Reductions: integers in [-4, 4], so that sums, maxima and minima over up to 64 ranks are exact in every type;
// prod takes ±1 and ±2, so that products are ±2^k (exact while 2^ranks fits: fp16 to 15 ranks).
template <class T>
T reduced(reduce_op op, int r, std::size_t i) {
  if (op == reduce_op::prod) {
    constexpr int factors[] = {1, -1, 2, -2, 1};
    return from_double<T>(factors[(i * 7 + std::size_t(r) * 3) % 5]);
  }
  return from_double<T>(double((i * 7 + std::size_t(r) * 3 + 1) % 9) - 4);
}
// The reduction over ranks 0..n-1 of element i, in double.
template <class T>
double reference(reduce_op op, int n, std::size_t i) {
  double acc = op == reduce_op::prod ? 1.0
               : op == reduce_op::max ? -std::numeric_limits<double>::infinity()
               : op == reduce_op::min ? std::numeric_limits<double>::infinity()
                                      : 0.0;
  for (int p = 0; p < n; ++p) {
    const double v = as_double(reduced<T>(op, p, i));
    switch (op) {
      case reduce_op::sum:
      case reduce_op::avg: acc += v; break;
      case reduce_op::max: acc = std::max(acc, v); break;
      case reduce_op::min: acc = std::min(acc, v); break;
      case reduce_op::prod: acc *= v; break;
    }
  }
  return op == reduce_op::avg ? acc / n : acc;
}
// Every result is exact but avg's: NCCL may scale each input by 1/n before summing, so allow one rounding per
// input and per partial sum, each at most epsilon·|largest input| (4).
template <class T>
double tolerance(reduce_op op, int n) {
  return op == reduce_op::avg ? (n + 1) * 4.0 * epsilon<T>() : 0.0;
}

template <class T, class F>
std::vector<T> make(std::size_t count, F f) {
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = f(i);
  return v;
}
using dml_test::to_device;
using dml_test::to_host;
template <class T>
dml::device_span<const T> in(const device_buffer<T>& d) {
  return d.span();
}

template <class T>
bool same(const T& got, const T& want, double tol) {
  if constexpr (std::is_same_v<T, item>) return got == want;
  else return std::fabs(as_double(got) - as_double(want)) <= tol;  // NaN fails
}
template <class T>
std::string show(const T& x) {
  char s[96];
  if constexpr (std::is_same_v<T, item>)
    std::snprintf(s, sizeof s, "{%d, %g, %u, %u}", x.id, x.value, unsigned(x.tag[0]), unsigned(x.tag[1]));
  else std::snprintf(s, sizeof s, "%.9g", as_double(x));
  return s;
}
// "" when got matches want, else the first difference and how many there are.
template <class T>
std::string compare(const std::vector<T>& got, const std::vector<T>& want, double tol = 0) {
  if (got.size() != want.size())
    return "found " + std::to_string(got.size()) + " elements, expected " + std::to_string(want.size());
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!same(got[i], want[i], tol) && bad++ == 0) first = i;
  if (bad == 0) return "";
  return "element " + std::to_string(first) + " is " + show(got[first]) + ", expected " + show(want[first]) + " (" +
         std::to_string(bad) + " of " + std::to_string(got.size()) + " differ)";
}
// Joins the differences of several outputs, naming each.
std::string also(std::string so_far, const std::string& what, const std::string& why) {
  if (why.empty()) return so_far;
  return (so_far.empty() ? "" : so_far + "; ") + what + ": " + why;
}

// ---- the run: one list of checks, the same on every rank ---------------------------------------------------

struct run {
  nccl& c;
  int n = c.size(), r = c.rank();
  std::vector<int> failed;  // per check, in the order every rank makes them

  // body() returns "" when the check passes, else what differed; an exception fails the check too. Each rank
  // prints its own failures, one line per check.
  template <class F>
  void check(const std::string& what, F&& body) {
    std::string why;
    try {
      why = body();
    } catch (const std::exception& e) {
      why = std::string("threw: ") + e.what();
    }
    failed.push_back(why.empty() ? 0 : 1);
    if (!why.empty()) {
      std::printf("FAIL rank %d: %s: %s\n", r, what.c_str(), why.c_str());
      std::fflush(stdout);
    }
  }
};

std::string label(const std::string& op, const std::string& type, std::size_t m) {
  return op + " " + type + " count=" + std::to_string(m);
}

// ---- reductions --------------------------------------------------------------------------------------------

template <class T>
void check_reductions(run& s, std::size_t m) {
  nccl& c = s.c;
  const int n = s.n, r = s.r;
  const std::string type = type_name<T>();
  for (reduce_op op : all_ops) {
    const std::string on = std::string(dml::comm::name(op));
    if (std::is_integral_v<T> && op == reduce_op::avg) {
      // Refused before anything is enqueued, on every rank alike.
      s.check(label("all_reduce(avg) refused", type, m), [&]() -> std::string {
        device_buffer<T> d(m);
        try {
          c.all_reduce(d.span(), op);
        } catch (const dml::invalid_argument&) {
          return "";
        }
        return "accepted reduce_op::avg on an integer type";
      });
      continue;
    }
    const double tol = tolerance<T>(op, n);
    const auto input = [&](std::size_t count) {
      return make<T>(count, [&](std::size_t i) { return reduced<T>(op, r, i); });
    };
    const auto want_at = [&](std::size_t i) { return from_double<T>(reference<T>(op, n, i)); };

    s.check(label("all_reduce(" + on + ", out of place)", type, m), [&] {
      const auto send = to_device(input(m));
      auto recv = to_device(std::vector<T>(m, sentinel<T>()));
      c.all_reduce(in(send), recv.span(), op);
      return also(also("", "recv", compare(to_host(recv), make<T>(m, want_at), tol)), "send",
                  compare(to_host(send), input(m)));
    });
    s.check(label("all_reduce(" + on + ", in place)", type, m), [&] {
      auto data = to_device(input(m));
      c.all_reduce(data.span(), op);
      return compare(to_host(data), make<T>(m, want_at), tol);
    });

    // reduce_scatter: rank r gets block r of the reduction of n blocks of m.
    const auto block_want = make<T>(m, [&](std::size_t j) { return want_at(std::size_t(r) * m + j); });
    s.check(label("reduce_scatter(" + on + ", out of place)", type, m), [&] {
      const auto send = to_device(input(m * n));
      auto recv = to_device(std::vector<T>(m, sentinel<T>()));
      c.reduce_scatter(in(send), recv.span(), op);
      return compare(to_host(recv), block_want, tol);
    });
    s.check(label("reduce_scatter(" + on + ", in place)", type, m), [&]() -> std::string {
      auto data = to_device(input(m * n));
      const auto mine = c.reduce_scatter(data.span(), op);
      if (mine.data() != data.data() + std::size_t(r) * m || mine.size() != m)
        return "returned a span other than block " + std::to_string(r) + " of the data";
      return compare(to_host(data.data() + std::size_t(r) * m, m), block_want, tol);
    });

    // reduce to each root; recv is written at the root only.
    for (int root = 0; root < n; ++root) {
      const std::string at = on + ", root " + std::to_string(root);
      s.check(label("reduce(" + at + ", out of place)", type, m), [&] {
        const auto send = to_device(input(m));
        auto recv = to_device(std::vector<T>(m, sentinel<T>()));
        c.reduce(in(send), recv.span(), op, root);
        return compare(to_host(recv), r == root ? make<T>(m, want_at) : std::vector<T>(m, sentinel<T>()), tol);
      });
      s.check(label("reduce(" + at + ", in place)", type, m), [&] {
        auto data = to_device(input(m));
        c.reduce(data.span(), op, root);
        return compare(to_host(data), r == root ? make<T>(m, want_at) : input(m), tol);
      });
    }
  }
}

// ---- data movement -----------------------------------------------------------------------------------------

// all_to_allv's counts: rank a sends cnt(a, b) elements to rank b; zero where (a + b) % 3 == 0 (self on rank 0).
std::size_t cnt(std::size_t m, int a, int b) { return (a + b) % 3 == 0 ? 0 : m + std::size_t(a) + 2 * std::size_t(b); }
// all_gatherv's counts: uneven, and the last rank (when there are several) sends nothing.
std::size_t gather_count(std::size_t m, int p, int n) { return n > 1 && p == n - 1 ? 0 : m + std::size_t(p); }

template <class T>
void check_movement(run& s, std::size_t m) {
  nccl& c = s.c;
  const int n = s.n, r = s.r;
  const std::string type = type_name<T>();
  const auto mine = [&](std::size_t count) { return make<T>(count, [&](std::size_t j) { return moved<T>(r, j); }); };
  const auto gathered = make<T>(m * n, [&](std::size_t i) { return moved<T>(int(i / (m ? m : 1)), i % (m ? m : 1)); });

  s.check(label("all_gather(out of place)", type, m), [&] {
    const auto send = to_device(mine(m));
    auto recv = to_device(std::vector<T>(m * n, sentinel<T>()));
    c.all_gather(in(send), recv.span());
    return compare(to_host(recv), gathered);
  });
  s.check(label("all_gather(in place)", type, m), [&] {
    auto h = std::vector<T>(m * n, sentinel<T>());
    for (std::size_t j = 0; j < m; ++j) h[std::size_t(r) * m + j] = moved<T>(r, j);
    auto data = to_device(h);
    c.all_gather(data.span());
    return compare(to_host(data), gathered);
  });

  s.check(label("all_gatherv(uneven, one empty)", type, m), [&] {
    std::vector<std::size_t> counts(n);
    std::vector<T> want;
    for (int p = 0; p < n; ++p) {
      counts[p] = gather_count(m, p, n);
      for (std::size_t j = 0; j < counts[p]; ++j) want.push_back(moved<T>(p, j));
    }
    const auto send = to_device(mine(counts[r]));
    auto recv = to_device(std::vector<T>(want.size(), sentinel<T>()));
    c.all_gatherv(in(send), recv.span(), counts);
    return compare(to_host(recv), want);
  });

  for (int root = 0; root < n; ++root)
    s.check(label("broadcast(root " + std::to_string(root) + ")", type, m), [&] {
      auto data = to_device(r == root ? mine(m) : std::vector<T>(m, sentinel<T>()));
      c.broadcast(data.span(), root);
      return compare(to_host(data), make<T>(m, [&](std::size_t j) { return moved<T>(root, j); }));
    });

  s.check(label("all_to_all", type, m), [&] {
    const auto send = to_device(mine(m * n));
    auto recv = to_device(std::vector<T>(m * n, sentinel<T>()));
    c.all_to_all(in(send), recv.span());
    // Block p of the result is block r of rank p's input.
    return compare(to_host(recv), make<T>(m * n, [&](std::size_t i) {
                     return moved<T>(int(i / (m ? m : 1)), std::size_t(r) * m + i % (m ? m : 1));
                   }));
  });

  s.check(label("all_to_allv(uneven, some empty)", type, m), [&] {
    // Rank a's elements for rank b are moved(a, 7919·b + j).
    std::vector<std::size_t> send_counts(n), recv_counts(n);
    std::vector<T> send_h, want;
    for (int p = 0; p < n; ++p) {
      send_counts[p] = cnt(m, r, p);
      recv_counts[p] = cnt(m, p, r);
      for (std::size_t j = 0; j < send_counts[p]; ++j) send_h.push_back(moved<T>(r, 7919 * std::size_t(p) + j));
      for (std::size_t j = 0; j < recv_counts[p]; ++j) want.push_back(moved<T>(p, 7919 * std::size_t(r) + j));
    }
    const auto send = to_device(send_h);
    auto recv = to_device(std::vector<T>(want.size(), sentinel<T>()));
    c.all_to_allv(in(send), send_counts, recv.span(), recv_counts);
    return compare(to_host(recv), want);
  });
}

// ---- point to point ----------------------------------------------------------------------------------------

template <class T>
void check_point_to_point(run& s, std::size_t m) {
  nccl& c = s.c;
  const int n = s.n, r = s.r, next = (r + 1) % n, prev = (r + n - 1) % n;
  const std::string type = type_name<T>();
  const auto from = [&](int p, std::size_t count, std::size_t base = 0) {
    return make<T>(count, [&](std::size_t j) { return moved<T>(p, base + j); });
  };

  // Blocking send and recv around the ring: even ranks send first, odd ranks receive first, so that at least
  // one rank receives before it sends (a blocking send to self cannot complete, so one rank skips this).
  if (n > 1)
    s.check(label("send/recv(ring)", type, m), [&] {
      const auto send = to_device(from(r, m));
      auto recv = to_device(std::vector<T>(m, sentinel<T>()));
      if (r % 2 == 0) {
        c.send(in(send), next, 0);
        c.recv(recv.span(), prev, 0);
      } else {
        c.recv(recv.span(), prev, 0);
        c.send(in(send), next, 0);
      }
      return compare(to_host(recv), from(prev, m));
    });

  // isend and irecv between partners (r, r^1; the last of an odd count exchanges with itself), two messages
  // each way, which arrive in the order they were sent. Posted in either order on both ranks and waited
  // receive first: the posts are issued together at the first wait, so neither order can deadlock.
  const int partner = (r ^ 1) < n ? (r ^ 1) : r;
  for (bool receive_first : {true, false})
    s.check(label(receive_first ? "irecv then isend (pair)" : "isend then irecv (pair)", type, m), [&] {
      const auto a = to_device(from(r, m)), b = to_device(from(r, m + 1, 5000));
      auto ra = to_device(std::vector<T>(m, sentinel<T>())), rb = to_device(std::vector<T>(m + 1, sentinel<T>()));
      dml::comm::request q[4];
      if (receive_first) {
        q[0] = c.irecv(ra.span(), partner, 0);
        q[1] = c.irecv(rb.span(), partner, 0);
        q[2] = c.isend(in(a), partner, 0);
        q[3] = c.isend(in(b), partner, 0);
      } else {
        q[2] = c.isend(in(a), partner, 0);
        q[3] = c.isend(in(b), partner, 0);
        q[0] = c.irecv(ra.span(), partner, 0);
        q[1] = c.irecv(rb.span(), partner, 0);
      }
      if (receive_first) {
        q[0].wait();
      } else {
        while (!q[0].test()) {
        }
      }
      for (auto& x : q) x.wait();
      return also(also("", "first message", compare(to_host(ra), from(partner, m))), "second message",
                  compare(to_host(rb), from(partner, m + 1, 5000)));
    });

  // isendrecv around the ring (member, free function, blocking, and the other way round).
  s.check(label("isendrecv(ring)", type, m), [&] {
    const auto send = to_device(from(r, m));
    auto recv = to_device(std::vector<T>(m, sentinel<T>()));
    c.isendrecv(in(send), next, recv.span(), prev, 0).wait();
    return compare(to_host(recv), from(prev, m));
  });
  s.check(label("comm::isendrecv(ring)", type, m), [&] {
    const auto send = to_device(from(r, m));
    auto recv = to_device(std::vector<T>(m, sentinel<T>()));
    auto q = dml::comm::isendrecv(c, in(send), next, recv.span(), prev, 0);
    q.wait();
    return compare(to_host(recv), from(prev, m));
  });
  s.check(label("sendrecv(ring, backwards)", type, m), [&] {
    const auto send = to_device(from(r, m));
    auto recv = to_device(std::vector<T>(m, sentinel<T>()));
    c.sendrecv(in(send), prev, recv.span(), next, 0);
    return compare(to_host(recv), from(next, m));
  });
}

// ---- non-blocking collectives: several in flight, completed in call order -------------------------------------

template <class T>
void check_nonblocking(run& s, std::size_t m) {
  nccl& c = s.c;
  const int n = s.n, r = s.r;
  const std::string type = type_name<T>();
  const auto mine = [&](std::size_t count) { return make<T>(count, [&](std::size_t j) { return moved<T>(r, j); }); };

  s.check(label("iall_gather, ibroadcast, iall_to_all in flight together", type, m), [&] {
    const auto gs = to_device(mine(m)), as = to_device(mine(m * n));
    auto gr = to_device(std::vector<T>(m * n, sentinel<T>()));
    auto bc = to_device(r == n - 1 ? mine(m) : std::vector<T>(m, sentinel<T>()));
    auto ar = to_device(std::vector<T>(m * n, sentinel<T>()));
    auto q1 = c.iall_gather(in(gs), gr.span());
    auto q2 = c.ibroadcast(bc.span(), n - 1);
    auto q3 = c.iall_to_all(in(as), ar.span());
    while (!q3.test()) {
    }
    q2.wait();
    q1.wait();
    const std::size_t b = m ? m : 1;
    std::string why = also("", "iall_gather", compare(to_host(gr), make<T>(m * n, [&](std::size_t i) {
                                                   return moved<T>(int(i / b), i % b);
                                                 })));
    why = also(why, "ibroadcast", compare(to_host(bc), make<T>(m, [&](std::size_t j) { return moved<T>(n - 1, j); })));
    return also(why, "iall_to_all", compare(to_host(ar), make<T>(m * n, [&](std::size_t i) {
                                              return moved<T>(int(i / b), std::size_t(r) * m + i % b);
                                            })));
  });

  if constexpr (dml::comm::reducible<T>) {
    s.check(label("iall_reduce, ireduce_scatter, ireduce in flight together", type, m), [&] {
      const auto x = [&](reduce_op op, std::size_t count) {
        return make<T>(count, [&](std::size_t i) { return reduced<T>(op, r, i); });
      };
      const auto want = [&](reduce_op op, std::size_t count, std::size_t first) {
        return make<T>(count, [&](std::size_t i) { return from_double<T>(reference<T>(op, n, first + i)); });
      };
      const auto sum_in = to_device(x(reduce_op::sum, m)), rs_in = to_device(x(reduce_op::max, m * n)),
                 red_in = to_device(x(reduce_op::min, m));
      auto sum_out = to_device(std::vector<T>(m, sentinel<T>()));
      auto prod_data = to_device(x(reduce_op::prod, m));
      auto rs_out = to_device(std::vector<T>(m, sentinel<T>()));
      auto red_out = to_device(std::vector<T>(m, sentinel<T>()));
      auto q1 = c.iall_reduce(in(sum_in), sum_out.span(), reduce_op::sum);
      auto q2 = c.iall_reduce(prod_data.span(), reduce_op::prod);
      auto q3 = c.ireduce_scatter(in(rs_in), rs_out.span(), reduce_op::max);
      auto q4 = c.ireduce(in(red_in), red_out.span(), reduce_op::min, 0);
      q4.wait();
      while (!q1.test()) {
      }
      q2.wait();
      q3.wait();
      std::string why = also("", "iall_reduce(sum)", compare(to_host(sum_out), want(reduce_op::sum, m, 0)));
      why = also(why, "iall_reduce(prod, in place)", compare(to_host(prod_data), want(reduce_op::prod, m, 0)));
      why = also(why, "ireduce_scatter(max)",
                 compare(to_host(rs_out), want(reduce_op::max, m, std::size_t(r) * m)));
      return also(why, "ireduce(min, root 0)",
                  compare(to_host(red_out), r == 0 ? want(reduce_op::min, m, 0) : std::vector<T>(m, sentinel<T>())));
    });
  }
}

// ---- host memory through the staged forms ------------------------------------------------------------------

template <class T>
void check_host_staged(run& s, std::size_t m) {
  nccl& c = s.c;
  const int n = s.n, r = s.r;
  const std::string type = type_name<T>();
  const std::size_t b = m ? m : 1;
  const auto mine = [&](std::size_t count) { return make<T>(count, [&](std::size_t j) { return moved<T>(r, j); }); };

  if constexpr (dml::comm::reducible<T>) {
    for (reduce_op op : {reduce_op::sum, reduce_op::max})
      s.check(label(std::string("all_reduce_host(") + std::string(dml::comm::name(op)) + ")", type, m), [&] {
        auto h = make<T>(m, [&](std::size_t i) { return reduced<T>(op, r, i); });
        if (op == reduce_op::sum) c.all_reduce_host(std::span<T>(h), op);
        else dml::comm::all_reduce_host(c, std::span<T>(h), op);
        return compare(h, make<T>(m, [&](std::size_t i) { return from_double<T>(reference<T>(op, n, i)); }));
      });
  }
  for (int root : {0, n - 1})
    s.check(label("broadcast_host(root " + std::to_string(root) + ")", type, m), [&] {
      auto h = r == root ? mine(m) : std::vector<T>(m, sentinel<T>());
      if (root == 0) c.broadcast_host(std::span<T>(h), root);
      else dml::comm::broadcast_host(c, std::span<T>(h), root);
      return compare(h, make<T>(m, [&](std::size_t j) { return moved<T>(root, j); }));
    });
  s.check(label("all_gather_host", type, m), [&] {
    const auto send = mine(m);
    std::vector<T> recv(m * n, sentinel<T>());
    dml::comm::all_gather_host(c, std::span<const T>(send), std::span<T>(recv));
    return compare(recv, make<T>(m * n, [&](std::size_t i) { return moved<T>(int(i / b), i % b); }));
  });
  s.check(label("all_to_all_host", type, m), [&] {
    const auto send = mine(m * n);
    std::vector<T> recv(m * n, sentinel<T>());
    c.all_to_all_host(std::span<const T>(send), std::span<T>(recv));
    return compare(recv, make<T>(m * n, [&](std::size_t i) {
                     return moved<T>(int(i / b), std::size_t(r) * m + i % b);
                   }));
  });
}

template <class T>
void check_type(run& s, std::size_t m) {
  if constexpr (dml::comm::reducible<T>) check_reductions<T>(s, m);
  check_movement<T>(s, m);
  check_point_to_point<T>(s, m);
  check_nonblocking<T>(s, m);
  check_host_staged<T>(s, m);
}

// ---- misuse, barrier and split -----------------------------------------------------------------------------

void check_misuse(run& s) {
  nccl& c = s.c;
  // Refused before anything is enqueued, on every rank alike; the communicator stays usable.
  s.check("all_reduce with recv smaller than send refused", [&]() -> std::string {
    device_buffer<float> a(8), b(7);
    try {
      c.all_reduce(in(a), b.span(), reduce_op::sum);
    } catch (const dml::invalid_argument&) {
      return "";
    }
    return "accepted";
  });
  s.check("reduce_scatter with send != size x recv refused", [&]() -> std::string {
    device_buffer<float> a(std::size_t(s.n) * 4 + 1), b(4);
    try {
      c.reduce_scatter(in(a), b.span(), reduce_op::sum);
    } catch (const dml::invalid_argument&) {
      return "";
    }
    return "accepted";
  });
  s.check("broadcast from a root outside the group refused", [&]() -> std::string {
    device_buffer<float> a(4);
    try {
      c.broadcast(a.span(), s.n);
    } catch (const dml::invalid_argument&) {
      return "";
    }
    return "accepted";
  });
}

void check_barrier_and_split(run& s) {
  nccl& c = s.c;
  const int n = s.n, r = s.r;
  s.check("barrier", [&] {
    c.barrier();
    c.barrier();
    return std::string();
  });

  // Even and odd world ranks, ordered by world rank: each group sums its members' world ranks.
  s.check("split(rank % 2, rank)", [&]() -> std::string {
    nccl g = c.split(r % 2, r);
    const int want_size = (n - r % 2 + 1) / 2, want_rank = r / 2;
    if (g.size() != want_size || g.rank() != want_rank)
      return "rank " + std::to_string(g.rank()) + " of " + std::to_string(g.size()) + ", expected " +
             std::to_string(want_rank) + " of " + std::to_string(want_size);
    std::int64_t want = 0;
    for (int p = r % 2; p < n; p += 2) want += p + 1;
    auto d = to_device(std::vector<std::int64_t>(3, r + 1));
    g.all_reduce(d.span(), reduce_op::sum);
    g.barrier();
    return compare(to_host(d), std::vector<std::int64_t>(3, want));
  });
  // One group, keys reversing the order: group rank n-1-r, and all_gather lists the world ranks backwards.
  s.check("split(0, size - rank)", [&]() -> std::string {
    nccl g = c.split(0, n - r);
    if (g.size() != n || g.rank() != n - 1 - r)
      return "rank " + std::to_string(g.rank()) + " of " + std::to_string(g.size()) + ", expected " +
             std::to_string(n - 1 - r) + " of " + std::to_string(n);
    const auto me = to_device(std::vector<std::int32_t>{r});
    device_buffer<std::int32_t> all(n);
    g.all_gather(in(me), all.span());
    return compare(to_host(all), make<std::int32_t>(n, [&](std::size_t i) { return std::int32_t(n - 1 - i); }));
  });
}

// ---- the order contract --------------------------------------------------------------------------------------

__device__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Waits delay_ns on the GPU, then writes p[i] = v·(i % 7 + 1): input that is ready only late.
__global__ void slow_fill(float* p, std::size_t count, float v, unsigned long long delay_ns) {
  const unsigned long long start = globaltimer_ns();
  while (globaltimer_ns() - start < delay_ns) {
  }
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < count;
       i += std::size_t(gridDim.x) * blockDim.x)
    p[i] = v * float(i % 7 + 1);
}

struct compute_stream {
  cudaStream_t s = nullptr;
  compute_stream() { DML_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~compute_stream() { cudaStreamDestroy(s); }
};

// A kernel on a non-blocking compute stream (dml::stream_scope) writes the input 20 ms late; the operation is
// called at once, with no synchronisation by the caller, and must see the kernel's values: its stream waits for
// the compute stream. The output is read on the compute stream after the call returns.
void check_order(run& s) {
  nccl& c = s.c;
  const int n = s.n, r = s.r;
  constexpr std::size_t m = std::size_t(1) << 20;
  constexpr unsigned long long delay_ns = 20'000'000;
  const auto launch = [&](compute_stream& cs, float* p, float v) -> std::string {
    slow_fill<<<64, 256, 0, cs.s>>>(p, m, v, delay_ns);
    DML_CHECK_CUDA(cudaGetLastError());
    // Still running: otherwise the check below would prove nothing.
    return cudaStreamQuery(cs.s) == cudaErrorNotReady ? "" : "the kernel had finished before the call";
  };
  const auto read = [&](compute_stream& cs, const device_buffer<float>& d) {
    std::vector<float> h(d.size());
    DML_CHECK_CUDA(cudaMemcpyAsync(h.data(), d.data(), d.bytes(), cudaMemcpyDeviceToHost, cs.s));
    DML_CHECK_CUDA(cudaStreamSynchronize(cs.s));
    return h;
  };
  const auto zeros = [&] {
    device_buffer<float> d(m);
    DML_CHECK_CUDA(cudaMemset(d.data(), 0, d.bytes()));
    DML_CHECK_CUDA(cudaDeviceSynchronize());
    return d;
  };
  const float ranks_sum = float(n) * float(n + 1) / 2;

  s.check("order: all_reduce(in place) after a slow kernel on the compute stream", [&] {
    compute_stream cs;
    auto data = zeros();
    dml::stream_scope scope(cs.s);
    const std::string late = launch(cs, data.data(), float(r + 1));
    c.all_reduce(data.span(), reduce_op::sum);
    return also(late, "result", compare(read(cs, data), make<float>(m, [&](std::size_t i) {
                                          return ranks_sum * float(i % 7 + 1);
                                        })));
  });
  s.check("order: iall_reduce(out of place) after a slow kernel on the compute stream", [&] {
    compute_stream cs;
    auto send = zeros(), recv = zeros();
    dml::stream_scope scope(cs.s);
    const std::string late = launch(cs, send.data(), float(r + 1));
    auto q = c.iall_reduce(in(send), recv.span(), reduce_op::sum);
    q.wait();
    return also(late, "result", compare(read(cs, recv), make<float>(m, [&](std::size_t i) {
                                          return ranks_sum * float(i % 7 + 1);
                                        })));
  });
  s.check("order: isendrecv(ring) after a slow kernel on the compute stream", [&] {
    compute_stream cs;
    auto send = zeros(), recv = zeros();
    dml::stream_scope scope(cs.s);
    const std::string late = launch(cs, send.data(), float(r + 1));
    const int prev = (r + n - 1) % n;
    c.isendrecv(in(send), (r + 1) % n, recv.span(), prev, 0).wait();
    return also(late, "result", compare(read(cs, recv), make<float>(m, [&](std::size_t i) {
                                          return float(prev + 1) * float(i % 7 + 1);
                                        })));
  });
}


// ---- recovery (DESIGN.md §11): abort, shrink, a communicator from a handed-out unique id -------------------

// body()'s verdict, an exception as a failure: for checks that must reach a barrier after it on every rank.
template <class F>
std::string verdict(F&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    return std::string("threw: ") + e.what();
  }
}

// "" when f throws comm_error whose message has `has`.
template <class F>
std::string throws_comm_error(F&& f, const std::string& has) {
  try {
    f();
  } catch (const dml::comm_error& e) {
    const std::string what = e.what();
    return what.find(has) != std::string::npos ? "" : "comm_error without \"" + has + "\": " + what;
  }
  return "did not throw";
}

void check_recovery(run& s, dml::comm::mpi& world) {
  nccl& c = s.c;
  const int n = s.n, r = s.r;
  const std::int64_t ranks_sum = std::int64_t(n) * (n + 1) / 2;

  s.check("abort(): the next all_reduce throws comm_error (aborted)", [&]() -> std::string {
    nccl g = c.split(0, r);
    auto d = to_device(std::vector<std::int64_t>(3, r + 1));
    g.all_reduce(d.span(), reduce_op::sum);
    if (const std::string why = compare(to_host(d), std::vector<std::int64_t>(3, ranks_sum)); !why.empty())
      return "before abort: " + why;
    g.abort();
    if (!g.aborted()) return "aborted() is false after abort()";
    return also(throws_comm_error([&] { g.all_reduce(d.span(), reduce_op::sum); }, "aborted"), "barrier",
                throws_comm_error([&] { g.barrier(); }, "aborted"));
  });

  // Rank 0 waits in an all_reduce that rank 1 never joins; another thread's abort() ends the wait.
  if (n >= 2) {
    s.check("abort() from another thread ends a wait() on a collective a rank never joins", [&]() -> std::string {
      nccl g = c.split(0, r);
      auto d = to_device(std::vector<float>(1024, 1.f));
      g.all_reduce(d.span(), reduce_op::sum);  // connects the ranks (NCCL connects at the first collective)
      const std::string why = verdict([&]() -> std::string {
        if (r != 0) return "";
        const auto t0 = std::chrono::steady_clock::now();
        std::thread killer([&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          g.abort();
        });
        std::string got = throws_comm_error([&] { g.all_reduce(d.span(), reduce_op::sum); }, "aborted");
        killer.join();
        if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(30)) got = also(got, "time", "took over 30 s");
        return got;
      });
      world.barrier();  // rank 1 keeps its end until rank 0 is done
      g.abort();
      return why;
    });
  }

  // The last rank is gone: the others shrink to n - 1 ranks, renumbered in order, and reduce over them.
  if (n >= 2) {
    for (const bool after_error : {false, true}) {
      const std::string how = after_error ? ", after_error: a collective hung on it)" : ")";
      s.check("shrink(exclude the last rank" + how,
              [&]() -> std::string {
        nccl p = c.split(0, r);
        auto d = to_device(std::vector<std::int64_t>(5, r + 1));
        p.all_reduce(d.span(), reduce_op::sum);  // connected, so that the next one is enqueued and hangs on the GPU
        dml::comm::request hung;
        const std::string why = verdict([&]() -> std::string {
          if (r == n - 1) return "";  // the rank that is gone
          const int gone[] = {n - 1};
          if (after_error) hung = p.iall_reduce(d.span(), reduce_op::sum);  // waits for the last rank forever
          nccl q = p.shrink(gone, after_error);
          if (after_error) p.abort();
          if (q.size() != n - 1 || q.rank() != r)
            return "rank " + std::to_string(q.rank()) + " of " + std::to_string(q.size()) + ", expected " +
                   std::to_string(r) + " of " + std::to_string(n - 1);
          auto e = to_device(std::vector<std::int64_t>(5, r + 1));
          q.all_reduce(e.span(), reduce_op::sum);
          q.barrier();
          return compare(to_host(e), std::vector<std::int64_t>(5, ranks_sum - n));
        });
        if (after_error && r < n - 1) p.abort();
        hung.cancel();
        world.barrier();  // the last rank keeps its end until the others are done
        if (after_error) p.abort();
        return why;
      });
    }
  } else if (r == 0) {
    std::printf("nccl_check: shrink needs 2 ranks (one GPU each): not checked on 1\n");
  }

  // The coordinator's part, played by rank 0 and MPI: a fresh id, handed to every rank.
  s.check("nccl(new_unique_id() from rank 0, rank, size): all_reduce", [&]() -> std::string {
    ncclUniqueId id{};
    if (r == 0) id = nccl::new_unique_id();
    DML_CHECK_MPI(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, world.native()));
    nccl g(id, r, n, {.timeout = std::chrono::seconds(60)});
    if (g.rank() != r || g.size() != n) return "rank " + std::to_string(g.rank()) + " of " + std::to_string(g.size());
    auto d = to_device(std::vector<std::int64_t>(7, r + 1));
    g.all_reduce(d.span(), reduce_op::sum);
    return compare(to_host(d), std::vector<std::int64_t>(7, ranks_sum));
  });

  // Non-blocking initialisation has a deadline: rank 1 of 2 never comes.
  s.check("nccl(id, 0, 2) with no rank 1: comm_error within the timeout", [&]() -> std::string {
    const auto t0 = std::chrono::steady_clock::now();
    std::string why = throws_comm_error(
        [&] { nccl g(nccl::new_unique_id(), 0, 2, {.timeout = std::chrono::seconds(2)}); },
        "rank 0 of 2: initialisation (waiting for every rank to join) did not complete within 2 s");
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(60)) why = also(why, "time", "took over 60 s");
    return why;
  });

  // Two ranks as two threads of one process, on two devices: only where this process is alone on its node's GPUs.
  int devices = 0;
  DML_CHECK_CUDA(cudaGetDeviceCount(&devices));
  if (n == 1 && devices >= 2) {
    s.check("nccl(new_unique_id(), t, 2) on two threads and two devices: all_reduce", [&]() -> std::string {
      const ncclUniqueId id = nccl::new_unique_id();
      std::string why[2];
      std::vector<std::thread> ranks;
      for (int t = 0; t < 2; ++t)
        ranks.emplace_back([&, t] {
          try {
            nccl g(id, t, 2, {.timeout = std::chrono::seconds(60), .device = t});
            auto d = to_device(std::vector<float>(9, float(t + 1)));
            g.all_reduce(d.span(), reduce_op::sum);
            why[t] = compare(to_host(d), std::vector<float>(9, 3.f));
          } catch (const std::exception& e) {
            why[t] = std::string("threw: ") + e.what();
          }
        });
      for (auto& t : ranks) t.join();
      return also(also("", "thread 0", why[0]), "thread 1", why[1]);
    });
  } else if (r == 0) {
    std::printf("nccl_check: two ranks as threads need one process on 2 GPUs: not checked\n");
  }
}

}  // namespace

static_assert(dml::comm::communicator<nccl>);

int main(int argc, char** argv) {
  dml::comm::mpi::environment env(&argc, &argv);
  dml::comm::mpi world;
  if (gpu_skip::skip_without_devices(world.native())) return gpu_skip::exit_code;
  try {
    nccl c(world, nullptr, {.timeout = std::chrono::seconds(120)});
    run s{c};
    if (s.r == 0) {
      int device = 0;
      cudaDeviceProp prop{};
      DML_CHECK_CUDA(cudaGetDevice(&device));
      DML_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
      std::printf("nccl_check: %d ranks, rank 0 on device %d (%s), NCCL %d\n", s.n, device, prop.name,
                  NCCL_VERSION_CODE);
    }
    s.check("topology", [&]() -> std::string {
      if (c.rank() == world.rank() && c.size() == world.size()) return "";
      return "rank " + std::to_string(c.rank()) + " of " + std::to_string(c.size()) + ", expected " +
             std::to_string(world.rank()) + " of " + std::to_string(world.size());
    });
    for (std::size_t m : {std::size_t(0), std::size_t(1), std::size_t(1023)}) {
      check_type<float>(s, m);
      check_type<double>(s, m);
      check_type<dml::bf16>(s, m);
      check_type<dml::fp16>(s, m);
      check_type<std::int32_t>(s, m);
      check_type<std::int64_t>(s, m);
      check_type<item>(s, m);
      if (s.r == 0) std::printf("nccl_check: sizes 0..%zu done, %zu checks so far\n", m, s.failed.size());
    }
    check_type<float>(s, std::size_t(1) << 22);
    check_misuse(s);
    check_barrier_and_split(s);
    check_order(s);
    check_recovery(s, world);

    // A check fails if it failed on any rank.
    std::vector<int> any(s.failed);
    world.all_reduce(std::span<int>(any), reduce_op::max);
    int failed = 0;
    for (int f : any) failed += f;
    if (s.r == 0) std::printf("nccl_check: %zu checks, %d failed\n", any.size(), failed);
    std::fflush(stdout);
    world.barrier();
    return failed == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    // A rank that cannot go on would leave the others waiting in a collective: end the job.
    std::printf("FAIL rank %d: %s\n", world.rank(), e.what());
    std::fflush(stdout);
    MPI_Abort(world.native(), 1);
    return 1;
  }
}
