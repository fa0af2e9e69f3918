// SPDX-License-Identifier: Apache-2.0
// tests/nn/static_shapes_mismatch.cpp — must NOT compile: 256 outputs feed a layer that takes 128.
#include "dml/nn/activation.hpp"
#include "dml/nn/linear.hpp"
#include "dml/nn/sequential.hpp"

int main() {
  auto model = dml::nn::sequential{dml::nn::linear<784, 256>{}, dml::nn::relu{}, dml::nn::linear<128, 10>{}};
  return static_cast<int>(model.size);
}
