// SPDX-License-Identifier: Apache-2.0
// dml/core/gemm.hpp — matrix multiply with fused bias and activation: oneDNN on the host, cuBLAS on CUDA.
// Sits on core/space.hpp and core/cast.hpp; nn/linear and every dense layer call it. See DESIGN.md §3.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <vector>

// nvcc 13's front end stops with an internal error on dnnl.hpp in C++20 mode (it cannot destroy
// a std::vector of the C API's unnamed typedef'd structs); CUDA translation units use the C API.
#if defined(__CUDACC__)
#  include <oneapi/dnnl/dnnl.h>
#else
#  include <oneapi/dnnl/dnnl.hpp>
#endif

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"
#include "dml/core/space.hpp"

#if DML_HAS_CUDA
#  include "dml/core/detail/cublas_gemm.cuh"
#endif
#if !defined(__CUDACC__)
#  include <fcntl.h>
#  include <sys/file.h>
#  include <unistd.h>

#  include <cstdio>
#  include <filesystem>
#  include <functional>

#  include "dml/core/detail/host_blas.hpp"
#endif

namespace dml {

enum class trans : std::uint8_t { n, t };
// What the GEMM applies to its result after bias, fused into the same pass.
enum class epilogue : std::uint8_t { none, relu };

// Row-major C[m,n] = op(A)[m,k] · op(B)[k,n] + beta·C + bias[n], then the epilogue, rounded once
// to C's type. lda/ldb/ldc are row strides of A, B and C as stored (before op).
// Types: A and B alike (f32, bf16 or f16); C and bias alike, either f32 or the type of A and B.
// Each pointer carries its type (core/cast.hpp), so `.a = float_ptr` and `.bias = nullptr` read as
// they always did and a bf16 pointer is never read as floats. Products always accumulate in f32.
struct gemm_args {
  trans ta = trans::n, tb = trans::n;
  std::int64_t m = 0, n = 0, k = 0;
  const_typed_ptr a{};
  std::int64_t lda = 0;
  const_typed_ptr b{};
  std::int64_t ldb = 0;
  typed_ptr c{};
  std::int64_t ldc = 0;
  float beta = 0.f;  // 0 or 1: overwrite or accumulate
  const_typed_ptr bias{};    // length n, or null
  epilogue ep = epilogue::none;
};

// The host libraries an f32 GEMM can run on; see host_gemm_choice.
enum class host_gemm_library : std::uint8_t { onednn, openblas, blis };
inline std::string_view to_string(host_gemm_library lib) {
  switch (lib) {
    case host_gemm_library::onednn: return "onednn";
    case host_gemm_library::openblas: return "openblas";
    case host_gemm_library::blis: return "blis";
  }
  return "?";
}

inline constexpr host_gemm_library host_gemm_all_libraries[] = {host_gemm_library::onednn, host_gemm_library::openblas,
                                                              host_gemm_library::blis};

// One host GEMM as detail::host_gemm_trace records it.
struct gemm_call {
  gemm_args args;                 // pointers are only meaningful during the call
  host_gemm_library library;      // the library that multiplied (the f32 copies, when widened)
  bool native = true;             // false: 16-bit inputs were widened to f32
  double seconds = 0;
};

namespace detail {

// The product is empty when k = 0 (oneDNN and cuBLASLt both reject it); what is left is the
// epilogue on beta·C, in either space.
template <float_like T>
struct gemm_epilogue_only {
  T* c;
  const T* bias;
  std::int64_t n, ldc;
  float beta;
  bool relu;
  DML_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t r = i / n, j = i % n;
    T& out = c[r * ldc + j];
    const float v = (beta != 0.f ? beta * static_cast<float>(out) : 0.f) + (bias ? static_cast<float>(bias[j]) : 0.f);
    out = T(relu && v < 0.f ? 0.f : v);
  }
};

// Strided rows×cols matrix <-> packed f32 copy (row stride cols), for the host's widening path.
template <float_like T>
struct widen_rows {
  const T* src;
  float* dst;
  std::int64_t cols, ld;
  DML_HOST_DEVICE void operator()(std::int64_t i) const { dst[i] = static_cast<float>(src[(i / cols) * ld + i % cols]); }
};
template <float_like T>
struct narrow_rows {
  const float* src;
  T* dst;
  std::int64_t cols, ld;
  DML_HOST_DEVICE void operator()(std::int64_t i) const { dst[(i / cols) * ld + i % cols] = T(src[i]); }
};

#if !defined(__CUDACC__)
struct dnnl_host_context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  // ta, tb, m, n, k, lda, ldb, ldc, bias, beta, epilogue, type of A and B, type of C.
  using key = std::tuple<int, int, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, bool, bool, int, int, int>;
  struct entry {
    dnnl::matmul prim;
    dnnl::memory a, b, c, bias;
  };
  std::map<key, entry> cache;

