// SPDX-License-Identifier: Apache-2.0
// dml/train/hf_llama.hpp — nn::llama's weights as a Hugging Face LlamaForCausalLM checkpoint, both ways: config.json
// and model.safetensors, or model-00001-of-0000N.safetensors shards with model.safetensors.index.json.
// Sits on nn/llama_config.hpp, nn/network.hpp, train/safetensors.hpp and train/checkpoint.hpp (atomic text files,
// directory sync). See DESIGN.md §6.
//
// nn::llama names its parameters as LlamaForCausalLM does but for two fused tensors a block
// (nn/detail/llama_block.hpp): self_attn.qkv_proj.weight holds q_proj's rows, then k_proj's, then v_proj's, and
// mlp.gate_up_proj.weight holds gate_proj's rows, then up_proj's. The checkpoint holds the five separate tensors, each
// a contiguous range of rows of its fused parameter. RoPE is rotate-half on both sides, so no rows are permuted. A
// tied LM head is not written (as Hugging Face does not); loading copies model.embed_tokens.weight into it.
//
// config.json: Hugging Face's LlamaConfig keys, written as transformers writes them (sorted, indent 2). Reading
// requires model_type "llama", vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads and
// max_position_embeddings (which becomes seq: assign .seq after reading to train on other lengths); the others take
// LlamaConfig's defaults when absent (num_key_value_heads = num_attention_heads, rms_norm_eps 1e-6, rope_theta 10000,
// rope_scaling null, tie_word_embeddings false). What nn::llama cannot compute is refused with one line naming the
// key: rope_scaling other than null, "default" or "llama3", attention_bias or mlp_bias true, hidden_act other than
// "silu", a head_dim other than hidden_size / num_attention_heads.
//
// Sharding follows huggingface_hub's rule, in the state dict's order (per block q, k, v, o, gate, up, down, then the
// two norms): a tensor joins the current file unless that would take it past max_shard_bytes, and a tensor larger
// than the limit gets a file of its own. One file is model.safetensors and no index. Inside a file the tensors are
// sorted by name, as the safetensors library stores them, with metadata {"format": "pt"}.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dml/core/dtype.hpp"
#include "dml/core/error.hpp"
#include "dml/nn/llama_config.hpp"
#include "dml/nn/network.hpp"
#include "dml/train/checkpoint.hpp"
#include "dml/train/safetensors.hpp"

namespace dml::train {

struct hf_options {
  dml::dtype dtype = dml::dtype::f32;             // of the stored tensors: f32, bf16 or f16
  std::uint64_t max_shard_bytes = 5'000'000'000;  // save_pretrained's default max_shard_size "5GB"
};

namespace detail {

// One tensor of the checkpoint: its Hugging Face name and shape, and where its elements lie in the flat buffer.
struct hf_tensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0, numel = 0;
};

// The shortest decimal that reads back as f, as a double: 1e-5f is written 1e-05, not 9.99999974737875e-06.
inline double hf_decimal(float f) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, f);
  return std::strtod(std::string(buf, r.ptr).c_str(), nullptr);
}
inline std::string hf_text(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::general);
  return std::string(buf, r.ptr);
}
inline std::string hf_text(float v) { return hf_text(hf_decimal(v)); }
inline std::string hf_text(std::int64_t v) { return std::to_string(v); }
inline std::string hf_text(bool v) { return v ? "true" : "false"; }

