// SPDX-License-Identifier: Apache-2.0
// dml/train/checkpoint.hpp — sharded checkpoints: one safetensors file per rank and an index, in a global index space.
// Sits on train/checkpoint_index.hpp (the index), train/safetensors.hpp and comm/; trainer.hpp saves and loads
// through it. See DESIGN.md §1 and §6.
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
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
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
#if defined(__linux__)
#  include <sys/resource.h>
#endif

#include "dml/comm/communicator.hpp"
#include "dml/core/error.hpp"
#include "dml/train/checkpoint_index.hpp"
#include "dml/train/safetensors.hpp"

namespace dml::train {

namespace detail {

// Test seam: when set, called by every rank just before it writes its file, so tests can make one
// rank's write fail. Never set by the library.
inline std::function<void(int rank)> checkpoint_write_fault;

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
  comm::all_reduce_host(comm, std::span<std::int32_t>(first), comm::reduce_op::min);
  if (first[0] >= comm.size()) return;
  std::array<std::int64_t, 2> head{kind, static_cast<std::int64_t>(what.size())};
  comm::broadcast_host(comm, std::span<std::int64_t>(head), first[0]);
  what.resize(static_cast<std::size_t>(head[1]));
  if (!what.empty()) comm::broadcast_host(comm, std::span<char>(what.data(), what.size()), first[0]);
  if (comm.size() > 1 && first[0] != comm.rank()) what = dml::detail::cat(what, " (on rank ", first[0], ")");
  switch (head[0]) {
    case format: throw format_error(what);
    case shape: throw shape_error(what);
    case io: throw io_error(what);
    case argument: throw invalid_argument(what);
    default: throw error(what);
  }
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

// One collective save, in three parts, so that the file writes can run behind training (an asynchronous save):
//   1. the constructor (collective) checks the ranges, makes a fresh staging directory and, when given a copy of
//      the data, lets the caller change its own at once;
//   2. write() writes this rank's file into the staging directory (synced): here, or in a background thread;
//   3. publish() (collective) agrees on the files, then rank 0 writes the index, renames the staging directory
//      into place and moves dir/latest to it last (here, or in a background thread); finish() waits for it all.
// An interrupted save leaves the previous checkpoint as it was. Each step is made durable before the next one
// depends on it: every file is synced before its rename, the staging directory before it is renamed, dir before
// latest is replaced, so that after a crash or a power cut latest names a complete checkpoint. What killed
// saves left is removed first. ranges[r] lists what rank r writes; data[i] holds the elements of
// ranges[rank][i] (in `copy` when the save owns them). borrowed: data[i] is the caller's memory, which a writer in
// the background reads until it has handed the bytes to the system; the caller's next change to it waits for that
// (wait_released), not for the file to reach the disk.
class checkpoint_save {
 public:
  template <class Comm>
  checkpoint_save(Comm& comm, const std::filesystem::path& dir, checkpoint_info info,
                  std::vector<std::vector<checkpoint_range>> ranges, std::span<const float* const> data,
                  std::vector<float> copy = {}, bool borrowed = false)
      : dir_(dir), info_(std::move(info)), ranges_(std::move(ranges)), data_(data.begin(), data.end()),
        copy_(std::move(copy)), rank_(comm.rank()), n_(comm.size()), released_(!borrowed) {
    namespace fs = std::filesystem;
    info_.world_size = n_;
    const std::string step_name = checkpoint_step_name(info_.step);
    std::array<char, 16> tag{};
    agree(comm, [&] {
      if (static_cast<int>(ranges_.size()) != n_ || data_.size() != ranges_[static_cast<std::size_t>(rank_)].size())
        fail<invalid_argument>("dml::train::save_checkpoint: expected ranges for ", n_, " ranks and ",
                               ranges_[static_cast<std::size_t>(rank_)].size(), " data pointers, found ",
                               ranges_.size(), " and ", data_.size());
      if (rank_ != 0) return;
      std::error_code ec;
      fs::create_directories(dir_, ec);
      if (ec) fail<io_error>(dir_.string(), ": cannot create the checkpoint directory: ", ec.message());
      remove_abandoned(dir_);
      const auto suffix = temp_suffix();
      std::copy_n(suffix.data(), tag.size(), tag.data());
      const auto staging = dir_ / (step_name + ".partial-" + suffix);
      if (!fs::create_directory(staging, ec) || ec)
        fail<io_error>(staging.string(), ": cannot create the directory for a new checkpoint: ",
                       ec ? ec.message() : std::string("it exists"));
    });
    comm::broadcast_host(comm, std::span<char>(tag), 0);
    staging_ = dir_ / (step_name + ".partial-" + std::string(tag.data(), tag.size()));
  }
  checkpoint_save(const checkpoint_save&) = delete;
  checkpoint_save& operator=(const checkpoint_save&) = delete;
  // Never leaves a thread running; a save not finished stays in its staging directory, which the next save
  // removes (dir/latest still names the previous checkpoint).
  ~checkpoint_save() {
    if (writer_.joinable()) writer_.join();
    if (publisher_.joinable()) publisher_.join();
  }

