// SPDX-License-Identifier: Apache-2.0
// The control of the nccl_host_* programs: the same calls with device memory, and host data through the
// staged forms, compile.
#include <span>
#include <vector>

#include "dml/comm/nccl.hpp"

void sum(dml::comm::nccl& c, dml::device_span<float> device, std::vector<float>& host) {
  c.all_reduce(device, dml::comm::reduce_op::sum);
  auto r = c.isend(dml::device_span<const float>(device), 1, 0);
  auto both = dml::comm::isendrecv(c, dml::device_span<const float>(device), 1, device, 1, 0);
  dml::comm::all_reduce_host(c, std::span<float>(host), dml::comm::reduce_op::sum);
}
static_assert(dml::comm::communicator<dml::comm::nccl>);
static_assert(!dml::comm::moves_host_memory<dml::comm::nccl>);

int main() {}
