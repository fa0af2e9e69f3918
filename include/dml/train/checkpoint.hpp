// SPDX-License-Identifier: Apache-2.0
// dml/train/checkpoint.hpp — sharded checkpoints: one safetensors file per rank and an index, in a global index space.
// Sits on train/safetensors.hpp and comm/; trainer.hpp saves and loads through it. See DESIGN.md §1 and §6.
//
// On disk:   dir/latest                              names the newest complete step directory
//            dir/step-00000100/index.json            model, optimizer, step, seed, files and their ranges
//            dir/step-00000100/rank-0-of-4.safetensors ...
// A tensor of the global index space is "param/<name>" or "state<k>/<name>" with the elements of the
// parameter flattened, no padding; each rank file holds one contiguous range of some of them. Ranges
// are independent of the layout that wrote them, so any group size or sharding can read any checkpoint.
// Every rank must see the same directory (one machine, or a shared file system).
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <functional>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#if __has_include(<fcntl.h>) && __has_include(<unistd.h>)
#  include <fcntl.h>
#  include <unistd.h>
#  define DML_CHECKPOINT_HAVE_DIRSYNC 1
#else
#  define DML_CHECKPOINT_HAVE_DIRSYNC 0
#endif

#include "dml/comm/communicator.hpp"
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

// Test seam: when set, called by every rank just before it writes its file, so tests can make one
// rank's write fail. Never set by the library.
inline std::function<void(int rank)> checkpoint_write_fault;

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

inline bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos;
}

// A rename or a new file is an entry of its directory: fsync of the file alone does not keep it
// after a power cut, fsync of the directory does. Where the system has no such call, a no-op.
inline void sync_directory(const std::filesystem::path& dir) {
#if DML_CHECKPOINT_HAVE_DIRSYNC
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail<io_error>(dir.string(), ": cannot open the directory to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd), saved = errno;
  ::close(fd);
  // Some file systems cannot sync a directory (EINVAL); there is nothing more to do on them.
  if (rc != 0 && saved != EINVAL)
    fail<io_error>(dir.string(), ": syncing the directory failed: ", std::strerror(saved));
#else
  (void)dir;
#endif
}

// What saves killed part-way left in dir: their staging directories ("step-*.partial-*") and a
// temporary beside latest ("latest.tmp-*"). Nothing names them, and one save at a time writes to a
// checkpoint directory, so they are removed before the next save makes its own.
inline void remove_abandoned(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> stale;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const auto name = it->path().filename().string();
    if ((name.starts_with("step-") && name.find(".partial-") != std::string::npos) ||
        name.starts_with("latest.tmp-"))
      stale.push_back(it->path());
  }
  for (const auto& p : stale) {
    std::error_code ignore;  // best effort: a leftover that stays does no harm but takes space
    std::filesystem::remove_all(p, ignore);
  }
}

// Text to `path` through a temporary beside it and a rename, so readers see the old or the new text.
inline void write_text_atomically(const std::filesystem::path& path, const std::string& text) {
  std::filesystem::path tmp = path;
  tmp += ".tmp-" + temp_suffix();
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail<io_error>(path.string(), ": cannot create temporary file ", tmp.string(), ": ", std::strerror(errno));
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  ok = ok && std::fflush(f) == 0;
#if DML_SAFETENSORS_HAVE_FSYNC
  ok = ok && ::fsync(::fileno(f)) == 0;
#endif
  const int saved = errno;
  ok = (std::fclose(f) == 0) && ok;
  std::error_code ec;
  if (ok) std::filesystem::rename(tmp, path, ec);
  if (!ok || ec) {
    std::error_code ignore;
    std::filesystem::remove(tmp, ignore);
    fail<io_error>(path.string(), ": writing ", text.size(), " bytes through ", tmp.string(),
                   " failed: ", ec ? ec.message() : std::strerror(saved));
  }
  sync_directory(path.has_parent_path() ? path.parent_path() : std::filesystem::path("."));
}

