// SPDX-License-Identifier: Apache-2.0
// tests/cuda/test_cuda_llama.cu — a Llama's forward, loss and backward (grouped-query attention, RoPE with Llama 3.1's
// scaling, SwiGLU) in dml::cuda against dml::host from the same initial weights and tokens. Needs a GPU (ctest label
// gpu); without one it prints `SKIPPED: <reason>` and exits 77.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "dml/core/buffer.hpp"
#include "dml/nn/llama.hpp"
#include "dml/nn/loss.hpp"
#include "dml/nn/network.hpp"
#include "../support.hpp"
#include "gpu_skip.hpp"

namespace {

using namespace dml;
using model_t = nn::llama_model;
template <class S>
using net_t = nn::network<S, nn::llama_embedding, nn::stack<nn::llama_block>, nn::llama_head>;

int failures = 0;

void expect_close(const char* what, const std::vector<float>& got, const std::vector<float>& want, double tol) {
  const double diff = dml_test::max_abs_difference(want, got).value, scale = dml_test::max_abs(want);
  const bool ok = diff <= tol * std::max(scale, 1e-6);
  std::printf("%s %s: max diff %.3g (scale %.3g)\n", ok ? "ok  " : "FAIL", what, diff, scale);
  failures += ok ? 0 : 1;
}

template <class S>
std::pair<float, std::vector<float>> run(const model_t& model, const std::vector<float>& ids, const std::vector<std::int32_t>& labels,
                                         std::int64_t b, std::int64_t t, std::int64_t vocab, std::vector<float>& logits) {
  net_t<S> net(model, 3);
  buffer<float, S> x(ids.size()), dlogits(static_cast<std::size_t>(b * t * vocab)), row(static_cast<std::size_t>(b * t));
  buffer<std::int32_t, S> y(labels.size());
  copy_n(ids.data(), ids.size(), x.data());
  copy_n(labels.data(), labels.size(), y.data());
  const nn::context c{.training = true, .seed = 1, .step = 1};
  auto out = net.forward(tensor_view<const float, S>(x.data(), {b, t}), c);
  logits.resize(static_cast<std::size_t>(out.numel()));
  copy_n(out.data, logits.size(), logits.data());
  const float loss = nn::softmax_cross_entropy{}.forward_backward<S>(out, y.data(), tensor_view<float, S>(dlogits.data(), out.shape),
                                                                      row.data());
  net.backward(tensor_view<const float, S>(dlogits.data(), out.shape), c);
  std::vector<float> grads(static_cast<std::size_t>(net.layout().total));
  copy_n(net.grads().data(), grads.size(), grads.data());
  return {loss, grads};
}

}  // namespace

int main() {
  if (gpu_skip::skip_without_device()) return gpu_skip::exit_code;
  const nn::llama_config g{.vocab = 64, .seq = 32, .d_model = 64, .layers = 2, .heads = 8, .kv_heads = 2, .ffn_hidden = 96,
                           .rope = {.theta = 500000, .scaling = nn::rope_scaling{}}};
  const auto model = nn::llama(g);
  const std::int64_t b = 3, t = 32;
  std::vector<float> ids(static_cast<std::size_t>(b * t));
  std::vector<std::int32_t> labels(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<float>((i * 7 + 3) % 64);
    labels[i] = static_cast<std::int32_t>((i * 5 + 1) % 64);
  }
  std::vector<float> host_logits, cuda_logits;
  const auto [host_loss, host_grads] = run<dml::host>(model, ids, labels, b, t, g.vocab, host_logits);
  const auto [cuda_loss, cuda_grads] = run<dml::cuda>(model, ids, labels, b, t, g.vocab, cuda_logits);
  expect_close("logits", cuda_logits, host_logits, 1e-4);
  expect_close("loss", {cuda_loss}, {host_loss}, 1e-5);
  expect_close("gradients", cuda_grads, host_grads, 1e-3);
  return failures == 0 ? 0 : 1;
}
