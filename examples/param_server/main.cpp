// SPDX-License-Identifier: Apache-2.0
// examples/param_server/main.cpp — Downpour training with a parameter server on the host.
#include "param_server.hpp"

int main(int argc, char** argv) { return param_server::main(argc, argv); }
