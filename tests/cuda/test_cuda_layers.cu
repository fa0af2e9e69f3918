// SPDX-License-Identifier: Apache-2.0
// tests/cuda/test_cuda_layers.cu — every layer, the loss, the GEMM and every optimizer run in dml::cuda
// and compared with dml::host (or a plain loop) on the same random data: every DML_HOST_DEVICE functor of nn/
// and optim/ runs on both sides here, in tests/cuda/test_cuda_attention.cu (causal attention) or in
// tests/cuda/test_cuda_gpt.cu (the GPT's embedding, blocks and head). Needs a GPU (ctest label gpu); without
// one it prints `SKIPPED: <reason>` and exits 77.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/buffer.hpp"
#include "dml/core/gemm.hpp"
#include "dml/nn/activation.hpp"
#include "dml/nn/dropout.hpp"
#include "dml/nn/embedding.hpp"
#include "dml/nn/gpt.hpp"
#include "dml/nn/layernorm.hpp"
#include "dml/nn/linear.hpp"
#include "dml/nn/loss.hpp"
#include "dml/nn/moe.hpp"
#include "dml/nn/network.hpp"
#include "dml/nn/rank_group.hpp"
#include "dml/nn/ring_attention.hpp"
#include "dml/optim/adagrad.hpp"
#include "dml/optim/adam.hpp"
#include "dml/optim/clip.hpp"
#include "dml/optim/loss_scaler.hpp"
#include "dml/optim/sgd.hpp"
#include "../support.hpp"
#include "gpu_skip.hpp"

namespace {

int failures = 0;
int checks = 0;
std::mt19937 gen{20240607};

using namespace dml_test;  // random_vector, to_device, to_host

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

// A group of two seen from its rank 0, so that one process runs the functors that only tensor or context
// parallelism reaches: sums leave this rank's values (the partner adds zeros), the maximum and gathers see the
// partner holding the same values, and a ring step receives what this rank sent. Host and CUDA get the same
// arithmetic on the same data, which is what these checks compare.
class standin_pair final : public dml::nn::rank_group {
 public:
  standin_pair() : rank_group(0, 2) {}

