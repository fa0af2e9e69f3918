// SPDX-License-Identifier: Apache-2.0
// benchmarks/bench_common.hpp — what the benchmarks share: timing, the machine's load, synthetic data.
// Sits on dml/dml.hpp and dml/train/flags.hpp (every benchmark's command line); used by gpt_throughput, pipeline_throughput and train_throughput.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>
#include <utility>

#include <sys/resource.h>
#include <unistd.h>

#include "dml/dml.hpp"

#include "dml/train/flags.hpp"

namespace dml_bench {

// cli.parse_for_main, and then, in a build for smoke runs (CMake's DML_PROGRAMS_OPTIMIZATION), a warning that the
// figures to come are not dml's; nothing is added to --help or to a flag's error.
template <class Flags, class... Check>
auto parse_for_main(Flags& cli, int argc, char** argv, Check&&... check) {
  auto status = cli.parse_for_main(argc, argv, std::forward<Check>(check)...);
#if defined(DML_PROGRAMS_OPTIMIZATION)
  if (!status)
    std::fprintf(stderr, "warning: built with DML_PROGRAMS_OPTIMIZATION=%s for smoke runs: these figures are not "
                         "dml's (build with a preset for those)\n", DML_PROGRAMS_OPTIMIZATION);
#endif
  return status;
}

// The kinds of a rank's compute actions in its schedule list, in order. The k-th compute_begin of a step is the k-th
// of them: an event's bucket is its index in the lowered program, which also holds unshard and reduction steps.
inline std::vector<dml::schedule::op> compute_kinds(const std::vector<dml::schedule::action>& list) {
  std::vector<dml::schedule::op> kinds;
  for (const auto& a : list)
    if (dml::schedule::is_compute(a.kind)) kinds.push_back(a.kind);
  return kinds;
}

using clock_type = std::chrono::steady_clock;
inline double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// One step's GEMMs, traced (dml::detail::host_gemm_trace), and that step's wall time.
struct step_trace {
  std::vector<dml::gemm_call> calls;
  double seconds = 0;
};
template <class Step>
step_trace trace_step(Step&& step) {
  step_trace t;
  dml::detail::host_gemm_trace = &t.calls;
  const auto t0 = clock_type::now();
  step();
  t.seconds = seconds_since(t0);
  dml::detail::host_gemm_trace = nullptr;
  return t;
}

// CPU time of the whole machine and of this process, to report how busy other processes kept the cores.
struct load_meter {
  double machine_busy = 0, machine_total = 0, self = 0;
  static load_meter now() {
    load_meter m;
    if (std::FILE* f = std::fopen("/proc/stat", "r")) {
      unsigned long long v[8] = {};
      if (std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                      &v[6], &v[7]) == 8) {
        const double tick = double(sysconf(_SC_CLK_TCK));
        for (auto x : v) m.machine_total += double(x) / tick;
        m.machine_busy = m.machine_total - double(v[3] + v[4]) / tick;  // less idle and iowait
      }
      std::fclose(f);
    }
    // This process and the children it has waited for (gpt_throughput's PyTorch runs).
    for (const int who : {RUSAGE_SELF, RUSAGE_CHILDREN}) {
      rusage u{};
      getrusage(who, &u);
      m.self += double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
    }
    return m;
  }
  // Share of the machine's CPU time that other processes used since `start`; −1: unknown.
  static double others_since(const load_meter& start) {
    const load_meter end = now();
    const double total = end.machine_total - start.machine_total;
    if (total <= 0) return -1;
    return std::max(0.0, (end.machine_busy - start.machine_busy) - (end.self - start.self)) / total;
  }
};

// `rows` rows of 784 uniform inputs and labels in [0, 10) for the MLP benchmarks, from Philox stream `stream`.
inline void synthetic_batch(std::int64_t rows, int stream, std::vector<float>& x, std::vector<std::int32_t>& y) {
  x.resize(static_cast<std::size_t>(rows * 784));
  y.resize(static_cast<std::size_t>(rows));
  const dml::rng_stream rng{42, static_cast<std::uint64_t>(stream)};
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = rng.uniform(i);
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(rng.block(1u << 30 | i)[0] % 10);
}

}  // namespace dml_bench