  // This rank's file, now (its error is thrown by publish) or in a background thread.
  void write(bool background) {
    if (background)
      writer_ = std::thread([this] {
        yield_to_training();
        write_file();
      });
    else
      write_file();
  }
  // Collective; never throws a save's error. True once every rank's file is written and none failed: publish()
  // will not wait. Once a rank's write has failed, polling() is false: finish() throws it.
  template <class Comm>
  bool written_everywhere(Comm& comm) {
    std::array<std::int32_t, 1> pending{written_.load(std::memory_order_acquire) ? (error_ ? 2 : 0) : 1};
    comm::all_reduce_host(comm, std::span<std::int32_t>(pending), comm::reduce_op::max);
    failed_somewhere_ = pending[0] == 2;
    return pending[0] == 0;
  }
  bool polling() const { return !published_ && !failed_somewhere_; }
  // Collective: waits for this rank's file, agrees on every rank's (the first failure is thrown on every rank
  // and the staging directory removed), then rank 0 writes the index and moves latest (background: in a thread,
  // whose error finish() throws).
  template <class Comm>
  void publish(Comm& comm, bool background) {
    published_ = true;
    try {
      agree(comm, [&] {
        if (writer_.joinable()) writer_.join();
        if (error_) std::rethrow_exception(error_);
      });
    } catch (...) {
      abandon();
      throw;
    }
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(n_));
    comm::all_gather_host(comm, std::span<const std::int64_t>(mine_), std::span<std::int64_t>(all));
    if (rank_ != 0) {
      complete_.store(true, std::memory_order_release);
      return;
    }
    if (background)
      publisher_ = std::thread([this, all = std::move(all)] {
        yield_to_training();
        publish_index(all);
      });
    else
      publish_index(all);
  }
  // Collective: the whole save, done and durable, or its error on every rank.
  template <class Comm>
  void finish(Comm& comm) {
    if (!published_) publish(comm, false);
    agree(comm, [&] {
      if (publisher_.joinable()) publisher_.join();
      if (error_) std::rethrow_exception(error_);
    });
  }
  // Returns once the writer no longer reads the caller's memory (borrowed: its bytes are in the system's hands).
  void wait_released() const { released_.wait(false, std::memory_order_acquire); }
  // Not collective: this rank's part is done (rank 0's: latest names the new checkpoint).
  bool complete() const { return complete_.load(std::memory_order_acquire); }
  std::int64_t step() const { return info_.step; }
  std::int64_t staged_bytes() const { return static_cast<std::int64_t>(copy_.capacity() * sizeof(float)); }
  // The copy the save wrote from, for the next save to reuse (not while the writer may read it).
  std::vector<float> take_copy() {
    if (writer_.joinable()) writer_.join();
    return std::move(copy_);
  }

 private:
  std::string file_name(int r) const { return dml::detail::cat("rank-", r, "-of-", n_, ".safetensors"); }

