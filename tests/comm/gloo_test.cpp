// SPDX-License-Identifier: Apache-2.0
// tests/comm/gloo_test.cpp — comm::gloo: the shared suite on 1 to 4 ranks as threads (each its own context over one
// HashStore), splits, and failures: a lost peer, the latch, a rank that never joins.
#include <doctest/doctest.h>

#include "skip.hpp"

#if DML_TEST_HAVE_GLOO

#include <gloo/rendezvous/hash_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dml/comm/gloo.hpp"
#include "dml/comm/gloo_store.hpp"
#include "suite.hpp"
#include "temp_dir.hpp"

namespace gloo_test {

// dml::comm::gloo beside Gloo's own namespace ::gloo.
using comm_gloo = dml::comm::gloo;
using dml::comm::reduce_op;
using namespace std::chrono_literals;

namespace {

// Runs fn(comm) on n ranks, threads of this process, each with its own context over one HashStore; returns what
// the ranks reported and the messages of the exceptions they threw.
template <class F>
std::vector<std::string> on_ranks(int n, F fn, comm_gloo::options opt = {.timeout = 60s}) {
  auto store = std::make_shared<::gloo::rendezvous::HashStore>();
  std::mutex m;
  std::vector<std::string> failures;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      dml_test::report rep;
      try {
        comm_gloo c(store, r, n, opt);
        rep = fn(c);
      } catch (const std::exception& e) {
        rep.failures.push_back(dml::detail::cat("rank ", r, " threw: ", e.what()));
      }
      std::lock_guard lk(m);
      failures.insert(failures.end(), rep.failures.begin(), rep.failures.end());
    });
  for (auto& t : threads) t.join();
  return failures;
}

void expect_clean(const std::vector<std::string>& failures) {
  for (const auto& f : failures) FAIL_CHECK(f);
  CHECK(failures.empty());
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---- ranks as processes over a file store

// Runs f in a child process, which exits with f's result (2 when it threw).
template <class F>
pid_t spawn(F f) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int rc = 2;
    try {
      rc = f();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d threw: %s\n", int(::getpid()), e.what());
    }
    std::fflush(stderr);
    ::_exit(rc);
  }
  return pid;
}

// Waits for every child until the deadline; returns their wait statuses, -1 for one still running then (killed).
std::vector<int> reap(const std::vector<pid_t>& pids, std::chrono::seconds bound) {
  const auto deadline = std::chrono::steady_clock::now() + bound;
  std::vector<int> status(pids.size(), -1);
  std::vector<bool> done(pids.size(), false);
  for (std::size_t left = pids.size(); left > 0;) {
    for (std::size_t i = 0; i < pids.size(); ++i) {
      int st = 0;
      if (!done[i] && ::waitpid(pids[i], &st, WNOHANG) == pids[i]) status[i] = st, done[i] = true, --left;
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (std::size_t i = 0; i < pids.size(); ++i)
        if (!done[i]) ::kill(pids[i], SIGKILL), ::waitpid(pids[i], nullptr, 0);
      break;
    }
    std::this_thread::sleep_for(10ms);
  }
  return status;
}

int exit_code(int status) { return status >= 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1; }

// Every rank marks that it finished its first all_reduce; a victim waits for all marks before it stops.
void mark(const dml_test::temp_dir& dir, int rank) { std::ofstream(dir / ("done-" + std::to_string(rank))) << 1; }
void wait_marks(const dml_test::temp_dir& dir, int n) {
  for (int r = 0; r < n; ++r)
    while (!std::filesystem::exists(dir / ("done-" + std::to_string(r)))) std::this_thread::sleep_for(5ms);
}

// A survivor: the next all_reduce must throw comm_error naming the operation, rank and size, and every operation
// after it must throw at once. Exit codes: 0 as expected, 3 nothing thrown, 4 a wrong message, 5 no latch.
int survivor_checks(comm_gloo& c) {
  std::vector<float> x(4096, 1.0f);
  try {
    c.all_reduce(std::span<float>(x), reduce_op::sum);
    return 3;
  } catch (const dml::comm_error& e) {
    std::fprintf(stderr, "rank %d: %s\n", c.rank(), e.what());
    if (!contains(e.what(), dml::detail::cat("dml::comm::gloo::all_reduce: rank ", c.rank(), " of ", c.size())))
      return 4;
  }
  if (!c.broken()) return 5;
  try {
    c.broadcast(std::span<float>(x), 0);
    return 5;
  } catch (const dml::comm_error& e) {
    if (!contains(e.what(), "broken by an earlier error: dml::comm::gloo::all_reduce")) return 5;
  }
  return 0;
}

