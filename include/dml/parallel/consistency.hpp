// SPDX-License-Identifier: Apache-2.0
// dml/parallel/consistency.hpp — the consistency policy family under its old names: dml::consistency::*
// (bsp, ssp, async, any, parse, to_string, unbounded, dynamic_staleness), dml::consistency_family and the
// concepts dml::consistency_policy, dml::diagnose_consistency and their parts.
// Sits on ps/consistency.hpp; used by dml.hpp and code written against the old names.
// Forwarding header, kept for one release: include dml/ps/consistency.hpp instead (names in dml::ps).
#pragma once

#include "dml/ps/consistency.hpp"

namespace dml {
namespace consistency = ps::consistency;
using ps::consistency_family;
using ps::consistency_policy;
using ps::diagnose_consistency;
using ps::has_cadence;
using ps::has_consistency_name;
using ps::has_staleness;
using ps::in_consistency_family;
}  // namespace dml
