// SPDX-License-Identifier: Apache-2.0
// Must not compile: a sharding policy that does not say what it shards.
#include "dml/dml.hpp"
struct half_sharding {
  using policy_family = dml::sharding_family;
  static constexpr const char* name = "half";
};
static_assert(sizeof(dml::trainer<half_sharding>) > 0);
int main() {}
