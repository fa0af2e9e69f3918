// SPDX-License-Identifier: Apache-2.0
// dml/train/progress.hpp — a progress bar on a terminal, plain lines elsewhere (logs, CI, pipes).
// Sits on the standard library; examples and the trainer report through it.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace dml::train {

class progress {
 public:
  // every: in plain mode, print one line every this many steps (and at the end).
  progress(std::string label, std::int64_t total, std::int64_t every = 100, std::FILE* out = stdout)
      : label_(std::move(label)), total_(total), every_(every > 0 ? every : 1), out_(out),
        tty_(::isatty(::fileno(out)) == 1), start_(clock::now()) {}

  void update(std::int64_t done, double loss, std::int64_t samples) {
    samples_ += samples;
    const double secs = std::chrono::duration<double>(clock::now() - start_).count();
    const double rate = secs > 0 ? static_cast<double>(samples_) / secs : 0.0;
    if (tty_) {
      const int width = 30;
      const int filled = total_ > 0 ? static_cast<int>(width * done / total_) : width;
      std::string bar(static_cast<std::size_t>(filled), '#');
      bar.resize(width, '.');
      std::fprintf(out_, "\r%s [%s] %lld/%lld loss=%.4f %.0f samples/s", label_.c_str(), bar.c_str(),
                   static_cast<long long>(done), static_cast<long long>(total_), loss, rate);
      if (done == total_) std::fputc('\n', out_);
    } else if (done % every_ == 0 || done == total_) {
      std::fprintf(out_, "%s step %lld/%lld loss=%.4f samples_per_s=%.0f\n", label_.c_str(),
                   static_cast<long long>(done), static_cast<long long>(total_), loss, rate);
    }
    std::fflush(out_);
  }
  // Seconds since construction.
  double elapsed() const { return std::chrono::duration<double>(clock::now() - start_).count(); }

 private:
  using clock = std::chrono::steady_clock;
  std::string label_;
  std::int64_t total_, every_;
  std::FILE* out_;
  bool tty_;
  clock::time_point start_;
  std::int64_t samples_ = 0;
};

}  // namespace dml::train
