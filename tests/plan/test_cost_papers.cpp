// SPDX-License-Identifier: Apache-2.0
// tests/plan/test_cost_papers.cpp — dml::cost reproduces the papers' tables: ZeRO's Figure 1 (model states per
// device, Ψ = 7.5B, Nd = 64, K = 12), Korthikanti et al.'s per-layer activation bytes for their GPT
// configurations, and Narayanan et al.'s FLOPs and parameter counts for their Table 1.
#include <doctest/doctest.h>

#include <cmath>

#include "dml/plan/cost.hpp"

namespace test_cost_papers {

using namespace dml;

namespace {
double rel(double got, double want) { return std::abs(got - want) / std::abs(want); }
}  // namespace

TEST_CASE("ZeRO Figure 1: 120, 31.4, 16.6 and 1.9 GB per device for 7.5B parameters on 64 devices") {
  const double psi = 7.5e9, gb = 1e9;
  // The formulas, and the paper's rounding to one decimal.
  const double want[] = {120.0, 31.4, 16.6, 1.9};
  for (int stage = 0; stage < 4; ++stage) {
    CAPTURE(stage);
    CHECK(std::round(cost::zero_model_state_bytes(psi, 12, 64, stage) / gb * 10) / 10 == doctest::Approx(want[stage]));
  }
  // The same through evaluate(): a model known by its parameter count, bf16 with AdamW (2 + 2 bytes of working
  // parameter and gradient; 8 of moments and 4 of float master weights: K = 12), 64 data-parallel ranks.
  cost::model m{.params_only = psi};
  cost::training t{.global_batch = 64, .prec = cost::precision::bf16, .optimizer = "adamw"};
  for (int stage = 0; stage < 4; ++stage) {
    const auto e = cost::evaluate(m, {.dp = 64, .zero = stage}, t, cost::cluster{.memory_bytes = 1e12}, 64);
    CAPTURE(stage);
    CAPTURE(e.why);
    REQUIRE(e.why.empty());
    CHECK(e.per_rank.total() == cost::zero_model_state_bytes(psi, 12, 64, stage));
    CHECK(std::round(e.per_rank.total() / gb * 10) / 10 == doctest::Approx(want[stage]));
  }
  // Table 1's first row (7.5B, Nd = 1024 under P_os+g+p): 0.12 GB.
  CHECK(cost::zero_model_state_bytes(psi, 12, 1024, 3) / gb == doctest::Approx(0.1171875));
}

// Korthikanti et al. §4: the activations of one layer, tensor by tensor (16-bit values, 1-byte dropout masks).
double layer_reference(double s, double b, double h, double a) {
  const double attention = 2 * s * b * h            // QKV input
                         + 4 * s * b * h            // Q, K
                         + 2 * a * s * s * b        // softmax output
                         + a * s * s * b            // softmax dropout mask
                         + 2 * a * s * s * b        // dropout output (attention over V)
                         + 2 * s * b * h            // V
                         + 2 * s * b * h            // output projection input
                         + s * b * h;               // attention dropout mask
  const double mlp = 2 * s * b * h + 8 * s * b * h + 8 * s * b * h + s * b * h;  // input, GeLU in, GeLU out, mask
  const double norms = 4 * s * b * h;
  return attention + mlp + norms;
}

TEST_CASE("Korthikanti et al. Table 2: per-layer activation bytes with tensor, sequence parallelism and recompute") {
  struct config {
    const char* name;
    double a, h, l, t, s, b;
  };
  // Their Table 3: 22B, 175B (GPT-3), 530B (MT-NLG) and 1T, sequence 2048, tensor-parallel size 8.
  const config configs[] = {{"22B", 64, 6144, 48, 8, 2048, 4},
                            {"175B", 96, 12288, 96, 8, 2048, 1},
                            {"530B", 128, 20480, 105, 8, 2048, 1},
                            {"1T", 160, 25600, 128, 8, 2048, 1}};
  using cost::recompute;
  for (const auto& c : configs) {
    CAPTURE(c.name);
    const double sbh = c.s * c.b * c.h;
    // No parallelism: sbh(34 + 5as/h), and the tensor-by-tensor sum gives the same.
    CHECK(cost::korthikanti_layer_bytes(c.s, c.b, c.h, c.a, 1, false, recompute::none) == doctest::Approx(layer_reference(c.s, c.b, c.h, c.a)));
    CHECK(cost::korthikanti_layer_bytes(c.s, c.b, c.h, c.a, 1, false, recompute::none) == doctest::Approx(sbh * (34 + 5 * c.a * c.s / c.h)));
    // Tensor parallel: sbh(10 + 24/t + 5as/(ht)); with sequence parallel: sbh/t (34 + 5as/h).
    CHECK(cost::korthikanti_layer_bytes(c.s, c.b, c.h, c.a, c.t, false, recompute::none) ==
          doctest::Approx(sbh * (10 + 24 / c.t + 5 * c.a * c.s / (c.h * c.t))));
    CHECK(cost::korthikanti_layer_bytes(c.s, c.b, c.h, c.a, c.t, true, recompute::none) ==
          doctest::Approx(sbh / c.t * (34 + 5 * c.a * c.s / c.h)));
    // Selective recompute with sequence parallelism: 34 sbh/t; full recompute: 2 sbh (the layer's input).
    CHECK(cost::korthikanti_layer_bytes(c.s, c.b, c.h, c.a, c.t, true, recompute::selective) == doctest::Approx(34 * sbh / c.t));
    CHECK(cost::korthikanti_layer_bytes(c.s, c.b, c.h, c.a, c.t, false, recompute::full) == doctest::Approx(2 * sbh));
  }
  // §5 / Figure 1's claim for the 175B model: sequence parallelism with selective recompute needs about 5x less
  // than tensor parallelism alone (10 + 24/8 + 10 = 23 against 34/8 = 4.25: 5.4x).
  const auto& g = configs[1];
  const double tp_only = cost::korthikanti_layer_bytes(g.s, g.b, g.h, g.a, g.t, false, recompute::none);
  const double both = cost::korthikanti_layer_bytes(g.s, g.b, g.h, g.a, g.t, true, recompute::selective);
  CHECK(tp_only / both == doctest::Approx(23 / 4.25));
}

TEST_CASE("Narayanan et al. Table 1: parameter counts, and FLOPs per iteration equal dml's GEMM count with full recompute") {
  struct row {
    double billions, a, h, l, batch;
  };
  // Their Table 1 (V = 51,200, s = 2048): parameters (billions), heads, hidden, layers, global batch.
  const row rows[] = {{1.7, 24, 2304, 24, 512},    {3.6, 32, 3072, 30, 512},    {7.5, 32, 4096, 36, 512},
                      {18.4, 48, 6144, 40, 1024},  {39.1, 64, 8192, 48, 1536},  {76.1, 80, 10240, 60, 1792},
                      {145.6, 96, 12288, 80, 2304}, {310.1, 128, 16384, 96, 2160}, {529.6, 128, 20480, 105, 2520},
                      {1008.0, 160, 25600, 128, 3072}};
  const double V = 51200, s = 2048;
  for (const auto& r : rows) {
    CAPTURE(r.billions);
    CHECK(std::round(cost::megatron_params(r.l, r.h, V, s) / 1e8) / 10 == doctest::Approx(r.billions));
    // dml's GPT with biases and a tied head holds 12lh² + 13lh + (V + s)h + 2h: the paper's count and the final
    // LayerNorm's 2h, which it leaves out.
    cost::model m{.layers = static_cast<std::int64_t>(r.l), .d_model = static_cast<std::int64_t>(r.h),
                  .heads = static_cast<std::int64_t>(r.a), .seq = 2048, .vocab = 51200, .bias = true, .tie = true};
    CHECK(rel(cost::count_gpt(m).total(m), cost::megatron_params(r.l, r.h, V, s) + 2 * r.h) < 1e-12);
    // Model FLOPs counted GEMM by GEMM (forward 24Bsh² + 4Bs²h per layer and 2BshV for the logits, backward twice
    // that), plus one forward of the blocks under full recompute, equal eq. (3); without it, 72Bslh²(1 + s/6h) + 6BshV.
    cost::training t{.global_batch = static_cast<std::int64_t>(r.batch)};
    const auto e = cost::evaluate(m, {.dp = 1, .recomp = cost::recompute::full}, t, cost::cluster{.memory_bytes = 1e18});
    CAPTURE(e.why);
    REQUIRE(e.why.empty());
    CHECK(rel(e.hardware_flops_per_step, cost::megatron_flops(r.batch, s, r.l, r.h, V)) < 1e-12);
    CHECK(rel(e.flops_per_step, 72 * r.batch * s * r.l * r.h * r.h * (1 + s / (6 * r.h)) + 6 * r.batch * s * r.h * V) < 1e-12);
  }
}

}  // namespace test_cost_papers
