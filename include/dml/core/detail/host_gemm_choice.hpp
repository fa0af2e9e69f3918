// SPDX-License-Identifier: Apache-2.0
// dml/core/detail/host_gemm_choice.hpp — which library runs a host f32 GEMM: oneDNN, OpenBLAS or BLIS, pinned by
// DML_HOST_GEMM or measured per shape and kept in a per-machine file so every process chooses alike.
// Sits on core/detail/host_onednn.hpp and core/detail/host_blas.hpp; used by core/gemm.hpp. Under nvcc: oneDNN only.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/detail/host_onednn.hpp"
#include "dml/core/error.hpp"
#include "dml/core/gemm_args.hpp"

#if !defined(__CUDACC__)
#  include <fcntl.h>
#  include <sys/file.h>
#  include <unistd.h>

#  include <cstdio>
#  include <filesystem>
#  include <functional>
#  if defined(__x86_64__) || defined(__i386__)
#    include <emmintrin.h>  // _mm_clflush, _mm_mfence (SSE2); <immintrin.h> would add 50,000 lines to every unit
#  endif

#  include "dml/core/detail/host_blas.hpp"
#endif

namespace dml::detail::inline DML_TU_NAMESPACE {  // differs between nvcc and host compilers (config.hpp)

#if !defined(__CUDACC__)
// f32 only; the caller checked that the library is loaded.
inline void host_gemm_blas(host_gemm_library lib, const gemm_args& g) {
  const auto& blas = host_blas::get();
  const float* a = g.a.as<float>();
  const float* b = g.b.as<float>();
  float* c = g.c.as<float>();
  if (lib == host_gemm_library::openblas) {
    constexpr int row_major = 101, no_trans = 111, transpose = 112;
    blas.openblas_sgemm(row_major, g.ta == trans::t ? transpose : no_trans, g.tb == trans::t ? transpose : no_trans,
                        int(g.m), int(g.n), int(g.k), 1.f, a, int(g.lda), b, int(g.ldb), g.beta, c, int(g.ldc));
  } else {
    // Transposes as strides: op(A)[i,p] sits at i·rs + p·cs.
    const float one = 1.f;
    const std::int64_t rsa = g.ta == trans::n ? g.lda : 1, csa = g.ta == trans::n ? 1 : g.lda;
    const std::int64_t rsb = g.tb == trans::n ? g.ldb : 1, csb = g.tb == trans::n ? 1 : g.ldb;
    blas.blis_sgemm(0, 0, g.m, g.n, g.k, &one, a, rsa, csa, b, rsb, csb, &g.beta, c, g.ldc, 1);
  }
  host_bias_relu(c, g.m, g.n, g.ldc, g.bias.as<float>(), g.ep == epilogue::relu);
}

inline bool host_gemm_available(host_gemm_library lib) {
  switch (lib) {
    case host_gemm_library::onednn:
    case host_gemm_library::onednn_sgemm: return true;
    case host_gemm_library::openblas: return host_blas::get().openblas_sgemm != nullptr;
    case host_gemm_library::blis: return host_blas::get().blis_sgemm != nullptr;
  }
  return false;
}

inline void host_gemm_run(host_gemm_library lib, const gemm_args& g) {
  if (lib == host_gemm_library::onednn) host_gemm_onednn(g);
  else if (lib == host_gemm_library::onednn_sgemm) host_gemm_sgemm(g);
  else host_gemm_blas(lib, g);
}

// Whether `rows` stored rows (16 or more) of `bytes`-wide elements lie a multiple of 1 KiB apart. Such rows fall into
// a few of each cache's sets: on a Zen 2 EPYC, oneDNN's AVX2 kernels (gemm:jit) ran dy·W of 256 × 1024 × 1024 with
// ldb = 1024 at 32.5 GFLOP/s on one core, and at 91-93 with 16 floats more per row (DESIGN.md §3).
inline bool host_rows_conflict(std::int64_t rows, std::int64_t ld, std::size_t bytes) {
  return rows >= 16 && (ld * static_cast<std::int64_t>(bytes)) % 1024 == 0;
}
// Whether A's or B's rows conflict so.
inline bool host_gemm_strides_conflict(const gemm_args& g) {
  const std::size_t bytes = dtype_size(g.a.type);
  return host_rows_conflict(g.ta == trans::n ? g.m : g.k, g.lda, bytes) ||
         host_rows_conflict(g.tb == trans::n ? g.k : g.n, g.ldb, bytes);
}

// g on lib, with A and B, where their rows conflict, copied first to rows of their own length plus 64 bytes (f32;
// the copies are kept per thread between calls).
inline void host_gemm_run_padded(host_gemm_library lib, const gemm_args& g) {
  thread_local std::vector<float> copy_a, copy_b;
  gemm_args p = g;
  const auto pad = [](const float* src, std::int64_t rows, std::int64_t cols, std::int64_t ld, const float*& to,
                      std::int64_t& to_ld, std::vector<float>& copy) {
    if (!host_rows_conflict(rows, ld, sizeof(float))) return;
    to_ld = cols + 16;
    if (host_rows_conflict(rows, to_ld, sizeof(float))) to_ld += 16;
    copy.resize(static_cast<std::size_t>(rows * to_ld));
    for (std::int64_t i = 0; i < rows; ++i) std::copy_n(src + i * ld, cols, copy.data() + i * to_ld);
    to = copy.data();
  };
  const float *a = g.a.as<float>(), *b = g.b.as<float>();
  const bool an = g.ta == trans::n, bn = g.tb == trans::n;
  pad(g.a.as<float>(), an ? g.m : g.k, an ? g.k : g.m, g.lda, a, p.lda, copy_a);
  pad(g.b.as<float>(), bn ? g.k : g.n, bn ? g.n : g.k, g.ldb, b, p.ldb, copy_b);
  p.a = a;
  p.b = b;
  host_gemm_run(lib, p);
}

inline void host_gemm_run(host_gemm_pick pick, const gemm_args& g) {
  if (pick.padded) host_gemm_run_padded(pick.library, g);
  else host_gemm_run(pick.library, g);
}

// DML_HOST_GEMM pins every f32 GEMM to one library (onednn, onednn-sgemm, openblas, blis); unset or "auto"
// measures. Read once.
inline std::optional<host_gemm_library> host_gemm_pinned() {
  static const std::optional<host_gemm_library> pinned = [] () -> std::optional<host_gemm_library> {
    const char* v = std::getenv("DML_HOST_GEMM");
    if (!v || !*v || std::string_view(v) == "auto") return std::nullopt;
    for (auto lib : host_gemm_all_libraries)
      if (to_string(lib) == v) {
        if (!host_gemm_available(lib))
          fail("dml::gemm: DML_HOST_GEMM=", v, " asks for a library that could not be loaded here");
        return lib;
      }
    fail<invalid_argument>("dml::gemm: expected DML_HOST_GEMM to be auto, onednn, onednn-sgemm, openblas or blis, found '",
                           v, "'");
  }();
  return pinned;
}

// Writes the lines of a rows × cols matrix of `bytes`-wide elements (row stride ld) back to memory and drops them from
// every cache level (x86; elsewhere a no-op).
inline void host_evict(const void* p, std::int64_t rows, std::int64_t cols, std::int64_t ld, std::size_t bytes) {
#  if defined(__x86_64__) || defined(__i386__)
  for (std::int64_t i = 0; i < rows; ++i) {
    const auto row = reinterpret_cast<std::uintptr_t>(p) + static_cast<std::uintptr_t>(i * ld) * bytes;
    const auto end = row + static_cast<std::uintptr_t>(cols) * bytes;
    for (auto line = row & ~std::uintptr_t{63}; line < end; line += 64) _mm_clflush(reinterpret_cast<const void*>(line));
  }
  _mm_mfence();
#  else
  (void)p, (void)rows, (void)cols, (void)ld, (void)bytes;
#  endif
}
// A, B and C of g out of every cache.
inline void host_evict(const gemm_args& g) {
  const bool an = g.ta == trans::n, bn = g.tb == trans::n;
  host_evict(g.a.ptr, an ? g.m : g.k, an ? g.k : g.m, g.lda, dtype_size(g.a.type));
  host_evict(g.b.ptr, bn ? g.k : g.n, bn ? g.n : g.k, g.ldb, dtype_size(g.b.type));
  host_evict(g.c.ptr, g.m, g.n, g.ldc, dtype_size(g.c.type));
}

// Seconds of g on lib, the upper median of eight runs (the fastest of a few swings with a shared host's noise), each
// with A, B and C out of cache, as a step meets them: a layer's weights, input and output (or the gradient it
// accumulates into) were last touched a layer or a micro-batch earlier, and the other ranks' work has passed through
// the shared cache since. Timed from cache, two choices went wrong in a pipeline step: the matmul primitive's sum
// post-op waits on a cold C (1.6x dnnl_sgemm's time at 1024 × 1024 over 128 rows, within 5% from cache), and its
// input gradient dy·W reads W by columns, level with dnnl_sgemm from cache and 10-20% behind it in a step of two
// ranks (DESIGN.md §3).
inline double host_gemm_time(host_gemm_pick pick, const gemm_args& g) {
  std::array<double, 9> t{};  // the first run builds oneDNN's primitive
  for (auto& ti : t) {
    host_evict(g);
    const auto t0 = std::chrono::steady_clock::now();
    host_gemm_run(pick, g);
    ti = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  std::nth_element(t.begin() + 1, t.begin() + 5, t.end());
  return t[5];
}

// The "model name" line of /proc/cpuinfo, or "unknown".
inline std::string cpu_model() {
  std::FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (!f) return "unknown";
  char line[512];
  std::string model = "unknown";
  while (std::fgets(line, sizeof line, f)) {
    const std::string_view l(line);
    if (l.starts_with("model name") && l.find(':') != std::string_view::npos) {
      model = std::string(l.substr(l.find(':') + 1));
      model.erase(0, model.find_first_not_of(" \t"));
      while (!model.empty() && (model.back() == '\n' || model.back() == ' ')) model.pop_back();
      break;
    }
  }
  std::fclose(f);
  return model;
}

// The library each measured shape runs on, kept in a file so that every process on this machine
// multiplies a shape on the library that the first process to measure it chose: results stay
// bit-identical from run to run (a resumed training run continues with the losses of an
// uninterrupted one). One file per CPU model, library set and oneDNN ISA cap; an flock orders
// processes that measure at once, and the first recorded choice wins. DML_HOST_GEMM_CACHE names the
// file, or "off" keeps choices in memory; by default it lies under $XDG_CACHE_HOME or ~/.cache/dml.
class host_gemm_choices {
 public:
  static host_gemm_choices& get() {
    static host_gemm_choices c;
    return c;
  }
  const std::string& path() const { return path_; }

  // Shapes this process has measured.
  std::size_t measured() const { return measured_; }

  // The choice on record for key, else measure()'s, recorded. Callers serialise calls.
  template <class Measure>
  host_gemm_pick settle(const std::string& key, Measure&& measure) {
    if (auto it = known_.find(key); it != known_.end()) return it->second;
    const int fd = path_.empty() ? -1 : ::open(path_.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    const bool locked = fd >= 0 && ::flock(fd, LOCK_EX) == 0;
    if (locked) read_records(fd);
    auto it = known_.find(key);
    if (it == known_.end()) {
      it = known_.emplace(key, measure()).first;
      ++measured_;
      const std::string line = key + " " + to_string(it->second) + "\n";
      if (locked && ::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size()))
        path_.clear();  // a file we cannot write is not used again; the choice stays in memory
    }
    if (fd >= 0) ::close(fd);  // also releases the lock
    return it->second;
  }

 private:
  host_gemm_choices() {
    const char* env = std::getenv("DML_HOST_GEMM_CACHE");
    if (env && std::string_view(env) == "off") return;
    std::filesystem::path file;
    if (env && *env) {
      file = env;
    } else {
      const char* xdg = std::getenv("XDG_CACHE_HOME");
      const char* home = std::getenv("HOME");
      if (xdg && *xdg) file = std::filesystem::path(xdg) / "dml";
      else if (home && *home) file = std::filesystem::path(home) / ".cache" / "dml";
      else return;
      const auto& blas = host_blas::get();
      const dnnl_version_t* v = dnnl_version();
      const char* isa = std::getenv("ONEDNN_MAX_CPU_ISA");
      const std::string id = cpu_model() + "|oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) +
                             "." + std::to_string(v->patch) + "|" + blas.openblas_name + "|" + blas.blis_name + "|" +
                             (isa ? isa : "") + "|onednn-sgemm, A, B and C out of cache, padded";  // records timed so, no older
      char name[64];
      std::snprintf(name, sizeof name, "host-gemm-%016zx.txt", std::hash<std::string>{}(id));
      file /= name;
    }
    std::error_code ec;
    if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path(), ec);
    if (!ec) path_ = file.string();
  }
  // Lines "key library" or "key library padded"; one that does not parse is skipped.
  void read_records(int fd) {
    std::string text;
    char buf[4096];
    ::lseek(fd, 0, SEEK_SET);
    for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) text.append(buf, static_cast<std::size_t>(n));
    for (std::size_t pos = 0; pos < text.size();) {
      const std::size_t eol = std::min(text.find('\n', pos), text.size());
      const std::string_view line(text.data() + pos, eol - pos);
      pos = eol + 1;
      const std::size_t space = line.find(' ');
      if (space == std::string_view::npos) continue;
      for (auto lib : host_gemm_all_libraries)
        for (const bool padded : {false, true})
          if (const host_gemm_pick pick{lib, padded}; line.substr(space + 1) == to_string(pick))
            known_.emplace(std::string(line.substr(0, space)), pick);
    }
  }

