// SPDX-License-Identifier: Apache-2.0
// tests/comm/suite.hpp — one test body for every communicator: each operation against a plain reference.
// Used by local_test.cpp (threads) and mpi_test.cpp (processes under mpirun).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "dml/comm/communicator.hpp"

namespace dml_test {

using dml::comm::reduce_op;

// Collects failures on any rank or thread; the test case checks them afterwards, so no assertion
// runs concurrently.
struct report {
  std::vector<std::string> failures;
  void expect(bool ok, const std::string& what) {
    if (!ok) failures.push_back(what);
  }
};

template <class T>
using math_t = std::conditional_t<std::is_same_v<T, dml::bf16> || std::is_same_v<T, dml::fp16>, float, T>;
template <class T>
double to_d(T x) {
  return double(static_cast<math_t<T>>(x));
}
template <class T>
T from_d(double x) {
  return T(static_cast<math_t<T>>(x));
}

// Small integers: every sum, max, min and (for prod, powers of two) product is exact in every
// type, so the reference can be exact whatever order a model reduces in.
template <class T>
T value(int rank, std::size_t i, reduce_op op) {
  if (op == reduce_op::prod) return from_d<T>(double(1 + (i + rank) % 2));
  return from_d<T>(double(int((i * 3 + rank * 5 + 1) % 11) - 5));
}

template <class T>
double tolerance() {
  if constexpr (std::is_integral_v<T>) return 0;
  else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) return 1e-6;
  else return 1e-2;
}

template <class T>
T reference(int n, std::size_t i, reduce_op op) {
  double acc = to_d(value<T>(0, i, op));
  for (int p = 1; p < n; ++p) {
    const double v = to_d(value<T>(p, i, op));
    switch (op) {
      case reduce_op::sum:
      case reduce_op::avg: acc += v; break;
      case reduce_op::prod: acc *= v; break;
      case reduce_op::max: acc = std::max(acc, v); break;
      case reduce_op::min: acc = std::min(acc, v); break;
    }
  }
  if (op == reduce_op::avg) acc /= n;
  return from_d<T>(acc);
}

// Compares got[i] with want(i); names the operation and the largest difference.
template <class T, class Want>
void compare(report& rep, const std::string& what, std::span<const T> got, Want want) {
  double max_abs_diff = 0;
  std::size_t worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double w = to_d(want(i));
    const double d = std::abs(to_d(got[i]) - w);
    if (d > tolerance<T>() * std::max(1.0, std::abs(w)) && d >= max_abs_diff) {
      max_abs_diff = d;
      worst = i;
    }
  }
  if (max_abs_diff > 0)
    rep.failures.push_back(dml::detail::cat(what, ": max_abs_diff=", max_abs_diff, " at ", worst,
                                            " (got ", to_d(got[worst]), ", want ", to_d(want(worst)), ")"));
}

template <class T>
std::vector<reduce_op> ops_for() {
  if constexpr (std::is_integral_v<T>)
    return {reduce_op::sum, reduce_op::max, reduce_op::min, reduce_op::prod};
  else
    return {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min, reduce_op::prod};
}

