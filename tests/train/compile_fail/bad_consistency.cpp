// SPDX-License-Identifier: Apache-2.0
// Must not compile: a consistency policy without staleness().
#include "dml/dml.hpp"
#include "dml/ps/downpour.hpp"
struct no_bound {
  using policy_family = dml::ps::consistency_family;
  static constexpr const char* name = "no_bound";
  int pull_every() const { return 1; }
  int push_every() const { return 1; }
};
int main() {
  dml::comm::local::run(2, [](dml::comm::local& c) {
    dml::train::dataset d;
    dml::ps::downpour(c, dml::nn::sequential{dml::nn::linear{4, 2}}, d, d, no_bound{}, {}, {});
  });
}