inline std::string read_text(const std::filesystem::path& path, const char* what) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    fail<io_error>(path.string(), ": expected ", what, ", found no such file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail<io_error>(path.string(), ": cannot open ", what, " for reading");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs f on every rank, then agrees: if f threw on any rank, every rank throws the same error (type
// and message of the lowest failing rank), so no rank goes on alone and the error reads the same
// wherever it is caught. f must not communicate.
template <class Comm, class F>
void agree(Comm& comm, F&& f) {
  enum : std::int64_t { other, format, shape, io, argument };
  std::int64_t kind = -1;
  std::string what;
  try {
    f();
  } catch (const format_error& e) {
    kind = format, what = e.what();
  } catch (const shape_error& e) {
    kind = shape, what = e.what();
  } catch (const io_error& e) {
    kind = io, what = e.what();
  } catch (const invalid_argument& e) {
    kind = argument, what = e.what();
  } catch (const std::filesystem::filesystem_error& e) {
    kind = io, what = e.what();
  } catch (const std::exception& e) {
    kind = other, what = e.what();
  }
  std::array<std::int32_t, 1> first{kind >= 0 ? comm.rank() : comm.size()};
  comm.all_reduce(std::span<std::int32_t>(first), comm::reduce_op::min);
  if (first[0] >= comm.size()) return;
  std::array<std::int64_t, 2> head{kind, static_cast<std::int64_t>(what.size())};
  comm.broadcast(std::span<std::int64_t>(head), first[0]);
  what.resize(static_cast<std::size_t>(head[1]));
  if (!what.empty()) comm.broadcast(std::span<char>(what.data(), what.size()), first[0]);
  if (comm.size() > 1 && first[0] != comm.rank()) what = dml::detail::cat(what, " (on rank ", first[0], ")");
  switch (head[0]) {
    case format: throw format_error(what);
    case shape: throw shape_error(what);
    case io: throw io_error(what);
    case argument: throw invalid_argument(what);
    default: throw error(what);
  }
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

// Files present with the sizes the index recorded, names that stay inside the step directory.
inline void check_files(const std::filesystem::path& path, const checkpoint_index& x) {
  if (static_cast<int>(x.files.size()) != x.info.world_size)
    fail<format_error>(path.string(), ": expected one file per rank (", x.info.world_size, "), found ", x.files.size());
  for (const auto& f : x.files) {
    if (!plain_file_name(f.name))
      fail<format_error>(path.string(), ": file name '", f.name, "' must name a file in the step directory");
    const auto p = x.dir / f.name;
    std::error_code ec;
    if (!std::filesystem::is_regular_file(p, ec))
      fail<io_error>(p.string(), ": the shard of rank ", f.rank, " is missing (the index ", path.string(),
                     " lists it)");
    const auto size = std::filesystem::file_size(p, ec);
    if (ec) fail<io_error>(p.string(), ": cannot read its size: ", ec.message());
    if (static_cast<std::int64_t>(size) != f.bytes)
      fail<format_error>(p.string(), ": expected ", f.bytes, " bytes as the index records, found ", size,
                         size < static_cast<std::uintmax_t>(f.bytes) ? " (truncated file)" : " (changed file)");
  }
}

// The key of each range in its rank file: the tensor's name, and "name@begin" for a second range of the same
// tensor in one file (a tensor-parallel part of a matrix split along its columns is one range per row).
inline std::vector<std::string> stored_names(const std::vector<checkpoint_range>& ranges) {
  std::vector<std::string> out;
  std::map<std::string_view, int> seen;
  for (const auto& r : ranges)
    out.push_back(seen[r.tensor]++ == 0 ? r.tensor : dml::detail::cat(r.tensor, "@", r.begin));
  return out;
}

// Opens a rank file and checks it against its index entry: the tensors, their shapes and the checksum.
inline safetensors_file open_shard(const checkpoint_index& x, const checkpoint_file& f) {
  auto file = safetensors_file::open(x.dir / f.name);
  const auto p = (x.dir / f.name).string();
  if (file.tensors().size() != f.ranges.size())
    fail<format_error>(p, ": expected ", f.ranges.size(), " tensors as the index lists, found ",
                       file.tensors().size());
  checksum64 sum;
  const auto keys = stored_names(f.ranges);
  for (std::size_t i = 0; i < f.ranges.size(); ++i) {
    const auto& r = f.ranges[i];
    if (!file.contains(keys[i])) fail<format_error>(p, ": expected a tensor '", keys[i], "', found none");
    const auto& t = file.at(keys[i]);
    if (t.dtype != dml::dtype::f32 || t.shape.size() != 1 || t.shape[0] != r.end - r.begin)
      fail<format_error>(p, ": tensor '", keys[i], "': expected F32 of shape [", r.end - r.begin, "], found ",
                         dml::dtype_name(t.dtype), " of shape ", shape_text(t.shape));
    sum.add(file.bytes(keys[i]));
  }
  if (sum.h != f.checksum)
    fail<format_error>(p, ": checksum ", hex64(sum.h), " does not match ", hex64(f.checksum),
                       " in the index (corrupted file)");
  return file;
}

}  // namespace detail

// The step directory that dir/latest names. Never writes.
inline std::filesystem::path latest_checkpoint(const std::filesystem::path& dir) {
  const auto latest = dir / "latest";
  std::error_code ec;
  if (!std::filesystem::exists(latest, ec))
    fail<io_error>(latest.string(), ": no checkpoint here (expected a file naming the newest step directory)");
  auto name = detail::read_text(latest, "a file naming the newest step directory");
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
  if (!detail::plain_file_name(name))
    fail<format_error>(latest.string(), ": expected the name of a step directory in ", dir.string(), ", found '",
                       name, "'");
  return dir / name;
}

// A checkpoint index from its text (the contents of `path`, a step directory's index.json),
// checked: format, and every element of every tensor in exactly one file. Touches no file.
inline checkpoint_index parse_checkpoint_index(const std::string& text, const std::filesystem::path& path) {
  auto x = detail::parse_index(path, text);
  detail::check_coverage(path, x);
  return x;
}

// The index of the newest checkpoint in dir, checked as parse_checkpoint_index does, and every
// file present with the size recorded. Shard contents are checked on load.
inline checkpoint_index read_checkpoint_index(const std::filesystem::path& dir) {
  const auto step_dir = latest_checkpoint(dir);
  const auto path = step_dir / "index.json";
  auto x = parse_checkpoint_index(detail::read_text(path, "a checkpoint index"), path);
  detail::check_files(path, x);
  return x;
}

namespace detail {

// Collective save. ranges[r] lists what rank r writes; data[i] holds the elements of ranges[rank][i].
// The files go into a fresh directory that is renamed into place once every rank has written, and
// dir/latest moves to it last: an interrupted save leaves the previous checkpoint as it was.
// Each step is made durable before the next one depends on it: every file is synced before its
// rename, the staging directory before it is renamed, dir before latest is replaced, so that after
// a crash or a power cut latest names a complete checkpoint. What killed saves left is removed first.
template <class Comm>
void write_checkpoint(Comm& comm, const std::filesystem::path& dir, checkpoint_info info,
                      const std::vector<std::vector<checkpoint_range>>& ranges, std::span<const float* const> data) {
  namespace fs = std::filesystem;
  const int rank = comm.rank(), n = comm.size();
  info.world_size = n;
  const std::string step_name = checkpoint_step_name(info.step);
  std::array<char, 16> tag{};
  agree(comm, [&] {
    if (static_cast<int>(ranges.size()) != n || data.size() != ranges[static_cast<std::size_t>(rank)].size())
      fail<invalid_argument>("dml::train::save_checkpoint: expected ranges for ", n, " ranks and ",
                             ranges[static_cast<std::size_t>(rank)].size(), " data pointers, found ", ranges.size(),
                             " and ", data.size());
    if (rank != 0) return;
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) fail<io_error>(dir.string(), ": cannot create the checkpoint directory: ", ec.message());
    remove_abandoned(dir);
    const auto suffix = temp_suffix();
    std::copy_n(suffix.data(), tag.size(), tag.data());
    const auto staging = dir / (step_name + ".partial-" + suffix);
    if (!fs::create_directory(staging, ec) || ec)
      fail<io_error>(staging.string(), ": cannot create the directory for a new checkpoint: ",
                     ec ? ec.message() : std::string("it exists"));
  });
  comm.broadcast(std::span<char>(tag), 0);
  const fs::path staging = dir / (step_name + ".partial-" + std::string(tag.data(), tag.size()));
  auto abandon = [&] {
    if (rank != 0) return;
    std::error_code ignore;
    fs::remove_all(staging, ignore);
  };

  const auto file_name = [n](int r) { return dml::detail::cat("rank-", r, "-of-", n, ".safetensors"); };
  std::array<std::int64_t, 2> mine{};  // bytes, checksum
  try {
    agree(comm, [&] {
      if (checkpoint_write_fault) checkpoint_write_fault(rank);
      const auto& my = ranges[static_cast<std::size_t>(rank)];
      std::vector<tensor_ref> refs;
      checksum64 sum;
      nlohmann::json listed = nlohmann::json::array();
      const auto keys = detail::stored_names(my);
      for (std::size_t i = 0; i < my.size(); ++i) {
        const auto& r = my[i];
        refs.push_back(make_tensor_ref(keys[i], std::span<const float>(data[i], static_cast<std::size_t>(r.end - r.begin)),
                                       {r.end - r.begin}));
        sum.add(refs.back().data);
        listed.push_back({r.tensor, r.begin, r.end});
      }
      const auto path = staging / file_name(rank);
      save_safetensors(path, refs,
                       {{"format", "dml-checkpoint"},
                        {"step", std::to_string(info.step)},
                        {"rank", std::to_string(rank)},
                        {"world_size", std::to_string(n)},
                        {"ranges", listed.dump()}});
      mine = {static_cast<std::int64_t>(fs::file_size(path)), static_cast<std::int64_t>(sum.h)};
    });
  } catch (...) {
    abandon();
    throw;
  }
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(n));
  comm.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));

  try {
    agree(comm, [&] {
      if (rank != 0) return;
      checkpoint_index x{staging, std::move(info), {}};
      for (int r = 0; r < n; ++r)
        x.files.push_back({file_name(r), r, all[2 * static_cast<std::size_t>(r)],
                           static_cast<std::uint64_t>(all[2 * static_cast<std::size_t>(r) + 1]),
                           ranges[static_cast<std::size_t>(r)]});
      // Syncing staging after the index also keeps the ranks' files, renamed into it before.
      write_text_atomically(staging / "index.json", to_json(x).dump(1));
      // A step directory already there (a second save of the same step) is left as it is.
      fs::path target = dir / step_name;
      for (int k = 1; fs::exists(target); ++k) target = dir / dml::detail::cat(step_name, ".", k);
      std::error_code ec;
      fs::rename(staging, target, ec);
      if (ec) fail<io_error>(target.string(), ": cannot move the new checkpoint into place: ", ec.message());
      sync_directory(dir);  // the step directory's new name is durable before latest names it
      write_text_atomically(dir / "latest", target.filename().string() + "\n");
    });
  } catch (...) {
    abandon();
    throw;
  }
}

