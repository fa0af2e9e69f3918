// SPDX-License-Identifier: Apache-2.0
// tests/fuzz/fuzz_check.hpp — what the libFuzzer harnesses share: an invariant check that
// aborts (so libFuzzer records the input) with a message, unlike assert, in every build type.
#pragma once

#include <cstdio>
#include <cstdlib>

#define DML_FUZZ_CHECK(cond)                                                                  \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      std::fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, #cond);      \
      std::abort();                                                                           \
    }                                                                                         \
  } while (false)