// n processes over a file store; rank victim, after every rank's first all_reduce, raises sig.
std::vector<int> lose_a_rank(int n, int victim, int sig, std::chrono::milliseconds timeout, std::chrono::seconds bound) {
  dml_test::temp_dir dir("dml-gloo");
  const std::string spec = "file:" + dir.path.string();
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r)
    pids.push_back(spawn([&, r] {
      comm_gloo c(dml::comm::open_store(spec, timeout), r, n, {.timeout = timeout});
      std::vector<float> x(4096, 1.0f);
      c.all_reduce(std::span<float>(x), reduce_op::sum);
      if (x[0] != float(n)) return 6;
      mark(dir, r);
      if (r == victim) {
        wait_marks(dir, n);
        ::raise(sig);
        return 0;
      }
      return survivor_checks(c);
    }));
  // A stopped victim stays stopped until the survivors are done.
  std::vector<pid_t> survivors;
  for (int r = 0; r < n; ++r)
    if (r != victim) survivors.push_back(pids[r]);
  auto status = reap(survivors, bound);
  ::kill(pids[victim], SIGKILL);
  ::waitpid(pids[victim], nullptr, 0);
  return status;
}

}  // namespace

static_assert(dml::comm::communicator<comm_gloo>);

TEST_CASE("comm::gloo: every operation, dtype, size and group size matches the reference") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    expect_clean(on_ranks(n, [](comm_gloo& c) { return dml_test::run_suite(c, {0, 1, 1001, (1u << 15) + 3}); }));
  }
}

TEST_CASE("comm::gloo: sub-groups of one rank each, of all ranks reversed, and a grid") {
  expect_clean(on_ranks(4, [](comm_gloo& c) {
    comm_gloo self = c.split(c.rank(), 0);
    dml_test::report rep = dml_test::run_suite(self, {0, 17});
    rep.expect(self.size() == 1, "self group of size 1");
    comm_gloo reversed = c.split(0, -c.rank());
    rep.expect(reversed.rank() == c.size() - 1 - c.rank(), "reversed rank");
    auto more = dml_test::run_suite(reversed, {3, 1001});
    rep.failures.insert(rep.failures.end(), more.failures.begin(), more.failures.end());
    dml_test::check_grid(c, rep);
    return rep;
  }));
}

TEST_CASE("comm::gloo: irecv posted before isend and after it, polled with test(), on every pair") {
  expect_clean(on_ranks(3, [](comm_gloo& c) {
    dml_test::report rep;
    const int n = c.size(), r = c.rank();
    std::vector<std::vector<double>> in(n, std::vector<double>(1000)), out(n);
    std::vector<dml::comm::request> reqs;
    for (int p = 0; p < n; ++p) {
      out[p].assign(1000, 100.0 * r + p);
      // receives first from lower ranks, sends first to higher ones (and to itself)
      if (p < r) reqs.push_back(c.irecv(std::span<double>(in[p]), p, 5));
      reqs.push_back(c.isend(std::span<const double>(out[p]), p, 5));
      if (p >= r) reqs.push_back(c.irecv(std::span<double>(in[p]), p, 5));
    }
    for (auto& q : reqs)
      while (!q.test()) std::this_thread::yield();
    for (int p = 0; p < n; ++p)
      rep.expect(in[p][0] == 100.0 * p + r && in[p][999] == 100.0 * p + r, dml::detail::cat("message from ", p));
    return rep;
  }));
}

TEST_CASE("comm::gloo: a peer that goes away fails the next collective, and the error latches") {
  std::vector<std::string> seen(2);
  expect_clean(on_ranks(2, [&](comm_gloo& c) {
    dml_test::report rep;
    std::vector<float> x(1000, 1.0f);
    c.all_reduce(std::span<float>(x), reduce_op::sum);
    rep.expect(x[0] == 2.0f && !c.broken(), "a first all_reduce works");
    if (c.rank() == 1) {
      c = comm_gloo(std::make_shared<::gloo::rendezvous::HashStore>(), 0, 1);  // closes its connections
      return rep;
    }
    try {
      c.all_reduce(std::span<float>(x), reduce_op::sum);
      rep.failures.push_back("all_reduce with a lost peer: expected comm_error, nothing thrown");
    } catch (const dml::comm_error& e) {
      seen[0] = e.what();
    }
    rep.expect(c.broken(), "broken() after the error");
    try {
      c.barrier();
      rep.failures.push_back("barrier after an error: expected comm_error, nothing thrown");
    } catch (const dml::comm_error& e) {
      seen[1] = e.what();
    }
    try {  // messages to itself too
      c.send(std::span<const float>(x), 0, 1);
      rep.failures.push_back("send to itself after an error: expected comm_error, nothing thrown");
    } catch (const dml::comm_error&) {
    }
    return rep;
  }));
  INFO(seen[0]);
  INFO(seen[1]);
  CHECK(contains(seen[0], "dml::comm::gloo::all_reduce: rank 0 of 2: "));
  CHECK(contains(seen[1], "dml::comm::gloo::barrier: rank 0 of 2: broken by an earlier error: "
                          "dml::comm::gloo::all_reduce: rank 0 of 2: "));
}

