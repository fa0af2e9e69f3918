// SPDX-License-Identifier: Apache-2.0
// tests/core/test_gemm_typed.cpp — dml::gemm with bf16 and fp16 operands against a double reference,
// the type rules, cast_n round trips, and a bf16-versus-f32 throughput line (printed, never asserted).
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <random>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dml/core/cast.hpp"
#include "dml/core/gemm.hpp"
#include "support.hpp"

namespace test_gemm_typed {

using namespace dml;

namespace {

using dml_test::random_vector;

// The largest |got - want| seen and whether every element was within its bound.
struct diff_report {
  double max_abs_diff = 0;
  bool ok = true;
};

struct case_spec {
  trans ta, tb;
  std::int64_t m, n, k;
  bool bias, relu, accumulate;
  std::int64_t pad;  // extra columns in every stored row, so that strides differ from widths
  std::int64_t ld = 0;  // > 0: every operand's row stride instead (pad ignored)
};

// Runs C = op(A)·op(B) + beta·C + bias (ReLU) with inputs of type In and output of type Out, and
// compares with the same formula in double on the values the kernel was given (already rounded to
// In and Out). Bound per element: f32 accumulation (k·2^-23·Σ|a·b|, generous for any summation
// order) plus, for a 16-bit C, half an ulp of the result (2^-8 relative for bf16, 2^-11 for fp16).
// lib: run on that host library (f32 only) instead of through the dispatch, on padded copies of A and B if padded.
template <class In, class Out>
diff_report run_case(const case_spec& s, std::mt19937& rng, std::optional<host_gemm_library> lib = std::nullopt,
                     bool padded = false) {
  const std::int64_t a_rows = s.ta == trans::n ? s.m : s.k, a_cols = s.ta == trans::n ? s.k : s.m;
  const std::int64_t b_rows = s.tb == trans::n ? s.k : s.n, b_cols = s.tb == trans::n ? s.n : s.k;
  const std::int64_t lda = s.ld ? s.ld : a_cols + s.pad, ldb = s.ld ? s.ld : b_cols + s.pad,
                     ldc = s.ld ? s.ld : s.n + s.pad;
  const auto a = random_vector<In>(rng, static_cast<std::size_t>(a_rows * lda));
  const auto b = random_vector<In>(rng, static_cast<std::size_t>(b_rows * ldb));
  const auto bias = random_vector<Out>(rng, static_cast<std::size_t>(s.n));
  auto c = random_vector<Out>(rng, static_cast<std::size_t>(s.m * ldc));
  const auto c0 = c;
  if (!s.accumulate)  // beta = 0 must not read C: NaN there would show if it did
    for (std::int64_t i = 0; i < s.m; ++i)
      for (std::int64_t j = 0; j < s.n; ++j) c[i * ldc + j] = Out(std::numeric_limits<float>::quiet_NaN());
  const auto before = c;

  const gemm_args g{.ta = s.ta, .tb = s.tb, .m = s.m, .n = s.n, .k = s.k, .a = a.data(), .lda = lda, .b = b.data(),
                    .ldb = ldb, .c = c.data(), .ldc = ldc, .beta = s.accumulate ? 1.f : 0.f,
                    .bias = s.bias ? bias.data() : nullptr, .ep = s.relu ? epilogue::relu : epilogue::none};
  if (lib) host_gemm_on(*lib, g, padded);
  else gemm<host>(g);

  const double out_half_ulp = std::is_same_v<Out, bf16> ? 0x1p-8 : std::is_same_v<Out, fp16> ? 0x1p-11 : 0.0;
  diff_report r;
  for (std::int64_t i = 0; i < s.m; ++i) {
    for (std::int64_t j = 0; j < s.n; ++j) {
      double acc = 0, mag = 0;
      for (std::int64_t p = 0; p < s.k; ++p) {
        const double x = float(s.ta == trans::n ? a[i * lda + p] : a[p * lda + i]);
        const double y = float(s.tb == trans::n ? b[p * ldb + j] : b[j * ldb + p]);
        acc += x * y;
        mag += std::abs(x * y);
      }
      if (s.accumulate) {
        acc += float(c0[i * ldc + j]);
        mag += std::abs(float(c0[i * ldc + j]));
      }
      if (s.bias) {
        acc += float(bias[j]);
        mag += std::abs(float(bias[j]));
      }
      if (s.relu) acc = std::max(acc, 0.0);
      const double accum_bound = double(s.k + 2) * 0x1p-23 * mag + 1e-30;
      const double bound = accum_bound + out_half_ulp * (std::abs(acc) + accum_bound);
      const double got = float(c[i * ldc + j]);
      const double d = std::abs(got - acc);
      r.max_abs_diff = std::max(r.max_abs_diff, std::isnan(d) ? INFINITY : d);
      if (!(d <= bound)) r.ok = false;
    }
    // The padding after each row of C is not C's: it must be left as it was.
    for (std::int64_t j = s.n; j < ldc; ++j)
      if (float(c[i * ldc + j]) != float(before[i * ldc + j])) r.ok = false;
  }
  return r;
}

template <class In, class Out>
void every_combination(std::uint32_t seed, std::optional<host_gemm_library> lib = std::nullopt) {
  std::mt19937 rng(seed);
  for (auto ta : {trans::n, trans::t})
    for (auto tb : {trans::n, trans::t})
      for (int flags = 0; flags < 8; ++flags) {
        const case_spec s{ta, tb, 37, 29, 53, (flags & 1) != 0, (flags & 2) != 0, (flags & 4) != 0, flags % 3};
        const diff_report r = run_case<In, Out>(s, rng, lib);
        INFO("ta=", int(ta), " tb=", int(tb), " bias=", s.bias, " relu=", s.relu, " beta=", s.accumulate,
             " pad=", s.pad, " max_abs_diff=", r.max_abs_diff);
        CHECK(r.ok);
      }
  // A longer reduction, where accumulating in 16 bits would be visibly wrong.
  const diff_report r = run_case<In, Out>({trans::n, trans::t, 64, 48, 1000, true, false, false, 0}, rng, lib);
  INFO("k=1000 max_abs_diff=", r.max_abs_diff);
  CHECK(r.ok);
}

}  // namespace

TEST_CASE("gemm: bf16 inputs, f32 output, every transpose with bias, ReLU and beta") {
  every_combination<bf16, float>(1);
}
TEST_CASE("gemm: bf16 inputs, bf16 output") { every_combination<bf16, bf16>(2); }
TEST_CASE("gemm: fp16 inputs (widened to f32 on the host), f32 and fp16 outputs") {
  every_combination<fp16, float>(3);
  every_combination<fp16, fp16>(4);
}
TEST_CASE("gemm: f32 still matches the reference") { every_combination<float, float>(5); }

TEST_CASE("gemm: every host library that loads matches the reference, epilogue included") {
  const auto libs = host_gemm_libraries();
  REQUIRE(libs.front().first == host_gemm_library::onednn);
  for (const auto& [lib, name] : libs) {
    INFO(to_string(lib), ": ", name);
    every_combination<float, float>(7, lib);
  }
}

// A weight gradient accumulated over a micro-batch (dW += dyᵀ·x, 200 × 136 over 128 rows, row strides padded): the
// shape gradient accumulation gives dnnl_sgemm, where its blocking differs from the small cases above.
TEST_CASE("gemm: every host library accumulates a weight gradient over a micro-batch") {
  std::mt19937 rng(11);
  for (const auto& [lib, name] : host_gemm_libraries()) {
    const diff_report r = run_case<float, float>({trans::t, trans::n, 200, 136, 128, false, false, true, 3}, rng, lib);
    INFO(to_string(lib), ": ", name, " max_abs_diff=", r.max_abs_diff);
    CHECK(r.ok);
  }
  std::vector<bf16> a(64, bf16(1.f));
  std::vector<float> c(64);
  const gemm_args g{.m = 8, .n = 8, .k = 8, .a = a.data(), .lda = 8, .b = a.data(), .ldb = 8, .c = c.data(), .ldc = 8};
  CHECK_THROWS_WITH_AS(host_gemm_on(host_gemm_library::onednn_sgemm, g),
                       "dml::host_gemm_on: onednn-sgemm multiplies F32 only, found A=BF16 C=F32", invalid_argument);
}

TEST_CASE("gemm: the host dispatch picks one library per shape for every rank thread") {
  set_thread_budget(1);
  std::vector<float> a(96 * 80, 0.5f), b(80 * 64, 0.25f), c(96 * 64);
  const gemm_args g{.tb = trans::t, .m = 96, .n = 64, .k = 80, .a = a.data(), .lda = 80, .b = b.data(), .ldb = 80,
                    .c = c.data(), .ldc = 64};
  const host_gemm_pick first = host_gemm_choice(g);
  std::vector<host_gemm_pick> seen(4);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < seen.size(); ++t)
    threads.emplace_back([&, t] {
      set_thread_budget(1);
      seen[t] = host_gemm_choice(g);
    });
  for (auto& t : threads) t.join();
  for (auto lib : seen) CHECK(lib == first);
  const bool loaded = std::ranges::any_of(host_gemm_libraries(), [&](const auto& l) { return l.first == first.library; });
  CHECK(loaded);
  CHECK(!first.padded);  // rows 320 bytes apart: nothing to pad
  // The choice is on record for later processes (unless DML_HOST_GEMM pins one or the cache is off).
  const std::string& file = detail::host_gemm_choices::get().path();
  if (!file.empty() && !std::getenv("DML_HOST_GEMM")) {
    std::ifstream in(file);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CHECK(text.find("0,1,96,64,80,80,80,64,0,0,0,0,0 " + std::string(to_string(first)) + "\n") != std::string::npos);
  }
  MESSAGE("96x64x80 (A·Bᵀ) runs on ", to_string(first), "; choices recorded in ", file.empty() ? "memory" : file);
}

