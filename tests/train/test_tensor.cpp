// SPDX-License-Identifier: Apache-2.0
// tests/train/test_tensor.cpp — a GPT under tensor (and sequence) parallelism, alone and with pipeline stages and
// data-parallel ranks: every layout of at most 8 ranks against one rank's losses and parameters, with dropout on;
// the collectives each pass makes; activation memory under sequence parallelism; errors.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "dml/dml.hpp"
#include "dml/nn/gpt.hpp"
#include "dml/train/text.hpp"

namespace {

using namespace dml;

constexpr std::int64_t batch = 8, seq = 16;
constexpr int steps = 20;

nn::gpt_config config(std::int64_t layers = 2, float dropout = 0.1f) {
  return {.vocab = 32, .seq = seq, .layers = layers, .d_model = 32, .heads = 4, .dropout = dropout};
}
const train::text_corpus& corpus() {
  static const train::text_corpus text = [] {
    std::vector<std::uint8_t> bytes(4096);
    const rng_stream rng{3, 1};
    // Some structure to learn: each byte depends on the one before it.
    std::uint8_t prev = 0;
    for (std::size_t i = 0; i < bytes.size(); ++i)
      prev = bytes[i] = static_cast<std::uint8_t>((prev * 5 + (rng.uniform(i) < 0.3f ? 7 : 1)) % 32);
    return train::text_corpus(bytes);
  }();
  return text;
}

struct layout {
  int tp = 1, pp = 1, dp = 1;
  bool sp = false;
  std::string name() const {
    return "tp " + std::to_string(tp) + " pp " + std::to_string(pp) + " dp " + std::to_string(dp) + (sp ? " sp" : "");
  }
};

struct result {
  std::vector<float> losses;
  std::vector<float> params;  // the whole model, padding stripped
  std::int64_t peak_activation_bytes = 0;
  std::int64_t forward_calls = 0, backward_calls = 0;
  std::array<std::int64_t, 4> forward_ops{}, backward_ops{};
};

template <class... P>
result run_layout(const layout& l, const nn::gpt_config& g, int n_steps = steps, std::int64_t micro = 0) {
  result out;
  const auto model = nn::gpt(g);
  comm::local::run(l.tp * l.pp * l.dp, [&](comm::local& c) {
    train::trainer_options o;
    o.seed = 9;
    o.pipeline_stages = l.pp;
    o.tensor_parallel = l.tp;
    o.sequence_parallel = l.sp;
    o.micro_batches = micro > 0 ? micro : (l.pp > 1 ? 2 : 1);
    trainer<P...> t(c, model, o, optim::adamw({.lr = 3e-3f}));
    const int dp_rank = c.rank() / l.tp % l.dp;
    const std::int64_t first = batch * dp_rank / l.dp, rows = batch * (dp_rank + 1) / l.dp - first;
    std::vector<float> x(static_cast<std::size_t>(rows * seq));
    std::vector<std::int32_t> y(x.size());
    std::vector<float> losses;
    for (int s = 1; s <= n_steps; ++s) {
      corpus().batch(4, static_cast<std::uint64_t>(s), first, rows, seq, x.data(), y.data());
      losses.push_back(t.step(tensor_view<const float>(x.data(), {rows, seq}), y.data(), batch).loss);
    }
    auto params = t.full_parameters();
    if (c.rank() != 0) return;
    out.losses = losses;
    for (const auto& slot : t.layout().slots)
      out.params.insert(out.params.end(), params.begin() + slot.offset, params.begin() + slot.offset + slot.shape.numel());
    out.peak_activation_bytes = t.peak_activation_bytes();
    if (const auto* g = t.tensor_parallel_group()) {
      out.forward_calls = g->calls(nn::pass::forward);
      out.backward_calls = g->calls(nn::pass::backward);
      for (int op = 0; op < 4; ++op) {
        out.forward_ops[op] = g->calls(nn::pass::forward, static_cast<nn::group_op>(op));
        out.backward_ops[op] = g->calls(nn::pass::backward, static_cast<nn::group_op>(op));
      }
    }
  });
  return out;
}

void check_same(const result& ref, const result& got, const std::string& what) {
  REQUIRE(ref.losses.size() == got.losses.size());
  REQUIRE(ref.params.size() == got.params.size());
  double worst = 0, worst_w = 0;
  for (std::size_t i = 0; i < ref.losses.size(); ++i)
    worst = std::max(worst, std::abs(double(ref.losses[i]) - got.losses[i]) / std::abs(double(ref.losses[i])));
  for (std::size_t i = 0; i < ref.params.size(); ++i)
    worst_w = std::max(worst_w, double(std::abs(ref.params[i] - got.params[i])));
  MESSAGE(what << ": max_rel_loss_diff=" << worst << " max_abs_param_diff=" << worst_w);
  CHECK(worst <= 1e-5);
  CHECK(worst_w <= 1e-5);
}

}  // namespace

TEST_CASE("every dp × tp × pp layout of at most 8 ranks, with and without sequence parallelism, gives one rank's losses") {
  const auto one = run_layout<parallel::replicate, optim::adamw>({}, config());
  REQUIRE(one.losses.size() == steps);
  CHECK(one.losses.back() < one.losses.front() - 0.3f);  // it learns
  // Dropout is on and matters: without it the losses differ.
  const auto plain = run_layout<parallel::replicate, optim::adamw>({}, config(2, 0.f), 2);
  CHECK(std::abs(plain.losses[1] - one.losses[1]) > 1e-4);
  int layouts = 0;
  for (int tp : {1, 2, 4})
    for (int pp : {1, 2})
      for (int dp : {1, 2})
        for (bool sp : {false, true}) {
          if (tp * pp * dp > 8 || (sp && tp == 1) || tp * pp * dp == 1) continue;
          const layout l{tp, pp, dp, sp};
          check_same(one, run_layout<parallel::replicate, optim::adamw>(l, config()), l.name());
          ++layouts;
        }
  CHECK(layouts == 17);
}