  static dnnl_host_context& get() {
    thread_local dnnl_host_context ctx;  // each rank thread keeps its own primitives and stream
    return ctx;
  }
};

inline dnnl_host_context::key gemm_key(const gemm_args& g) {
  return {int(g.ta), int(g.tb), g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.bias.ptr != nullptr,
          g.beta != 0.f, int(g.ep), int(g.a.type), int(g.c.type)};
}

inline dnnl::memory::data_type dnnl_type(dtype t) {
  using dt = dnnl::memory::data_type;
  switch (t) {
    case dtype::f32: return dt::f32;
    case dtype::bf16: return dt::bf16;
    case dtype::f16: return dt::f16;
    default: break;
  }
  fail<invalid_argument>("dml::gemm: expected an element type of F32, BF16 or F16, found ", t);
}

// The matmul oneDNN offers for g on this CPU, or none (reference kernels count as none: they are
// orders of magnitude slower than widening to f32).
inline std::optional<dnnl::matmul::primitive_desc> try_host_matmul_desc(const dnnl::engine& eng, const gemm_args& g) {
  using dims = dnnl::memory::dims;
  const dims a_strides = g.ta == trans::n ? dims{g.lda, 1} : dims{1, g.lda};
  const dims b_strides = g.tb == trans::n ? dims{g.ldb, 1} : dims{1, g.ldb};
  const auto ab = dnnl_type(g.a.type), ct = dnnl_type(g.c.type);
  dnnl::memory::desc a_md({g.m, g.k}, ab, a_strides);
  dnnl::memory::desc b_md({g.k, g.n}, ab, b_strides);
  dnnl::memory::desc c_md({g.m, g.n}, ct, dims{g.ldc, 1});
  dnnl::post_ops ops;
  if (g.beta != 0.f) ops.append_sum(g.beta);
  if (g.ep == epilogue::relu) ops.append_eltwise(1.f, dnnl::algorithm::eltwise_relu, 0.f, 0.f);
  dnnl::primitive_attr attr;
  attr.set_post_ops(ops);
  try {
    std::optional<dnnl::matmul::primitive_desc> pd;
    if (g.bias.ptr) {
      dnnl::memory::desc bias_md({1, g.n}, ct, dims{g.n, 1});
      pd.emplace(dnnl::matmul::desc(a_md, b_md, bias_md, c_md), attr, eng);
    } else {
      pd.emplace(dnnl::matmul::desc(a_md, b_md, c_md), attr, eng);
    }
    if (g.a.type != dtype::f32 && std::string_view(pd->impl_info_str()).starts_with("ref")) return std::nullopt;
    return pd;
  } catch (const dnnl::error&) {
    return std::nullopt;
  }
}

inline dnnl::matmul::primitive_desc host_matmul_desc(const dnnl::engine& eng, const gemm_args& g) {
  if (auto pd = try_host_matmul_desc(eng, g)) return *pd;
  fail("dml::gemm: expected oneDNN to offer a matmul for A,B=", g.a.type, " C=", g.c.type, " m=", g.m, " n=", g.n,
       " k=", g.k, " on this CPU, found none");
}

