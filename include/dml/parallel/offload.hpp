// SPDX-License-Identifier: Apache-2.0
// dml/parallel/offload.hpp — optimizer state in memory or on disk (ZeRO-Offload's disk tier), updated in buckets.
// Sits on optim/optimizer.hpp; parallel/sharding.hpp keeps one per rank and replicate.hpp and zero.hpp update through it.
//
// On disk, a rank's state slots live in two files, DIR/<stem>.0 and DIR/<stem>.1, each a 32-byte header
// (magic "DMLOPTST", elements, slots, sequence) and the slots one after another. Both files are allocated
// in full at construction, so a full disk fails there and never in a step. A step reads the state from the
// current file and writes it to the other one, a bucket at a time, on one I/O thread per state that lives as
// long as it: while bucket k updates, that thread writes bucket k - 1 and reads bucket k + 1 (two buffers,
// so the depth is fixed and no thread is made per step). The other file's header is stamped last, after
// every write: if the step fails or the process dies part-way, the current file still holds the whole state
// of the last finished step, and the next step reads it again. Only two buckets of state are in memory. A
// checkpoint reads the whole state in (slot()), and the next update writes it out. With offload_options::master
// (mixed precision), a last slot holds the float master weights: the update reads them with the state and
// passes them as step_args::w, and master() reads them in for the sharding's other readers (parameters,
// checkpoints, the working copy's refresh) as slot() does.
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
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dml/core/buffer.hpp"
#include "dml/core/error.hpp"
#include "dml/core/worker_thread.hpp"
#include "dml/optim/optimizer.hpp"

namespace dml::parallel {

// trainer_options::offload: the optimizer state, and with "master" the float master weights of mixed precision.
inline constexpr std::string_view offload_prefixes[] = {"optimizer:disk:", "optimizer,master:disk:"};

// "optimizer:disk:DIR" or "optimizer,master:disk:DIR" to DIR; empty to empty (no offload).
inline std::string offload_directory(std::string_view spec) {
  if (spec.empty()) return {};
  for (const auto prefix : offload_prefixes)
    if (spec.starts_with(prefix) && spec.size() > prefix.size()) return std::string(spec.substr(prefix.size()));
  fail<invalid_argument>("dml::trainer: expected offload \"optimizer:disk:DIR\" or \"optimizer,master:disk:DIR\", found \"",
                         spec, "\"");
}
// Whether spec puts the master weights on disk too.
inline bool offload_master(std::string_view spec) { return spec.starts_with(offload_prefixes[1]); }

// What is wrong with dir as an offload directory ("an existing directory, found none"), or empty.
inline std::string offload_directory_problem(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return std::string("an existing directory, found ") + (fs::exists(dir, ec) ? "something else" : "none");
  if (::access(dir.c_str(), W_OK | X_OK) != 0) return std::string("a writable directory, found ") + std::strerror(errno);
  return {};
}

// The check of a command line's --offload value: empty when spec is "optimizer:disk:DIR" or
// "optimizer,master:disk:DIR" with a usable DIR, else what was expected (the examples' flag tables print it
// after "expected").
inline std::string offload_spec_problem(std::string_view spec) {
  for (const auto prefix : offload_prefixes)
    if (spec.starts_with(prefix) && spec.size() > prefix.size() &&
        offload_directory_problem(std::string(spec.substr(prefix.size()))).empty())
      return {};
  return "optimizer:disk:DIR or optimizer,master:disk:DIR with DIR an existing, writable directory";
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
  bool master = false;         // on disk, a last slot holds the float master weights (mixed precision)
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
    slots_ = K + (o.master ? 1 : 0);
    namespace fs = std::filesystem;
    if (const auto problem = offload_directory_problem(dir_); !problem.empty())
      fail<invalid_argument>("dml::trainer: offload directory ", dir_, ": expected ", problem);
    if (!(o.bucket_mb > 0)) fail<invalid_argument>("dml::trainer: expected offload_bucket_mb > 0, found ", o.bucket_mb);
    const auto per = static_cast<std::int64_t>(o.bucket_mb * 1024 * 1024 / (sizeof(float) * std::max(slots_, 1)));
    bucket_ = std::max<std::int64_t>(1, std::min(per, n));
    for (int f = 0; f < 2; ++f) files_[f] = detail::state_file(fs::path(dir_) / (o.stem + "." + std::to_string(f)), n, slots_);
    std::vector<float> zeros(static_cast<std::size_t>(bucket_), 0.f);
    for (int s = 0; s < slots_; ++s)
      for (std::int64_t lo = 0; lo < n; lo += bucket_) files_[0].write_slot(s, lo, std::min(bucket_, n - lo), zeros.data());
    files_[0].stamp(0);
    // Even buckets go to buf_[0], odd ones to buf_[1]: an odd bucket holds at most n - bucket elements.
    cap_ = {bucket_, std::clamp<std::int64_t>(n - bucket_, 0, bucket_)};
    for (int j = 0; j < 2; ++j) buf_[j].resize(static_cast<std::size_t>(slots_ * cap_[j]));
    if constexpr (!std::same_as<Space, host>)
      for (int j = 0; j < 2; ++j) dev_[j].resize(static_cast<std::size_t>(slots_ * cap_[j]));
    io_ = std::make_unique<io_thread>();
  }
  bool on_disk() const { return !dir_.empty(); }
  // Whether the float master weights live here (on disk, slot K) rather than with the sharding.
  bool holds_master() const { return slots_ > K; }
  // The slots' pointers, for updates that walk the state themselves (layer-wise optimizers): in memory only.
  float* const* pointers() {
    if (on_disk()) fail<invalid_argument>("dml::parallel::optimizer_state: expected the state in memory, found it on disk in ", dir_);
    return memory_.pointers();
  }
  std::int64_t size() const { return on_disk() ? n_ : memory_.size(); }
  // Bytes in memory: the whole state, or two buckets of it (at most the state's size; and the whole state while
  // a checkpoint or the master weights' reader holds it). The master weights count when they are here.
  std::int64_t bytes() const {
    if (!on_disk()) return memory_.bytes();
    return (slots_ * (cap_[0] + cap_[1]) + static_cast<std::int64_t>(loaded_.size())) * std::int64_t{sizeof(float)};
  }
  std::int64_t disk_bytes() const { return on_disk() ? n_ * slots_ * std::int64_t{sizeof(float)} : 0; }