// Rows a multiple of 1 KiB apart crowd a few cache sets, and the dispatch may multiply copies of A and B with longer
// rows instead (detail::host_gemm_strides_conflict). Views of 29 to 53 columns in rows of 256 floats, and packed rows
// of 256: every library's product on the copies is the reference's, bias, ReLU and beta included.
TEST_CASE("gemm: operands whose rows lie a multiple of 1 KiB apart multiply to the reference on padded copies") {
  const float x[16] = {};
  const gemm_args conflicting{.m = 16, .n = 8, .k = 8, .a = x, .lda = 256, .b = x, .ldb = 8};
  CHECK(detail::host_gemm_strides_conflict(conflicting));
  gemm_args fewer_rows = conflicting, other_stride = conflicting, transposed = conflicting;
  fewer_rows.m = 15;     // 15 rows: too few to crowd a set
  other_stride.lda = 264;
  transposed.ta = trans::t;  // A stored as k = 8 rows
  CHECK(!detail::host_gemm_strides_conflict(fewer_rows));
  CHECK(!detail::host_gemm_strides_conflict(other_stride));
  CHECK(!detail::host_gemm_strides_conflict(transposed));
  std::mt19937 rng(13);
  for (const auto& [lib, name] : host_gemm_libraries())
    for (auto ta : {trans::n, trans::t})
      for (auto tb : {trans::n, trans::t})
        for (int flags = 0; flags < 8; ++flags) {
          const bool bias = (flags & 1) != 0, relu = (flags & 2) != 0, beta = (flags & 4) != 0;
          for (const case_spec& s : {case_spec{ta, tb, 37, 29, 53, bias, relu, beta, 0, 256},
                                     case_spec{ta, tb, 64, 256, 256, bias, relu, beta, 0}}) {
            const diff_report r = run_case<float, float>(s, rng, lib, true);
            INFO(to_string(lib), " ta=", int(ta), " tb=", int(tb), " m=", s.m, " bias=", bias, " relu=", relu,
                 " beta=", beta, " max_abs_diff=", r.max_abs_diff);
            CHECK(r.ok);
          }
        }
}

