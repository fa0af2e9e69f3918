// SPDX-License-Identifier: Apache-2.0
// examples/gpt/main.cpp — train a byte-level GPT or Llama on a text file on the host.
#include "train_gpt.hpp"
#include "train_llama.hpp"

int main(int argc, char** argv) { return gpt_example::main(argc, argv); }
