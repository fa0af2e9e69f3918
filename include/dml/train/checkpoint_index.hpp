// SPDX-License-Identifier: Apache-2.0
// dml/train/checkpoint_index.hpp — a sharded checkpoint's index: types, tensor names, JSON form, parsing, checks.
// Sits on train/safetensors.hpp (its shape helpers) and nlohmann/json; train/checkpoint.hpp reads and writes the files.
//
// The index (a step directory's index.json) lists the model's parameters and the optimizer, and for each rank file
// its size, checksum and the ranges of the global index space it holds. Nothing here touches a file.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dml/core/error.hpp"
#include "dml/train/safetensors.hpp"

namespace dml::train {

inline constexpr int checkpoint_version = 1;

struct checkpoint_param {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

// What a checkpoint records besides the numbers. Loading checks model, optimizer and state_slots
// against the trainer; the rest is restored (step, seed, user) or informative (world_size, sharding).
struct checkpoint_info {
  std::vector<checkpoint_param> model;  // names and shapes in layer order: the model's fingerprint
  std::string optimizer;
  int state_slots = 0;
  std::int64_t step = 0;
  std::uint64_t seed = 0;
  int world_size = 0;
  std::string sharding;
  std::map<std::string, std::string> user;  // the caller's own position (epoch, batch, ...)
};

// Elements [begin, end) of one flattened tensor of the global index space.
struct checkpoint_range {
  std::string tensor;
  std::int64_t begin = 0, end = 0;
};

struct checkpoint_file {
  std::string name;  // relative to the step directory
  int rank = 0;
  std::int64_t bytes = 0;
  std::uint64_t checksum = 0;  // of the tensors' data, in the order of `ranges`
  std::vector<checkpoint_range> ranges;
};

struct checkpoint_index {
  std::filesystem::path dir;  // the step directory
  checkpoint_info info;
  std::vector<checkpoint_file> files;
};

// "param/<name>" for slot < 0, "state<slot>/<name>" otherwise.
inline std::string checkpoint_tensor_name(int slot, const std::string& param) {
  return slot < 0 ? "param/" + param : dml::detail::cat("state", slot, "/", param);
}

inline std::string checkpoint_step_name(std::int64_t step) {
  std::string digits = std::to_string(step);
  if (digits.size() < 8) digits.insert(0, 8 - digits.size(), '0');
  return "step-" + digits;
}

namespace detail {

// A fast 64-bit checksum (not cryptographic): it catches flipped or replaced bytes in a shard.
struct checksum64 {
  std::uint64_t h = 0x6a09e667f3bcc908ull;
  void add(std::span<const std::byte> data) {
    constexpr std::uint64_t k = 0x9e3779b97f4a7c15ull;
    std::size_t i = 0;
    for (; i + 8 <= data.size(); i += 8) {
      std::uint64_t w;
      std::memcpy(&w, data.data() + i, 8);
      h = (std::rotl(h ^ w, 29) + k) * 0xbf58476d1ce4e5b9ull;
    }
    for (; i < data.size(); ++i) h = (h ^ std::uint64_t(data[i])) * 0x100000001b3ull;
    h ^= data.size();
  }
};

inline std::string hex64(std::uint64_t v) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 0; i < 16; ++i) s[static_cast<std::size_t>(i)] = digits[(v >> (60 - 4 * i)) & 0xF];
  return s;
}

inline nlohmann::json to_json(const checkpoint_index& x) {
  const auto& i = x.info;
  nlohmann::json model = nlohmann::json::array();
  for (const auto& p : i.model) model.push_back({{"name", p.name}, {"shape", p.shape}});
  nlohmann::json files = nlohmann::json::array();
  for (const auto& f : x.files) {
    nlohmann::json ranges = nlohmann::json::array();
    for (const auto& r : f.ranges) ranges.push_back({r.tensor, r.begin, r.end});
    files.push_back({{"name", f.name}, {"rank", f.rank}, {"bytes", f.bytes}, {"checksum", hex64(f.checksum)},
                     {"ranges", std::move(ranges)}});
  }
  return {{"format", "dml-checkpoint"},
          {"version", checkpoint_version},
          {"step", i.step},
          {"seed", i.seed},
          {"world_size", i.world_size},
          {"sharding", i.sharding},
          {"optimizer", {{"name", i.optimizer}, {"state_slots", i.state_slots}}},
          {"model", std::move(model)},
          {"files", std::move(files)},
          {"user", i.user}};
}

// An integer field of an index: a JSON integer (not a float, which nlohmann would convert with
// undefined behaviour when out of range, nor a boolean) from lo to T's maximum.
template <class T>
T index_integer(const std::filesystem::path& path, const nlohmann::json& v, std::string_view what,
                T lo = std::numeric_limits<T>::min()) {
  bool ok = false;
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    ok = std::in_range<T>(u) && static_cast<T>(u) >= lo;
  } else if (v.is_number_integer()) {
    const auto n = v.get<std::int64_t>();
    ok = std::in_range<T>(n) && static_cast<T>(n) >= lo;
  }
  if (!ok)
    fail<format_error>(path.string(), ": expected ", what, " to be an integer from ", lo, " to ",
                       std::numeric_limits<T>::max(), ", found ", v.dump());
  return v.get<T>();
}

