// SPDX-License-Identifier: Apache-2.0
// tests/train/test_layerwise_trainer.cpp — LAMB and LARS under every sharding x group size give one rank's losses,
// with one reduction of per-tensor sums per step under ZeRO (none under DDP); what they refuse.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include "support.hpp"
#include "trainer_fixture.hpp"

namespace test_layerwise_trainer {

using namespace trainer_fixture;

namespace {

// LARS with a trust coefficient and a global lr (below) that move this small model's weights within 30 steps.
struct lars_fast : optim::lars {
  lars_fast() : lars({.weight_decay = 1e-3f, .eta = 0.02f}) {}
};

// Layouts against one rank: measured 9.6e-8 (lamb) and 1.2e-7 (lars) (losses, relative); the bound is 10x that.
constexpr double layerwise_bound = 1e-6;

template <class... P>
run_result train_local(int ranks, train::trainer_options opt) {
  return on_ranks<run_result>(ranks, [&](comm::local& c) { return train_ranks<P...>(c, opt); });
}

std::int64_t count(const run_result& r, train::event_kind k) {
  return std::ranges::count_if(r.events, [&](const train::event& e) { return e.kind == k; });
}

template <class O>
void layouts_match_one_rank() {
  auto o = options();
  o.record_events = true;
  if constexpr (std::same_as<O, lars_fast>) o.lr = [](std::int64_t step) { return step <= 5 ? 0.04f * float(step) : 0.2f; };
  const auto ref = train_local<parallel::replicate, O>(1, o);
  MESSAGE(std::string(O::name) << " one rank: loss " << ref.losses.front() << " -> " << ref.losses.back());
  CHECK(ref.losses.back() < 0.8 * ref.losses.front());  // it learns
  CHECK(count(ref, train::event_kind::norm_reduce) == 0);
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    const auto ddp = train_local<parallel::replicate, O>(ranks, o);
    check_same(ref, ddp, layerwise_bound);
    CHECK(count(ddp, train::event_kind::norm_reduce) == 0);  // whole tensors on every rank
    for (const auto& got : {train_local<parallel::zero<1>, O>(ranks, o), train_local<parallel::zero<2>, O>(ranks, o),
                            train_local<parallel::zero<3>, O>(ranks, o)}) {
      check_same(ref, got, layerwise_bound);
      CHECK(count(got, train::event_kind::norm_reduce) == steps);  // one reduction per step, not one per tensor
    }
  }
  // Hybrid sharding (the replicas hold the same shards) and a two-stage pipeline (each stage's group).
  auto h = o;
  h.replicas = 2;
  const auto hyb = train_local<parallel::hybrid<parallel::zero<3>>, O>(4, h);
  check_same(ref, hyb, layerwise_bound);
  CHECK(count(hyb, train::event_kind::norm_reduce) == steps);
  auto p = o;
  p.pipeline_stages = 2;
  check_same(ref, train_local<parallel::zero<1>, O>(4, p), layerwise_bound);
}

}  // namespace

TEST_CASE("lamb: replicate, zero1, zero2, zero3 on 2 and 4 ranks, hybrid and a pipeline give one rank's losses") {
  layouts_match_one_rank<optim::lamb>();
}

TEST_CASE("lars: replicate, zero1, zero2, zero3 on 2 and 4 ranks, hybrid and a pipeline give one rank's losses") {
  layouts_match_one_rank<lars_fast>();
}

TEST_CASE("lamb: the trust ratio changes training (the per-tensor path is taken)") {
  // LAMB without decay differs from AdamW without decay only by the ratio; with one rank and under ZeRO-2.
  struct adamw0 : optim::adamw {
    adamw0() : adamw({.weight_decay = 0.f}) {}
  };
  struct lamb0 : optim::lamb {
    lamb0() : lamb({.eps = 1e-8f, .weight_decay = 0.f}) {}
  };
  const auto a = train_local<parallel::zero<2>, adamw0>(2, options());
  const auto l = train_local<parallel::zero<2>, lamb0>(2, options());
  const auto d = dml_test::max_rel_difference(a.losses, l.losses);
  MESSAGE("adamw vs lamb without decay: max_rel_loss_diff=" << d);
  CHECK(d.value > 1e-3);
}

TEST_CASE("bf16 under zero2: lamb tracks one rank in bf16") {
  const auto ref = train_local<parallel::replicate, optim::lamb, precision::bf16>(1, options());
  for (int ranks : {2, 4}) {
    const auto got = train_local<parallel::zero<2>, optim::lamb, precision::bf16>(ranks, options());
    const auto d = dml_test::max_rel_difference(ref.losses, got.losses);
    MESSAGE("bf16 max_rel_loss_diff=" << d);
    CHECK(d.value < 4e-3);  // measured 4.4e-4
  }
}

TEST_CASE("layer-wise optimizers refuse tensor parallelism, naming it") {
  auto o = options();
  o.tensor_parallel = 2;
  comm::local::run(2, [&](comm::local& c) {
    const auto msg = dml_test::error_of<invalid_argument>([&] { trainer<parallel::replicate, optim::lamb> t(c, make_model(), o); });
    CHECK_MESSAGE(msg.find("tensor_parallel") != std::string::npos, msg);
  });
}

TEST_CASE("layer-wise optimizers refuse offload, naming it, and leave no state file behind") {
  dml_test::temp_dir dir("dml-layerwise-offload");
  auto o = options();
  o.offload = "optimizer:disk:" + dir.path.string();
  comm::local::run(1, [&](comm::local& c) {
    const auto msg = dml_test::error_of<invalid_argument>([&] { trainer<parallel::zero<2>, optim::lamb> t(c, make_model(), o); });
    CHECK_MESSAGE(msg.find("offload optimizer:disk:") != std::string::npos, msg);
    CHECK_MESSAGE(msg.find("lamb or lars") != std::string::npos, msg);
  });
  CHECK(std::filesystem::is_empty(dir.path));
}

}  // namespace test_layerwise_trainer
