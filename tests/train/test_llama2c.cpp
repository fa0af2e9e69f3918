// SPDX-License-Identifier: Apache-2.0
// tests/train/test_llama2c.cpp — nn::llama's weights as llama2.c's legacy checkpoint (train/llama2c.hpp): the
// header, the file's size, where each tensor lands and q/k rows in Meta's interleaved order, tied and untied; the
// configs run.c cannot run refused with no file written; and (the case named "Python") the file read by
// tests/train/llama2c_check.py, which runs run.c's forward in numpy against dml's logits.
#include <doctest/doctest.h>

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dml/nn/llama.hpp"
#include "dml/nn/network.hpp"
#include "dml/train/llama2c.hpp"
#include "support.hpp"

namespace test_llama2c {

namespace {

namespace fs = std::filesystem;
using namespace dml;
using dml_test::temp_dir;
using llama_net = nn::network<host, nn::llama_embedding, nn::stack<nn::llama_block>, nn::llama_head>;

// 2 layers, 4 query heads over 2 key/value heads of head_dim 4 (grouped-query), SwiGLU width 12.
nn::llama_config tiny(bool tied) {
  return {.vocab = 11, .seq = 8, .d_model = 16, .layers = 2, .heads = 4, .kv_heads = 2, .ffn_hidden = 12,
          .tie_embeddings = tied};
}

// Norms 1 ± 0.3, the embedding N(0, 1), matrices N(0, 1/in), distinct in every element; a tied head is the embedding.
std::vector<float> random_params(const nn::param_layout& l, unsigned seed, bool tied) {
  std::mt19937 gen(seed);
  std::vector<float> flat(static_cast<std::size_t>(l.total), 0.f);
  for (const auto& s : l.slots) {
    float* w = flat.data() + s.offset;
    const bool norm = s.name.ends_with("norm.weight");
    std::uniform_real_distribution<float> u(0.7f, 1.3f);
    const bool embed = s.name == "model.embed_tokens.weight";
    std::normal_distribution<float> n(0.f, embed ? 1.f : 1.f / std::sqrt(float(s.shape[1])));
    for (std::int64_t i = 0; i < s.shape.numel(); ++i) w[i] = norm ? u(gen) : n(gen);
  }
  if (tied) {
    const auto& e = l.find("model.embed_tokens.weight");
    std::copy_n(flat.begin() + e.offset, e.shape.numel(), flat.begin() + l.find("lm_head.weight").offset);
  }
  return flat;
}

std::vector<char> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  return out;
}

// `n` floats of the file from float index `at` (after the header) equal `n` floats of flat from `from`.
bool same(const std::vector<char>& file, std::int64_t at, const std::vector<float>& flat, std::int64_t from,
          std::int64_t n) {
  return std::memcmp(file.data() + 28 + 4 * at, flat.data() + from, static_cast<std::size_t>(4 * n)) == 0;
}

}  // namespace

