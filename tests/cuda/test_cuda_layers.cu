// SPDX-License-Identifier: Apache-2.0
// tests/cuda/test_cuda_layers.cu — every layer, the loss, the GEMM and every optimizer run in dml::cuda
// and compared with dml::host (or a plain loop) on the same random data. Needs a GPU (ctest label gpu).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/buffer.hpp"
#include "dml/core/gemm.hpp"
#include "dml/nn/activation.hpp"
#include "dml/nn/dropout.hpp"
#include "dml/nn/embedding.hpp"
#include "dml/nn/layernorm.hpp"
#include "dml/nn/linear.hpp"
#include "dml/nn/loss.hpp"
#include "dml/nn/network.hpp"
#include "dml/optim/adagrad.hpp"
#include "dml/optim/adam.hpp"
#include "dml/optim/clip.hpp"
#include "dml/optim/sgd.hpp"

namespace {

int failures = 0;
int checks = 0;
std::mt19937 gen{20240607};

std::vector<float> random_vector(std::size_t n, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

template <class T>
dml::buffer<T, dml::cuda> to_device(const std::vector<T>& v) {
  dml::buffer<T, dml::cuda> b(v.size());
  dml::copy_n(v.data(), v.size(), b.data());
  return b;
}
template <class T>
std::vector<T> to_host(const T* p, std::size_t n) {
  std::vector<T> v(n);
  dml::copy_n(p, n, v.data());
  return v;
}

// |got − want| <= atol + rtol·|want| everywhere (NaN fails); prints the largest difference seen.
void expect_close(const std::string& what, const std::vector<float>& got, const std::vector<float>& want,
                  float atol = 1e-5f, float rtol = 1e-4f) {
  ++checks;
  bool ok = got.size() == want.size();
  double max_diff = 0.0;
  std::size_t worst = 0;
  for (std::size_t i = 0; got.size() == want.size() && i < got.size(); ++i) {
    const double diff = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(diff <= atol + rtol * std::fabs(want[i])) && ok) {
      ok = false;
      worst = i;
    }
    max_diff = std::isnan(diff) ? INFINITY : std::max(max_diff, diff);
  }
  std::printf("%-4s %-52s n=%-8zu max_abs_diff=%.3g\n", ok ? "ok" : "FAIL", what.c_str(), want.size(), max_diff);
  if (!ok) {
    ++failures;
    if (got.size() != want.size())
      std::printf("     expected %zu values, found %zu\n", want.size(), got.size());
    else
      std::printf("     first bad index %zu: cuda %.9g, reference %.9g\n", worst, got[worst], want[worst]);
  }
}
void expect_close(const std::string& what, float got, float want, float atol = 1e-5f, float rtol = 1e-4f) {
  expect_close(what, std::vector<float>{got}, std::vector<float>{want}, atol, rtol);
}
void expect_true(const std::string& what, bool ok) {
  ++checks;
  std::printf("%-4s %s\n", ok ? "ok" : "FAIL", what.c_str());
  if (!ok) ++failures;
}

// ---- GEMM: cuBLASLt against a double-precision loop -------------------------------------------

void check_gemm(dml::trans ta, dml::trans tb, std::int64_t m, std::int64_t n, std::int64_t k, bool bias, bool relu,
                float beta, std::int64_t pad, std::int64_t offset) {
  const bool at = ta == dml::trans::t, bt = tb == dml::trans::t;
  // Stored shapes (before op) with `pad` extra columns so strides differ from widths.
  const std::int64_t a_rows = at ? k : m, a_cols = (at ? m : k) + pad;
  const std::int64_t b_rows = bt ? n : k, b_cols = (bt ? k : n) + pad;
  const std::int64_t ldc = n + pad;
  const auto a = random_vector(static_cast<std::size_t>(a_rows * a_cols + offset));
  const auto b = random_vector(static_cast<std::size_t>(b_rows * b_cols + offset));
  const auto bv = random_vector(static_cast<std::size_t>(n + offset));
  const auto c0 = random_vector(static_cast<std::size_t>(m * ldc + offset));

  std::vector<float> want = c0;
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      for (std::int64_t p = 0; p < k; ++p) {
        const float av = at ? a[offset + p * a_cols + i] : a[offset + i * a_cols + p];
        const float bw = bt ? b[offset + j * b_cols + p] : b[offset + p * b_cols + j];
        acc += static_cast<double>(av) * bw;
      }
      if (beta != 0.f) acc += beta * static_cast<double>(c0[offset + i * ldc + j]);
      if (bias) acc += bv[offset + j];
      if (relu && acc < 0.0) acc = 0.0;
      want[offset + i * ldc + j] = static_cast<float>(acc);
    }

