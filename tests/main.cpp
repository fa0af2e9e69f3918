// SPDX-License-Identifier: Apache-2.0
// tests/main.cpp — the doctest runner shared by every test binary.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
