// SPDX-License-Identifier: Apache-2.0
// benchmarks/generate_throughput.cpp — sampling from a GPT or a Llama on the host: N greedy tokens after a prompt,
// each from a KV cache (nn::generate: one token's forward a token, the prompt in one forward) beside the same tokens
// each from a forward over the whole window before it (what sampling cost without a cache), in the same run: tokens/s
// of each and their ratio, the prompt's one forward, and whether both chose the same tokens. A cached token's products
// are matrix-vector: its rate stands beside this machine's streaming rate, measured in the same run.
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dml/dml.hpp"
#include "dml/plan/calibrate.hpp"

#include "bench_common.hpp"

namespace {

struct options {
  std::string arch = "gpt";
  std::int64_t layers = 4, d_model = 512, heads = 8, seq = 1024, vocab = 256, prompt = 896, tokens = 128;
  int threads = 1;
  bool quick = false;
};

struct figures {
  double prompt_seconds = 0, token_seconds = 0;  // the prompt's forward; each later token's, averaged
  double cache_bytes = 0;                         // keys and values a later token reads, on average
  std::vector<float> ids;
};

std::int64_t argmax(const float* row, std::int64_t n) { return std::max_element(row, row + n) - row; }

template <class Net>
figures cached(Net& net, const options& o, const std::vector<float>& prompt) {
  dml::nn::kv_cache cache(o.seq);
  figures f;
  const auto t0 = std::chrono::steady_clock::now();
  auto t1 = t0;
  f.ids = dml::nn::generate(net, cache, prompt, o.tokens, [&](const float* last, std::int64_t i) {
    if (i == 0) t1 = std::chrono::steady_clock::now();  // the prompt's forward is done
    return argmax(last, o.vocab);
  });
  f.prompt_seconds = std::chrono::duration<double>(t1 - t0).count();
  f.token_seconds = dml_bench::seconds_since(t1) / static_cast<double>(std::max<std::int64_t>(1, o.tokens - 1));
  const double positions = static_cast<double>(std::min(o.seq, o.prompt + o.tokens / 2));
  f.cache_bytes = static_cast<double>(cache.bytes()) * positions / static_cast<double>(o.seq);
  return f;
}

template <class Net>
figures whole(Net& net, const options& o, const std::vector<float>& prompt) {
  std::vector<float> tokens = prompt;
  figures f;
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < o.tokens; ++i) {
    const std::int64_t t = std::min<std::int64_t>(o.seq, static_cast<std::int64_t>(tokens.size()));
    const auto y = net.forward(dml::tensor_view<const float>(tokens.data() + tokens.size() - t, {1, t}), {.training = false});
    const auto id = static_cast<float>(argmax(y.data + (t - 1) * o.vocab, o.vocab));
    if (i == 0) f.prompt_seconds = dml_bench::seconds_since(t0);
    tokens.push_back(id);
    f.ids.push_back(id);
  }
  f.token_seconds = dml_bench::seconds_since(t0) / static_cast<double>(o.tokens);
  return f;
}

