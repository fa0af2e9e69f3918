// SPDX-License-Identifier: Apache-2.0
// tests/nn/test_flops.cpp — what a layer says its forward costs (nn::forward_flops) against the products its forward
// runs (every host GEMM traced: 2·m·n·k each), and the pipeline's stage cuts by predicted time (parallel::stage_chunks)
// against dml::cost's pricing of the same cut.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dml/core/gemm.hpp"
#include "dml/nn/gpt.hpp"
#include "dml/nn/moe.hpp"
#include "dml/nn/network.hpp"
#include "dml/plan/calibrate.hpp"
#include "dml/plan/cost.hpp"
#include "dml/plan/exact.hpp"
#include "support.hpp"

namespace test_flops {

using namespace dml;

namespace {

// 2·m·n·k summed over the host GEMMs that f runs.
template <class F>
double traced_flops(F&& f) {
  std::vector<gemm_call> calls;
  detail::host_gemm_trace = &calls;
  f();
  detail::host_gemm_trace = nullptr;
  double sum = 0;
  for (const auto& c : calls) sum += 2.0 * static_cast<double>(c.args.m * c.args.n * c.args.k);
  return sum;
}

// The FLOPs of one forward of a one-layer network on input shape xs (token ids for the embedding, else values).
template <class Layer>
double forward_traced(const Layer& layer, const dml::shape& xs, std::vector<float> x) {
  nn::network<host, Layer> net(nn::sequential{layer}, 1);
  nn::context c{.training = true, .seed = 1, .step = 1};
  return traced_flops([&] { net.forward(tensor_view<const float>(x.data(), xs), c); });
}

nn::gpt_config small_gpt() {
  return {.vocab = 40, .seq = 12, .layers = 3, .d_model = 16, .heads = 2};
}

}  // namespace

TEST_CASE("forward_flops: a linear layer's, a GPT block's and head's, and an MoE layer's are the products they run") {
  const nn::linear lin{24, 40};
  const dml::shape rows{7, 24};
  CHECK(nn::forward_flops(lin, rows) == 2.0 * 7 * 24 * 40);
  CHECK(forward_traced(lin, rows, dml_test::random_vector(7 * 24, 1)) == nn::forward_flops(lin, rows));

  const auto g = small_gpt();
  const dml::shape tokens{3, 12, 16};  // batch 3, T 12, C 16
  const nn::gpt_block block(g, false);
  // Per token: c_attn, c_proj and the MLP's 24·C², q·kᵀ and p·v over all T keys 4·T·C. Attention's products run
  // inside the tile kernel, not as traced GEMMs, and count as model FLOPs do: the whole T × T.
  const double attention = 36.0 * 4 * 12 * 16;
  CHECK(nn::forward_flops(block, tokens) == 36.0 * 24 * 16 * 16 + attention);
  CHECK(forward_traced(block, tokens, dml_test::random_vector(3 * 12 * 16, 2)) + attention ==
        nn::forward_flops(block, tokens));

  const nn::gpt_head head(g);
  CHECK(nn::forward_flops(head, tokens) == 2.0 * 36 * 16 * 40);
  CHECK(forward_traced(head, tokens, dml_test::random_vector(3 * 12 * 16, 3)) == nn::forward_flops(head, tokens));

  // Dropless (capacity factor 0): every token runs its top-k experts, so the traced products are exactly the count.
  const nn::moe moe(
      nn::moe_config{.dim = 16, .hidden = 32, .experts = 4, .top_k = 2, .capacity_factor = 0.f, .logit_bias = {}});
  const dml::shape moe_rows{20, 16};
  CHECK(nn::forward_flops(moe, moe_rows) == 20.0 * 16 * (2 * 4 + 4 * 2 * 32));
  CHECK(forward_traced(moe, moe_rows, dml_test::random_vector(20 * 16, 4)) == nn::forward_flops(moe, moe_rows));

  // The GPT block with experts counts its attention and its experts.
  auto ge = g;
  ge.experts = 4;
  ge.capacity_factor = 0.f;
  const nn::gpt_block moe_block(ge, true);
  CHECK(forward_traced(moe_block, tokens, dml_test::random_vector(3 * 12 * 16, 5)) + attention ==
        nn::forward_flops(moe_block, tokens));
}

TEST_CASE("forward_flops: a layer without products counts one per output element; each_layer_flops adds the backward") {
  const nn::relu r;
  CHECK(nn::forward_flops(r, dml::shape{5, 8}) == 40);
  // linear 8→4, relu, linear 4→3 on 5 rows: the first layer has no input gradient, the relu no weight gradient.
  const auto model = nn::sequential{nn::linear{8, 4}, nn::relu{}, nn::linear{4, 3}};
  const auto f = parallel::each_layer_flops(model, 5);
  REQUIRE(f.size() == 3);
  CHECK(f[0].forward == 2.0 * 5 * 8 * 4);
  CHECK(f[0].input_gradient == 0);
  CHECK(f[0].weight_gradient == f[0].forward);
  CHECK(f[1].forward == 20);
  CHECK(f[1].input_gradient == 20);
  CHECK(f[1].weight_gradient == 0);
  CHECK(f[2].forward == 2.0 * 5 * 4 * 3);
  CHECK(f[2].input_gradient == f[2].forward);
  CHECK(f[2].weight_gradient == f[2].forward);
  CHECK(parallel::layer_training_flops(model, 5) == std::vector<double>{f[0].total(), f[1].total(), f[2].total()});
}

TEST_CASE("stage cuts balance predicted time, not parameters: a large vocabulary's lookup is cheap, its head is not") {
  // 6 blocks of ~320 kFLOP per token (training) and a head of 1.57 MFLOP per token: the head weighs about 5 blocks,
  // and the embedding's 262,144-value table almost nothing. Balanced by time the first stage takes the embedding and 5
  // blocks (1.6 M), the second a block and the head (1.89 M); by parameters (the embedding has 5x a block's) the first
  // stage would have taken only 2 blocks.
  const nn::gpt_config g{.vocab = 4096, .seq = 32, .layers = 6, .d_model = 64, .heads = 4};
  const auto model = nn::gpt(g);
  const auto rank0 = cost::stage_chunks(model, 2, 1, 0), rank1 = cost::stage_chunks(model, 2, 1, 1);
  REQUIRE(rank0.size() == 1);
  CHECK(rank0[0].first == 0);
  CHECK(rank0[0].end == 6);  // embedding + blocks 0-4
  CHECK(rank1[0].first == 6);
  CHECK(rank1[0].end == 8);  // block 5 + head

  // The 784-1024x3-10 MLP: the first linear layer computes no input gradient, so it weighs 2/3 of the next; the
  // cut leaves the first two layers on stage 0 (60% of the FLOPs).
  const auto mlp = nn::sequential{nn::linear{784, 1024}, nn::relu{}, nn::linear{1024, 1024}, nn::relu{},
                                  nn::linear{1024, 1024}, nn::relu{}, nn::linear{1024, 10}};
  CHECK(cost::stage_chunks(mlp, 2, 1, 1)[0].first == 4);
}

TEST_CASE("dml::cost prices a pipeline at its busiest rank, as the trainer cuts the GPT's layers") {
  // For each model and layout: the busiest pipeline rank's share of the training FLOPs under the trainer's own cut
  // (parallel::stage_chunks over parallel::layer_training_flops) equals cost::busiest_stage_share.
  struct shape_case {
    std::int64_t vocab, layers, d_model, heads, seq, experts;
    int pp;
    const char* schedule;
  };
  const shape_case cases[] = {
      {4096, 6, 64, 4, 32, 0, 2, "1f1b"},    {256, 6, 64, 4, 32, 0, 2, "1f1b"},   {50304, 8, 64, 4, 64, 0, 4, "zb"},
      {256, 8, 64, 4, 32, 0, 2, "interleaved:2"}, {1024, 4, 32, 2, 16, 4, 2, "1f1b"}, {512, 12, 32, 2, 64, 0, 3, "gpipe"},
  };
  for (const auto& s : cases) {
    CAPTURE(s.vocab);
    CAPTURE(s.layers);
    CAPTURE(s.pp);
    CAPTURE(s.schedule);
    nn::gpt_config g{.vocab = s.vocab, .seq = s.seq, .layers = s.layers, .d_model = s.d_model, .heads = s.heads};
    g.experts = s.experts;
    const auto model = nn::gpt(g);
    const cost::model m{.layers = s.layers, .d_model = s.d_model, .heads = s.heads, .seq = s.seq, .vocab = s.vocab,
                        .experts = s.experts};
    cost::layout l{.pp = s.pp, .schedule = s.schedule};
    const int v = std::max(1, cost::interleaved_chunks(s.schedule));
    const auto flops = parallel::layer_training_flops(model, 64);
    double total = 0, busiest = 0;
    for (double f : flops) total += f;
    for (int r = 0; r < s.pp; ++r) {
      double mine = 0;
      for (const auto& c : cost::stage_chunks(model, s.pp, v, r))
        for (std::size_t i = c.first; i < c.end; ++i) mine += flops[i];
      busiest = std::max(busiest, mine);
    }
    CHECK(cost::busiest_stage_share(m, l) == doctest::Approx(busiest / total).epsilon(1e-6));
    CHECK(busiest / total >= 1.0 / s.pp);
  }
}

TEST_CASE("a sequential as a pipeline: each rank's costs from its layers' FLOPs, simulated through the schedule") {
  const auto mlp = nn::sequential{nn::linear{784, 1024}, nn::relu{}, nn::linear{1024, 1024}, nn::relu{},
                                  nn::linear{1024, 1024}, nn::relu{}, nn::linear{1024, 10}};
  cost::cluster flat;
  flat.flops_fp32 = 1e9;
  // Stage 0 holds linear 784→1024, relu, linear 1024→1024, relu (the cut above); 32 rows.
  const auto c = cost::pipeline_rank_costs(mlp, 2, 1, 32, flat);
  REQUIRE(c.size() == 2);
  const double l0 = 2.0 * 32 * 784 * 1024, l1 = 2.0 * 32 * 1024 * 1024, r = 32.0 * 1024, l3 = 2.0 * 32 * 1024 * 10;
  CHECK(c[0].forward == doctest::Approx((l0 + r + l1 + r) / 1e9));
  CHECK(c[0].backward_input == doctest::Approx((r + l1 + r) / 1e9));  // the first layer: no input gradient
  CHECK(c[0].backward_weight == doctest::Approx((l0 + l1) / 1e9));
  CHECK(c[0].backward == doctest::Approx(c[0].backward_input + c[0].backward_weight));
  CHECK(c[1].forward == doctest::Approx((l1 + r + l3) / 1e9));
  CHECK(c[1].backward_weight == doctest::Approx((l1 + l3) / 1e9));

  // Each rank's update: its parameters (weights and biases), 28 bytes each under AdamW, at memory bandwidth.
  const auto update = cost::pipeline_update_seconds(mlp, 2, 1, flat);
  REQUIRE(update.size() == 2);
  CHECK(update[0] == doctest::Approx((785.0 * 1024 + 1025.0 * 1024) * 28 / flat.memory_bandwidth));
  CHECK(update[1] == doctest::Approx((1025.0 * 1024 + 1025.0 * 10) * 28 / flat.memory_bandwidth));
  CHECK(cost::pipeline_update_seconds(mlp, 2, 1, flat, "sgd")[1] == doctest::Approx(update[1] * 20 / 28));

  // One micro-batch leaves nothing to overlap: the step is every FLOP at the rate, then the first stage's update
  // (the last stage's runs while the first computes its backward).
  const auto one = cost::simulate_pipeline(mlp, 2, "1f1b", 1, 32, flat);
  CHECK(one.makespan == doctest::Approx(c[0].forward + c[0].backward + c[1].forward + c[1].backward + update[0]));
  CHECK(one.busy[1] == doctest::Approx(c[1].forward + c[1].backward + update[1]));
  CHECK_THROWS_WITH_AS(cost::simulate_pipeline(mlp, 2, "1f1b", 3, 32, flat),
                       "dml::cost::simulate_pipeline: expected a micro-batch count that divides the 32 rows, found 3",
                       invalid_argument);

  // Products at full speed at every size: more micro-batches only shrink the bubble, and zb's is the smallest, until
  // the first stage never idles: its work at 256 rows (8 times 32) and its update. Of the pipelines that reach that,
  // the pick has the fewest micro-batches.
  const auto flat_picks = cost::rank_pipelines(mlp, 2, 256, flat);
  const auto& flat_pick = flat_picks.front();
  const double bound = 8 * (c[0].forward + c[0].backward) + update[0];
  CHECK(flat_pick.schedule == "zb");
  CHECK(flat_pick.step_seconds == doctest::Approx(bound).epsilon(1e-3));
  for (const auto& p : flat_picks) {
    CHECK(p.step_seconds >= bound * (1 - 1e-9));
    if (p.step_seconds <= bound * 1.001) CHECK(p.micro_batches >= flat_pick.micro_batches);
  }
  CHECK(cost::simulate_pipeline(mlp, 2, "zb", 1, 256, flat).makespan > bound * 1.1);
  // Products of 32 rows at a third of 256 rows' speed (and 128 at 90%): few large micro-batches win.
  cost::cluster steep = flat;
  steep.gemm_rows = {{32, 0.33}, {64, 0.6}, {128, 0.9}, {256, 1.0}};
  const auto picks = cost::rank_pipelines(mlp, 2, 256, steep);
  CHECK(picks.front().micro_batches <= 4);
  CHECK(picks.front().micro_batches >= 2);
  CHECK(picks[0].step_seconds <= picks[1].step_seconds * 1.001);
  for (std::size_t i = 2; i < picks.size(); ++i) CHECK(picks[i - 1].step_seconds <= picks[i].step_seconds);
  // The stages are unequal (60/40), so even the best pipeline idles: its bubble is above zb's equal-stage one.
  CHECK(flat_pick.bubble > 1.0 / (3 * 64 + 1));

  // Two micro-batches: the first stage's wait for its first input gradient is the last stage's forward and input
  // pass of micro-batch 0 less its own forward of micro-batch 1. A smaller first micro-batch shortens the one and
  // lengthens the other, and the planner's split is faster than the even one.
  const auto even = cost::simulate_pipeline(mlp, 2, "zb", 2, 256, flat).makespan;
  const auto two = std::ranges::find_if(picks, [](const auto& p) { return p.schedule == "zb" && p.micro_batches == 2; });
  for (const auto& rates : {flat, steep}) {
    const auto all = cost::rank_pipelines(mlp, 2, 256, rates);
    const auto best = *std::ranges::find_if(all, [](const auto& p) { return p.schedule == "zb" && p.micro_batches == 2; });
    REQUIRE(best.micro_rows.size() == 2);
    CHECK(best.micro_rows[0] < 128);
    CHECK(best.micro_rows[0] + best.micro_rows[1] == 256);
    const auto t = schedule::make("zb", 2, 2);
    CHECK(best.step_seconds == doctest::Approx(cost::simulate_pipeline(mlp, 2, t, best.micro_rows, rates).makespan));
    CHECK(best.step_seconds < cost::simulate_pipeline(mlp, 2, "zb", 2, 256, rates).makespan);
  }
  REQUIRE(two != picks.end());
  CHECK(cost::simulate_pipeline(mlp, 2, schedule::make("zb", 2, 2), std::vector<std::int64_t>{128, 128}, flat).makespan ==
        doctest::Approx(even));
  // Flat rates, 112/144 rows: micro-batch 1 costs 144/112 of micro-batch 0, which is priced at 112 rows.
  const auto c112 = cost::pipeline_rank_costs(mlp, 2, 1, 112, flat);
  const std::vector<double> scale{1.0, 144.0 / 112};
  auto by_hand = schedule::simulate(schedule::make("zb", 2, 2), c112, scale);
  const auto u = cost::pipeline_update_seconds(mlp, 2, 1, flat);
  double last = 0;
  for (std::size_t r = 0; r < 2; ++r) last = std::max(last, *std::max_element(by_hand.end[r].begin(), by_hand.end[r].end()) + u[r]);
  CHECK(cost::simulate_pipeline(mlp, 2, schedule::make("zb", 2, 2), std::vector<std::int64_t>{112, 144}, flat).makespan ==
        doctest::Approx(last));
  CHECK_THROWS_WITH_AS(cost::simulate_pipeline(mlp, 2, schedule::make("zb", 2, 2), std::vector<std::int64_t>{0, 256}, flat),
                       "dml::cost::simulate_pipeline: expected 2 micro-batches of at least 1 row, found 2", invalid_argument);
}

TEST_CASE("the element-wise probe times a one-layer GPT's passes and loss beside their products") {
  // A small GPT's forward, loss and backward less their traced GEMMs: some time, so a finite, positive rate.
  const double rate = cost::elementwise_bandwidth_of(32, 2, 16, 1, 64);
  CHECK(std::isfinite(rate));
  CHECK(rate > 0);
  const auto p = cost::probe_gpt(32, 2, 16, 1, 64);
  CHECK(std::isfinite(p.block_seconds));
  CHECK(p.block_seconds >= 0);
  CHECK(p.block_seconds < 0.1);  // a block of 32 wide over 512 tokens: microseconds, not a tenth of a second
  // The model's own products at 128, 512 and 1,024 tokens, over their rate at 512.
  REQUIRE(p.gemm_rows.size() == 3);
  CHECK(p.gemm_rows[0].first == 128);
  CHECK(p.gemm_rows[1] == std::pair{512.0, 1.0});
  CHECK(p.gemm_rows[2].first == 1024);
  for (const auto& [rows, share] : p.gemm_rows) CHECK((std::isfinite(share) && share > 0));
  CHECK_THROWS_WITH_AS(cost::probe_gpt(32, 2, 16, 1, 0), doctest::Contains("found 32, 2, 16 and 0"), invalid_argument);
}

TEST_CASE("a GPT's GEMM share: the model's own points, one shape's below them scaled to meet the first, none above") {
  const std::vector<std::pair<double, double>> single{{32, 0.5}, {64, 0.8}, {128, 1.0}, {512, 1.0}, {1024, 1.4}};
  const std::vector<std::pair<double, double>> model{{128, 0.9}, {512, 1.0}, {1024, 1.05}};
  const auto rows = cost::gpt_gemm_rows(single, model);
  REQUIRE(rows.size() == 5);
  CHECK(rows[0].first == 32);
  CHECK(rows[0].second == doctest::Approx(0.45));  // 0.5 × 0.9 / 1.0
  CHECK(rows[1].second == doctest::Approx(0.72));
  CHECK(rows[2] == model[0]);
  CHECK(rows[4] == model[2]);  // one shape's 1.4 at 1,024 rows is not the model's
  const cost::cluster c{.gemm_rows = rows};
  CHECK(c.gemm_share(2048) == doctest::Approx(1.05));  // held
  CHECK(c.gemm_share(16) == doctest::Approx(0.45));
  // Between one shape's points, scaled: 96 rows of one shape's 0.8 to 1.0 in log(rows), times 0.9.
  CHECK(c.gemm_share(96) == doctest::Approx(0.9 * cost::cluster{.gemm_rows = single}.gemm_share(96)));
  CHECK(cost::gpt_gemm_rows(single, {}) == single);
}

TEST_CASE("the passes' fit: each block's fixed seconds and the rate of their bytes, from runs of 1 and 2 blocks") {
  // Runs made of a known cost: 80 µs a block and 10 GB/s, over 1 and 2 blocks at a quarter of the tokens and all.
  const auto seconds = [](double blocks, double bytes) { return blocks * 80e-6 + bytes / 10e9; };
  std::vector<cost::pass_time> runs;
  for (const double blocks : {1.0, 2.0})
    for (const double bytes : {4e6 * blocks + 1e6, 1e6 * blocks + 0.25e6}) runs.push_back({blocks, bytes, seconds(blocks, bytes)});
  const auto [fixed, rate] = cost::fit_passes(runs);
  CHECK(fixed == doctest::Approx(80e-6).epsilon(1e-9));
  CHECK(rate == doctest::Approx(10e9).epsilon(1e-9));
  // Runs of bytes alone: no fixed cost, the rate.
  for (auto& r : runs) r.seconds = r.bytes / 4e9;
  const auto [none, bytes_only] = cost::fit_passes(runs);
  CHECK(none == doctest::Approx(0).scale(1e-6));
  CHECK(bytes_only == doctest::Approx(4e9).epsilon(1e-9));
  // Runs that fall as blocks are added at the same bytes (no cost a block can have): 0, and the rate of their bytes.
  const std::vector<cost::pass_time> odd{{1, 1e6, 2e-4}, {2, 1e6, 1e-4}, {1, 2e6, 3e-4}, {2, 2e6, 2e-4}};
  const auto [zero, rate_of_bytes] = cost::fit_passes(odd);
  CHECK(zero == 0);
  CHECK(rate_of_bytes > 0);
  CHECK_THROWS_WITH_AS(cost::fit_passes({}), "dml::cost::fit_passes: expected at least one run, found none", invalid_argument);
  CHECK_THROWS_WITH_AS(cost::fit_passes({{1, 1e6, 0}}), doctest::Contains("found 0 s, 1e+06 bytes and 1 blocks"), invalid_argument);
}

TEST_CASE("the bf16 probe and the precision probe: each precision timed, the faster named, the thread budget kept") {
  // probe_gpt in bf16: its products on this host's path (native or widened) and its passes over 16-bit values.
  const auto half = cost::probe_gpt(32, 2, 16, 1, 64, cost::precision::bf16);
  CHECK(std::isfinite(half.gemm_flops));
  CHECK(half.gemm_flops > 0);
  CHECK(half.elementwise_bandwidth > 0);
  CHECK_THROWS_WITH_AS(cost::probe_gpt(32, 2, 16, 1, 64, cost::precision::fp16), doctest::Contains("found fp16"),
                       invalid_argument);
  // A sequential's forward and backward in fp32 and bf16: both timed, the faster one picked, the caller's thread
  // budget as it was (the probe runs on 1 thread here).
  const auto mlp = nn::sequential{nn::linear{64, 96}, nn::relu{}, nn::linear{96, 10}};
  const int budget = dml::thread_budget();
  const auto p = cost::probe_precisions(mlp, 32, 1);
  CHECK(dml::thread_budget() == budget);
  CHECK(std::isfinite(p.fp32_seconds));
  CHECK(std::isfinite(p.bf16_seconds));
  CHECK(p.fp32_seconds > 0);
  CHECK(p.bf16_seconds > 0);
  CHECK(p.faster == (p.bf16_seconds < p.fp32_seconds ? cost::precision::bf16 : cost::precision::fp32));
  CHECK_THROWS_WITH_AS(cost::probe_precisions(mlp, 0), "dml::cost::probe_precisions: expected rows >= 1, found 0",
                       invalid_argument);
}

}  // namespace test_flops
