// SPDX-License-Identifier: Apache-2.0
// tests/train/test_transactions.cpp — steps as transactions (trainer_options::commit) and snapshots: an
// abandoned or failed step changes nothing, and a snapshot restored into a fresh trainer of the same layout
// continues with the same losses, bit for bit.
#include <doctest/doctest.h>

#include <vector>

#include "dml/dml.hpp"
#include "trainer_fixture.hpp"

using namespace dml;
using trainer_fixture::on_ranks;

namespace {

template <class T, class C>
float step_on(T& t, C& c, std::int64_t s) {
  const auto& d = trainer_fixture::data();
  using trainer_fixture::features;
  train::sampler sampler(trainer_fixture::samples, trainer_fixture::global_batch, 11);
  std::vector<float> xb;
  std::vector<std::int32_t> yb;
  const auto rows = sampler.gather(s, c.rank(), c.size(), d.x.data(), features, d.y.data(), xb, yb);
  const auto r = t.step(tensor_view<const float>(xb.data(), {rows, features}), yb.data(), trainer_fixture::global_batch);
  return r.committed ? r.loss : -1.f;
}

// Steps 0..5; with `abandon`, the commit hook refuses every other attempt and throws on one, so each step is tried
// until it commits. The committed losses and parameters must equal a run where every step commits.
template <class Sharding>
void check_abandoned_steps(int ranks) {
  struct out_t {
    std::vector<float> losses, params;
    std::int64_t steps = 0, attempts = 0;
  };
  auto run = [&](bool abandon) {
    return on_ranks<out_t>(ranks, [&](comm::local& c) {
      out_t o;
      auto opt = trainer_fixture::options();
      if (abandon)
        opt.commit = [&o] {
          ++o.attempts;
          if (o.attempts == 5) throw comm_error("a collective failed");  // as a dead peer makes it
          return o.attempts % 2 == 0;
        };
      trainer<Sharding> t(c, trainer_fixture::make_model(), opt);
      for (std::int64_t s = 0; s < 6;) {
        float loss = -1.f;
        try {
          loss = step_on(t, c, s);
        } catch (const comm_error&) {
        }
        if (loss < 0) continue;  // the step did not commit: try it again
        o.losses.push_back(loss);
        ++s;
      }
      o.steps = t.steps();
      o.params = t.full_parameters();
      return o;
    });
  };
  const auto ref = run(false), got = run(true);
  CHECK(got.attempts > 6);
  CHECK(got.steps == 6);
  CHECK(got.losses == ref.losses);
  CHECK(got.params == ref.params);
}

// 3 steps, a snapshot per rank, then a new trainer (another seed: other initial weights) restores it and takes
// steps 3..5: the same losses as the trainer that went on.
template <class Sharding>
void check_snapshot(int ranks) {
  struct out_t {
    std::vector<float> a, b;
    std::int64_t steps = 0;
  };
  const auto got = on_ranks<out_t>(ranks, [&](comm::local& c) {
    out_t o;
    trainer<Sharding> t(c, trainer_fixture::make_model(), trainer_fixture::options());
    for (int s = 0; s < 3; ++s) step_on(t, c, s);
    const auto snap = t.snapshot();
    CHECK(snap.step == 3);
    auto other = trainer_fixture::options();
    other.seed = 99;
    trainer<Sharding> u(c, trainer_fixture::make_model(), other);
    u.restore(snap);
    for (int s = 3; s < 6; ++s) {
      o.a.push_back(step_on(t, c, s));
      o.b.push_back(step_on(u, c, s));
    }
    o.steps = u.steps();
    CHECK(t.full_parameters() == u.full_parameters());
    return o;
  });
  CHECK(got.a == got.b);
  CHECK(got.steps == 6);
}

}  // namespace

TEST_CASE("an abandoned or failed step changes nothing: replicate") { check_abandoned_steps<parallel::replicate>(2); }
TEST_CASE("an abandoned or failed step changes nothing: zero<2>") { check_abandoned_steps<parallel::zero<2>>(2); }
TEST_CASE("an abandoned or failed step changes nothing: zero<3>") { check_abandoned_steps<parallel::zero<3>>(3); }
TEST_CASE("a snapshot restores into a fresh trainer: replicate") { check_snapshot<parallel::replicate>(2); }
TEST_CASE("a snapshot restores into a fresh trainer: zero<1>") { check_snapshot<parallel::zero<1>>(2); }
TEST_CASE("a snapshot restores into a fresh trainer: zero<3>") { check_snapshot<parallel::zero<3>>(3); }

TEST_CASE("a snapshot of another layout is refused") {
  comm::local::run(2, [](comm::local& c) {
    trainer<parallel::zero<2>> t(c, trainer_fixture::make_model(), trainer_fixture::options());
    auto snap = t.snapshot();
    snap.values.pop_back();
    CHECK_THROWS_WITH_AS(t.restore(snap), doctest::Contains("the snapshot has"), invalid_argument);
  });
}
