// SPDX-License-Identifier: Apache-2.0
// Must not compile: a host trainer (host memory) over comm::nccl (device memory).
#include "dml/comm/nccl.hpp"
#include "dml/dml.hpp"

void train(dml::comm::nccl& c) {
  dml::trainer<dml::host> t(c, dml::nn::sequential{dml::nn::linear{4, 2}});
}
