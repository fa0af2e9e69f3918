// SPDX-License-Identifier: Apache-2.0
// tests/plan/test_cost_time.cpp — dml::cost's step time where products are small: the GEMM rate's share at a
// micro-batch's rows (cluster::gemm_rows, what dml-plan --calibrate measures), its JSON form, a search that
// picks the micro-batch count, trading a pipeline's bubble against slower small products, and each schedule's bubble.
#include <doctest/doctest.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "dml/plan/cluster.hpp"
#include "dml/plan/cost.hpp"

namespace test_cost_time {

using namespace dml;

namespace {
const cost::model small_gpt{.layers = 2, .d_model = 256, .heads = 4, .seq = 128, .vocab = 256};
const cost::training fp32_batch8{.global_batch = 8, .prec = cost::precision::fp32};
constexpr double unbounded = std::numeric_limits<double>::infinity();  // a memory bandwidth that makes updates free

// The micro-batch count of the fastest 1F1B layout of two stages and no other parallelism that search() finds.
std::int64_t fastest_pp2_count(const cost::cluster& c) {
  const auto all = cost::search(small_gpt, fp32_batch8, c, 2, 0);
  for (const auto& e : all)  // fastest first
    if (e.lay.pp == 2 && e.lay.zero == 0 && e.lay.recomp == cost::recompute::none && e.lay.schedule == "1f1b" &&
        e.why.empty())
      return e.lay.micro_batches;
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
  full.memory_bandwidth = shared.memory_bandwidth = unbounded;  // the compute alone
  full.elementwise_bandwidth = shared.elementwise_bandwidth = unbounded;
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
    if (e.lay.pp == 2 && e.lay.zero == 0 && e.lay.recomp == cost::recompute::none && e.lay.schedule == "1f1b")
      counts.push_back(e.lay.micro_batches);
  std::sort(counts.begin(), counts.end());
  CHECK(counts == std::vector<std::int64_t>{1, 2, 4, 8});  // every count that divides the 8 sequences (1 refused)
}

TEST_CASE("gemm_rows and memory_bandwidth in the cluster file: written, read back, and refused by name when malformed") {
  cost::cluster c;
  c.gemm_rows = {{32, 0.61}, {256, 0.95}, {2048, 1.02}};
  CHECK(cost::cluster_from_json(cost::to_json(c)).gemm_rows == c.gemm_rows);
  CHECK(cost::to_json(cost::cluster{}).count("gemm_rows") == 0);
  c.memory_bandwidth = 17.5e9;
  CHECK(cost::cluster_from_json(cost::to_json(c)).memory_bandwidth == 17.5e9);
  CHECK_THROWS_WITH_AS(cost::cluster_from_json(nlohmann::json::parse(R"({"memory_bandwidth": 0})"), "c.json"),
                       "c.json: field 'memory_bandwidth' must be a positive number, found 0", dml::format_error);
  for (const char* bad : {R"({"gemm_rows": [[64, 0.5], [32, 0.9]]})", R"({"gemm_rows": [[64, -0.5]]})",
                          R"({"gemm_rows": [64, 0.5]})", R"({"gemm_rows": "fast"})"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(cost::cluster_from_json(nlohmann::json::parse(bad), "c.json"),
                         doctest::Contains("c.json: field 'gemm_rows' must be a list of [rows, share] pairs"),
                         dml::format_error);
  }
}

TEST_CASE("tensor parallelism: all-gathers and reduce-scatters at the node's gather rate, all-reduces at its link's") {
  // small_gpt, tp 2 + sp, one micro-batch of 8 sequences: per block 10 all-gathers and reduce-scatters of the
  // micro-batch's 1,024 × 256 floats (1 MiB), and 2 more for the embedding and the head's end; a ring moves half.
  const auto sp = cost::parse_layout("tp=2,sp=1,schedule=single"), no_sp = cost::parse_layout("tp=2,schedule=single");
  const auto tc = cost::gpt_tp_collectives(small_gpt, sp, 8, 4);
  CHECK(tc.moved_gather == 24 * 0.5 * 1024 * 256 * 4);
  CHECK(cost::gpt_tp_collectives(small_gpt, no_sp, 8, 4).moved_gather == 0);  // all-reduces only
  cost::cluster ring, local;
  ring.intra_bandwidth = local.intra_bandwidth = 16e9;
  ring.intra_latency = local.intra_latency = 1e-6;
  local.intra_gather_bandwidth = 4e9;
  const auto a = cost::evaluate(small_gpt, sp, fp32_batch8, ring, 2), b = cost::evaluate(small_gpt, sp, fp32_batch8, local, 2);
  REQUIRE(a.why.empty());
  CHECK(a.time.tp == doctest::Approx(tc.steps * 1e-6 + tc.moved / 16e9).epsilon(1e-12));
  CHECK(b.time.tp == doctest::Approx(tc.steps * 1e-6 + (tc.moved - tc.moved_gather) / 16e9 + tc.moved_gather / 4e9).epsilon(1e-12));
  CHECK(cost::evaluate(small_gpt, no_sp, fp32_batch8, local, 2).time.tp ==
        doctest::Approx(cost::evaluate(small_gpt, no_sp, fp32_batch8, ring, 2).time.tp).epsilon(1e-12));
  // A group wider than a node runs at the link between nodes, whatever the node's gather rate.
  local.devices_per_node = ring.devices_per_node = 1;
  CHECK(cost::evaluate(small_gpt, sp, fp32_batch8, local, 2).time.tp ==
        doctest::Approx(cost::evaluate(small_gpt, sp, fp32_batch8, ring, 2).time.tp).epsilon(1e-12));
  // In the cluster file: written where set, read back, refused by name when not positive.
  CHECK(cost::to_json(cost::cluster{}).count("intra_gather_bandwidth") == 0);
  CHECK(cost::cluster_from_json(cost::to_json(local)).intra_gather_bandwidth == 4e9);
  CHECK_THROWS_WITH_AS(cost::cluster_from_json(nlohmann::json::parse(R"({"intra_gather_bandwidth": -1})"), "c.json"),
                       "c.json: field 'intra_gather_bandwidth' must be a positive number, found -1", dml::format_error);
}

TEST_CASE("the optimizer's update: the rank's parameters (its ZeRO shard) at memory bandwidth, after the pipeline") {
  CHECK(cost::update_bytes_per_param("adamw", cost::precision::fp32) == 28);  // w r/w, g, m r/w, v r/w
  CHECK(cost::update_bytes_per_param("adamw", cost::precision::bf16) == 28);  // master r/w, 16-bit g, m, v, 16-bit w
  CHECK(cost::update_bytes_per_param("sgd", cost::precision::fp32) == 20);
  // A model of 1.2e9 parameters on 8 ranks: tp 2 x dp 4. The update is the only term that depends on the bandwidth.
  const cost::model m{.params_only = 1.2e9};
  cost::cluster fast, slow;
  fast.memory_bandwidth = unbounded;
  slow.memory_bandwidth = 1e12;
  for (const auto& [layout, optimizer, prec, updated] :
       {std::tuple{"dp=4,tp=2,zero=0", "adamw", cost::precision::fp32, 0.6e9},  // every rank updates its tp half
        {"dp=4,tp=2,zero=1", "adamw", cost::precision::bf16, 0.15e9},           // ZeRO-1: a quarter of that
        {"dp=4,tp=2,zero=3", "sgd", cost::precision::fp32, 0.15e9}}) {
    CAPTURE(layout);
    const cost::training t{.global_batch = 8, .prec = prec, .optimizer = optimizer};
    const auto a = cost::evaluate(m, cost::parse_layout(layout), t, fast, 8), b = cost::evaluate(m, cost::parse_layout(layout), t, slow, 8);
    REQUIRE(a.why.empty());
    CHECK(b.step_seconds - a.step_seconds == doctest::Approx(updated * cost::update_bytes_per_param(optimizer, prec) / 1e12).epsilon(1e-9));
    CHECK(b.bubble == 0);
  }
  // Where the update outweighs everything else, it is the bottleneck.
  cost::cluster crawl;
  crawl.memory_bandwidth = 1e6;
  CHECK(cost::evaluate(m, cost::parse_layout("dp=4,tp=2"), fp32_batch8, crawl, 8).bottleneck == "optimizer update");
}

TEST_CASE("the element-wise passes: the blocks' saved activation bytes and the ends' values, at the element-wise rate") {
  cost::cluster fast, slow;
  fast.elementwise_bandwidth = unbounded;
  slow.elementwise_bandwidth = 1e9;
  // small_gpt: 2 layers, C 256, 4 heads, seq 128, vocabulary 256; 8 sequences. Korthikanti's bytes per layer for b
  // sequences of one rank's micro-batch, twice the 2-byte figure in fp32; without tp sbh(34 + 5as/h), with tp and sp
  // a t-th of it, with tp alone sbh(10 + 24/t + 5as/(ht)). Outside the blocks, 4-byte values per token of the rank:
  // the embedding's 9C (every token's, under tp too), the final LayerNorm's 10C (a t-th under sp) and the loss's 5V/t.
  const double sbh8 = 128.0 * 8 * 256, attention = 5.0 * 4 * 128 / 256, h = 256, v = 256;
  for (const auto& [layout, bytes] :
       {std::pair{"dp=1,schedule=single", 2 * 2 * sbh8 * (34 + attention) + 1024 * 4 * (9 * h + 10 * h + 5 * v)},  // 2 layers
        {"dp=1,mb=4,schedule=single", 2 * 2 * sbh8 * (34 + attention) + 1024 * 4 * (9 * h + 10 * h + 5 * v)},  // 4 of a quarter
        {"dp=2,schedule=single", 2 * 2 * sbh8 / 2 * (34 + attention) + 512 * 4 * (9 * h + 10 * h + 5 * v)},  // half the sequences
        {"tp=2,sp=1,schedule=single", 2 * 2 * sbh8 / 2 * (34 + attention) + 1024 * 4 * (9 * h + 10 * h / 2 + 5 * v / 2)},
        {"tp=2,schedule=single", 2 * 2 * sbh8 * (10 + 24.0 / 2 + attention / 2) + 1024 * 4 * (9 * h + 10 * h + 5 * v / 2)}}) {
    CAPTURE(layout);
    const auto l = cost::parse_layout(layout);
    const auto a = cost::evaluate(small_gpt, l, fp32_batch8, fast, l.devices()), b = cost::evaluate(small_gpt, l, fp32_batch8, slow, l.devices());
    REQUIRE(a.why.empty());
    CHECK(b.step_seconds - a.step_seconds == doctest::Approx(bytes / 1e9).epsilon(1e-9));
  }
  // On a pipeline the passes are part of each stage's busy time, so the bubble stretches them: 1F1B, 2 stages, M = 4;
  // a stage holds one layer and one end, the larger (the last stage's LayerNorm and loss, 10C + 5V).
  const auto l = cost::parse_layout("pp=2,mb=4,schedule=1f1b");
  const auto a = cost::evaluate(small_gpt, l, fp32_batch8, fast, 2), b = cost::evaluate(small_gpt, l, fp32_batch8, slow, 2);
  CHECK(b.step_seconds - a.step_seconds ==
        doctest::Approx((2 * sbh8 * (34 + attention) + 1024 * 4 * (10 * h + 5 * v)) / 1e9 * 5 / 4).epsilon(1e-9));
  cost::cluster c;
  c.elementwise_bandwidth = 3.5e9;
  CHECK(cost::cluster_from_json(cost::to_json(c)).elementwise_bandwidth == 3.5e9);
  // 16-bit working types at their own rate, their bytes halved: bf16's passes at 1e9 bytes/s take half fp32's time
  // at the same rate, and all of it at half the rate (as many values a second as fp32 at 1e9).
  const cost::training bf16_batch8{.global_batch = 8, .prec = cost::precision::bf16};
  const auto one = cost::parse_layout("dp=1,schedule=single");
  const double fp32_bytes = 2 * 2 * sbh8 * (34 + attention) + 1024 * 4 * (9 * h + 10 * h + 5 * v);
  fast.elementwise_bandwidth_bf16 = unbounded;
  for (const double rate : {1e9, 0.5e9}) {
    CAPTURE(rate);
    cost::cluster half = fast;
    half.elementwise_bandwidth_bf16 = rate;
    const double extra = cost::evaluate(small_gpt, one, bf16_batch8, half, 1).step_seconds -
                         cost::evaluate(small_gpt, one, bf16_batch8, fast, 1).step_seconds;
    CHECK(extra == doctest::Approx(fp32_bytes / 2 / rate).epsilon(1e-9));
  }
  // In the cluster file: written and read back; left out, it follows elementwise_bandwidth.
  c.elementwise_bandwidth_bf16 = 1.5e9;
  CHECK(cost::cluster_from_json(cost::to_json(c)).elementwise_bandwidth_bf16 == 1.5e9);
  CHECK(cost::cluster_from_json(nlohmann::json::parse(R"({"elementwise_bandwidth": 2e9})")).elementwise_bandwidth_bf16 == 2e9);
  CHECK_THROWS_WITH_AS(cost::cluster_from_json(nlohmann::json::parse(R"({"elementwise_bandwidth_bf16": "x"})"), "c.json"),
                       "c.json: field 'elementwise_bandwidth_bf16' must be a positive number, found \"x\"",
                       dml::format_error);
}

TEST_CASE("precision auto: fp32 where bf16's products are slower (widened to f32), bf16 where faster or only it fits") {
  const std::vector<cost::precision> both{cost::precision::fp32, cost::precision::bf16};
  const auto pick = [&](const cost::cluster& c) {
    const auto all = cost::search_precisions(fp32_batch8, both, [&](const cost::training& t) { return cost::search(small_gpt, t, c, 1, 0); });
    REQUIRE(!all.empty());
    // Both precisions are searched: as many estimates as two single searches, each saying its precision.
    CHECK(all.size() == 2 * cost::search(small_gpt, fp32_batch8, c, 1, 0).size());
    CHECK(std::count_if(all.begin(), all.end(), [](const auto& e) { return e.prec == cost::precision::bf16; }) ==
          static_cast<std::ptrdiff_t>(all.size() / 2));
    REQUIRE(all.front().fits);
    return all.front();
  };
  // An AVX2 host as measured: bf16 GEMMs widened to f32 at 0.9x fp32's rate, its element-wise passes at about fp32's
  // values per second (half the bytes per second).
  cost::cluster widened;
  widened.flops_fp32 = 60e9, widened.flops_bf16 = 54e9;
  widened.elementwise_bandwidth = 4e9, widened.elementwise_bandwidth_bf16 = 2e9;
  widened.memory_bandwidth = 10e9;
  const auto a = pick(widened);
  CHECK(a.prec == cost::precision::fp32);
  // A host with bf16 dot products: twice the rate.
  cost::cluster native = widened;
  native.flops_bf16 = 120e9;
  CHECK(pick(native).prec == cost::precision::bf16);
  // A layout given (as gpt --precision auto with the layout's flags) in memory that its fp32 bytes do not fit and
  // its bf16 bytes (halves of the parameters, gradients and activations) do: bf16, though it is slower.
  cost::training bf16_batch8 = fp32_batch8;
  bf16_batch8.prec = cost::precision::bf16;
  const auto fp32_bytes = cost::evaluate(small_gpt, a.lay, fp32_batch8, widened, 1).per_rank.total();
  const auto bf16_bytes = cost::evaluate(small_gpt, a.lay, bf16_batch8, widened, 1).per_rank.total();
  REQUIRE(bf16_bytes < fp32_bytes);
  cost::cluster tight = widened;
  const auto given = [&](const cost::cluster& c) {
    return cost::search_precisions(fp32_batch8, both, [&](const cost::training& t) {
      return std::vector{cost::evaluate(small_gpt, a.lay, t, c, 1)};
    });
  };
  REQUIRE(given(tight).size() == 2);
  CHECK(given(tight).front().prec == cost::precision::fp32);  // 80 GiB: both fit, fp32 the faster
  tight.memory_bytes = (fp32_bytes + bf16_bytes) / 2;
  const auto squeezed = given(tight);
  CHECK(squeezed.front().prec == cost::precision::bf16);
  CHECK(squeezed.front().fits);
  CHECK_FALSE(squeezed.back().fits);
  CHECK(squeezed.front().step_seconds > squeezed.back().step_seconds);
  tight.memory_bytes = bf16_bytes / 2;  // neither
  CHECK_FALSE(given(tight).front().fits);
}

TEST_CASE("each schedule's bubble: (p - 1)/(units + p - 1) with M, V·M or 3M units of a stage's compute") {
  // Two stages, M = 4, no data parallelism: the step is the stage's busy time stretched by the bubble alone.
  cost::model four_layers = small_gpt;
  four_layers.layers = 4;  // interleaved:2 on 2 stages needs 4
  cost::cluster c;
  c.flops_fp32 = 1e11;
  c.memory_bandwidth = unbounded;  // no update after the pipeline
  const auto eval = [&](const std::string& schedule) {
    const auto e = cost::evaluate(four_layers, cost::parse_layout("pp=2,mb=4,schedule=" + schedule), fp32_batch8, c, 2);
    REQUIRE(e.why.empty());
    return e;
  };
  const auto one = eval("1f1b");
  CHECK(one.bubble == doctest::Approx(1.0 / 5).epsilon(1e-12));
  const double busy = one.step_seconds * (1 - one.bubble);
  for (const auto& [schedule, bubble] : {std::pair{"gpipe", 1.0 / 5}, {"zb", 1.0 / 13}, {"interleaved:2", 1.0 / 9}}) {
    CAPTURE(schedule);
    const auto e = eval(schedule);
    CHECK(e.bubble == doctest::Approx(bubble).epsilon(1e-12));
    // The same busy time, but interleaving's twice as many sends.
    if (std::string(schedule) != "interleaved:2") CHECK(e.step_seconds * (1 - e.bubble) == doctest::Approx(busy).epsilon(1e-12));
    else CHECK(e.step_seconds * (1 - e.bubble) > busy);
  }
  // zb holds 1F1B's micro-batches in flight; interleaving (1 + (p - 1)/(p·V)) times as many on the first stage.
  CHECK(eval("zb").per_rank.activations == one.per_rank.activations);
  CHECK(eval("interleaved:2").per_rank.activations == doctest::Approx(one.per_rank.activations * 1.25).epsilon(1e-12));
}

TEST_CASE("the search weighs zb against 1F1B and picks the smaller bubble") {
  cost::cluster c;
  c.flops_fp32 = 1e11;
  const auto all = cost::search(small_gpt, fp32_batch8, c, 2, 0);
  const auto first_pp2 = std::find_if(all.begin(), all.end(), [](const cost::estimate& e) { return e.lay.pp == 2; });
  REQUIRE(first_pp2 != all.end());
  CHECK(first_pp2->lay.schedule == "zb");
  CHECK(first_pp2->lay.micro_batches == 8);
  std::vector<std::string> seen;
  for (const auto& e : all)
    if (std::find(seen.begin(), seen.end(), e.lay.schedule) == seen.end()) seen.push_back(e.lay.schedule);
  std::sort(seen.begin(), seen.end());
  CHECK(seen == std::vector<std::string>{"1f1b", "single", "zb"});
}

TEST_CASE("schedules in a layout: zb and interleaved:V read; others refused by name; interleaving needs its layers") {
  CHECK(cost::parse_layout("pp=2,schedule=zb").schedule == "zb");
  CHECK(cost::parse_layout("pp=2,schedule=interleaved:3").schedule == "interleaved:3");
  for (const char* bad : {"schedule=interleaved:1", "schedule=interleaved:x", "schedule=interleaved:", "schedule=zigzag"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(cost::parse_layout(bad), doctest::Contains("expected schedule single, gpipe, 1f1b, zb or interleaved:V"),
                         dml::invalid_argument);
  }
  // small_gpt has 2 layers: interleaved:2 on 2 stages needs 4.
  CHECK(cost::refusal(small_gpt, cost::parse_layout("pp=2,mb=2,schedule=interleaved:2"), fp32_batch8, 2) ==
        "interleaved:2 on pp 2 needs 4 stages of layers, more than the 2 layers");
  CHECK(cost::refusal(small_gpt, cost::parse_layout("pp=2,mb=2,schedule=zb"), fp32_batch8, 2).empty());
}

TEST_CASE("each block's fixed cost: a stage's blocks times the micro-batches, in the working precision's field") {
  cost::cluster none, fixed;
  fixed.block_seconds = 1e-3, fixed.block_seconds_bf16 = 3e-3;
  // small_gpt's 2 layers: every block on one stage (dp, tp and micro-batches alike), or one a stage on two.
  for (const auto& [layout, blocks_times_mb] :
       {std::pair{"dp=1,schedule=single", 2.0}, {"dp=1,mb=4,schedule=single", 8.0}, {"dp=2,schedule=single", 2.0},
        {"tp=2,sp=1,schedule=single", 2.0}, {"pp=2,mb=4,schedule=1f1b", 4.0}}) {
    CAPTURE(layout);
    const auto l = cost::parse_layout(layout);
    const auto a = cost::evaluate(small_gpt, l, fp32_batch8, none, l.devices()), b = cost::evaluate(small_gpt, l, fp32_batch8, fixed, l.devices());
    REQUIRE(a.why.empty());
    CHECK(b.time.elementwise - a.time.elementwise == doctest::Approx(blocks_times_mb * 1e-3).epsilon(1e-9));
    // Busy time: a pipeline's bubble stretches it (1F1B, 2 stages, M = 4: 5/4 of it).
    CHECK(b.step_seconds - a.step_seconds == doctest::Approx(blocks_times_mb * 1e-3 * (l.pp > 1 ? 5.0 / 4 : 1)).epsilon(1e-9));
    const cost::training bf16_batch8{.global_batch = 8, .prec = cost::precision::bf16};
    CHECK(cost::evaluate(small_gpt, l, bf16_batch8, fixed, l.devices()).time.elementwise -
              cost::evaluate(small_gpt, l, bf16_batch8, none, l.devices()).time.elementwise ==
          doctest::Approx(blocks_times_mb * 3e-3).epsilon(1e-9));
  }
  // In the cluster file: written and read back; block_seconds_bf16 left out follows block_seconds; 0 allowed,
  // negative refused by name.
  const auto back = cost::cluster_from_json(cost::to_json(fixed));
  CHECK(back.block_seconds == 1e-3);
  CHECK(back.block_seconds_bf16 == 3e-3);
  CHECK(cost::cluster_from_json(nlohmann::json::parse(R"({"block_seconds": 2e-4})")).block_seconds_bf16 == 2e-4);
  CHECK(cost::cluster_from_json(nlohmann::json::parse(R"({"block_seconds": 0})")).block_seconds == 0);
  CHECK_THROWS_WITH_AS(cost::cluster_from_json(nlohmann::json::parse(R"({"block_seconds_bf16": -1e-4})"), "c.json"),
                       "c.json: field 'block_seconds_bf16' must be a number of seconds of at least 0, found -0.0001",
                       dml::format_error);
}
TEST_CASE("the step's parts add up to the step, each the term it names") {
  cost::cluster c;
  c.memory_bandwidth = 1e11;
  c.elementwise_bandwidth = 1e9;
  for (const char* layout : {"dp=1,schedule=single", "dp=2,schedule=single", "dp=1,mb=4,schedule=single",
                             "tp=2,sp=1,schedule=single", "pp=2,mb=4,schedule=1f1b", "pp=2,mb=8,schedule=zb",
                             "dp=2,pp=2,tp=2,mb=4,schedule=1f1b,zero=1"}) {
    CAPTURE(layout);
    const auto l = cost::parse_layout(layout);
    const auto e = cost::evaluate(small_gpt, l, fp32_batch8, c, l.devices());
    REQUIRE(e.why.empty());
    const auto& t = e.time;
    CHECK(t.compute + t.elementwise + t.tp + t.pp + t.bubble + t.dp + t.update == doctest::Approx(e.step_seconds).epsilon(1e-12));
    CHECK(t.bubble == doctest::Approx(e.bubble * e.step_seconds).epsilon(1e-12));
    CHECK((t.tp > 0) == (l.tp > 1));
    CHECK((t.pp > 0) == (l.pp > 1));
    CHECK((t.bubble > 0) == (l.pp > 1));
    CHECK((t.dp > 0) == (l.dp > 1));
    // Doubling one rate halves its own part and leaves the others.
    cost::cluster faster = c;
    faster.elementwise_bandwidth *= 2;
    faster.memory_bandwidth *= 2;
    const auto f = cost::evaluate(small_gpt, l, fp32_batch8, faster, l.devices());
    CHECK(f.time.elementwise == doctest::Approx(t.elementwise / 2).epsilon(1e-12));
    CHECK(f.time.update == doctest::Approx(t.update / 2).epsilon(1e-12));
    CHECK(f.time.compute == t.compute);
    CHECK(f.time.dp == t.dp);
  }
}

TEST_CASE("experts: their passes in place of the dense MLP's, the routing all-reduce and ep's four all-to-alls a block") {
  cost::model moe = small_gpt;
  moe.experts = 4;  // top 2, every block
  cost::cluster fast, slow;
  fast.elementwise_bandwidth = slow.elementwise_bandwidth = unbounded;
  fast.intra_bandwidth = slow.intra_bandwidth = 10e9;
  fast.intra_latency = slow.intra_latency = 2e-6;
  slow.elementwise_bandwidth = 1e9;
  const auto one = cost::parse_layout("dp=1,schedule=single"), dp2 = cost::parse_layout("dp=2,schedule=single"),
             ep2 = cost::parse_layout("dp=2,ep=2,schedule=single");
  CHECK(cost::evaluate(small_gpt, dp2, fp32_batch8, fast, 2).time.ep == 0);  // no experts
  CHECK(cost::evaluate(moe, one, fp32_batch8, fast, 1).time.ep == 0);        // one rank routes alone
  // Data parallel: per block and micro-batch one all-reduce of the routing counts, 2(dp - 1) ring steps.
  CHECK(cost::evaluate(moe, dp2, fp32_batch8, fast, 2).time.ep == doctest::Approx(2 * 2 * 1 * 2e-6).epsilon(1e-12));
  // Expert parallel: four all-to-alls more per block, each a latency per peer and half of a rank's 512 tokens' 2
  // choices of 256 floats leaving.
  const double a2a = 512.0 * 2 * 256 * 4;
  CHECK(cost::evaluate(moe, ep2, fp32_batch8, fast, 2).time.ep ==
        doctest::Approx(2 * 2 * 2e-6 + 2 * 4 * (2e-6 + a2a / 2 / 10e9)).epsilon(1e-12));
  // The passes: an expert block's MLP stands for 37 sbh per choice (41 under ep, at the busiest rank's load, the
  // capacity factor 1.25) where a dense one's is 19, twice the 2-byte figure in fp32; the rest as a dense GPT's.
  const double sbh8 = 128.0 * 8 * 256;
  for (const auto& [l, per_choice, ranks] : {std::tuple{one, 37.0, 1}, std::tuple{dp2, 37.0, 2}, std::tuple{ep2, 41.0 * 1.25, 2}}) {
    CAPTURE(per_choice);
    CAPTURE(ranks);
    const auto passes = [&](const cost::model& m, const cost::layout& at) {
      return cost::evaluate(m, at, fp32_batch8, slow, ranks).time.elementwise -
             cost::evaluate(m, at, fp32_batch8, fast, ranks).time.elementwise;
    };
    // (a dense GPT refuses ep > 1: its dp-only twin)
    CHECK(passes(moe, l) - passes(small_gpt, ranks == 1 ? one : dp2) == doctest::Approx(2 * 2 * sbh8 / ranks * (2 * per_choice - 19) / 1e9).epsilon(1e-9));
  }
  // The products: under ep the busiest rank's experts at 1.25 times their mean rows, the experts' 2 choices of
  // 16h² FLOPs a token, three times the forward's, for a rank's 512 tokens in each of 2 blocks.
  cost::cluster plain;
  plain.flops_fp32 = 1e11;
  const double expert_flops = 3 * 512.0 * 2 * 2 * 16 * 256 * 256;
  CHECK(cost::evaluate(moe, ep2, fp32_batch8, plain, 2).time.compute - cost::evaluate(moe, dp2, fp32_batch8, plain, 2).time.compute ==
        doctest::Approx(0.25 * expert_flops / 1e11).epsilon(1e-9));
  CHECK(cost::busiest_expert_load(1.25, 2) == 1.25);
  CHECK(cost::busiest_expert_load(1.25, 1) == 1);  // one rank holds every expert
  CHECK(cost::busiest_expert_load(4, 2) == 2);     // all of the group's rows at most
  CHECK(cost::busiest_expert_load(0, 4) == 4);     // dropless: nothing bounds it but the group
  CHECK(cost::estimate::parts{.ep = 1}.named()[3] == std::pair<const char*, double>{"expert routing and all-to-alls", 1});
}

TEST_CASE("context parallelism: a rank's queries meet every key, the ring's passes and its 3(cp - 1) steps a block") {
  cost::cluster fast, slow;
  fast.elementwise_bandwidth = slow.elementwise_bandwidth = unbounded;
  fast.intra_bandwidth = slow.intra_bandwidth = 10e9;
  fast.intra_latency = slow.intra_latency = 2e-6;
  slow.elementwise_bandwidth = 1e9;
  // small_gpt on 2 ranks: dp 2 gives each 4 sequences of 128 tokens, cp 2 all 8 sequences' 64-token halves.
  const auto dp2 = cost::parse_layout("dp=2,schedule=single"), cp2 = cost::parse_layout("dp=2,cp=2,schedule=single");
  CHECK(cost::evaluate(small_gpt, dp2, fp32_batch8, fast, 2).time.cp == 0);
  // Per block: one step forward and two backward, each 512 tokens' K and V (2 · 256 floats) leaving.
  const double kv = 512.0 * 2 * 256 * 4;
  CHECK(cost::evaluate(small_gpt, cp2, fp32_batch8, fast, 2).time.cp == doctest::Approx(2 * 3 * (2e-6 + kv / 10e9)).epsilon(1e-12));
  // The blocks' passes: the same tokens per rank as dp 2 and the same s² bytes (64 queries by 128 keys of 8
  // sequences, as 128 by 128 of 4), plus the ring's 30 sbh; twice the 2-byte figure in fp32. The ends are alike.
  const auto passes = [&](const cost::layout& l) {
    return cost::evaluate(small_gpt, l, fp32_batch8, slow, 2).time.elementwise -
           cost::evaluate(small_gpt, l, fp32_batch8, fast, 2).time.elementwise;
  };
  const double sbh_rank = 512.0 * 256;
  CHECK(passes(cp2) - passes(dp2) == doctest::Approx(2 * 2 * sbh_rank * 30 / 1e9).epsilon(1e-9));
  CHECK(cost::estimate::parts{.cp = 1}.named()[4] == std::pair<const char*, double>{"context-parallel ring", 1});
}

}  // namespace test_cost_time
