// SPDX-License-Identifier: Apache-2.0
// benchmarks/compressed.cpp — compressed gradient all-reduce (parallel/compressed.hpp) beside the dense all-reduce,
// in the same run: bytes on the wire per rank, time, and the dense-equivalent bus bandwidth. See benchmarks/README.md.
// `compressed --comm local --ranks 2` or `mpirun -np 2 compressed --comm mpi`.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "dml/comm/local.hpp"
#include "dml/parallel/compressed.hpp"
#include "dml/train/flags.hpp"

#include "bench_common.hpp"
#if defined(DML_BENCH_MPI)
#  include "dml/comm/mpi.hpp"
#endif

namespace {

using clk = std::chrono::steady_clock;

struct config {
  std::string comm = "local";
  int ranks = 2;
  std::vector<std::string> compress{"onebit", "topk:0.05"};
  std::vector<std::int64_t> mib{1, 16, 64};
  int iters = 5;
};

// The fastest of `iters` timed calls (after one untimed), in seconds, the same on every rank.
template <class Comm, class F>
double fastest(Comm& c, int iters, F f) {
  f();
  double best = 1e30;
  for (int i = 0; i < iters; ++i) {
    c.barrier();
    const auto t0 = clk::now();
    f();
    c.barrier();
    best = std::min(best, std::chrono::duration<double>(clk::now() - t0).count());
  }
  return best;
}

template <class Comm>
void run(Comm& c, const config& cfg) {
  const int n = c.size();
  if (c.rank() == 0) {
    std::printf("# compressed all-reduce vs dense on %s, %d rank(s); bytes sent per rank per call; busbw: the dense\n"
                "# all-reduce's bus bytes 2(N-1)/N·size over the time (what a dense one would need to match it)\n",
                cfg.comm.c_str(), n);
    std::printf("# %10s %12s %14s %10s %12s %10s %12s\n", "size", "compress", "wire_bytes", "ratio", "time(us)",
                "speedup", "busbw(GB/s)");
  }
  for (const auto m : cfg.mib) {
    const std::size_t count = static_cast<std::size_t>(m) * 1024 * 1024 / 4 / static_cast<std::size_t>(n) *
                              static_cast<std::size_t>(n);
    const double bus = 2.0 * (n - 1) / n * 4.0 * static_cast<double>(count);
    std::vector<float> g(count), work(count);
    for (std::size_t i = 0; i < count; ++i) g[i] = static_cast<float>((i * 2654435761u + c.rank()) % 1000) * 1e-3f - 0.5f;
    const double dense = fastest(c, cfg.iters, [&] {
      std::copy(g.begin(), g.end(), work.begin());
      c.all_reduce(std::span<float>(work), dml::comm::reduce_op::sum);
    });
    if (c.rank() == 0)
      std::printf("  %10zu %12s %14.0f %10.2f %12.1f %10.2f %12.2f\n", 4 * count, "none", bus, 1.0, dense * 1e6, 1.0,
                  bus / dense / 1e9);
    for (const auto& spec : cfg.compress) {
      dml::parallel::compressed_reducer red(dml::parallel::gradient_compression::parse(spec), count, count / n);
      std::int64_t calls = 0;
      const double t = fastest(c, cfg.iters, [&] {
        std::copy(g.begin(), g.end(), work.begin());
        red.all_reduce(c, std::span<float>(work), 0, 0);
        ++calls;
      });
      const double sent = static_cast<double>(red.bytes().sent) / static_cast<double>(calls);
      if (c.rank() == 0)
        std::printf("  %10zu %12s %14.0f %10.2f %12.1f %10.2f %12.2f\n", 4 * count, spec.c_str(), sent, bus / sent,
                    t * 1e6, dense / t, bus / t / 1e9);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  config cfg;
  dml::flags f("compressed", "Compressed gradient all-reduce (1-bit, top-k, error feedback) beside the dense one.");
  f.add("--comm", cfg.comm, "C", "communicator; mpi under mpirun").choices({"local", "mpi"});
  f.add("--ranks", cfg.ranks, "N", "comm::local ranks").min(1);
  f.add("--compress", cfg.compress, "C,C", "compressions to time: onebit, onebit:B, topk:F")
      .check(dml::parallel::gradient_compression::spec_problem);
  f.add("--mib", cfg.mib, "M,M", "gradient sizes in MiB").min(1);
  f.add("--iters", cfg.iters, "N", "timed calls per size; the fastest is kept").min(1);
  if (const auto status = dml_bench::parse_for_main(f, argc, argv, [] {})) return *status;
  if (cfg.comm == "mpi") {
#if defined(DML_BENCH_MPI)
    dml::comm::mpi::environment env(&argc, &argv);
    dml::comm::mpi world(MPI_COMM_WORLD);
    run(world, cfg);
    return 0;
#else
    std::fprintf(stderr, "compressed: error: --comm mpi: expected a build with MPI, found none\n");
    return 2;
#endif
  }
  dml::comm::local::run(cfg.ranks, [&](dml::comm::local& c) { run(c, cfg); });
  return 0;
}
