// SPDX-License-Identifier: Apache-2.0
// tests/nn/test_gpt.cpp — the GPT layers: gradients against central finite differences, names, shapes, errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "dml/nn/gpt.hpp"
#include "dml/nn/gradcheck.hpp"
#include "dml/nn/loss.hpp"
#include "dml/nn/network.hpp"
#include "support.hpp"

namespace test_gpt {

namespace {

using namespace dml;

using dml_test::random_vector;
std::vector<float> random_ids(std::size_t n, int vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng() % static_cast<unsigned>(vocab));
  return v;
}

// loss = Σ y·r; analytic gradients of every parameter (sampled) and of the input against differences.
template <class... L>
nn::gradcheck_result gradcheck(nn::sequential<L...> model, shape xs, std::vector<float> x, bool check_input, float h,
                    nn::context c = {}) {
  nn::network<host, L...> net(model, 7);
  const shape ys = model.output_shape(xs);
  const auto r = random_vector(static_cast<std::size_t>(ys.numel()), 99);
  auto probe = [&] {
    auto y = net.forward(tensor_view<const float>(x.data(), xs), c);
    return nn::projected_loss({y.data, static_cast<std::size_t>(y.numel())}, r);
  };
  probe();
  auto dx = net.backward(tensor_view<const float>(r.data(), ys), c, check_input);
  std::vector<float> grad_x(dx.data, dx.data + (check_input ? dx.numel() : 0));
  std::vector<float> grads(net.grads().begin(), net.grads().end());
  nn::gradcheck_result rep;
  std::string where;
  auto compare = [&](float analytic, double numeric) {
    // The floor sits above the float rounding of Σ y·r over a step of 2h.
    const double rel = nn::gradient_difference(analytic, numeric);
    if (rel > 3e-3) MESSAGE(where << " analytic " << analytic << " numeric " << numeric);
    rep.max_rel = std::max(rep.max_rel, rel);
    ++rep.checked;
  };
  for (const auto& slot : net.layout().slots) {
    float* w = net.params().data() + slot.offset;
    const std::int64_t n = slot.shape.numel();
    for (std::int64_t i = 0; i < n; i += std::max<std::int64_t>(1, n / 29)) {
      where = slot.name + "[" + std::to_string(i) + "]";
      compare(grads[static_cast<std::size_t>(slot.offset + i)], nn::central_difference(w[i], h, probe));
    }
  }
  if (check_input)
    for (std::size_t i = 0; i < x.size(); i += std::max<std::size_t>(1, x.size() / 37)) {
      where = "x[" + std::to_string(i) + "]";
      compare(grad_x[i], nn::central_difference(x[i], h, probe));
    }
  return rep;
}

nn::gpt_config small(bool bias = false, float dropout = 0.f) {
  return {.vocab = 11, .seq = 6, .layers = 2, .d_model = 8, .heads = 2, .dropout = dropout, .bias = bias};
}

}  // namespace

TEST_CASE("gpt_block: every parameter and the input match finite differences, with and without biases") {
  for (bool bias : {false, true}) {
    auto g = small(bias);
    auto rep = gradcheck(nn::sequential{nn::gpt_block(g)}, {2, 5, 8}, random_vector(80, 3), true, 1e-2f);
    MESSAGE("gpt_block bias=" << bias << " max_rel_diff=" << rep.max_rel << " over " << rep.checked);
    CHECK(rep.checked > 150);
    CHECK(rep.max_rel < 5e-3);
  }
}

TEST_CASE("gpt_block with dropout: backward applies forward's masks") {
  nn::context c{.training = true, .seed = 5, .step = 2, .row_offset = 3};
  auto rep = gradcheck(nn::sequential{nn::gpt_block(small(true, 0.3f))}, {2, 4, 8}, random_vector(64, 4), true, 1e-2f, c);
  MESSAGE("gpt_block dropout max_rel_diff=" << rep.max_rel);
  CHECK(rep.max_rel < 5e-3);
}

