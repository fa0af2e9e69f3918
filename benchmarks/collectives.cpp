// SPDX-License-Identifier: Apache-2.0
// benchmarks/collectives.cpp — nccl-tests-style bandwidth of dml's communicators, with baselines.
// `collectives --comm local --ranks 2` or `mpirun -np 2 collectives --comm mpi`; see benchmarks/README.md.
// With Gloo, the mpi run times comm::gloo over the same processes too (a file store in a temp directory).
#include <mpi.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "dml/comm/local.hpp"
#include "dml/comm/mpi.hpp"
#if defined(DML_BENCH_GLOO)
#  include <filesystem>

#  include "dml/comm/gloo.hpp"
#  include "dml/comm/gloo_store.hpp"
#endif
#include "dml/train/flags.hpp"

#include "bench_common.hpp"

namespace {

using dml::comm::collective;
using dml::comm::reduce_op;
using clk = std::chrono::steady_clock;

struct config {
  std::string comm = "local";
  int ranks = 2;
  std::string op = "all_reduce";  // or "all"
  std::string min_bytes_text = "4K", max_bytes_text = "256M";
  // Read from the three above by check_across.
  std::vector<collective> ops;
  std::size_t min_bytes = 0, max_bytes = 0;
  int iters = 20;
  int warmup = 3;
  int repeats = 3;
  bool in_place = false;
  bool json = false;
};

// "64M" -> 67108864: a number with an optional K, M or G suffix (powers of 1024), up to 1T; nullopt if the text
// is not one.
std::optional<std::size_t> parse_bytes(std::string_view s) {
  double mul = 1;
  if (!s.empty() && std::string_view("KkMmGg").find(s.back()) != std::string_view::npos) {
    mul = std::tolower(s.back()) == 'k' ? 0x1p10 : std::tolower(s.back()) == 'm' ? 0x1p20 : 0x1p30;
    s.remove_suffix(1);
  }
  try {
    const double v = dml::parse_number<double>("", s) * mul;
    if (v >= 0 && v <= 0x1p40) return static_cast<std::size_t>(v);
  } catch (const dml::invalid_argument&) {
  }
  return std::nullopt;
}

const std::vector<collective>& all_ops() {
  static const std::vector<collective> all{collective::all_reduce, collective::reduce_scatter,
                                           collective::all_gather, collective::broadcast, collective::all_to_all};
  return all;
}

// The command line (dml/train/flags.hpp).
dml::flags command_line(config& c) {
  dml::flags f("collectives", "nccl-tests-style bandwidth of dml's communicators, with baselines.");
  std::vector<std::string> ops{"all"};
  for (const auto k : all_ops()) ops.emplace_back(dml::comm::name(k));
  const auto bytes = [](const std::string& v) { return parse_bytes(v) ? std::string() : "a byte count like 4K or 64M"; };
  f.add("--comm", c.comm, "C", "communicator; mpi under mpirun (and gloo beside it where built)")
      .choices({"local", "mpi"});
  f.add("--ranks", c.ranks, "N", "comm::local ranks").min(1);
  f.add("--op", c.op, "OP", "the collective to time").choices(ops);
  f.add("--min-bytes", c.min_bytes_text, "B", "the smallest message; K, M, G suffixes").check(bytes);
  f.add("--max-bytes", c.max_bytes_text, "B", "the largest message; K, M, G suffixes").check(bytes);
  f.add("--iters", c.iters, "N", "timed iterations per size").min(1);
  f.add("--warmup", c.warmup, "N", "untimed iterations first").min(0);
  f.add("--repeats", c.repeats, "N", "runs per size; the fastest is kept").min(1);
  f.add_switch("--in-place", c.in_place, "the output buffer is the input buffer");
  f.add_switch("--json", c.json, "print one JSON object per result too");
  return f;
}

// The flags' texts read into what the runs use.
void check_across(config& c) {
  if (c.op == "all") c.ops = all_ops();
  else
    for (const auto k : all_ops())
      if (dml::comm::name(k) == c.op) c.ops = {k};
  c.min_bytes = std::max<std::size_t>(4, *parse_bytes(c.min_bytes_text));
  c.max_bytes = *parse_bytes(c.max_bytes_text);
}

struct result {
  std::string comm;  // local, mpi, mpi_raw, memcpy
  std::string op;
  int ranks;
  std::size_t bytes, count;
  double time_us;
  double algbw, busbw;
  long wrong;
};

void print_header(const config& c, const std::string& title) {
  if (c.json) return;
  std::printf("#\n# %s\n#\n", title.c_str());
  std::printf("# %10s %12s %6s %6s %12s %12s %12s %8s\n", "size", "count", "type", "redop", "time(us)",
              "algbw(GB/s)", "busbw(GB/s)", "#wrong");
}

void print(const config& c, const result& r) {
  const char* redop = r.op == "all_reduce" || r.op == "reduce_scatter" ? "sum" : "none";
  if (c.json) {
    std::printf("{\"comm\":\"%s\",\"op\":\"%s\",\"ranks\":%d,\"bytes\":%zu,\"count\":%zu,\"type\":\"float\","
                "\"redop\":\"%s\",\"in_place\":%s,\"time_us\":%.2f,\"algbw_gbs\":%.3f,\"busbw_gbs\":%.3f,"
                "\"wrong\":%ld}\n",
                r.comm.c_str(), r.op.c_str(), r.ranks, r.bytes, r.count, redop, c.in_place ? "true" : "false", r.time_us,
                r.algbw, r.busbw, r.wrong);
  } else {
    std::printf("  %10zu %12zu %6s %6s %12.1f %12.2f %12.2f %8ld\n", r.bytes, r.count, "float", redop, r.time_us, r.algbw, r.busbw,
                r.wrong);
  }
  std::fflush(stdout);
}

std::vector<std::size_t> sizes(const config& c) {
  std::vector<std::size_t> s;
  for (std::size_t b = c.min_bytes; b <= c.max_bytes; b *= 2) s.push_back(b);
  return s;
}

// ---- memcpy baseline: one thread copies the whole buffer, or two threads a half each.
double memcpy_gbs(std::size_t bytes, int threads, int iters) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  double best = 1e300;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = clk::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        const std::size_t lo = bytes * t / threads, hi = bytes * (t + 1) / threads;
        for (int i = 0; i < iters; ++i) std::memcpy(dst.data() + lo, src.data() + lo, hi - lo);
      });
    for (auto& t : ts) t.join();
    best = std::min(best, std::chrono::duration<double>(clk::now() - t0).count() / iters);
  }
  return double(bytes) / best / 1e9;
}

