// SPDX-License-Identifier: Apache-2.0
// tests/fuzz/fuzz_flags.cpp — libFuzzer harness for dml::flags (train/flags.hpp): the input split into argv words
// at NUL bytes and newlines, parsed against a table with every kind of flag, then the usage text built.
// dml::invalid_argument is the expected answer to a bad command line; any other exception, crash or sanitizer
// report is a finding, and so is an accepted value that breaks its flag's declared rule or a one-line message
// with a newline in it.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dml/core/error.hpp"
#include "dml/train/flags.hpp"
#include "fuzz_check.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> words{"fuzz"};
  std::string word;
  for (std::size_t i = 0; i < size; ++i) {
    const char c = static_cast<char>(data[i]);
    if (c == '\0' || c == '\n') {
      words.push_back(word);
      word.clear();
    } else {
      word.push_back(c);
    }
  }
  if (size) words.push_back(word);
  std::vector<const char*> argv;
  for (const auto& w : words) argv.push_back(w.c_str());

  std::int64_t steps = 10;
  int ranks = 1, count = 0;
  std::uint64_t seed = 1;
  std::uint8_t small = 3;
  std::int16_t offset = -1;
  float lr = 0.1f;
  double holdout = 0.1;
  std::string precision = "fp32", text, dir;
  std::optional<float> temperature;
  std::optional<std::int64_t> every;
  std::vector<std::int64_t> hidden{256};
  std::vector<double> skews;
  std::int64_t heads = 4;
  bool bias = false, shuffle = true;

  dml::flags f("fuzz", "preamble", "epilogue");
  f.add("--steps", steps, "N", "steps").min(0);
  f.add("--ranks", ranks, "N", "ranks").min(1).max(64);
  f.add("--seed", seed, "N", "seed");
  f.add("--small", small, "N", "a byte");
  f.add("--offset", offset, "N", "a short").max(100);
  f.add("--lr", lr, "X", "learning rate").min(0.f);
  f.add("--holdout", holdout, "X", "fraction").min(0.0).max(0.5);
  f.add("--precision", precision, "P", "precision").choices({"fp32", "bf16", "fp16"});
  f.add("--text", text, "FILE", "text");
  f.add("--temperature", temperature, "X", "temperature").min(0.f);
  f.add("--every", every, "N", "every").min(1);
  f.add("--hidden", hidden, "W,W", "widths").min(1).max(1 << 20);
  f.add("--skew", skews, "S,S", "skews").max(1.0);
  f.add("--heads", heads, "N", "heads").check([](std::int64_t h) { return h % 2 ? "an even number" : ""; }, "even");
  f.add_switch("--bias", bias, "bias");
  f.add_switch("--no-shuffle", shuffle, "order", false);
  f.positional("COUNT", count, "a count").min(0);
  f.positional("DIR", dir, "a directory");
  try {
    (void)f.parse(static_cast<int>(argv.size()), argv.data());
    // What an accepted command line promises.
    DML_FUZZ_CHECK(steps >= 0 && ranks >= 1 && ranks <= 64 && offset <= 100 && count >= 0);
    DML_FUZZ_CHECK(std::isfinite(lr) && lr >= 0.f && std::isfinite(holdout) && holdout >= 0.0 && holdout <= 0.5);
    DML_FUZZ_CHECK(precision == "fp32" || precision == "bf16" || precision == "fp16");
    DML_FUZZ_CHECK(!temperature || (std::isfinite(*temperature) && *temperature >= 0.f));
    DML_FUZZ_CHECK(!every || *every >= 1);
    for (auto h : hidden) DML_FUZZ_CHECK(h >= 1 && h <= (1 << 20));
    for (auto s : skews) DML_FUZZ_CHECK(std::isfinite(s) && s <= 1.0);
    DML_FUZZ_CHECK(heads % 2 == 0);
  } catch (const dml::invalid_argument& e) {
    // One line, whatever the input: a newline can only come from the input's words, and they split at newlines.
    DML_FUZZ_CHECK(std::string(e.what()).find('\n') == std::string::npos);
  }
  DML_FUZZ_CHECK(!f.usage().empty());
  return 0;
}
