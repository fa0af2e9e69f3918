// SPDX-License-Identifier: Apache-2.0
// Must not compile: an optimizer without default_lr().
#include "dml/dml.hpp"
struct no_lr {
  using policy_family = dml::optim::optimizer_family;
  static constexpr const char* name = "no_lr";
  static constexpr int state_slots = 0;
  template <dml::execution_space S>
  void update(const dml::optim::step_args&) const {}
};
static_assert(sizeof(dml::trainer<no_lr>) > 0);
int main() {}