struct memcpy_row {
  std::size_t bytes;
  double one, two;
};

memcpy_row measure_memcpy(std::size_t b) {
  // about 1 GiB copied per measurement, so that starting the threads is noise
  const int iters = int(std::clamp<std::size_t>((std::size_t(1) << 30) / b, 3, std::size_t(1) << 18));
  return {b, memcpy_gbs(b, 1, iters), memcpy_gbs(b, 2, iters)};
}

void print_memcpy(const config& c, const std::vector<memcpy_row>& rows) {
  if (!c.json)
    std::printf("#\n# baseline: memcpy (GB/s = bytes copied / time), measured between the rows below\n#\n"
                "# %10s %12s %12s\n", "size", "1 thread", "2 threads");
  for (const auto& r : rows) {
    if (c.json) {
      std::printf("{\"comm\":\"memcpy\",\"op\":\"memcpy\",\"threads\":1,\"bytes\":%zu,\"gbs\":%.3f}\n", r.bytes, r.one);
      std::printf("{\"comm\":\"memcpy\",\"op\":\"memcpy\",\"threads\":2,\"bytes\":%zu,\"gbs\":%.3f}\n", r.bytes, r.two);
    } else {
      std::printf("  %10zu %12.2f %12.2f\n", r.bytes, r.one, r.two);
    }
  }
  std::fflush(stdout);
}

// ---- one collective, through any communicator-like object.
// Buffers follow nccl-tests: `bytes` is the larger side (recv of all_gather, send of reduce_scatter).
struct buffers {
  std::vector<float> send, recv;
};

std::size_t elements(collective op, std::size_t bytes, int n) {
  std::size_t count = bytes / sizeof(float);
  if (op == collective::reduce_scatter || op == collective::all_gather || op == collective::all_to_all)
    count = count / n * n;
  return count;
}