// A choice holds for a step of shapes (four an octave): an expert's GEMM, whose rows change with the routing from call
// to call, is measured once for the 64 row counts 449 to 512 rather than 64 times.
TEST_CASE("gemm: shapes within a step of the size grid share one measured choice") {
  CHECK(detail::host_gemm_size_step(8) == 8);
  CHECK(detail::host_gemm_size_step(9) == 10);
  CHECK(detail::host_gemm_size_step(449) == 512);
  CHECK(detail::host_gemm_size_step(512) == 512);
  CHECK(detail::host_gemm_size_step(513) == 640);
  CHECK(detail::host_gemm_size_step(768) == 768);
  CHECK(detail::host_gemm_size_step(1000) == 1024);
  if (std::getenv("DML_HOST_GEMM")) return dml_test::skip("DML_HOST_GEMM pins the library: no choice is made");
  std::vector<float> a(512 * 48, 0.5f), b(48 * 24, 0.25f), c(512 * 24);
  gemm_args g{.m = 449, .n = 24, .k = 48, .a = a.data(), .lda = 48, .b = b.data(), .ldb = 24, .c = c.data(), .ldc = 24};
  const std::size_t before = detail::host_gemm_choices::get().measured();
  const host_gemm_pick first = host_gemm_choice(g);
  for (g.m = 450; g.m <= 512; ++g.m) CHECK(host_gemm_choice(g) == first);
  // Kept in memory only, the step is measured here; on file, an earlier process may have measured it.
  const bool in_memory = detail::host_gemm_choices::get().path().empty();
  const std::size_t measured = detail::host_gemm_choices::get().measured() - before;
  if (in_memory) CHECK(measured == 1);
  else CHECK(measured <= 1);
  g.m = 513;
  host_gemm_choice(g);  // the next step: a shape of its own
  if (in_memory) CHECK(detail::host_gemm_choices::get().measured() - before == 2);
}