TEST_CASE("export_llama2c writes llama2.c's header, every tensor where run.c reads it, q and k in Meta's order") {
  for (bool tied : {false, true}) {
    CAPTURE(tied);
    const auto g = tiny(tied);
    const auto layout = nn::make_layout(nn::llama(g));
    const auto flat = random_params(layout, 7, tied);
    temp_dir dir("dml-llama2c");
    train::export_llama2c(g, layout, flat, dir / "model.bin");
    CHECK(listing(dir.path) == std::vector<std::string>{"model.bin"});
    const auto file = read_bytes(dir / "model.bin");

    std::int32_t h[7];
    REQUIRE(file.size() >= sizeof h);
    std::memcpy(h, file.data(), sizeof h);
    CHECK(h[0] == 16);  // dim
    CHECK(h[1] == 12);  // hidden_dim
    CHECK(h[2] == 2);   // n_layers
    CHECK(h[3] == 4);   // n_heads
    CHECK(h[4] == 2);   // n_kv_heads
    CHECK(h[5] == (tied ? 11 : -11));
    CHECK(h[6] == 8);   // seq_len

    const std::int64_t dim = 16, hidden = 12, layers = 2, kv_dim = 8, vocab = 11, seq = 8, hd = 4;
    // Float offsets of run.c's memory_map_weights.
    const std::int64_t rms_att = vocab * dim, wq = rms_att + layers * dim, wk = wq + layers * dim * dim,
                       wv = wk + layers * kv_dim * dim, wo = wv + layers * kv_dim * dim,
                       rms_ffn = wo + layers * dim * dim,
                       w1 = rms_ffn + layers * dim, w2 = w1 + layers * hidden * dim, w3 = w2 + layers * dim * hidden,
                       rms_final = w3 + layers * hidden * dim, freq = rms_final + dim, wcls = freq + seq * hd;
    CHECK(file.size() == static_cast<std::size_t>(28 + 4 * (wcls + (tied ? 0 : vocab * dim))));

    const auto at = [&](const std::string& name) { return layout.find(name).offset; };
    const std::string l1 = "model.layers.1.";
    CHECK(same(file, 0, flat, at("model.embed_tokens.weight"), vocab * dim));
    CHECK(same(file, rms_att + dim, flat, at(l1 + "input_layernorm.weight"), dim));
    // q of layer 1: in head 1, run.c's row 4 + 2·0 + 1 (pair 0, its second) is rotate-half's row 4 + 2 + 0; in
    // head 2, row 8 + 2·1 + 0 (pair 1, its first) is rotate-half's 8 + 0 + 1.
    const std::int64_t qkv = at(l1 + "self_attn.qkv_proj.weight");
    CHECK(same(file, wq + dim * dim + (hd + 1) * dim, flat, qkv + (hd + 2 + 0) * dim, dim));
    CHECK(same(file, wq + dim * dim + (2 * hd + 2) * dim, flat, qkv + (2 * hd + 0 + 1) * dim, dim));
    // k of layer 1, kv head 1 (k's rows follow q's 16): row 4 + 2·1 + 0 is rotate-half's 4 + 0 + 1.
    CHECK(same(file, wk + kv_dim * dim + (hd + 2) * dim, flat, qkv + (dim + hd + 1) * dim, dim));
    // v as it is, after q and k.
    CHECK(same(file, wv + kv_dim * dim, flat, qkv + (dim + kv_dim) * dim, kv_dim * dim));
    CHECK(same(file, wo + dim * dim, flat, at(l1 + "self_attn.o_proj.weight"), dim * dim));
    CHECK(same(file, rms_ffn + dim, flat, at(l1 + "post_attention_layernorm.weight"), dim));
    const std::int64_t gate_up = at(l1 + "mlp.gate_up_proj.weight");
    CHECK(same(file, w1 + hidden * dim, flat, gate_up, hidden * dim));
    CHECK(same(file, w2 + dim * hidden, flat, at(l1 + "mlp.down_proj.weight"), dim * hidden));
    CHECK(same(file, w3 + hidden * dim, flat, gate_up + hidden * dim, hidden * dim));
    CHECK(same(file, rms_final, flat, at("model.norm.weight"), dim));
    if (!tied) CHECK(same(file, wcls, flat, at("lm_head.weight"), vocab * dim));
    // freq_cis_real and _imag: cos and sin of position 3 × theta^(-2/4), [seq, hd/2] each.
    float c, s;
    std::memcpy(&c, file.data() + 28 + 4 * (freq + 3 * 2 + 1), 4);
    std::memcpy(&s, file.data() + 28 + 4 * (freq + seq * 2 + 3 * 2 + 1), 4);
    CHECK(c == doctest::Approx(std::cos(3 / 100.)).epsilon(1e-6));
    CHECK(s == doctest::Approx(std::sin(3 / 100.)).epsilon(1e-6));
  }
}

