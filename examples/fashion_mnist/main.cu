// SPDX-License-Identifier: Apache-2.0
// examples/fashion_mnist/main.cu — the same program with tensors and kernels on a CUDA GPU.
#include "fashion_mnist.hpp"

int main(int argc, char** argv) { return fashion_mnist::main<dml::cuda>(argc, argv); }