  std::string path_;
  std::map<std::string, host_gemm_pick> known_;
  std::size_t measured_ = 0;
};

// v rounded up to four steps an octave (..., 256, 320, 384, 448, 512, 640, ...; exact to 8). Powers of two and their
// 1.25, 1.5 and 1.75 multiples, the widths models use, are their own step.
inline std::int64_t host_gemm_size_step(std::int64_t v) {
  if (v <= 8) return v;
  const std::int64_t step = std::int64_t{1} << (std::bit_width(static_cast<std::uint64_t>(v - 1)) - 3);
  return (v + step - 1) / step * step;
}
// The shape a choice holds for: g's, with m, n and k to their step. A GEMM whose rows change from call to call (an
// expert's tokens under MoE routing, 449 to 640 of them over a run) is then measured for the few steps it meets,
// not for each new count: timing every library on each, under the lock that keeps the other ranks waiting, made a
// step of a 4-expert GPT on two ranks 38x its prediction (DESIGN.md §3).
inline dnnl_host_context::key host_gemm_choice_key(const gemm_args& g) {
  auto key = gemm_key(g);
  std::get<2>(key) = host_gemm_size_step(g.m);
  std::get<3>(key) = host_gemm_size_step(g.n);
  std::get<4>(key) = host_gemm_size_step(g.k);
  return key;
}

