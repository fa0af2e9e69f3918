// SPDX-License-Identifier: Apache-2.0
// benchmarks/offload_throughput.cpp — optimizer state on disk (trainer_options::offload) measured: steps/s of an
// MLP with the state in memory and in files in --dir, per layout, beside the same run's disk bandwidth (write with
// fdatasync, read with the page cache dropped) and the steps/s that bandwidth allows. Prints a table; --json FILE
// writes one line per result.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "dml/comm/local.hpp"

namespace {

using namespace dml;
using dml_bench::clock_type, dml_bench::seconds_since;

struct options {
  std::int64_t width = 1024, layers = 3, batch = 64;
  int steps = 10, warmup = 2, threads = 1;
  double bucket_mb = 4.0;
  std::string dir = std::filesystem::temp_directory_path().string();
  std::string json;
  bool quick = false;
};

constexpr std::int64_t features = 256, classes = 10;

// Write bandwidth (pwrite, then fdatasync) and read bandwidth (the page cache dropped first) of `bytes` in dir.
std::pair<double, double> disk_bandwidth(const std::string& dir, std::int64_t bytes) {
  const auto path = std::filesystem::path(dir) / ("dml-offload-bench-" + std::to_string(::getpid()));
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) fail<io_error>(path.string(), ": cannot create the bandwidth probe");
  const std::int64_t chunk = 1 << 20;
  std::vector<char> block(static_cast<std::size_t>(chunk), 1);
  auto t0 = clock_type::now();
  for (std::int64_t at = 0; at < bytes; at += chunk)
    if (::pwrite(fd, block.data(), static_cast<std::size_t>(std::min(chunk, bytes - at)), at) < 0)
      fail<io_error>(path.string(), ": writing the bandwidth probe failed");
  ::fdatasync(fd);
  const double w = double(bytes) / seconds_since(t0);
  ::posix_fadvise(fd, 0, bytes, POSIX_FADV_DONTNEED);
  t0 = clock_type::now();
  for (std::int64_t at = 0; at < bytes; at += chunk)
    if (::pread(fd, block.data(), static_cast<std::size_t>(std::min(chunk, bytes - at)), at) < 0)
      fail<io_error>(path.string(), ": reading the bandwidth probe failed");
  const double r = double(bytes) / seconds_since(t0);
  ::close(fd);
  std::filesystem::remove(path);
  return {w, r};
}

struct result {
  double steps_per_s = 0;
  train::memory_report memory;
};

template <class Sharding>
result run(const options& o, int ranks, bool offload) {
  result out;
  comm::local::run(ranks, [&](comm::local& c) {
    set_thread_budget(o.threads);
    train::trainer_options to;
    to.seed = 5;
    if (offload) {
      to.offload = "optimizer:disk:" + o.dir;
      to.offload_bucket_mb = o.bucket_mb;
    }
    nn::sequential model{nn::linear{features, o.width}, nn::relu{}, nn::linear{o.width, o.width}, nn::relu{},
                         nn::linear{o.width, o.width}, nn::relu{}, nn::linear{o.width, classes}};
    trainer<Sharding, optim::adamw> t(c, model, to, optim::adamw({.lr = 1e-3f}));
    const std::int64_t rows = o.batch / ranks;
    std::vector<float> x(static_cast<std::size_t>(rows * features));
    const rng_stream rng{3, static_cast<std::uint64_t>(c.rank())};
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = rng.normal(i);
    std::vector<std::int32_t> y(static_cast<std::size_t>(rows));
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(i % classes);
    clock_type::time_point t0{};
    for (int s = 0; s < o.warmup + o.steps; ++s) {
      if (s == o.warmup) {
        c.barrier();
        t0 = clock_type::now();
      }
      t.step(tensor_view<const float>(x.data(), {rows, features}), y.data(), o.batch);
    }
    c.barrier();
    if (c.rank() == 0) {
      out.steps_per_s = o.steps / seconds_since(t0);
      out.memory = t.memory();
    }
  });
  return out;
}

