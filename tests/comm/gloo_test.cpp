// SPDX-License-Identifier: Apache-2.0
// tests/comm/gloo_test.cpp — comm::gloo: the shared suite on 1 to 4 ranks as threads (each its own context over one
// HashStore), splits, and failures: a lost peer, the latch, a rank that never joins.
#include <doctest/doctest.h>

#include "skip.hpp"

#if DML_TEST_HAVE_GLOO

#include <gloo/rendezvous/hash_store.h>

#include <chrono>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dml/comm/gloo.hpp"
#include "suite.hpp"

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

TEST_CASE("comm::gloo: bad arguments name the setting") {
  auto store = std::make_shared<::gloo::rendezvous::HashStore>();
  CHECK_THROWS_WITH_AS(comm_gloo(store, 2, 2), doctest::Contains("expected 0 <= rank < size, found rank 2 and size 2"),
                       dml::invalid_argument);
  CHECK_THROWS_WITH_AS(comm_gloo(nullptr, 0, 1), doctest::Contains("expected a store"), dml::invalid_argument);
  CHECK_THROWS_WITH_AS(comm_gloo(store, 0, 1, {.timeout = 0ms}), doctest::Contains("expected a timeout > 0 ms, found 0"),
                       dml::invalid_argument);
}

#else

TEST_CASE("comm::gloo: not built") { dml_test::skip("dml was configured without Gloo (libgloo-dev)"); }

#endif