// A whole nn::llama's parameters (dml's names and shapes) and the checkpoint's tensors, from the config; checks that
// `layout` is that model's (every parameter, whole: not one tensor-parallel rank's part, not one pipeline stage's).
inline std::vector<hf_tensor> hf_llama_tensors(const nn::llama_config& g, const nn::param_layout& layout,
                                               std::size_t flat_size, const char* what) {
  g.validate();
  if (g.experts > 0)
    fail<invalid_argument>(what, ": Hugging Face's Llama layout has no experts: expected experts 0, found ", g.experts);
  if (g.latent())
    fail<invalid_argument>(what, ": Hugging Face's Llama layout has no latent attention: expected kv_lora_rank 0, found ",
                           g.kv_lora_rank);
  const std::int64_t c = g.d_model, hd = g.head_dim(), q = g.heads * hd, kv = g.kv_heads * hd, f = g.ffn_hidden;
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> params{{"model.embed_tokens.weight", {g.vocab, c}}};
  for (std::int64_t i = 0; i < g.layers; ++i) {
    const std::string p = dml::detail::cat("model.layers.", i, ".");
    params.push_back({p + "input_layernorm.weight", {c}});
    params.push_back({p + "self_attn.qkv_proj.weight", {q + 2 * kv, c}});
    params.push_back({p + "self_attn.o_proj.weight", {c, q}});
    params.push_back({p + "post_attention_layernorm.weight", {c}});
    params.push_back({p + "mlp.gate_up_proj.weight", {2 * f, c}});
    params.push_back({p + "mlp.down_proj.weight", {c, f}});
  }
  params.push_back({"model.norm.weight", {c}});
  params.push_back({"lm_head.weight", {g.vocab, c}});

  std::map<std::string, std::int64_t, std::less<>> offset;
  for (const auto& [name, shape] : params) {
    const nn::param_slot* s = nullptr;
    for (const auto& slot : layout.slots) s = slot.name == name ? &slot : s;
    if (!s)
      fail<invalid_argument>(what, ": the layout has no parameter '", name, "', expected every parameter of ",
                             "nn::llama(config) (a whole model's layout, not one pipeline stage's)");
    if (s->shape.vec() != shape)
      fail<invalid_argument>(what, ": parameter '", name, "' has shape ", shape_text(s->shape.vec()),
                             " in the layout, expected ", shape_text(shape), " for the config (a whole model's layout, ",
                             "not one tensor-parallel rank's)");
    offset.emplace(name, s->offset);
  }
  if (layout.slots.size() != params.size())
    fail<invalid_argument>(what, ": the layout has ", layout.slots.size(), " parameters, expected the ", params.size(),
                           " of nn::llama(config)");
  if (flat_size != static_cast<std::size_t>(layout.total))
    fail<invalid_argument>(what, ": expected a flat buffer of the layout's ", layout.total, " floats, found ", flat_size);

  std::vector<hf_tensor> out;
  // `rows` rows of `cols` from row `first` of dml's parameter `from`.
  const auto add = [&](std::string name, std::string_view from, std::int64_t first, std::int64_t rows,
                       std::int64_t cols) {
    std::vector<std::int64_t> shape{rows};
    if (cols) shape.push_back(cols);
    out.push_back({std::move(name), std::move(shape), offset.find(from)->second + first * std::max<std::int64_t>(cols, 1),
                   rows * std::max<std::int64_t>(cols, 1)});
  };
  add("model.embed_tokens.weight", "model.embed_tokens.weight", 0, g.vocab, c);
  for (std::int64_t i = 0; i < g.layers; ++i) {
    const std::string p = dml::detail::cat("model.layers.", i, ".");
    const std::string qkv = p + "self_attn.qkv_proj.weight", gate_up = p + "mlp.gate_up_proj.weight";
    add(p + "self_attn.q_proj.weight", qkv, 0, q, c);
    add(p + "self_attn.k_proj.weight", qkv, q, kv, c);
    add(p + "self_attn.v_proj.weight", qkv, q + kv, kv, c);
    add(p + "self_attn.o_proj.weight", p + "self_attn.o_proj.weight", 0, c, q);
    add(p + "mlp.gate_proj.weight", gate_up, 0, f, c);
    add(p + "mlp.up_proj.weight", gate_up, f, f, c);
    add(p + "mlp.down_proj.weight", p + "mlp.down_proj.weight", 0, c, f);
    add(p + "input_layernorm.weight", p + "input_layernorm.weight", 0, c, 0);
    add(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", 0, c, 0);
  }
  add("model.norm.weight", "model.norm.weight", 0, c, 0);
  add("lm_head.weight", "lm_head.weight", 0, g.vocab, c);  // the last: save leaves it out when tied
  return out;
}

// huggingface_hub's split of a state dict into files: tensor i (bytes[i]) joins the current file unless that takes
// the file past max; one larger than max gets a file of its own, placed when it is met.
inline std::vector<std::vector<std::size_t>> hf_shards(std::span<const std::uint64_t> bytes, std::uint64_t max) {
  std::vector<std::vector<std::size_t>> out;
  std::vector<std::size_t> current;
  std::uint64_t size = 0;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] > max) {
      out.push_back({i});
      continue;
    }
    if (size + bytes[i] > max && !current.empty()) {
      out.push_back(std::move(current));
      current.clear();
      size = 0;
    }
    current.push_back(i);
    size += bytes[i];
  }
  if (!current.empty() || out.empty()) out.push_back(std::move(current));
  return out;
}