TEST_CASE("gpt embedding, blocks and head: whole-model gradients through the cross-entropy") {
  auto g = small(true, 0.1f);
  auto model = nn::gpt(g);
  CHECK(model.depth() == 4);
  nn::network<host, nn::gpt_embedding, nn::stack<nn::gpt_block>, nn::gpt_head> net(model, 3);
  const shape xs{2, 5};
  auto ids = random_ids(10, 11, 8);
  std::vector<std::int32_t> labels(10);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>((i * 7 + 3) % 11);
  nn::context c{.training = true, .seed = 1, .step = 1};
  std::vector<float> dlogits(10 * 11), row(10);
  auto loss = [&](bool grad) {
    auto y = net.forward(tensor_view<const float>(ids.data(), xs), c);
    CHECK(y.shape == shape{2, 5, 11});
    return nn::softmax_cross_entropy{}.forward_backward<host>(y, labels.data(),
                                                               tensor_view<float>(grad ? dlogits.data() : nullptr, y.shape),
                                                               row.data());
  };
  const float l0 = loss(true);
  CHECK(std::abs(l0 - std::log(11.f)) < 0.5f);
  net.backward(tensor_view<const float>(dlogits.data(), {2, 5, 11}), c);
  std::vector<float> grads(net.grads().begin(), net.grads().end());
  double worst = 0;
  int checked = 0;
  // The residual stream starts at the embeddings' scale (σ 0.02), where LayerNorm is far from linear: a
  // small step, and a floor that sits above float rounding of the loss.
  const float h = 2e-3f;
  for (const auto& slot : net.layout().slots) {
    float* w = net.params().data() + slot.offset;
    for (std::int64_t i = 0; i < slot.shape.numel(); i += std::max<std::int64_t>(1, slot.shape.numel() / 11)) {
      const double num = nn::central_difference(w[i], h, [&] { return loss(false); });
      const double ana = grads[static_cast<std::size_t>(slot.offset + i)], rel = nn::gradient_difference(ana, num, 2e-2);
      if (rel > 1e-2) MESSAGE(slot.name << "[" << i << "] analytic " << ana << " numeric " << num);
      worst = std::max(worst, rel);
      ++checked;
    }
  }
  MESSAGE("gpt max_rel_diff=" << worst << " over " << checked);
  CHECK(checked > 100);
  CHECK(worst < 1e-2);
}

TEST_CASE("gpt parameter names follow nanoGPT's state dict") {
  auto names = [](const nn::gpt_config& g) {
    std::vector<std::string> out;
    for (const auto& [l, spec] : nn::gpt(g).parameters()) out.push_back(spec.name);
    return out;
  };
  auto g = small();
  g.layers = 1;
  CHECK(names(g) == std::vector<std::string>{"wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.weight",
                                             "h.0.attn.c_proj.weight", "h.0.ln_2.weight", "h.0.mlp.c_fc.weight",
                                             "h.0.mlp.c_proj.weight", "ln_f.weight", "lm_head.weight"});
  g.bias = true;
  g.layers = 2;
  const auto b = names(g);
  CHECK(b.size() == 2 + 2 * 12 + 3);
  CHECK(b[3] == "h.0.ln_1.bias");
  CHECK(b[14] == "h.1.ln_1.weight");
  CHECK(b.back() == "lm_head.weight");
}

