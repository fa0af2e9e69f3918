// SPDX-License-Identifier: Apache-2.0
// Must not compile: a sharding whose sync lacks the sync_setup part of dml::parallel::sharding_sync.
#define DROP_SETUP
#include "sync_parts.hpp"
int main() {}