inline checkpoint_index parse_index(const std::filesystem::path& path, const std::string& text) {
  checkpoint_index x;
  x.dir = path.parent_path();
  try {
    const auto j = nlohmann::json::parse(text);
    if (!j.is_object() || j.value("format", std::string()) != "dml-checkpoint")
      fail<format_error>(path.string(), ": expected a dml checkpoint index (\"format\": \"dml-checkpoint\"), found ",
                         j.is_object() && j.contains("format") ? j["format"].dump() : std::string("none"));
    if (index_integer<int>(path, j.at("version"), "the format version") != checkpoint_version)
      fail<format_error>(path.string(), ": expected checkpoint format version ", checkpoint_version, ", found ",
                         j.at("version").dump());
    auto& i = x.info;
    i.step = index_integer<std::int64_t>(path, j.at("step"), "the step");
    i.seed = index_integer<std::uint64_t>(path, j.at("seed"), "the seed");
    i.world_size = index_integer<int>(path, j.at("world_size"), "the world size", 0);
    i.sharding = j.at("sharding").get<std::string>();
    i.optimizer = j.at("optimizer").at("name").get<std::string>();
    i.state_slots = index_integer<int>(path, j.at("optimizer").at("state_slots"), "the optimizer's state slots", 0);
    for (const auto& p : j.at("model")) {
      checkpoint_param q{p.at("name").get<std::string>(), {}};
      const auto& shape = p.at("shape");
      if (!shape.is_array())
        fail<format_error>(path.string(), ": parameter '", q.name, "': expected an array 'shape', found ", shape.dump());
      for (const auto& d : shape)
        q.shape.push_back(index_integer<std::int64_t>(path, d, "a dimension of parameter '" + q.name + "'", 0));
      // numel() must not overflow, for this parameter or any tensor of its state.
      std::uint64_t n = 0;
      if (!checked_bytes(q.shape, 1, n) || !std::in_range<std::int64_t>(n))
        fail<format_error>(path.string(), ": parameter '", q.name, "': shape ", shape_text(q.shape),
                           " has 2^63 or more elements, expected fewer");
      i.model.push_back(std::move(q));
    }
    i.user = j.at("user").get<std::map<std::string, std::string>>();
    for (const auto& f : j.at("files")) {
      checkpoint_file g;
      g.name = f.at("name").get<std::string>();
      g.rank = index_integer<int>(path, f.at("rank"), "the rank of file '" + g.name + "'", 0);
      g.bytes = index_integer<std::int64_t>(path, f.at("bytes"), "the size of file '" + g.name + "'", 0);
      const auto sum = f.at("checksum").get<std::string>();
      if (sum.size() != 16 || sum.find_first_not_of("0123456789abcdef") != std::string::npos)
        fail<format_error>(path.string(), ": file '", g.name, "': expected a 16-digit hex checksum, found '", sum, "'");
      g.checksum = std::stoull(sum, nullptr, 16);
      for (const auto& r : f.at("ranges"))
        g.ranges.push_back({r.at(0).get<std::string>(),
                            index_integer<std::int64_t>(path, r.at(1), "a range's begin in file '" + g.name + "'"),
                            index_integer<std::int64_t>(path, r.at(2), "a range's end in file '" + g.name + "'")});
      x.files.push_back(std::move(g));
    }
  } catch (const nlohmann::json::exception& e) {
    fail<format_error>(path.string(), ": not a valid checkpoint index: ", e.what());
  }
  return x;
}

// The parameter a tensor name of the global index space refers to, when it is one: "param/<name>",
// or "state<k>/<name>" with k below state_slots, written as checkpoint_tensor_name writes it.
inline bool tensor_parameter(const std::string& tensor, int state_slots, std::string& param) {
  const auto slash = tensor.find('/');
  if (slash == std::string::npos) return false;
  param = tensor.substr(slash + 1);
  const std::string_view head(tensor.data(), slash);
  if (head == "param") return true;
  if (!head.starts_with("state") || head.size() == 5 || head.size() > 15) return false;
  std::int64_t k = 0;
  for (char c : head.substr(5)) {
    if (c < '0' || c > '9') return false;
    k = k * 10 + (c - '0');
  }
  return k < state_slots && checkpoint_tensor_name(static_cast<int>(k), param) == tensor;
}