  auto da = to_device(a), db = to_device(b), dbias = to_device(bv);
  // With beta = 0, C must not be read: start it as NaN so a read would show.
  auto c_init = c0;
  if (beta == 0.f)
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) c_init[offset + i * ldc + j] = std::numeric_limits<float>::quiet_NaN();
  auto dc = to_device(c_init);
  dml::gemm<dml::cuda>({.ta = ta, .tb = tb, .m = m, .n = n, .k = k, .a = da.data() + offset, .lda = a_cols,
                        .b = db.data() + offset, .ldb = b_cols, .c = dc.data() + offset, .ldc = ldc, .beta = beta,
                        .bias = bias ? dbias.data() + offset : nullptr,
                        .ep = relu ? dml::epilogue::relu : dml::epilogue::none});
  const std::string name = std::string("gemm ") + (at ? "t" : "n") + (bt ? "t" : "n") + " m=" + std::to_string(m) +
                           " n=" + std::to_string(n) + " k=" + std::to_string(k) + (bias ? " bias" : "") +
                           (relu ? " relu" : "") + (beta != 0.f ? " beta=1" : "") +
                           (offset ? " offset=" + std::to_string(offset) : "");
  expect_close(name, to_host(dc.data(), dc.size()), want, 1e-4f, 1e-4f);
}

void gemm_tests() {
  for (auto ta : {dml::trans::n, dml::trans::t})
    for (auto tb : {dml::trans::n, dml::trans::t})
      for (int bias = 0; bias < 2; ++bias)
        for (int relu = 0; relu < 2; ++relu)
          for (float beta : {0.f, 1.f}) check_gemm(ta, tb, 37, 53, 29, bias, relu, beta, 3, 0);
  // Views into flat buffers are only 4-byte aligned in general; the heuristic must respect that.
  check_gemm(dml::trans::n, dml::trans::t, 64, 96, 128, true, true, 0.f, 0, 1);
  check_gemm(dml::trans::t, dml::trans::n, 96, 64, 128, false, false, 1.f, 0, 3);
  // The bias-gradient GEMV of linear: n = 1, ldb = ldc = 1.
  check_gemm(dml::trans::t, dml::trans::n, 47, 1, 300, false, false, 1.f, 0, 0);
  // Empty reductions and empty outputs.
  check_gemm(dml::trans::n, dml::trans::n, 5, 7, 0, true, true, 1.f, 1, 0);
  check_gemm(dml::trans::n, dml::trans::n, 5, 7, 0, false, false, 0.f, 0, 0);
  check_gemm(dml::trans::n, dml::trans::n, 0, 7, 4, true, false, 0.f, 0, 0);
  // Large enough for tensor-core-sized tiles and a split-k choice.
  check_gemm(dml::trans::n, dml::trans::t, 256, 512, 1024, true, false, 0.f, 0, 0);
}

// ---- layers: network<cuda, L> against network<host, L> ---------------------------------------

struct layer_case {
  dml::shape in;
  std::vector<float> x;
  bool want_dx = true;
};

