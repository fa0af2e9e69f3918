// SPDX-License-Identifier: Apache-2.0
// examples/fashion_mnist/main.cpp — train an MLP on Fashion-MNIST on the host.
#include "fashion_mnist.hpp"

int main(int argc, char** argv) { return fashion_mnist::main<dml::host>(argc, argv); }