inline std::string hf_shard_name(std::size_t k, std::size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, n);
  return buf;
}
inline bool is_hf_shard_name(const std::string& s) {
  if (s.size() != 32 || !s.starts_with("model-") || s.substr(11, 4) != "-of-" || !s.ends_with(".safetensors"))
    return false;
  for (std::size_t i : {6, 7, 8, 9, 10, 15, 16, 17, 18, 19})
    if (s[i] < '0' || s[i] > '9') return false;
  return true;
}

inline std::string_view hf_torch_dtype(dml::dtype t) {
  return t == dml::dtype::bf16 ? "bfloat16" : t == dml::dtype::f16 ? "float16" : "float32";
}

inline nlohmann::json hf_config_json(const nn::llama_config& g, dml::dtype t) {
  nlohmann::json j = nlohmann::json::object();  // sorted keys, as transformers' to_json_string(sort_keys=True)
  j["architectures"] = nlohmann::json::array({"LlamaForCausalLM"});
  j["model_type"] = "llama";
  j["vocab_size"] = g.vocab;
  j["hidden_size"] = g.d_model;
  j["intermediate_size"] = g.ffn_hidden;
  j["num_hidden_layers"] = g.layers;
  j["num_attention_heads"] = g.heads;
  j["num_key_value_heads"] = g.kv_heads;
  j["head_dim"] = g.head_dim();
  j["max_position_embeddings"] = g.seq;
  j["rms_norm_eps"] = hf_decimal(g.norm_eps);
  j["rope_theta"] = g.rope.theta;
  if (g.rope.scaling) {
    const auto& s = *g.rope.scaling;
    nlohmann::json r = {{"rope_type", "llama3"},
                        {"factor", s.factor},
                        {"low_freq_factor", s.low_freq_factor},
                        {"high_freq_factor", s.high_freq_factor}};
    // An integer in transformers' files (8192), as dml's double holds it when it is whole.
    const double old = s.original_max_position_embeddings;
    const auto whole = static_cast<std::int64_t>(old);
    if (old == static_cast<double>(whole)) r["original_max_position_embeddings"] = whole;
    else r["original_max_position_embeddings"] = old;
    j["rope_scaling"] = std::move(r);
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["tie_word_embeddings"] = g.tie_embeddings;
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["hidden_act"] = "silu";
  j["torch_dtype"] = hf_torch_dtype(t);
  return j;
}

// config.json's keys, each read with a one-line refusal naming it: "<path>: '<key>': expected ..., found ...".
struct hf_config_reader {
  std::string path;
  const nlohmann::json& j;

  [[noreturn]] void bad(std::string_view key, std::string_view expected, const nlohmann::json* found) const {
    fail<format_error>(path, ": '", key, "': expected ", expected, ", found ", found ? found->dump() : "no such key");
  }
  static const nlohmann::json* find(const nlohmann::json& o, std::string_view key) {
    const auto it = o.find(key);
    return it == o.end() ? nullptr : &*it;
  }
  // A present, non-null value, or nullptr; absent is refused when required.
  const nlohmann::json* value(const nlohmann::json& o, std::string_view key, std::string_view shown,
                              std::string_view expected, bool required) const {
    const auto* v = find(o, key);
    if (required && (!v || v->is_null())) bad(shown, expected, v);
    return v && !v->is_null() ? v : nullptr;
  }
  std::int64_t size(std::string_view key, std::int64_t fallback = 0, bool required = true) const {
    const auto* v = value(j, key, key, "a positive integer", required);
    if (!v) return fallback;
    constexpr auto most = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    if (!v->is_number_integer() || (v->is_number_unsigned() && v->get<std::uint64_t>() > most) ||
        v->get<std::int64_t>() <= 0)
      bad(key, "a positive integer", v);
    return v->get<std::int64_t>();
  }
  double positive(const nlohmann::json& o, std::string_view key, std::string_view shown, double fallback,
                  bool required) const {
    const auto* v = value(o, key, shown, "a positive number", required);
    if (!v) return fallback;
    if (!v->is_number() || !(v->get<double>() > 0)) bad(shown, "a positive number", v);
    return v->get<double>();
  }
  bool flag(std::string_view key, bool fallback) const {
    const auto* v = value(j, key, key, "true or false", false);
    if (!v) return fallback;
    if (!v->is_boolean()) bad(key, "true or false", v);
    return v->get<bool>();
  }
  // A key whose only value nn::llama computes is `want`.
  void only(std::string_view key, const nlohmann::json& want, std::string_view expected, bool required) const {
    const auto* v = value(j, key, key, expected, required);
    if (v && *v != want) bad(key, expected, v);
  }
};

}  // namespace detail