 private:
  static void copy(void* dst, const void* src, std::int64_t n, dml::dtype t) {
    // cudaMemcpyDefault copies between any two of host and device memory, in order with the legacy stream.
    if (n > 0 && dst != src)
      DML_CHECK_CUDA(cudaMemcpy(dst, src, static_cast<std::size_t>(n) * dml::dtype_size(t), cudaMemcpyDefault));
  }
  [[noreturn]] static void unused(const char* op) { dml::fail("standin_pair: ", op, " is not used by these checks"); }
  void do_all_reduce(dml::typed_ptr, std::int64_t) override {}
  void do_all_reduce_max(float*, std::int64_t) override {}
  void do_all_gather(dml::const_typed_ptr in, dml::typed_ptr out, std::int64_t n) override {
    copy(out.ptr, in.ptr, n, in.type);
    const auto bytes = n * static_cast<std::int64_t>(dml::dtype_size(in.type));
    copy(static_cast<std::byte*>(out.ptr) + bytes, in.ptr, n, in.type);
  }
  void do_reduce_scatter(dml::const_typed_ptr in, dml::typed_ptr out, std::int64_t n) override {
    copy(out.ptr, in.ptr, n, in.type);
  }
  void do_all_reduce_sum(double*, std::int64_t) override {}
  void do_all_to_allv(dml::const_typed_ptr, const std::int64_t*, dml::typed_ptr, const std::int64_t*) override {
    unused("all_to_allv");
  }
  void do_all_to_all(const std::int64_t*, std::int64_t*, std::int64_t) override { unused("all_to_all"); }
  dml::nn::group_request do_isend(dml::const_typed_ptr, std::int64_t, int, int) override { unused("isend"); }
  dml::nn::group_request do_irecv(dml::typed_ptr, std::int64_t, int, int) override { unused("irecv"); }
  dml::nn::group_request do_isendrecv(dml::const_typed_ptr send, int, dml::typed_ptr recv, int, std::int64_t n,
                                      int) override {
    copy(recv.ptr, send.ptr, n, send.type);
    return {};
  }
};

// ---- GEMM: cuBLASLt against a double-precision loop -------------------------------------------

void check_gemm(dml::trans ta, dml::trans tb, std::int64_t m, std::int64_t n, std::int64_t k, bool bias, bool relu,
                float beta, std::int64_t pad, std::int64_t offset) {
  const bool at = ta == dml::trans::t, bt = tb == dml::trans::t;
  // Stored shapes (before op) with `pad` extra columns so strides differ from widths.
  const std::int64_t a_rows = at ? k : m, a_cols = (at ? m : k) + pad;
  const std::int64_t b_rows = bt ? n : k, b_cols = (bt ? k : n) + pad;
  const std::int64_t ldc = n + pad;
  const auto a = random_vector(gen, static_cast<std::size_t>(a_rows * a_cols + offset));
  const auto b = random_vector(gen, static_cast<std::size_t>(b_rows * b_cols + offset));
  const auto bv = random_vector(gen, static_cast<std::size_t>(n + offset));
  const auto c0 = random_vector(gen, static_cast<std::size_t>(m * ldc + offset));

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

// What a layer check may add: parameters to start from instead of the initial ones (host order, the layout's
// total), and a tensor-parallel group for a split layer.
struct layer_extras {
  const std::vector<float>* params = nullptr;
  dml::nn::rank_group* tp = nullptr;
};

template <class Layer>
void check_layer(const std::string& name, const Layer& layer, const layer_case& lc, float atol = 1e-5f,
                 float rtol = 1e-4f, const layer_extras& extra = {}) {
  using seq = dml::nn::sequential<Layer>;
  dml::nn::network<dml::host, Layer> h{seq{layer}, 7};
  dml::nn::network<dml::cuda, Layer> d{seq{layer}, 7};
  // The initial parameters (init_param) drawn on each side from the same seed: normal() may differ in the
  // last bit between the host's libm and CUDA's.
  expect_close(name + " initial parameters", to_host(d.params().data(), d.params().size()),
               std::vector<float>(h.params().begin(), h.params().end()), 1e-6f, 1e-5f);
  if (extra.params) dml::copy_n(extra.params->data(), h.params().size(), h.params().data());
  // From here on the same starting parameters on both sides.
  dml::copy_n(h.params().data(), h.params().size(), d.params().data());
  const dml::nn::context c{.training = true, .seed = 11, .step = 3, .row_offset = 5, .tp = extra.tp};

  auto dx_in = to_device(lc.x);
  const auto yh = h.forward({lc.x.data(), lc.in}, c);
  const auto yd = d.forward({dx_in.data(), lc.in}, c);
  const auto y_host = std::vector<float>(yh.data, yh.data + yh.numel());
  expect_close(name + " forward", to_host(yd.data, static_cast<std::size_t>(yd.numel())), y_host, atol, rtol);

  const auto dy = random_vector(gen, static_cast<std::size_t>(yh.numel()));
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
  return {{rows, cols}, random_vector(gen, static_cast<std::size_t>(rows * cols), -scale, scale)};
}

void layer_tests() {
  check_layer("linear(33, 47)", dml::nn::linear{33, 47}, dense_case(64, 33), 1e-5f, 1e-4f);
  check_layer("linear(128, 96, no bias)", dml::nn::linear{128, 96, false}, dense_case(200, 128), 1e-5f, 1e-4f);
  check_layer("linear<16, 8>", dml::nn::linear<16, 8>{}, dense_case(5, 16));
  check_layer("relu", dml::nn::relu{}, dense_case(64, 100));
  // The host's tanh is a polynomial that vectorises (core/math.hpp): GELU's derivative is within 1.3e-6 of a
  // double reference over [-4, 4], CUDA's tanhf within 4.3e-7; with |dy| <= 1 the two sides differ by up to 1.7e-6.
  check_layer("gelu", dml::nn::gelu{}, dense_case(64, 100, 4.f), 2e-6f, 1e-5f);
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

// ---- parts that only tensor or expert parallelism and sharded trainers reach -------------------------

// init_param_range: part of one parameter's initial values, as a trainer that keeps a shard of it draws them.
void check_init_range() {
  const auto layer = dml::nn::linear{33, 47};
  using Layer = std::remove_const_t<decltype(layer)>;
  dml::nn::network<dml::host, Layer> h{dml::nn::sequential<Layer>{layer}, 7};
  dml::nn::network<dml::cuda, Layer> d{dml::nn::sequential<Layer>{layer}, 7};
  for (std::size_t slot = 0; slot < h.layout().slots.size(); ++slot) {
    const std::int64_t numel = h.layout().slots[slot].shape.numel(), begin = numel / 3, end = numel - 2;
    std::vector<float> hv(static_cast<std::size_t>(end - begin));
    dml::buffer<float, dml::cuda> dv(hv.size());
    h.init_range(9, slot, begin, end, hv.data());
    d.init_range(9, slot, begin, end, dv.data());
    expect_close("init_range linear(33, 47) " + h.layout().slots[slot].name, to_host(dv.data(), dv.size()), hv, 1e-6f,
                 1e-5f);
  }
}

// The smallest gap, over tokens, between the router logits that decide the top-k (the k-th against the
// (k+1)-th, and the chosen ones among themselves), in double from the host's parameters.
double routing_margin(const dml::nn::moe& m, const dml::nn::param_slot& router, const std::vector<float>& params,
                      const std::vector<float>& x, std::int64_t rows) {
  const std::int64_t C = m.cfg.dim, E = m.cfg.experts;
  double margin = 1e300;
  for (std::int64_t t = 0; t < rows; ++t) {
    std::vector<double> l(static_cast<std::size_t>(E));
    for (std::int64_t e = 0; e < E; ++e)
      for (std::int64_t j = 0; j < C; ++j)
        l[static_cast<std::size_t>(e)] += double(x[static_cast<std::size_t>(t * C + j)]) *
                                          params[static_cast<std::size_t>(router.offset + e * C + j)];
    std::sort(l.begin(), l.end(), std::greater<>());
    for (int k = 0; k < m.cfg.top_k && k + 1 < E; ++k)
      margin = std::min(margin, l[static_cast<std::size_t>(k)] - l[static_cast<std::size_t>(k + 1)]);
  }
  return margin;
}

// Mixture of experts on one rank (moe_gather_rows, moe_combine, moe_gate_grad; column_sum and
// gelu_backward_inplace with biases). Routing is decided on the host from the router's logits, which the two
// GEMMs round differently: parameters and inputs are drawn until every deciding gap exceeds 1e-3, far above
// that rounding (~1e-6), so both sides route every token alike.
void check_moe(const std::string& name, const dml::nn::moe_config& cfg) {
  const dml::nn::moe layer(cfg);
  const dml::nn::network<dml::host, dml::nn::moe> probe{dml::nn::sequential<dml::nn::moe>{layer}, 7};
  const auto& router = probe.layout().slots[0];  // parameters() lists router.weight first
  const auto params = random_vector(gen, static_cast<std::size_t>(probe.layout().total), -0.5f, 0.5f);
  const std::int64_t rows = 64;
  layer_case lc{{rows, cfg.dim}, {}};
  bool clear = false;
  for (int attempt = 0; attempt < 1000 && !clear; ++attempt) {
    lc.x = random_vector(gen, static_cast<std::size_t>(rows * cfg.dim));
    clear = routing_margin(layer, router, params, lc.x, rows) > 1e-3;
  }
  expect_true(name + ": inputs whose routing rounding cannot change", clear);
  if (clear) check_layer(name, layer, lc, 1e-5f, 1e-3f, {.params = &params});
}

// The GPT embedding split over a (stand-in) tensor group of two: lookups of this rank's vocabulary rows, then
// add_positions with dropout; sequence parallel also takes the reduce-scatter and all-gather paths.
void check_split_embedding(bool sequence) {
  standin_pair tp;
  dml::nn::gpt_config g;
  g.vocab = 64;
  g.seq = 16;
  g.d_model = 32;
  g.dropout = 0.1f;
  dml::nn::gpt_embedding e(g);
  e.set_split({.ranks = 2, .rank = 0, .sequence = sequence});
  std::uniform_int_distribution<int> id(0, 63);  // ids of both ranks' halves of the vocabulary
  layer_case lc{{3, 16}, std::vector<float>(48), false};
  for (auto& v : lc.x) v = static_cast<float>(id(gen));
  check_layer(std::string("gpt_embedding split over 2, rank 0") + (sequence ? ", sequence parallel" : ""), e, lc,
              1e-6f, 1e-5f, {.tp = &tp});
}

void parallel_layer_tests() {
  check_init_range();
  dml::nn::moe_config gshard;
  gshard.dim = 16;
  gshard.hidden = 32;
  gshard.experts = 4;
  gshard.top_k = 2;
  gshard.capacity_factor = 1.25f;  // some tokens dropped
  gshard.bias = true;
  check_moe("moe(16, 4 experts, top-2, capacity 1.25, bias)", gshard);
  dml::nn::moe_config sw = gshard;
  sw.top_k = 1;
  sw.capacity_factor = 0.f;  // dropless
  sw.bias = false;
  check_moe("moe(16, 4 experts, top-1, dropless)", sw);
  check_split_embedding(false);
  check_split_embedding(true);
}

// ---- softmax + cross-entropy ------------------------------------------------------------------

void check_loss(std::int64_t rows, std::int64_t n, float spread) {
  const auto x = random_vector(gen, static_cast<std::size_t>(rows * n), -spread, spread);
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

// bf16 logits: on CUDA the per-row functor (softmax_xent_row), not the float kernel; and argmax_hit in bf16.
void check_loss_bf16(std::int64_t rows, std::int64_t n) {
  const auto xf = random_vector(gen, static_cast<std::size_t>(rows * n), -3.f, 3.f);
  std::vector<dml::bf16> x(xf.size());
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = dml::bf16(xf[i]);
  std::vector<std::int32_t> labels(static_cast<std::size_t>(rows));
  std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(n - 1));
  for (auto& l : labels) l = pick(gen);
  const dml::shape s{rows, n};
  const std::string name = "softmax_cross_entropy bf16 rows=" + std::to_string(rows) + " n=" + std::to_string(n);
  const dml::nn::softmax_cross_entropy loss;
  std::vector<dml::bf16> gh(x.size());
  std::vector<float> rh(labels.size());
  const float loss_h =
      loss.forward_backward<dml::host, dml::bf16>({x.data(), s}, labels.data(), {gh.data(), s}, rh.data());
  auto dx = to_device(x);
  auto dl = to_device(labels);
  dml::buffer<dml::bf16, dml::cuda> dg(x.size());
  dml::buffer<float, dml::cuda> drow(labels.size());
  const float loss_d =
      loss.forward_backward<dml::cuda, dml::bf16>({dx.data(), s}, dl.data(), {dg.data(), s}, drow.data());
  expect_close(name + " loss", loss_d, loss_h, 1e-5f, 1e-5f);
  // Float arithmetic rounded to bf16 once: expf's last bit may move a value across a rounding boundary, one
  // bf16 unit (at most 2^-7 relative).
  const auto widen = [](const std::vector<dml::bf16>& v) { return std::vector<float>(v.begin(), v.end()); };
  expect_close(name + " dlogits", widen(to_host(dg.data(), dg.size())), widen(gh), 1e-7f, 1e-2f);
  expect_true(name + " count_correct",
              dml::nn::count_correct<dml::cuda, dml::bf16>({dx.data(), s}, dl.data()) ==
                  dml::nn::count_correct<dml::host, dml::bf16>({x.data(), s}, labels.data()));
}

// The vocabulary-parallel form (row_max, row_sum_exp_and_label, parallel_xent_row) over a stand-in group of
// two: this rank's n columns, labels anywhere in the whole vocabulary of 2n.
void check_parallel_loss(std::int64_t rows, std::int64_t n) {
  standin_pair tp;
  const auto x = random_vector(gen, static_cast<std::size_t>(rows * n), -5.f, 5.f);
  std::vector<std::int32_t> labels(static_cast<std::size_t>(rows));
  std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(2 * n - 1));
  for (auto& l : labels) l = pick(gen);
  const dml::shape s{rows, n};
  const std::string name = "vocabulary-parallel cross-entropy rows=" + std::to_string(rows) + " n=" + std::to_string(n);
  const auto scratch = static_cast<std::size_t>(dml::nn::cross_entropy_scratch(rows, &tp));
  const dml::nn::softmax_cross_entropy loss;
  std::vector<float> gh(x.size()), sh(scratch);
  const float loss_h = loss.forward_backward<dml::host, float>({x.data(), s}, labels.data(), {gh.data(), s}, sh.data(),
                                                               rows * 2, 1.f, &tp);
  auto dx = to_device(x);
  auto dl = to_device(labels);
  dml::buffer<float, dml::cuda> dg(x.size()), ds(scratch);
  const float loss_d = loss.forward_backward<dml::cuda, float>({dx.data(), s}, dl.data(), {dg.data(), s}, ds.data(),
                                                               rows * 2, 1.f, &tp);
  expect_close(name + " loss", loss_d, loss_h, 1e-5f, 1e-5f);
  expect_close(name + " dlogits", to_host(dg.data(), dg.size()), gh, 1e-7f, 1e-4f);
}

void loss_tests() {
  check_loss_bf16(64, 10);
  check_loss_bf16(9, 1000);
  check_parallel_loss(64, 10);
  check_parallel_loss(7, 300);
  check_loss(256, 10, 3.f);     // a classifier head: the one-warp kernel
  check_loss(33, 3000, 10.f);   // a vocabulary: the wide kernel
  check_loss(7, 257, 50.f);     // just past the switch, with large logits (the max shift matters)
  {
    // A label outside [0, n) cannot throw on the device; it must show as a NaN loss.
    const std::vector<float> x = random_vector(gen, 20);
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
  auto w = random_vector(gen, static_cast<std::size_t>(n));
  dml::optim::state<O, dml::host> sh(n);
  dml::optim::state<O, dml::cuda> sd(n);
  auto dw = to_device(w);
  for (std::int64_t step = 1; step <= 3; ++step) {
    const auto g = random_vector(gen, static_cast<std::size_t>(n));
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

// has_nonfinite (count_nonfinite): the loss scaler's overflow test, by exponent bits, in each 16-bit type too.
template <class T>
T special(bool nan, bool negative) {
  if constexpr (std::is_same_v<T, float>) {
    const float v = nan ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
    return negative ? -v : v;
  } else if constexpr (std::is_same_v<T, dml::bf16>) {
    return T::from_bits(static_cast<std::uint16_t>((negative ? 0x8000u : 0u) | (nan ? 0x7fc0u : 0x7f80u)));
  } else {
    return T::from_bits(static_cast<std::uint16_t>((negative ? 0x8000u : 0u) | (nan ? 0x7e00u : 0x7c00u)));
  }
}
template <class T>
void check_nonfinite(const char* type) {
  const std::int64_t n = 100003;
  const auto f = random_vector(gen, static_cast<std::size_t>(n), -60000.f, 60000.f);  // finite in fp16 too
  std::vector<T> v(f.size());
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = T(f[i]);
  struct poison {
    const char* what;
    std::int64_t at;  // -1: none
    bool nan, negative;
  };
  for (const poison& p : {poison{"finite", -1, false, false}, poison{"+inf last", n - 1, false, false},
                          poison{"NaN in the middle", n / 2, true, false}, poison{"-inf first", 0, false, true}}) {
    auto w = v;
    if (p.at >= 0) w[static_cast<std::size_t>(p.at)] = special<T>(p.nan, p.negative);
    auto dw = to_device(w);
    const bool want = p.at >= 0;
    const bool host = dml::optim::has_nonfinite<dml::host, T>(w.data(), n);
    const bool cuda = dml::optim::has_nonfinite<dml::cuda, T>(dw.data(), n);
    expect_true(std::string("has_nonfinite ") + type + " " + p.what + ": host " + (host ? "yes" : "no") + ", cuda " +
                    (cuda ? "yes" : "no"),
                host == want && cuda == want);
  }
}

void optimizer_tests() {
  check_optimizer("sgd", dml::optim::sgd{{.lr = 0.01f}});
  check_optimizer("sgd momentum nesterov wd", dml::optim::sgd{{.lr = 0.01f, .momentum = 0.9f, .weight_decay = 1e-2f,
                                                               .nesterov = true}});
  check_optimizer("sgd momentum dampening", dml::optim::sgd{{.lr = 0.01f, .momentum = 0.9f, .dampening = 0.1f}});
  check_optimizer("adam wd", dml::optim::adam{{.weight_decay = 1e-2f}});
  check_optimizer("adamw", dml::optim::adamw{});
  check_optimizer("adagrad", dml::optim::adagrad{{.lr_decay = 0.01f, .weight_decay = 1e-2f}});

  check_nonfinite<float>("float");
  check_nonfinite<dml::bf16>("bf16");
  check_nonfinite<dml::fp16>("fp16");

  const auto g = random_vector(gen, 100001);
  auto dg = to_device(g);
  const double nh = dml::optim::squared_norm<dml::host>(g.data(), static_cast<std::int64_t>(g.size()));
  const double nd = dml::optim::squared_norm<dml::cuda>(dg.data(), static_cast<std::int64_t>(g.size()));
  expect_close("squared_norm", static_cast<float>(nd), static_cast<float>(nh), 0.f, 1e-6f);
}

// ---- ring attention (context parallelism) -------------------------------------------------------

// Forward (ring_forward_row, ring_forward_finish) and backward (ring_backward_dot, ring_backward_row) on one
// rank, and around a stand-in ring of two (ring_pack_kv, ring_zero_columns, ring_unpack_dkv; the block that
// travels back is this rank's own, seen at the partner's positions).
void check_ring_attention(const dml::nn::ring_attention_shape& s, const dml::nn::cp_layout& at) {
  standin_pair pair;
  dml::nn::rank_group* cp = at.ranks > 1 ? &pair : nullptr;
  const std::int64_t local = s.seq / at.ranks, w = s.width();
  const auto qkv = random_vector(gen, static_cast<std::size_t>(s.batch * local * 3 * w), -2.f, 2.f);
  const auto dy = random_vector(gen, static_cast<std::size_t>(s.batch * local * w));
  const auto saved = static_cast<std::size_t>(dml::nn::ring_attention_saved_size(s, at));
  const auto scratch = static_cast<std::size_t>(dml::nn::ring_attention_workspace_size(s, at));
  std::vector<float> y(dy.size()), lse(saved), dqkv(qkv.size()), work(scratch);
  dml::nn::ring_attention_forward<dml::host>(s, at, cp, qkv.data(), y.data(), lse.data(), work.data());
  dml::nn::ring_attention_backward<dml::host>(s, at, cp, qkv.data(), static_cast<const float*>(y.data()), lse.data(),
                                              dy.data(), dqkv.data(), work.data());
  auto d_qkv = to_device(qkv), d_dy = to_device(dy);
  dml::buffer<float, dml::cuda> d_y(y.size()), d_lse(saved), d_dqkv(qkv.size()), d_work(scratch);
  dml::nn::ring_attention_forward<dml::cuda>(s, at, cp, static_cast<const float*>(d_qkv.data()), d_y.data(),
                                             d_lse.data(), d_work.data());
  dml::nn::ring_attention_backward<dml::cuda>(
      s, at, cp, static_cast<const float*>(d_qkv.data()), static_cast<const float*>(d_y.data()),
      static_cast<const float*>(d_lse.data()), static_cast<const float*>(d_dy.data()), d_dqkv.data(), d_work.data());
  const std::string layout = at.ranks > 1 ? (at.zigzag ? " (zig-zag)" : " (contiguous)") : "";
  const std::string name = std::string("ring attention ") + (s.causal ? "causal" : "full") + " over " +
                           std::to_string(at.ranks) + layout +
                           " b=" + std::to_string(s.batch) + " t=" + std::to_string(s.seq) + " h=" +
                           std::to_string(s.heads) + " hd=" + std::to_string(s.head_dim);
  expect_close(name + " y", to_host(d_y.data(), d_y.size()), y, 1e-5f, 1e-4f);
  expect_close(name + " lse", to_host(d_lse.data(), d_lse.size()), lse, 1e-5f, 1e-4f);
  expect_close(name + " dqkv", to_host(d_dqkv.data(), d_dqkv.size()), dqkv, 1e-5f, 1e-4f);
}

void ring_attention_tests() {
  for (bool causal : {true, false}) {
    const dml::nn::ring_attention_shape s{.batch = 2, .seq = 16, .heads = 2, .head_dim = 8, .causal = causal};
    check_ring_attention(s, {.ranks = 1, .rank = 0});
    check_ring_attention(s, {.ranks = 2, .rank = 0, .zigzag = true});
    check_ring_attention(s, {.ranks = 2, .rank = 0, .zigzag = false});
  }
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
    const auto x = random_vector(gen, static_cast<std::size_t>(rows * 20));
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
  if (gpu_skip::skip_without_device()) return gpu_skip::exit_code;
  cudaDeviceProp prop{};
  DML_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("dml_cuda_smoke on %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  try {
    gemm_tests();
    layer_tests();
    parallel_layer_tests();
    loss_tests();
    optimizer_tests();
    ring_attention_tests();
    training_test();
    DML_CHECK_CUDA(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    std::printf("FAIL exception: %s\n", e.what());
    return 1;
  }
  std::printf("%d of %d checks failed\n", failures, checks);
  return failures == 0 ? 0 : 1;
}