TEST_CASE("zero<1> across data-parallel ranks composes with tensor and pipeline parallelism") {
  const auto one = run_layout<parallel::replicate, optim::adamw>({}, config());
  check_same(one, run_layout<parallel::zero<1>, optim::adamw>({.tp = 2, .pp = 2, .dp = 2, .sp = true}, config()), "zero<1> tp 2 pp 2 dp 2 sp");
}

TEST_CASE("each half-block makes one all-reduce in forward and one in backward") {
  const layout l{.tp = 2};
  const auto one_layer = run_layout<parallel::replicate, optim::adamw>(l, config(1), 1);
  const auto two_layers = run_layout<parallel::replicate, optim::adamw>(l, config(2), 1);
  const auto ar = static_cast<std::size_t>(nn::group_op::all_reduce);
  // 2 per layer in each pass, and nothing else grows with depth.
  CHECK(two_layers.forward_ops[ar] - one_layer.forward_ops[ar] == 2);
  CHECK(two_layers.backward_ops[ar] - one_layer.backward_ops[ar] == 2);
  CHECK(two_layers.forward_calls - one_layer.forward_calls == 2);
  CHECK(two_layers.backward_calls - one_layer.backward_calls == 2);
  // The rest: the embedding's sum (forward), the head's input gradient (backward), and the
  // vocabulary-parallel loss's max and sum (forward).
  CHECK(two_layers.forward_ops[ar] == 2 * 2 + 1 + 1);
  CHECK(two_layers.forward_ops[static_cast<std::size_t>(nn::group_op::all_reduce_max)] == 1);
  CHECK(two_layers.backward_ops[ar] == 2 * 2 + 1);
  CHECK(two_layers.forward_calls == 2 * 2 + 3);
  CHECK(two_layers.backward_calls == 2 * 2 + 1);
}

TEST_CASE("sequence parallelism: all-gathers and reduce-scatters replace the all-reduces, and activations shrink") {
  const auto tp = run_layout<parallel::replicate, optim::adamw>({.tp = 2}, config(2), 1);
  const auto sp1 = run_layout<parallel::replicate, optim::adamw>({.tp = 2, .sp = true}, config(1), 1);
  const auto sp2 = run_layout<parallel::replicate, optim::adamw>({.tp = 2, .sp = true}, config(2), 1);
  const auto ag = static_cast<std::size_t>(nn::group_op::all_gather), rs = static_cast<std::size_t>(nn::group_op::reduce_scatter),
             ar = static_cast<std::size_t>(nn::group_op::all_reduce);
  // Per layer, forward: all-gather before each column-parallel GEMM, reduce-scatter after each row-parallel one.
  CHECK(sp2.forward_ops[ag] - sp1.forward_ops[ag] == 2);
  CHECK(sp2.forward_ops[rs] - sp1.forward_ops[rs] == 2);
  CHECK(sp2.forward_ops[ar] - sp1.forward_ops[ar] == 0);
  // Backward: the gradient's all-gathers and reduce-scatters, the re-gathered LayerNorm outputs, and the
  // LayerNorm weights' partial gradients summed once.
  CHECK(sp2.backward_ops[ag] - sp1.backward_ops[ag] == 4);
  CHECK(sp2.backward_ops[rs] - sp1.backward_ops[rs] == 2);
  CHECK(sp2.backward_ops[ar] - sp1.backward_ops[ar] == 2);
  // Korthikanti et al.: LayerNorm, dropout and residual activations are split too.
  const auto one = run_layout<parallel::replicate, optim::adamw>({}, config(2), 1);
  MESSAGE("peak activation bytes per rank: tp 1 " << one.peak_activation_bytes << ", tp 2 " << tp.peak_activation_bytes
                                                   << ", tp 2 + sp " << sp2.peak_activation_bytes);
  CHECK(tp.peak_activation_bytes < one.peak_activation_bytes);
  CHECK(sp2.peak_activation_bytes < tp.peak_activation_bytes);
}

TEST_CASE("tensor-parallel layouts that do not divide say so") {
  const auto model = nn::gpt(config());
  auto build = [&](int ranks, train::trainer_options o) {
    comm::local::run(ranks, [&](comm::local& c) { trainer<parallel::replicate, optim::adamw> t(c, model, o); });
  };
  CHECK_THROWS_WITH_AS(build(4, {.tensor_parallel = 3}), doctest::Contains("tensor_parallel × pipeline_stages to divide"),
                       invalid_argument);
  auto g = config();
  g.heads = 2;
  const auto two_heads = nn::gpt(g);
  CHECK_THROWS_WITH_AS(comm::local::run(4, [&](comm::local& c) {
                         trainer<parallel::replicate, optim::adamw> t(c, two_heads, {.tensor_parallel = 4});
                       }),
                       doctest::Contains("needs the heads divisible by 4, found 2"), invalid_argument);
  g = config();
  g.vocab = 30;
  const auto odd_vocab = nn::gpt(g);
  CHECK_THROWS_WITH_AS(comm::local::run(4, [&](comm::local& c) {
                         trainer<parallel::replicate, optim::adamw> t(c, odd_vocab, {.tensor_parallel = 4});
                       }),
                       doctest::Contains("the vocabulary divisible by 4, found 30"), invalid_argument);
}
