// SPDX-License-Identifier: Apache-2.0
// tests/nn/test_llama_parity.cpp — dml's Llama kernels against PyTorch autograd (tests/nn/llama_layers_reference.py)
// on the same inputs: RMSNorm alone and fused with the residual add, RoPE with Llama 3.1's scaling at positions
// up to 8191 (Hugging Face's rotate-half), SwiGLU; every output and every gradient, in float.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "dml/nn/rmsnorm.hpp"
#include "dml/nn/rope.hpp"
#include "dml/nn/swiglu.hpp"
#include "support.hpp"

namespace test_llama_parity {

namespace {

namespace fs = std::filesystem;
namespace nn = dml::nn;
using dml::host;

template <class T>
void write(const fs::path& p, const std::vector<T>& v) {
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
  REQUIRE(out.good());
}
std::vector<float> read(const fs::path& p, std::size_t n) {
  std::vector<float> v(n);
  std::ifstream in(p, std::ios::binary);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(float)));
  REQUIRE(in.gcount() == static_cast<std::streamsize>(n * sizeof(float)));
  return v;
}

// max |dml − torch| / max |torch| over one tensor.
double rel(const std::vector<float>& torch, const std::vector<float>& ours) {
  return dml_test::max_abs_difference(torch, ours).value / dml_test::max_abs(torch);
}

}  // namespace

