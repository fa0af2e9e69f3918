// SPDX-License-Identifier: Apache-2.0
// Must not compile: a plan, and a sharding beside it (the plan names the sharding in data<S>).
#include "dml/dml.hpp"
namespace pl = dml::parallel;
static_assert(sizeof(dml::trainer<pl::plan<pl::data<>>, pl::zero<2>>) > 0);
int main() {}
