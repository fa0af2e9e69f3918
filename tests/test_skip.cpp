// SPDX-License-Identifier: Apache-2.0
// tests/test_skip.cpp — the skip path itself (tests/skip.hpp, tests/main.cpp): a binary whose test case skipped and
// none failed exits 77 with the reason printed; run through expect_output.cmake, which asks for exactly that.
#include <doctest/doctest.h>

#include "skip.hpp"

TEST_CASE("a test case that cannot run here skips, and says why") {
  CHECK(1 + 1 == 2);
  dml_test::skip("this case always skips: it tests the skip path");
}