buffers make_buffers(collective op, std::size_t count, int n) {
  buffers b;
  switch (op) {
    case collective::reduce_scatter: b.send.resize(count); b.recv.resize(count / n); break;
    case collective::all_gather: b.send.resize(count / n); b.recv.resize(count); break;
    default: b.send.resize(count); b.recv.resize(count); break;
  }
  return b;
}

template <class Comm>
void issue(Comm& c, collective op, buffers& b, bool in_place) {
  std::span<const float> s(b.send);
  std::span<float> r(b.recv);
  switch (op) {
    case collective::all_reduce:
      if (in_place) c.all_reduce(std::span<float>(b.send), reduce_op::sum);
      else c.all_reduce(s, r, reduce_op::sum);
      break;
    case collective::reduce_scatter:
      if (in_place) c.reduce_scatter(std::span<float>(b.send), reduce_op::sum);
      else c.reduce_scatter(s, r, reduce_op::sum);
      break;
    case collective::all_gather:
      if (in_place) c.all_gather(r);
      else c.all_gather(s, r);
      break;
    case collective::broadcast: c.broadcast(std::span<float>(b.send), 0); break;
    case collective::all_to_all: c.all_to_all(s, r); break;
    case collective::reduce: break;
  }
}

// Fills inputs with rank-dependent small integers, runs once and counts wrong outputs.
template <class Comm>
long verify(Comm& c, collective op, buffers& b, bool in_place) {
  const int n = c.size(), r = c.rank();
  const auto v = [](int rank, std::size_t i) { return float(int((i * 7 + rank * 3) % 13)); };
  for (std::size_t i = 0; i < b.send.size(); ++i) b.send[i] = v(r, i);
  std::size_t m = b.recv.size() / std::max(n, 1);
  if (op == collective::all_gather) {
    m = b.send.size();
    if (in_place) std::copy(b.send.begin(), b.send.end(), b.recv.begin() + m * r);
  }
  issue(c, op, b, in_place);
  long wrong = 0;
  switch (op) {
    case collective::all_reduce: {
      const auto& out = in_place ? b.send : b.recv;
      for (std::size_t i = 0; i < out.size(); ++i) {
        float want = 0;
        for (int p = 0; p < n; ++p) want += v(p, i);
        wrong += out[i] != want;
      }
      break;
    }
    case collective::reduce_scatter: {
      const std::size_t k = b.send.size() / n;
      const float* out = in_place ? b.send.data() + k * r : b.recv.data();
      for (std::size_t i = 0; i < k; ++i) {
        float want = 0;
        for (int p = 0; p < n; ++p) want += v(p, k * r + i);
        wrong += out[i] != want;
      }
      break;
    }
    case collective::all_gather:
      for (std::size_t i = 0; i < b.recv.size(); ++i) wrong += b.recv[i] != v(int(i / m), i % m);
      break;
    case collective::broadcast:
      for (std::size_t i = 0; i < b.send.size(); ++i) wrong += b.send[i] != v(0, i);
      break;
    case collective::all_to_all:
      for (std::size_t i = 0; i < b.recv.size(); ++i) wrong += b.recv[i] != v(int(i / m), m * r + i % m);
      break;
    case collective::reduce: break;
  }
  return wrong;
}

// Average time of one call on this rank, best of `repeats` runs of `iters` calls.
template <class Comm>
double time_us(Comm& c, collective op, buffers& b, const config& cfg, int iters) {
  for (int i = 0; i < cfg.warmup; ++i) issue(c, op, b, cfg.in_place);
  double best = 1e300;
  for (int rep = 0; rep < cfg.repeats; ++rep) {
    c.barrier();
    const auto t0 = clk::now();
    for (int i = 0; i < iters; ++i) issue(c, op, b, cfg.in_place);
    best = std::min(best, std::chrono::duration<double, std::micro>(clk::now() - t0).count() / iters);
  }
  return best;
}

int iters_for(const config& c, std::size_t bytes) {
  // Fewer calls for large messages keeps a 256 MiB sweep within a minute on two cores.
  return int(std::clamp<std::size_t>(std::size_t(c.iters) * (std::size_t(16) << 20) / std::max<std::size_t>(bytes, 1),
                                     2, std::size_t(c.iters) * 50));
}

