// SPDX-License-Identifier: Apache-2.0
// examples/fashion_mnist/local_engines.cpp — the comm::local trainers of the example (fashion_mnist.hpp,
// run_engines), in every precision; main.cpp dispatches to them.
#include "fashion_mnist.hpp"

namespace fashion_mnist {
DML_FASHION_MNIST_LOCAL_ENGINES(, dml::precision::fp32);
DML_FASHION_MNIST_LOCAL_ENGINES(, dml::precision::bf16);
DML_FASHION_MNIST_LOCAL_ENGINES(, dml::precision::fp16);
}  // namespace fashion_mnist