// One cached oneDNN matmul primitive per problem, with beta, bias and ReLU as post-ops and the
// output rounded to C's type by the kernel.
inline void host_gemm_onednn(const gemm_args& g) {
  auto& ctx = dnnl_host_context::get();
  const auto key = gemm_key(g);
  auto it = ctx.cache.find(key);
  if (it == ctx.cache.end()) {
    auto pd = host_matmul_desc(ctx.engine, g);
    dnnl_host_context::entry e{dnnl::matmul(pd), dnnl::memory(pd.src_desc(), ctx.engine, nullptr),
                               dnnl::memory(pd.weights_desc(), ctx.engine, nullptr),
                               dnnl::memory(pd.dst_desc(), ctx.engine, nullptr), {}};
    if (g.bias.ptr) e.bias = dnnl::memory(pd.bias_desc(), ctx.engine, nullptr);
    it = ctx.cache.emplace(key, std::move(e)).first;
  }
  auto& e = it->second;
  // Memory objects are cached with the primitive; only their data pointers change per call.
  e.a.set_data_handle(const_cast<void*>(g.a.ptr));
  e.b.set_data_handle(const_cast<void*>(g.b.ptr));
  e.c.set_data_handle(g.c.ptr);
  std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, e.a}, {DNNL_ARG_WEIGHTS, e.b}, {DNNL_ARG_DST, e.c}};
  if (g.bias.ptr) {
    e.bias.set_data_handle(const_cast<void*>(g.bias.ptr));
    args.emplace(DNNL_ARG_BIAS, e.bias);
  }
  e.prim.execute(ctx.stream, args);
  ctx.stream.wait();
}

// Whether oneDNN has a matmul kernel for 16-bit inputs on this CPU. oneDNN 2.6 has bf16 kernels
// only from AVX512-BF16 (or AVX-512 emulation) on and f16 kernels only with AVX512-FP16; an AVX2
// CPU has neither. Asked once per type for a representative shape.
inline bool host_gemm_is_native(dtype ab) {
  if (ab == dtype::f32) return true;
  static const auto probe = [](dtype t) {
    gemm_args g{.m = 64, .n = 64, .k = 64, .lda = 64, .ldb = 64, .ldc = 64};
    g.a.type = g.b.type = t;
    return try_host_matmul_desc(dnnl::engine(dnnl::engine::kind::cpu, 0), g).has_value();
  };
  static const bool bf16 = probe(dtype::bf16), f16 = probe(dtype::f16);
  return ab == dtype::bf16 ? bf16 : f16;
}

// C += bias, then ReLU, over an m×n block: what oneDNN fuses as post-ops, as one pass after a BLAS call.
inline void host_bias_relu(float* c, std::int64_t m, std::int64_t n, std::int64_t ldc, const float* bias, bool relu) {
  if (!bias && !relu) return;
  for (std::int64_t i = 0; i < m; ++i) {
    float* row = c + i * ldc;
#  pragma omp simd
    for (std::int64_t j = 0; j < n; ++j) {
      const float v = row[j] + (bias ? bias[j] : 0.f);
      row[j] = relu ? (v < 0.f ? 0.f : v) : v;
    }
  }
}

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
    case host_gemm_library::onednn: return true;
    case host_gemm_library::openblas: return host_blas::get().openblas_sgemm != nullptr;
    case host_gemm_library::blis: return host_blas::get().blis_sgemm != nullptr;
  }
  return false;
}

inline void host_gemm_run(host_gemm_library lib, const gemm_args& g) {
  if (lib == host_gemm_library::onednn) host_gemm_onednn(g);
  else host_gemm_blas(lib, g);
}

// DML_HOST_GEMM pins every f32 GEMM to one library (onednn, openblas, blis); unset or "auto"
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
    fail<invalid_argument>("dml::gemm: expected DML_HOST_GEMM to be auto, onednn, openblas or blis, found '", v, "'");
  }();
  return pinned;
}

// Seconds of the fastest of a few runs of g on lib, into a scratch C.
inline double host_gemm_time(host_gemm_library lib, const gemm_args& g) {
  double best = 1e300;
  for (int rep = 0; rep < 4; ++rep) {  // the first run warms caches and builds oneDNN's primitive
    const auto t0 = std::chrono::steady_clock::now();
    host_gemm_run(lib, g);
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0) best = std::min(best, t);
  }
  return best;
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

  // The choice on record for key, else measure()'s, recorded. Callers serialise calls.
  template <class Measure>
  host_gemm_library settle(const std::string& key, Measure&& measure) {
    if (auto it = known_.find(key); it != known_.end()) return it->second;
    const int fd = path_.empty() ? -1 : ::open(path_.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    const bool locked = fd >= 0 && ::flock(fd, LOCK_EX) == 0;
    if (locked) read_records(fd);
    auto it = known_.find(key);
    if (it == known_.end()) {
      it = known_.emplace(key, measure()).first;
      const std::string line = key + " " + std::string(to_string(it->second)) + "\n";
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
                             (isa ? isa : "");
      char name[64];
      std::snprintf(name, sizeof name, "host-gemm-%016zx.txt", std::hash<std::string>{}(id));
      file /= name;
    }
    std::error_code ec;
    if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path(), ec);
    if (!ec) path_ = file.string();
  }
  // Lines "key library"; one that does not parse is skipped.
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
        if (line.substr(space + 1) == to_string(lib)) known_.emplace(std::string(line.substr(0, space)), lib);
    }
  }

  std::string path_;
  std::map<std::string, host_gemm_library> known_;
};