template <class Comm>
result measure(Comm& c, const std::string& label, collective op, std::size_t bytes, const config& cfg) {
  const int n = c.size();
  const std::size_t count = elements(op, bytes, n);
  buffers b = make_buffers(op, count, n);
  long wrong = verify(c, op, b, cfg.in_place);
  double t = time_us(c, op, b, cfg, iters_for(cfg, bytes));
  // The slowest rank sets the time, as in nccl-tests; wrong counts add up.
  c.all_reduce(std::span<double>(&t, 1), reduce_op::max);
  std::int64_t w = wrong;
  c.all_reduce(std::span<std::int64_t>(&w, 1), reduce_op::sum);
  const double algbw = double(count * sizeof(float)) / (t * 1e-6) / 1e9;
  return {label, std::string(dml::comm::name(op)), n, count * sizeof(float), count, t, algbw,
          algbw * dml::comm::bus_factor(op, n), long(w)};
}

// The same operations straight on MPI, for the baseline.
struct raw_mpi {
  MPI_Comm comm = MPI_COMM_WORLD;
  int r = 0, n = 1;
  raw_mpi() {
    MPI_Comm_rank(comm, &r);
    MPI_Comm_size(comm, &n);
  }
  int rank() const { return r; }
  int size() const { return n; }
  void barrier() { MPI_Barrier(comm); }
  template <class T>
  static MPI_Datatype type() {
    if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
    else if constexpr (std::is_same_v<T, std::int64_t>) return MPI_INT64_T;
    else return MPI_FLOAT;
  }
  template <class T>
  void all_reduce(std::span<T> x, reduce_op op) {
    MPI_Allreduce(MPI_IN_PLACE, x.data(), int(x.size()), type<T>(), op == reduce_op::max ? MPI_MAX : MPI_SUM, comm);
  }
  void all_reduce(std::span<const float> s, std::span<float> x, reduce_op) {
    MPI_Allreduce(s.data(), x.data(), int(x.size()), MPI_FLOAT, MPI_SUM, comm);
  }
  void reduce_scatter(std::span<float> x, reduce_op) {
    MPI_Reduce_scatter_block(MPI_IN_PLACE, x.data(), int(x.size() / n), MPI_FLOAT, MPI_SUM, comm);
    if (r) std::memmove(x.data() + x.size() / n * r, x.data(), x.size() / n * sizeof(float));
  }
  void reduce_scatter(std::span<const float> s, std::span<float> x, reduce_op) {
    MPI_Reduce_scatter_block(s.data(), x.data(), int(x.size()), MPI_FLOAT, MPI_SUM, comm);
  }
  void all_gather(std::span<float> x) {
    MPI_Allgather(MPI_IN_PLACE, 0, MPI_FLOAT, x.data(), int(x.size() / n), MPI_FLOAT, comm);
  }
  void all_gather(std::span<const float> s, std::span<float> x) {
    MPI_Allgather(s.data(), int(s.size()), MPI_FLOAT, x.data(), int(s.size()), MPI_FLOAT, comm);
  }
  void broadcast(std::span<float> x, int root) { MPI_Bcast(x.data(), int(x.size()), MPI_FLOAT, root, comm); }
  void all_to_all(std::span<const float> s, std::span<float> x) {
    MPI_Alltoall(s.data(), int(s.size() / n), MPI_FLOAT, x.data(), int(x.size() / n), MPI_FLOAT, comm);
  }
};

