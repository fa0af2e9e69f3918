// SPDX-License-Identifier: Apache-2.0
// dml/train/downpour.hpp — Downpour training with a parameter server under its old names:
// dml::train::{downpour, downpour_options, downpour_result, key_lengths, accuracy} and dml::train::ps.
// Sits on ps/downpour.hpp; used by code written against the old names.
// Forwarding header, kept for one release: include dml/ps/downpour.hpp instead (names in dml::ps).
#pragma once

#include "dml/parallel/consistency.hpp"
#include "dml/parallel/param_server.hpp"
#include "dml/ps/downpour.hpp"

namespace dml::train {
namespace ps = ::dml::ps;
using ::dml::ps::accuracy;
using ::dml::ps::downpour;
using ::dml::ps::downpour_options;
using ::dml::ps::downpour_result;
using ::dml::ps::key_lengths;
}  // namespace dml::train
