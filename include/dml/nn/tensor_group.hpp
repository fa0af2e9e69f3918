// SPDX-License-Identifier: Apache-2.0
// dml/nn/tensor_group.hpp — forwarding header, kept for one release: nn::tensor_group is nn::rank_group
// (it serves the tensor, expert, context and data groups alike).
#pragma once

#include "dml/nn/rank_group.hpp"

namespace dml::nn {
using tensor_group [[deprecated("dml: nn::tensor_group is nn::rank_group")]] = rank_group;
}  // namespace dml::nn
