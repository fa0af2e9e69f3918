// SPDX-License-Identifier: Apache-2.0
// tests/fuzz/fuzz_idx.cpp — libFuzzer harness for dml::train::read_idx on bytes in memory
// (raw IDX, or gzip when the input opens with 1f 8b). dml::error is the expected answer to bad
// input; any other exception, crash or sanitizer report is a finding.
#include <cstddef>
#include <cstdint>
#include <span>

#include "dml/core/error.hpp"
#include "dml/train/idx.hpp"
#include "fuzz_check.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto a = dml::train::read_idx(std::span<const std::uint8_t>(data, size), "fuzz.idx");
    // What a reader may rely on: dimensions that fit and a payload of exactly numel bytes.
    DML_FUZZ_CHECK(!a.dims.empty());
    for (auto d : a.dims) DML_FUZZ_CHECK(d >= 0);
    DML_FUZZ_CHECK(a.numel() == static_cast<std::int64_t>(a.data.size()));
  } catch (const dml::error&) {
  }
  return 0;
}
