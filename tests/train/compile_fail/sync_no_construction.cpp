// SPDX-License-Identifier: Apache-2.0
// Must not compile: a sharding whose sync lacks the sync_construction part of dml::parallel::sharding_sync.
#define DROP_CONSTRUCTION
#include "sync_parts.hpp"
int main() {}
