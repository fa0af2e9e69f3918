// SPDX-License-Identifier: Apache-2.0
// Must not compile: int is not a policy. The error names the rule and, in its instantiation line, int.
#include "dml/dml.hpp"
static_assert(sizeof(dml::trainer<dml::parallel::replicate, int>) > 0);
int main() {}
