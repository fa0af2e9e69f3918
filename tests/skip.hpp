// SPDX-License-Identifier: Apache-2.0
// tests/skip.hpp — a test case that cannot run here (its data or its processes are missing) says so: it prints
// `SKIPPED: <why>`, and the binary, if nothing failed, exits 77, which ctest reports as skipped (every test's
// SKIP_RETURN_CODE), never as passed. scripts/test names the skipped tests and fails when a test that should
// run on this machine was skipped.
#pragma once

#include <string>

namespace dml_test {
// Records why the calling test case does not run; the caller returns right after.
void skip(const std::string& why);
}  // namespace dml_test
