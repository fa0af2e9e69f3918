// SPDX-License-Identifier: Apache-2.0
// dml/ps/split.hpp — a parameter server's split of a world into server ranks and worker ranks.
// Sits on comm/communicator.hpp; used by programs that give servers and workers a group each (ps/ps.hpp
// and dml.hpp include it).
#pragma once

#include <utility>

#include "dml/comm/communicator.hpp"
#include "dml/core/error.hpp"

namespace dml::ps {

// A parameter server's split of a world: ranks [0, servers) serve, the others are workers. `side` is the
// group of this rank's kind (all servers, or all workers), ordered by world rank. Collective over world.
template <comm::communicator Comm>
struct server_split {
  Comm side;
  bool serves = false;
  int servers = 0, workers = 0;
  int index = 0;  // this rank among its side
};

template <comm::communicator Comm>
server_split<Comm> split_servers(Comm& world, int servers) {
  if (servers < 1 || servers >= world.size())
    fail<invalid_argument>("dml::ps::split_servers: expected 1 <= servers < ", world.size(),
                           " (the world's ranks; at least one must be a worker), found ", servers);
  const bool serves = world.rank() < servers;
  Comm side = world.split(serves ? 0 : 1, world.rank());
  const int index = side.rank();
  return {std::move(side), serves, servers, world.size() - servers, index};
}

}  // namespace dml::ps