TEST_CASE("comm::gloo: a rank that never joins is a comm_error within the deadline, naming it") {
  auto store = std::make_shared<::gloo::rendezvous::HashStore>();
  std::string what;
  try {
    comm_gloo c(store, 0, 2, {.timeout = 300ms});
  } catch (const dml::comm_error& e) {
    what = e.what();
  }
  INFO(what);
  CHECK(contains(what, "dml::comm::gloo::rendezvous: rank 0 of 2: no connection within 300 ms (waited for rank 1"));
}

TEST_CASE("comm::gloo: processes; a rank killed (SIGKILL) fails the survivors' next collective, and the error latches") {
  // Timeout 3 s: the survivors must be done well before the bound (timeout plus a generous margin), not hang.
  const auto status = lose_a_rank(3, 1, SIGKILL, 3s, 30s);
  for (std::size_t i = 0; i < status.size(); ++i) {
    CAPTURE(i);
    CHECK(exit_code(status[i]) == 0);
  }
}

TEST_CASE("comm::gloo: processes; a rank stopped (SIGSTOP) fails the survivors' next collective after the timeout") {
  const auto status = lose_a_rank(2, 1, SIGSTOP, 1s, 30s);
  REQUIRE(status.size() == 1);
  CHECK(exit_code(status[0]) == 0);
}

TEST_CASE("comm::gloo: processes; a rank that never joins a file store is a comm_error within the deadline") {
  dml_test::temp_dir dir("dml-gloo");
  auto store = dml::comm::open_store("file:" + dir.path.string(), 1s);
  std::string what;
  try {
    comm_gloo c(store, 1, 3, {.timeout = 1s});
  } catch (const dml::comm_error& e) {
    what = e.what();
  }
  INFO(what);
  CHECK(contains(what, "dml::comm::gloo::rendezvous: rank 1 of 3: no connection within 1000 ms (waited for rank 0"));
}

TEST_CASE("comm::gloo: a fresh world over a PrefixStore of the same store, after the first is gone") {
  auto store = std::make_shared<::gloo::rendezvous::HashStore>();
  for (int epoch = 0; epoch < 3; ++epoch) {
    std::vector<std::thread> threads;
    std::vector<float> got(2);
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        auto prefixed = std::make_shared<::gloo::rendezvous::PrefixStore>("epoch-" + std::to_string(epoch), *store);
        comm_gloo c(prefixed, r, 2, {.timeout = 20s});
        std::vector<float> x(3, float(r + epoch));
        c.all_reduce(std::span<float>(x), reduce_op::sum);
        got[r] = x[2];
      });
    for (auto& t : threads) t.join();
    CHECK(got[0] == float(1 + 2 * epoch));
    CHECK(got[1] == float(1 + 2 * epoch));
  }
}

TEST_CASE("comm::gloo: open_store refuses a missing, non-directory or read-only directory, naming it") {
  dml_test::temp_dir dir("dml-gloo");
  const std::string missing = (dir / "missing").string();
  CHECK_THROWS_WITH_AS(dml::comm::open_store("file:" + missing, 1s),
                       doctest::Contains(("expected an existing directory in 'file:" + missing + "', found nothing").c_str()),
                       dml::invalid_argument);
  std::ofstream(dir / "plain") << "x";
  CHECK_THROWS_WITH_AS(dml::comm::open_store("file:" + (dir / "plain").string(), 1s),
                       doctest::Contains("found something else"), dml::invalid_argument);
  // Root writes anywhere a mode allows nothing; /proc refuses new files to root too.
  std::string locked = (dir / "locked").string();
  std::filesystem::create_directory(locked);
  ::chmod(locked.c_str(), 0555);
  if (::geteuid() == 0) locked = "/proc";
  CHECK_THROWS_WITH_AS(dml::comm::open_store("file:" + locked, 1s),
                       doctest::Contains(("expected a writable directory in 'file:" + locked + "', found " + locked +
                                          " not writable").c_str()),
                       dml::invalid_argument);
  CHECK_THROWS_WITH_AS(dml::comm::open_store("tcp:", 1s), doctest::Contains("expected a store spec file:DIR or tcp:HOST:PORT, found 'tcp:'"),
                       dml::invalid_argument);
  CHECK(dml::comm::open_store("file:" + dir.path.string(), 1s) != nullptr);
}

TEST_CASE("comm::gloo: bad arguments name the setting") {
  auto store = std::make_shared<::gloo::rendezvous::HashStore>();
  CHECK_THROWS_WITH_AS(comm_gloo(store, 2, 2), doctest::Contains("expected 0 <= rank < size, found rank 2 and size 2"),
                       dml::invalid_argument);
  CHECK_THROWS_WITH_AS(comm_gloo(nullptr, 0, 1), doctest::Contains("expected a store"), dml::invalid_argument);
  CHECK_THROWS_WITH_AS(comm_gloo(store, 0, 1, {.timeout = 0ms}), doctest::Contains("expected a timeout > 0 ms, found 0"),
                       dml::invalid_argument);
}

}  // namespace gloo_test

#else

TEST_CASE("comm::gloo: not built") { dml_test::skip("dml was configured without Gloo (libgloo-dev)"); }

#endif