// Collective load: checks the newest checkpoint in dir against `want` (model, optimizer), then fills
// out[i] with the elements of need[i]. Reads only the files this rank's ranges touch. Never writes.
template <class Comm>
checkpoint_info read_checkpoint(Comm& comm, const std::filesystem::path& dir, const checkpoint_info& want,
                                std::span<const checkpoint_range> need, std::span<float* const> out) {
  checkpoint_info got;
  agree(comm, [&] {
    if (need.size() != out.size())
      fail<invalid_argument>("dml::train::load_checkpoint: expected one output per range, found ", need.size(),
                             " ranges and ", out.size(), " outputs");
    auto x = read_checkpoint_index(dir);
    check_matches(x.dir / "index.json", x.info, want);
    // Where each tensor's pieces lie: (file, range) pairs.
    std::map<std::string, std::vector<std::pair<std::size_t, std::size_t>>> where;
    for (std::size_t f = 0; f < x.files.size(); ++f)
      for (std::size_t r = 0; r < x.files[f].ranges.size(); ++r) where[x.files[f].ranges[r].tensor].emplace_back(f, r);
    std::map<std::size_t, safetensors_file> open;
    std::vector<std::vector<std::string>> keys;
    for (const auto& f : x.files) keys.push_back(detail::stored_names(f.ranges));
    for (std::size_t i = 0; i < need.size(); ++i) {
      const auto& q = need[i];
      std::int64_t filled = 0;
      for (const auto& [f, r] : where[q.tensor]) {
        const auto& have = x.files[f].ranges[r];
        const std::int64_t b = std::max(q.begin, have.begin), e = std::min(q.end, have.end);
        if (b >= e) continue;
        auto it = open.find(f);
        if (it == open.end()) it = open.emplace(f, open_shard(x, x.files[f])).first;
        const auto bytes = it->second.bytes(keys[f][r]);
        std::memcpy(out[i] + (b - q.begin), bytes.data() + (b - have.begin) * sizeof(float),
                    static_cast<std::size_t>(e - b) * sizeof(float));
        filled += e - b;
      }
      if (filled != q.end - q.begin)
        fail<invalid_argument>(x.dir.string(), ": elements [", q.begin, ", ", q.end, ") of '", q.tensor,
                               "' were asked for, but the checkpoint holds only ", filled, " of them");
    }
    got = std::move(x.info);
  });
  return got;
}

}  // namespace detail

}  // namespace dml::train