  // Slot s in memory (s = K: the master weights), for checkpoints and the master's readers: on disk, every slot
  // is read in and stays until the next update writes it out (what is written into it meanwhile is kept).
  span_in<float, Space> slot(int s) {
    if (!on_disk()) return memory_.slot(s);
    return read_in(s);
  }
  // The master weights in memory (holds_master()): read in from the files as slot() does.
  float* master() { return read_in(K).data(); }

  // One update of elements [at, at + a.n) of the state (a.state is ignored; so is a.w when the master weights
  // are here). Every element of the state is updated once between begin_step() and end_step().
  void update(const O& opt, optim::step_args a, std::int64_t at) {
    if (!on_disk()) {
      std::array<float*, (K > 0 ? K : 1)> st{};
      for (int s = 0; s < K; ++s) st[s] = memory_.pointers()[s] + at;
      a.state = st.data();
      return opt.template update<Space>(a);
    }
    const std::int64_t buckets = (a.n + bucket_ - 1) / bucket_;
    auto range = [&](std::int64_t b) { return std::pair{at + b * bucket_, std::min(bucket_, a.n - b * bucket_)}; };
    // Bucket b lives in buf_[b % 2]. The I/O thread runs its jobs in order, so the read of bucket b + 1 queues
    // behind the write of bucket b - 1 (the same buffer) and runs while bucket b updates.
    auto read = [&](std::int64_t b) {
      const auto [lo, count] = range(b);
      return io_->thread.push([this, j = static_cast<int>(b % 2), lo = lo, count = count] {
        io_job([&] { for (int s = 0; s < slots_; ++s) files_[cur_].read_slot(s, lo, count, buf_[j].data() + s * cap_[j]); });
      });
    };
    std::int64_t reading = read(0);
    for (std::int64_t b = 0; b < buckets; ++b) {
      wait_io(reading);
      if (b + 1 < buckets) reading = read(b + 1);
      const auto [lo, count] = range(b);
      float* host_state = buf_[b % 2].data();
      float* state = host_state;
      if constexpr (!std::same_as<Space, host>) {  // staged through host memory
        state = dev_[b % 2].data();
        dml::copy_n(host_state, buf_[b % 2].size(), state);
      }
      std::array<float*, (K > 0 ? K : 1)> st{};
      for (int s = 0; s < K; ++s) st[s] = state + s * cap_[b % 2];
      optim::step_args piece = a;
      piece.n = count;
      piece.w = holds_master() ? state + K * cap_[b % 2] : a.w + (lo - at);
      piece.g.ptr = static_cast<const char*>(a.g.ptr) + (lo - at) * static_cast<std::int64_t>(dtype_size(a.g.type));
      if (a.working)
        piece.working.ptr = static_cast<char*>(a.working.ptr) + (lo - at) * static_cast<std::int64_t>(dtype_size(a.working.type));
      piece.state = st.data();
      opt.template update<Space>(piece);
      if constexpr (!std::same_as<Space, host>) dml::copy_n(state, buf_[b % 2].size(), host_state);
      io_->thread.push([this, j = static_cast<int>(b % 2), lo = lo, count = count] {
        io_job([&] { for (int s = 0; s < slots_; ++s) files_[1 - cur_].write_slot(s, lo, count, buf_[j].data() + s * cap_[j]); });
      });
    }
    written_ += a.n;
  }
  // Around every update of the whole state: checks the current file, and at the end stamps the other one and
  // makes it current. A checkpoint's state in memory is written out first.
  void begin_step() {
    if (!on_disk()) return;
    wait_io();  // a failed step's jobs
    if (loaded_.size() != 0) {
      std::vector<float> tmp(static_cast<std::size_t>(n_));
      for (int k = 0; k < slots_; ++k) {
        dml::copy_n(loaded_.data() + k * n_, tmp.size(), tmp.data());
        files_[1 - cur_].write_slot(k, 0, n_, tmp.data());
      }
      switch_files();
      loaded_ = buffer<float, Space>();
    }
    files_[cur_].check(sequence_);
    written_ = 0;
  }
  void end_step() {
    if (!on_disk()) return;
    wait_io();
    if (written_ != n_)
      fail<error>("dml::parallel::optimizer_state: a step updated ", written_, " of ", n_, " elements of the offloaded state");
    switch_files();
  }

