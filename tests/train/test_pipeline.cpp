// SPDX-License-Identifier: Apache-2.0
// tests/train/test_pipeline.cpp — every pipeline schedule × stages × data-parallel ranks × micro-batches, with
// dropout in the model, trains to one rank's per-step losses; in-flight activations follow each schedule.
#include <doctest/doctest.h>

#include <span>
#include <string>

#include "support.hpp"
#include "trainer_fixture.hpp"

namespace test_pipeline {

using namespace trainer_fixture;

namespace {

constexpr int pipeline_steps = 20;

template <class... P>
run_result train_local(int ranks, train::trainer_options opt, float p = 0.2f) {
  return on_ranks<run_result>(ranks, [&](comm::local& c) { return train_ranks<P...>(c, opt, make_deep_model(p), pipeline_steps); });
}

// Per-step peaks of the last step on every rank: (rank, peak sets, peak bytes).
struct peaks {
  std::vector<std::int64_t> sets, bytes, held;
};
peaks activation_peaks(int ranks, train::trainer_options opt) {
  peaks out{std::vector<std::int64_t>(ranks), std::vector<std::int64_t>(ranks), std::vector<std::int64_t>(ranks)};
  comm::local::run(ranks, [&](comm::local& c) {
    trainer<parallel::replicate> t(c, make_deep_model(0.f), opt);
    const auto& d = data();
    t.step(tensor_view<const float>(d.x.data(), {global_batch, features}), d.y.data(), global_batch);
    out.sets[static_cast<std::size_t>(c.rank())] = t.peak_in_flight();
    out.bytes[static_cast<std::size_t>(c.rank())] = t.peak_activation_bytes();
    t.step(tensor_view<const float>(d.x.data(), {global_batch, features}), d.y.data(), global_batch);  // again: kept
    out.held[static_cast<std::size_t>(c.rank())] = t.memory().activations_held;
    // Given back, every byte of it, and allocated again by the next step, which ends as it would have: the same
    // loss as a trainer that kept its storage, the same bytes held and at the peak.
    trainer<parallel::replicate> kept(c, make_deep_model(0.f), opt);
    for (int i = 0; i < 2; ++i) kept.step(tensor_view<const float>(d.x.data(), {global_batch, features}), d.y.data(), global_batch);
    const auto before = t.memory();
    t.release_activations();
    CHECK(t.memory().activations_held == 0);
    CHECK(before.allocated - t.memory().allocated >= before.activations_held);
    const float loss = t.step(tensor_view<const float>(d.x.data(), {global_batch, features}), d.y.data(), global_batch).loss;
    CHECK(loss == kept.step(tensor_view<const float>(d.x.data(), {global_batch, features}), d.y.data(), global_batch).loss);
    CHECK(t.memory().activations_held == before.activations_held);
    CHECK(t.peak_activation_bytes() == kept.peak_activation_bytes());
  });
  return out;
}

// Steps [from, to) of the fixture's run on this rank's rows; rank 0's losses.
template <class... P>
std::vector<float> run_steps(trainer<P...>& t, comm::local& c, int stages, int from, int to) {
  const auto& d = data();
  train::sampler sampler(samples, global_batch, 11);
  const int dp = c.size() / stages;
  std::vector<float> xb, losses;
  std::vector<std::int32_t> yb;
  for (int s = from; s < to; ++s) {
    const std::int64_t rows = sampler.gather(s, c.rank() % dp, dp, d.x.data(), features, d.y.data(), xb, yb);
    losses.push_back(t.step(tensor_view<const float>(xb.data(), {rows, features}), yb.data(), global_batch).loss);
  }
  return losses;
}

}  // namespace

TEST_CASE("pipeline: every schedule x stages x data-parallel ranks x micro-batches gives one rank's losses") {
  const auto ref = train_local<parallel::replicate>(1, options());
  const auto plain = train_local<parallel::replicate>(1, options(), 0.f);
  CHECK(std::abs(ref.losses.back() - plain.losses.back()) > 1e-3);  // dropout is on and matters
  MESSAGE("one rank: loss " << ref.losses.front() << " -> " << ref.losses.back());
  int runs = 0;
  for (std::string sched : {"gpipe", "1f1b", "interleaved:2", "zb", "single"})
    for (int pp : {1, 2, 4})
      for (int dp : {1, 2})
        for (std::int64_t m : {1, 2, 4, 8}) {
          if (sched == "single" && pp > 1) continue;  // one stage only
          auto o = options();
          o.schedule = sched;
          o.pipeline_stages = pp;
          o.micro_batches = m;
          CAPTURE(sched);
          CAPTURE(pp);
          CAPTURE(dp);
          CAPTURE(m);
          check_same(ref, train_local<parallel::replicate>(pp * dp, o), fp32_bound);
          ++runs;
        }
  MESSAGE(runs << " layouts");
}

TEST_CASE("pipeline x zero<1>, recompute, and user cut points give one rank's losses") {
  const auto ref = train_local<parallel::replicate>(1, options());
  for (std::string sched : {"1f1b", "zb", "interleaved:2"}) {
    CAPTURE(sched);
    auto o = options();
    o.schedule = sched;
    o.pipeline_stages = 2;
    o.micro_batches = 4;
    check_same(ref, train_local<parallel::zero<1>>(4, o), fp32_bound);
    o.recompute = true;
    check_same(ref, train_local<parallel::replicate>(4, o), fp32_bound);
  }
  auto o = options();
  o.pipeline_stages = 2;
  o.micro_batches = 2;
  o.stage_cuts = {12};  // a heavy first stage
  check_same(ref, train_local<parallel::replicate>(2, o), fp32_bound);
}

TEST_CASE("pipeline: micro-batches of unequal rows give one rank's losses") {
  // Each micro-batch's rows, dropout masks and loss share follow its place in the batch, so a smaller first
  // micro-batch (what dml::cost::rank_pipelines picks for unequal stages) changes no loss.
  const auto ref = train_local<parallel::replicate>(1, options());
  for (std::string sched : {"1f1b", "zb", "gpipe"})
    for (const auto& rows : {std::vector<std::int64_t>{5, 27}, std::vector<std::int64_t>{3, 9, 9, 11}}) {
      CAPTURE(sched);
      CAPTURE(rows.size());
      auto o = options();
      o.schedule = sched;
      o.pipeline_stages = 2;
      o.micro_batches = std::ssize(rows);
      o.micro_batch_rows = rows;
      check_same(ref, train_local<parallel::replicate>(2, o), fp32_bound);
    }
  // One stage accumulating gradients over unequal micro-batches, under ZeRO-2 on 2 ranks (16 rows each).
  auto o = options();
  o.micro_batches = 3;
  o.micro_batch_rows = {2, 6, 8};
  check_same(ref, train_local<parallel::zero<2>>(2, o), fp32_bound);
}

TEST_CASE("pipeline: in-flight activations per stage follow the schedule") {
  constexpr int K = 4, M = 8;
  auto o = options();
  o.pipeline_stages = K;
  o.micro_batches = M;
  o.schedule = "gpipe";
  const auto gpipe = activation_peaks(K, o);
  o.schedule = "1f1b";
  const auto f1b = activation_peaks(K, o);
  o.recompute = true;
  const auto recompute = activation_peaks(K, o);
  for (int r = 0; r < K; ++r) {
    CAPTURE(r);
    CHECK(gpipe.sets[r] == M);          // GPipe holds every micro-batch
    CHECK(f1b.sets[r] <= K - r);        // 1F1B at most K − r
    CHECK(f1b.sets[r] >= 1);
    CHECK(recompute.sets[r] == f1b.sets[r]);
    CHECK(recompute.bytes[r] < f1b.bytes[r]);  // only the stage inputs
    // The storage kept for the next step is that of the sets in flight at once, not one per micro-batch.
    CHECK(gpipe.held[r] == gpipe.bytes[r]);
    CHECK(f1b.held[r] == f1b.bytes[r]);
    CHECK(recompute.held[r] == recompute.bytes[r]);
    MESSAGE("rank " << r << ": gpipe " << gpipe.bytes[r] << " B, 1f1b " << f1b.bytes[r] << " B (" << f1b.held[r]
                    << " held), recompute " << recompute.bytes[r] << " B (" << recompute.held[r] << " held)");
  }
  CHECK(f1b.bytes[0] * 2 <= gpipe.bytes[0]);
  // README's figures: rank 3 keeps 1,104 bytes under 1F1B, where one set per micro-batch (GPipe's) is 8,832.
  CHECK(f1b.held[K - 1] == 1'104);
  CHECK(gpipe.held[K - 1] == 8'832);
}

TEST_CASE("pipeline: bad layouts fail with what was expected") {
  comm::local::run(3, [&](comm::local& c) {
    auto o = options();
    o.pipeline_stages = 2;
    CHECK_THROWS_WITH_AS(trainer<parallel::replicate>(c, make_deep_model(0.f), o),
                         doctest::Contains("to divide the group's 3 ranks, found tensor_parallel 1 and pipeline_stages 2"), invalid_argument);
  });
  comm::local::run(2, [&](comm::local& c) {
    auto o = options();
    o.pipeline_stages = 2;
    o.stage_cuts = {2};  // layer 1 is a relu fused into layer 0; 2 is fine, 1 is not
    CHECK_NOTHROW(trainer<parallel::replicate>(c, make_deep_model(0.f), o));
    o.stage_cuts = {1};
    CHECK_THROWS_WITH_AS(trainer<parallel::replicate>(c, make_deep_model(0.f), o),
                         doctest::Contains("the cut before layer 1 separates a relu from the linear"), invalid_argument);
    o.stage_cuts = {};
    o.micro_batches = 2;
    o.micro_batch_rows = {4, 4, 8};
    CHECK_THROWS_WITH_AS(trainer<parallel::replicate>(c, make_deep_model(0.f), o),
                         "dml::trainer: micro_batch_rows: expected 2 row counts of at least 1 (one per micro-batch), "
                         "found 3 of which 0 below 1", invalid_argument);
    o.micro_batch_rows = {0, 32};
    CHECK_THROWS_WITH_AS(trainer<parallel::replicate>(c, make_deep_model(0.f), o),
                         doctest::Contains("found 2 of which 1 below 1"), invalid_argument);
    o.micro_batch_rows = {8, 16};  // a step of 32 rows
    trainer<parallel::replicate> t(c, make_deep_model(0.f), o);
    const std::vector<float> x(32 * features, 0.5f);
    const std::vector<std::int32_t> y(32, 1);
    CHECK_THROWS_WITH_AS(t.step(tensor_view<const float>(x.data(), {32, features}), y.data(), 32),
                         "dml::trainer::step: micro_batch_rows: expected 2 micro-batches summing to the 32 rows given, "
                         "found 2 summing to 24", invalid_argument);
    o.micro_batch_rows = {};
    o.micro_batches = 1;
    o.stage_cuts = {2};
    o.schedule = "interleaved:2";  // 4 virtual stages need 3 cuts
    CHECK_THROWS_WITH_AS(trainer<parallel::replicate>(c, make_deep_model(0.f), o),
                         doctest::Contains("expected 3 stage cuts for 4 (virtual) stages, found 1"), invalid_argument);
  });
}

// A checkpoint written by 2 stages × 2 data-parallel ranks loads into every other layout (one rank, more
// or fewer stages, zero<1>), and training goes on with the losses of an uninterrupted run.
TEST_CASE("pipeline: checkpoints load into any dp x pp layout") {
  const auto ref = train_local<parallel::replicate>(1, options());
  dml_test::temp_dir dir("dml-pipeline-ckpt");
  constexpr int half = pipeline_steps / 2;
  comm::local::run(4, [&](comm::local& c) {
    auto o = options();
    o.pipeline_stages = 2;
    o.micro_batches = 2;
    trainer<parallel::replicate> t(c, make_deep_model(0.2f), o);
    run_steps(t, c, 2, 0, half);
    t.save_checkpoint(dir.path);
  });
  struct layout {
    int ranks, stages;
    const char* schedule;
  };
  for (const auto [ranks, stages, sched] : {layout{1, 1, ""}, layout{2, 2, "gpipe"}, layout{4, 4, "1f1b"},
                                            layout{4, 2, "interleaved:2"}, layout{2, 1, ""}}) {
    CAPTURE(ranks);
    CAPTURE(stages);
    const auto losses = on_ranks<std::vector<float>>(ranks, [&](comm::local& c) {
      auto o = options();
      o.pipeline_stages = stages;
      o.micro_batches = 2;
      o.schedule = sched;
      trainer<parallel::zero<1>> t(c, make_deep_model(0.2f), o);
      t.load_checkpoint(dir.path);
      return run_steps(t, c, stages, half, pipeline_steps);
    });
    REQUIRE(losses.size() == static_cast<std::size_t>(pipeline_steps - half));
    const auto worst = dml_test::max_rel_difference(std::span(ref.losses).subspan(half, losses.size()), losses);
    MESSAGE("max_rel_loss_diff=" << worst);
    CHECK(worst.value <= fp32_bound);
  }
}

}  // namespace test_pipeline
