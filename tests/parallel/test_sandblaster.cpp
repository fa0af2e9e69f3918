// SPDX-License-Identifier: Apache-2.0
// tests/parallel/test_sandblaster.cpp — Sandblaster L-BFGS on comm::local: the distributed two-loop recursion
// against a plain one-process L-BFGS, backup tasks counting every portion once, the coordinator's bytes
// independent of the parameter count, bad settings.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <chrono>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "dml/comm/local.hpp"
#include "dml/ps/sandblaster.hpp"
#include "ps_fixture.hpp"
#include "support.hpp"

namespace test_sandblaster {

using namespace dml;
using comm_t = comm::local;

namespace {

constexpr int classes = 4, features = 16;
constexpr std::int64_t used = classes * features + classes;  // W then b; parameters past these are unused

// Multinomial logistic regression on the blobs, the mean loss plus λ/2 |x|² over the used parameters, cut
// into `portions` contiguous row blocks: f_p = Σ_{rows of p} loss / N + λ/2 |x|² / portions.
struct problem {
  train::dataset data = ps_fixture::blobs(240, 3);
  int portions = 6;
  double lambda = 1e-3;
  double operator()(int p, std::span<const float> x, std::span<float> g) const {
    std::ranges::fill(g, 0.f);
    const std::int64_t N = data.size(), lo = N * p / portions, hi = N * (p + 1) / portions;
    std::vector<double> gd(std::size_t(used), 0.0);
    double loss = 0;
    for (std::int64_t r = lo; r < hi; ++r) {
      const float* a = data.images.data() + r * features;
      double z[classes], mx = -1e300, sum = 0;
      for (int c = 0; c < classes; ++c) {
        z[c] = x[std::size_t(classes * features + c)];
        for (int j = 0; j < features; ++j) z[c] += double(x[std::size_t(c * features + j)]) * a[j];
        mx = std::max(mx, z[c]);
      }
      for (double& v : z) sum += std::exp(v - mx);
      const int y = data.labels[std::size_t(r)];
      loss += (std::log(sum) + mx - z[y]) / double(N);
      for (int c = 0; c < classes; ++c) {
        const double d = (std::exp(z[c] - mx) / sum - (c == y)) / double(N);
        for (int j = 0; j < features; ++j) gd[std::size_t(c * features + j)] += d * a[j];
        gd[std::size_t(classes * features + c)] += d;
      }
    }
    for (std::int64_t i = 0; i < used; ++i) {
      loss += lambda / 2 * double(x[std::size_t(i)]) * x[std::size_t(i)] / portions;
      g[std::size_t(i)] = float(gd[std::size_t(i)] + lambda * x[std::size_t(i)] / portions);
    }
    return loss;
  }
};

// L-BFGS as Nocedal & Wright write it (Algorithm 7.4 with the two-loop recursion 7.5, H0 = γI), with the
// line search and the safeguards ps::sandblaster uses, on one process: the vectors whole, in double, the
// gradient summed over the portions in order.
struct plain_lbfgs {
  std::vector<float> x;
  std::vector<double> losses;
};
plain_lbfgs reference(const problem& pr, std::vector<float> x0, int history, int iterations) {
  const std::size_t n = x0.size();
  using vec = std::vector<double>;
  auto dot = [](const vec& a, const vec& b) {
    double s = 0;
    for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
  };
  auto eval = [&](const vec& x, vec& g) {
    std::vector<float> xf(n), gf(n);
    for (std::size_t i = 0; i < n; ++i) xf[i] = float(x[i]);
    g.assign(n, 0.0);
    std::vector<double> part(std::size_t(pr.portions));
    for (int p = 0; p < pr.portions; ++p) {
      part[std::size_t(p)] = pr(p, xf, gf);
      for (std::size_t i = 0; i < n; ++i) g[i] += gf[i];
    }
    double f = 0;
    for (double v : part) f += v;
    return f;
  };
  vec x(x0.begin(), x0.end()), g, xt, gt;
  double fx = eval(x, g);
  plain_lbfgs out;
  out.losses.push_back(fx);
  std::vector<vec> s, y;  // oldest first
  std::vector<double> rho;
  double gamma = 1;
  for (int it = 0; it < iterations; ++it) {
    vec d = g;
    std::vector<double> alpha(s.size());
    for (std::size_t j = s.size(); j-- > 0;) {
      alpha[j] = rho[j] * dot(s[j], d);
      for (std::size_t i = 0; i < n; ++i) d[i] -= alpha[j] * y[j][i];
    }
    if (!s.empty())
      for (auto& v : d) v *= gamma;
    for (std::size_t j = 0; j < s.size(); ++j) {
      const double beta = rho[j] * dot(y[j], d);
      for (std::size_t i = 0; i < n; ++i) d[i] += (alpha[j] - beta) * s[j][i];
    }
    for (auto& v : d) v = -v;
    double gd = dot(g, d);
    if (!(gd < 0) && !s.empty()) {
      s.clear(), y.clear(), rho.clear();
      for (std::size_t i = 0; i < n; ++i) d[i] = -g[i];
      gd = dot(g, d);
    }
    if (!(gd < 0)) break;
    double t = s.empty() ? std::min(1.0, 1.0 / std::sqrt(-gd)) : 1.0, ft = 0;
    bool ok = false;
    for (int trial = 0; trial < 30; ++trial, t *= 0.5) {
      xt = x;
      for (std::size_t i = 0; i < n; ++i) xt[i] += t * d[i];
      ft = eval(xt, gt);
      if ((ok = ft <= fx + 1e-4 * t * gd)) break;
    }
    if (!ok) break;
    vec sk(n), yk(n);
    for (std::size_t i = 0; i < n; ++i) sk[i] = xt[i] - x[i], yk[i] = gt[i] - g[i];
    const double sy = dot(sk, yk), yy = dot(yk, yk);
    if (sy > 1e-10 * yy && yy > 0) {
      if (int(s.size()) == history) s.erase(s.begin()), y.erase(y.begin()), rho.erase(rho.begin());
      s.push_back(sk), y.push_back(yk), rho.push_back(1 / sy);
      gamma = sy / yy;
    } else if (int(s.size()) == history) {
      s.erase(s.begin()), y.erase(y.begin()), rho.erase(rho.begin());
    }
    x = xt, g = gt, fx = ft;
    out.losses.push_back(fx);
  }
  out.x.assign(x.begin(), x.end());
  return out;
}

// Runs sandblaster on 1 + servers + workers local ranks; returns the coordinator's result, with the shards'
// applied and dropped counts summed into it. f: the portions' function (default: pr).
ps::sandblaster_result run(const problem& pr, std::span<const float> x0, ps::sandblaster_options o, int workers,
                           ps::portion_fn f = {}) {
  if (!f) f = std::cref(pr);
  ps::sandblaster_result out;
  std::mutex m;
  std::int64_t applied = 0, dropped = 0, computed = 0;
  comm::local::run(1 + o.servers + workers, [&](comm_t& c) {
    auto r = ps::sandblaster(c, x0, f, o);
    std::lock_guard l(m);
    applied += r.applied, dropped += r.dropped, computed += r.computed;
    if (r.role == ps::sandblaster_result::coordinator) out = std::move(r);
  });
  out.applied = applied, out.dropped = dropped, out.computed = computed;
  return out;
}

std::vector<float> start(std::int64_t n) { return dml_test::random_vector(std::size_t(n), 7, -0.1f, 0.1f); }

}  // namespace

TEST_CASE("sandblaster: the distributed two-loop recursion gives a plain L-BFGS's iterates") {
  const problem pr;
  const auto x0 = start(used);
  ps::sandblaster_options o;
  o.servers = 3, o.portions = pr.portions, o.history = 4, o.iterations = 25;
  const auto got = run(pr, x0, o, 2);
  const auto want = reference(pr, x0, o.history, o.iterations);
  REQUIRE(got.iterations == o.iterations);
  REQUIRE(got.losses.size() == want.losses.size());
  // Measured: 0 on the float iterate after 25 iterations and 0 on the losses (the shards' partial dot products
  // round differently in double only); the bounds allow a few float roundings (6e-8 each) and double ones.
  CHECK(dml_test::max_rel_difference(want.x, got.x, 1e-2).value < 6e-7);
  CHECK(dml_test::max_rel_difference(want.losses, got.losses).value < 1e-13);
  CHECK(got.losses.back() < 0.2 * got.losses.front());  // it trained
  CHECK(got.portions_counted == std::int64_t(got.passes) * o.portions);
  CHECK(got.applied == std::int64_t(got.passes) * o.portions * o.servers);
}

TEST_CASE("sandblaster: with a straggler, backup tasks count every portion exactly once") {
  const problem pr;
  const auto x0 = start(used);
  ps::sandblaster_options o;
  o.servers = 2, o.portions = pr.portions, o.history = 3, o.iterations = 6;
  o.slow_worker_ms = 30;  // the last worker: its portions arrive after the others' backups of them
  const auto want = reference(pr, x0, o.history, o.iterations);
  for (const bool backup : {true, false}) {
    CAPTURE(backup);
    o.backup_tasks = backup;
    const auto got = run(pr, x0, o, 3);
    REQUIRE(got.iterations == o.iterations);
    CHECK(dml_test::max_rel_difference(want.x, got.x, 1e-2).value < 6e-7);  // measured 0, as above
    CHECK(got.portions_counted == std::int64_t(got.passes) * o.portions);
    // Each shard took each portion of each pass once, whichever copy came first; the other copies were dropped.
    CHECK(got.applied == std::int64_t(got.passes) * o.portions * o.servers);
    CHECK(got.tasks_issued == std::int64_t(got.passes) * o.portions + got.backups_issued);
    if (backup) {
      // The straggler's first portion is still asleep when the others run out of new ones. Its copies that
      // lose the race come back late (or after the end) and are dropped: how many depends on the timing.
      CHECK(got.backups_issued > 0);
    } else {
      CHECK(got.backups_issued == 0);
      CHECK(got.late_results == 0);
    }
  }
}

TEST_CASE("sandblaster: two copies of a portion finishing in the same pass count once") {
  problem pr;
  pr.portions = 2;
  const auto x0 = start(used);
  ps::sandblaster_options o;
  o.servers = 2, o.portions = 2, o.history = 3, o.iterations = 4;
  // Every copy of portion 1 takes 40 ms. Worker 0 takes portion 0, worker 1 portion 1, and worker 2, with
  // nothing new left, a backup of portion 0: both copies of portion 0 finish and push while portion 1 holds
  // the pass open, so every pass has a duplicate report and a duplicate push of portion 0.
  const ps::portion_fn slow_one = [&](int p, std::span<const float> x, std::span<float> g) {
    if (p == 1) std::this_thread::sleep_for(std::chrono::milliseconds(40));
    return pr(p, x, g);
  };
  const auto got = run(pr, x0, o, 3, slow_one);
  const auto want = reference(pr, x0, o.history, o.iterations);
  REQUIRE(got.iterations == o.iterations);
  CHECK(dml_test::max_rel_difference(want.x, got.x, 1e-2).value < 6e-7);  // measured 0
  CHECK(dml_test::max_rel_difference(want.losses, got.losses).value < 1e-13);
  CHECK(got.portions_counted == std::int64_t(got.passes) * 2);
  CHECK(got.applied == std::int64_t(got.passes) * 2 * o.servers);
  CHECK(got.late_results >= got.passes);                    // portion 0's second report, every pass
  CHECK(got.dropped >= std::int64_t(got.passes) * o.servers);  // and its second push, on every shard
}

TEST_CASE("sandblaster: the coordinator's bytes per iteration do not grow with the parameters") {
  const problem pr;
  ps::sandblaster_options o;
  o.servers = 2, o.portions = pr.portions, o.history = 4, o.iterations = 10;
  o.backup_tasks = false;  // the same messages every run
  auto x0 = start(used);
  const auto small = run(pr, x0, o, 2);
  x0.resize(std::size_t(used + 200000), 0.25f);  // parameters the objective ignores: their gradient is 0
  const auto large = run(pr, x0, o, 2);
  REQUIRE(small.iterations == o.iterations);
  REQUIRE(large.iterations == o.iterations);
  CHECK(small.losses == large.losses);
  CHECK(small.coordinator_messages == large.coordinator_messages);
  CHECK(small.coordinator_bytes == large.coordinator_bytes);  // exactly
  // Scalars only: far below one copy of the parameters (800 KB) per iteration.
  CHECK(large.bytes_per_iteration() < 0.01 * double(x0.size() * sizeof(float)));
  // The history's round trips: with 4 pairs more than with 1 (O(history)).
  o.history = 1;
  const auto one = run(pr, start(used), o, 2);
  CHECK(one.bytes_per_iteration() < small.bytes_per_iteration());
}

TEST_CASE("sandblaster: bad settings fail before any message, naming the setting") {
  const problem pr;
  const auto x0 = start(used);
  // One setting wrong at a time, on 3 ranks.
  const std::pair<void (*)(ps::sandblaster_options&), const char*> bad[] = {
      {[](auto& o) { o.history = 0; }, "expected history >= 1, found 0"},
      {[](auto& o) { o.portions = 0; }, "expected portions >= 1, found 0"},
      {[](auto& o) { o.servers = 2; }, "at least one worker, found servers 2 in a world of 3 ranks"},
      {[](auto& o) { o.backtrack = 1.5; }, "expected 0 < backtrack < 1, found 1.5"},
      {[](auto& o) { o.iterations = -1; }, "expected iterations >= 0, found -1"},
  };
  for (const auto& [set, what] : bad) {
    CAPTURE(what);
    ps::sandblaster_options o;
    set(o);
    comm::local::run(3, [&](comm_t& c) {
      CHECK_THROWS_WITH_AS(ps::sandblaster(c, x0, std::cref(pr), o), doctest::Contains(what), dml::invalid_argument);
    });
  }
}

}  // namespace test_sandblaster
