// SPDX-License-Identifier: Apache-2.0
// Must not compile: a sharding whose sync lacks the sync_checkpoint part of dml::parallel::sharding_sync.
#define DROP_CHECKPOINT
#include "sync_parts.hpp"
int main() {}
