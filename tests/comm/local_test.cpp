// SPDX-License-Identifier: Apache-2.0
// tests/comm/local_test.cpp — comm::local: every operation against a reference, sub-groups, failures.
// Labelled unit and tsan: runs under ASan/UBSan and ThreadSanitizer too.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dml/comm/local.hpp"
#include "suite.hpp"

namespace local_test {

using dml::comm::local;
using dml::comm::reduce_op;

namespace {

// Runs fn on n local ranks and checks that no rank reported a failure.
template <class F>
void on_ranks(int n, F fn) {
  std::mutex m;
  std::vector<std::string> failures;
  local::run(n, [&](local& c) {
    dml_test::report rep = fn(c);
    std::lock_guard lk(m);
    failures.insert(failures.end(), rep.failures.begin(), rep.failures.end());
  });
  for (const auto& f : failures) FAIL_CHECK(f);
  CHECK(failures.empty());
}

}  // namespace

static_assert(dml::comm::communicator<local>);

TEST_CASE("comm::local: every operation, dtype, size and group size matches the reference") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    on_ranks(n, [](local& c) { return dml_test::run_suite(c, {0, 1, 1001, (1u << 15) + 3}); });
  }
}

TEST_CASE("comm::local: ranks count and thread budget") {
  std::atomic<int> seen{0};
  local::run(3, [&](local& c) {
    CHECK(c.size() == 3);
    CHECK(dml::thread_budget() == std::max(1, int(std::thread::hardware_concurrency()) / 3));
    seen.fetch_add(1 << (4 * c.rank()));
  });
  CHECK(seen.load() == 0x111);
}

TEST_CASE("comm::local: rank 0 runs on the calling thread, the others on their own, and the caller's budget comes back") {
  const dml::thread_budget_scope scope(3);  // the test's own budget back at the end
  const auto caller = std::this_thread::get_id();
  std::mutex m;
  std::vector<std::thread::id> ids(3);
  local::run(3, [&](local& c) {
    std::lock_guard lk(m);
    ids[static_cast<std::size_t>(c.rank())] = std::this_thread::get_id();
  });
  CHECK(ids[0] == caller);
  CHECK(ids[1] != caller);
  CHECK(ids[2] != caller);
  CHECK(ids[1] != ids[2]);
  CHECK(dml::thread_budget() == 3);
  // The same when rank 0 throws.
  CHECK_THROWS_WITH_AS(local::run(2, [](local& c) {
                         if (c.rank() == 0) throw std::runtime_error("rank 0 fails");
                         c.barrier();
                       }),
                       "rank 0 fails", std::runtime_error);
  CHECK(dml::thread_budget() == 3);
}

TEST_CASE("comm::local: split into a 2x2 grid, collectives along rows and columns at once") {
  on_ranks(4, [](local& c) {
    dml_test::report rep;
    dml_test::check_grid(c, rep);
    return rep;
  });
  on_ranks(6, [](local& c) {
    dml_test::report rep;
    dml_test::check_grid(c, rep);
    return rep;
  });
}

TEST_CASE("comm::local: counts that differ across ranks throw on every rank") {
  std::atomic<int> thrown{0};
  local::run(3, [&](local& c) {
    std::vector<float> x(c.rank() == 1 ? 5 : 4, 1.0f);
    try {
      c.all_reduce(std::span<float>(x), reduce_op::sum);
    } catch (const dml::invalid_argument& e) {
      CHECK(std::string(e.what()).find("rank 1 has 5") != std::string::npos);
      thrown.fetch_add(1);
    }
    std::vector<float> y(7, 1.0f);  // the group stays usable
    c.all_reduce(std::span<float>(y), reduce_op::sum);
    CHECK(y[6] == 3.0f);
    std::vector<std::size_t> sc(3, 1), rc(3, 1);
    if (c.rank() == 2) rc[0] = 2;
    std::vector<float> s(3), r(c.rank() == 2 ? 4 : 3);
    CHECK_THROWS_AS(c.all_to_allv(std::span<const float>(s), std::span<const std::size_t>(sc),
                                  std::span<float>(r), std::span<const std::size_t>(rc)),
                    dml::invalid_argument);
  });
  CHECK(thrown.load() == 3);
}