 private:
  // Slot s of the files in memory: every slot is read in at the first call after a step.
  span_in<float, Space> read_in(int s) {
    if (loaded_.size() == 0) {
      loaded_.resize(static_cast<std::size_t>(n_ * slots_));
      files_[cur_].check(sequence_);
      std::vector<float> tmp(static_cast<std::size_t>(n_));
      for (int k = 0; k < slots_; ++k) {
        files_[cur_].read_slot(k, 0, n_, tmp.data());
        dml::copy_n(tmp.data(), tmp.size(), loaded_.data() + k * n_);
      }
    }
    return span_in<float, Space>(loaded_.data() + s * n_, static_cast<std::size_t>(n_));
  }
  // The I/O thread and its first failure: the jobs after it do nothing, and wait_io() rethrows it.
  struct io_thread {
    dml::detail::worker_thread thread;
    std::atomic<bool> failed{false};
    std::exception_ptr error;
  };
  // On the I/O thread: job, unless an earlier one failed.
  template <class F>
  void io_job(F&& job) {
    if (io_->failed.load(std::memory_order_acquire)) return;
    try {
      job();
    } catch (...) {
      io_->error = std::current_exception();
      io_->failed.store(true, std::memory_order_release);
    }
  }
  // Until the job with this ticket has run (0: every job); a failure is rethrown once no job is left.
  void wait_io(std::int64_t ticket = 0) {
    if (ticket > 0) io_->thread.wait(ticket);
    else io_->thread.drain();
    if (!io_->failed.load(std::memory_order_acquire)) return;
    io_->thread.drain();
    io_->failed = false;
    std::rethrow_exception(std::exchange(io_->error, nullptr));
  }
  void switch_files() {
    files_[1 - cur_].stamp(sequence_ + 1);
    ++sequence_;
    cur_ = 1 - cur_;
  }

  optim::state<O, Space> memory_;
  buffer<float, Space> loaded_;  // on disk: every slot, while a checkpoint or the master's reader holds them
  std::string dir_;
  std::int64_t n_ = 0, bucket_ = 0, written_ = 0, sequence_ = 0;
  std::array<std::int64_t, 2> cap_{};  // elements per slot of buf_[0] and buf_[1]
  int cur_ = 0, slots_ = K;  // on disk: K, or K + 1 with the master weights
  detail::state_file files_[2];
  std::vector<float> buf_[2];
  buffer<float, Space> dev_[2];
  std::unique_ptr<io_thread> io_;  // last: joins before the files and buffers its jobs use go
};

}  // namespace dml::parallel
