// SPDX-License-Identifier: Apache-2.0
// tests/plan/test_cost_time.cpp — dml::cost's step time where products are small: the GEMM rate's share at a
// micro-batch's rows (cluster::gemm_rows, what dml-plan --calibrate measures), its JSON form, and a search that
// picks the micro-batch count, trading a pipeline's bubble against slower small products.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "dml/plan/cluster.hpp"
#include "dml/plan/cost.hpp"

using namespace dml;

namespace {
const cost::model small_gpt{.layers = 2, .d_model = 256, .heads = 4, .seq = 128, .vocab = 256};
const cost::training fp32_batch8{.global_batch = 8, .prec = cost::precision::fp32};

// The micro-batch count of the fastest 1F1B layout of two stages and no other parallelism that search() finds.
std::int64_t fastest_pp2_count(const cost::cluster& c) {
  const auto all = cost::search(small_gpt, fp32_batch8, c, 2, 0);
  for (const auto& e : all)  // fastest first
    if (e.lay.pp == 2 && e.lay.zero == 0 && e.lay.recomp == cost::recompute::none && e.why.empty()) return e.lay.micro_batches;
  return -1;
}
}  // namespace

TEST_CASE("the GEMM share at a micro-batch's rows: interpolated in log(rows), held beyond the ends") {
  cost::cluster c;
  CHECK(c.gemm_share(7) == 1.0);  // no table: the full rate
  c.gemm_rows = {{32, 0.5}, {128, 0.9}, {512, 1.0}};
  CHECK(c.gemm_share(16) == 0.5);
  CHECK(c.gemm_share(32) == 0.5);
  CHECK(c.gemm_share(64) == doctest::Approx(0.7).epsilon(1e-12));  // halfway from 32 to 128 in log(rows)
  CHECK(c.gemm_share(128) == doctest::Approx(0.9).epsilon(1e-12));
  CHECK(c.gemm_share(4096) == 1.0);
}

TEST_CASE("the step's compute runs at the rate of its micro-batches' rows") {
  cost::cluster full, shared;
  shared.gemm_rows = {{128, 0.9}, {1024, 1.0}};
  // One rank: 8 sequences of 128 tokens. One micro-batch has 1,024 rows (share 1); eight have 128 (share 0.9).
  for (std::int64_t count : {1, 8}) {
    const cost::layout l{.schedule = "single", .micro_batches = count};
    const auto a = cost::evaluate(small_gpt, l, fp32_batch8, full, 1), b = cost::evaluate(small_gpt, l, fp32_batch8, shared, 1);
    REQUIRE(a.why.empty());
    CAPTURE(count);
    CHECK(b.step_seconds / a.step_seconds == doctest::Approx(count == 1 ? 1.0 : 1 / 0.9).epsilon(1e-12));
    CHECK(b.mfu * b.step_seconds == doctest::Approx(a.mfu * a.step_seconds).epsilon(1e-12));  // MFU: of the peak rate
  }
}

TEST_CASE("search with micro-batch 0 tries every count and picks the one that trades bubble for product size") {
  // Two stages, 8 sequences: 1F1B's step is (M + 1)/M of the compute, which falls with M while the products shrink.
  // A CPU's rate (100 GFLOP/s), so that compute, not the sends' latency, decides.
  cost::cluster c;
  c.flops_fp32 = 1e11;
  CHECK(fastest_pp2_count(c) == 8);  // products at full rate whatever their rows: the most micro-batches
  c.gemm_rows = {{128, 0.3}, {1024, 1.0}};
  // M = 1: 2/1.0 = 2; M = 2 (512 rows, share 0.767): 1.5/0.767 = 1.96; M = 4: 1.25/0.533 = 2.34; M = 8: 3.75.
  CHECK(fastest_pp2_count(c) == 2);
  std::vector<std::int64_t> counts;
  for (const auto& e : cost::search(small_gpt, fp32_batch8, c, 2, 0))
    if (e.lay.pp == 2 && e.lay.zero == 0 && e.lay.recomp == cost::recompute::none) counts.push_back(e.lay.micro_batches);
  std::sort(counts.begin(), counts.end());
  CHECK(counts == std::vector<std::int64_t>{1, 2, 4, 8});  // every count that divides the 8 sequences (1 refused)
}

TEST_CASE("gemm_rows in the cluster file: written, read back, and refused by name when malformed") {
  cost::cluster c;
  c.gemm_rows = {{32, 0.61}, {256, 0.95}, {2048, 1.02}};
  CHECK(cost::cluster_from_json(cost::to_json(c)).gemm_rows == c.gemm_rows);
  CHECK(cost::to_json(cost::cluster{}).count("gemm_rows") == 0);
  for (const char* bad : {R"({"gemm_rows": [[64, 0.5], [32, 0.9]]})", R"({"gemm_rows": [[64, -0.5]]})",
                          R"({"gemm_rows": [64, 0.5]})", R"({"gemm_rows": "fast"})"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(cost::cluster_from_json(nlohmann::json::parse(bad), "c.json"),
                         doctest::Contains("c.json: field 'gemm_rows' must be a list of [rows, share] pairs"),
                         dml::format_error);
  }
}
