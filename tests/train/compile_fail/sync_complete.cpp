// SPDX-License-Identifier: Apache-2.0
// Must compile: the sync of sync_parts.hpp with every part (the control for the sync_no_<part> tests).
#include "sync_parts.hpp"
int main() {}
