// SPDX-License-Identifier: Apache-2.0
// Must not compile: 16-bit precision with an optimizer that does not write the working copy.
#include "dml/dml.hpp"
static_assert(sizeof(dml::trainer<dml::precision::bf16, dml::optim::adagrad>) > 0);
int main() {}