template <class T, class Comm>
void check_type(Comm& c, report& rep, const std::vector<std::size_t>& sizes) {
  const int n = c.size(), r = c.rank();
  const std::string tn(dml::comm::type_name<T>());
  for (std::size_t m : sizes) {
    const auto tag = [&](const char* op, reduce_op o = reduce_op::sum) {
      return dml::detail::cat(op, "<", tn, "> n=", n, " rank=", r, " size=", m, " op=", dml::comm::name(o));
    };
    for (reduce_op op : ops_for<T>()) {
      const auto want = [&](std::size_t i) { return reference<T>(n, i, op); };
      // all_reduce out of place and in place
      std::vector<T> in(m), out(m, from_d<T>(99));
      for (std::size_t i = 0; i < m; ++i) in[i] = value<T>(r, i, op);
      c.all_reduce(std::span<const T>(in), std::span<T>(out), op);
      compare<T>(rep, tag("all_reduce", op), out, want);
      c.all_reduce(std::span<T>(in), op);
      compare<T>(rep, tag("all_reduce(in place)", op), in, want);

      // reduce_scatter: block b of rank p's send holds value(p, b*m + i)
      std::vector<T> rs_in(m * n), rs_out(m, from_d<T>(99));
      for (std::size_t i = 0; i < m * n; ++i) rs_in[i] = value<T>(r, i, op);
      c.reduce_scatter(std::span<const T>(rs_in), std::span<T>(rs_out), op);
      const auto want_rs = [&](std::size_t i) { return reference<T>(n, m * r + i, op); };
      compare<T>(rep, tag("reduce_scatter", op), rs_out, want_rs);
      auto mine = c.reduce_scatter(std::span<T>(rs_in), op);
      compare<T>(rep, tag("reduce_scatter(in place)", op), std::span<const T>(mine), want_rs);

      // reduce to a root that moves with the size
      const int root = int(m % n);
      std::vector<T> red(r == root ? m : 0, from_d<T>(99));
      for (std::size_t i = 0; i < m; ++i) in[i] = value<T>(r, i, op);
      c.reduce(std::span<const T>(in), std::span<T>(red), op, root);
      if (r == root) compare<T>(rep, tag("reduce", op), red, want);
      c.reduce(std::span<T>(in), op, root);
      if (r == root) compare<T>(rep, tag("reduce(in place)", op), in, want);
    }

    // all_gather: rank p contributes value(p, i)
    std::vector<T> mine(m), all(m * n, from_d<T>(99));
    for (std::size_t i = 0; i < m; ++i) mine[i] = value<T>(r, i, reduce_op::sum);
    const auto want_ag = [&](std::size_t i) { return value<T>(int(i / std::max<std::size_t>(m, 1)), i % std::max<std::size_t>(m, 1), reduce_op::sum); };
    c.all_gather(std::span<const T>(mine), std::span<T>(all));
    compare<T>(rep, tag("all_gather"), all, want_ag);
    std::fill(all.begin(), all.end(), from_d<T>(99));
    std::copy(mine.begin(), mine.end(), all.begin() + m * r);
    c.all_gather(std::span<T>(all));
    compare<T>(rep, tag("all_gather(in place)"), all, want_ag);

    // all_gatherv: rank p contributes counts[p] elements
    std::vector<std::size_t> counts(n);
    for (int p = 0; p < n; ++p) counts[p] = m / (p + 1) + p % 2;
    std::vector<std::size_t> offs(n + 1, 0);
    for (int p = 0; p < n; ++p) offs[p + 1] = offs[p] + counts[p];
    std::vector<T> vin(counts[r]), vout(offs[n], from_d<T>(99));
    for (std::size_t i = 0; i < counts[r]; ++i) vin[i] = value<T>(r, i, reduce_op::sum);
    c.all_gatherv(std::span<const T>(vin), std::span<T>(vout), std::span<const std::size_t>(counts));
    compare<T>(rep, tag("all_gatherv"), vout, [&](std::size_t i) {
      const int p = int(std::upper_bound(offs.begin(), offs.end(), i) - offs.begin()) - 1;
      return value<T>(p, i - offs[p], reduce_op::sum);
    });

    // broadcast from every root
    for (int root = 0; root < n; ++root) {
      std::vector<T> b(m);
      for (std::size_t i = 0; i < m; ++i) b[i] = value<T>(r, i, reduce_op::sum);
      c.broadcast(std::span<T>(b), root);
      compare<T>(rep, tag("broadcast"), b, [&](std::size_t i) { return value<T>(root, i, reduce_op::sum); });
    }

    // all_to_all: block q of rank p's send is value(p, q*m + i); rank r receives block r of each
    std::vector<T> a_in(m * n), a_out(m * n, from_d<T>(99));
    for (std::size_t i = 0; i < m * n; ++i) a_in[i] = value<T>(r, i, reduce_op::sum);
    const auto want_a2a = [&](std::size_t i) {
      const std::size_t p = i / std::max<std::size_t>(m, 1), k = i % std::max<std::size_t>(m, 1);
      return value<T>(int(p), m * r + k, reduce_op::sum);
    };
    c.all_to_all(std::span<const T>(a_in), std::span<T>(a_out));
    compare<T>(rep, tag("all_to_all"), a_out, want_a2a);

    // all_to_allv: rank p sends cnt(p, q) elements to rank q, value(p, 1000*q + k)
    const auto cnt = [&](int from, int to) { return std::size_t((m + from + 2 * to) % 7) * (m > 0); };
    std::vector<std::size_t> sc(n), rc(n);
    for (int q = 0; q < n; ++q) sc[q] = cnt(r, q), rc[q] = cnt(q, r);
    std::vector<T> v_in, v_out(std::accumulate(rc.begin(), rc.end(), std::size_t(0)), from_d<T>(99));
    for (int q = 0; q < n; ++q)
      for (std::size_t k = 0; k < sc[q]; ++k) v_in.push_back(value<T>(r, 1000 * q + k, reduce_op::sum));
    std::vector<T> want_v;
    for (int p = 0; p < n; ++p)
      for (std::size_t k = 0; k < rc[p]; ++k) want_v.push_back(value<T>(p, 1000 * r + k, reduce_op::sum));
    c.all_to_allv(std::span<const T>(v_in), std::span<const std::size_t>(sc), std::span<T>(v_out),
                  std::span<const std::size_t>(rc));
    compare<T>(rep, tag("all_to_allv"), v_out, [&](std::size_t i) { return want_v[i]; });

    // send/recv around a ring, two tags received in the opposite order of sending
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    std::vector<T> s1(m), s2(m + 1), g1(m), g2(m + 1);
    for (std::size_t i = 0; i < m; ++i) s1[i] = value<T>(r, i, reduce_op::sum);
    for (std::size_t i = 0; i <= m; ++i) s2[i] = value<T>(r, i + 7, reduce_op::sum);
    auto q1 = c.isend(std::span<const T>(s1), next, 1);
    auto q2 = c.isend(std::span<const T>(s2), next, 2);
    c.recv(std::span<T>(g2), prev, 2);
    c.recv(std::span<T>(g1), prev, 1);
    q1.wait();
    q2.wait();
    compare<T>(rep, tag("send/recv tag 1"), g1, [&](std::size_t i) { return value<T>(prev, i, reduce_op::sum); });
    compare<T>(rep, tag("send/recv tag 2"), g2, [&](std::size_t i) { return value<T>(prev, i + 7, reduce_op::sum); });
  }
}

