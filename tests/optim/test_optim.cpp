// SPDX-License-Identifier: Apache-2.0
// tests/optim/test_optim.cpp — optimizer updates against hand-computed steps, clipping, schedules, state, and the
// checks of every optimizer's settings where it is built.
// (Multi-step agreement with torch.optim is in tests/nn/test_torch_parity.cpp.)
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "dml/optim/adagrad.hpp"
#include "dml/optim/adam.hpp"
#include "dml/optim/any.hpp"
#include "dml/optim/clip.hpp"
#include "dml/optim/lamb.hpp"
#include "dml/optim/lars.hpp"
#include "dml/optim/learning_rate.hpp"
#include "dml/optim/sgd.hpp"
#include "dml/ps/transport.hpp"

namespace test_optim {

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

// Every optimizer checks its settings where it is built, as PyTorch's constructors do: the message names the
// optimizer, the setting, the rule and the value found. The edge values the rules allow are taken.
namespace {
constexpr float not_a_number = std::numeric_limits<float>::quiet_NaN();
constexpr float infinity = std::numeric_limits<float>::infinity();
}  // namespace

TEST_CASE("sgd: settings checked where it is built") {
  CHECK_THROWS_WITH_AS(optim::sgd({.lr = -0.5f}), "dml::optim::sgd: expected lr >= 0, found -0.5", invalid_argument);
  CHECK_THROWS_WITH_AS(optim::sgd({.lr = not_a_number}), "dml::optim::sgd: expected a finite lr, found nan",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(optim::sgd({.lr = infinity}), "dml::optim::sgd: expected a finite lr, found inf",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(optim::sgd({.momentum = -0.1f}), "dml::optim::sgd: expected momentum >= 0, found -0.1",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(optim::sgd({.dampening = 1.5f}), "dml::optim::sgd: expected dampening in [0, 1], found 1.5",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(optim::sgd({.dampening = -0.5f}), "dml::optim::sgd: expected dampening in [0, 1], found -0.5",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(optim::sgd({.weight_decay = -1e-4f}),
                       "dml::optim::sgd: expected weight_decay >= 0, found -0.0001", invalid_argument);
  CHECK_THROWS_WITH_AS(optim::sgd({.nesterov = true}),
                       "dml::optim::sgd: expected momentum > 0 and dampening 0 with nesterov, found momentum 0 and "
                       "dampening 0", invalid_argument);
  CHECK_THROWS_WITH_AS((optim::sgd({.momentum = 0.9f, .dampening = 0.1f, .nesterov = true})),
                       "dml::optim::sgd: expected momentum > 0 and dampening 0 with nesterov, found momentum 0.9 and "
                       "dampening 0.1", invalid_argument);
  CHECK_NOTHROW(optim::sgd({.lr = 0.f, .momentum = 0.f, .dampening = 0.f, .weight_decay = 0.f}));
  CHECK_NOTHROW(optim::sgd({.momentum = 0.9f, .dampening = 1.f}));
  CHECK_NOTHROW(optim::sgd({.momentum = 0.9f, .nesterov = true}));
}

TEST_CASE_TEMPLATE("adam and adamw: settings checked where they are built", O, optim::adam, optim::adamw) {
  const std::string who = std::string("dml::optim::") + O::name + ": expected ";
  CHECK_THROWS_WITH_AS(O({.lr = -0.5f}), (who + "lr >= 0, found -0.5").c_str(), invalid_argument);
  CHECK_THROWS_WITH_AS(O({.lr = not_a_number}), (who + "a finite lr, found nan").c_str(), invalid_argument);
  CHECK_THROWS_WITH_AS(O({.beta1 = 1.f}), (who + "beta1 in [0, 1), found 1").c_str(), invalid_argument);
  CHECK_THROWS_WITH_AS(O({.beta1 = -0.1f}), (who + "beta1 in [0, 1), found -0.1").c_str(), invalid_argument);
  CHECK_THROWS_WITH_AS(O({.beta2 = 1.5f}), (who + "beta2 in [0, 1), found 1.5").c_str(), invalid_argument);
  CHECK_THROWS_WITH_AS(O({.beta2 = not_a_number}), (who + "beta2 in [0, 1), found nan").c_str(), invalid_argument);
  // Stricter than PyTorch (eps >= 0): with eps 0 a gradient that has been 0 at every step updates by 0/0.
  CHECK_THROWS_WITH_AS(O({.eps = 0.f}), (who + "eps > 0, found 0").c_str(), invalid_argument);
  CHECK_THROWS_WITH_AS(O({.eps = -1e-8f}), (who + "eps > 0, found -1e-08").c_str(), invalid_argument);
  CHECK_THROWS_WITH_AS(O({.weight_decay = -0.01f}), (who + "weight_decay >= 0, found -0.01").c_str(), invalid_argument);
  CHECK_THROWS_WITH_AS(O({.freeze_variance_after = -1}),
                       (who + "freeze_variance_after >= 0 (0: never), found -1").c_str(), invalid_argument);
  CHECK_NOTHROW(O({.lr = 0.f, .beta1 = 0.f, .beta2 = 0.f, .eps = 1e-30f, .weight_decay = 0.f}));
  // 1-bit Adam's freeze changes a setting after construction: checked again.
  O o;
  CHECK_THROWS_WITH_AS(o.freeze_variance(-2), (who + "freeze_variance_after >= 0 (0: never), found -2").c_str(),
                       invalid_argument);
  CHECK(o.opt.freeze_variance_after == 0);  // left as it was
  CHECK(o.freeze_variance(5)[0] == 0.9f);
  CHECK(o.opt.freeze_variance_after == 5);
}

TEST_CASE("adagrad: settings checked where it is built") {
  CHECK_THROWS_WITH_AS(optim::adagrad({.lr = -0.5f}), "dml::optim::adagrad: expected lr >= 0, found -0.5",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(optim::adagrad({.lr_decay = -0.1f}), "dml::optim::adagrad: expected lr_decay >= 0, found -0.1",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(optim::adagrad({.weight_decay = -1.f}),
                       "dml::optim::adagrad: expected weight_decay >= 0, found -1", invalid_argument);
  CHECK_THROWS_WITH_AS(optim::adagrad({.eps = 0.f}), "dml::optim::adagrad: expected eps > 0, found 0",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(optim::adagrad({.eps = infinity}), "dml::optim::adagrad: expected a finite eps, found inf",
                       invalid_argument);
  CHECK_NOTHROW(optim::adagrad({.lr = 0.f, .lr_decay = 0.f, .weight_decay = 0.f}));
}

TEST_CASE("lamb and lars: settings checked where they are built") {
  CHECK_THROWS_WITH_AS(optim::lamb({.lr = -0.5f}), "dml::optim::lamb: expected lr >= 0, found -0.5", invalid_argument);
  CHECK_THROWS_WITH_AS(optim::lamb({.beta1 = 1.f}), "dml::optim::lamb: expected beta1 in [0, 1), found 1",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(optim::lamb({.beta2 = -0.1f}), "dml::optim::lamb: expected beta2 in [0, 1), found -0.1",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(optim::lamb({.eps = 0.f}), "dml::optim::lamb: expected eps > 0, found 0", invalid_argument);
  CHECK_THROWS_WITH_AS(optim::lamb({.weight_decay = -0.01f}),
                       "dml::optim::lamb: expected weight_decay >= 0, found -0.01", invalid_argument);
  CHECK_THROWS_WITH_AS(optim::lamb({.trust_clip = -1.f}), "dml::optim::lamb: expected trust_clip >= 0, found -1",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(optim::lamb({.trust_clip = infinity}),
                       "dml::optim::lamb: expected a finite trust_clip, found inf", invalid_argument);
  CHECK_NOTHROW(optim::lamb({.lr = 0.f, .beta1 = 0.f, .beta2 = 0.f, .weight_decay = 0.f, .trust_clip = 0.f}));

  CHECK_THROWS_WITH_AS(optim::lars({.lr = -0.5f}), "dml::optim::lars: expected lr >= 0, found -0.5", invalid_argument);
  CHECK_THROWS_WITH_AS(optim::lars({.momentum = 1.f}), "dml::optim::lars: expected momentum in [0, 1), found 1",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(optim::lars({.weight_decay = -1.f}), "dml::optim::lars: expected weight_decay >= 0, found -1",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(optim::lars({.eta = 0.f}), "dml::optim::lars: expected eta (trust coefficient) > 0, found 0",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(optim::lars({.trust_clip = -0.5f}), "dml::optim::lars: expected trust_clip >= 0, found -0.5",
                       invalid_argument);
  CHECK_NOTHROW(optim::lars({.lr = 0.f, .momentum = 0.f, .weight_decay = 0.f, .trust_clip = 0.f}));
}

TEST_CASE("any_of: every way to choose checks the chosen one's settings") {
  using any = optim::any_of<optim::sgd, optim::adam, optim::adamw, optim::adagrad, optim::lamb, optim::lars>;
  for (const char* name : {"sgd", "adam", "adamw", "adagrad", "lamb", "lars"}) CHECK_NOTHROW(any::by_name(name));
  // A setting changed through the public `opt` after construction is caught where the optimizer is next taken in.
  optim::sgd s;
  s.opt.lr = -0.5f;
  CHECK_THROWS_WITH_AS(any{s}, "dml::optim::sgd: expected lr >= 0, found -0.5", invalid_argument);
  auto a = any::by_name("adamw");
  std::get<optim::adamw>(a.chosen).opt.eps = 0.f;
  CHECK_THROWS_WITH_AS(optim::validate(a), "dml::optim::adamw: expected eps > 0, found 0", invalid_argument);
  CHECK_THROWS_WITH_AS(optim::validate(s), "dml::optim::sgd: expected lr >= 0, found -0.5", invalid_argument);
}

TEST_CASE("the parameter server's optimizers follow optim's rules; every node's placement checks them") {
  CHECK_THROWS_WITH_AS(ps::server_optimizer::parse("sgd", -0.5f), "dml::optim::sgd: expected lr >= 0, found -0.5",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(ps::server_optimizer::parse("adagrad", -0.5f),
                       "dml::optim::adagrad: expected lr >= 0, found -0.5", invalid_argument);
  CHECK(ps::server_optimizer::parse("sgd", 0.f).lr == 0.f);
  CHECK(ps::server_optimizer::parse("adagrad", 0.f).kind == ps::server_optimizer::adagrad);
  ps::options o;
  o.optimizer = {ps::server_optimizer::adagrad, 0.1f, 1e-10f, -1.f};
  CHECK_THROWS_WITH_AS(ps::placement({8}, o),
                       "dml::ps::server_optimizer: expected a finite initial_accumulator >= 0, found -1",
                       invalid_argument);
  o.optimizer = {ps::server_optimizer::adagrad, 0.1f, 0.f};
  CHECK_THROWS_WITH_AS(ps::placement({8}, o), "dml::optim::adagrad: expected eps > 0, found 0", invalid_argument);
  o.optimizer = {ps::server_optimizer::sgd, -1.f};
  CHECK_THROWS_WITH_AS(ps::placement({8}, o), "dml::optim::sgd: expected lr >= 0, found -1", invalid_argument);
  o.optimizer = {ps::server_optimizer::adagrad, 0.f, 1e-10f, 0.f};
  CHECK_NOTHROW(ps::placement({8}, o));
}

}  // namespace test_optim
