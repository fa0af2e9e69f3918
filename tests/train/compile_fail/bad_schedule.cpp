// SPDX-License-Identifier: Apache-2.0
// Must not compile: a schedule policy without make(stages, micro_batches).
#include "dml/dml.hpp"
struct no_make {
  using policy_family = dml::schedule_family;
  static constexpr const char* name = "no_make";
  static constexpr int virtual_stages = 1;
};
static_assert(sizeof(dml::trainer<no_make>) > 0);
int main() {}
