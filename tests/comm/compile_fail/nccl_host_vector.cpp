// SPDX-License-Identifier: Apache-2.0
// Must not compile: a std::vector (host memory) handed to comm::nccl.
#include <vector>

#include "dml/comm/nccl.hpp"

void sum(dml::comm::nccl& c, std::vector<float>& host) { c.all_reduce(host, dml::comm::reduce_op::sum); }
