// SPDX-License-Identifier: Apache-2.0
// Must not compile: two sharding policies.
#include "dml/dml.hpp"
static_assert(sizeof(dml::trainer<dml::parallel::zero<2>, dml::optim::sgd, dml::parallel::replicate>) > 0);
int main() {}
