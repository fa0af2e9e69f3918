// SPDX-License-Identifier: Apache-2.0
// tests/train/test_hf_llama.cpp — nn::llama's weights as a Hugging Face checkpoint (train/hf_llama.hpp): names,
// shapes and config.json; save and load bit for bit in F32 and within one rounding in BF16 and F16, tied and untied;
// shards and their index; every refusal of config.json and of the tensors, with flat untouched; and (cases named
// "Python") the files read by tests/train/hf_llama_check.py, a reader of its own that runs LlamaForCausalLM's
// forward in plain torch from the Hugging Face tensors against dml's logits.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dml/nn/llama.hpp"
#include "dml/nn/network.hpp"
#include "dml/train/hf_llama.hpp"
#include "support.hpp"

namespace test_hf_llama {

namespace {

namespace fs = std::filesystem;
using namespace dml;
using dml_test::temp_dir;
using llama_net = nn::network<host, nn::llama_embedding, nn::stack<nn::llama_block>, nn::llama_head>;

// 2 layers, 4 query heads over 2 key/value heads of head_dim 4 (grouped-query), SwiGLU width 12.
nn::llama_config tiny(bool tied, bool scaled = false) {
  nn::llama_config g{.vocab = 11, .seq = 8, .d_model = 16, .layers = 2, .heads = 4, .kv_heads = 2, .ffn_hidden = 12,
                     .tie_embeddings = tied};
  if (scaled) g.rope = {.theta = 500000, .scaling = nn::rope_scaling{}};
  return g;
}

// Parameters at the scale of a trained model's, distinct in every element: norms 1 ± 0.3, the embedding N(0, 1),
// matrices N(0, 1/in). A tied head is the embedding. Padding stays zero.
std::vector<float> random_params(const nn::param_layout& l, unsigned seed, bool tied) {
  std::mt19937 gen(seed);
  std::vector<float> flat(static_cast<std::size_t>(l.total), 0.f);
  for (const auto& s : l.slots) {
    float* w = flat.data() + s.offset;
    if (s.name.ends_with("norm.weight")) {
      std::uniform_real_distribution<float> d(0.7f, 1.3f);
      for (std::int64_t i = 0; i < s.shape.numel(); ++i) w[i] = d(gen);
    } else {
      std::normal_distribution<float> d(0.f, s.name == "model.embed_tokens.weight" ? 1.f : 1.f / std::sqrt(float(s.shape[1])));
      for (std::int64_t i = 0; i < s.shape.numel(); ++i) w[i] = d(gen);
    }
  }
  if (tied) {
    const auto& e = l.find("model.embed_tokens.weight");
    std::copy_n(flat.begin() + e.offset, e.shape.numel(), flat.begin() + l.find("lm_head.weight").offset);
  }
  return flat;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::set<std::string> listing(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

// Hugging Face's names and shapes for tiny(): LlamaForCausalLM's state dict.
std::map<std::string, std::vector<std::int64_t>> hf_shapes(bool tied) {
  std::map<std::string, std::vector<std::int64_t>> out{
      {"model.embed_tokens.weight", {11, 16}}, {"model.norm.weight", {16}}};
  for (int i = 0; i < 2; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    out[p + "self_attn.q_proj.weight"] = {16, 16};
    out[p + "self_attn.k_proj.weight"] = {8, 16};
    out[p + "self_attn.v_proj.weight"] = {8, 16};
    out[p + "self_attn.o_proj.weight"] = {16, 16};
    out[p + "mlp.gate_proj.weight"] = {12, 16};
    out[p + "mlp.up_proj.weight"] = {12, 16};
    out[p + "mlp.down_proj.weight"] = {16, 12};
    out[p + "input_layernorm.weight"] = {16};
    out[p + "post_attention_layernorm.weight"] = {16};
  }
  if (!tied) out["lm_head.weight"] = {11, 16};
  return out;
}

// Every tensor of a checkpoint directory (one file or shards) as floats, by name.
std::map<std::string, std::vector<float>> read_all(const fs::path& dir) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& name : listing(dir)) {
    if (!name.ends_with(".safetensors")) continue;
    const auto f = train::safetensors_file::open(dir / name);
    for (const auto& t : f.tensors()) {
      REQUIRE(t.dtype == dtype::f32);
      std::vector<float> v(t.bytes / 4);
      f.read<float>(t.name, std::span<float>(v), t.shape);
      REQUIRE(out.emplace(t.name, std::move(v)).second);
    }
  }
  return out;
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}
void write_text(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
  REQUIRE(out.good());
}
std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Rewrites a safetensors file through edit(tensors), which may drop, add or change entries.
template <class F>
void rewrite(const fs::path& p, F edit) {
  const auto f = train::safetensors_file::open(p);
  std::vector<std::vector<std::byte>> keep;
  std::vector<train::tensor_ref> refs;
  for (const auto& t : f.tensors()) {
    const auto b = f.bytes(t.name);
    keep.emplace_back(b.begin(), b.end());
  }
  for (std::size_t i = 0; i < f.tensors().size(); ++i)
    refs.push_back({f.tensors()[i].name, f.tensors()[i].dtype, f.tensors()[i].shape, keep[i]});
  edit(refs);
  train::save_safetensors(p, refs, f.metadata());
}

}  // namespace

TEST_CASE("save_hf_llama writes Hugging Face's names, shapes and config; F32 loads back bit for bit, tied and untied") {
  for (bool tied : {false, true}) {
    CAPTURE(tied);
    const auto g = tiny(tied, true);
    const auto layout = nn::make_layout(nn::llama(g));
    const auto flat = random_params(layout, 7, tied);
    temp_dir dir("dml-hf-llama");
    const auto ckpt = dir / "ckpt";
    train::save_hf_llama(g, layout, flat, ckpt);
    CHECK(listing(ckpt) == std::set<std::string>{"config.json", "model.safetensors"});
    CHECK(listing(dir.path) == std::set<std::string>{"ckpt"});  // no staging left beside it

    const auto file = train::safetensors_file::open(ckpt / "model.safetensors");
    CHECK(file.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
    std::map<std::string, std::vector<std::int64_t>> shapes;
    std::vector<std::string> order;
    for (const auto& t : file.tensors()) {
      CHECK(t.dtype == dtype::f32);
      shapes[t.name] = t.shape;
      order.push_back(t.name);
    }
    CHECK(shapes == hf_shapes(tied));
    CHECK(std::ranges::is_sorted(order));  // as the safetensors library stores them
    // q, k and v are rows [0, 16), [16, 24) and [24, 32) of qkv_proj; gate and up rows [0, 12) and [12, 24) of gate_up.
    const auto rows_of = [&](const char* fused, std::int64_t first, std::int64_t n) {
      const auto& s = layout.find(fused);
      const auto* p = reinterpret_cast<const std::byte*>(flat.data() + s.offset + first * s.shape[1]);
      return std::vector<std::byte>(p, p + n * s.shape[1] * 4);
    };
    const auto bytes_of = [&](const char* name) {
      const auto b = file.bytes(name);
      return std::vector<std::byte>(b.begin(), b.end());
    };
    CHECK(bytes_of("model.layers.1.self_attn.q_proj.weight") == rows_of("model.layers.1.self_attn.qkv_proj.weight", 0, 16));
    CHECK(bytes_of("model.layers.1.self_attn.k_proj.weight") == rows_of("model.layers.1.self_attn.qkv_proj.weight", 16, 8));
    CHECK(bytes_of("model.layers.1.self_attn.v_proj.weight") == rows_of("model.layers.1.self_attn.qkv_proj.weight", 24, 8));
    CHECK(bytes_of("model.layers.0.mlp.gate_proj.weight") == rows_of("model.layers.0.mlp.gate_up_proj.weight", 0, 12));
    CHECK(bytes_of("model.layers.0.mlp.up_proj.weight") == rows_of("model.layers.0.mlp.gate_up_proj.weight", 12, 12));

    const std::string text = read_text(ckpt / "config.json");
    const auto cfg = nlohmann::json::parse(text);
    CHECK(text == cfg.dump(2) + "\n");  // sorted keys, indent 2, as transformers writes
    CHECK(cfg["architectures"] == nlohmann::json::array({"LlamaForCausalLM"}));
    CHECK(cfg["model_type"] == "llama");
    CHECK(cfg["torch_dtype"] == "float32");
    CHECK(cfg["tie_word_embeddings"] == tied);
    CHECK(cfg["num_key_value_heads"] == 2);
    CHECK(cfg["head_dim"] == 4);
    CHECK(cfg["attention_bias"] == false);
    CHECK(cfg["mlp_bias"] == false);
    CHECK(cfg["hidden_act"] == "silu");
    CHECK(text.find("\"rms_norm_eps\": 1e-05,") != std::string::npos);
    CHECK(cfg["rope_scaling"] == nlohmann::json{{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                                                {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}});
    CHECK(text.find("\"original_max_position_embeddings\": 8192,\n") != std::string::npos);

    const auto back = train::read_hf_llama_config(ckpt);
    CHECK(back.vocab == g.vocab);
    CHECK(back.seq == g.seq);
    CHECK(back.d_model == g.d_model);
    CHECK(back.layers == g.layers);
    CHECK(back.heads == g.heads);
    CHECK(back.kv_heads == g.kv_heads);
    CHECK(back.ffn_hidden == g.ffn_hidden);
    CHECK(back.norm_eps == g.norm_eps);
    CHECK(back.rope.theta == g.rope.theta);
    REQUIRE(back.rope.scaling);
    CHECK(back.rope.scaling->factor == 8);
    CHECK(back.rope.scaling->original_max_position_embeddings == 8192);
    CHECK(back.tie_embeddings == tied);

    std::vector<float> loaded(flat.size(), 0.f);
    train::load_hf_llama(g, layout, loaded, ckpt);
    CHECK(same_bits(loaded, flat));

    // Through a network: the same bits in its parameters.
    llama_net net(nn::llama(g), 3);
    train::load_hf_llama(g, net, ckpt);
    CHECK(same_bits(std::vector<float>(net.params().begin(), net.params().end()), flat));
    train::save_hf_llama(g, net, dir / "again");
    CHECK(read_all(dir / "again") == read_all(ckpt));
  }
}

TEST_CASE("BF16 and F16 checkpoints: each value within one rounding, torch_dtype named") {
  for (auto type : {dtype::bf16, dtype::f16}) {
    const bool bf = type == dtype::bf16;
    CAPTURE(bf);
    const auto g = tiny(false);
    const auto layout = nn::make_layout(nn::llama(g));
    const auto flat = random_params(layout, 8, false);
    temp_dir dir("dml-hf-llama");
    train::save_hf_llama(g, layout, flat, dir / "ckpt", {.dtype = type});
    const auto file = train::safetensors_file::open(dir / "ckpt" / "model.safetensors");
    for (const auto& t : file.tensors()) CHECK(t.dtype == type);
    CHECK(read_json(dir / "ckpt" / "config.json")["torch_dtype"] == (bf ? "bfloat16" : "float16"));
    std::vector<float> loaded(flat.size(), 0.f);
    train::load_hf_llama(g, layout, loaded, dir / "ckpt");
    double max_rel = 0;
    bool rounded = true;
    for (std::size_t i = 0; i < flat.size(); ++i) {
      const float want = bf ? float(bf16(flat[i])) : float(fp16(flat[i]));
      rounded = rounded && loaded[i] == want;
      if (flat[i] != 0) max_rel = std::max(max_rel, std::abs(double(loaded[i]) - flat[i]) / std::abs(flat[i]));
    }
    MESSAGE(std::string(bf ? "bf16" : "f16"), " round trip: max_rel_diff=", max_rel);
    CHECK(rounded);  // exactly the nearest 16-bit value
    CHECK(max_rel <= (bf ? 1.0 / 256 : 1.0 / 2048));  // half an ulp: 2^-8 (bf16), 2^-11 (f16)
    CHECK(max_rel > 0);
  }
}

TEST_CASE("sharded save: Hugging Face's file names, index and split, the same tensors, loads bit for bit") {
  const auto g = tiny(false);
  const auto layout = nn::make_layout(nn::llama(g));
  const auto flat = random_params(layout, 9, false);
  temp_dir dir("dml-hf-llama");
  train::save_hf_llama(g, layout, flat, dir / "one");
  // F32 bytes: embedding and head 704, q and o 1024, k and v 512, gate, up and down 768, norms 64. At 1000 bytes a
  // file, q and o exceed the limit and get files of their own.
  const std::uint64_t max = 1000;
  train::save_hf_llama(g, layout, flat, dir / "many", {.max_shard_bytes = max});
  const auto files = listing(dir / "many");
  CHECK(!files.contains("model.safetensors"));
  const auto index_text = read_text(dir / "many" / "model.safetensors.index.json");
  const auto index = nlohmann::json::parse(index_text);
  CHECK(index_text == index.dump(2) + "\n");
  CHECK(index_text.starts_with("{\n  \"metadata\": {\n    \"total_size\": "));
  const auto& wm = index["weight_map"];
  const std::set<std::string> shard_files = [&] {
    std::set<std::string> s;
    for (const auto& f : wm) s.insert(f.get<std::string>());
    return s;
  }();
  const std::size_t n = shard_files.size();
  MESSAGE("tiny llama at max_shard_bytes=", max, ": ", n, " files");
  CHECK(n == 16);
  for (std::size_t k = 1; k <= n; ++k) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k, n);
    CHECK(shard_files.contains(name));
    // Each file stays within the limit unless it holds one larger tensor alone.
    const auto f = train::safetensors_file::open(dir / "many" / name);
    std::uint64_t bytes = 0;
    for (const auto& t : f.tensors()) {
      bytes += t.bytes;
      CHECK(wm[t.name] == name);
    }
    CHECK((bytes <= max || f.tensors().size() == 1));
    CHECK(f.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
  }
  std::set<std::string> expected_files(shard_files);
  expected_files.insert({"config.json", "model.safetensors.index.json"});
  CHECK(files == expected_files);
  const auto one = read_all(dir / "one");
  CHECK(read_all(dir / "many") == one);
  std::uint64_t total = 0;
  for (const auto& [name, v] : one) {
    total += v.size() * 4;
    CHECK(wm.contains(name));
  }
  CHECK(wm.size() == one.size());
  CHECK(index["metadata"]["total_size"] == total);
  CHECK(index["metadata"].size() == 1);

  std::vector<float> loaded(flat.size(), 0.f);
  train::load_hf_llama(g, layout, loaded, dir / "many");
  CHECK(same_bits(loaded, flat));

  // Saving over a checkpoint of the other layout leaves only the new one's weight files; other files stay.
  write_text(dir / "many" / "tokenizer.json", "{}\n");
  train::save_hf_llama(g, layout, flat, dir / "many");
  CHECK(listing(dir / "many") == std::set<std::string>{"config.json", "model.safetensors", "tokenizer.json"});
  train::save_hf_llama(g, layout, flat, dir / "many", {.max_shard_bytes = 4000});
  auto after = listing(dir / "many");
  CHECK(!after.contains("model.safetensors"));
  CHECK(after.contains("model.safetensors.index.json"));
  CHECK(after.contains("tokenizer.json"));
  CHECK(std::ranges::count_if(after, [](const std::string& s) { return s.starts_with("model-"); }) == 4);
  std::fill(loaded.begin(), loaded.end(), 0.f);
  train::load_hf_llama(g, layout, loaded, dir / "many");
  CHECK(same_bits(loaded, flat));
  CHECK(listing(dir.path) == std::set<std::string>{"many", "one"});
}

TEST_CASE("read_hf_llama_config: Hugging Face's defaults, and one line naming the key for what nn::llama cannot compute") {
  temp_dir dir("dml-hf-llama");
  const auto g = tiny(false, true);
  const auto layout = nn::make_layout(nn::llama(g));
  train::save_hf_llama(g, layout, random_params(layout, 1, false), dir / "ckpt");
  const auto path = dir / "ckpt" / "config.json";
  const auto base = read_json(path);
  const auto with = [&](auto edit) {
    auto j = base;
    edit(j);
    write_text(path, j.dump(2));
  };

  // Absent keys take LlamaConfig's defaults; rope_type "default" is plain RoPE.
  with([](nlohmann::json& j) {
    for (const char* k : {"num_key_value_heads", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "attention_bias",
                          "mlp_bias", "hidden_act", "head_dim", "rope_scaling", "torch_dtype", "architectures"})
      j.erase(k);
  });
  auto d = train::read_hf_llama_config(dir / "ckpt");
  CHECK(d.kv_heads == 4);
  CHECK(d.norm_eps == 1e-6f);
  CHECK(d.rope.theta == 10000);
  CHECK(!d.rope.scaling);
  CHECK(!d.tie_embeddings);
  with([](nlohmann::json& j) { j["rope_scaling"] = {{"rope_type", "default"}}; });
  CHECK(!train::read_hf_llama_config(dir / "ckpt").rope.scaling);
  with([](nlohmann::json& j) { j["rope_scaling"].erase("rope_type"), j["rope_scaling"]["type"] = "llama3"; });
  CHECK(train::read_hf_llama_config(dir / "ckpt").rope.scaling->factor == 8);

  const std::string p = path.string() + ": ";
  const auto refuses = [&](auto edit, const std::string& message) {
    with(edit);
    CHECK_THROWS_WITH_AS(train::read_hf_llama_config(dir / "ckpt"), (p + message).c_str(), format_error);
  };
  refuses([](nlohmann::json& j) { j["rope_scaling"]["rope_type"] = "yarn"; },
          "'rope_scaling.rope_type': expected \"llama3\" or \"default\" (or rope_scaling null), found \"yarn\"");
  refuses([](nlohmann::json& j) { j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}}; },
          "'rope_scaling.type': expected \"llama3\" or \"default\" (or rope_scaling null), found \"linear\"");
  refuses([](nlohmann::json& j) { j["rope_scaling"].erase("rope_type"); },
          "'rope_scaling.rope_type': expected \"llama3\" or \"default\" (or rope_scaling null), found no such key");
  refuses([](nlohmann::json& j) { j["rope_scaling"].erase("factor"); },
          "'rope_scaling.factor': expected a positive number, found no such key");
  refuses([](nlohmann::json& j) { j["rope_scaling"] = "llama3"; },
          "'rope_scaling': expected null or an object, found \"llama3\"");
  refuses([](nlohmann::json& j) { j["attention_bias"] = true; },
          "'attention_bias': expected false (nn::llama has no biases), found true");
  refuses([](nlohmann::json& j) { j["mlp_bias"] = true; }, "'mlp_bias': expected false (nn::llama has no biases), found true");
  refuses([](nlohmann::json& j) { j["hidden_act"] = "gelu"; },
          "'hidden_act': expected \"silu\" (nn::llama's SwiGLU), found \"gelu\"");
  refuses([](nlohmann::json& j) { j["model_type"] = "mistral"; }, "'model_type': expected \"llama\", found \"mistral\"");
  refuses([](nlohmann::json& j) { j.erase("model_type"); }, "'model_type': expected \"llama\", found no such key");
  refuses([](nlohmann::json& j) { j.erase("hidden_size"); }, "'hidden_size': expected a positive integer, found no such key");
  refuses([](nlohmann::json& j) { j.erase("max_position_embeddings"); },
          "'max_position_embeddings': expected a positive integer, found no such key");
  refuses([](nlohmann::json& j) { j["num_attention_heads"] = 4.5; },
          "'num_attention_heads': expected a positive integer, found 4.5");
  refuses([](nlohmann::json& j) { j["num_hidden_layers"] = 2.0; },
          "'num_hidden_layers': expected a positive integer, found 2.0");
  refuses([](nlohmann::json& j) { j["vocab_size"] = "11"; }, "'vocab_size': expected a positive integer, found \"11\"");
  refuses([](nlohmann::json& j) { j["intermediate_size"] = 0; }, "'intermediate_size': expected a positive integer, found 0");
  refuses([](nlohmann::json& j) { j["num_key_value_heads"] = -2; },
          "'num_key_value_heads': expected a positive integer, found -2");
  refuses([](nlohmann::json& j) { j["rms_norm_eps"] = "1e-5"; }, "'rms_norm_eps': expected a positive number, found \"1e-5\"");
  refuses([](nlohmann::json& j) { j["tie_word_embeddings"] = 1; }, "'tie_word_embeddings': expected true or false, found 1");
  refuses([](nlohmann::json& j) { j["head_dim"] = 8; },
          "'head_dim': expected hidden_size / num_attention_heads = 4 (nn::llama has no other head_dim), found 8");
  refuses([](nlohmann::json& j) { j["num_key_value_heads"] = 3; },
          "dml::nn::llama_config: expected kv_heads dividing heads = 4, found kv_heads = 3");
  write_text(path, "[1, 2]");
  CHECK_THROWS_WITH_AS(train::read_hf_llama_config(dir / "ckpt"), (p + "expected a JSON object, found a JSON array").c_str(),
                       format_error);
  fs::remove(path);
  CHECK_THROWS_WITH_AS(train::read_hf_llama_config(dir / "ckpt"),
                       (p + "expected a Hugging Face config.json, found no such file").c_str(), io_error);
}

