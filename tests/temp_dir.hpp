// SPDX-License-Identifier: Apache-2.0
// tests/temp_dir.hpp — a fresh directory under the system's temp folder, removed with everything in it.
// Shared by the tests that write files (IDX, safetensors, checkpoints, the trainer).
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <system_error>

namespace dml_test {

struct temp_dir {
  std::filesystem::path path;
  explicit temp_dir(const std::string& tag = "dml-test") {
    static std::atomic<int> counter{0};
    path = std::filesystem::temp_directory_path() /
           (tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ignore;
    std::filesystem::remove_all(path, ignore);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  std::filesystem::path operator/(const std::string& name) const { return path / name; }
};

}  // namespace dml_test