// Reads dir/config.json (Hugging Face's LlamaConfig) into an nn::llama_config; seq is max_position_embeddings.
// Refuses, with one line naming the key, what nn::llama cannot compute and sizes that are not positive integers.
inline nn::llama_config read_hf_llama_config(const std::filesystem::path& dir) {
  const auto path = dir / "config.json";
  const std::string text = detail::read_text(path, "a Hugging Face config.json");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail<format_error>(path.string(), ": expected JSON, found text that does not parse: ", e.what());
  }
  if (!j.is_object()) fail<format_error>(path.string(), ": expected a JSON object, found a JSON ", j.type_name());
  const detail::hf_config_reader r{path.string(), j};
  r.only("model_type", "llama", "\"llama\"", true);
  nn::llama_config g;
  g.vocab = r.size("vocab_size");
  g.d_model = r.size("hidden_size");
  g.ffn_hidden = r.size("intermediate_size");
  g.layers = r.size("num_hidden_layers");
  g.heads = r.size("num_attention_heads");
  g.kv_heads = r.size("num_key_value_heads", g.heads, false);
  g.seq = r.size("max_position_embeddings");
  if (const auto* hd = r.value(j, "head_dim", "head_dim", "", false);
      hd && g.d_model % g.heads == 0 && *hd != g.d_model / g.heads)
    r.bad("head_dim", dml::detail::cat("hidden_size / num_attention_heads = ", g.d_model / g.heads,
                                       " (nn::llama has no other head_dim)"), hd);
  g.norm_eps = static_cast<float>(r.positive(j, "rms_norm_eps", "rms_norm_eps", 1e-6, false));
  g.rope.theta = r.positive(j, "rope_theta", "rope_theta", 10000, false);
  g.tie_embeddings = r.flag("tie_word_embeddings", false);
  r.only("attention_bias", false, "false (nn::llama has no biases)", false);
  r.only("mlp_bias", false, "false (nn::llama has no biases)", false);
  r.only("hidden_act", "silu", "\"silu\" (nn::llama's SwiGLU)", false);
  if (const auto* s = r.value(j, "rope_scaling", "rope_scaling", "", false)) {
    if (!s->is_object()) r.bad("rope_scaling", "null or an object", s);
    // "type" is the key's older name, still read by transformers.
    const bool legacy = !s->contains("rope_type") && s->contains("type");
    const auto* type = detail::hf_config_reader::find(*s, legacy ? "type" : "rope_type");
    if (!type || !type->is_string() || (*type != "llama3" && *type != "default"))
      r.bad(legacy ? "rope_scaling.type" : "rope_scaling.rope_type", "\"llama3\" or \"default\" (or rope_scaling null)",
            type);
    if (*type == "llama3") {
      nn::rope_scaling k;
      k.factor = r.positive(*s, "factor", "rope_scaling.factor", 0, true);
      k.low_freq_factor = r.positive(*s, "low_freq_factor", "rope_scaling.low_freq_factor", 0, true);
      k.high_freq_factor = r.positive(*s, "high_freq_factor", "rope_scaling.high_freq_factor", 0, true);
      k.original_max_position_embeddings = r.positive(*s, "original_max_position_embeddings",
                                                      "rope_scaling.original_max_position_embeddings", 0, true);
      g.rope.scaling = k;
    }
  }
  try {
    g.validate();
  } catch (const invalid_argument& e) {
    fail<format_error>(path.string(), ": ", e.what());
  }
  return g;
}