template <class Layer>
void check_layer(const std::string& name, const Layer& layer, const layer_case& lc, float atol = 1e-5f,
                 float rtol = 1e-4f) {
  using seq = dml::nn::sequential<Layer>;
  dml::nn::network<dml::host, Layer> h{seq{layer}, 7};
  dml::nn::network<dml::cuda, Layer> d{seq{layer}, 7};
  // The same starting parameters on both sides (normal() may differ in the last bit between libms).
  dml::copy_n(h.params().data(), h.params().size(), d.params().data());
  const dml::nn::context c{.training = true, .seed = 11, .step = 3, .row_offset = 5};

  auto dx_in = to_device(lc.x);
  const auto yh = h.forward({lc.x.data(), lc.in}, c);
  const auto yd = d.forward({dx_in.data(), lc.in}, c);
  const auto y_host = std::vector<float>(yh.data, yh.data + yh.numel());
  expect_close(name + " forward", to_host(yd.data, static_cast<std::size_t>(yd.numel())), y_host, atol, rtol);

  const auto dy = random_vector(static_cast<std::size_t>(yh.numel()));
  auto ddy = to_device(dy);
  for (int pass = 0; pass < 2; ++pass) {
    // The second pass accumulates into the gradients of the first, as micro-batches do.
    dml::nn::context cb = c;
    cb.accumulate = pass == 1;
    const auto gxh = h.backward({dy.data(), yh.shape}, cb, lc.want_dx);
    const auto gxd = d.backward({ddy.data(), yd.shape}, cb, lc.want_dx);
    const std::string tag = name + (pass ? " backward (accumulate)" : " backward");
    if (!h.grads().empty())
      expect_close(tag + " param grads", to_host(d.grads().data(), d.grads().size()),
                   std::vector<float>(h.grads().begin(), h.grads().end()), atol, rtol);
    if (lc.want_dx)
      expect_close(tag + " dx", to_host(gxd.data, static_cast<std::size_t>(gxd.numel())),
                   std::vector<float>(gxh.data, gxh.data + gxh.numel()), atol, rtol);
  }
}

layer_case dense_case(std::int64_t rows, std::int64_t cols, float scale = 1.f) {
  return {{rows, cols}, random_vector(static_cast<std::size_t>(rows * cols), -scale, scale)};
}

void layer_tests() {
  check_layer("linear(33, 47)", dml::nn::linear{33, 47}, dense_case(64, 33), 1e-5f, 1e-4f);
  check_layer("linear(128, 96, no bias)", dml::nn::linear{128, 96, false}, dense_case(200, 128), 1e-5f, 1e-4f);
  check_layer("linear<16, 8>", dml::nn::linear<16, 8>{}, dense_case(5, 16));
  check_layer("relu", dml::nn::relu{}, dense_case(64, 100));
  check_layer("gelu", dml::nn::gelu{}, dense_case(64, 100, 4.f), 1e-6f, 1e-5f);
  check_layer("dropout(0.3)", dml::nn::dropout{0.3f}, dense_case(64, 100));
  // Both block sizes of the fused kernel; a width that is not a multiple of the block; a large mean.
  check_layer("layernorm(7)", dml::nn::layernorm{7}, dense_case(300, 7, 3.f), 1e-5f, 1e-4f);
  check_layer("layernorm(300)", dml::nn::layernorm{300}, dense_case(129, 300), 1e-5f, 1e-4f);
  check_layer("layernorm(1500)", dml::nn::layernorm{1500}, dense_case(33, 1500), 1e-5f, 1e-4f);
  {
    layer_case lc = dense_case(40, 64);
    for (auto& v : lc.x) v += 100.f;
    check_layer("layernorm(64), mean 100", dml::nn::layernorm{64}, lc, 1e-4f, 1e-3f);
  }
  {
    // Ids with repeats, so several tokens add into one table row.
    std::uniform_int_distribution<int> id(0, 9);
    layer_case lc{{6, 5}, std::vector<float>(30), false};
    for (auto& v : lc.x) v = static_cast<float>(id(gen));
    check_layer("embedding(10, 24)", dml::nn::embedding{10, 24}, lc);
  }
}

// ---- softmax + cross-entropy ------------------------------------------------------------------