// A rank of two threads chooses between oneDNN's two forms only (OpenBLAS's and BLIS's threads are process-wide),
// recorded apart from the one-thread choice of the same shape.
TEST_CASE("gemm: a rank of several threads chooses between oneDNN's matmul and dnnl_sgemm, per thread count") {
  std::vector<float> a(72 * 40, 0.5f), b(72 * 56, 0.25f), c(40 * 56, 1.f);
  const gemm_args g{.ta = trans::t, .m = 40, .n = 56, .k = 72, .a = a.data(), .lda = 40, .b = b.data(), .ldb = 56,
                    .c = c.data(), .ldc = 56, .beta = 1.f};
  host_gemm_pick at_two{};
  std::thread([&] {
    set_thread_budget(2);
    at_two = host_gemm_choice(g);
  }).join();
  INFO("at two threads: ", to_string(at_two));
  if (std::getenv("DML_HOST_GEMM")) return dml_test::skip("DML_HOST_GEMM pins the library: no choice is made");
  CHECK((at_two.library == host_gemm_library::onednn || at_two.library == host_gemm_library::onednn_sgemm));
  const std::string& file = detail::host_gemm_choices::get().path();
  if (!file.empty()) {
    std::ifstream in(file);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CHECK(text.find("1,0,40,56,80,40,56,56,0,1,0,0,0@2 " + std::string(to_string(at_two)) + "\n") != std::string::npos);
  }
}

// A oneDNN primitive runs on the threads its thread had when the primitive was built. A thread that multiplies a
// shape under a budget of 1 and then under 2 must get a second primitive, which starts a second OpenMP thread
// (counted in /proc/self/task); reused, it would leave that core idle (and the reverse would run two threads per
// call beside the other ranks').
TEST_CASE("gemm: a thread's oneDNN products follow its current thread budget") {
#if !defined(_OPENMP) || !defined(__linux__)
  dml_test::skip("the thread budget reaches oneDNN through OpenMP; /proc/self/task is Linux's");
#else
  const auto tasks = [] {
    return std::distance(std::filesystem::directory_iterator("/proc/self/task"), std::filesystem::directory_iterator{});
  };
  std::vector<float> a(512 * 512, 0.5f), b(512 * 512, 0.25f), c(512 * 512);
  const gemm_args g{.m = 512, .n = 512, .k = 512, .a = a.data(), .lda = 512, .b = b.data(), .ldb = 512,
                    .c = c.data(), .ldc = 512};
  std::ptrdiff_t at_one = 0, at_two = 0;
  std::thread([&] {  // a thread of its own: no OpenMP team has run on it
    set_thread_budget(1);
    host_gemm_on(host_gemm_library::onednn, g);
    at_one = tasks();
    set_thread_budget(2);
    host_gemm_on(host_gemm_library::onednn, g);
    at_two = tasks();
  }).join();
  CHECK(at_two == at_one + 1);
  CHECK(c[0] == doctest::Approx(512 * 0.125));
#endif
}

TEST_CASE("gemm: 16-bit inputs say whether they run natively or widened to f32") {
  for (dtype t : {dtype::bf16, dtype::f16}) {
    const std::string impl = host_gemm_impl(64, 64, 64, t);
    INFO(t, ": ", impl);
    CHECK(host_gemm_native(t) == !impl.starts_with("widened to f32"));
  }
  CHECK(host_gemm_native(dtype::f32));
}

