// SPDX-License-Identifier: Apache-2.0
// benchmarks/attention_throughput.cpp — causal attention forward + backward on the host, the tile attention
// (nn/tile_attention.hpp) beside the T×T attention (nn/attention.hpp) in the same run, for sequence lengths from
// --min-seq to --max-seq: milliseconds per call, their ratio, and the bytes each keeps for backward plus the
// scratch it needs. Both read the same q, k, v and write the same gradients. The tiles' GFLOP/s (the products
// they run) stand beside the roofline of one tile's product, measured in the same run, and the speed-up beside the
// one the products alone allow (the T×T attention's FLOPs over the tiles'), were both to run at one rate.
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "dml/dml.hpp"
#include "dml/plan/calibrate.hpp"

#include "bench_common.hpp"

namespace {

struct options {
  std::int64_t batch = 1, heads = 6, head_dim = 64, min_seq = 256, max_seq = 8192, max_dense_seq = 8192;
  int threads = 1, repeats = 3;
  bool quick = false;
};

std::vector<float> random_values(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

struct figures {
  double ms = 0, bytes = 0;  // forward + backward; kept for backward + scratch
};

figures dense(const options& o, std::int64_t seq, const std::vector<float>& qkv, const std::vector<float>& dy) {
  const dml::nn::attention_shape s{o.batch, seq, o.heads, o.head_dim};
  std::vector<float> probs(static_cast<std::size_t>(dml::nn::attention_saved_size(s))), y(dy.size()), dqkv(qkv.size()),
      scratch(static_cast<std::size_t>(dml::nn::attention_scratch_size(s)));
  const double sec = dml::cost::detail::seconds_per_call(
      [&] {
        dml::nn::causal_attention_forward<dml::host>(s, qkv.data(), probs.data(), y.data());
        dml::nn::causal_attention_backward<dml::host>(s, qkv.data(), probs.data(), dy.data(), dqkv.data(), scratch.data());
      },
      o.repeats);
  return {1e3 * sec, 4.0 * static_cast<double>(probs.size() + scratch.size())};
}

figures tiles(const options& o, std::int64_t seq, const std::vector<float>& qkv, const std::vector<float>& dy) {
  const dml::nn::tile_attention_shape s{o.batch, seq, o.heads, 0, o.head_dim};
  std::vector<float> lse(static_cast<std::size_t>(dml::nn::tile_attention_saved_size(s))), y(dy.size()), dqkv(qkv.size()),
      ws(static_cast<std::size_t>(dml::nn::tile_attention_workspace_size(s)));
  const double sec = dml::cost::detail::seconds_per_call(
      [&] {
        dml::nn::tile_attention_forward<dml::host>(s, qkv.data(), y.data(), lse.data());
        dml::nn::tile_attention_backward<dml::host>(s, qkv.data(), y.data(), lse.data(), dy.data(), dqkv.data(), ws.data());
      },
      o.repeats);
  return {1e3 * sec, 4.0 * static_cast<double>(lse.size() + ws.size())};
}

// FLOPs of the products the tiles run in forward + backward: 2 a visible tile pair forward (q·kᵀ, p·v) and 5
// backward (q·kᵀ again, dO·vᵀ, dV, dK, dQ), each 2·rows·keys·head_dim, over the causal pairs of tiles.
double tile_flops(const options& o, std::int64_t seq) {
  const std::int64_t n = dml::nn::kernels::attention_tile;
  double pairs = 0;  // Σ rows·keys over the visible pairs
  for (std::int64_t q0 = 0; q0 < seq; q0 += n)
    pairs += static_cast<double>(std::min(n, seq - q0)) * static_cast<double>(std::min(seq, q0 + n));
  return 7 * 2 * pairs * static_cast<double>(o.head_dim * o.batch * o.heads);
}

// FLOPs of the T×T attention's products: q·kᵀ and p·v forward, dO·vᵀ, dQ, dK and dV backward, each over the whole
// T × T (its GEMMs skip no masked half).
double dense_flops(const options& o, std::int64_t seq) {
  return 6 * 2 * static_cast<double>(seq) * static_cast<double>(seq) * static_cast<double>(o.head_dim * o.batch * o.heads);
}

// The roofline of those products: one tile's q·kᵀ (128 × 128 × head_dim) by oneDNN's sgemm on this thread, GFLOP/s.
double tile_gemm_gflops(const options& o) {
  const std::int64_t n = dml::nn::kernels::attention_tile;
  const auto a = random_values(static_cast<std::size_t>(n * o.head_dim), 3), b = random_values(a.size(), 4);
  std::vector<float> c(static_cast<std::size_t>(n * n));
  const dml::thread_budget_scope one(1);  // a tile's product runs on one thread, inside the tiles' parallel loop
  const double sec = dml::cost::detail::seconds_per_call(
      [&] {
        dml::detail::host_gemm_sgemm(dml::gemm_args{.ta = dml::trans::n, .tb = dml::trans::t, .m = n, .n = n,
                                                    .k = o.head_dim, .a = a.data(), .lda = o.head_dim, .b = b.data(),
                                                    .ldb = o.head_dim, .c = c.data(), .ldc = n});
      },
      std::max(o.repeats, 200));
  return 2.0 * n * n * static_cast<double>(o.head_dim) / sec / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  dml::flags cli("attention_throughput", "causal attention forward + backward: tiles beside T×T, time and bytes per T.");
  cli.add("--batch", o.batch, "B", "sequences per call").min(1);
  cli.add("--heads", o.heads, "H", "attention heads").min(1);
  cli.add("--head-dim", o.head_dim, "D", "values per head").min(1);
  cli.add("--min-seq", o.min_seq, "T", "shortest sequence (doubled up to --max-seq)").min(1);
  cli.add("--max-seq", o.max_seq, "T", "longest sequence").min(1);
  cli.add("--max-dense-seq", o.max_dense_seq, "T", "longest sequence the T×T attention runs at").min(1);
  cli.add("--threads", o.threads, "N", "threads (dml::set_thread_budget)").min(1);
  cli.add("--repeats", o.repeats, "R", "timed calls per figure; the fastest is kept").min(1);
  cli.add_switch("--quick", o.quick, "short sequences, one timed call (a smoke run)");
  if (const auto status = dml_bench::parse_for_main(cli, argc, argv)) return *status;
  if (o.quick) o.min_seq = 64, o.max_seq = 256, o.repeats = 1;
  dml::set_thread_budget(o.threads);
  const auto start = dml_bench::load_meter::now();
  std::printf("# %s; %d thread(s); batch %lld, %lld heads of %lld; f32; each figure the fastest of %d calls after a "
              "warm one\n", dml::host_cpu_model().c_str(), o.threads, static_cast<long long>(o.batch),
              static_cast<long long>(o.heads), static_cast<long long>(o.head_dim), o.repeats);
  const double roof = tile_gemm_gflops(o);
  std::printf("# roofline of the tiles' products: one %lld × %lld × %lld sgemm at %.1f GFLOP/s on one thread\n",
              static_cast<long long>(dml::nn::kernels::attention_tile),
              static_cast<long long>(dml::nn::kernels::attention_tile), static_cast<long long>(o.head_dim), roof);
  std::printf("# bound: the speed-up the products allow, the T×T attention's FLOPs over the tiles' (the tiles skip the\n"
              "# masked half but recompute q·kᵀ in backward: 7 products a visible tile pair against 6 over all of T × T)\n");
  std::printf("%7s %12s %12s %8s %7s %14s %14s %12s %9s\n", "T", "T×T ms", "tiles ms", "speedup", "bound", "T×T MiB",
              "tiles MiB", "tiles GF/s", "of roof");
  for (std::int64_t seq = o.min_seq; seq <= o.max_seq; seq *= 2) {
    const std::int64_t w = o.heads * o.head_dim;
    const auto qkv = random_values(static_cast<std::size_t>(o.batch * seq * 3 * w), 1);
    const auto dy = random_values(static_cast<std::size_t>(o.batch * seq * w), 2);
    const figures t = tiles(o, seq, qkv, dy);
    const double gflops = tile_flops(o, seq) / (t.ms * 1e-3) / 1e9, share = gflops / (roof * o.threads);
    if (seq <= o.max_dense_seq) {
      const figures d = dense(o, seq, qkv, dy);
      std::printf("%7lld %12.2f %12.2f %7.2fx %6.2fx %14.1f %14.1f %12.1f %8.0f%%\n", static_cast<long long>(seq), d.ms,
                  t.ms, d.ms / t.ms, dense_flops(o, seq) / tile_flops(o, seq), d.bytes / (1 << 20), t.bytes / (1 << 20),
                  gflops, 100 * share);
    } else {
      std::printf("%7lld %12s %12.2f %8s %7s %14s %14.1f %12.1f %8.0f%%\n", static_cast<long long>(seq), "-", t.ms, "-",
                  "-", "-", t.bytes / (1 << 20), gflops, 100 * share);
    }
  }
  std::printf("# other processes used %.0f%% of the machine meanwhile\n", 100 * dml_bench::load_meter::others_since(start));
  return 0;
}