TEST_CASE("comm::local: a rank that throws fails its peers' collectives and run rethrows") {
  std::atomic<int> comm_errors{0};
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(local::run(4, [&](local& c) {
                         std::vector<float> x(100000, 1.0f);
                         c.all_reduce(std::span<float>(x), reduce_op::sum);
                         if (c.rank() == 2) throw std::runtime_error("boom");
                         try {
                           for (;;) c.all_reduce(std::span<float>(x), reduce_op::sum);
                         } catch (const dml::comm_error& e) {
                           CHECK(std::string(e.what()).find("aborted") != std::string::npos);
                           comm_errors.fetch_add(1);
                           throw;
                         }
                       }, {.timeout = std::chrono::seconds(120)}),
                       "boom", std::runtime_error);
  CHECK(comm_errors.load() == 3);
  // Far below the timeout: the abort wakes the waiters, they do not wait it out.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));
}

TEST_CASE("comm::local: a pending non-blocking collective fails when a peer throws") {
  std::atomic<int> comm_errors{0};
  CHECK_THROWS_AS(local::run(2, [&](local& c) {
                    if (c.rank() == 1) throw std::logic_error("rank 1 gives up");
                    std::vector<float> x(1000, 1.0f);
                    auto q = c.iall_reduce(std::span<float>(x), reduce_op::sum);
                    try {
                      q.wait();
                    } catch (const dml::comm_error&) {
                      comm_errors.fetch_add(1);
                    }
                    std::vector<float> y(10);
                    CHECK_THROWS_AS(c.recv(std::span<float>(y), 1, 0), dml::comm_error);
                  }),
                  std::logic_error);
  CHECK(comm_errors.load() == 1);
}

TEST_CASE("comm::local: a wait past the timeout throws naming the operation and the rank") {
  std::string message;
  CHECK_THROWS_AS(local::run(2, [&](local& c) {
                    if (c.rank() == 1) return;  // never joins the broadcast
                    std::vector<int> x(3);
                    try {
                      c.broadcast(std::span<int>(x), 0);
                    } catch (const dml::comm_error& e) {
                      message = e.what();
                      throw;
                    }
                  }, {.timeout = std::chrono::milliseconds(200)}),
                  dml::comm_error);
  CHECK(message.find("rank 0") != std::string::npos);
  CHECK(message.find("broadcast") != std::string::npos);
}

TEST_CASE("comm::local: customisation points forward to the model") {
  local::run(2, [](local& c) {
    std::vector<double> x(3, 1.5);
    dml::comm::all_reduce(c, std::span<double>(x), reduce_op::sum);
    CHECK(x[2] == 3.0);
    dml::comm::barrier(c);
  });
}

