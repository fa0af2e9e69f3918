// SPDX-License-Identifier: Apache-2.0
// tests/train/test_tensor.cpp — a GPT under tensor (and sequence) parallelism, alone and with pipeline stages and
// data-parallel ranks: every layout of at most 8 ranks against one rank's losses and parameters, with dropout on;
// the collectives each pass makes; activation memory under sequence parallelism; errors.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "support.hpp"
#include "gpt_fixture.hpp"

namespace test_tensor {

namespace {

using namespace gpt_fixture;

// Trains on l.size() local ranks; rank 0's record.
template <class... P>
result run_layout(const layout& l, const nn::gpt_config& g, int n_steps = steps, std::int64_t micro = 0,
                  const checkpoints& ck = {}) {
  result out;
  comm::local::run(l.size(), [&](comm::local& c) {
    auto r = train_gpt<P...>(c, l, g, n_steps, micro, ck);
    if (c.rank() == 0) out = std::move(r);
  });
  return out;
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
  // Exactly: what a layer saves is a function of the shapes alone (the attention keeps a float per row, no T × T).
  CHECK(one.peak_activation_bytes == 582'656);
  CHECK(tp.peak_activation_bytes == 375'808);
  CHECK(sp2.peak_activation_bytes == 307'712);
}

TEST_CASE("tensor-parallel layouts that do not divide say so") {
  const auto model = nn::gpt(config());
  auto build = [](int ranks, const auto& m, int tp) {
    train::trainer_options o;
    o.tensor_parallel = tp;
    comm::local::run(ranks, [&](comm::local& c) { trainer<parallel::replicate, optim::adamw> t(c, m, o); });
  };
  CHECK_THROWS_WITH_AS(build(4, model, 3), doctest::Contains("tensor_parallel × pipeline_stages to divide"),
                       invalid_argument);
  auto g = config();
  g.heads = 2;
  const auto two_heads = nn::gpt(g);
  CHECK_THROWS_WITH_AS(build(4, two_heads, 4), doctest::Contains("needs the heads divisible by 4, found 2"),
                       invalid_argument);
  g = config();
  g.vocab = 30;
  const auto odd_vocab = nn::gpt(g);
  CHECK_THROWS_WITH_AS(build(4, odd_vocab, 4), doctest::Contains("the vocabulary divisible by 4, found 30"),
                       invalid_argument);
}

TEST_CASE("checkpoints written by any dp × tp × pp layout resume in any other") {
  const auto whole = run_layout<parallel::replicate, optim::adamw>({}, config(), 12);
  const layout layouts[] = {{}, {.tp = 2}, {.tp = 2, .pp = 2, .sp = true}, {.tp = 4, .dp = 2}, {.tp = 2, .dp = 2}};
  for (const auto& from : layouts)
    for (const auto& to : layouts) {
      if (from.size() == 1 && to.size() == 1) continue;
      if (from.tp == to.tp && from.pp == to.pp && from.dp == to.dp) continue;
      dml_test::temp_dir dir;
      checkpoints save, load;
      save.save = load.load = dir.path.string();
      run_layout<parallel::replicate, optim::adamw>(from, config(), 6, 0, save);
      auto resumed = run_layout<parallel::replicate, optim::adamw>(to, config(), 6, 0, load);
      CAPTURE(from.name());
      CAPTURE(to.name());
      resumed.losses.insert(resumed.losses.begin(), whole.losses.begin(), whole.losses.begin() + 6);
      resumed.grad_norms.insert(resumed.grad_norms.begin(), whole.grad_norms.begin(), whole.grad_norms.begin() + 6);
      check_same(whole, resumed, from.name() + " -> " + to.name());
    }
}

TEST_CASE("a tied LM head and token embedding stay one parameter in every layout") {
  auto g = config();
  g.tie_weights = true;
  const auto one = run_layout<parallel::replicate, optim::adamw>({}, g);
  // The two copies start equal and take the same updates.
  const auto model = nn::gpt(g);
  const auto whole = nn::make_layout(model);
  std::int64_t wte = 0, head = 0, at = 0;
  for (const auto& s : whole.slots) {
    if (s.name == "wte.weight") wte = at;
    if (s.name == "lm_head.weight") head = at;
    at += s.shape.numel();
  }
  const std::int64_t n = g.vocab * g.d_model;
  double apart = 0;
  for (std::int64_t i = 0; i < n; ++i) apart = std::max(apart, double(std::abs(one.params[wte + i] - one.params[head + i])));
  CHECK(apart == 0.0);
  // Tying changes training: an untied model learns differently.
  const auto untied = run_layout<parallel::replicate, optim::adamw>({}, config(), 3);
  CHECK(std::abs(untied.losses[2] - one.losses[2]) > 1e-4);
  for (const layout& l : {layout{.tp = 2}, layout{.pp = 2}, layout{.tp = 2, .pp = 2, .dp = 2, .sp = true}})
    check_same(one, run_layout<parallel::replicate, optim::adamw>(l, g), "tied, " + l.name());
  // Sharded gradients: each copy is a run of its own, so a rank owns the same elements of both and sums them.
  check_same(one, run_layout<parallel::zero<1>, optim::adamw>(layout{.dp = 2}, g), "tied, zero1 dp 2");
  check_same(one, run_layout<parallel::zero<2>, optim::adamw>(layout{.pp = 2, .dp = 2}, g), "tied, zero2 pp 2 dp 2");
  check_same(one, run_layout<parallel::zero<3>, optim::adamw>(layout{.tp = 2, .dp = 2}, g), "tied, zero3 tp 2 dp 2");
}

}  // namespace test_tensor
