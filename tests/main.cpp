// SPDX-License-Identifier: Apache-2.0
// tests/main.cpp — the doctest runner shared by every test binary. A binary in which a test case called
// dml_test::skip (tests/skip.hpp) and none failed exits 77: ctest's SKIP_RETURN_CODE, reported as skipped.
// A run whose filters select no test case fails: a test binary holds several files' cases, and each ctest entry
// picks its own by file and name (tests/CMakeLists.txt), so a filter that matches nothing must not pass.
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

// Counts the test cases that passed the filters of a run.
unsigned selected = 0;
struct count_selected : doctest::IReporter {
  explicit count_selected(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& s) override { selected = s.numTestCasesPassingFilters; }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("dml_count_selected", 1, count_selected);
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
  if (selected == 0) {
    std::printf("no test case passed the filters given: expected at least one\n");
    return 1;
  }
  if (!skipped.empty()) {
    std::printf("%zu test case%s skipped (exit 77)\n", skipped.size(), skipped.size() == 1 ? "" : "s");
    return 77;
  }
  return 0;
}
