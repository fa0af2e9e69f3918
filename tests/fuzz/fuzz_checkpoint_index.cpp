// SPDX-License-Identifier: Apache-2.0
// tests/fuzz/fuzz_checkpoint_index.cpp — libFuzzer harness for dml::train::parse_checkpoint_index
// (a step directory's index.json) on text in memory; what it accepts is written back and read
// again. dml::error is the expected answer to bad input; any other exception, crash or sanitizer
// report is a finding.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

#include "dml/core/error.hpp"
#include "dml/train/checkpoint.hpp"
#include "fuzz_check.hpp"

namespace dt = dml::train;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  // A step directory that does not exist: check_files must fail cleanly, never touch a file.
  const std::filesystem::path path = "/nonexistent/dml-fuzz/step-00000001/index.json";
  dt::checkpoint_index x;
  try {
    x = dt::parse_checkpoint_index(text, path);
  } catch (const dml::error&) {
    return 0;
  }
  for (const auto& p : x.info.model) DML_FUZZ_CHECK(p.numel() >= 0);
  // An accepted index survives a round trip through the writer's JSON unchanged.
  const auto again = dt::parse_checkpoint_index(dt::detail::to_json(x).dump(1), path);
  DML_FUZZ_CHECK(again.info.step == x.info.step && again.info.seed == x.info.seed);
  DML_FUZZ_CHECK(again.info.model.size() == x.info.model.size() && again.files.size() == x.files.size());
  DML_FUZZ_CHECK(again.info.user == x.info.user && again.info.state_slots == x.info.state_slots);
  dt::detail::check_matches(path, again.info, x.info);
  try {
    dt::detail::check_files(path, x);
    DML_FUZZ_CHECK(x.files.empty());  // any listed file is missing from a directory that does not exist
  } catch (const dml::error&) {
  }
  return 0;
}