// The library that runs an f32 problem: measured on a scratch copy of C the first time any process
// on this machine meets the shape (host_gemm_choices), then kept. Every rank thread of a process
// takes the same choice. oneDNN (which fuses bias and ReLU) keeps a shape unless another library is
// 5% faster. Only ranks with one thread measure: OpenBLAS's and BLIS's thread counts are
// process-wide, while oneDNN's follow each rank's budget.
inline host_gemm_library host_gemm_choose(const gemm_args& g) {
  if (auto pinned = host_gemm_pinned()) return *pinned;
  if (thread_budget() != 1 || (!host_gemm_available(host_gemm_library::openblas) &&
                               !host_gemm_available(host_gemm_library::blis)))
    return host_gemm_library::onednn;
  const auto key = gemm_key(g);
  thread_local std::map<dnnl_host_context::key, host_gemm_library> seen;
  if (auto it = seen.find(key); it != seen.end()) return it->second;
  static std::mutex mutex;
  std::lock_guard lock(mutex);  // one rank measures a shape while the others wait: no contention skews it
  std::string code;
  std::apply([&](auto... v) { ((code += std::to_string(static_cast<long long>(v)) + ","), ...); }, key);
  code.pop_back();
  const host_gemm_library lib = host_gemm_choices::get().settle(code, [&] {
    std::vector<float> scratch(static_cast<std::size_t>(g.m * g.n));
    gemm_args trial = g;
    trial.c = scratch.data();
    trial.ldc = g.n;
    for (std::int64_t i = 0; g.beta != 0.f && i < g.m; ++i)
      std::copy_n(g.c.as<float>() + i * g.ldc, g.n, scratch.data() + i * g.n);
    auto best = host_gemm_library::onednn;
    double best_t = host_gemm_time(best, trial) / 1.05;
    for (auto l : {host_gemm_library::openblas, host_gemm_library::blis}) {
      if (!host_gemm_available(l)) continue;
      if (const double t = host_gemm_time(l, trial); t < best_t) {
        best = l;
        best_t = t;
      }
    }
    return best;
  });
  seen.emplace(key, lib);
  return lib;
}

#else
// The same contract through the C API: C = op(A)·op(B) + beta·C by dnnl_sgemm (row-major), then
// bias and ReLU in one pass over C. f32 only: oneDNN 2.6's C API has no bf16 GEMM entry point.
inline void host_gemm_onednn(const gemm_args& g) {
  float* c = g.c.as<float>();
  const float* bias = g.bias.as<float>();
  const dnnl_status_t st = dnnl_sgemm(g.ta == trans::t ? 'T' : 'N', g.tb == trans::t ? 'T' : 'N', g.m, g.n, g.k, 1.f,
                                      g.a.as<float>(), g.lda, g.b.as<float>(), g.ldb, g.beta, c, g.ldc);
  if (st != dnnl_success) fail("dml::gemm: dnnl_sgemm expected dnnl_success, found status ", int(st));
  if (!bias && g.ep == epilogue::none) return;
  for (std::int64_t i = 0; i < g.m; ++i)
    for (std::int64_t j = 0; j < g.n; ++j) {
      float& out = c[i * g.ldc + j];
      float v = out;
      if (bias) v += bias[j];
      out = g.ep == epilogue::relu && v < 0.f ? 0.f : v;
    }
}

inline bool host_gemm_is_native(dtype ab) { return ab == dtype::f32; }
inline host_gemm_library host_gemm_choose(const gemm_args&) { return host_gemm_library::onednn; }
inline void host_gemm_run(host_gemm_library, const gemm_args& g) { host_gemm_onednn(g); }
#endif

// When set on a thread, each host GEMM it runs is timed and recorded here (benchmarks, profiles).
inline thread_local std::vector<gemm_call>* host_gemm_trace = nullptr;

