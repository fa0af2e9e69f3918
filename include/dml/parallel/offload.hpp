// SPDX-License-Identifier: Apache-2.0
// dml/parallel/offload.hpp — optimizer state in memory or on disk (ZeRO-Offload's disk tier), updated in buckets.
// Sits on optim/optimizer.hpp; parallel/sharding.hpp keeps one per rank and replicate.hpp and zero.hpp update through it.
//
// On disk, a rank's state slots live in two files, DIR/<stem>.0 and DIR/<stem>.1, each a 32-byte header
// (magic "DMLOPTST", elements, slots, sequence) and the slots one after another. Both files are allocated
// in full at construction, so a full disk fails there and never in a step. A step reads the state from the
// current file two buckets at a time (the next bucket is read on a helper thread while this one updates),
// writes each updated bucket to the other file, and stamps that file's header last: if the process dies
// part-way, the current file still holds the whole state of the last finished step. Only two buckets of
// state are in memory. A checkpoint reads the whole state in (slot()), and the next update writes it out.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <future>
#include <string>
#include <string_view>
#include <vector>

#include "dml/core/buffer.hpp"
#include "dml/core/error.hpp"
#include "dml/optim/optimizer.hpp"

namespace dml::parallel {

// "optimizer:disk:DIR" (trainer_options::offload) to DIR; empty to empty (no offload).
inline std::string offload_directory(std::string_view spec) {
  constexpr std::string_view prefix = "optimizer:disk:";
  if (spec.empty()) return {};
  if (!spec.starts_with(prefix) || spec.size() == prefix.size())
    fail<invalid_argument>("dml::trainer: expected offload \"optimizer:disk:DIR\", found \"", spec, "\"");
  return std::string(spec.substr(prefix.size()));
}

// What is wrong with dir as an offload directory ("an existing directory, found none"), or empty.
inline std::string offload_directory_problem(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return std::string("an existing directory, found ") + (fs::exists(dir, ec) ? "something else" : "none");
  if (::access(dir.c_str(), W_OK | X_OK) != 0) return std::string("a writable directory, found ") + std::strerror(errno);
  return {};
}

// The check of a command line's --offload value: empty when spec is "optimizer:disk:DIR" with a usable DIR, else
// what was expected (the examples' flag tables print it after "expected").
inline std::string offload_spec_problem(std::string_view spec) {
  constexpr std::string_view prefix = "optimizer:disk:";
  const bool ok = spec.starts_with(prefix) && spec.size() > prefix.size() &&
                  offload_directory_problem(std::string(spec.substr(prefix.size()))).empty();
  return ok ? std::string() : "optimizer:disk:DIR with DIR an existing, writable directory";
}

// A file stem of its own for each trainer and rank of this process ("dml-optimizer-<pid>-<serial>-rank<r>"),
// so that trainers and processes sharing a directory never share a file.
inline std::string offload_stem(int rank) {
  static std::atomic<int> serial{0};
  return "dml-optimizer-" + std::to_string(::getpid()) + "-" + std::to_string(serial++) + "-rank" + std::to_string(rank);
}

namespace detail {

// One file of a rank's state: header and slots, allocated in full when created, removed when closed.
class state_file {
 public:
  static constexpr char magic[8] = {'D', 'M', 'L', 'O', 'P', 'T', 'S', 'T'};
  static constexpr std::int64_t header_bytes = 32;

  state_file() = default;
  state_file(std::filesystem::path p, std::int64_t n, int slots) : path_(std::move(p)), n_(n), slots_(slots) {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd_ < 0) fail<io_error>(path_.string(), ": cannot create the optimizer state file: ", std::strerror(errno));
    if (const int rc = ::posix_fallocate(fd_, 0, bytes()); rc != 0) {
      ::close(fd_);
      std::error_code ignore;
      std::filesystem::remove(path_, ignore);
      fail<io_error>(path_.string(), ": cannot allocate ", bytes(), " bytes for the optimizer state (", std::strerror(rc),
                     "): the disk is full or the file too large");
    }
  }
  state_file(state_file&& o) noexcept { *this = std::move(o); }
  state_file& operator=(state_file&& o) noexcept {
    std::swap(fd_, o.fd_);
    std::swap(path_, o.path_);
    n_ = o.n_;
    slots_ = o.slots_;
    return *this;
  }
  ~state_file() {
    if (fd_ < 0) return;
    ::close(fd_);
    std::error_code ignore;
    std::filesystem::remove(path_, ignore);  // scratch: checkpoints are what persists
  }