TEST_CASE("load_hf_llama: a missing, extra, misshapen or mistyped tensor, or another model's config: one line, "
          "flat untouched") {
  temp_dir dir("dml-hf-llama");
  const auto g = tiny(false, true);
  const auto layout = nn::make_layout(nn::llama(g));
  const auto flat = random_params(layout, 2, false);
  const auto ckpt = dir / "ckpt";
  const auto fresh = [&] {
    fs::remove_all(ckpt);
    train::save_hf_llama(g, layout, flat, ckpt);
    return ckpt / "model.safetensors";
  };
  const auto refuses = [&]<class E>(const nn::llama_config& model, const std::string& message, E*) {
    const auto l = nn::make_layout(nn::llama(model));
    std::vector<float> o(static_cast<std::size_t>(l.total), -3.f);
    CHECK_THROWS_WITH_AS(train::load_hf_llama(model, l, o, ckpt), message.c_str(), E);
    CHECK(std::ranges::all_of(o, [](float v) { return v == -3.f; }));
  };
  const format_error* fmt = nullptr;
  const std::string single = (ckpt / "model.safetensors").string() + ": ";
  const std::string config = (ckpt / "config.json").string() + ": ";

  rewrite(fresh(), [](auto& refs) {
    std::erase_if(refs, [](const train::tensor_ref& t) { return t.name == "model.layers.1.mlp.up_proj.weight"; });
  });
  refuses(g, single + "expected tensor 'model.layers.1.mlp.up_proj.weight', found none of that name (1 of the 21 "
                      "tensors missing)", fmt);
  rewrite(fresh(), [](auto& refs) {
    std::erase_if(refs, [](const train::tensor_ref& t) { return t.name == "lm_head.weight"; });
  });
  refuses(g, single + "expected tensor 'lm_head.weight', found none of that name (1 of the 21 tensors missing)", fmt);
  rewrite(fresh(), [](auto& refs) {
    auto extra = refs.back();
    extra.name = "model.layers.2.self_attn.q_proj.weight";
    refs.push_back(extra);
  });
  refuses(g, single + "tensor 'model.layers.2.self_attn.q_proj.weight' is not one of LlamaForCausalLM's for the "
                      "config (expected only 21 tensors: the model's)", fmt);
  rewrite(fresh(), [](auto& refs) {
    for (auto& t : refs)
      if (t.name == "model.layers.0.self_attn.k_proj.weight") t.shape = {16, 8};
  });
  refuses(g, single + "tensor 'model.layers.0.self_attn.k_proj.weight': expected shape [8, 16], found [16, 8]",
          static_cast<const shape_error*>(nullptr));
  const std::vector<double> wide(16, 1.0);
  rewrite(fresh(), [&](auto& refs) {
    for (auto& t : refs)
      if (t.name == "model.norm.weight") t = train::make_tensor_ref<double>(t.name, wide, {16});
  });
  refuses(g, single + "tensor 'model.norm.weight': expected dtype F32, BF16 or F16, found F64", fmt);

  // Another model's config.
  fresh();
  auto other = g;
  other.layers = 3;
  refuses(other, config + "'num_hidden_layers' is 2, expected 3 (the model's layers)", fmt);
  other = g, other.kv_heads = 4;
  refuses(other, config + "'num_key_value_heads' is 2, expected 4 (the model's kv_heads)", fmt);
  other = g, other.norm_eps = 1e-6f;
  refuses(other, config + "'rms_norm_eps' is 1e-05, expected 1e-06 (the model's norm_eps)", fmt);
  other = g, other.rope.theta = 10000;
  refuses(other, config + "'rope_theta' is 500000, expected 10000 (the model's rope.theta)", fmt);
  other = g, other.rope.scaling->factor = 32;
  refuses(other, config + "'rope_scaling.factor' is 8, expected 32 (the model's rope.scaling->factor)", fmt);
  other = g, other.rope.scaling.reset();
  refuses(other, config + "'rope_scaling' is llama3, expected null (the model's rope.scaling)", fmt);
  other = g, other.tie_embeddings = true;
  refuses(other, config + "'tie_word_embeddings' is false, expected true (the model's tie_embeddings)", fmt);
  // seq is the caller's: a model of other length reads the same weights.
  other = g, other.seq = 5;
  auto l5 = nn::make_layout(nn::llama(other));
  std::vector<float> o5(static_cast<std::size_t>(l5.total));
  train::load_hf_llama(other, l5, o5, ckpt);
  CHECK(same_bits(o5, flat));

  // A layout that is not the config's model: refused before any file is read.
  auto mha = g;
  mha.kv_heads = 4;
  const auto mha_layout = nn::make_layout(nn::llama(mha));
  std::vector<float> m(static_cast<std::size_t>(mha_layout.total), -3.f);
  CHECK_THROWS_WITH_AS(train::load_hf_llama(g, mha_layout, m, ckpt),
                       "dml::train::load_hf_llama: parameter 'model.layers.0.self_attn.qkv_proj.weight' has shape "
                       "[48, 16] in the layout, expected [32, 16] for the config (a whole model's layout, not one "
                       "tensor-parallel rank's)",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(train::save_hf_llama(g, mha_layout, m, dir / "x"),
                       "dml::train::save_hf_llama: parameter 'model.layers.0.self_attn.qkv_proj.weight' has shape "
                       "[48, 16] in the layout, expected [32, 16] for the config (a whole model's layout, not one "
                       "tensor-parallel rank's)",
                       invalid_argument);
  CHECK(!fs::exists(dir / "x"));
  CHECK_THROWS_WITH_AS(train::save_hf_llama(g, layout, std::span<const float>(flat).first(10), dir / "x"),
                       dml::detail::cat("dml::train::save_hf_llama: expected a flat buffer of the layout's ", layout.total,
                                        " floats, found 10").c_str(),
                       invalid_argument);

  // No weights at all.
  fs::remove(ckpt / "model.safetensors");
  refuses(g, ckpt.string() + ": expected model.safetensors or model.safetensors.index.json, found neither",
          static_cast<const io_error*>(nullptr));

  // Tied: lm_head.weight absent (as Hugging Face saves) is the embedding; present, it must equal it.
  auto tied = g;
  tied.tie_embeddings = true;
  const auto tl = nn::make_layout(nn::llama(tied));
  const auto tflat = random_params(tl, 4, true);
  fs::remove_all(ckpt);
  train::save_hf_llama(tied, tl, tflat, ckpt);
  std::vector<float> t_out(tflat.size(), 0.f);
  train::load_hf_llama(tied, tl, t_out, ckpt);
  CHECK(same_bits(t_out, tflat));
  std::vector<float> head;
  rewrite(ckpt / "model.safetensors", [&](auto& refs) {
    for (const auto& t : refs)
      if (t.name == "model.embed_tokens.weight") {
        head.resize(t.data.size() / 4);
        std::memcpy(head.data(), t.data.data(), t.data.size());
      }
    refs.push_back(train::make_tensor_ref<float>("lm_head.weight", head, {11, 16}));
  });
  std::fill(t_out.begin(), t_out.end(), 0.f);
  train::load_hf_llama(tied, tl, t_out, ckpt);
  CHECK(same_bits(t_out, tflat));
  head[5] += 1.f;
  rewrite(ckpt / "model.safetensors", [&](auto& refs) {
    for (auto& t : refs)
      if (t.name == "lm_head.weight") t = train::make_tensor_ref<float>("lm_head.weight", head, {11, 16});
  });
  refuses(tied, single + "tensor 'lm_head.weight' differs from 'model.embed_tokens.weight', expected them equal "
                         "(tie_word_embeddings is true)", fmt);
}

TEST_CASE("load_hf_llama: a shard that fails after others have loaded leaves flat untouched") {
  temp_dir dir("dml-hf-llama");
  const auto g = tiny(false);
  const auto layout = nn::make_layout(nn::llama(g));
  const auto flat = random_params(layout, 5, false);
  const auto ckpt = dir / "ckpt";
  const auto save = [&] {
    fs::remove_all(ckpt);
    train::save_hf_llama(g, layout, flat, ckpt, {.max_shard_bytes = 4000});
  };
  const std::string last = (ckpt / "model-00004-of-00004.safetensors").string();
  const auto untouched = [&](auto load) {
    std::vector<float> o(flat.size(), -3.f);
    load(o);
    CHECK(std::ranges::all_of(o, [](float v) { return v == -3.f; }));
  };
  save();
  REQUIRE(fs::exists(last));
  fs::remove(last);
  untouched([&](std::vector<float>& o) {
    CHECK_THROWS_WITH_AS(train::load_hf_llama(g, layout, o, ckpt),
                         (last + ": cannot open for reading (expected an existing, readable safetensors file)").c_str(),
                         io_error);
  });
  // Truncated: the header promises more data than the file holds.
  save();
  fs::resize_file(last, fs::file_size(last) - 100);
  untouched([&](std::vector<float>& o) {
    const auto message = dml_test::error_of<format_error>([&] { train::load_hf_llama(g, layout, o, ckpt); });
    CHECK(message.starts_with(last + ": not a valid safetensors file: "));
    CHECK(message.ends_with("(truncated file?)"));
  });
  // The index puts a tensor in a file that lacks it.
  save();
  auto index = read_json(ckpt / "model.safetensors.index.json");
  index["weight_map"]["model.norm.weight"] = "model-00001-of-00004.safetensors";
  write_text(ckpt / "model.safetensors.index.json", index.dump(2));
  untouched([&](std::vector<float>& o) {
    CHECK_THROWS_WITH_AS(train::load_hf_llama(g, layout, o, ckpt),
                         ((ckpt / "model-00001-of-00004.safetensors").string() +
                          ": expected tensor 'model.norm.weight' (model.safetensors.index.json lists it for this file), "
                          "found none of that name").c_str(),
                         format_error);
  });
  // A tensor the index does not list for its file.
  index["weight_map"].erase("model.norm.weight");
  write_text(ckpt / "model.safetensors.index.json", index.dump(2));
  untouched([&](std::vector<float>& o) {
    CHECK_THROWS_WITH_AS(train::load_hf_llama(g, layout, o, ckpt),
                         (last + ": tensor 'model.norm.weight' is here, but model.safetensors.index.json does not list "
                                 "it for this file").c_str(),
                         format_error);
  });
}

// ---- against an independent reader: tests/train/hf_llama_check.py.

namespace {

// 2 layers, 8 query heads over 2 key/value heads of head_dim 8.
nn::llama_config check_model(bool tied, bool scaled) {
  nn::llama_config g{.vocab = 64, .seq = 16, .d_model = 64, .layers = 2, .heads = 8, .kv_heads = 2, .ffn_hidden = 128,
                     .tie_embeddings = tied};
  if (scaled) g.rope = {.theta = 500000, .scaling = nn::rope_scaling{}};
  return g;
}

// Writes a checkpoint of random weights in dir/checkpoint, the token ids and dml's logits, and what the script is to
// expect (case.json).
void write_case(const fs::path& dir, bool tied, bool scaled, dtype type, std::uint64_t max_shard_bytes) {
  const auto g = check_model(tied, scaled);
  llama_net net(nn::llama(g), 1);
  const auto flat = random_params(net.layout(), 11, tied);
  std::ranges::copy(flat, net.params().begin());
  train::save_hf_llama(g, net, dir / "checkpoint", {.dtype = type, .max_shard_bytes = max_shard_bytes});
  // dml's model as the file holds it (a BF16 file holds rounded weights).
  train::load_hf_llama(g, net, dir / "checkpoint");
  const std::int64_t batch = 2;
  std::mt19937 gen(17);
  std::vector<float> ids(static_cast<std::size_t>(batch * g.seq));
  std::vector<std::int32_t> tokens(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) tokens[i] = static_cast<std::int32_t>(gen() % 64), ids[i] = float(tokens[i]);
  const auto y = net.forward(tensor_view<const float>(ids.data(), {batch, g.seq}));
  REQUIRE(y.shape == shape{batch, g.seq, g.vocab});
  std::ofstream(dir / "tokens.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 4));
  std::ofstream(dir / "logits.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(y.data), static_cast<std::streamsize>(y.numel() * 4));
  const nlohmann::json c = {{"tied", tied},
                            {"dtype", std::string(dtype_name(type))},
                            {"max_shard_bytes", max_shard_bytes},
                            {"batch", batch},
                            {"seq", g.seq}};
  write_text(dir / "case.json", c.dump() + "\n");
}

}  // namespace

TEST_CASE("Python: Hugging Face's loader reads the files, and LlamaForCausalLM's forward from them gives dml's logits") {
  temp_dir dir("dml-hf-llama-py");
  // Untied with Llama 3.1's RoPE scaling in shards (gate, up and down, 32 KiB each, exceed 30000 bytes and get files
  // of their own); tied in one file; BF16 in shards.
  write_case(dir / "untied_sharded", false, true, dtype::f32, 30000);
  write_case(dir / "tied_single", true, false, dtype::f32, 5'000'000'000);
  write_case(dir / "bf16_sharded", false, true, dtype::bf16, 40000);
  const std::string cmd = std::string(DML_TEST_PYTHON) + " " + DML_TEST_SOURCE_DIR + "/hf_llama_check.py '" +
                          (dir / "untied_sharded").string() + "' '" + (dir / "tied_single").string() + "' '" +
                          (dir / "bf16_sharded").string() + "'";
  INFO(cmd);
  REQUIRE(std::system(cmd.c_str()) == 0);
}

}  // namespace test_hf_llama