// Writes the parameters of nn::llama(g), laid out by `layout` in `flat` (host memory, a whole model's), as a
// Hugging Face checkpoint in dir: config.json and model.safetensors, or shards and their index when the tensors
// exceed o.max_shard_bytes. The files are written in a staging directory beside dir and fsynced; a new (or empty)
// dir is that directory renamed into place, so a crash leaves no checkpoint or a whole one. Into a directory with
// files, each file is replaced whole by a rename (shards, then the index, then config.json) and the shards and
// index of an earlier layout are removed after; other files there (a tokenizer's) are kept.
inline void save_hf_llama(const nn::llama_config& g, const nn::param_layout& layout, std::span<const float> flat,
                          const std::filesystem::path& dir, const hf_options& o = {}) {
  namespace fs = std::filesystem;
  constexpr const char* what = "dml::train::save_hf_llama";
  if (o.dtype != dml::dtype::f32 && o.dtype != dml::dtype::bf16 && o.dtype != dml::dtype::f16)
    fail<invalid_argument>(what, ": expected dtype F32, BF16 or F16, found ", dml::dtype_name(o.dtype));
  if (o.max_shard_bytes == 0) fail<invalid_argument>(what, ": expected max_shard_bytes > 0, found 0");
  auto tensors = detail::hf_llama_tensors(g, layout, flat.size(), what);
  if (g.tie_embeddings) tensors.pop_back();  // lm_head.weight
  const std::size_t elem = dml::dtype_size(o.dtype);
  std::vector<std::uint64_t> bytes;
  std::uint64_t total = 0;
  for (const auto& t : tensors) total += bytes.emplace_back(static_cast<std::uint64_t>(t.numel) * elem);
  const auto shards = detail::hf_shards(bytes, o.max_shard_bytes);
  std::vector<std::string> files;
  for (std::size_t k = 0; k < shards.size(); ++k)
    files.push_back(shards.size() == 1 ? "model.safetensors" : detail::hf_shard_name(k, shards.size()));

  fs::path target = fs::absolute(dir).lexically_normal();
  if (!target.has_filename()) target = target.parent_path();
  std::error_code ec;
  if (fs::exists(target, ec) && !fs::is_directory(target, ec))
    fail<io_error>(target.string(), ": expected a directory for the checkpoint, found a file");
  fs::create_directories(target.parent_path(), ec);
  // What saves killed part-way left beside dir: nothing names them, and one save at a time writes a checkpoint.
  const std::string partial = "." + target.filename().string() + ".partial-";
  std::vector<fs::path> abandoned;
  for (fs::directory_iterator it(target.parent_path(), ec), end; !ec && it != end; it.increment(ec))
    if (it->path().filename().string().starts_with(partial)) abandoned.push_back(it->path());
  for (const auto& p : abandoned) fs::remove_all(p, ec);
  ec.clear();
  const fs::path staging = target.parent_path() / (partial + detail::temp_suffix());
  if (!fs::create_directory(staging, ec) || ec)
    fail<io_error>(staging.string(), ": cannot create the staging directory: ", ec ? ec.message() : "it exists");
  try {
    nlohmann::json weight_map = nlohmann::json::object();
    for (std::size_t k = 0; k < shards.size(); ++k) {
      std::vector<std::size_t> order = shards[k];
      std::ranges::sort(order, [&](std::size_t a, std::size_t b) { return tensors[a].name < tensors[b].name; });
      std::size_t n = 0;
      for (auto i : order) n += o.dtype == dml::dtype::f32 ? 0 : static_cast<std::size_t>(tensors[i].numel);
      std::vector<std::uint16_t> half(n);  // this file's tensors in 16 bits
      std::vector<tensor_ref> refs;
      std::size_t at = 0;
      for (auto i : order) {
        const auto& t = tensors[i];
        const auto src = flat.subspan(static_cast<std::size_t>(t.offset), static_cast<std::size_t>(t.numel));
        std::span<const std::byte> data = std::as_bytes(src);
        if (o.dtype != dml::dtype::f32) {
          std::uint16_t* dst = half.data() + at;
          for (std::size_t e = 0; e < src.size(); ++e)
            dst[e] = o.dtype == dml::dtype::bf16 ? dml::detail::float_to_bf16_bits(src[e])
                                                 : dml::detail::float_to_fp16_bits(src[e]);
          data = std::as_bytes(std::span<const std::uint16_t>(dst, src.size()));
          at += src.size();
        }
        refs.push_back({t.name, o.dtype, t.shape, data});
        weight_map[t.name] = files[k];
      }
      save_safetensors(staging / files[k], refs, {{"format", "pt"}});
    }
    if (shards.size() > 1) {
      const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", std::move(weight_map)}};
      detail::write_text_atomically(staging / "model.safetensors.index.json", index.dump(2) + "\n");
      files.push_back("model.safetensors.index.json");
    }
    detail::write_text_atomically(staging / "config.json", detail::hf_config_json(g, o.dtype).dump(2) + "\n");
    files.push_back("config.json");

    if (!fs::exists(target, ec) || fs::is_empty(target, ec)) {
      fs::rename(staging, target, ec);
      if (ec) fail<io_error>(target.string(), ": cannot move the new checkpoint into place: ", ec.message());
      detail::sync_directory(target.parent_path());
      return;
    }
    for (const auto& f : files) {
      fs::rename(staging / f, target / f, ec);
      if (ec) fail<io_error>((target / f).string(), ": cannot move the new file into place: ", ec.message());
    }
    // What an earlier save of another layout left: its shards, its index, its single file.
    std::vector<fs::path> stale;
    for (fs::directory_iterator it(target, ec), end; !ec && it != end; it.increment(ec)) {
      const auto name = it->path().filename().string();
      const bool earlier = detail::is_hf_shard_name(name) || name == "model.safetensors" ||
                           name == "model.safetensors.index.json";
      if (earlier && std::ranges::find(files, name) == files.end()) stale.push_back(it->path());
    }
    for (const auto& p : stale) fs::remove(p, ec);
    detail::sync_directory(target);
    fs::remove(staging, ec);
  } catch (...) {
    std::error_code ignore;
    fs::remove_all(staging, ignore);
    throw;
  }
}