// Non-blocking forms: issue, compute meanwhile, then wait.
template <class Comm>
void check_nonblocking(Comm& c, report& rep, std::size_t m) {
  const int n = c.size(), r = c.rank();
  std::vector<float> x(m), y(m * n), z(m), b(m);
  for (std::size_t i = 0; i < m; ++i) x[i] = value<float>(r, i, reduce_op::sum);
  for (std::size_t i = 0; i < m * n; ++i) y[i] = value<float>(r, i, reduce_op::sum);
  for (std::size_t i = 0; i < m; ++i) b[i] = value<float>(r, i, reduce_op::max);
  auto q1 = c.iall_reduce(std::span<float>(x), reduce_op::sum);
  auto q2 = c.ireduce_scatter(std::span<const float>(y), std::span<float>(z), reduce_op::sum);
  auto q3 = c.ibroadcast(std::span<float>(b), n - 1);
  double busy = 0;  // work the caller overlaps with communication
  for (std::size_t i = 0; i < 100000; ++i) busy += std::sqrt(double(i));
  rep.expect(busy > 0, "overlap work");
  while (!q1.test()) {
  }
  q2.wait();
  q3.wait();
  rep.expect(q1.done() && q2.done() && q3.done(), "requests report done after wait");
  compare<float>(rep, "iall_reduce", x, [&](std::size_t i) { return reference<float>(n, i, reduce_op::sum); });
  compare<float>(rep, "ireduce_scatter", z, [&](std::size_t i) { return reference<float>(n, m * r + i, reduce_op::sum); });
  compare<float>(rep, "ibroadcast", b, [&](std::size_t i) { return value<float>(n - 1, i, reduce_op::max); });
  std::vector<float> g(m * n);
  std::vector<float> mine(x.begin(), x.end());
  c.iall_gather(std::span<const float>(mine), std::span<float>(g)).wait();
  compare<float>(rep, "iall_gather", g, [&](std::size_t i) { return x[i % std::max<std::size_t>(m, 1)]; });
  // a blocking call after non-blocking ones keeps every rank's order
  std::vector<float> u(m, 1.0f), v(m, 2.0f);
  auto q4 = c.iall_reduce(std::span<float>(u), reduce_op::sum);
  c.all_reduce(std::span<float>(v), reduce_op::sum);
  q4.wait();
  compare<float>(rep, "iall_reduce then all_reduce", u, [&](std::size_t) { return float(n); });
  compare<float>(rep, "all_reduce after iall_reduce", v, [&](std::size_t) { return 2.0f * n; });
  c.barrier();
}

