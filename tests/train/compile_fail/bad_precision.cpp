// SPDX-License-Identifier: Apache-2.0
// Must not compile: a precision policy whose working type dml cannot compute in.
#include "dml/dml.hpp"
struct fp64 {
  using policy_family = dml::precision_family;
  using type = double;
  static constexpr bool loss_scaling = false;
  static constexpr const char* name = "fp64";
};
static_assert(sizeof(dml::trainer<fp64>) > 0);
int main() {}