TEST_CASE("comm::local: isendrecv around a ring, and the host-staged forms are the plain operations") {
  for (int n : {1, 2, 3, 5})
    local::run(n, [n](local& c) {
      const int r = c.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
      std::vector<float> out(7), in(7, -1.f);
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = float(100 * r + int(i));
      dml::comm::isendrecv(c, std::span<const float>(out), next, std::span<float>(in), prev, 4).wait();
      for (std::size_t i = 0; i < in.size(); ++i) CHECK(in[i] == float(100 * prev + int(i)));

      std::vector<double> s{double(r), 1.0};
      dml::comm::all_reduce_host(c, std::span<double>(s), reduce_op::sum);
      CHECK(s[0] == double(n * (n - 1) / 2));
      CHECK(s[1] == double(n));
      std::vector<std::int64_t> mine{r}, all(static_cast<std::size_t>(n));
      dml::comm::all_gather_host(c, std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
      for (int p = 0; p < n; ++p) CHECK(all[std::size_t(p)] == p);
      std::vector<char> word{r == 0 ? 'y' : 'n'};
      dml::comm::broadcast_host(c, std::span<char>(word), 0);
      CHECK(word[0] == 'y');
      std::vector<std::int64_t> to(static_cast<std::size_t>(n)), from(static_cast<std::size_t>(n));
      for (int p = 0; p < n; ++p) to[std::size_t(p)] = 10 * r + p;
      dml::comm::all_to_all_host(c, std::span<const std::int64_t>(to), std::span<std::int64_t>(from));
      for (int p = 0; p < n; ++p) CHECK(from[std::size_t(p)] == 10 * p + r);
    });
}

TEST_CASE("comm::local: issend is received where it lies, and completes only once received") {
  local::run(2, [](local& c) {
    std::vector<std::byte> out(1 << 20), small(3, std::byte{7});
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = std::byte(i * 31 % 251);
    if (c.rank() == 0) {
      auto a = c.issend(std::span<const std::byte>(out), 1, 5);
      auto b = c.issend(std::span<const std::byte>(small), 1, 5);
      auto d = c.issend(std::span<const std::byte>(out).first(1000), 1, 6);  // to a plain receive
      c.barrier();                      // rank 1 has received nothing yet
      CHECK_FALSE(a.test());
      CHECK_FALSE(b.test());
      CHECK_FALSE(d.test());
      std::int64_t where = std::int64_t(reinterpret_cast<std::uintptr_t>(out.data()));
      c.send(std::span<const std::int64_t>(&where, 1), 1, 9);
      a.wait();
      b.wait();
      d.wait();
      // A receive posted first is filled at the issend, which is then complete.
      std::vector<float> early(4, 2.5f);
      c.barrier();
      CHECK(c.issend(std::span<const float>(early), 1, 7).test());
      c.barrier();
    } else {
      c.barrier();
      std::int64_t where = 0;
      c.recv(std::span<std::int64_t>(&where, 1), 0, 9);
      {
        const auto held = c.recv_borrowed(0, 5);  // in order: the large one first, at the sender's address
        REQUIRE(held.bytes().size() == out.size());
        CHECK(std::int64_t(reinterpret_cast<std::uintptr_t>(held.bytes().data())) == where);
        CHECK(std::equal(held.bytes().begin(), held.bytes().end(), out.begin()));
      }
      {
        const auto second = c.recv_borrowed(0, 5);  // held until dropped: rank 0's wait waits for that
        CHECK(second.bytes().size() == 3);
        CHECK(second.bytes()[2] == std::byte{7});
      }
      std::vector<std::byte> in(1000);
      c.recv(std::span<std::byte>(in), 0, 6);
      CHECK(std::equal(in.begin(), in.end(), out.begin()));
      std::vector<float> early(4);
      auto r = c.irecv(std::span<float>(early), 0, 7);
      c.barrier();
      c.barrier();
      r.wait();
      CHECK(early[3] == 2.5f);
    }
  });
}

TEST_CASE("comm::local: a plain send is borrowed too, a borrowed receive checks the element type, a "
          "cancelled issend is withdrawn") {
  local::run(2, [](local& c) {
    if (c.rank() == 0) {
      std::vector<std::byte> b(100, std::byte{1});
      c.send(std::span<const std::byte>(b), 1, 1);
      std::vector<float> f(4, 1.f);
      c.send(std::span<const float>(f), 1, 2);
      auto gone = c.issend(std::span<const std::byte>(b), 1, 3);
      gone.cancel();  // never received: withdrawn, so b may go
      CHECK(gone.done());
      c.barrier();
    } else {
      CHECK(c.recv_borrowed(0, 1).bytes().size() == 100);
      CHECK_THROWS_WITH_AS(c.recv_borrowed(0, 2), doctest::Contains("expected a message of bytes from rank 0"),
                           dml::invalid_argument);
      c.barrier();
      std::vector<std::byte> none(100);
      auto r = c.irecv(std::span<std::byte>(none), 0, 3);
      CHECK_FALSE(r.test());
      r.cancel();
    }
  });
}

TEST_CASE("comm::local: an issend waiting for a peer that throws fails, and a borrowed receive times out") {
  CHECK_THROWS_AS(local::run(2, [](local& c) {
                    std::vector<std::byte> b(64, std::byte{2});
                    if (c.rank() == 1) throw std::logic_error("rank 1 gives up");
                    auto s = c.issend(std::span<const std::byte>(b), 1, 0);
                    CHECK_THROWS_AS(s.wait(), dml::comm_error);
                  }),
                  std::logic_error);
  std::string message;
  CHECK_THROWS_AS(local::run(2, [&](local& c) {
                    if (c.rank() == 1) return;
                    try {
                      (void)c.recv_borrowed(1, 0);
                    } catch (const dml::comm_error& e) {
                      message = e.what();
                      throw;
                    }
                  }, {.timeout = std::chrono::milliseconds(200)}),
                  dml::comm_error);
  CHECK(message.find("recv") != std::string::npos);
}

}  // namespace local_test
