// SPDX-License-Identifier: Apache-2.0
// tests/main.cpp — the doctest runner shared by every test binary. A binary in which a test case called
// dml_test::skip (tests/skip.hpp) and none failed exits 77: ctest's SKIP_RETURN_CODE, reported as skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "skip.hpp"

namespace {
std::mutex skipped_mutex;
std::vector<std::string> skipped;
}  // namespace

void dml_test::skip(const std::string& why) {
  const std::lock_guard lock(skipped_mutex);
  std::printf("SKIPPED: %s\n", why.c_str());
  std::fflush(stdout);
  skipped.push_back(why);
}

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int failed = context.run();
  if (context.shouldExit() || failed != 0) return failed;
  if (!skipped.empty()) {
    std::printf("%zu test case%s skipped (exit 77)\n", skipped.size(), skipped.size() == 1 ? "" : "s");
    return 77;
  }
  return 0;
}