TEST_CASE("gemm: bf16 result is the f32 result rounded once") {
  // Same inputs, two output types: the bf16 C must be exactly bf16(f32 C) wherever the f32 result
  // is not within a hair of a rounding tie or of zero (another summation order may tip either).
  std::mt19937 rng(6);
  const std::int64_t m = 16, n = 24, k = 40;
  const auto a = random_vector<bf16>(rng, m * k), b = random_vector<bf16>(rng, k * n);
  const auto bias_f = random_vector<bf16>(rng, n);
  std::vector<float> bias32(bias_f.begin(), bias_f.end()), c32(m * n);
  std::vector<bf16> c16(m * n);
  gemm<host>({.m = m, .n = n, .k = k, .a = a.data(), .lda = k, .b = b.data(), .ldb = n, .c = c32.data(), .ldc = n,
              .bias = bias32.data(), .ep = epilogue::relu});
  gemm<host>({.m = m, .n = n, .k = k, .a = a.data(), .lda = k, .b = b.data(), .ldb = n, .c = c16.data(), .ldc = n,
              .bias = bias_f.data(), .ep = epilogue::relu});
  int same = 0, near_tie = 0;
  for (std::int64_t i = 0; i < m * n; ++i) {
    const std::uint32_t low = detail::float_bits(c32[i]) & 0xffffu;
    if ((low > 0x7f00u && low < 0x8100u) || std::abs(c32[i]) < 1e-3f) {
      ++near_tie;
      continue;
    }
    same += bf16(c32[i]).bits == c16[i].bits;
  }
  CHECK(same + near_tie == m * n);
}

TEST_CASE("gemm: k = 0 leaves the epilogue, in the output's type") {
  std::vector<bf16> c{bf16(1.f), bf16(-2.f), bf16(3.f), bf16(-4.f)};
  const std::vector<bf16> bias{bf16(0.5f), bf16(0.25f)};
  gemm<host>({.m = 2, .n = 2, .k = 0, .a = static_cast<const bf16*>(nullptr), .b = static_cast<const bf16*>(nullptr),
              .c = c.data(), .ldc = 2, .beta = 1.f, .bias = bias.data(), .ep = epilogue::relu});
  CHECK(float(c[0]) == 1.5f);
  CHECK(float(c[1]) == 0.f);
  CHECK(float(c[2]) == 3.5f);
  CHECK(float(c[3]) == 0.f);
}

TEST_CASE("gemm: type rules are checked with what was expected and found") {
  std::vector<float> f(4, 1.f);
  std::vector<bf16> h(4, bf16(1.f));
  std::vector<fp16> q(4, fp16(1.f));
  const auto args = [](const_typed_ptr a, const_typed_ptr b, typed_ptr c, const_typed_ptr bias) {
    return gemm_args{.m = 2, .n = 2, .k = 2, .a = a, .lda = 2, .b = b, .ldb = 2, .c = c, .ldc = 2, .bias = bias};
  };
  CHECK_THROWS_WITH_AS(gemm<host>(args(h.data(), f.data(), f.data(), nullptr)),
                       doctest::Contains("found A=BF16 B=F32"), invalid_argument);
  CHECK_THROWS_WITH_AS(gemm<host>(args(f.data(), f.data(), h.data(), nullptr)),
                       doctest::Contains("expected C of type F32 (as A and B), found BF16"), invalid_argument);
  CHECK_THROWS_WITH_AS(gemm<host>(args(q.data(), q.data(), h.data(), nullptr)),
                       doctest::Contains("expected C of type F32 or F16 (as A and B), found BF16"), invalid_argument);
  CHECK_THROWS_WITH_AS(gemm<host>(args(h.data(), h.data(), h.data(), f.data())),
                       doctest::Contains("bias to have C's type BF16, found F32"), invalid_argument);
  CHECK_NOTHROW(gemm<host>(args(h.data(), h.data(), f.data(), f.data())));
  CHECK(float(f[0]) == 3.f);  // 1·1 + 1·1 + bias 1
}

