// SPDX-License-Identifier: Apache-2.0
// tests/cuda/test_cuda_attention.cu — causal attention (T×T and tiles) forward and backward in dml::cuda against
// dml::host on the same random data, in float and bf16; the tiles also with grouped-query heads and document masks. Needs a GPU (ctest label gpu); without one it prints
// `SKIPPED: <reason>` and exits 77.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "dml/core/buffer.hpp"
#include "dml/nn/attention.hpp"
#include "dml/nn/tile_attention.hpp"
#include "../support.hpp"
#include "gpu_skip.hpp"

namespace {

int failures = 0;
int checks = 0;
std::mt19937 gen{20240611};

using namespace dml_test;  // random_vector, to_device, to_host

// max |got − want| <= tol · max |want| (NaN fails); prints the largest difference seen.
template <class T>
void expect_close(const std::string& what, const std::vector<T>& got, const std::vector<T>& want, double tol) {
  ++checks;
  const double max_diff = dml_test::max_abs_difference(want, got).value, scale = dml_test::max_abs(want);
  const bool ok = max_diff <= tol * scale;  // vectors of other sizes differ infinitely
  std::printf("%-4s %-60s n=%-8zu max_abs_diff=%.3g\n", ok ? "ok" : "FAIL", what.c_str(), want.size(), max_diff);
  if (!ok) ++failures;
}

template <class T>
void check_attention(const dml::nn::attention_shape& s, double tol, const char* type) {
  const std::int64_t w = s.width();
  const auto qkv = random_vector<T>(gen, static_cast<std::size_t>(s.batch * s.seq * 3 * w), -2.f, 2.f);
  const auto dy = random_vector<T>(gen, static_cast<std::size_t>(s.batch * s.seq * w));
  const auto saved = static_cast<std::size_t>(dml::nn::attention_saved_size(s));
  const auto scratch = static_cast<std::size_t>(dml::nn::attention_scratch_size(s));

  std::vector<T> probs(saved), y(dy.size()), dqkv(qkv.size()), work(scratch);
  dml::nn::causal_attention_forward<dml::host>(s, qkv.data(), probs.data(), y.data());
  dml::nn::causal_attention_backward<dml::host>(s, qkv.data(), probs.data(), dy.data(), dqkv.data(), work.data());

  auto d_qkv = to_device(qkv), d_dy = to_device(dy);
  dml::buffer<T, dml::cuda> d_probs(saved), d_y(dy.size()), d_dqkv(qkv.size()), d_work(scratch);
  dml::nn::causal_attention_forward<dml::cuda>(s, d_qkv.data(), d_probs.data(), d_y.data());
  dml::nn::causal_attention_backward<dml::cuda>(s, d_qkv.data(), d_probs.data(), d_dy.data(), d_dqkv.data(),
                                                d_work.data());
  const std::string name = std::string(type) + " b=" + std::to_string(s.batch) + " t=" + std::to_string(s.seq) +
                           " h=" + std::to_string(s.heads) + " hd=" + std::to_string(s.head_dim);
  expect_close("attention probs " + name, to_host(d_probs.data(), saved), probs, tol);
  expect_close("attention y " + name, to_host(d_y.data(), y.size()), y, tol);
  expect_close("attention dqkv " + name, to_host(d_dqkv.data(), dqkv.size()), dqkv, tol);
}

// Tile attention: the shared-memory kernels against the host's tiles. docs: documents of 37 tokens.
template <class T>
void check_tiles(const dml::nn::tile_attention_shape& s, bool docs, double tol, const char* type) {
  const auto qkv = random_vector<T>(gen, static_cast<std::size_t>(s.batch * s.seq * s.row()), -2.f, 2.f);
  const auto dy = random_vector<T>(gen, static_cast<std::size_t>(s.batch * s.seq * s.width()));
  std::vector<std::int64_t> doc;
  if (docs)
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t t = 0; t < s.seq; ++t) doc.push_back(t / 37 * 37);
  const std::int64_t* h_doc = docs ? doc.data() : nullptr;
  const auto saved = static_cast<std::size_t>(dml::nn::tile_attention_saved_size(s));
  const auto ws = static_cast<std::size_t>(dml::nn::tile_attention_workspace_size(s));
  std::vector<T> y(dy.size()), dqkv(qkv.size());
  std::vector<float> lse(saved), work(ws);
  dml::nn::tile_attention_forward<dml::host>(s, qkv.data(), y.data(), lse.data(), h_doc);
  dml::nn::tile_attention_backward<dml::host>(s, qkv.data(), y.data(), lse.data(), dy.data(), dqkv.data(), work.data(),
                                             h_doc);

  auto d_qkv = to_device(qkv), d_dy = to_device(dy);
  dml::buffer<T, dml::cuda> d_y(dy.size()), d_dqkv(qkv.size());
  dml::buffer<float, dml::cuda> d_lse(saved), d_work(ws);
  const auto d_doc = to_device(docs ? doc : std::vector<std::int64_t>(1, 0));
  const std::int64_t* dev_doc = docs ? d_doc.data() : nullptr;
  dml::nn::tile_attention_forward<dml::cuda>(s, d_qkv.data(), d_y.data(), d_lse.data(), dev_doc);
  dml::nn::tile_attention_backward<dml::cuda>(s, d_qkv.data(), d_y.data(), d_lse.data(), d_dy.data(), d_dqkv.data(),
                                              d_work.data(), dev_doc);
  const std::string name = std::string(type) + " b=" + std::to_string(s.batch) + " t=" + std::to_string(s.seq) +
                           " h=" + std::to_string(s.heads) + " kv=" + std::to_string(s.kv()) +
                           " hd=" + std::to_string(s.head_dim) + (docs ? " documents" : "");
  expect_close("tiles lse " + name, to_host(d_lse.data(), saved), lse, 1e-4);
  expect_close("tiles y " + name, to_host(d_y.data(), y.size()), y, tol);
  expect_close("tiles dqkv " + name, to_host(d_dqkv.data(), dqkv.size()), dqkv, tol);
}

}  // namespace

int main() {
  if (gpu_skip::skip_without_device()) return gpu_skip::exit_code;
  try {
    // Short rows take the one-warp kernels, long ones (seq > 256) the 256-thread ones.
    const dml::nn::attention_shape shapes[] = {{1, 1, 1, 8}, {3, 17, 4, 13}, {2, 64, 2, 32}, {1, 300, 3, 64}};
    for (const auto& s : shapes) {
      check_attention<float>(s, 1e-4, "float");
      check_attention<dml::bf16>(s, 3e-2, "bf16");
    }
    const dml::nn::tile_attention_shape tiles[] = {{1, 1, 1, 0, 8}, {2, 70, 4, 2, 16}, {1, 200, 8, 1, 64},
                                                   {2, 129, 6, 3, 128}};
    for (const auto& s : tiles)
      for (const bool docs : {false, true}) {
        check_tiles<float>(s, docs, 1e-5, "float");
        check_tiles<dml::bf16>(s, docs, 1e-2, "bf16");
      }
    DML_CHECK_CUDA(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    std::printf("FAIL exception: %s\n", e.what());
    return 1;
  }
  std::printf("%d of %d checks failed\n", failures, checks);
  return failures == 0 ? 0 : 1;
}
