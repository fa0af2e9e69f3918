// SPDX-License-Identifier: Apache-2.0
// benchmarks/kernel_throughput.cpp — dml's host row kernels (LayerNorm forward and backward, GELU forward and
// backward, the causal softmax and its backward, softmax with cross-entropy) in f32 and bf16, each beside memcpy of
// the same bytes in the same run: values per second, bytes per second and their share of memcpy's. The bytes are
// what a kernel must read and write at the least (its inputs once, its outputs once), so the share says how near
// the kernel runs to the copy that moves them.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "dml/dml.hpp"
#include "dml/plan/calibrate.hpp"

#include "bench_common.hpp"

namespace {

using namespace dml;

struct options {
  std::int64_t tokens = 2048, d_model = 384, heads = 6, seq = 256, xent_rows = 128, vocab = 50257;
  int threads = 1, repeats = 7;
  bool quick = false;
};

// Each figure is the fastest of `repeats` calls after a warm one (cost::detail::seconds_per_call): other processes
// only ever slow a call down. Memcpy moving `bytes` (half read, half written) is the baseline each kernel is set
// beside.
double memcpy_seconds(double bytes, int repeats) {
  const auto half = static_cast<std::size_t>(bytes / 2);
  std::vector<char> src(half, 1), dst(half);
  return cost::detail::seconds_per_call([&] { std::memcpy(dst.data(), src.data(), half); }, repeats);
}

struct row {
  std::string kernel, shape;
  double values = 0, bytes = 0;  // per call: the values it produces, and the bytes it reads and writes at the least
  std::function<void()> call;
};

void report(const row& r, const char* dtype, int repeats) {
  const double s = cost::detail::seconds_per_call(r.call, repeats), copy = memcpy_seconds(r.bytes, repeats);
  std::printf("%-26s %-18s %-5s %9.3f %10.2f %8.2f %12.2f %9.2f\n", r.kernel.c_str(), r.shape.c_str(), dtype, s * 1e3,
              r.values / s / 1e9, r.bytes / s / 1e9, r.bytes / copy / 1e9, copy / s);
}

std::string dims(std::int64_t a, std::int64_t b) { return std::to_string(a) + " x " + std::to_string(b); }

template <class T>
void run(const options& o, const char* dtype) {
  const double w = sizeof(T);
  const std::int64_t C = o.d_model, N = o.tokens * C, F = 4 * N;
  auto filled = [](std::int64_t n, float scale) {
    std::vector<T> v(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = T(scale * static_cast<float>(static_cast<int>(i * 7919 % 2001) - 1000) / 1000.f);
    return v;
  };
  const nn::context ctx{};
  std::vector<row> rows;

  // LayerNorm over tokens × d_model: forward reads x and writes y; backward reads x and dy and writes dx (the
  // parameters' gradients, 2·d_model values, are left out of the bytes).
  auto x = filled(N, 2.f), y = filled(N, 0.f), dy = filled(N, 1.f), dx = filled(N, 0.f);
  auto ln_w = filled(C, 1.f), ln_b = filled(C, 0.1f), ln_gw = filled(C, 0.f), ln_gb = filled(C, 0.f);
  T* ln_weights[] = {ln_w.data(), ln_b.data()};
  T* ln_grads[] = {ln_gw.data(), ln_gb.data()};
  const nn::layernorm ln(C);
  std::vector<float> stats(static_cast<std::size_t>(ln.workspace_size({o.tokens, C})));
  nn::context ln_ctx{};
  ln_ctx.workspace = stats.data();
  const nn::layer_params<T> ln_p{ln_weights, ln_grads};
  const tensor_view<const T> xv(x.data(), {o.tokens, C}), dyv(dy.data(), {o.tokens, C});
  rows.push_back({"layernorm forward", dims(o.tokens, C), double(N), 2 * N * w,
                  [&] { ln.forward<host, T>(ctx, ln_p, xv, tensor_view<T>(y.data(), {o.tokens, C})); }});
  rows.push_back({"layernorm backward", dims(o.tokens, C), double(N), 3 * N * w, [&] {
                    ln.backward<host, T>(ln_ctx, ln_p, xv, tensor_view<const T>(y.data(), {o.tokens, C}), dyv,
                                         tensor_view<T>(dx.data(), {o.tokens, C}));
                  }});

  // GELU over the MLP's hidden values (tokens × 4·d_model).
  auto hx = filled(F, 3.f), hy = filled(F, 0.f), hdy = filled(F, 1.f), hdx = filled(F, 0.f);
  const tensor_view<const T> hxv(hx.data(), {o.tokens, 4 * C});
  rows.push_back({"gelu forward", dims(o.tokens, 4 * C), double(F), 2 * F * w,
                  [&] { nn::gelu{}.forward<host, T>(ctx, {}, hxv, tensor_view<T>(hy.data(), {o.tokens, 4 * C})); }});
  rows.push_back({"gelu backward", dims(o.tokens, 4 * C), double(F), 3 * F * w, [&] {
                    nn::gelu{}.backward<host, T>(ctx, {}, hxv, {}, tensor_view<const T>(hdy.data(), {o.tokens, 4 * C}),
                                                 tensor_view<T>(hdx.data(), {o.tokens, 4 * C}));
                  }});

  // The causal softmax over (tokens / seq)·heads·seq rows of seq scores, in place: row t reads and writes its t + 1
  // visible values (the backward reads the probabilities too).
  const std::int64_t srows = o.tokens / o.seq * o.heads * o.seq;
  const double visible = double(srows / o.seq) * double(o.seq) * double(o.seq + 1) / 2;
  // In place, on what the last call left (probabilities, and gradients that shrink by the scale each call).
  auto p = filled(srows * o.seq, 4.f), d = filled(srows * o.seq, 1.f);
  const float scale = 1.f / std::sqrt(static_cast<float>(C / o.heads));
  rows.push_back({"causal softmax", dims(srows, o.seq), visible, 2 * visible * w,
                  [&] { nn::detail::causal_softmax_rows<host>(p.data(), srows, o.seq, scale); }});
  rows.push_back({"causal softmax backward", dims(srows, o.seq), visible, 3 * visible * w,
                  [&] { nn::detail::causal_softmax_backward_rows<host>(p.data(), d.data(), srows, o.seq, scale); }});

  // Softmax with cross-entropy over xent_rows rows of the vocabulary: reads the logits, writes their gradient.
  const std::int64_t L = o.xent_rows * o.vocab;
  auto logits = filled(L, 8.f), dlogits = filled(L, 0.f);
  std::vector<std::int32_t> labels(static_cast<std::size_t>(o.xent_rows));
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i * 7919 % o.vocab);
  std::vector<float> row_loss(labels.size());
  rows.push_back({"softmax cross-entropy", dims(o.xent_rows, o.vocab), double(L), 2 * L * w, [&] {
                    nn::softmax_cross_entropy{}.forward_backward<host, T>(
                        tensor_view<const T>(logits.data(), {o.xent_rows, o.vocab}), labels.data(),
                        tensor_view<T>(dlogits.data(), {o.xent_rows, o.vocab}), row_loss.data());
                  }});

  for (const auto& r : rows) report(r, dtype, o.repeats);
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  dml::flags cli("kernel_throughput", "dml's host row kernels in f32 and bf16 beside memcpy of the same bytes.");
  cli.add("--tokens", o.tokens, "N", "rows of the LayerNorm, GELU and attention passes").min(1);
  cli.add("--d-model", o.d_model, "C", "LayerNorm width; GELU runs over 4C").min(1);
  cli.add("--heads", o.heads, "H", "attention heads (C / H per head)").min(1);
  cli.add("--seq", o.seq, "S", "sequence length of the causal softmax (divides --tokens)").min(1);
  cli.add("--xent-rows", o.xent_rows, "R", "rows of the cross-entropy").min(1);
  cli.add("--vocab", o.vocab, "V", "columns of the cross-entropy").min(2);
  cli.add("--threads", o.threads, "T", "threads (dml::set_thread_budget)").min(1);
  cli.add("--repeats", o.repeats, "R", "timed calls per figure; the fastest is kept").min(1);
  cli.add_switch("--quick", o.quick, "small shapes, one timed call (a smoke run)");
  if (const auto status = dml_bench::parse_for_main(cli, argc, argv)) return *status;
  if (o.quick) {
    o.tokens = 256, o.seq = 64, o.xent_rows = 8, o.vocab = 1000, o.repeats = 1;
  }
  if (o.tokens % o.seq != 0 || o.d_model % o.heads != 0) {
    std::fprintf(stderr, "kernel_throughput: expected --seq to divide --tokens and --heads to divide --d-model, found "
                         "%lld, %lld, %lld and %lld\n", static_cast<long long>(o.seq), static_cast<long long>(o.tokens),
                 static_cast<long long>(o.heads), static_cast<long long>(o.d_model));
    return 2;
  }
  dml::set_thread_budget(o.threads);
  const auto start = dml_bench::load_meter::now();
  std::printf("# %s; %d thread(s); each figure the fastest of %d calls after a warm one, memcpy of the same bytes "
              "timed the same way beside it\n", dml::host_cpu_model().c_str(), o.threads, o.repeats);
  std::printf("%-26s %-18s %-5s %9s %10s %8s %12s %9s\n", "kernel", "shape", "dtype", "ms", "Gvalues/s", "GB/s",
              "memcpy GB/s", "of memcpy");
  run<float>(o, "f32");
  run<dml::bf16>(o, "bf16");
  std::printf("# other processes used %.0f%% of the machine meanwhile\n", 100 * dml_bench::load_meter::others_since(start));
  return 0;
}