// Ranks other than 0 wait here without spinning while rank 0 measures memcpy, so that Open MPI's
// polling does not take a core from the baseline.
void quiet_barrier(MPI_Comm comm) {
  MPI_Request q;
  MPI_Ibarrier(comm, &q);
  int done = 0;
  while (!done) {
    MPI_Test(&q, &done, MPI_STATUS_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

#if defined(DML_BENCH_GLOO)
// comm::gloo over the processes of the MPI world: rank 0 makes a directory for the file store and tells the others.
struct gloo_world {
  std::string dir;
  std::optional<dml::comm::gloo> comm;
  explicit gloo_world(const dml::comm::mpi& world) {
    char path[4096] = {};
    if (world.rank() == 0) {
      std::string tmpl = (std::filesystem::temp_directory_path() / "dml-collectives-XXXXXX").string();
      if (!::mkdtemp(tmpl.data())) dml::fail<dml::io_error>("collectives: cannot make a directory for the store");
      std::snprintf(path, sizeof path, "%s", tmpl.c_str());
    }
    MPI_Bcast(path, sizeof path, MPI_CHAR, 0, world.native());
    dir = path;
    comm.emplace(dml::comm::open_store("file:" + dir, std::chrono::seconds(60)), world.rank(), world.size());
    MPI_Barrier(world.native());
    if (world.rank() == 0) std::filesystem::remove_all(dir);
  }
};
#endif

// Baselines and collectives alternate size by size, so that all of them see the same machine
// load (the machine may be shared); tables are printed at the end.
int run_mpi(const config& cfg, int argc, char** argv) {
  dml::comm::mpi::environment env(&argc, &argv);
  dml::comm::mpi world(MPI_COMM_WORLD);
  raw_mpi raw;
  const bool lead = world.rank() == 0;
  std::vector<memcpy_row> copies;
  std::vector<std::vector<result>> base(cfg.ops.size()), ours(cfg.ops.size()), glo(cfg.ops.size());
#if defined(DML_BENCH_GLOO)
  gloo_world g(world);
#endif
  for (std::size_t bytes : sizes(cfg)) {
    if (lead) copies.push_back(measure_memcpy(bytes));
    quiet_barrier(MPI_COMM_WORLD);
    for (std::size_t k = 0; k < cfg.ops.size(); ++k) {
      base[k].push_back(measure(raw, "mpi_raw", cfg.ops[k], bytes, cfg));
      ours[k].push_back(measure(world, "mpi", cfg.ops[k], bytes, cfg));
#if defined(DML_BENCH_GLOO)
      glo[k].push_back(measure(*g.comm, "gloo", cfg.ops[k], bytes, cfg));
#endif
    }
  }
  if (!lead) return 0;
  if (!cfg.json)
    std::printf("# collectives: comm mpi, %d ranks (processes)%s\n", world.size(), cfg.in_place ? ", in place" : "");
  print_memcpy(cfg, copies);
  for (std::size_t k = 0; k < cfg.ops.size(); ++k) {
    const std::string op(dml::comm::name(cfg.ops[k])), n = std::to_string(world.size());
    print_header(cfg, "baseline: raw MPI " + op + ", " + n + " processes");
    for (auto& r : base[k]) print(cfg, r);
    print_header(cfg, "dml::comm::mpi " + op + ", " + n + " processes");
    for (auto& r : ours[k]) print(cfg, r);
    if (glo[k].empty()) continue;
    print_header(cfg, "dml::comm::gloo " + op + ", " + n + " processes (Gloo's TCP transport over loopback)");
    for (auto& r : glo[k]) print(cfg, r);
  }
  return 0;
}

int run_local(const config& cfg) {
  std::vector<memcpy_row> copies;
  std::vector<std::vector<result>> ours(cfg.ops.size());
  dml::comm::local::run(cfg.ranks, [&](dml::comm::local& c) {
    for (std::size_t bytes : sizes(cfg)) {
      if (c.rank() == 0) copies.push_back(measure_memcpy(bytes));  // the other ranks sleep meanwhile
      c.barrier();
      for (std::size_t k = 0; k < cfg.ops.size(); ++k) {
        const result r = measure(c, "local", cfg.ops[k], bytes, cfg);
        if (c.rank() == 0) ours[k].push_back(r);
      }
    }
  });
  if (!cfg.json)
    std::printf("# collectives: comm local, %d ranks (threads)%s\n", cfg.ranks, cfg.in_place ? ", in place" : "");
  print_memcpy(cfg, copies);
  for (std::size_t k = 0; k < cfg.ops.size(); ++k) {
    print_header(cfg, "dml::comm::local " + std::string(dml::comm::name(cfg.ops[k])) + ", " +
                          std::to_string(cfg.ranks) + " threads");
    for (auto& r : ours[k]) print(cfg, r);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  config cfg;
  auto cli = command_line(cfg);
  if (const auto status = dml_bench::parse_for_main(cli, argc, argv, [&] { check_across(cfg); })) return *status;
  try {
    return cfg.comm == "mpi" ? run_mpi(cfg, argc, argv) : run_local(cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "collectives: %s\n", e.what());
    return 1;
  }
}
