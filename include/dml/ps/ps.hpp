// SPDX-License-Identifier: Apache-2.0
// dml/ps/ps.hpp — the parameter server, in the shape of ps-lite's (Li et al., OSDI 2014), over any
// communicator's tagged send/recv: servers hold key ranges (keys.hpp), apply workers' pushes with a server-side
// optimizer, answer pulls under a consistency bound enforced by vector clocks (consistency.hpp), filter both
// directions with error feedback (comm/compression.hpp), and chain-replicate every range so a server's loss
// loses no acknowledged update.
// Sits on comm/ and optim/; used by programs that run a parameter server, and by parallel/param_server.hpp
// (the old names). ps/downpour.hpp, which trains a model with it, needs nn/ and is included on its own.
//
// Ranks [0, servers) serve; the rest are workers (split.hpp gives each side a group of its own). Every node
// is one thread of control that polls: a worker makes progress inside push/pull/wait (worker.hpp), a server
// inside serve() (server.hpp). Liveness is by silence: a peer that owes a reply and has said nothing for
// `timeout` (pings go out every timeout/4 while waiting) is dead to the one waiting; dead servers' ranges fail
// over to the next live server of their chain, dead workers leave the clocks. Nothing ever blocks on a peer
// without a deadline (transport.hpp), so a lost peer cannot hang the others.
#pragma once

#include "dml/ps/consistency.hpp"
#include "dml/ps/keys.hpp"
#include "dml/ps/server.hpp"
#include "dml/ps/split.hpp"
#include "dml/ps/transport.hpp"
#include "dml/ps/worker.hpp"
