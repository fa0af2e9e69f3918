// SPDX-License-Identifier: Apache-2.0
// dml/ft/elastic.hpp — training that goes on when a member dies: each configuration (epoch) builds a fresh
// communicator and trainer, a member behind the others heals from one at the highest committed step, and every
// step is a transaction the members vote on. Sits on ft/session.hpp and train/trainer.hpp; dml-run hosts the
// coordinator. See DESIGN.md §11.
//
// What holds, whatever dies and when: an update is applied only after every member of the epoch voted for it
// (trainer_options::commit), so the members that commit a step hold the same parameters (the commit log's
// hashes say so); a member that fails, is fenced or dies keeps its last committed state, and one that comes back
// or starts anew receives the state of a member at the quorum's step before it trains. Batches are keyed by the
// step, so after a recovery the step in flight is run again with the same samples: nothing is skipped or seen
// twice. Under data parallelism a member is a replica: it holds the whole model, so any member can heal any other.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/ft/session.hpp"
#include "dml/train/options.hpp"

namespace dml::ft {

struct elastic_options {
  std::int64_t steps = 0;   // the job ends when this many steps have committed
  std::string commit_log;   // a file to append "step epoch size hash" to after each commit (empty: none)
  std::ostream* log = nullptr;  // one line per configuration and per failure
};

struct elastic_result {
  std::int64_t steps = 0;            // committed steps at the end
  std::int64_t configurations = 0;   // epochs this member trained in
  std::int64_t healed = 0;           // times it received state from a peer
  std::int64_t failed_steps = 0;     // step attempts that did not commit here
  std::vector<float> losses;         // the loss of each step this member committed, by step (0 where it was absent)
  std::uint64_t hash = 0;            // of the final state (parameters and optimizer state)
  int rank = -1;                     // this member's rank in its last configuration
  double seconds = 0;                // from its first step (its trainer built and healed) to its last commit
  std::optional<train::state_snapshot> state;  // the final committed state
};

// FNV-1a over the bytes of the parameters: equal on every member after every commit.
inline std::uint64_t parameter_hash(std::span<const float> p) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* b = reinterpret_cast<const unsigned char*>(p.data());
  for (std::size_t i = 0; i < p.size_bytes(); ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

namespace detail {
// A snapshot over a communicator: six numbers, then the values.
template <class C>
void send_state(C& c, const train::state_snapshot& s, int to) {
  std::int64_t head[6] = {s.step, s.optimizer_step, static_cast<std::int64_t>(s.seed), s.growth_tracker,
                          static_cast<std::int64_t>(s.values.size()), 0};
  std::memcpy(&head[5], &s.loss_scale, sizeof s.loss_scale);
  c.send(std::span<const std::int64_t>(head), to, 71);
  c.send(std::span<const float>(s.values), to, 72);
}
template <class C>
train::state_snapshot receive_state(C& c, int from) {
  std::int64_t head[6] = {};
  c.recv(std::span<std::int64_t>(head), from, 71);
  train::state_snapshot s{.step = head[0], .optimizer_step = head[1], .seed = static_cast<std::uint64_t>(head[2]),
                          .growth_tracker = head[3], .values = {}};
  std::memcpy(&s.loss_scale, &head[5], sizeof s.loss_scale);
  if (head[4] < 0 || head[4] > (std::int64_t{1} << 40))
    fail<format_error>("dml::ft: a peer's state announces ", head[4], " values");
  s.values.resize(static_cast<std::size_t>(head[4]));
  c.recv(std::span<float>(s.values), from, 72);
  return s;
}
}  // namespace detail

// Trains until `o.steps` steps have committed, through deaths, freezes and restarts of members.
//   make_comm(const quorum&) -> std::unique_ptr<Comm>: the epoch's communicator (collective over its members);
//   make_trainer(Comm&, std::function<bool()> commit) -> std::unique_ptr<Trainer>: a trainer whose
//     trainer_options::commit is `commit`;
//   run_step(Trainer&, Comm&, std::int64_t step, const quorum&) -> train::step_result: step `step` (from 0),
//     on this member's share of the step's samples (rank q.rank of q.size()).
template <class MakeComm, class MakeTrainer, class RunStep>
elastic_result train_elastic(session& s, MakeComm make_comm, MakeTrainer make_trainer, RunStep run_step,
                             const elastic_options& o) {
  using comm_ptr = decltype(make_comm(std::declval<const quorum&>()));
  using trainer_ptr = decltype(make_trainer(*std::declval<comm_ptr&>(), std::declval<std::function<bool()>>()));
  elastic_result out;
  out.losses.assign(static_cast<std::size_t>(o.steps), 0.f);
  std::optional<train::state_snapshot> committed_state;  // what this member last committed
  std::int64_t committed = 0;
  std::ofstream commits;
  if (!o.commit_log.empty()) {
    commits.open(o.commit_log, std::ios::app);
    if (!commits) fail<io_error>("dml::ft: cannot append to the commit log ", o.commit_log);
  }
  auto say = [&](const std::string& line) {
    if (o.log) *o.log << "slot " << s.options().slot << ": " << line << std::endl;
  };
  std::optional<clock::time_point> began;
  while (committed < o.steps) {
    const quorum q = s.join(committed);
    if (q.finished) break;
    ++out.configurations;
    out.rank = q.rank;
    say(dml::detail::cat("epoch ", q.epoch, ": rank ", q.rank, " of ", q.size(), ", step ", q.step,
                         q.behind(q.rank) ? dml::detail::cat(" (behind at ", committed, ": healing from rank ", q.source(), ")") : ""));
    bool reconfigure = false, holds_committed = false;
    std::int64_t at = committed;
    // The trainer refers to the communicator: it goes first.
    comm_ptr comm;
    trainer_ptr t;
    try {
      comm = make_comm(q);
      auto vote = [&] {
        const verdict v = s.vote(q.epoch, at + 1, true);
        reconfigure = v == verdict::commit_and_reconfigure;
        return v == verdict::commit || v == verdict::commit_and_reconfigure;
      };
      t = make_trainer(*comm, vote);
      if (q.behind(q.rank)) {
        t->restore(detail::receive_state(*comm, q.source()));
        ++out.healed;
      } else if (committed_state) {
        t->restore(*committed_state);
      }
      if (q.rank == q.source()) {
        const auto mine = t->snapshot();
        for (int r = 0; r < q.size(); ++r)
          if (q.behind(r)) detail::send_state(*comm, mine, r);
      }
      at = q.step;
      holds_committed = true;
      if (!began) began = clock::now();
      while (at < o.steps && !reconfigure) {
        const auto r = run_step(*t, *comm, at, q);
        if (!r.committed) {
          ++out.failed_steps;
          say(dml::detail::cat("step ", at + 1, " was not committed (epoch ", q.epoch, ")"));
          break;
        }
        out.losses[static_cast<std::size_t>(at)] = r.loss;
        ++at;
        if (commits) {
          const auto p = t->full_parameters();
          commits << at << ' ' << q.epoch << ' ' << q.size() << ' ' << parameter_hash(p) << std::endl;
        }
      }
    } catch (const comm_error& e) {
      ++out.failed_steps;
      say(dml::detail::cat("epoch ", q.epoch, " failed at step ", at + 1, ": ", e.what()));
    }
    // Keep what was committed: the trainer's state, unless it never received it (a failure while healing).
    if (t && holds_committed) {
      committed_state = t->snapshot();
      committed = at;
    }
    t.reset();
    comm.reset();
  }
  if (began) out.seconds = std::chrono::duration<double>(clock::now() - *began).count();
  if (committed >= o.steps) s.done();
  out.steps = committed;
  if (committed_state) out.hash = parameter_hash(committed_state->values);
  out.state = std::move(committed_state);
  return out;
}

}  // namespace dml::ft