// Inputs without a native kernel: A, B, bias (and C when accumulating) are widened to packed f32
// copies, multiplied in f32 and rounded once into C. The copies cost O(mk + kn + mn) against the
// product's O(mnk), and f32 holds every bf16 and fp16 value exactly, so the result equals a native
// kernel's up to the order of the f32 accumulation. The scratch is kept per thread between calls.
// Returns the library that multiplied the f32 copies.
inline host_gemm_library host_gemm_widened(const gemm_args& g) {
  thread_local std::vector<float> wa, wb, wc, wbias;
  const auto widen = [](const const_typed_ptr& src, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                        std::vector<float>& dst) {
    dst.resize(static_cast<std::size_t>(rows * cols));
    visit_float_like(src.type, "dml::gemm", [&](auto t) {
      using T = decltype(t);
      // Packed rows convert as one flat, vectorised pass; strided ones index through the division.
      if (ld == cols) cast_n<host>(src.as<T>(), dst.data(), rows * cols);
      else for_each_index<host>(rows * cols, widen_rows<T>{src.as<T>(), dst.data(), cols, ld});
    });
  };
  const std::int64_t a_rows = g.ta == trans::n ? g.m : g.k, a_cols = g.ta == trans::n ? g.k : g.m;
  const std::int64_t b_rows = g.tb == trans::n ? g.k : g.n, b_cols = g.tb == trans::n ? g.n : g.k;
  gemm_args f = g;
  widen(g.a, a_rows, a_cols, g.lda, wa);
  widen(g.b, b_rows, b_cols, g.ldb, wb);
  f.a = static_cast<const float*>(wa.data());
  f.lda = a_cols;
  f.b = static_cast<const float*>(wb.data());
  f.ldb = b_cols;
  if (g.bias.ptr) {
    widen(g.bias, 1, g.n, g.n, wbias);
    f.bias = static_cast<const float*>(wbias.data());
  }
  const bool narrow_c = g.c.type != dtype::f32;
  if (narrow_c) {
    if (g.beta != 0.f) widen(g.c, g.m, g.n, g.ldc, wc);
    else wc.resize(static_cast<std::size_t>(g.m * g.n));  // not read: beta = 0 overwrites
    f.c = wc.data();
    f.ldc = g.n;
  }
  const host_gemm_library lib = host_gemm_choose(f);
  host_gemm_run(lib, f);
  if (narrow_c)
    visit_float_like(g.c.type, "dml::gemm", [&](auto t) {
      using T = decltype(t);
      if (g.ldc == g.n) cast_n<host>(static_cast<const float*>(wc.data()), g.c.as<T>(), g.m * g.n);
      else for_each_index<host>(g.m * g.n, narrow_rows<T>{wc.data(), g.c.as<T>(), g.n, g.ldc});
    });
  return lib;
}

inline void host_gemm(const gemm_args& g) {
  const auto t0 = host_gemm_trace ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  const bool native = host_gemm_is_native(g.a.type);
  host_gemm_library lib = host_gemm_library::onednn;
  if (g.a.type == dtype::f32) host_gemm_run(lib = host_gemm_choose(g), g);
  else if (native) host_gemm_onednn(g);
  else lib = host_gemm_widened(g);
  if (host_gemm_trace)
    host_gemm_trace->push_back({g, lib, native, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()});
}

inline void check_gemm_args(const gemm_args& g) {
  if (g.m < 0 || g.n < 0 || g.k < 0)
    fail<invalid_argument>("dml::gemm: sizes must be non-negative, found m=", g.m, " n=", g.n, " k=", g.k);
  const auto is_float_like = [](dtype t) { return t == dtype::f32 || t == dtype::bf16 || t == dtype::f16; };
  if (!is_float_like(g.a.type) || g.b.type != g.a.type)
    fail<invalid_argument>("dml::gemm: expected A and B of one type among F32, BF16, F16; found A=", g.a.type,
                           " B=", g.b.type);
  if (g.c.type != dtype::f32 && g.c.type != g.a.type) {
    if (g.a.type == dtype::f32)
      fail<invalid_argument>("dml::gemm: expected C of type F32 (as A and B), found ", g.c.type);
    fail<invalid_argument>("dml::gemm: expected C of type F32 or ", g.a.type, " (as A and B), found ", g.c.type);
  }
  if (g.bias.ptr && g.bias.type != g.c.type)
    fail<invalid_argument>("dml::gemm: expected the bias to have C's type ", g.c.type, ", found ", g.bias.type);
}
}  // namespace detail

