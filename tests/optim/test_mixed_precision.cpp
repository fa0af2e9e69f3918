// SPDX-License-Identifier: Apache-2.0
// tests/optim/test_mixed_precision.cpp — the loss scaler's rule and finite check, and optimizer passes
// that also write a bf16/fp16 working copy, against plain references.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "dml/optim/adam.hpp"
#include "dml/optim/loss_scaler.hpp"
#include "dml/optim/sgd.hpp"
#include "support.hpp"

namespace test_mixed_precision {

using namespace dml;

namespace {

using dml_test::normal_vector;

// GradScaler's update written out plainly: the reference the class is held to.
struct reference_scaler {
  double scale = 65536;
  std::int64_t tracker = 0;
  std::int64_t interval;
  void update(bool found_inf) {
    if (found_inf) {
      scale *= 0.5;
      tracker = 0;
    } else if (++tracker == interval) {
      scale *= 2;
      tracker = 0;
    }
  }
};

}  // namespace

TEST_CASE("loss_scaler: defaults are GradScaler's") {
  optim::loss_scaler s;
  CHECK(s.scale() == 65536.f);
  CHECK(s.inv_scale() == 1.f / 65536.f);
  CHECK(s.opts().growth_factor == 2.f);
  CHECK(s.opts().backoff_factor == 0.5f);
  CHECK(s.opts().growth_interval == 2000);
  CHECK_THROWS_AS(optim::loss_scaler({.init_scale = 0.f}), invalid_argument);
  CHECK_THROWS_AS(optim::loss_scaler({.backoff_factor = 1.f}), invalid_argument);
  CHECK_THROWS_AS(optim::loss_scaler({.growth_interval = 0}), invalid_argument);
}

TEST_CASE("loss_scaler: overflow skips the step and halves; growth after the interval") {
  optim::loss_scaler s;
  CHECK_FALSE(s.update(true));  // overflow: skip, back off
  CHECK(s.scale() == 32768.f);
  CHECK(s.growth_tracker() == 0);
  for (int i = 0; i < 1999; ++i) REQUIRE(s.update(false));
  CHECK(s.scale() == 32768.f);  // one short of the interval
  CHECK(s.growth_tracker() == 1999);
  CHECK(s.update(false));
  CHECK(s.scale() == 65536.f);  // the 2000th clean step grows
  CHECK(s.growth_tracker() == 0);
  // An overflow part-way resets the count: growth needs a full interval after it.
  for (int i = 0; i < 1000; ++i) s.update(false);
  CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 32768.f);
  for (int i = 0; i < 1999; ++i) s.update(false);
  CHECK(s.scale() == 32768.f);
  s.update(false);
  CHECK(s.scale() == 65536.f);
}

TEST_CASE("loss_scaler: a long random sequence follows the reference rule") {
  optim::loss_scaler s({.growth_interval = 7});
  reference_scaler ref{.interval = 7};
  std::mt19937 rng(3);
  std::bernoulli_distribution overflow(0.1);
  for (int step = 0; step < 5000; ++step) {
    const bool inf = overflow(rng);
    const bool applied = s.update(inf);
    ref.update(inf);
    REQUIRE(applied == !inf);
    REQUIRE(double(s.scale()) == ref.scale);
    REQUIRE(s.growth_tracker() == ref.tracker);
  }
}

TEST_CASE("loss_scaler: growth stops short of float overflow; restore checks its input") {
  optim::loss_scaler s({.init_scale = 0x1p127f, .growth_interval = 1});
  s.update(false);
  CHECK(s.scale() == 0x1p127f);
  s.restore(1024.f, 0);
  CHECK(s.scale() == 1024.f);
  CHECK(s.inv_scale() == 0x1p-10f);
  CHECK_THROWS_AS(s.restore(INFINITY, 0), invalid_argument);
  CHECK_THROWS_AS(s.restore(1.f, 1), invalid_argument);
}

TEST_CASE_TEMPLATE("has_nonfinite: inf and NaN anywhere, in every float type", T, float, bf16, fp16) {
  // Above the threaded loop's grain, so both the serial and the parallel reduction run.
  for (std::int64_t n : {std::int64_t{1}, std::int64_t{1000}, std::int64_t{100000}}) {
    std::vector<T> g(static_cast<std::size_t>(n), T(1.f));
    CHECK_FALSE(optim::has_nonfinite<host>(g.data(), n));
    // The largest finite value of each type (bf16(FLT_MAX) would round up to infinity).
    if constexpr (std::is_same_v<T, float>) g[0] = std::numeric_limits<float>::max();
    else g[0] = T::from_bits(std::is_same_v<T, bf16> ? 0x7f7fu : 0x7bffu);
    g[n - 1] = T(-float(g[0]));
    CHECK_FALSE(optim::has_nonfinite<host>(g.data(), n));
    for (float bad : {INFINITY, -INFINITY, std::numeric_limits<float>::quiet_NaN()})
      for (std::int64_t at : {std::int64_t{0}, n / 2, n - 1}) {
        auto h = g;
        h[static_cast<std::size_t>(at)] = T(bad);
        INFO("n=", n, " at=", at, " value=", bad);
        CHECK(optim::has_nonfinite<host>(h.data(), n));
      }
  }
  CHECK_FALSE(optim::has_nonfinite<host>(static_cast<const T*>(nullptr), 0));
}