TEST_CASE("export_llama2c refuses what run.c computes otherwise, and writes nothing") {
  temp_dir dir("dml-llama2c-refuse");
  const auto refused = [&](nn::llama_config g, const std::string& message) {
    const auto layout = nn::make_layout(nn::llama(g));
    const auto flat = random_params(layout, 3, false);
    CHECK(dml_test::error_of<invalid_argument>([&] { train::export_llama2c(g, layout, flat, dir / "model.bin"); }) ==
          "dml::train::export_llama2c: " + message);
    CHECK(listing(dir.path).empty());
  };
  auto g = tiny(false);
  g.rope.theta = 500000;
  refused(g, "rope.theta: llama2.c expects 10000, found 500000");
  g = tiny(false);
  g.rope.scaling = nn::rope_scaling{};
  refused(g, "rope.scaling: llama2.c expects none, found Llama 3.1's (factor 8)");
  g = tiny(false);
  g.norm_eps = 1e-6f;
  refused(g, "norm_eps: llama2.c expects 1e-05, found 1e-06");

  // A refusal leaves an earlier file as it was.
  g = tiny(false);
  const auto layout = nn::make_layout(nn::llama(g));
  const auto flat = random_params(layout, 3, false);
  train::export_llama2c(g, layout, flat, dir / "model.bin");
  const auto before = read_bytes(dir / "model.bin");
  g.norm_eps = 1e-6f;
  CHECK_THROWS_AS(train::export_llama2c(g, layout, flat, dir / "model.bin"), invalid_argument);
  CHECK(read_bytes(dir / "model.bin") == before);
  CHECK(listing(dir.path) == std::vector<std::string>{"model.bin"});
  // A layout of another model is refused as save_hf_llama refuses it.
  const auto other = tiny(true);
  CHECK_THROWS_AS(train::export_llama2c(other, nn::make_layout(nn::llama(nn::llama_config{})), flat, dir / "x.bin"),
                  invalid_argument);
  CHECK(listing(dir.path) == std::vector<std::string>{"model.bin"});
}

// ---- against an independent reader: tests/train/llama2c_check.py.

namespace {

// Writes the file of a random model in dir/model.bin, 3 token sequences, dml's logits for them and case.json.
void write_case(const fs::path& dir, bool tied) {
  fs::create_directories(dir);
  const nn::llama_config g{.vocab = 64, .seq = 16, .d_model = 32, .layers = 2, .heads = 4, .kv_heads = 2,
                           .ffn_hidden = 96, .tie_embeddings = tied};
  llama_net net(nn::llama(g), 1);
  const auto flat = random_params(net.layout(), 11, tied);
  std::ranges::copy(flat, net.params().begin());
  train::export_llama2c(g, net, dir / "model.bin");
  const std::int64_t batch = 3;
  std::mt19937 gen(17);
  std::vector<float> ids(static_cast<std::size_t>(batch * g.seq));
  std::vector<std::int32_t> tokens(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    tokens[i] = static_cast<std::int32_t>(gen() % 64);
    ids[i] = float(tokens[i]);
  }
  const auto y = net.forward(tensor_view<const float>(ids.data(), {batch, g.seq}));
  REQUIRE(y.shape == shape{batch, g.seq, g.vocab});
  std::ofstream(dir / "tokens.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 4));
  std::ofstream(dir / "logits.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(y.data), static_cast<std::streamsize>(y.numel() * 4));
  std::ofstream(dir / "case.json") << nlohmann::json{{"tied", tied}, {"batch", batch}, {"seq", g.seq}}.dump() << "\n";
}

}  // namespace

TEST_CASE("Python: run.c's forward in numpy from the exported file gives dml's logits") {
  temp_dir dir("dml-llama2c-py");
  write_case(dir / "untied", false);
  write_case(dir / "tied", true);
  const std::string cmd = std::string(DML_TEST_PYTHON) + " " + DML_TEST_SOURCE_DIR + "/llama2c_check.py '" +
                          (dir / "untied").string() + "' '" + (dir / "tied").string() + "'";
  INFO(cmd);
  const int rc = std::system(cmd.c_str());
  if (WIFEXITED(rc) && WEXITSTATUS(rc) == 77) {
    dml_test::skip(std::string(DML_TEST_PYTHON) + " lacks numpy");
    return;
  }
  REQUIRE(rc == 0);
}

}  // namespace test_llama2c