// Every tensor of the global index space is covered exactly once by the files' ranges.
inline void check_coverage(const std::filesystem::path& path, const checkpoint_index& x) {
  std::map<std::string, std::int64_t> numel;  // of each parameter, and so of each of its tensors
  for (const auto& p : x.info.model) numel[p.name] = p.numel();
  std::map<std::string, std::vector<std::pair<std::int64_t, std::int64_t>>> seen;
  std::map<std::string, std::int64_t> seen_numel;
  std::string param;
  for (const auto& f : x.files)
    for (const auto& r : f.ranges) {
      auto it = tensor_parameter(r.tensor, x.info.state_slots, param) ? numel.find(param) : numel.end();
      if (it == numel.end())
        fail<format_error>(path.string(), ": file '", f.name, "' holds '", r.tensor,
                           "', which is not a tensor of the checkpoint's model");
      if (r.begin < 0 || r.end <= r.begin || r.end > it->second)
        fail<format_error>(path.string(), ": file '", f.name, "' holds elements [", r.begin, ", ", r.end, ") of '",
                           r.tensor, "', expected a non-empty range within [0, ", it->second, ")");
      seen[r.tensor].emplace_back(r.begin, r.end);
      seen_numel[r.tensor] = it->second;
    }
  // Tensors with elements that no file holds. Each needs a range, so this walk meets a missing one
  // after at most seen.size() tensors: a corrupt state_slots cannot keep it going for long.
  std::vector<const checkpoint_param*> nonempty;
  for (const auto& p : x.info.model)
    if (p.numel() > 0) nonempty.push_back(&p);
  for (int s = -1; !nonempty.empty() && s < x.info.state_slots; ++s)
    for (const auto* p : nonempty) {
      const auto name = checkpoint_tensor_name(s, p->name);
      if (!seen.contains(name))
        fail<format_error>(path.string(), ": elements [0, ", p->numel(), ") of '", name,
                           "' are in no file (a shard is missing from the index)");
    }
  for (const auto& [name, n] : seen_numel) {
    auto& v = seen[name];
    std::sort(v.begin(), v.end());
    std::int64_t at = 0;
    for (const auto& [b, e] : v) {
      if (b > at)
        fail<format_error>(path.string(), ": elements [", at, ", ", b, ") of '", name,
                           "' are in no file (a shard is missing from the index)");
      if (b < at)
        fail<format_error>(path.string(), ": elements [", b, ", ", std::min(at, e), ") of '", name,
                           "' are in two files, expected each element once");
      at = e;
    }
    if (at < n)
      fail<format_error>(path.string(), ": elements [", at, ", ", n, ") of '", name,
                         "' are in no file (a shard is missing from the index)");
  }
}

inline void check_matches(const std::filesystem::path& path, const checkpoint_info& got, const checkpoint_info& want) {
  auto names = [](const checkpoint_info& i) {
    std::string s;
    for (const auto& p : i.model) s += (s.empty() ? "" : ", ") + p.name;
    return s;
  };
  if (got.model.size() != want.model.size())
    fail<invalid_argument>(path.string(), ": the checkpoint is of another model: it has ", got.model.size(),
                           " parameters (", names(got), "), this trainer's model has ", want.model.size(), " (",
                           names(want), ")");
  for (std::size_t k = 0; k < got.model.size(); ++k) {
    const auto &a = got.model[k], &b = want.model[k];
    if (a.name != b.name)
      fail<invalid_argument>(path.string(), ": the checkpoint is of another model: parameter ", k, " is '", a.name,
                             "' in the checkpoint, '", b.name, "' in this trainer's model");
    if (a.shape != b.shape)
      fail<shape_error>(path.string(), ": the checkpoint is of another model: parameter '", a.name, "' has shape ",
                        shape_text(a.shape), " in the checkpoint, ", shape_text(b.shape), " in this trainer's model");
  }
  if (got.optimizer != want.optimizer || got.state_slots != want.state_slots)
    fail<invalid_argument>(path.string(), ": the checkpoint holds the state of optimizer '", got.optimizer,
                           "' (state slots: ", got.state_slots, "), this trainer uses '", want.optimizer,
                           "' (state slots: ", want.state_slots, ")");
}

}  // namespace detail

// A checkpoint index from its text (the contents of `path`, a step directory's index.json),
// checked: format, and every element of every tensor in exactly one file. Touches no file.
inline checkpoint_index parse_checkpoint_index(const std::string& text, const std::filesystem::path& path) {
  auto x = detail::parse_index(path, text);
  detail::check_coverage(path, x);
  return x;
}

}  // namespace dml::train