void check_loss(std::int64_t rows, std::int64_t n, float spread) {
  const auto x = random_vector(static_cast<std::size_t>(rows * n), -spread, spread);
  std::vector<std::int32_t> labels(static_cast<std::size_t>(rows));
  std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(n - 1));
  for (auto& l : labels) l = pick(gen);
  const dml::shape s{rows, n};
  const std::string name = "softmax_cross_entropy rows=" + std::to_string(rows) + " n=" + std::to_string(n);

  std::vector<float> gh(x.size()), lh(labels.size());
  const dml::nn::softmax_cross_entropy loss;
  const float loss_h =
      loss.forward_backward<dml::host, float>({x.data(), s}, labels.data(), {gh.data(), s}, lh.data(), rows * 2);
  auto dx = to_device(x);
  auto dl = to_device(labels);
  dml::buffer<float, dml::cuda> dg(x.size()), drow(labels.size());
  const float loss_d = loss.forward_backward<dml::cuda, float>({dx.data(), s}, dl.data(), {dg.data(), s}, drow.data(), rows * 2);
  expect_close(name + " loss", loss_d, loss_h, 1e-5f, 1e-5f);
  expect_close(name + " dlogits", to_host(dg.data(), dg.size()), gh, 1e-7f, 1e-4f);
  const float loss_only = loss.forward_backward<dml::cuda, float>({dx.data(), s}, dl.data(), {}, drow.data());
  expect_close(name + " loss without dlogits", loss_only, loss_h * 2.f, 1e-5f, 1e-5f);
  expect_true(name + " count_correct",
              dml::nn::count_correct<dml::cuda, float>({dx.data(), s}, dl.data()) ==
                  dml::nn::count_correct<dml::host, float>({x.data(), s}, labels.data()));
}

void loss_tests() {
  check_loss(256, 10, 3.f);     // a classifier head: the one-warp kernel
  check_loss(33, 3000, 10.f);   // a vocabulary: the wide kernel
  check_loss(7, 257, 50.f);     // just past the switch, with large logits (the max shift matters)
  {
    // A label outside [0, n) cannot throw on the device; it must show as a NaN loss.
    const std::vector<float> x = random_vector(20);
    auto dx = to_device(x);
    auto dl = to_device(std::vector<std::int32_t>{1, 10});
    dml::buffer<float, dml::cuda> drow(2);
    const float l = dml::nn::softmax_cross_entropy{}.forward_backward<dml::cuda, float>({dx.data(), {2, 10}}, dl.data(), {},
                                                                                  drow.data());
    expect_true("softmax_cross_entropy bad label gives NaN", std::isnan(l));
  }
}

// ---- optimizers -------------------------------------------------------------------------------

template <class O>
void check_optimizer(const std::string& name, const O& opt) {
  const std::int64_t n = 10003;
  auto w = random_vector(static_cast<std::size_t>(n));
  dml::optim::state<O, dml::host> sh(n);
  dml::optim::state<O, dml::cuda> sd(n);
  auto dw = to_device(w);
  for (std::int64_t step = 1; step <= 3; ++step) {
    const auto g = random_vector(static_cast<std::size_t>(n));
    auto dg = to_device(g);
    const dml::optim::step_args ha{.n = n, .w = w.data(), .g = g.data(), .state = sh.pointers(), .step = step,
                                   .lr = 0.01f, .grad_scale = 0.5f};
    dml::optim::step_args da = ha;
    da.w = dw.data();
    da.g = dg.data();
    da.state = sd.pointers();
    opt.template update<dml::host>(ha);
    opt.template update<dml::cuda>(da);
  }
  expect_close(name + " weights after 3 steps", to_host(dw.data(), dw.size()), w, 1e-6f, 1e-5f);
  for (int s = 0; s < O::state_slots; ++s)
    expect_close(name + " state " + std::to_string(s), to_host(sd.slot(s).data(), sd.slot(s).size()),
                 std::vector<float>(sh.slot(s).begin(), sh.slot(s).end()), 1e-6f, 1e-5f);
}

void optimizer_tests() {
  check_optimizer("sgd", dml::optim::sgd{{.lr = 0.01f}});
  check_optimizer("sgd momentum nesterov wd", dml::optim::sgd{{.lr = 0.01f, .momentum = 0.9f, .weight_decay = 1e-2f,
                                                               .nesterov = true}});
  check_optimizer("sgd momentum dampening", dml::optim::sgd{{.lr = 0.01f, .momentum = 0.9f, .dampening = 0.1f}});
  check_optimizer("adam wd", dml::optim::adam{{.weight_decay = 1e-2f}});
  check_optimizer("adamw", dml::optim::adamw{});
  check_optimizer("adagrad", dml::optim::adagrad{{.lr_decay = 0.01f, .weight_decay = 1e-2f}});

  const auto g = random_vector(100001);
  auto dg = to_device(g);
  const double nh = dml::optim::squared_norm<dml::host>(g.data(), static_cast<std::int64_t>(g.size()));
  const double nd = dml::optim::squared_norm<dml::cuda>(dg.data(), static_cast<std::int64_t>(g.size()));
  expect_close("squared_norm", static_cast<float>(nd), static_cast<float>(nh), 0.f, 1e-6f);
}