// Misuse that each rank can see alone throws invalid_argument on that rank before any exchange.
template <class Comm>
void check_misuse(Comm& c, report& rep) {
  const int n = c.size();
  const auto throws = [&](const char* what, auto f) {
    try {
      f();
      rep.failures.push_back(dml::detail::cat(what, ": expected dml::invalid_argument, nothing thrown"));
    } catch (const dml::invalid_argument&) {
    }
  };
  std::vector<float> x(n + 1), y(1);
  if (n > 1)
    throws("reduce_scatter size not divisible", [&] { c.reduce_scatter(std::span<float>(x), reduce_op::sum); });
  throws("broadcast root out of range", [&] { c.broadcast(std::span<float>(y), n); });
  throws("reduce root out of range", [&] { c.reduce(std::span<float>(y), reduce_op::sum, -1); });
  throws("send peer out of range", [&] { c.send(std::span<const float>(y), n, 0); });
  std::vector<std::int32_t> k(3);
  throws("avg of int32", [&] { c.all_reduce(std::span<std::int32_t>(k), reduce_op::avg); });
  throws("all_gather wrong recv size", [&] {
    c.all_gather(std::span<const float>(y), std::span<float>(x));
  });
  c.barrier();
}

template <class Comm>
report run_suite(Comm& c, const std::vector<std::size_t>& sizes) {
  report rep;
  check_type<float>(c, rep, sizes);
  check_type<double>(c, rep, sizes);
  check_type<dml::bf16>(c, rep, sizes);
  check_type<dml::fp16>(c, rep, sizes);
  check_type<std::int32_t>(c, rep, sizes);
  check_type<std::int64_t>(c, rep, sizes);
  check_nonblocking(c, rep, sizes.back());
  check_nonblocking(c, rep, 0);
  check_misuse(c, rep);
  return rep;
}

// A 2 x (n/2) grid: collectives along rows and columns at the same time.
template <class Comm>
void check_grid(Comm& c, report& rep) {
  const int n = c.size(), r = c.rank();
  if (n % 2) return;
  const int cols = n / 2, row = r / cols, col = r % cols;
  Comm rows = c.split(row, col);
  Comm columns = c.split(col, -row);  // key reverses the order within a column
  rep.expect(rows.size() == cols && rows.rank() == col, dml::detail::cat("row group of rank ", r));
  rep.expect(columns.size() == 2 && columns.rank() == 1 - row, dml::detail::cat("column group of rank ", r));
  const std::size_t m = 10007;
  std::vector<double> a(m, double(r + 1)), b(m, double(10 * (r + 1)));
  auto qa = rows.iall_reduce(std::span<double>(a), reduce_op::sum);
  auto qb = columns.iall_reduce(std::span<double>(b), reduce_op::max);
  qa.wait();
  qb.wait();
  double row_sum = 0;
  for (int k = 0; k < cols; ++k) row_sum += row * cols + k + 1;
  const double col_max = 10.0 * (cols + col + 1);
  compare<double>(rep, "row all_reduce", a, [&](std::size_t) { return row_sum; });
  compare<double>(rep, "column all_reduce", b, [&](std::size_t) { return col_max; });
  // blocking along rows, then columns, then the whole group
  std::vector<std::int64_t> g(2 * cols);
  std::int64_t me = r;
  rows.all_gather(std::span<const std::int64_t>(&me, 1), std::span<std::int64_t>(g.data(), cols));
  for (int k = 0; k < cols; ++k) rep.expect(g[k] == row * cols + k, "row all_gather");
  std::vector<float> bc(5, float(r));
  columns.broadcast(std::span<float>(bc), 0);  // column rank 0 is the row-1 member
  rep.expect(bc[4] == float(cols + col), "column broadcast");
  c.barrier();
}

}  // namespace dml_test
