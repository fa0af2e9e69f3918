// SPDX-License-Identifier: Apache-2.0
// tests/nn/gpt_heads_mismatch.cpp — must not compile: 6 heads do not split over 4 tensor-parallel ranks.
#include "dml/nn/gpt.hpp"

constexpr dml::nn::gpt_config cfg{.vocab = 256, .layers = 6, .d_model = 384, .heads = 6};
static_assert(dml::nn::check_tensor_parallel<cfg, 2>());  // fits
static_assert(dml::nn::check_tensor_parallel<cfg, 4>());  // does not

int main() {}
