// SPDX-License-Identifier: Apache-2.0
// Must not compile: a std::span over host memory handed to comm::nccl's point-to-point.
#include <span>

#include "dml/comm/nccl.hpp"

dml::comm::request pass(dml::comm::nccl& c, std::span<const float> host) { return c.isend(host, 1, 0); }