TEST_CASE("gpt: shapes and divisibility errors say what was expected") {
  auto g = small();
  auto model = nn::gpt(g);
  CHECK_THROWS_WITH_AS(model.output_shape({2, 7}), doctest::Contains("1 <= T <= 6"), shape_error);
  nn::gpt_block b(g);
  CHECK_THROWS_WITH_AS(b.set_split({.ranks = 4}), doctest::Contains("needs the heads divisible by 4, found 2"),
                       invalid_argument);
  nn::gpt_embedding e(g);
  CHECK_THROWS_WITH_AS(e.set_split({.ranks = 2}), doctest::Contains("the vocabulary divisible by 2, found 11"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(nn::gpt_block(nn::gpt_config{.d_model = 10, .heads = 4}), doctest::Contains("multiple of heads"),
                       invalid_argument);
}

TEST_CASE("tied LM head: both copies start equal, and their summed gradients are the shared weight's") {
  auto g = small(false, 0.f);
  g.tie_weights = true;
  auto model = nn::gpt(g);
  nn::network<host, nn::gpt_embedding, nn::stack<nn::gpt_block>, nn::gpt_head> net(model, 4);
  const auto& wte = net.layout().find("wte.weight");
  const auto& head = net.layout().find("lm_head.weight");
  CHECK(head.init_id == wte.id);
  const std::int64_t n = wte.shape.numel();
  float* w = net.params().data();
  for (std::int64_t i = 0; i < n; ++i) REQUIRE(w[wte.offset + i] == w[head.offset + i]);
  auto ids = random_ids(10, 11, 3);
  std::vector<std::int32_t> labels(10);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>((i * 3 + 1) % 11);
  std::vector<float> dlogits(10 * 11), row(10);
  auto loss = [&](bool grad) {
    auto y = net.forward(tensor_view<const float>(ids.data(), {2, 5}));
    return nn::softmax_cross_entropy{}.forward_backward<host>(y, labels.data(),
                                                               tensor_view<float>(grad ? dlogits.data() : nullptr, y.shape),
                                                               row.data());
  };
  loss(true);
  net.backward(tensor_view<const float>(dlogits.data(), {2, 5, 11}));
  std::vector<float> grads(net.grads().begin(), net.grads().end());
  double worst = 0;
  const float h = 2e-3f;
  for (std::int64_t i = 0; i < n; i += 7) {
    // The one shared weight moves: both copies at once.
    const double num = nn::central_difference({&w[wte.offset + i], &w[head.offset + i]}, h, [&] { return loss(false); });
    const double ana = double(grads[wte.offset + i]) + grads[head.offset + i];
    worst = std::max(worst, nn::gradient_difference(ana, num, 2e-2));
  }
  MESSAGE("tied max_rel_diff=" << worst);
  CHECK(worst < 1e-2);
}

TEST_CASE("gpt dropout kernels: a row per call gives the bits of an element per call, with and without context parallel") {
  // 6 local token rows of 40 columns; the context-parallel case holds 2 of each sequence's 4 positions (zigzag).
  constexpr std::int64_t rows = 6, n = 40;
  const auto a = random_vector(rows * n, 1), b = random_vector(rows * n, 2), bias = random_vector(n, 3);
  const auto wpe = random_vector(4 * n, 4);
  for (const nn::context_split cp : {nn::context_split{}, nn::context_split{2, 1, true}}) {
    nn::kernels::token_dropout drop{rng_stream{9, 4}, 0.7f, 12, n};
    drop.cp = cp;
    drop.t_local = cp.ranks > 1 ? 2 : 4;
    drop.seq = 4;
    drop.local_first = 1;
    nn::kernels::token_place at{4, drop.t_local, cp};
    std::vector<float> by_element(rows * n), by_row(rows * n);
    // dropped: whether dropped elements are 0 (no residual added), so that some must be.
    const auto both = [&](auto make, const char* what, bool dropped = true) {
      const auto f = make(by_element.data()), g = make(by_row.data());
      for (std::int64_t i = 0; i < rows * n; ++i) f(i);
      for (std::int64_t r = 0; r < rows; ++r) g.row(r);
      INFO(what << ", cp ranks " << cp.ranks);
      CHECK(std::memcmp(by_element.data(), by_row.data(), by_row.size() * sizeof(float)) == 0);
      if (dropped) CHECK(std::count(by_row.begin(), by_row.end(), 0.f) > 0);
    };
    both([&](float* out) { return nn::kernels::residual_dropout<float>{a.data(), b.data(), bias.data(), out, drop}; },
         "residual_dropout", false);
    both([&](float* out) { return nn::kernels::residual_dropout<float>{nullptr, b.data(), nullptr, out, drop}; },
         "dropout alone");
    both([&](float* out) { return nn::kernels::dropout_grad<float>{b.data(), out, drop}; }, "dropout_grad");
    both([&](float* out) { return nn::kernels::add_positions<float>{a.data(), wpe.data(), out, n, 1, at, drop}; },
         "add_positions");
  }
}

TEST_CASE("bias gradients: the host's column blocks give the bits of a column per call, summed onto or written") {
  constexpr std::int64_t rows = 7, n = 300;  // a block of 256 columns and a partial one
  const auto x = random_vector(rows * n, 5), start = random_vector(n, 6);
  for (const bool accumulate : {false, true}) {
    std::vector<float> by_column = start, by_block = start;
    for (std::int64_t j = 0; j < n; ++j) nn::kernels::column_sum<float>{x.data(), by_column.data(), rows, n, accumulate}(j);
    nn::detail::column_sums<host>(x.data(), by_block.data(), rows, n, accumulate);
    INFO("accumulate " << accumulate);
    CHECK(std::memcmp(by_column.data(), by_block.data(), n * sizeof(float)) == 0);
    CHECK(by_block[0] != start[0]);
  }
}

TEST_CASE("position embedding gradient: a row per call gives the bits of an element per call") {
  // 6 local token rows of 300 columns (a block of 256 and a partial one) into 4 positions; the context-parallel
  // case holds 2 of each sequence's 4 positions (zigzag), and a sequence-parallel rank starts at token 1.
  constexpr std::int64_t rows = 6, n = 300, seq = 4;
  const auto dy = random_vector(rows * n, 7), start = random_vector(seq * n, 8);
  for (const nn::context_split cp : {nn::context_split{}, nn::context_split{2, 1, true}})
    for (const std::int64_t first_token : {0, 1})
      for (const bool accumulate : {false, true}) {
        const nn::kernels::token_place at{seq, cp.ranks > 1 ? 2 : 4, cp};
        std::vector<float> by_element = start, by_row = start;
        const auto f = [&](float* dw) {
          return nn::kernels::embed_wpe_grad<float>{dy.data(), dw, rows, n, first_token, at, accumulate};
        };
        for (std::int64_t i = 0; i < seq * n; ++i) f(by_element.data())(i);
        for (std::int64_t pos = 0; pos < seq; ++pos) f(by_row.data()).row(pos);
        INFO("cp ranks " << cp.ranks << ", first token " << first_token << ", accumulate " << accumulate);
        CHECK(std::memcmp(by_element.data(), by_row.data(), by_row.size() * sizeof(float)) == 0);
        CHECK(by_row != start);
      }
}

}  // namespace test_gpt