TEST_CASE("parity with PyTorch: RMSNorm, fused residual RMSNorm, RoPE (Llama 3.1) and SwiGLU, forward and backward") {
  const std::int64_t rows = 16, n = 300, ff = 200;
  const float eps = 1e-5f;
  const nn::rope_shape s{.batch = 2, .seq = 16, .heads = 8, .kv_heads = 2, .head_dim = 16};
  // head_dim 16 at theta 500000 has wavelengths in all three of the scaling's bands (6.3 ... 2.3e5).
  const nn::rope_config rope{.theta = 500000, .scaling = nn::rope_scaling{}};
  const std::int64_t max_positions = 8192;
  const fs::path dir = fs::path(DML_TEST_BINARY_DIR) / "parity_llama_layers";
  fs::create_directories(dir);
  {
    std::ofstream cfg(dir / "config.json");
    cfg << "{\"rows\": " << rows << ", \"n\": " << n << ", \"eps\": 1e-5, \"batch\": " << s.batch << ", \"seq\": " << s.seq
        << ", \"heads\": " << s.heads << ", \"kv_heads\": " << s.kv_heads << ", \"head_dim\": " << s.head_dim
        << ", \"theta\": 500000.0, \"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0"
        << ", \"original_max_position_embeddings\": 8192.0, \"ff\": " << ff << "}\n";
    REQUIRE(cfg.good());
  }
  const auto size = static_cast<std::size_t>(rows * n);
  const auto x = dml_test::random_vector(size, 1, -2.f, 2.f), w = dml_test::random_vector(static_cast<std::size_t>(n), 2, 0.5f, 1.5f);
  const auto dy = dml_test::random_vector(size, 3), r0 = dml_test::random_vector(size, 4, -3.f, 3.f);
  const auto dr = dml_test::random_vector(size, 5);
  const auto qkv = dml_test::random_vector(static_cast<std::size_t>(s.batch * s.seq * s.width()), 6, -2.f, 2.f);
  const auto rope_dy = dml_test::random_vector(qkv.size(), 7);
  std::vector<std::int64_t> positions(static_cast<std::size_t>(s.batch * s.seq));
  std::mt19937 gen(8);
  std::uniform_int_distribution<std::int64_t> pick(0, max_positions - 1);
  for (auto& p : positions) p = pick(gen);
  positions[0] = max_positions - 1;
  const auto gu = dml_test::random_vector(static_cast<std::size_t>(rows * 2 * ff), 9, -6.f, 6.f);
  const auto dh = dml_test::random_vector(static_cast<std::size_t>(rows * ff), 10);
  write(dir / "norm_x.bin", x);
  write(dir / "norm_w.bin", w);
  write(dir / "norm_dy.bin", dy);
  write(dir / "norm_r.bin", r0);
  write(dir / "norm_dr.bin", dr);
  write(dir / "rope_qkv.bin", qkv);
  write(dir / "rope_positions.bin", positions);
  write(dir / "rope_dy.bin", rope_dy);
  write(dir / "swiglu_gu.bin", gu);
  write(dir / "swiglu_dh.bin", dh);
  const std::string cmd = std::string(DML_TEST_PYTHON) + " " + DML_TEST_SOURCE_DIR + "/llama_layers_reference.py " + dir.string();
  REQUIRE(std::system(cmd.c_str()) == 0);
  const auto theirs = [&](const char* name, std::size_t count) { return read(dir / ("torch_" + std::string(name) + ".bin"), count); };

  // RMSNorm.
  std::vector<float> y(size), rrms(static_cast<std::size_t>(rows)), dx(size), dw(static_cast<std::size_t>(n));
  nn::rmsnorm_forward<host>(x.data(), w.data(), y.data(), rrms.data(), rows, n, eps);
  nn::rmsnorm_backward<host>(x.data(), w.data(), rrms.data(), dy.data(), nullptr, dx.data(), dw.data(), rows, n);
  const double norm[] = {rel(theirs("norm_y", size), y), rel(theirs("norm_dx", size), dx), rel(theirs("norm_dw", w.size()), dw)};
  // Fused: the stream's one gradient is written over dr's copy.
  auto r = r0, dr_total = dr;
  nn::residual_rmsnorm_forward<host>(r.data(), x.data(), w.data(), y.data(), rrms.data(), rows, n, eps);
  nn::rmsnorm_backward<host>(r.data(), w.data(), rrms.data(), dy.data(), dr_total.data(), dr_total.data(), dw.data(), rows, n);
  const double fused[] = {rel(theirs("fused_r", size), r), rel(theirs("fused_y", size), y),
                          rel(theirs("fused_dr", size), dr_total), rel(theirs("fused_dx", size), dr_total),
                          rel(theirs("fused_dw", w.size()), dw)};
  // RoPE.
  const nn::rope_table table(rope, s.head_dim, max_positions);
  auto rope_y = qkv, dqkv = rope_dy;
  nn::rope_forward<host>(s, rope_y.data(), table.view(), positions.data());
  nn::rope_backward<host>(s, dqkv.data(), table.view(), positions.data());
  const double rot[] = {rel(theirs("rope_y", qkv.size()), rope_y), rel(theirs("rope_dqkv", qkv.size()), dqkv)};
  // SwiGLU.
  std::vector<float> h(dh.size()), dgu(gu.size());
  nn::swiglu_forward<host>(gu.data(), h.data(), rows, ff);
  nn::swiglu_backward<host>(gu.data(), dh.data(), dgu.data(), rows, ff);
  const double glu[] = {rel(theirs("swiglu_h", h.size()), h), rel(theirs("swiglu_dgu", gu.size()), dgu)};

  MESSAGE("max |dml − torch| / max |torch|: rmsnorm y " << norm[0] << " dx " << norm[1] << " dw " << norm[2]
          << "; fused r " << fused[0] << " y " << fused[1] << " d residual " << fused[2] << " d branch " << fused[3]
          << " dw " << fused[4] << "; rope y " << rot[0] << " dqkv " << rot[1] << "; swiglu h " << glu[0] << " dgu "
          << glu[1]);
  for (double e : norm) CHECK(e <= 2e-6);
  for (double e : fused) CHECK(e <= 2e-6);
  for (double e : rot) CHECK(e <= 2e-6);
  for (double e : glu) CHECK(e <= 2e-6);
}

}  // namespace test_llama_parity
