// SPDX-License-Identifier: Apache-2.0
// tests/train/test_transactions.cpp — steps as transactions (trainer_options::commit) and snapshots: an
// abandoned or failed step changes nothing, and a snapshot restored into a fresh trainer of the same layout
// continues with the same losses, bit for bit; pieces exported by one layout restore into another.
#include <doctest/doctest.h>

#include <chrono>
#include <mutex>
#include <vector>

#include "dml/dml.hpp"
#include "trainer_fixture.hpp"

namespace test_transactions {

using namespace dml;
using trainer_fixture::on_ranks;

namespace {

// Step s on this rank's rows: with pp pipeline stages, the world holds size / pp data-parallel ranks (the data
// rank fastest), and the stages of one data rank take the same rows.
template <class T, class C>
float step_on(T& t, C& c, std::int64_t s, int pp = 1) {
  const auto& d = trainer_fixture::data();
  using trainer_fixture::features;
  train::sampler sampler(trainer_fixture::samples, trainer_fixture::global_batch, 11);
  std::vector<float> xb;
  std::vector<std::int32_t> yb;
  const int dp = c.size() / pp;
  const auto rows = sampler.gather(s, c.rank() % dp, dp, d.x.data(), features, d.y.data(), xb, yb);
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
// steps 3..5: the same losses as the trainer that went on. With `transactions` both vote (always commit): under
// ZeRO-1/2 the snapshot is taken while the others' updated parts are still to be gathered.
template <class Sharding>
void check_snapshot(int ranks, bool transactions = false) {
  struct out_t {
    std::vector<float> a, b;
    std::int64_t steps = 0;
  };
  const auto got = on_ranks<out_t>(ranks, [&](comm::local& c) {
    out_t o;
    auto opt = trainer_fixture::options();
    if (transactions) opt.commit = [] { return true; };
    trainer<Sharding> t(c, trainer_fixture::make_model(), opt);
    for (int s = 0; s < 3; ++s) step_on(t, c, s);
    const auto snap = t.snapshot();
    CHECK(snap.step == 3);
    auto other = opt;
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

// Nothing after the vote waits for a peer: rank 1 fails its vote of step 2 and leaves (as a rank that died after
// the others' votes), rank 0 is told to commit, and its step must end committed, not in a collective that times out.
template <class Sharding>
void check_nothing_after_the_vote() {
  bool committed = false, threw = false;
  comm::local::run(2, [&](comm::local& c) {
    auto opt = trainer_fixture::options();
    std::int64_t votes = 0;
    opt.commit = [&] {
      if (++votes == 2 && c.rank() == 1) throw comm_error("a collective failed");
      return true;
    };
    trainer<Sharding> t(c, trainer_fixture::make_model(), opt);
    step_on(t, c, 0);
    try {
      const bool ok = step_on(t, c, 1) >= 0;
      if (c.rank() == 0) committed = ok;
    } catch (const comm_error&) {
      if (c.rank() == 0) threw = true;
    }
    if (c.rank() == 0) CHECK(t.steps() == 2);
  }, comm::local_options{.timeout = std::chrono::seconds(5)});
  CHECK(committed);
  CHECK_FALSE(threw);
}

// A run of one layout to step 3: every rank's pieces, the parameters, and the losses of steps 3..5 after it.
struct moved_run {
  std::vector<train::state_pieces> pieces;
  std::vector<float> params, next;
  std::int64_t steps = 0;
};
// With `from` empty: trains steps 0..2 and exports. Else: a trainer with other initial weights imports `from`.
// Either way it records the parameters, then takes steps 3..5.
template <class Sharding>
moved_run move_run(int ranks, int pp, std::span<const train::state_pieces> from) {
  moved_run out;
  out.pieces.resize(static_cast<std::size_t>(ranks));
  std::mutex m;
  comm::local::run(ranks, [&](comm::local& c) {
    auto opt = trainer_fixture::options();
    opt.pipeline_stages = pp;
    if (!from.empty()) opt.seed = 99;
    trainer<Sharding> t(c, trainer_fixture::make_model(), opt);
    train::state_pieces mine;
    if (from.empty()) {
      for (int s = 0; s < 3; ++s) step_on(t, c, s, pp);
      mine = t.export_pieces();
    } else {
      t.import_pieces(from);
    }
    const auto steps = t.steps();
    // Without the padding, which depends on the world's size.
    const auto full = t.full_parameters();
    std::vector<float> params;
    for (const auto& slot : t.layout().slots)
      params.insert(params.end(), full.begin() + slot.offset, full.begin() + slot.offset + slot.shape.numel());
    std::vector<float> next;
    for (int s = 3; s < 6; ++s) next.push_back(step_on(t, c, s, pp));
    std::lock_guard lock(m);
    out.pieces[static_cast<std::size_t>(c.rank())] = std::move(mine);
    if (c.rank() == 0) out.params = std::move(params), out.next = std::move(next), out.steps = steps;
  });
  return out;
}

template <class From, class To>
void check_moved(int from_ranks, int from_pp, int to_ranks, int to_pp) {
  const auto a = move_run<From>(from_ranks, from_pp, {});
  const auto b = move_run<To>(to_ranks, to_pp, a.pieces);
  CHECK(b.steps == 3);
  CHECK(b.params == a.params);  // copied, not computed: exact
  REQUIRE(b.next.size() == a.next.size());
  for (std::size_t i = 0; i < a.next.size(); ++i) {
    // Another world sums in another order: float rounding apart, the same run.
    if (from_ranks == to_ranks && from_pp == to_pp) CHECK(b.next[i] == a.next[i]);
    else CHECK(b.next[i] == doctest::Approx(a.next[i]).epsilon(1e-5));
  }
}

}  // namespace

TEST_CASE("pieces restore into the same layout, bit for bit: zero<2> on 3 ranks") {
  check_moved<parallel::zero<2>, parallel::zero<2>>(3, 1, 3, 1);
}
TEST_CASE("pieces move a run to a smaller world: zero<2> on 4 ranks to zero<3> on 3") {
  check_moved<parallel::zero<2>, parallel::zero<3>>(4, 1, 3, 1);
}
TEST_CASE("pieces move a run out of a pipeline: 2 stages x 2 ranks (zero<1>) to replicate on 3") {
  check_moved<parallel::zero<1>, parallel::replicate>(4, 2, 3, 1);
}
TEST_CASE("pieces move a run into a pipeline: replicate on 3 to 2 stages (zero<3>)") {
  check_moved<parallel::replicate, parallel::zero<3>>(3, 1, 2, 2);
}
TEST_CASE("pieces move a run into 2 stages x 2 data ranks: zero<3> on 3 to zero<3> on 4") {
  check_moved<parallel::zero<3>, parallel::zero<3>>(3, 1, 4, 2);
}
TEST_CASE("pieces that miss an element are refused, and the trainer is unchanged") {
  auto a = move_run<parallel::zero<2>>(2, 1, {});
  a.pieces.pop_back();  // rank 1's part is gone
  comm::local::run(1, [&](comm::local& c) {
    trainer<parallel::replicate> t(c, trainer_fixture::make_model(), trainer_fixture::options());
    const auto before = t.full_parameters();
    CHECK_THROWS_WITH_AS(t.import_pieces(a.pieces), doctest::Contains("are held by none of the 1 states"),
                         invalid_argument);
    CHECK(t.full_parameters() == before);
    CHECK(t.steps() == 0);
  });
}

TEST_CASE("an abandoned or failed step changes nothing: replicate") { check_abandoned_steps<parallel::replicate>(2); }
TEST_CASE("an abandoned or failed step changes nothing: zero<2>") { check_abandoned_steps<parallel::zero<2>>(2); }
TEST_CASE("an abandoned or failed step changes nothing: zero<3>") { check_abandoned_steps<parallel::zero<3>>(3); }
TEST_CASE("a snapshot restores into a fresh trainer: replicate") { check_snapshot<parallel::replicate>(2); }
TEST_CASE("a snapshot restores into a fresh trainer: zero<1>") { check_snapshot<parallel::zero<1>>(2); }
TEST_CASE("a snapshot restores into a fresh trainer: zero<3>") { check_snapshot<parallel::zero<3>>(3); }
TEST_CASE("an abandoned or failed step changes nothing: zero<1>, whose gathers wait for the next pass") {
  check_abandoned_steps<parallel::zero<1>>(2);
}
TEST_CASE("a snapshot taken before the gather restores: zero<1> and zero<2> with votes") {
  check_snapshot<parallel::zero<1>>(2, true);
  check_snapshot<parallel::zero<2>>(3, true);
}
TEST_CASE("nothing after the vote waits for a peer: zero<1>, zero<2>, zero<3>, replicate") {
  check_nothing_after_the_vote<parallel::zero<1>>();
  check_nothing_after_the_vote<parallel::zero<2>>();
  check_nothing_after_the_vote<parallel::zero<3>>();
  check_nothing_after_the_vote<parallel::replicate>();
}

TEST_CASE("a snapshot of another layout is refused") {
  comm::local::run(2, [](comm::local& c) {
    trainer<parallel::zero<2>> t(c, trainer_fixture::make_model(), trainer_fixture::options());
    auto snap = t.snapshot();
    snap.values.pop_back();
    CHECK_THROWS_WITH_AS(t.restore(snap), doctest::Contains("the snapshot has"), invalid_argument);
  });
}

}  // namespace test_transactions
