// SPDX-License-Identifier: Apache-2.0
// tests/optim/test_optim.cpp — optimizer updates against hand-computed steps, clipping, schedules, state.
// (Multi-step agreement with torch.optim is in tests/nn/test_torch_parity.cpp.)
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "dml/optim/adagrad.hpp"
#include "dml/optim/adam.hpp"
#include "dml/optim/clip.hpp"
#include "dml/optim/learning_rate.hpp"
#include "dml/optim/sgd.hpp"

using namespace dml;

template <class O>
std::vector<float> run(const O& opt, std::vector<float> w, const std::vector<float>& g, int steps, float lr,
                       float scale = 1.f) {
  optim::state<O> st(static_cast<std::int64_t>(w.size()));
  for (int s = 1; s <= steps; ++s)
    opt.template update<host>({.n = static_cast<std::int64_t>(w.size()), .w = w.data(), .g = g.data(),
                               .state = st.pointers(), .step = s, .lr = lr, .grad_scale = scale});
  return w;
}

TEST_CASE("sgd: plain, momentum, Nesterov and weight decay") {
  CHECK(run(optim::sgd{}, {1.f}, {0.5f}, 1, 0.1f)[0] == doctest::Approx(0.95f));
  // momentum 0.9: v1 = g, v2 = 0.9 g + g → w = 1 − 0.1·(0.5 + 0.95)
  CHECK(run(optim::sgd{{.momentum = 0.9f}}, {1.f}, {0.5f}, 2, 0.1f)[0] == doctest::Approx(1 - 0.1 * (0.5 + 0.95)));
  // Nesterov: d = g + 0.9 v → step 1 uses 0.5 + 0.45
  CHECK(run(optim::sgd{{.momentum = 0.9f, .nesterov = true}}, {1.f}, {0.5f}, 1, 0.1f)[0] ==
        doctest::Approx(1 - 0.1 * 0.95));
  CHECK(run(optim::sgd{{.weight_decay = 0.1f}}, {2.f}, {0.f}, 1, 0.5f)[0] == doctest::Approx(2 - 0.5 * 0.2));
  CHECK_THROWS_AS(optim::sgd({.nesterov = true}), invalid_argument);
}

TEST_CASE("adam and adamw: first steps by hand") {
  // Step 1 of Adam moves every weight by lr·sign(g) (up to eps).
  const auto w = run(optim::adam{}, {1.f, -1.f}, {0.3f, -2.f}, 1, 0.01f);
  CHECK(w[0] == doctest::Approx(0.99f));
  CHECK(w[1] == doctest::Approx(-0.99f));
  // AdamW decays the weight first: w·(1 − lr·wd) − lr·sign(g).
  CHECK(run(optim::adamw{}, {1.f}, {0.3f}, 1, 0.01f)[0] == doctest::Approx(1 * (1 - 0.01 * 0.01) - 0.01));
  // Defaults are PyTorch's.
  optim::adamw a;
  CHECK(a.opt.beta1 == 0.9f);
  CHECK(a.opt.beta2 == 0.999f);
  CHECK(a.opt.eps == 1e-8f);
  CHECK(a.opt.weight_decay == 0.01f);
  CHECK(optim::adam{}.opt.weight_decay == 0.f);
  // grad_scale is applied before the moments: halving g twice as large equals g.
  CHECK(run(optim::adam{}, {1.f}, {0.6f}, 3, 0.01f, 0.5f)[0] == doctest::Approx(run(optim::adam{}, {1.f}, {0.3f}, 3, 0.01f)[0]));
}

TEST_CASE("adagrad: accumulated squares and learning-rate decay") {
  // g constant: sum_t = t·g², step t moves clr_t · g/(√t·|g|)
  const float g = 0.5f, lr = 0.1f, decay = 0.5f;
  double w = 1;
  for (int t = 1; t <= 3; ++t) w -= lr / (1 + (t - 1) * decay) / std::sqrt(double(t));
  CHECK(run(optim::adagrad{{.lr = lr, .lr_decay = decay}}, {1.f}, {g}, 3, lr)[0] == doctest::Approx(w));
}

TEST_CASE("global-norm clipping matches torch.nn.utils.clip_grad_norm_") {
  std::vector<float> g{3.f, 4.f, 0.f};
  const double norm = std::sqrt(optim::squared_norm<host>(g.data(), 3));
  CHECK(norm == doctest::Approx(5.0));
  CHECK(optim::clip_scale(norm, 1.f) == doctest::Approx(1.0 / (5.0 + 1e-6)));
  CHECK(optim::clip_scale(norm, 10.f) == 1.f);
  CHECK(optim::clip_scale(norm, 0.f) == 1.f);  // 0 means no clipping
  std::vector<float> big(100000, 0.01f);
  CHECK(optim::squared_norm<host>(big.data(), 100000) == doctest::Approx(100000 * 1e-4));
}

TEST_CASE("schedules: constant, warmup then cosine") {
  CHECK(optim::constant_lr{0.1f}(1000) == 0.1f);
  optim::warmup_cosine s{.lr = 1.f, .warmup = 10, .total = 110, .min_lr = 0.f};
  CHECK(s(1) == doctest::Approx(0.1));
  CHECK(s(10) == doctest::Approx(1.0));
  CHECK(s(60) == doctest::Approx(0.5));
  CHECK(s(110) == doctest::Approx(0.0));
  CHECK(s(500) == 0.f);
  for (int t = 11; t < 110; ++t) CHECK(s(t + 1) <= s(t));
}