  std::int64_t bytes() const { return header_bytes + n_ * slots_ * std::int64_t{sizeof(float)}; }
  const std::filesystem::path& path() const { return path_; }
  void stamp(std::int64_t sequence) {
    std::array<std::int64_t, 4> h{};
    std::memcpy(h.data(), magic, sizeof magic);
    h[1] = n_;
    h[2] = slots_;
    h[3] = sequence;
    write(h.data(), sizeof h, 0, "the header");
  }
  // Before reading: the header says this file holds the state of `sequence`, and the file is whole.
  void check(std::int64_t sequence) const {
    struct stat st{};
    if (::fstat(fd_, &st) != 0) fail<io_error>(path_.string(), ": cannot stat the optimizer state file: ", std::strerror(errno));
    if (st.st_size < bytes())
      fail<io_error>(path_.string(), ": expected an optimizer state file of ", bytes(), " bytes, found ", st.st_size,
                     " (truncated)");
    std::array<std::int64_t, 4> h{};
    read(h.data(), sizeof h, 0, "the header");
    if (std::memcmp(h.data(), magic, sizeof magic) != 0 || h[1] != n_ || h[2] != slots_ || h[3] != sequence)
      fail<io_error>(path_.string(), ": expected an optimizer state header (DMLOPTST, ", n_, " elements, ", slots_,
                     " slots, sequence ", sequence, "), found ", h[1], " elements, ", h[2], " slots, sequence ", h[3],
                     std::memcmp(h.data(), magic, sizeof magic) != 0 ? " and a wrong magic (corrupted)" : "");
  }
  // Elements [lo, lo + count) of slot s.
  void read_slot(int s, std::int64_t lo, std::int64_t count, float* out) const {
    read(out, static_cast<std::size_t>(count) * sizeof(float), offset(s, lo), "optimizer state");
  }
  void write_slot(int s, std::int64_t lo, std::int64_t count, const float* in) {
    write(in, static_cast<std::size_t>(count) * sizeof(float), offset(s, lo), "optimizer state");
  }

 private:
  std::int64_t offset(int s, std::int64_t lo) const {
    return header_bytes + (static_cast<std::int64_t>(s) * n_ + lo) * std::int64_t{sizeof(float)};
  }
  void read(void* out, std::size_t bytes, std::int64_t at, const char* what) const {
    auto* p = static_cast<char*>(out);
    for (std::size_t done = 0; done < bytes;) {
      const auto r = ::pread(fd_, p + done, bytes - done, static_cast<off_t>(at + static_cast<std::int64_t>(done)));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        fail<io_error>(path_.string(), ": reading ", what, ": expected ", bytes, " bytes at offset ", at, ", found ",
                       done, r < 0 ? std::string(" (") + std::strerror(errno) + ")" : std::string(" (end of file)"));
      done += static_cast<std::size_t>(r);
    }
  }
  void write(const void* in, std::size_t bytes, std::int64_t at, const char* what) {
    const auto* p = static_cast<const char*>(in);
    for (std::size_t done = 0; done < bytes;) {
      const auto r = ::pwrite(fd_, p + done, bytes - done, static_cast<off_t>(at + static_cast<std::int64_t>(done)));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        fail<io_error>(path_.string(), ": writing ", what, ": expected to write ", bytes, " bytes at offset ", at,
                       ", wrote ", done, r < 0 ? std::string(" (") + std::strerror(errno) + ")" : std::string());
      done += static_cast<std::size_t>(r);
    }
  }

  int fd_ = -1;
  std::filesystem::path path_;
  std::int64_t n_ = 0;
  int slots_ = 0;
};

}  // namespace detail

