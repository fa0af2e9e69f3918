// SPDX-License-Identifier: Apache-2.0
// dml/parallel/param_server.hpp — the parameter server under its old names: dml::parallel::ps::*, and
// dml::parallel::{server_split, split_servers}, which lived in parallel/mesh.hpp.
// Sits on ps/ps.hpp; used by code written against the old names.
// Forwarding header, kept for one release: include dml/ps/ps.hpp instead (names in dml::ps).
#pragma once

#include "dml/parallel/consistency.hpp"
#include "dml/parallel/ps_keys.hpp"
#include "dml/ps/ps.hpp"

namespace dml::parallel {
namespace ps = ::dml::ps;
using ::dml::ps::server_split;
using ::dml::ps::split_servers;
}  // namespace dml::parallel