template <execution_space Space>
void gemm(const gemm_args& g) {
  detail::check_gemm_args(g);
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) {
    detail::visit_float_like(g.c.type, "dml::gemm", [&](auto t) {
      using T = decltype(t);
      for_each_index<Space>(g.m * g.n, detail::gemm_epilogue_only<T>{g.c.as<T>(), g.bias.as<T>(), g.n, g.ldc, g.beta,
                                                                     g.ep == epilogue::relu});
    });
    return;
  }
  if constexpr (std::same_as<Space, host>) {
    detail::host_gemm(g);
  } else {
#if DML_HAS_CUDA
    detail::cuda_gemm(g);
#else
    static_assert(sizeof(Space) == 0, "dml: the cuda space needs a translation unit compiled by nvcc");
#endif
  }
}

// Whether host products with inputs of type ab run on a native oneDNN kernel here. false means they
// are widened to f32 and multiplied by the f32 dispatch: bf16 and f16 on CPUs without AVX-512
// (oneDNN 2.6 has no 16-bit matmul for AVX2), f16 without AVX512-FP16.
inline bool host_gemm_native(dtype ab) { return detail::host_gemm_is_native(ab); }

// The library the host dispatch runs for this f32 problem, measuring the shape now if it is new.
inline host_gemm_library host_gemm_choice(const gemm_args& g) {
  detail::check_gemm_args(g);
  return detail::host_gemm_choose(g);
}

// Runs g on the named library whatever the dispatch would pick (f32; benchmarks compare libraries).
inline void host_gemm_on(host_gemm_library lib, const gemm_args& g) {
  detail::check_gemm_args(g);
  if (lib != host_gemm_library::onednn && (g.a.type != dtype::f32 || g.c.type != dtype::f32))
    fail<invalid_argument>("dml::host_gemm_on: ", to_string(lib), " multiplies F32 only, found A=", g.a.type,
                           " C=", g.c.type);
#if !defined(__CUDACC__)
  if (!detail::host_gemm_available(lib)) fail("dml::host_gemm_on: ", to_string(lib), " could not be loaded here");
#endif
  if (g.m > 0 && g.n > 0 && g.k > 0) detail::host_gemm_run(lib, g);
}

#if !defined(__CUDACC__)
// The CPU's model name, as benchmarks print it beside their figures.
inline std::string host_cpu_model() { return detail::cpu_model(); }

// The host GEMM libraries this process found, each with its version and kernel set.
inline std::vector<std::pair<host_gemm_library, std::string>> host_gemm_libraries() {
  const dnnl_version_t* v = dnnl_version();
  std::vector<std::pair<host_gemm_library, std::string>> out{
      {host_gemm_library::onednn, "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                                      std::to_string(v->patch)}};
  const auto& blas = detail::host_blas::get();
  if (blas.openblas_sgemm) out.emplace_back(host_gemm_library::openblas, blas.openblas_name);
  if (blas.blis_sgemm) out.emplace_back(host_gemm_library::blis, blas.blis_name);
  return out;
}

// The implementation oneDNN picks for a representative matmul with inputs of type ab and an f32
// result, e.g. "brg:avx512_core" (f32) or "brg:avx512_core_bf16" (bf16).
inline std::string host_gemm_impl(std::int64_t m = 256, std::int64_t n = 1024, std::int64_t k = 1024,
                                  dtype ab = dtype::f32) {
  gemm_args g{.m = m, .n = n, .k = k, .lda = k, .ldb = n, .ldc = n};
  g.a.type = g.b.type = ab;
  if (!detail::host_gemm_is_native(ab)) return "widened to f32: " + host_gemm_impl(m, n, k);
  return detail::host_matmul_desc(detail::dnnl_host_context::get().engine, g).impl_info_str();
}

#else
// nvcc translation units reach oneDNN through dnnl_sgemm, whose kernel choice is not exposed.
inline std::string host_gemm_impl(std::int64_t = 256, std::int64_t = 1024, std::int64_t = 1024,
                                  dtype ab = dtype::f32) {
  return ab == dtype::f32 ? "dnnl_sgemm" : "widened to f32: dnnl_sgemm";
}
#endif

}  // namespace dml
