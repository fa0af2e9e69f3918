// SPDX-License-Identifier: Apache-2.0
// tests/nn/test_kv_cache.cpp — incremental decoding with nn::kv_cache: a GPT's and a Llama's logits for a prompt and
// then one (or a few) tokens a call equal those of one forward over the whole window, row for row (multi-head,
// grouped-query and multi-query attention, experts, two sequences at once); clear() starts again; bad calls fail.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "dml/nn/gpt.hpp"
#include "dml/nn/kv_cache.hpp"
#include "dml/nn/llama.hpp"
#include "dml/nn/network.hpp"
#include "support.hpp"

namespace test_kv_cache {

namespace {

using namespace dml;
using gpt_net = nn::network<host, nn::gpt_embedding, nn::stack<nn::gpt_block>, nn::gpt_head>;
using llama_net = nn::network<host, nn::llama_embedding, nn::stack<nn::llama_block>, nn::llama_head>;

std::vector<float> random_ids(std::int64_t n, std::int64_t vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<float>(rng() % static_cast<unsigned>(vocab));
  return v;
}

// Columns [from, from + n) of ids [batch, t].
std::vector<float> columns(const std::vector<float>& ids, std::int64_t batch, std::int64_t t, std::int64_t from,
                           std::int64_t n) {
  std::vector<float> out;
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t i = from; i < from + n; ++i) out.push_back(ids[static_cast<std::size_t>(b * t + i)]);
  return out;
}

// The whole window's logits, then the cached ones: a prompt of `prompt` tokens, then `step` tokens a call. Returns
// the largest difference over every row, relative to the logits' largest magnitude.
template <class Net>
double cached_against_whole(Net& net, std::int64_t batch, std::int64_t t, std::int64_t vocab, std::int64_t prompt,
                            std::int64_t step, nn::kv_cache& cache) {
  const auto ids = random_ids(batch * t, vocab, 7);
  const auto whole_view = net.forward(tensor_view<const float>(ids.data(), {batch, t}), {.training = false});
  const std::vector<float> whole(whole_view.data, whole_view.data + whole_view.numel());
  double scale = 0, worst = 0;
  for (const float v : whole) scale = std::max(scale, std::abs(static_cast<double>(v)));
  for (std::int64_t at = 0; at < t;) {
    const std::int64_t n = std::min(at == 0 ? prompt : step, t - at);
    const auto next = columns(ids, batch, t, at, n);
    const auto y = nn::forward_cached(net, cache, tensor_view<const float>(next.data(), {batch, n}));
    REQUIRE(y.shape == shape{batch, n, vocab});
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t v = 0; v < vocab; ++v)
          worst = std::max(worst, std::abs(static_cast<double>(y.data[(b * n + i) * vocab + v]) -
                                           whole[static_cast<std::size_t>((b * t + at + i) * vocab + v)]));
    at += n;
    CHECK(cache.length() == at);
  }
  return worst / scale;
}

nn::gpt_config gpt_small(std::int64_t experts = 0) {
  return {.vocab = 23, .seq = 12, .layers = 2, .d_model = 32, .heads = 4, .dropout = 0.f, .bias = true,
          .experts = experts, .top_k = 2, .capacity_factor = 0.f};
}
nn::llama_config llama_small(std::int64_t kv_heads, std::int64_t experts = 0) {
  return {.vocab = 19, .seq = 12, .d_model = 32, .layers = 2, .heads = 4, .kv_heads = kv_heads, .ffn_hidden = 24,
          .experts = experts, .top_k = 2, .capacity_factor = 0.f, .shared_experts = experts ? 1 : 0};
}

// Float sums in another order than the tile attention's: seen 3.4e-7 of the largest logit.
constexpr double bound = 1e-6;

}  // namespace