// The library that runs an f32 problem, and whether on padded copies of A and B: measured on a scratch copy of C the
// first time any process on this machine meets the shape's step (host_gemm_choice_key, host_gemm_choices), then
// kept. Every rank thread of a process takes the same choice. oneDNN's matmul (which fuses bias and ReLU) keeps a
// shape unless another library (dnnl_sgemm, OpenBLAS, BLIS) is 5% faster. OpenBLAS's and BLIS's thread counts are
// process-wide while oneDNN's follow each rank's budget, so a rank of one thread chooses among all four and a rank
// of several between oneDNN's two forms, at its thread count (recorded as "shape@threads"; a one-thread record is
// the shape alone). Where the operands' rows conflict in the caches (host_gemm_strides_conflict), each library is
// timed on padded copies as well, the copies' time counted. DML_HOST_GEMM pins a library, unpadded.
inline host_gemm_pick host_gemm_choose(const gemm_args& g) {
  if (auto pinned = host_gemm_pinned()) return {*pinned, false};
  const int threads = thread_budget();
  const auto key = std::pair{threads, host_gemm_choice_key(g)};
  thread_local std::map<std::pair<int, dnnl_host_context::key>, host_gemm_pick> seen;
  if (auto it = seen.find(key); it != seen.end()) return it->second;
  static std::mutex mutex;
  std::lock_guard lock(mutex);  // one rank measures a shape while the others wait: no contention skews it
  std::string code;
  std::apply([&](auto... v) { ((code += std::to_string(static_cast<long long>(v)) + ","), ...); }, key.second);
  code.pop_back();
  if (threads != 1) code += "@" + std::to_string(threads);
  const host_gemm_pick pick = host_gemm_choices::get().settle(code, [&] {
    std::vector<float> scratch(static_cast<std::size_t>(g.m * g.n));
    gemm_args trial = g;
    trial.c = scratch.data();
    trial.ldc = g.n;
    for (std::int64_t i = 0; g.beta != 0.f && i < g.m; ++i)
      std::copy_n(g.c.as<float>() + i * g.ldc, g.n, scratch.data() + i * g.n);
    host_gemm_pick best{};
    double best_t = host_gemm_time(best, trial) / 1.05;
    const bool conflict = host_gemm_strides_conflict(g);
    for (auto l : host_gemm_all_libraries) {
      if (!host_gemm_available(l) || (threads != 1 && l != host_gemm_library::onednn && l != host_gemm_library::onednn_sgemm))
        continue;
      for (const bool padded : {false, true}) {
        const host_gemm_pick p{l, padded};
        if ((padded && !conflict) || p == host_gemm_pick{}) continue;
        if (const double t = host_gemm_time(p, trial); t < best_t) {
          best = p;
          best_t = t;
        }
      }
    }
    return best;
  });
  seen.emplace(key, pick);
  return pick;
}

#else
inline host_gemm_pick host_gemm_choose(const gemm_args&) { return {}; }
inline void host_gemm_run(host_gemm_library, const gemm_args& g) { host_gemm_onednn(g); }
inline void host_gemm_run(host_gemm_pick, const gemm_args& g) { host_gemm_onednn(g); }
#endif

}  // namespace dml::detail::DML_TU_NAMESPACE