template <class Net, class Model>
void run(const options& o, Model model, const std::vector<float>& prompt) {
  Net net(std::move(model), 11);
  net.forward(dml::tensor_view<const float>(prompt.data(), {1, o.prompt}), {.training = false});  // warm
  const figures w = whole(net, o, prompt), c = cached(net, o, prompt);
  std::printf("%-32s %12s %12s\n", "", "whole window", "KV cache");
  std::printf("%-32s %12.1f %12.1f\n", "the prompt's forward, ms", 1e3 * w.prompt_seconds, 1e3 * c.prompt_seconds);
  std::printf("%-32s %12.2f %12.2f\n", "a later token, ms", 1e3 * w.token_seconds, 1e3 * c.token_seconds);
  std::printf("%-32s %12.1f %12.1f\n", "tokens/s after the prompt", 1 / w.token_seconds, 1 / c.token_seconds);
  std::printf("speed-up of a token with the cache: %.1fx; the same %lld tokens chosen: %s\n",
              w.token_seconds / c.token_seconds, static_cast<long long>(o.tokens), w.ids == c.ids ? "yes" : "no");
  // A cached token reads every weight once and the cached keys and values before it: at one token a call its products
  // are matrix-vector, bound by memory. The roofline: this machine's streaming rate, dml's AdamW update over as many
  // floats as the weights in the same run.
  const double weight_bytes = 4.0 * static_cast<double>(net.params().size()), read = weight_bytes + c.cache_bytes;
  const double stream = dml::cost::detail::update_bandwidth(static_cast<std::int64_t>(net.params().size()), 1, o.threads);
  std::printf("a cached token reads %.1f MB of weights and %.1f MB of keys and values (on average): %.1f GB/s, %.0f%% "
              "of the %.1f GB/s dml's AdamW update streams here\n", weight_bytes / 1e6, c.cache_bytes / 1e6,
              read / c.token_seconds / 1e9, 100 * read / c.token_seconds / stream, stream / 1e9);
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  dml::flags cli("generate_throughput",
                 "greedy sampling after a prompt: a KV cache beside a forward over the whole window per token.");
  cli.add("--arch", o.arch, "A", "gpt or llama").choices({"gpt", "llama"});
  cli.add("--layers", o.layers, "L", "blocks").min(1);
  cli.add("--d-model", o.d_model, "C", "width").min(1);
  cli.add("--heads", o.heads, "H", "attention heads (a Llama: a quarter of them key/value heads)").min(1);
  cli.add("--seq", o.seq, "T", "the window (the model's seq and the cache's capacity)").min(2);
  cli.add("--prompt", o.prompt, "P", "prompt tokens").min(1);
  cli.add("--tokens", o.tokens, "N", "tokens sampled after it").min(1);
  cli.add("--threads", o.threads, "N", "threads (dml::set_thread_budget)").min(1);
  cli.add_switch("--quick", o.quick, "a tiny model (a smoke run)");
  if (const auto status = dml_bench::parse_for_main(cli, argc, argv)) return *status;
  if (o.quick) o.layers = 1, o.d_model = 64, o.heads = 4, o.seq = 64, o.prompt = 40, o.tokens = 8;
  if (o.prompt + o.tokens > o.seq)
    std::printf("# the prompt and the tokens pass the window: the cache starts again from its last %lld tokens when "
                "full, the whole-window forward slides; the tokens may differ\n", static_cast<long long>(o.seq / 2));
  dml::set_thread_budget(o.threads);
  std::mt19937 gen(5);
  std::vector<float> prompt(static_cast<std::size_t>(o.prompt));
  for (auto& id : prompt) id = static_cast<float>(gen() % static_cast<unsigned>(o.vocab));
  const auto start = dml_bench::load_meter::now();
  std::printf("# %s; %d thread(s); %s, %lld layers, d_model %lld, %lld heads, window %lld; f32; %lld greedy tokens "
              "after a prompt of %lld (random weights)\n", dml::host_cpu_model().c_str(), o.threads, o.arch.c_str(),
              static_cast<long long>(o.layers), static_cast<long long>(o.d_model), static_cast<long long>(o.heads),
              static_cast<long long>(o.seq), static_cast<long long>(o.tokens), static_cast<long long>(o.prompt));
  if (o.arch == "gpt") {
    using net = dml::nn::network<dml::host, dml::nn::gpt_embedding, dml::nn::stack<dml::nn::gpt_block>, dml::nn::gpt_head>;
    run<net>(o, dml::nn::gpt({.vocab = o.vocab, .seq = o.seq, .layers = o.layers, .d_model = o.d_model, .heads = o.heads}),
             prompt);
  } else {
    using net = dml::nn::network<dml::host, dml::nn::llama_embedding, dml::nn::stack<dml::nn::llama_block>,
                                 dml::nn::llama_head>;
    const std::int64_t kv = o.heads % 4 == 0 ? o.heads / 4 : o.heads;
    run<net>(o, dml::nn::llama({.vocab = o.vocab, .seq = o.seq, .d_model = o.d_model, .layers = o.layers, .heads = o.heads,
                                .kv_heads = kv, .ffn_hidden = (8 * o.d_model / 3 + 63) / 64 * 64}),
             prompt);
  }
  std::printf("# other processes used %.0f%% of the machine meanwhile\n", 100 * dml_bench::load_meter::others_since(start));
  return 0;
}