TEST_CASE("fp16 overflow in a scaled gradient: found, step skipped, weights untouched") {
  // The scaled loss makes a 16-bit gradient overflow; the scaler sees it, skips the step and backs off.
  optim::loss_scaler scaler;
  const std::vector<float> true_grad{1e-3f, 2.f, -0.5f};
  std::vector<fp16> scaled(true_grad.size());
  for (std::size_t i = 0; i < scaled.size(); ++i) scaled[i] = fp16(true_grad[i] * scaler.scale());
  const bool found = optim::has_nonfinite<host>(scaled.data(), 3);
  CHECK(found);  // 2 · 65536 > 65504
  std::vector<float> w{1.f, 2.f, 3.f};
  const auto w0 = w;
  if (scaler.update(found)) FAIL("the step should have been skipped");
  CHECK(w == w0);
  CHECK(scaler.scale() == 32768.f);
}

namespace {

// n values of each: master weights, gradients multiplied by a loss scale, and the optimizer run with
// and without a working copy. The master weights must agree bit for bit, and the copy must be
// exactly W(master) after every step.
template <class O, class W>
void check_working_copy(const O& opt, std::int64_t n) {
  const float loss_scale = 1024.f;
  auto w_plain = normal_vector(static_cast<std::size_t>(n), 11);
  auto w_mixed = w_plain;
  std::vector<W> working(static_cast<std::size_t>(n), W(std::numeric_limits<float>::quiet_NaN()));
  optim::state<O> s_plain(n), s_mixed(n);
  int copy_bad = 0, master_bad = 0;
  for (int step = 1; step <= 4; ++step) {
    const auto g = normal_vector(static_cast<std::size_t>(n), 100 + step);
    std::vector<float> g_scaled(g);
    for (auto& x : g_scaled) x *= loss_scale;  // a power of two: exact, and exactly undone below
    opt.template update<host>({.n = n, .w = w_plain.data(), .g = g.data(), .state = s_plain.pointers(),
                               .step = step, .lr = 1e-2f});
    opt.template update<host>({.n = n, .w = w_mixed.data(), .g = g_scaled.data(), .state = s_mixed.pointers(),
                               .step = step, .lr = 1e-2f, .grad_scale = 1.f / loss_scale,
                               .working = working.data()});
    for (std::int64_t i = 0; i < n; ++i) {
      master_bad += detail::float_bits(w_plain[i]) != detail::float_bits(w_mixed[i]);
      copy_bad += working[i].bits != W(w_mixed[i]).bits;
    }
  }
  INFO("n=", n);
  CHECK(master_bad == 0);
  CHECK(copy_bad == 0);
  // And the copy is not just the master's leading bits: some weights must round up.
  int rounded_up = 0;
  for (std::int64_t i = 0; i < n; ++i) rounded_up += std::abs(float(working[i])) > std::abs(w_mixed[i]);
  CHECK(rounded_up > 0);
}

}  // namespace

TEST_CASE_TEMPLATE("fused step: unscale, update and cast in one pass write W(master)", W, bf16, fp16) {
  for (std::int64_t n : {std::int64_t{257}, std::int64_t{70000}}) {
    check_working_copy<optim::adamw, W>(optim::adamw{}, n);
    check_working_copy<optim::adam, W>(optim::adam{{.weight_decay = 0.1f}}, n);
    check_working_copy<optim::sgd, W>(optim::sgd{{.momentum = 0.9f, .weight_decay = 1e-3f}}, n);
    check_working_copy<optim::sgd, W>(optim::sgd{}, n);
  }
}

TEST_CASE("fused step: without a working copy nothing else is written") {
  // The default step_args has no working copy; the f32 update must equal a hand-computed AdamW step.
  std::vector<float> w{1.f}, g{0.3f};
  optim::state<optim::adamw> st(1);
  optim::adamw{}.update<host>({.n = 1, .w = w.data(), .g = g.data(), .state = st.pointers(), .step = 1, .lr = 0.01f});
  CHECK(w[0] == doctest::Approx(1 * (1 - 0.01 * 0.01) - 0.01));
}

}  // namespace test_mixed_precision
