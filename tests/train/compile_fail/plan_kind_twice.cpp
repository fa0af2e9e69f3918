// SPDX-License-Identifier: Apache-2.0
// Must not compile: a plan that names one kind of parallelism twice.
#include "dml/dml.hpp"
namespace pl = dml::parallel;
static_assert(sizeof(dml::trainer<pl::plan<pl::data<>, pl::pipe<>, pl::data<pl::zero<1>>>>) > 0);
int main() {}
