// SPDX-License-Identifier: Apache-2.0
// tests/pch.cpp — the translation unit that builds the precompiled dml.hpp every test reuses.