// Where a sharding keeps its optimizer state: in memory (dir empty) or in files in dir.
struct offload_options {
  std::string dir{};           // empty: memory
  std::string stem = "state";  // file names: dir/<stem>.0 and dir/<stem>.1
  double bucket_mb = 1.0;      // state of this many MiB per bucket (all slots together)
};

// The optimizer state of n elements (the flat range or a ZeRO shard), with the update that reads and writes it.
template <optim::optimizer O, execution_space Space = host>
class optimizer_state {
  static constexpr int K = O::state_slots;

 public:
  optimizer_state() = default;
  void resize(std::int64_t n, const offload_options& o = {}) {
    dir_ = o.dir;
    if (dir_.empty()) return memory_.resize(n);
    n_ = n;
    namespace fs = std::filesystem;
    if (const auto problem = offload_directory_problem(dir_); !problem.empty())
      fail<invalid_argument>("dml::trainer: offload directory ", dir_, ": expected ", problem);
    if (!(o.bucket_mb > 0)) fail<invalid_argument>("dml::trainer: expected offload_bucket_mb > 0, found ", o.bucket_mb);
    const auto per = static_cast<std::int64_t>(o.bucket_mb * 1024 * 1024 / (sizeof(float) * std::max(K, 1)));
    bucket_ = std::max<std::int64_t>(1, std::min(per, n));
    for (int f = 0; f < 2; ++f) files_[f] = detail::state_file(fs::path(dir_) / (o.stem + "." + std::to_string(f)), n, K);
    std::vector<float> zeros(static_cast<std::size_t>(bucket_), 0.f);
    for (int s = 0; s < K; ++s)
      for (std::int64_t lo = 0; lo < n; lo += bucket_) files_[0].write_slot(s, lo, std::min(bucket_, n - lo), zeros.data());
    files_[0].stamp(0);
    // Even buckets go to io_[0], odd ones to io_[1]: an odd bucket holds at most n - bucket elements.
    cap_ = {bucket_, std::clamp<std::int64_t>(n - bucket_, 0, bucket_)};
    for (int j = 0; j < 2; ++j) io_[j].resize(static_cast<std::size_t>(K * cap_[j]));
    if constexpr (!std::same_as<Space, host>)
      for (int j = 0; j < 2; ++j) dev_[j].resize(static_cast<std::size_t>(K * cap_[j]));
  }
  bool on_disk() const { return !dir_.empty(); }
  // The slots' pointers, for updates that walk the state themselves (layer-wise optimizers): in memory only.
  float* const* pointers() {
    if (on_disk()) fail<invalid_argument>("dml::parallel::optimizer_state: expected the state in memory, found it on disk in ", dir_);
    return memory_.pointers();
  }
  std::int64_t size() const { return on_disk() ? n_ : memory_.size(); }
  // Bytes in memory: the whole state, or two buckets of it (at most the state's size; and the whole state while
  // a checkpoint holds it).
  std::int64_t bytes() const {
    if (!on_disk()) return memory_.bytes();
    return K * (cap_[0] + cap_[1]) * std::int64_t{sizeof(float)} + loaded_.bytes();
  }
  std::int64_t disk_bytes() const { return on_disk() ? n_ * K * std::int64_t{sizeof(float)} : 0; }

  // Slot s in memory, for checkpoints: on disk, the whole state is read in and stays until the next update
  // writes it out (a checkpoint loaded into it changes what is written).
  span_in<float, Space> slot(int s) {
    if (!on_disk()) return memory_.slot(s);
    if (loaded_.size() == 0) {
      loaded_.resize(n_);
      files_[cur_].check(sequence_);
      std::vector<float> tmp(static_cast<std::size_t>(n_));
      for (int k = 0; k < K; ++k) {
        files_[cur_].read_slot(k, 0, n_, tmp.data());
        dml::copy_n(tmp.data(), tmp.size(), loaded_.slot(k).data());
      }
    }
    return loaded_.slot(s);
  }

