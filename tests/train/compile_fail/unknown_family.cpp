// SPDX-License-Identifier: Apache-2.0
// Must not compile: a policy of a family the trainer does not know.
#include "dml/dml.hpp"
struct my_family {};
struct stranger {
  using policy_family = my_family;
};
static_assert(sizeof(dml::trainer<stranger>) > 0);
int main() {}
