// SPDX-License-Identifier: Apache-2.0
// tests/parallel/test_param_server.cpp — the parameter server on comm::local: the key slicer and ring,
// push/pull arithmetic, bsp against synchronous data parallel, the ssp bound from the servers' clocks,
// filters with error feedback end to end, a server's loss under chain replication, a worker's loss, bad
// requests, and the payload buffers' reuse.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <random>
#include <set>

#include "dml/comm/local.hpp"
#include "dml/nn/mlp.hpp"
#include "dml/ps/downpour.hpp"
#include "dml/ps/ps.hpp"
#include "support.hpp"
#include "ps_fixture.hpp"

namespace test_param_server {

using namespace dml;
namespace ps = dml::ps;

namespace {

using comm_t = comm::local;
using namespace ps_fixture;

comm::local::options quick(int seconds = 120) { return {std::chrono::seconds(seconds)}; }

// Ranks [0, o.servers) serve until the workers are done; every other rank runs work(its kv_worker).
template <class F>
void serve_or_work(comm_t& c, const std::vector<std::int64_t>& lengths, const ps::options& o, F&& work) {
  if (c.rank() < o.servers) {
    ps::server<comm_t>(c, lengths, o).serve();
    return;
  }
  ps::kv_worker<comm_t> kv(c, lengths, o);
  work(kv);
}

}  // namespace

TEST_CASE("the slicer never loses or duplicates a key, and the ring's chains are distinct servers") {
  std::mt19937 g(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int keys = 1 + int(g() % 20), servers = 1 + int(g() % 9);
    const int replicas = int(g() % servers);
    const std::int64_t max_range = 1 + std::int64_t(g() % 300);
    std::vector<std::int64_t> lengths(static_cast<std::size_t>(keys));
    for (auto& l : lengths) l = 1 + std::int64_t(g() % 1000);
    ps::key_table t(lengths, max_range);
    const ps::ring ring(servers, 1 + int(g() % 64), g());
    // Every element of every key is in exactly one range; flat offsets are the concatenation.
    std::int64_t flat = 0;
    std::set<std::uint32_t> ids;
    for (std::size_t k = 0; k < lengths.size(); ++k) {
      std::vector<int> cover(std::size_t(lengths[k]), 0);
      for (const auto& r : t.ranges_of(k)) {
        CHECK(r.k == k);
        CHECK(r.length >= 1);
        CHECK(r.length <= max_range);
        CHECK(r.flat == flat + r.offset);
        CHECK(ids.insert(r.id).second);
        for (std::int64_t i = 0; i < r.length; ++i) ++cover[std::size_t(r.offset + i)];
        const auto ch = ring.chain(r, replicas);
        CHECK(ch.size() == std::size_t(replicas + 1));
        CHECK(std::set<int>(ch.begin(), ch.end()).size() == ch.size());
        for (int s : ch) CHECK((s >= 0 && s < servers));
        CHECK(ch.front() == ring.owner(r));
      }
      CHECK(std::ranges::all_of(cover, [](int c) { return c == 1; }));
      flat += lengths[k];
    }
    CHECK(ids.size() == t.ranges().size());
    CHECK(t.total() == flat);
  }
}

TEST_CASE("split_servers: the first ranks serve, the rest work, each side a group of its own") {
  comm::local::run(5, [](comm_t& c) {
    auto s = ps::split_servers(c, 2);
    CHECK(s.serves == (c.rank() < 2));
    CHECK(s.side.size() == (s.serves ? 2 : 3));
    CHECK(s.index == (s.serves ? c.rank() : c.rank() - 2));
    CHECK(s.workers == 3);
    CHECK_THROWS_WITH_AS(ps::split_servers(c, 5), doctest::Contains("at least one must be a worker"),
                         invalid_argument);
  }, quick());
}

TEST_CASE("buffer_pool: a free buffer is reused, the largest first, empty and with room for the message") {
  ps::detail::buffer_pool pool;
  auto big = pool.take(4096);
  CHECK(big->empty());
  CHECK(big->capacity() >= 4096);
  big->resize(4096);
  auto small = pool.take(16);  // big is held: a second buffer
  CHECK(small.get() != big.get());
  CHECK(small->capacity() >= 16);
  const auto* big_memory = big->data();
  const auto* big_buffer = big.get();
  big.reset();
  small.reset();
  // Both are free: the larger is handed out, emptied, its memory kept (no new mapping to fault in).
  auto again = pool.take(1000);
  CHECK(again.get() == big_buffer);
  CHECK(again->empty());
  CHECK(again->data() == big_memory);
  // The other is free too, and grows once to the size asked for.
  auto grown = pool.take(10000);
  CHECK(grown.get() != big_buffer);
  CHECK(grown->capacity() >= 10000);
}

TEST_CASE("consistent hashing: adding a server moves only ranges onto it") {
  ps::key_table t(std::vector<std::int64_t>(40, 1000), 100);
  const ps::ring a(4), b(5);
  int moved = 0;
  for (const auto& r : t.ranges()) {
    if (a.owner(r) != b.owner(r)) {
      CHECK(b.owner(r) == 4);
      ++moved;
    }
  }
  // About a fifth of the 400 ranges move to the new server.
  CHECK(moved > 40);
  CHECK(moved < 140);
}

TEST_CASE("push and pull: servers apply SGD and Adagrad to the exact values, batched over servers") {
  for (auto kind : {ps::server_optimizer::sgd, ps::server_optimizer::adagrad}) {
    CAPTURE(int(kind));
    ps::options o;
    o.servers = 3;
    o.max_range = 7;  // keys of 20 and 5 elements spread over several servers
    o.staleness = 0;
    o.optimizer = {kind, 0.5f};
    const std::vector<std::int64_t> lengths = {20, 5};
    comm::local::run(5, [&](comm_t& c) {
      serve_or_work(c, lengths, o, [&](ps::kv_worker<comm_t>& kv) {
        const ps::key keys[] = {0, 1};
        std::vector<float> init(25), got(25), grad(25);
        for (int i = 0; i < 25; ++i) init[std::size_t(i)] = float(i);
        kv.init(keys, init);
        for (int i = 0; i < 25; ++i) grad[std::size_t(i)] = float(kv.index() + 1) * 0.25f * float(i % 3);
        kv.wait(kv.pull(keys, got));
        CHECK(got == init);
        kv.wait(kv.push(keys, grad));
        kv.wait(kv.pull(keys, got));  // bsp: both workers' pushes are in
        for (int i = 0; i < 25; ++i) {
          const float g = 0.25f * float(i % 3) * 3.f;  // worker 1's plus worker 2's
          const float want = kind == ps::server_optimizer::sgd ? float(i) - 0.5f * g
                                                               : float(i) - (g == 0 ? 0.f : 0.5f * g / (std::abs(g) + 1e-10f));
          CHECK(got[std::size_t(i)] == doctest::Approx(want).epsilon(1e-6));
        }
        // Only key 1, into a span of its length.
        const ps::key one[] = {1};
        std::vector<float> five(5);
        kv.wait(kv.pull(one, five));
        CHECK(std::equal(five.begin(), five.end(), got.begin() + 20));
        kv.leave();
      });
    }, quick());
  }
}

TEST_CASE("bsp with SGD gives synchronous data parallel's losses") {
  const auto train = blobs(512, 1), test = blobs(64, 2);
  const int workers = 3;
  const std::int64_t batch = 8, steps = 30;
  const float lr = 0.2f;
  const auto want = sync_losses(train, workers, batch, steps, lr, 3);
  std::mutex m;
  std::vector<std::vector<double>> got(static_cast<std::size_t>(workers), std::vector<double>(static_cast<std::size_t>(steps)));
  ps::options o;
  o.servers = 2;
  o.max_range = 100;
  o.optimizer = {ps::server_optimizer::sgd, lr};
  ps::downpour_options d;
  d.steps = steps;
  d.batch = batch;
  d.seed = 3;
  d.on_step = [&](int w, std::int64_t s, float loss) {
    std::lock_guard lk(m);
    got[std::size_t(w)][std::size_t(s)] = loss;
  };
  comm::local::run(o.servers + workers, [&](comm_t& c) {
    ps::downpour(c, small_model(), train, test, ps::consistency::bsp{}, o, d);
  }, quick());
  std::vector<double> mean(std::size_t(steps), 0.0);
  for (std::int64_t s = 0; s < steps; ++s)
    for (int w = 0; w < workers; ++w) mean[std::size_t(s)] += got[std::size_t(w)][std::size_t(s)] / workers;
  const double worst = dml_test::max_rel_difference(want, mean).value;
  MESSAGE("bsp against synchronous data parallel: max relative loss difference ", worst, " over ", steps, " steps");
  CHECK(worst < 5e-7);  // README quotes 8.5e-8 (5.4e-8 on another CPU): under 10x that
  CHECK(want.back() < 0.6 * want.front());
}

TEST_CASE("ssp: no worker runs more than S steps ahead of a slowed one, by the servers' vector clocks") {
  const auto train = blobs(1024, 4), test = blobs(64, 5);
  for (int S : {0, 2}) {
    CAPTURE(S);
    ps::options o;
    o.servers = 2;
    o.max_range = 200;
    o.optimizer = {ps::server_optimizer::sgd, 0.05f};
    ps::downpour_options d;
    d.steps = 24;
    d.batch = 8;
    d.slow_worker_ms = 15;
    std::vector<ps::range_report> reports;
    std::mutex m;
    comm::local::run(o.servers + 3, [&](comm_t& c) {
      // The report is read by the fast worker 0 when it is done: the slow one is still going.
      auto r = ps::downpour(c, small_model(), train, test, ps::consistency::ssp<>{S}, o, d);
      if (!r.server) CHECK(r.lost == 0);
    }, quick());
    // Second run, reading the clocks from a hand-driven worker loop: every pull answered must have had
    // every worker at least pushes - S.
    comm::local::run(o.servers + 3, [&](comm_t& c) {
      const std::vector<std::int64_t> lengths = {300, 40};
      auto oo = o;
      oo.staleness = S;
      serve_or_work(c, lengths, oo, [&](ps::kv_worker<comm_t>& kv) {
        const ps::key keys[] = {0, 1};
        std::vector<float> v(340, 0.f), g(340, 0.001f);
        kv.init(keys, v);
        for (int step = 0; step < 20; ++step) {
          kv.wait(kv.pull(keys, v));
          if (kv.index() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(10));
          kv.wait(kv.push(keys, g));
        }
        if (kv.index() == 0) {
          std::lock_guard lk(m);
          reports = kv.report();
        }
        kv.leave();
      });
    }, quick());
    REQUIRE(!reports.empty());
    for (const auto& r : reports) {
      // A worker pushes its (c+1)-th step only after its pull at c was answered, which needed the slowest at
      // c - S: the lead is at most S + 1, and the slowed worker makes the fast ones reach it.
      // bsp applies a step's pushes together, so its clocks never differ.
      CHECK(r.max_lead == (S == 0 ? 0 : S + 1));
    }
  }
}

TEST_CASE("filters with error feedback train through the servers and cut the bytes pushed") {
  const auto train = blobs(2048, 6), test = blobs(400, 7);
  double dense_bytes = 0;
  for (std::string f : {"none", "topk:0.01", "onebit", "significant:0.001"}) {
    CAPTURE(f);
    ps::options o;
    o.servers = 2;
    o.max_range = 1024;  // one range per parameter: headers stay small beside the values
    o.push_filter = f;
    o.pull_filter = f;
    o.optimizer = {ps::server_optimizer::sgd, 0.2f};
    ps::downpour_options d;
    d.epochs = 4;
    d.batch = 16;
    double acc = 0;
    std::int64_t pushed = 0, pulled = 0;
    std::mutex m;
    comm::local::run(o.servers + 2, [&](comm_t& c) {
      auto r = ps::downpour(c, small_model(), train, test, ps::consistency::ssp<>{1}, o, d);
      std::lock_guard lk(m);
      pushed += r.traffic.bytes_pushed;
      pulled += r.traffic.bytes_pulled;
      if (!r.accuracy.empty()) acc = r.accuracy.back();
    }, quick());
    MESSAGE(f, ": accuracy ", acc, ", bytes pushed ", pushed, ", pulled ", pulled);
    CHECK(acc > 0.9);
    if (f == "none") dense_bytes = double(pushed);
    // The ideal is 50× for topk:0.01 and 32× for onebit; each range's header costs some of it here, where
    // the biases are ranges of 4 and 32 values.
    else if (f != "significant:0.001") CHECK(dense_bytes / double(pushed) > 12);
  }
}

TEST_CASE("a server stops mid-training: its ranges fail over to their replicas and no acknowledged update is lost") {
  const auto train = blobs(2048, 8), test = blobs(400, 9);
  for (auto policy : {ps::consistency::any{ps::consistency::bsp{}}, ps::consistency::any{ps::consistency::async{}}}) {
    const ps::options o = failover_options();
    ps::downpour_options d;
    d.epochs = 3;
    d.batch = 16;
    std::mutex m;
    double acked = 0, lost = 0, acc = 0;
    bool died = false;
    comm::local::run(o.servers + 3, [&](comm_t& c) {
      auto r = std::visit([&](auto p) { return ps::downpour(c, small_model(), train, test, p, o, d); }, policy);
      std::lock_guard lk(m);
      died |= r.died;  // the server's fault hook fired
      if (!r.accuracy.empty()) {  // worker 0: the workers' totals
        acc = r.accuracy.back();
        acked = r.totals.acknowledged;
        lost = r.totals.lost;
      }
    }, quick());
    MESSAGE(ps::consistency::to_string(policy), ": acknowledged ", acked, ", lost ", lost, ", accuracy ", acc);
    CHECK(died);
    CHECK(acked > 0);
    CHECK(lost == 0);
    CHECK(acc > 0.9);
  }
}

TEST_CASE("without replicas, losing a server is a clear error, not a hang") {
  ps::options o;
  o.servers = 2;
  o.max_range = 4;
  o.timeout = std::chrono::milliseconds(1000);
  o.fault = [](int s, std::int64_t clk) { return s == 0 && clk >= 2; };
  const std::vector<std::int64_t> lengths = {40};
  std::mutex m;
  std::string error;
  comm::local::run(3, [&](comm_t& c) {
    serve_or_work(c, lengths, o, [&](ps::kv_worker<comm_t>& kv) {
      const ps::key keys[] = {0};
      std::vector<float> v(40, 1.f);
      kv.init(keys, v);
      try {
        for (int i = 0; i < 10; ++i) kv.wait(kv.push(keys, v));
      } catch (const comm_error& e) {
        std::lock_guard lk(m);
        error = e.what();
      }
      kv.die();
    });
  }, quick());
  CHECK(error.find("every server holding key range") != std::string::npos);
}

TEST_CASE("a worker stops: the servers drop it from the clocks and the others finish") {
  const auto train = blobs(1024, 10), test = blobs(200, 11);
  ps::options o;
  o.servers = 2;
  o.max_range = 128;
  o.timeout = std::chrono::milliseconds(1000);
  o.optimizer = {ps::server_optimizer::sgd, 0.2f};
  ps::downpour_options d;
  d.steps = 40;
  d.batch = 16;
  d.die_worker = 1;
  d.die_step = 10;
  std::mutex m;
  std::vector<std::int64_t> steps;
  comm::local::run(o.servers + 3, [&](comm_t& c) {
    auto r = ps::downpour(c, small_model(), train, test, ps::consistency::bsp{}, o, d);
    std::lock_guard lk(m);
    if (!r.server && !r.died) steps.push_back(r.steps);
  }, quick());
  CHECK(steps == std::vector<std::int64_t>{40, 40});
}

TEST_CASE("a worker that finishes long before the slowest waits without a deadline") {
  // comm::local's collectives give up after its timeout (1 s here); finishing uses no collective, so a fast
  // async worker may wait 3 s for a slowed one.
  const auto train = blobs(512, 12), test = blobs(64, 13);
  ps::options o;
  o.servers = 1;
  o.max_range = 128;
  o.timeout = std::chrono::milliseconds(2000);
  ps::downpour_options d;
  d.steps = 20;
  d.batch = 8;
  d.slow_worker_ms = 150;
  std::mutex m;
  double finished = -1;
  comm::local::run(3, [&](comm_t& c) {
    auto r = ps::downpour(c, small_model(), train, test, ps::consistency::async{}, o, d);
    std::lock_guard lk(m);
    if (!r.server) finished = r.totals.stopped == 0 ? r.totals.acknowledged : -1;
  }, {std::chrono::milliseconds(1000)});
  CHECK(finished > 0);
}

TEST_CASE("bad requests get clear errors and the server keeps serving") {
  ps::options o;
  o.servers = 2;
  o.max_range = 8;
  const std::vector<std::int64_t> lengths = {16, 8};
  comm::local::run(3, [&](comm_t& c) {
    serve_or_work(c, lengths, o, [&](ps::kv_worker<comm_t>& kv) {
      const ps::key keys[] = {0, 1};
      std::vector<float> v(24, 1.f);
      kv.init(keys, v);
      auto entry = [](std::uint32_t range, std::uint8_t kind, std::span<const std::byte> body) {
        std::vector<std::byte> b;
        auto put = [&](const void* p, std::size_t n) {
          const auto* q = static_cast<const std::byte*>(p);
          b.insert(b.end(), q, q + n);
        };
        const auto n = std::uint32_t(body.size());
        put(&range, 4);
        put(&kind, 1);
        put(&n, 4);
        put(body.data(), body.size());
        return b;
      };
      const auto& place = kv.layout();
      const std::uint32_t r0 = 0;
      const int home = place.chains[r0].front(), other = 1 - home;
      std::vector<float> wrong(5, 1.f);
      const std::span<const std::byte> wrong_bytes(reinterpret_cast<const std::byte*>(wrong.data()), 20);
      // Keys outside every range.
      CHECK_THROWS_WITH_AS(kv.wait(kv.raw_push(home, entry(99, 1, wrong_bytes))),
                           doctest::Contains("expected a key range below 3 (keys outside every range), found range 99"),
                           invalid_argument);
      // A value length that does not match.
      CHECK_THROWS_WITH_AS(kv.wait(kv.raw_push(home, entry(r0, 1, wrong_bytes))),
                           doctest::Contains("expected 8 initial values for range 0, found 5"), invalid_argument);
      // A truncated message.
      auto cut = entry(r0, 1, wrong_bytes);
      cut.resize(cut.size() - 3);
      CHECK_THROWS_WITH_AS(kv.wait(kv.raw_push(home, cut)), doctest::Contains("truncated"), invalid_argument);
      // The wrong server, and a rank that is no server.
      CHECK_THROWS_WITH_AS(kv.wait(kv.raw_push(other, entry(r0, 1, wrong_bytes))), doctest::Contains("range 0"),
                           invalid_argument);
      CHECK_THROWS_WITH_AS(kv.raw_push(2, {}), doctest::Contains("expected a server rank in [0, 2), found 2"),
                           invalid_argument);
      // On the client side: an unknown key, a span of the wrong length.
      const ps::key bad[] = {7};
      CHECK_THROWS_WITH_AS(kv.push(bad, v), doctest::Contains("expected a key below 2"), invalid_argument);
      CHECK_THROWS_WITH_AS(kv.pull(keys, std::span<float>(v).first(20)), doctest::Contains("expected 24 values"),
                           invalid_argument);
      // Nothing changed, and the servers still serve.
      std::vector<float> got(24);
      kv.wait(kv.pull(keys, got));
      CHECK(got == v);
      kv.leave();
    });
  }, quick());
}

}  // namespace test_param_server