TEST_CASE("a GPT decoded with a KV cache gives the whole window's logits, a token at a time and a few at a time") {
  for (const std::int64_t experts : {0, 4}) {
    gpt_net net(nn::gpt(gpt_small(experts)), 3);
    for (const auto& [batch, prompt, step] : {std::tuple{1, 5, 1}, std::tuple{2, 3, 2}, std::tuple{1, 12, 1}}) {
      CAPTURE(experts);
      CAPTURE(batch);
      CAPTURE(step);
      nn::kv_cache cache(12);
      const double err = cached_against_whole(net, batch, 12, 23, prompt, step, cache);
      MESSAGE("GPT, experts ", experts, ", batch ", batch, ", ", step, " a call: ", err);
      CHECK(err <= bound);
      CHECK(cache.bytes() == 2 * 2 * batch * 4 * 12 * 8 * 4);  // k and v, layers, batch, heads, capacity, head_dim
    }
  }
}

TEST_CASE("a Llama decoded with a KV cache gives the whole window's logits (MHA, GQA, MQA, experts)") {
  for (const auto& [kv, experts] : {std::pair{4, 0}, std::pair{2, 0}, std::pair{1, 0}, std::pair{2, 4}}) {
    llama_net net(nn::llama(llama_small(kv, experts)), 5);
    for (const auto& [batch, prompt, step] : {std::tuple{1, 4, 1}, std::tuple{2, 1, 3}}) {
      CAPTURE(kv);
      CAPTURE(experts);
      CAPTURE(batch);
      nn::kv_cache cache(12);
      const double err = cached_against_whole(net, batch, 12, 19, prompt, step, cache);
      MESSAGE("Llama, kv_heads ", kv, ", experts ", experts, ", batch ", batch, ": ", err);
      CHECK(err <= bound);
      CHECK(cache.bytes() == 2 * 2 * batch * kv * 12 * 8 * 4);
    }
  }
}

TEST_CASE("clear() starts a new prompt, and the cache refuses what it cannot hold") {
  llama_net net(nn::llama(llama_small(2)), 5);
  nn::kv_cache cache(12);
  const auto ids = random_ids(12, 19, 9);
  const auto call = [&](auto& model, nn::kv_cache& kv, std::int64_t batch, std::int64_t n) {
    return dml_test::error_of<invalid_argument>(
        [&] { nn::forward_cached(model, kv, tensor_view<const float>(ids.data(), {batch, n})); });
  };
  const auto first = nn::forward_cached(net, cache, tensor_view<const float>(ids.data(), {1, 8}));
  const std::vector<float> logits(first.data, first.data + first.numel());
  // Past the capacity: 8 cached, 5 more.
  CHECK(call(net, cache, 1, 5) == "dml::nn::forward_cached: 8 positions are cached of 12; expected 1 to 4 new tokens, "
                                  "found 5 (clear() it, or start again from a shorter window)");
  CHECK(cache.length() == 8);
  // Another batch size on top of what is cached.
  CHECK(call(net, cache, 2, 1) == "dml::nn::kv_cache::attend: layer 1 cached 1 sequences of 2 key/value heads of 8, "
                                  "found 2 of 2 of 8 (clear() the cache before another batch)");
  cache.clear();
  const auto again = nn::forward_cached(net, cache, tensor_view<const float>(ids.data(), {1, 8}));
  CHECK(std::vector<float>(again.data, again.data + again.numel()) == logits);
  // A GPT's learned positions end at the capacity as well.
  gpt_net gpt(nn::gpt(gpt_small()), 3);
  nn::kv_cache small(4);
  CHECK(call(gpt, small, 1, 6) == "dml::nn::forward_cached: 0 positions are cached of 4; expected 1 to 4 new tokens, "
                                  "found 6 (clear() it, or start again from a shorter window)");
  CHECK_THROWS_AS(nn::kv_cache(0), invalid_argument);
}

TEST_CASE("a network without attention has nothing to cache") {
  nn::network<host, nn::linear<4, 3>> mlp(nn::sequential{nn::linear<4, 3>{}}, 1);
  nn::kv_cache cache(8);
  const std::vector<float> x(8, 0.5f);
  CHECK(dml_test::error_of<invalid_argument>([&] {
          nn::forward_cached(mlp, cache, tensor_view<const float>(x.data(), {2, 4}));
        }) == "dml::nn::forward_cached: no layer of the network keeps a KV cache (nn::gpt's and nn::llama's blocks do)");
}

}  // namespace test_kv_cache