  // A background thread runs at the lowest priority, so that on a machine whose cores all train it takes what
  // training leaves (an update that needs its memory back waits, and so leaves it a core). Linux: per thread.
  static void yield_to_training() {
#if defined(__linux__)
    (void)::setpriority(PRIO_PROCESS, 0, 19);
#endif
  }
  void release() {
    if (released_.load(std::memory_order_relaxed)) return;
    released_.store(true, std::memory_order_release);
    released_.notify_all();
  }
  void write_file() {
    const auto& my = ranges_[static_cast<std::size_t>(rank_)];
    try {
      if (checkpoint_write_fault) checkpoint_write_fault(rank_);
      std::vector<tensor_ref> refs;
      checksum64 sum;
      nlohmann::json listed = nlohmann::json::array();
      const auto keys = detail::stored_names(my);
      for (std::size_t i = 0; i < my.size(); ++i) {
        const auto& r = my[i];
        refs.push_back(make_tensor_ref(
            keys[i], std::span<const float>(data_[i], static_cast<std::size_t>(r.end - r.begin)), {r.end - r.begin}));
        sum.add(refs.back().data);
        listed.push_back({r.tensor, r.begin, r.end});
      }
      const auto path = staging_ / file_name(rank_);
      save_safetensors(path, refs,
                       {{"format", "dml-checkpoint"},
                        {"step", std::to_string(info_.step)},
                        {"rank", std::to_string(rank_)},
                        {"world_size", std::to_string(n_)},
                        {"ranges", listed.dump()}},
                       [this] { release(); });
      mine_ = {static_cast<std::int64_t>(std::filesystem::file_size(path)), static_cast<std::int64_t>(sum.h)};
    } catch (...) {
      error_ = std::current_exception();
    }
    release();
    written_.store(true, std::memory_order_release);
  }

  void publish_index(const std::vector<std::int64_t>& all) {
    namespace fs = std::filesystem;
    try {
      checkpoint_index x{staging_, info_, {}};
      for (int r = 0; r < n_; ++r)
        x.files.push_back({file_name(r), r, all[2 * static_cast<std::size_t>(r)],
                           static_cast<std::uint64_t>(all[2 * static_cast<std::size_t>(r) + 1]),
                           ranges_[static_cast<std::size_t>(r)]});
      // Syncing staging after the index also keeps the ranks' files, renamed into it before.
      write_text_atomically(staging_ / "index.json", to_json(x).dump(1));
      // A step directory already there (a second save of the same step) is left as it is.
      const std::string step_name = checkpoint_step_name(info_.step);
      fs::path target = dir_ / step_name;
      for (int k = 1; fs::exists(target); ++k) target = dir_ / dml::detail::cat(step_name, ".", k);
      std::error_code ec;
      fs::rename(staging_, target, ec);
      if (ec) fail<io_error>(target.string(), ": cannot move the new checkpoint into place: ", ec.message());
      sync_directory(dir_);  // the step directory's new name is durable before latest names it
      write_text_atomically(dir_ / "latest", target.filename().string() + "\n");
    } catch (...) {
      error_ = std::current_exception();
      abandon();
    }
    complete_.store(true, std::memory_order_release);
  }

  void abandon() {
    if (rank_ != 0) return;
    std::error_code ignore;
    std::filesystem::remove_all(staging_, ignore);
  }

  std::filesystem::path dir_, staging_;
  checkpoint_info info_;
  std::vector<std::vector<checkpoint_range>> ranges_;
  std::vector<const float*> data_;
  std::vector<float> copy_;
  int rank_, n_;
  std::array<std::int64_t, 2> mine_{};  // bytes, checksum of this rank's file
  std::exception_ptr error_;            // of this rank's write, or rank 0's publication
  std::atomic<bool> written_{false}, complete_{false}, released_;
  bool published_ = false, failed_somewhere_ = false;
  std::thread writer_, publisher_;
};

// Collective save, all three parts at once.
template <class Comm>
void write_checkpoint(Comm& comm, const std::filesystem::path& dir, checkpoint_info info,
                      std::vector<std::vector<checkpoint_range>> ranges, std::span<const float* const> data) {
  checkpoint_save save(comm, dir, std::move(info), std::move(ranges), data);
  save.write(false);
  save.finish(comm);
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
