// SPDX-License-Identifier: Apache-2.0
// dml/parallel/ps_keys.hpp — the parameter server's key space under its old names (dml::parallel::ps::key,
// key_range, key_table, ring).
// Sits on ps/keys.hpp; used by code written against the old names.
// Forwarding header, kept for one release: include dml/ps/keys.hpp instead (names in dml::ps).
#pragma once

#include "dml/ps/keys.hpp"

namespace dml::parallel {
namespace ps = ::dml::ps;
}  // namespace dml::parallel
