// SPDX-License-Identifier: Apache-2.0
// Must not compile: a plan that names tensor parallelism for a model with no tensor-parallel layer.
#include "dml/dml.hpp"
#include "dml/comm/local.hpp"
namespace pl = dml::parallel;
int main() {
  auto mlp = dml::nn::sequential(dml::nn::linear(4, 8), dml::nn::relu(), dml::nn::linear(8, 2));
  dml::comm::local::run(1, [&](dml::comm::local& c) {
    dml::trainer<pl::plan<pl::data<>, pl::tensor<>>> t(c, mlp);
  });
}