dml::flags command_line(options& o) {
  dml::flags f("offload_throughput",
               "Steps/s of an MLP with AdamW's state in memory and on disk (--offload optimizer:disk:DIR), beside "
               "the disk's measured bandwidth.");
  f.add("--width", o.width, "N", "hidden width (three hidden layers)").min(1);
  f.add("--batch", o.batch, "N", "global batch").min(2);
  f.add("--steps", o.steps, "N", "timed steps").min(1);
  f.add("--threads", o.threads, "N", "OpenMP threads per rank").min(1);
  f.add("--bucket-mb", o.bucket_mb, "X", "offload bucket size in MiB (all slots)")
      .check([](double mb) { return mb > 0 ? std::string() : "a size > 0"; }, "> 0");
  f.add("--dir", o.dir, "DIR", "where the state files go").check([](const std::string& d) {
    return dml::parallel::offload_directory_problem(d).empty() ? std::string() : "an existing, writable directory";
  });
  f.add("--json", o.json, "FILE", "write one JSON object per result");
  f.add_switch("--quick", o.quick, "a smoke run: tiny");
  return f;
}

}  // namespace

int main(int argc, char** argv) try {
  options o;
  auto cli = command_line(o);
  if (const auto status = dml_bench::parse_for_main(cli, argc, argv, [&] {
        if (o.quick) o.width = 64, o.steps = 2, o.warmup = 1, o.bucket_mb = 0.01;
      }))
    return *status;
  std::FILE* json = o.json.empty() ? nullptr : std::fopen(o.json.c_str(), "w");
  if (!o.json.empty() && !json) dml::fail("--json: cannot write ", o.json);
  std::printf("# offload_throughput on %s, %d hardware threads; %d thread(s) per rank; state files in %s\n",
              dml::host_cpu_model().c_str(), static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)), o.threads, o.dir.c_str());
  // The bandwidth probe writes as much as the largest state (one rank's AdamW state), at least 64 MiB.
  const auto probe_memory = run<parallel::replicate>(o, 1, false).memory;
  const std::int64_t probe = std::max<std::int64_t>(probe_memory.optimizer, o.quick ? 4 << 20 : 64 << 20);
  const auto [wbw, rbw] = disk_bandwidth(o.dir, probe);
  std::printf("# disk in %s: write %.0f MB/s (fdatasync), read %.0f MB/s (page cache dropped), %.0f MiB probe\n",
              o.dir.c_str(), wbw / 1e6, rbw / 1e6, double(probe) / 1048576.0);
  std::printf("# mlp %lld-%lldx3-%lld (%lld parameters), AdamW, global batch %lld, offload bucket %.2f MiB\n",
              static_cast<long long>(features), static_cast<long long>(o.width), static_cast<long long>(classes),
              static_cast<long long>(probe_memory.numel), static_cast<long long>(o.batch), o.bucket_mb);
  std::printf("%-8s %5s %12s %12s %9s %15s %15s %16s\n", "layout", "ranks", "memory st/s", "disk st/s", "ratio",
              "state on disk", "state resident", "disk-bound st/s");
  auto row = [&](const char* name, int ranks, const result& mem, const result& disk) {
    // A step reads and writes the state once: the steps/s the measured bandwidth allows, compute aside.
    const double io = double(disk.memory.offloaded);
    const double bound = 1.0 / (io / rbw + io / wbw);
    std::printf("%-8s %5d %12.2f %12.2f %8.2fx %12.2f MiB %12.3f MiB %16.2f\n", name, ranks, mem.steps_per_s,
                disk.steps_per_s, disk.steps_per_s / mem.steps_per_s, io / 1048576.0,
                double(disk.memory.optimizer) / 1048576.0, bound);
    if (json)
      std::fprintf(json,
                   "{\"layout\":\"%s\",\"ranks\":%d,\"memory_steps_per_s\":%.3f,\"disk_steps_per_s\":%.3f,\"ratio\":%.4f,"
                   "\"offloaded_bytes\":%lld,\"resident_optimizer_bytes\":%lld,\"disk_write_bps\":%.0f,"
                   "\"disk_read_bps\":%.0f,\"disk_bound_steps_per_s\":%.3f}\n",
                   name, ranks, mem.steps_per_s, disk.steps_per_s, disk.steps_per_s / mem.steps_per_s,
                   static_cast<long long>(disk.memory.offloaded), static_cast<long long>(disk.memory.optimizer), wbw,
                   rbw, bound);
  };
  row("ddp", 1, run<parallel::replicate>(o, 1, false), run<parallel::replicate>(o, 1, true));
  row("zero2", 2, run<parallel::zero<2>>(o, 2, false), run<parallel::zero<2>>(o, 2, true));
  std::printf("(the state files are written through the page cache: a step's reads usually hit memory, so disk "
              "st/s can beat the disk-bound figure)\n");
  if (json) std::fclose(json);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "offload_throughput: error: %s\n", e.what());
  return 1;
}
