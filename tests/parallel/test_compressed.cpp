// SPDX-License-Identifier: Apache-2.0
// tests/parallel/test_compressed.cpp — compressed reductions (parallel/compressed.hpp) against a plain reference
// (each rank's messages decoded and summed), their exact bytes, error feedback and bad settings.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "dml/comm/local.hpp"
#include "dml/parallel/compressed.hpp"
#include "support.hpp"

namespace test_compressed {

using namespace dml;
using parallel::compressed_reducer;
using parallel::gradient_compression;

namespace {

// One filter message about v (its copy: the reference keeps no state), decoded and added into out.
void encode_decode_add(const comm::any_filter& f, std::span<const float> v, std::span<float> out) {
  std::vector<float> acc(v.begin(), v.end());
  std::vector<std::byte> msg;
  f.encode(acc, msg);
  f.decode(msg, out);
}

std::vector<float> grads_of(int rank, int step, std::size_t n) {
  return dml_test::random_vector(n, static_cast<unsigned>(1000 * step + rank + 1));
}

// Message bytes of one part of `part` entries, from the wire format (comm/filter.hpp, comm/compression.hpp).
std::int64_t message_bytes(const std::string& spec, std::int64_t part) {
  if (spec == "onebit") return 9 + 4 + 8 * ((part + 4095) / 4096) + (part + 7) / 8;
  // topk:0.05: a u32 count per block of 65536 entries, then a u16 index and an f32 value per entry.
  return 9 + 4 * ((part + 65535) / 65536) + 6 * static_cast<std::int64_t>(0.05 * static_cast<double>(part));
}

}  // namespace

TEST_CASE("compressed all-reduce equals each rank's messages decoded and summed, then (over 3 ranks or more) the "
          "owner's sum compressed") {
  for (const std::string spec : {"onebit", "topk:0.05", "onebit:64", "topk:1"}) {
    const auto c = gradient_compression::parse(spec);
    // 70,000 entries a part: two blocks of topk's 16-bit indices.
    for (const auto& layout : {std::pair<int, std::size_t>{1, 1000}, {2, 1000}, {3, 1000}, {4, 1000}, {2, 70000}}) {
      const int ranks = layout.first;
      const std::size_t part = layout.second, n = part * static_cast<std::size_t>(ranks);
      CAPTURE(spec);
      CAPTURE(ranks);
      CAPTURE(part);
      // The reference, first step (residuals zero): part p of every rank's gradient encoded and decoded,
      // summed; over 3 ranks or more, that sum encoded and decoded again (on 1 or 2 every rank gets every
      // rank's messages: the same bytes, and no second compression).
      std::vector<float> want(n, 0.f), dense(n, 0.f);
      for (int p = 0; p < ranks; ++p) {
        std::vector<float> sum(part, 0.f);
        for (int r = 0; r < ranks; ++r) {
          const auto g = grads_of(r, 0, n);
          encode_decode_add(c.filter, std::span(g).subspan(p * part, part), sum);
          for (std::size_t i = 0; i < part; ++i) dense[p * part + i] += g[p * part + i];
        }
        if (ranks > 2) encode_decode_add(c.filter, sum, std::span(want).subspan(p * part, part));
        else std::copy(sum.begin(), sum.end(), want.begin() + static_cast<std::ptrdiff_t>(p * part));
      }
      std::vector<std::vector<float>> got(static_cast<std::size_t>(ranks));
      std::vector<parallel::wire_bytes> bytes(static_cast<std::size_t>(ranks));
      comm::local::run(ranks, [&](comm::local& w) {
        compressed_reducer red(c, n, part);
        auto g = grads_of(w.rank(), 0, n);
        red.all_reduce(w, std::span(g), 0, 0);
        got[static_cast<std::size_t>(w.rank())] = g;
        bytes[static_cast<std::size_t>(w.rank())] = red.bytes();
      });
      for (int r = 0; r < ranks; ++r) {
        const auto d = dml_test::max_abs_difference(want, got[static_cast<std::size_t>(r)]);
        CHECK(d.value == 0.0);  // the same sums in the same order as the reference
      }
      // Every entry sent: the dense sum, to rounding.
      if (spec == "topk:1") CHECK(dml_test::max_abs_difference(dense, got[0]).value == 0.0);
    }
  }
}

TEST_CASE("compressed bytes are exact: onebit >= 16x and topk:0.05 >= 13x fewer than a dense ring all-reduce") {
  for (const std::string spec : {"onebit", "topk:0.05"}) {
    for (int ranks : {2, 3, 4}) {
      CAPTURE(spec);
      CAPTURE(ranks);
      const std::int64_t part = 65536, n = part * ranks;
      std::vector<parallel::wire_bytes> ar(static_cast<std::size_t>(ranks)), rs(static_cast<std::size_t>(ranks));
      comm::local::run(ranks, [&](comm::local& w) {
        const auto c = gradient_compression::parse(spec);
        compressed_reducer a(c, static_cast<std::size_t>(n), static_cast<std::size_t>(part)), b = a;
        auto g = grads_of(w.rank(), 0, static_cast<std::size_t>(n));
        std::vector<float> out(static_cast<std::size_t>(part));
        b.reduce_scatter(w, std::span<const float>(g), 0, out);
        a.all_reduce(w, std::span(g), 0, 0);
        ar[static_cast<std::size_t>(w.rank())] = a.bytes();
        rs[static_cast<std::size_t>(w.rank())] = b.bytes();
      });
      const std::int64_t m = message_bytes(spec, part);
      for (int r = 0; r < ranks; ++r) {
        CHECK(rs[r].sent == (ranks - 1) * m);
        CHECK(rs[r].dense == 4 * part * (ranks - 1));
        CHECK(ar[r].sent == 2 * (ranks - 1) * m);
        CHECK(ar[r].dense == 8 * part * (ranks - 1));
      }
      const double ratio = double(ar[0].dense) / double(ar[0].sent);
      MESSAGE(spec << " ranks=" << ranks << " dense/compressed=" << ratio);
      if (spec == "onebit") CHECK(ratio >= 16.0);
      else CHECK(ratio >= 13.3);  // 6 bytes (u16 index, f32 value) for 5% of the entries: 13.33x measured
    }
  }
}

TEST_CASE("error feedback: what was sent over the steps plus the residuals left equals the gradients' sum") {
  for (const std::string spec : {"onebit", "topk:0.05"}) {
    const int ranks = 3, steps = 20;
    const std::size_t part = 512, n = part * ranks;
    CAPTURE(spec);
    std::vector<double> want(n, 0.0), sent_rs(n, 0.0), sent_ar(n, 0.0), left_rs(n, 0.0), left_ar(n, 0.0);
    std::mutex m;
    for (int s = 0; s < steps; ++s)
      for (int r = 0; r < ranks; ++r) {
        const auto g = grads_of(r, s, n);
        for (std::size_t i = 0; i < n; ++i) want[i] += g[i];
      }
    comm::local::run(ranks, [&](comm::local& w) {
      const auto c = gradient_compression::parse(spec);
      compressed_reducer rs(c, n, part), ar(c, n, part);
      std::vector<double> out_rs(part, 0.0), out_ar(n, 0.0);
      std::vector<float> out(part);
      for (int s = 0; s < steps; ++s) {
        auto g = grads_of(w.rank(), s, n);
        rs.reduce_scatter(w, std::span<const float>(g), 0, out);
        for (std::size_t i = 0; i < part; ++i) out_rs[i] += out[i];
        ar.all_reduce(w, std::span(g), 0, 0);
        for (std::size_t i = 0; i < n; ++i) out_ar[i] += g[i];
      }
      const std::size_t mine = part * static_cast<std::size_t>(w.rank());
      std::lock_guard lk(m);
      for (std::size_t i = 0; i < part; ++i) {
        sent_rs[mine + i] = out_rs[i];
        left_ar[mine + i] += ar.server_residual()[i];  // the owner's second residual
      }
      if (w.rank() == 0) sent_ar = out_ar;
      for (std::size_t i = 0; i < n; ++i) {
        left_rs[i] += rs.worker_residual()[i];
        left_ar[i] += ar.worker_residual()[i];
      }
    });
    double worst_rs = 0, worst_ar = 0, residual = 0;
    for (std::size_t i = 0; i < n; ++i) {
      worst_rs = std::max(worst_rs, std::abs(sent_rs[i] + left_rs[i] - want[i]));
      worst_ar = std::max(worst_ar, std::abs(sent_ar[i] + left_ar[i] - want[i]));
      residual = std::max(residual, std::abs(left_ar[i]));
    }
    MESSAGE(spec << ": |sent + residual - sum| reduce-scatter " << worst_rs << ", all-reduce " << worst_ar
                 << "; largest residual " << residual);
    CHECK(residual > 0.1);      // something was held back: the property is not trivially dense
    CHECK(worst_rs <= 1e-5);  // fp32 rounding: ~1e-6 measured
    CHECK(worst_ar <= 1e-5);
  }
}

TEST_CASE("bad compress settings throw naming the setting") {
  for (const char* bad : {"topk:0", "topk:1.5", "topk:-0.1", "topk:", "topk:x", "onebit:33", "onebit:0", "twobit",
                          "topk:nan"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(gradient_compression::parse(bad), doctest::Contains("compress"), invalid_argument);
  }
  // The flag check the examples and benchmarks share: empty for what parse accepts, else what was expected.
  CHECK(gradient_compression::spec_problem("onebit-adam:5").empty());
  CHECK(gradient_compression::spec_problem("topk:0.05").empty());
  CHECK(gradient_compression::spec_problem("none").empty());
  CHECK(gradient_compression::spec_problem("topk:2").find("topk:F (0 < F <= 1)") != std::string::npos);
  CHECK(gradient_compression::spec_problem("onebit-adam:0").find("onebit-adam:W (W >= 1") != std::string::npos);
  CHECK(!gradient_compression::parse("none").on());
  CHECK(gradient_compression::parse("topk:1").on());
  CHECK(gradient_compression::parse("onebit:64").name() == "onebit:64");
}

}  // namespace test_compressed