// Reads a Hugging Face checkpoint from dir into `flat` (host memory, laid out by `layout` for nn::llama(g)):
// config.json must describe g (seq aside), and the tensors (F32, BF16 or F16; one file or an index and its shards)
// must be exactly LlamaForCausalLM's for g, lm_head.weight absent or equal to the embedding when g is tied. q/k/v and
// gate/up are joined into the fused parameters; a tied head is copied from the embedding. Anything else is an error
// naming it, and `flat` is left untouched unless every tensor loads.
inline void load_hf_llama(const nn::llama_config& g, const nn::param_layout& layout, std::span<float> flat,
                          const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  const auto tensors = detail::hf_llama_tensors(g, layout, flat.size(), "dml::train::load_hf_llama");

  const auto cfg = read_hf_llama_config(dir);
  {
    const std::string path = (dir / "config.json").string();
    const auto differ = [&](const char* key, const char* field, const auto& file, const auto& model) {
      if (file != model)
        fail<format_error>(path, ": '", key, "' is ", detail::hf_text(file), ", expected ", detail::hf_text(model),
                           " (the model's ", field, ")");
    };
    differ("vocab_size", "vocab", cfg.vocab, g.vocab);
    differ("hidden_size", "d_model", cfg.d_model, g.d_model);
    differ("intermediate_size", "ffn_hidden", cfg.ffn_hidden, g.ffn_hidden);
    differ("num_hidden_layers", "layers", cfg.layers, g.layers);
    differ("num_attention_heads", "heads", cfg.heads, g.heads);
    differ("num_key_value_heads", "kv_heads", cfg.kv_heads, g.kv_heads);
    differ("rms_norm_eps", "norm_eps", cfg.norm_eps, g.norm_eps);
    differ("rope_theta", "rope.theta", cfg.rope.theta, g.rope.theta);
    differ("tie_word_embeddings", "tie_embeddings", cfg.tie_embeddings, g.tie_embeddings);
    if (cfg.rope.scaling.has_value() != g.rope.scaling.has_value())
      fail<format_error>(path, ": 'rope_scaling' is ", cfg.rope.scaling ? "llama3" : "null", ", expected ",
                         g.rope.scaling ? "llama3" : "null", " (the model's rope.scaling)");
    if (cfg.rope.scaling) {
      const auto &a = *cfg.rope.scaling, &b = *g.rope.scaling;
      differ("rope_scaling.factor", "rope.scaling->factor", a.factor, b.factor);
      differ("rope_scaling.low_freq_factor", "rope.scaling->low_freq_factor", a.low_freq_factor, b.low_freq_factor);
      differ("rope_scaling.high_freq_factor", "rope.scaling->high_freq_factor", a.high_freq_factor, b.high_freq_factor);
      differ("rope_scaling.original_max_position_embeddings", "rope.scaling->original_max_position_embeddings",
             a.original_max_position_embeddings, b.original_max_position_embeddings);
    }
  }

  // Which files, and for shards which tensors the index puts in each.
  const fs::path single = dir / "model.safetensors", index_path = dir / "model.safetensors.index.json";
  std::error_code ec;
  const bool sharded = !fs::exists(single, ec);
  std::map<std::string, std::set<std::string>> files;  // file -> the tensors the index puts there
  if (!sharded) {
    files[single.filename().string()];
  } else {
    if (!fs::exists(index_path, ec))
      fail<io_error>(dir.string(), ": expected model.safetensors or model.safetensors.index.json, found neither");
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(detail::read_text(index_path, "a safetensors index"));
    } catch (const nlohmann::json::exception& e) {
      fail<format_error>(index_path.string(), ": expected JSON, found text that does not parse: ", e.what());
    }
    const auto wm = index.is_object() ? index.find("weight_map") : index.end();
    if (!index.is_object() || wm == index.end() || !wm->is_object())
      fail<format_error>(index_path.string(), ": 'weight_map': expected an object of tensor names to file names, found ",
                         index.is_object() && wm != index.end() ? wm->dump() : "no such key");
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it->is_string() || !detail::plain_file_name(it->get<std::string>()))
        fail<format_error>(index_path.string(), ": 'weight_map' entry '", it.key(),
                           "': expected the name of a file in the directory, found ", it->dump());
      files[it->get<std::string>()].insert(it.key());
    }
  }
  const fs::path source = sharded ? index_path : single;

  std::map<std::string, std::size_t, std::less<>> known;
  for (std::size_t i = 0; i < tensors.size(); ++i) known.emplace(tensors[i].name, i);
  std::vector<std::string> found_in(tensors.size());
  std::vector<float> staged(flat.begin(), flat.end());
  for (const auto& [name, listed] : files) {
    const auto file = safetensors_file::open(dir / name);
    const std::string fp = file.path().string();
    for (const auto& t : file.tensors()) {
      const auto k = known.find(t.name);
      if (k == known.end())
        fail<format_error>(fp, ": tensor '", t.name, "' is not one of LlamaForCausalLM's for the config (expected only ",
                           g.tie_embeddings ? tensors.size() - 1 : tensors.size(), " tensors: the model's)");
      const std::size_t i = k->second;
      if (sharded && !listed.contains(t.name))
        fail<format_error>(fp, ": tensor '", t.name, "' is here, but ", index_path.filename().string(),
                           " does not list it for this file");
      if (!found_in[i].empty())
        fail<format_error>(fp, ": tensor '", t.name, "' is also in ", found_in[i], "; expected it once");
      found_in[i] = fp;
      const auto& want = tensors[i];
      if (t.dtype != dml::dtype::f32 && t.dtype != dml::dtype::bf16 && t.dtype != dml::dtype::f16)
        fail<format_error>(fp, ": tensor '", t.name, "': expected dtype F32, BF16 or F16, found ",
                           dml::dtype_name(t.dtype));
      if (t.shape != want.shape)
        fail<shape_error>(fp, ": tensor '", t.name, "': expected shape ", detail::shape_text(want.shape), ", found ",
                          detail::shape_text(t.shape));
      const auto src = file.bytes(t.name);
      float* dst = staged.data() + want.offset;
      if (t.dtype == dml::dtype::f32) {
        std::memcpy(dst, src.data(), src.size());
      } else {
        for (std::int64_t e = 0; e < want.numel; ++e) {
          std::uint16_t h;
          std::memcpy(&h, src.data() + 2 * e, 2);
          dst[e] = t.dtype == dml::dtype::bf16 ? dml::detail::bf16_bits_to_float(h) : dml::detail::fp16_bits_to_float(h);
        }
      }
    }
    for (const auto& n : listed)
      if (known.contains(n) && found_in[known.find(n)->second] != fp)
        fail<format_error>(fp, ": expected tensor '", n, "' (", index_path.filename().string(),
                           " lists it for this file), found none of that name");
  }
  std::size_t missing = 0;
  std::string first;
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (found_in[i].empty() && !(g.tie_embeddings && tensors[i].name == "lm_head.weight"))
      first = missing++ ? first : tensors[i].name;
  if (missing)
    fail<format_error>(source.string(), ": expected tensor '", first, "', found none of that name (", missing, " of the ",
                       g.tie_embeddings ? tensors.size() - 1 : tensors.size(), " tensors missing)");
  if (g.tie_embeddings) {
    const auto& embed = tensors.front();
    const auto& head = tensors.back();
    float* h = staged.data() + head.offset;
    const float* e = staged.data() + embed.offset;
    if (!found_in.back().empty() && !std::equal(e, e + embed.numel, h))
      fail<format_error>(found_in.back(), ": tensor 'lm_head.weight' differs from 'model.embed_tokens.weight', ",
                         "expected them equal (tie_word_embeddings is true)");
    std::copy_n(e, embed.numel, h);
  }
  std::ranges::copy(staged, flat.begin());
}

// The same for a network, in whichever space its parameters live.
template <class Net>
  requires requires(const Net& n) {
    n.layout();
    n.params();
  }
void save_hf_llama(const nn::llama_config& g, const Net& net, const std::filesystem::path& dir, const hf_options& o = {}) {
  std::vector<float> host(static_cast<std::size_t>(net.layout().total));
  copy_n(net.params().data(), host.size(), host.data());
  save_hf_llama(g, net.layout(), host, dir, o);
}
template <class Net>
  requires requires(Net& n) {
    n.layout();
    n.params();
  }
void load_hf_llama(const nn::llama_config& g, Net& net, const std::filesystem::path& dir) {
  std::vector<float> host(static_cast<std::size_t>(net.layout().total));
  copy_n(net.params().data(), host.size(), host.data());
  load_hf_llama(g, net.layout(), host, dir);
  copy_n(host.data(), host.size(), net.params().data());
}

}  // namespace dml::train