  // One update of elements [at, at + a.n) of the state (a.state is ignored). Every element of the state is
  // updated once between begin_step() and end_step().
  void update(const O& opt, optim::step_args a, std::int64_t at) {
    if (!on_disk()) {
      std::array<float*, (K > 0 ? K : 1)> st{};
      for (int s = 0; s < K; ++s) st[s] = memory_.pointers()[s] + at;
      a.state = st.data();
      return opt.template update<Space>(a);
    }
    const std::int64_t buckets = (a.n + bucket_ - 1) / bucket_;
    auto range = [&](std::int64_t b) { return std::pair{at + b * bucket_, std::min(bucket_, a.n - b * bucket_)}; };
    auto read = [&](std::int64_t b) {
      const auto [lo, count] = range(b);
      for (int s = 0; s < K; ++s) files_[cur_].read_slot(s, lo, count, io_[b % 2].data() + s * cap_[b % 2]);
    };
    std::future<void> reading = std::async(std::launch::async, read, 0), writing[2];
    for (std::int64_t b = 0; b < buckets; ++b) {
      reading.get();
      if (b + 1 < buckets) {
        if (writing[(b + 1) % 2].valid()) writing[(b + 1) % 2].get();
        reading = std::async(std::launch::async, read, b + 1);
      }
      const auto [lo, count] = range(b);
      float* host_state = io_[b % 2].data();
      float* state = host_state;
      if constexpr (!std::same_as<Space, host>) {  // staged through host memory
        state = dev_[b % 2].data();
        dml::copy_n(host_state, io_[b % 2].size(), state);
      }
      std::array<float*, (K > 0 ? K : 1)> st{};
      for (int s = 0; s < K; ++s) st[s] = state + s * cap_[b % 2];
      optim::step_args piece = a;
      piece.n = count;
      piece.w = a.w + (lo - at);
      piece.g.ptr = static_cast<const char*>(a.g.ptr) + (lo - at) * static_cast<std::int64_t>(dtype_size(a.g.type));
      if (a.working)
        piece.working.ptr = static_cast<char*>(a.working.ptr) + (lo - at) * static_cast<std::int64_t>(dtype_size(a.working.type));
      piece.state = st.data();
      opt.template update<Space>(piece);
      if constexpr (!std::same_as<Space, host>) dml::copy_n(state, io_[b % 2].size(), host_state);
      writing[b % 2] = std::async(std::launch::async, [&, b, lo = lo, count = count] {
        for (int s = 0; s < K; ++s) files_[1 - cur_].write_slot(s, lo, count, io_[b % 2].data() + s * cap_[b % 2]);
      });
    }
    for (auto& w : writing)
      if (w.valid()) w.get();
    written_ += a.n;
  }
  // Around every update of the whole state: checks the current file, and at the end stamps the other one and
  // makes it current. A checkpoint's state in memory is written out first.
  void begin_step() {
    if (!on_disk()) return;
    if (loaded_.size() != 0) {
      std::vector<float> tmp(static_cast<std::size_t>(n_));
      for (int k = 0; k < K; ++k) {
        dml::copy_n(loaded_.slot(k).data(), tmp.size(), tmp.data());
        files_[1 - cur_].write_slot(k, 0, n_, tmp.data());
      }
      switch_files();
      loaded_ = optim::state<O, Space>();
    }
    files_[cur_].check(sequence_);
    written_ = 0;
  }
  void end_step() {
    if (!on_disk()) return;
    if (written_ != n_)
      fail<error>("dml::parallel::optimizer_state: a step updated ", written_, " of ", n_, " elements of the offloaded state");
    switch_files();
  }

 private:
  void switch_files() {
    files_[1 - cur_].stamp(sequence_ + 1);
    ++sequence_;
    cur_ = 1 - cur_;
  }

  optim::state<O, Space> memory_, loaded_;
  std::string dir_;
  std::int64_t n_ = 0, bucket_ = 0, written_ = 0, sequence_ = 0;
  std::array<std::int64_t, 2> cap_{};  // elements per slot of io_[0] and io_[1]
  int cur_ = 0;
  detail::state_file files_[2];
  std::vector<float> io_[2];
  buffer<float, Space> dev_[2];
};

}  // namespace dml::parallel