TEST_CASE("cast_n: round trips and single rounding") {
  // Every bf16 and every fp16 survives a trip through float, bit for bit (NaNs stay NaN).
  std::vector<bf16> h(65536), h2(65536);
  std::vector<fp16> q(65536), q2(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    h[i] = bf16::from_bits(static_cast<std::uint16_t>(i));
    q[i] = fp16::from_bits(static_cast<std::uint16_t>(i));
  }
  std::vector<float> f(65536);
  cast_n<host>(h.data(), f.data(), 65536);
  cast_n<host>(f.data(), h2.data(), 65536);
  int bf16_bad = 0, fp16_bad = 0;
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const bool nan = (i & 0x7fffu) > 0x7f80u;
    bf16_bad += nan ? !std::isnan(float(h2[i])) : h2[i].bits != i;
  }
  cast_n<host>(q.data(), f.data(), 65536);
  cast_n<host>(f.data(), q2.data(), 65536);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const bool nan = (i & 0x7fffu) > 0x7c00u;
    fp16_bad += nan ? !std::isnan(float(q2[i])) : q2[i].bits != i;
  }
  CHECK(bf16_bad == 0);
  CHECK(fp16_bad == 0);

  // float -> bf16 rounds to nearest, ties to even (1 + 2^-8 down to 1; 1 + 3·2^-8 up to 1 + 2^-6).
  const std::vector<float> in{1.f + 0x1p-8f, 1.f + 3 * 0x1p-8f, -0.f, 65504.f, 1e-8f, INFINITY};
  std::vector<bf16> out(in.size());
  cast_n<host>(in.data(), out.data(), static_cast<std::int64_t>(in.size()));
  CHECK(float(out[0]) == 1.f);
  CHECK(float(out[1]) == 1.f + 0x1p-6f);
  CHECK(out[2].bits == 0x8000u);
  CHECK(float(out[3]) == 65536.f);  // fp16's largest value needs 11 bits; bf16 keeps 8
  CHECK(std::isinf(float(out[5])));

  // bf16 -> fp16 goes through float (exact) and rounds once: 65536 overflows fp16, 1e-8 underflows.
  std::vector<fp16> narrowed(out.size());
  cast_n<host>(out.data(), narrowed.data(), static_cast<std::int64_t>(out.size()));
  CHECK(float(narrowed[0]) == 1.f);
  CHECK(float(narrowed[1]) == 1.f + 0x1p-6f);
  CHECK(std::isinf(float(narrowed[3])));
  CHECK(narrowed[4].bits == 0);
  // And back: fp16 -> bf16 of every fp16 equals the scalar conversion through float.
  std::vector<bf16> widened(65536);
  cast_n<host>(q.data(), widened.data(), 65536);
  int mismatches = 0;
  for (std::uint32_t i = 0; i < 65536; ++i)
    if (!std::isnan(float(q[i]))) mismatches += widened[i].bits != bf16(float(q[i])).bits;
  CHECK(mismatches == 0);

  // Large enough for the threaded loop.
  std::mt19937 rng(7);
  const auto big = random_vector<float>(rng, 1 << 17, -1e3f, 1e3f);
  std::vector<bf16> big16(big.size());
  cast_n<host>(big.data(), big16.data(), static_cast<std::int64_t>(big.size()));
  int big_bad = 0;
  for (std::size_t i = 0; i < big.size(); ++i) {
    // Nearest: no other bf16 is strictly closer than the one chosen.
    const float got = big16[i];
    const float up = bf16::from_bits(static_cast<std::uint16_t>(big16[i].bits + 1));
    const float down = bf16::from_bits(static_cast<std::uint16_t>(big16[i].bits - 1));
    big_bad += std::abs(got - big[i]) > std::abs(up - big[i]) || std::abs(got - big[i]) > std::abs(down - big[i]);
  }
  CHECK(big_bad == 0);
}

TEST_CASE("gemm: bf16 and f32 throughput on one thread (printed, not checked)") {
  const std::int64_t m = 256, n = 1024, k = 1024;
  const int budget = thread_budget();
  set_thread_budget(1);
  const auto gflops = [&](auto tag) {
    using T = decltype(tag);
    std::vector<T> a(m * k, T(0.5f)), b(k * n, T(0.25f));
    std::vector<float> c(m * n);
    const gemm_args g{.ta = trans::n, .tb = trans::t, .m = m, .n = n, .k = k, .a = a.data(), .lda = k,
                      .b = b.data(), .ldb = k, .c = c.data(), .ldc = n};
    for (int i = 0; i < 3; ++i) gemm<host>(g);
    const int iters = 20;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) gemm<host>(g);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(c[0] == doctest::Approx(0.125 * k));
    return 2.0 * double(m * n * k) * iters / s / 1e9;
  };
  const double f32 = gflops(float{}), b16 = gflops(bf16{});
  MESSAGE("gemm 256x1024x1024 (A·Bᵀ), 1 thread: f32 ", f32, " GFLOP/s [", host_gemm_impl(m, n, k), "], bf16 ", b16,
          " GFLOP/s [", host_gemm_impl(m, n, k, dtype::bf16), "]");
  set_thread_budget(budget);
}

}  // namespace test_gemm_typed