// ---- a whole model trained a few steps on both sides ------------------------------------------

template <class S, class Model>
struct network_for;
template <class S, class... L>
struct network_for<S, dml::nn::sequential<L...>> {
  using type = dml::nn::network<S, L...>;
};

void training_test() {
  using namespace dml::nn;
  const auto make = [] {
    return sequential{linear{20, 64}, layernorm{64}, gelu{}, dropout{0.1f}, linear{64, 64}, relu{}, linear{64, 10}};
  };
  using model_t = decltype(make());
  using host_net = network_for<dml::host, model_t>::type;
  using cuda_net = network_for<dml::cuda, model_t>::type;
  host_net h{make(), 5};
  cuda_net d{make(), 5};
  dml::copy_n(h.params().data(), h.params().size(), d.params().data());

  const std::int64_t rows = 128, total = h.layout().total;
  const dml::optim::adamw opt{{.lr = 1e-2f}};
  dml::optim::state<dml::optim::adamw, dml::host> sh(total);
  dml::optim::state<dml::optim::adamw, dml::cuda> sd(total);
  std::vector<float> gh(static_cast<std::size_t>(rows * 10)), rl(static_cast<std::size_t>(rows));
  dml::buffer<float, dml::cuda> gd(gh.size()), rld(rl.size());
  std::vector<float> losses_h, losses_d;
  std::uniform_int_distribution<std::int32_t> pick(0, 9);
  for (std::uint64_t step = 1; step <= 5; ++step) {
    const auto x = random_vector(static_cast<std::size_t>(rows * 20));
    std::vector<std::int32_t> labels(static_cast<std::size_t>(rows));
    for (auto& l : labels) l = pick(gen);
    auto dx = to_device(x);
    auto dl = to_device(labels);
    const context c{.training = true, .seed = 3, .step = step};
    const auto yh = h.forward({x.data(), {rows, 20}}, c);
    const auto yd = d.forward({dx.data(), {rows, 20}}, c);
    losses_h.push_back(softmax_cross_entropy{}.forward_backward<dml::host, float>(yh, labels.data(), {gh.data(), yh.shape},
                                                                           rl.data()));
    losses_d.push_back(softmax_cross_entropy{}.forward_backward<dml::cuda, float>(yd, dl.data(), {gd.data(), yd.shape},
                                                                           rld.data()));
    h.backward({gh.data(), yh.shape}, c);
    d.backward({gd.data(), yd.shape}, c);
    const auto s = static_cast<std::int64_t>(step);
    opt.update<dml::host>({.n = total, .w = h.params().data(), .g = h.grads().data(), .state = sh.pointers(),
                           .step = s, .lr = 1e-2f});
    opt.update<dml::cuda>({.n = total, .w = d.params().data(), .g = d.grads().data(), .state = sd.pointers(),
                           .step = s, .lr = 1e-2f});
  }
  expect_close("mlp + layernorm + adamw: losses over 5 steps", losses_d, losses_h, 1e-4f, 1e-4f);
  expect_close("mlp + layernorm + adamw: parameters after 5 steps", to_host(d.params().data(), d.params().size()),
               std::vector<float>(h.params().begin(), h.params().end()), 1e-4f, 1e-3f);
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("dml_cuda_smoke: no CUDA device; skipped\n");
    return 77;  // ctest's SKIP_RETURN_CODE
  }
  cudaDeviceProp prop{};
  DML_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("dml_cuda_smoke on %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  try {
    gemm_tests();
    layer_tests();
    loss_tests();
    optimizer_tests();
    training_test();
    DML_CHECK_CUDA(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    std::printf("FAIL exception: %s\n", e.what());
    return 1;
  }
  std::printf("%d of %d checks failed\n", failures, checks);
  return failures == 0 ? 0 : 1;
}
