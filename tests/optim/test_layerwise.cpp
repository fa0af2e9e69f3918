// SPDX-License-Identifier: Apache-2.0
// tests/optim/test_layerwise.cpp — LAMB and LARS against plain references written from the papers (You et al. 2019,
// Algorithm 2; You et al. 2017, Algorithm 1), tensors cut into pieces as shards cut them, bad settings.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "dml/optim/adam.hpp"
#include "dml/optim/any.hpp"
#include "dml/optim/lamb.hpp"
#include "dml/optim/lars.hpp"
#include "support.hpp"

namespace test_layerwise {

using namespace dml;

namespace {

// Three tensors in a flat buffer with padding between them: a matrix, a bias (1-D, not adapted), a matrix.
struct tensor_def {
  std::int64_t offset, n;
  bool adapt;
};
const std::vector<tensor_def> tensors{{0, 30, true}, {32, 5, false}, {48, 21, true}};
constexpr std::int64_t total = 80;
constexpr int steps = 5;

std::vector<float> initial() {
  auto w = dml_test::random_vector(total, 3, -0.5f, 0.5f);
  std::vector<float> out(total, 0.f);
  for (const auto& t : tensors)
    for (std::int64_t i = 0; i < t.n; ++i) out[t.offset + i] = w[t.offset + i];
  return out;
}
std::vector<float> grad_at(int step) {
  auto g = dml_test::random_vector(total, 100 + step, -2.f, 2.f);
  std::vector<float> out(total, 0.f);
  for (const auto& t : tensors)
    for (std::int64_t i = 0; i < t.n; ++i) out[t.offset + i] = g[t.offset + i];
  return out;
}

double norm(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v * v;
  return std::sqrt(s);
}

// LAMB, Algorithm 2, in double, per tensor; the ratio φ(‖w‖)/‖u‖ with φ the identity, at most clip when clip > 0.
std::vector<float> lamb_reference(const optim::lamb::options& o, float lr, float scale) {
  const auto w0 = initial();
  std::vector<double> w(w0.begin(), w0.end()), m(total, 0.0), v(total, 0.0);
  for (int t = 1; t <= steps; ++t) {
    const auto g = grad_at(t);
    for (const auto& tn : tensors) {
      std::vector<double> u(tn.n), wt(tn.n);
      for (std::int64_t i = 0; i < tn.n; ++i) {
        const auto k = tn.offset + i;
        const double gi = double(g[k]) * scale;
        m[k] = o.beta1 * m[k] + (1 - double(o.beta1)) * gi;
        v[k] = o.beta2 * v[k] + (1 - double(o.beta2)) * gi * gi;
        const double mh = m[k] / (1 - std::pow(double(o.beta1), t)), vh = v[k] / (1 - std::pow(double(o.beta2), t));
        u[i] = mh / (std::sqrt(vh) + o.eps) + (tn.adapt ? o.weight_decay * w[k] : 0.0);
        wt[i] = w[k];
      }
      double ratio = 1;
      if (tn.adapt && norm(wt) > 0 && norm(u) > 0) ratio = norm(wt) / norm(u);
      if (tn.adapt && o.trust_clip > 0) ratio = std::min(ratio, double(o.trust_clip));
      for (std::int64_t i = 0; i < tn.n; ++i) w[tn.offset + i] -= lr * ratio * u[i];
    }
  }
  return {w.begin(), w.end()};
}

// LARS, Algorithm 1, in double: local lr η‖w‖/(‖∇‖ + β‖w‖), v = μv + γ·local·(∇ + βw), w −= v.
std::vector<float> lars_reference(const optim::lars::options& o, float lr, float scale) {
  const auto w0 = initial();
  std::vector<double> w(w0.begin(), w0.end()), b(total, 0.0);
  for (int t = 1; t <= steps; ++t) {
    const auto g = grad_at(t);
    for (const auto& tn : tensors) {
      std::vector<double> gt(tn.n), wt(tn.n);
      for (std::int64_t i = 0; i < tn.n; ++i) {
        gt[i] = double(g[tn.offset + i]) * scale;
        wt[i] = w[tn.offset + i];
      }
      double local = 1;
      if (tn.adapt && norm(wt) > 0 && norm(gt) > 0) local = o.eta * norm(wt) / (norm(gt) + o.weight_decay * norm(wt));
      if (tn.adapt && o.trust_clip > 0) local = std::min(local, double(o.trust_clip));
      for (std::int64_t i = 0; i < tn.n; ++i) {
        const auto k = tn.offset + i;
        b[k] = o.momentum * b[k] + lr * local * (gt[i] + (tn.adapt ? o.weight_decay * wt[i] : 0.0));
        w[k] -= b[k];
      }
    }
  }
  return {w.begin(), w.end()};
}

// dml's update with the tensors cut into `ranks` equal parts of the flat buffer, as ZeRO cuts them: each part
// prepares its pieces, the sums add up (the reduction), each part applies.
template <class O>
std::vector<float> run_dml(const O& opt, float lr, float scale, int ranks) {
  auto w = initial();
  optim::state<O> st(total);
  const std::int64_t part = total / ranks;
  for (int t = 1; t <= steps; ++t) {
    const auto g = grad_at(t);
    std::vector<double> sums(2 * tensors.size(), 0.0);
    std::vector<std::vector<optim::tensor_piece>> pieces(ranks);
    auto args = [&](int r) {
      float* const* base = st.pointers();
      static thread_local std::vector<float*> s;
      s.assign(base, base + O::state_slots);
      for (auto& p : s) p += r * part;
      return optim::step_args{.n = part, .w = w.data() + r * part, .g = g.data() + r * part, .state = s.data(),
                              .step = t, .lr = lr, .grad_scale = scale};
    };
    for (int r = 0; r < ranks; ++r) {
      const std::int64_t p0 = r * part, p1 = p0 + part;
      for (std::size_t k = 0; k < tensors.size(); ++k) {
        const auto b = std::max(tensors[k].offset, p0), e = std::min(tensors[k].offset + tensors[k].n, p1);
        if (b < e) pieces[r].push_back({b - p0, e - p0, static_cast<std::int64_t>(k), tensors[k].adapt});
      }
      opt.template prepare<host>(args(r), pieces[r], sums.data());
    }
    for (int r = 0; r < ranks; ++r) opt.template apply<host>(args(r), pieces[r], sums.data());
  }
  return w;
}

// Bound: float arithmetic against double over five steps; measured 4.8e-7 (the message prints it).
constexpr double bound = 2e-6;

void check_close(const std::vector<float>& want, const std::vector<float>& got) {
  const auto d = dml_test::max_abs_difference(want, got);
  MESSAGE("max_abs_diff=" << d);
  CHECK(d.value <= bound);
}

}  // namespace

TEST_CASE("lamb: the fused passes match Algorithm 2, whole or cut into shards; padding stays zero") {
  for (float clip : {0.f, 0.5f}) {
    const optim::lamb::options o{.lr = 0.05f, .weight_decay = 0.1f, .trust_clip = clip};
    const auto want = lamb_reference(o, 0.05f, 0.5f);
    for (int ranks : {1, 2, 4, 5}) {
      CAPTURE(ranks);
      CAPTURE(clip);
      const auto got = run_dml(optim::lamb{o}, 0.05f, 0.5f, ranks);
      check_close(want, got);
      CHECK(got[31] == 0.f);  // padding
      CHECK(got[40] == 0.f);
    }
  }
}

TEST_CASE("lars: the fused passes match Algorithm 1, whole or cut into shards") {
  for (float clip : {0.f, 0.002f}) {
    const optim::lars::options o{.lr = 2.f, .momentum = 0.9f, .weight_decay = 1e-3f, .eta = 0.01f, .trust_clip = clip};
    const auto want = lars_reference(o, 2.f, 0.5f);
    for (int ranks : {1, 2, 4, 5}) {
      CAPTURE(ranks);
      CAPTURE(clip);
      check_close(want, run_dml(optim::lars{o}, 2.f, 0.5f, ranks));
    }
  }
}

TEST_CASE("lamb and lars: update() is one adapted tensor; a zero norm gives ratio 1") {
  // One tensor of 4 weights, all zero: ‖w‖ = 0, so the ratio is 1 and LAMB's first step is Adam's: −lr·sign(g)
  // (eps must be > 0; 1e-30 vanishes beside |g| in float).
  std::vector<float> w(4, 0.f), g{1.f, -2.f, 0.5f, 3.f};
  optim::state<optim::lamb> st(4);
  optim::lamb{{.eps = 1e-30f}}.update<host>({.n = 4, .w = w.data(), .g = g.data(), .state = st.pointers(), .step = 1, .lr = 0.1f});
  for (std::size_t i = 0; i < 4; ++i) CHECK(w[i] == doctest::Approx(g[i] > 0 ? -0.1 : 0.1));
  // A nonzero tensor: the LAMB step's norm is lr·‖w‖ (the trust ratio's point), whatever the gradient's size.
  std::vector<float> w2{3.f, 4.f, 0.f, 0.f}, w2_0 = w2;
  optim::state<optim::lamb> st2(4);
  optim::lamb{{.weight_decay = 0.f}}.update<host>(
      {.n = 4, .w = w2.data(), .g = g.data(), .state = st2.pointers(), .step = 1, .lr = 0.1f, .grad_scale = 1000.f});
  double step = 0;
  for (std::size_t i = 0; i < 4; ++i) step += double(w2[i] - w2_0[i]) * (w2[i] - w2_0[i]);
  CHECK(std::sqrt(step) == doctest::Approx(0.1 * 5.0).epsilon(1e-6));
  // LARS with zero gradients and momentum 0: ratio 1, decay only: w −= lr·β·w.
  std::vector<float> w3{1.f, 2.f}, z{0.f, 0.f};
  optim::state<optim::lars> st3(2);
  optim::lars{{.momentum = 0.f, .weight_decay = 0.1f}}.update<host>(
      {.n = 2, .w = w3.data(), .g = z.data(), .state = st3.pointers(), .step = 1, .lr = 0.5f});
  CHECK(w3[0] == doctest::Approx(1 - 0.05));
  CHECK(w3[1] == doctest::Approx(2 - 0.1));
}

TEST_CASE("any_of: lamb and lars chosen at run time update as themselves; adamw stays element-wise") {
  using any = optim::any_of<optim::adamw, optim::lamb, optim::lars>;
  static_assert(optim::layerwise_v<any>);
  CHECK(!optim::uses_layerwise(any::by_name("adamw")));
  CHECK(optim::uses_layerwise(any::by_name("lamb")));
  CHECK(optim::uses_layerwise(any::by_name("lars")));
  const any chosen = optim::lamb{{.lr = 0.05f, .weight_decay = 0.1f}};
  const auto want = run_dml(optim::lamb{{.lr = 0.05f, .weight_decay = 0.1f}}, 0.05f, 1.f, 2);
  const auto got = run_dml(chosen, 0.05f, 1.f, 2);
  CHECK(dml_test::max_abs_difference(want, got).value == 0.0);
  const any adamw = optim::adamw{};
  std::vector<double> sums(2, 0.0);
  const optim::tensor_piece one{0, 1, 0, true};
  float x = 1.f, gx = 1.f;
  optim::state<any> st(1);
  CHECK_THROWS_AS(adamw.prepare<host>({.n = 1, .w = &x, .g = &gx, .state = st.pointers()}, std::span(&one, 1), sums.data()),
                  invalid_argument);
}

TEST_CASE("lamb and lars: bad settings fail at construction, naming the setting") {
  auto says = [](auto make, const std::string& what) {
    const auto msg = dml_test::error_of<invalid_argument>(make);
    CHECK_MESSAGE(msg.find(what) != std::string::npos, msg);
  };
  says([] { optim::lamb{{.trust_clip = -1.f}}; }, "trust_clip");
  says([] { optim::lamb{{.beta1 = 1.f}}; }, "beta1");
  says([] { optim::lamb{{.beta2 = -0.1f}}; }, "beta2");
  says([] { optim::lamb{{.lr = -1.f}}; }, "lr");
  says([] { optim::lamb{{.eps = -1.f}}; }, "eps");
  says([] { optim::lamb{{.weight_decay = -1.f}}; }, "weight_decay");
  says([] { optim::lars{{.trust_clip = -0.5f}}; }, "trust_clip");
  says([] { optim::lars{{.eta = 0.f}}; }, "eta");
  says([] { optim::lars{{.momentum = 1.f}}; }, "momentum");
  says([] { optim::lars{{.weight_decay = -1.f}}; }, "weight_decay");
  says([] { optim::lars{{.lr = -1.f}}; }, "lr");
}

}  // namespace test_layerwise
