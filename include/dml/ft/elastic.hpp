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
//
// train_restarting is the same loop for layouts where no member holds the whole model (ZeRO, pipelines): after
// each step every member exports its pieces (train::state_pieces) and hands a copy to the next member (its
// buddy; with elastic_options::copies = K, the K next members) before it votes, so a committed step survives any
// K deaths, in memory. A new configuration, of any
// size, gathers the pieces of the quorum's step from whoever holds them and restores them into its own layout.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/ft/session.hpp"
#include "dml/nn/param_layout.hpp"
#include "dml/train/checkpoint_io.hpp"
#include "dml/train/options.hpp"

namespace dml::ft {

struct elastic_result;

struct elastic_options {
  std::int64_t steps = 0;   // the job ends when this many steps have committed
  std::string commit_log;   // a file to append "step epoch size hash" to after each commit (empty: none)
  std::ostream* log = nullptr;  // one line per configuration and per failure
  int copies = 1;  // train_restarting: the members after each that hold a copy of its pieces (deaths survived at once)
  // train_restarting: vote and copy every this many steps. The steps between are tentative: a failure runs the
  // steps since the last commit again (up to this many lost), for 1/commit_every of the copying.
  std::int64_t commit_every = 1;
  // Called on the one member chosen to report the final state (the example scores it) with its result, whole;
  // the other members that hold the state wait until it returns, and one of them is chosen if it dies first.
  // Empty: the program reports nothing, and no member waits.
  std::function<void(const elastic_result&)> report{};
};

struct elastic_result {
  std::int64_t steps = 0;            // committed steps at the end
  std::int64_t configurations = 0;   // epochs this member trained in
  std::int64_t healed = 0;           // times it received state from a peer
  std::int64_t failed_steps = 0;     // step attempts that did not commit here
  std::vector<float> losses;         // the loss of each step this member committed, by step (0 where it was absent)
  std::uint64_t hash = 0;            // of the final parameters (as the commit log's last line)
  int rank = -1;                     // this member's rank in its last configuration
  bool reports = false;              // the coordinator chose it to report the final state (the example scores it):
                                     // the first member to say DONE holding it (parameters or pieces)
  double seconds = 0;  // from its first step (trainer built and healed) to the end of its last step (the final
                       // snapshot or gathering and the teardown are not counted)
  std::optional<train::state_snapshot> state;  // the final committed state (train_elastic): this rank's part
  std::vector<float> parameters;               // the final parameters, whole and packed (train_elastic)
  std::vector<train::state_pieces> pieces;     // the final committed state, every piece (train_restarting)
};

// One line for a member's end: "slot=S steps=N configurations=C healed=H failed_steps=F seconds=T final_loss=L
// state_hash=X" (what tests/ft/chaos.py reads).
inline std::string summary_line(const elastic_result& r, int slot) {
  char line[320];
  std::snprintf(line, sizeof line,
                "slot=%d steps=%lld configurations=%lld healed=%lld failed_steps=%lld seconds=%.3f final_loss=%.6f "
                "state_hash=%016llx",
                slot, static_cast<long long>(r.steps), static_cast<long long>(r.configurations),
                static_cast<long long>(r.healed), static_cast<long long>(r.failed_steps), r.seconds,
                static_cast<double>(r.losses.empty() ? 0.f : r.losses.back()), static_cast<unsigned long long>(r.hash));
  return line;
}

// FNV-1a over the bytes of the parameters: equal on every member after every commit.
inline std::uint64_t parameter_hash(std::span<const float> p) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* b = reinterpret_cast<const unsigned char*>(p.data());
  for (std::size_t i = 0; i < p.size_bytes(); ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

// The whole model's parameters without padding (nn::pack): the same values in every layout. Collective.
template <class Trainer>
std::vector<float> packed_parameters(Trainer& t) {
  return nn::pack(t.layout(), t.full_parameters());
}

namespace detail {
// The member committed the last step (or the job finished without it): it says so, and reports the final state if
// it is the one chosen (then says it has, letting the other holders go).
inline void say_done(session& s, const elastic_options& o, elastic_result& out, bool holds) {
  if (out.steps < o.steps) return;
  out.reports = s.done(out.steps, holds && o.report);
  if (!out.reports) return;
  o.report(out);
  s.reported();
}

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
// What a member writes: a line per commit to the commit log ("step epoch members hash"), and its story to o.log.
class journal {
 public:
  journal(const elastic_options& o, int slot) : log_(o.log), slot_(slot) {
    if (o.commit_log.empty()) return;
    // An earlier start of this slot may have written lines: the last complete one's step is where it stopped.
    std::ifstream before(o.commit_log);
    for (std::string line; std::getline(before, line);)
      if (long long step = 0; std::sscanf(line.c_str(), "%lld", &step) == 1) logged_ = std::max<std::int64_t>(logged_, step);
    commits_.open(o.commit_log, std::ios::app);
    if (!commits_) fail<io_error>("dml::ft: cannot append to the commit log ", o.commit_log);
  }
  bool logs_commits() const { return commits_.is_open(); }
  void commit(std::int64_t step, std::int64_t epoch, int members, std::uint64_t hash) {
    if (logs_commits()) commits_ << step << ' ' << epoch << ' ' << members << ' ' << hash << std::endl;
    logged_ = step;
  }
  std::int64_t logged() const { return logged_; }  // the last step written
  void say(const std::string& line) {
    if (log_) *log_ << "slot " << slot_ << ": " << line << std::endl;
  }

 private:
  std::ofstream commits_;
  std::int64_t logged_ = 0;
  std::ostream* log_;
  int slot_;
};
}  // namespace detail

// Trains until `o.steps` steps have committed, through deaths, freezes and restarts of members.
//   make_comm(const quorum&) -> std::unique_ptr<Comm>: the epoch's communicator (collective over its members);
//   make_trainer(Comm&, const quorum&, std::function<bool()> commit) -> std::unique_ptr<Trainer>: a trainer whose
//     trainer_options::commit is `commit` (with groups, hybrid sharding: q.size() / q.group replicas);
//   run_step(Trainer&, Comm&, std::int64_t step, const quorum&) -> train::step_result: step `step` (from 0),
//     on this member's share of the step's samples (rank q.rank of q.size()).
template <class MakeComm, class MakeTrainer, class RunStep>
elastic_result train_elastic(session& s, MakeComm make_comm, MakeTrainer make_trainer, RunStep run_step,
                             const elastic_options& o) {
  using comm_ptr = decltype(make_comm(std::declval<const quorum&>()));
  using trainer_ptr = decltype(make_trainer(*std::declval<comm_ptr&>(), std::declval<const quorum&>(),
                                            std::declval<std::function<bool()>>()));
  elastic_result out;
  out.losses.assign(static_cast<std::size_t>(o.steps), 0.f);
  std::optional<train::state_snapshot> committed_state;  // what this member last committed
  std::int64_t committed = 0, ran = 0;  // ran: the highest step started (the coordinator counts those lost)
  detail::journal journal(o, s.options().slot);
  std::optional<clock::time_point> began, trained;
  while (committed < o.steps) {
    const quorum q = s.join(committed, ran);
    if (q.finished) break;
    ++out.configurations;
    out.rank = q.rank;
    journal.say(dml::detail::cat("epoch ", q.epoch, ": rank ", q.rank, " of ", q.size(), ", step ", q.step,
                         q.behind(q.rank) ? dml::detail::cat(" (behind at ", committed, ": healing from rank ", q.source(q.rank), ")") : ""));
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
      t = make_trainer(*comm, q, vote);
      if (q.behind(q.rank)) {
        t->restore(detail::receive_state(*comm, q.source(q.rank)));
        ++out.healed;
      } else if (committed_state) {
        t->restore(*committed_state);
      }
      // Each member behind heals from the first at the quorum's step in its place (groups: hybrid sharding).
      std::optional<train::state_snapshot> mine;
      for (int r = 0; r < q.size(); ++r)
        if (q.behind(r) && q.source(r) == q.rank) {
          if (!mine) mine = t->snapshot();
          detail::send_state(*comm, *mine, r);
        }
      at = q.step;
      holds_committed = true;
      // A step can commit and its line go unwritten: under ZeRO-3 the hash gathers the parameters, a collective
      // that a death right after the vote breaks. The configuration that follows writes it (every member gathers).
      if (journal.logs_commits() && at > 0) {
        const auto hash = parameter_hash(packed_parameters(*t));
        if (!q.behind(q.rank) && journal.logged() < at) journal.commit(at, q.epoch, q.size(), hash);
      }
      if (!began) began = clock::now();
      while (at < o.steps && !reconfigure) {
        ran = std::max(ran, at + 1);
        const auto r = run_step(*t, *comm, at, q);
        if (!r.committed) {
          ++out.failed_steps;
          journal.say(dml::detail::cat("step ", at + 1, " was not committed (epoch ", q.epoch, ")"));
          break;
        }
        out.losses[static_cast<std::size_t>(at)] = r.loss;
        const bool last = ++at == o.steps;
        if (last) trained = clock::now();  // the final gathering, snapshot and teardown are one-offs: not timed
        if (journal.logs_commits() || last) {
          auto p = packed_parameters(*t);
          const auto hash = parameter_hash(p);
          journal.commit(at, q.epoch, q.size(), hash);
          if (last) out.hash = hash, out.parameters = std::move(p);
        }
      }
    } catch (const comm_error& e) {
      ++out.failed_steps;
      journal.say(dml::detail::cat("epoch ", q.epoch, " failed at step ", at + 1, ": ", e.what()));
    }
    // Keep what was committed: the trainer's state, unless it never received it (a failure while healing).
    if (t && holds_committed) {
      committed_state = t->snapshot();
      committed = at;
    }
    t.reset();
    comm.reset();
  }
  if (began) out.seconds = std::chrono::duration<double>(trained.value_or(clock::now()) - *began).count();
  out.steps = committed;
  out.state = std::move(committed_state);
  detail::say_done(s, o, out, !out.parameters.empty());
  return out;
}

namespace detail {

// A copy of one rank's pieces at a committed step: this member's own, or its buddy's (the rank before it).
struct held_pieces {
  std::int64_t step = 0, epoch = 0;
  int rank = 0, size = 0;   // whose: rank `rank` of the `size` ranks of configuration `epoch`
  std::vector<char> bytes;  // encode()d
};

// train::state_pieces as bytes: nine numbers, (name length, begin, end) per range, the names, the values.
inline std::vector<char> encode(const train::state_pieces& p) {
  std::vector<std::int64_t> head{p.meta.step, p.meta.optimizer_step, static_cast<std::int64_t>(p.meta.seed),
                                 p.meta.growth_tracker, 0, static_cast<std::int64_t>(p.ranges.size()),
                                 static_cast<std::int64_t>(p.meta.values.size()), 0, 0};
  std::memcpy(&head[4], &p.meta.loss_scale, sizeof p.meta.loss_scale);
  std::string names;
  for (const auto& r : p.ranges) {
    head.insert(head.end(), {static_cast<std::int64_t>(r.tensor.size()), r.begin, r.end});
    names += r.tensor;
  }
  head[7] = static_cast<std::int64_t>(names.size());
  std::vector<char> out(head.size() * sizeof(std::int64_t) + names.size() + p.meta.values.size() * sizeof(float));
  char* at = out.data();
  auto put = [&](const void* b, std::size_t n) {
    if (n) std::memcpy(at, b, n);
    at += n;
  };
  put(head.data(), head.size() * sizeof(std::int64_t));
  put(names.data(), names.size());
  put(p.meta.values.data(), p.meta.values.size() * sizeof(float));
  return out;
}
inline train::state_pieces decode(std::span<const char> b) {
  std::size_t at = 0;
  auto take = [&](void* to, std::size_t n) {
    if (n > b.size() - at) fail<format_error>("dml::ft: a peer's pieces end after ", b.size(), " bytes, before their end");
    if (n) std::memcpy(to, b.data() + at, n);
    at += n;
  };
  std::int64_t head[9] = {};
  take(head, sizeof head);
  train::state_pieces p;
  p.meta.step = head[0];
  p.meta.optimizer_step = head[1];
  p.meta.seed = static_cast<std::uint64_t>(head[2]);
  p.meta.growth_tracker = head[3];
  std::memcpy(&p.meta.loss_scale, &head[4], sizeof p.meta.loss_scale);
  const auto limit = static_cast<std::int64_t>(b.size());
  if (head[5] < 0 || head[5] > limit || head[6] < 0 || head[6] > limit || head[7] < 0 || head[7] > limit)
    fail<format_error>("dml::ft: a peer's pieces announce ", head[5], " ranges, ", head[6], " values and ", head[7],
                       " name bytes in ", b.size(), " bytes");
  std::vector<std::int64_t> ranges(3 * static_cast<std::size_t>(head[5]));
  take(ranges.data(), ranges.size() * sizeof(std::int64_t));
  std::string names(static_cast<std::size_t>(head[7]), '\0');
  take(names.data(), names.size());
  std::size_t name_at = 0;
  for (std::size_t i = 0; i < ranges.size(); i += 3) {
    const auto n = static_cast<std::size_t>(ranges[i]);
    if (ranges[i] < 0 || n > names.size() - name_at) fail<format_error>("dml::ft: a peer's pieces name past their names");
    p.ranges.push_back({names.substr(name_at, n), ranges[i + 1], ranges[i + 2]});
    name_at += n;
  }
  p.meta.values.resize(static_cast<std::size_t>(head[6]));
  take(p.meta.values.data(), p.meta.values.size() * sizeof(float));
  if (at != b.size()) fail<format_error>("dml::ft: a peer's pieces have ", b.size() - at, " bytes past their end");
  return p;
}

// Sends `mine` to the rank `d` after this one and returns what the rank `d` before sent (sizes first: they
// differ by rank).
template <class C>
std::vector<char> pass_to_buddy(C& c, const std::vector<char>& mine, int d) {
  const int n = c.size(), to = (c.rank() + d) % n, from = (c.rank() + n - d) % n;
  const std::int64_t out = static_cast<std::int64_t>(mine.size());
  std::int64_t in = 0;
  comm::isendrecv(c, std::span<const std::int64_t>(&out, 1), to, std::span<std::int64_t>(&in, 1), from, 73).wait();
  if (in < 0 || in > (std::int64_t{1} << 40)) fail<format_error>("dml::ft: a peer announces ", in, " bytes of pieces");
  std::vector<char> got(static_cast<std::size_t>(in));
  comm::isendrecv(c, std::span<const char>(mine), to, std::span<char>(got), from, 74).wait();
  return got;
}

// Every member's copies of the pieces of `step`: each member offers what it holds (at most `most`), the newest
// configuration whose every rank is offered is taken (else every copy offered), and the lowest member holding
// each copy broadcasts it. Collective over the new configuration; every member returns the same pieces.
template <class C>
std::vector<train::state_pieces> collect_pieces(C& c, const std::vector<held_pieces>& held, std::int64_t step) {
  constexpr std::size_t most = 8, width = 1 + 3 * most;
  std::vector<const held_pieces*> offered;
  for (const auto& h : held)
    if (h.step == step && offered.size() < most) offered.push_back(&h);
  std::vector<std::int64_t> mine(width, 0), every(width * static_cast<std::size_t>(c.size()));
  mine[0] = static_cast<std::int64_t>(offered.size());
  for (std::size_t i = 0; i < offered.size(); ++i)
    std::copy_n(std::array<std::int64_t, 3>{offered[i]->epoch, offered[i]->rank, offered[i]->size}.data(), 3,
                mine.data() + 1 + 3 * i);
  comm::all_gather_host(c, std::span<const std::int64_t>(mine), std::span<std::int64_t>(every));
  struct copy { std::int64_t size; int holder; };
  std::map<std::pair<std::int64_t, std::int64_t>, copy> copies;  // (epoch, rank) -> the lowest member holding it
  for (int m = c.size() - 1; m >= 0; --m) {
    const auto* o = every.data() + width * static_cast<std::size_t>(m);
    for (std::int64_t i = 0; i < o[0]; ++i) copies[{o[1 + 3 * i], o[2 + 3 * i]}] = {o[3 + 3 * i], m};
  }
  std::int64_t complete = -1;  // the newest epoch with every rank's copy
  for (const auto& [key, cp] : copies) {
    std::int64_t ranks = 0;
    for (const auto& [k2, c2] : copies) ranks += k2.first == key.first;
    if (ranks == cp.size) complete = std::max(complete, key.first);
  }
  std::vector<train::state_pieces> out;
  for (const auto& [key, cp] : copies) {
    if (complete >= 0 && key.first != complete) continue;
    std::vector<char> bytes;
    if (c.rank() == cp.holder)
      for (const auto* h : offered)
        if (h->epoch == key.first && h->rank == key.second) bytes = h->bytes;
    std::int64_t n = static_cast<std::int64_t>(bytes.size());
    comm::broadcast_host(c, std::span<std::int64_t>(&n, 1), cp.holder);
    bytes.resize(static_cast<std::size_t>(n));
    comm::broadcast_host(c, std::span<char>(bytes), cp.holder);
    out.push_back(decode(bytes));
  }
  return out;
}

}  // namespace detail

// Trains until `o.steps` steps have committed, as train_elastic does, for layouts whose members hold parts of the
// model. Each configuration may have another size and layout (make_trainer(Comm&, const quorum&) picks it); its
// members restore the quorum's step from the pieces any member holds (own or buddy copies), and the loss of a
// member costs no committed step. A step commits only after every member's `copies` next members hold its
// pieces; a configuration that cannot restore the step (more neighbours lost, or frozen, than copies) is left for
// one that can, and if none comes the launcher's stall deadline ends the job. make_comm and run_step are
// train_elastic's.
template <class MakeComm, class MakeTrainer, class RunStep>
elastic_result train_restarting(session& s, MakeComm make_comm, MakeTrainer make_trainer, RunStep run_step,
                                const elastic_options& o) {
  using comm_ptr = decltype(make_comm(std::declval<const quorum&>()));
  using trainer_ptr = decltype(make_trainer(*std::declval<comm_ptr&>(), std::declval<const quorum&>()));
  if (o.copies < 0) fail<invalid_argument>("dml::ft: copies: expected 0 or more, found ", o.copies);
  if (o.commit_every < 1) fail<invalid_argument>("dml::ft: commit_every: expected 1 or more, found ", o.commit_every);
  elastic_result out;
  out.losses.assign(static_cast<std::size_t>(o.steps), 0.f);
  std::vector<detail::held_pieces> held;  // of the step `committed`, newest configuration first
  std::int64_t committed = 0, ran = 0;  // ran: the highest step started, tentative ones too
  detail::journal journal(o, s.options().slot);
  // This member's pieces as of step `at` of configuration q, and copies of the `copies` members' before it.
  auto pieces_of = [&](auto& t, auto& c, const quorum& q, std::int64_t at) {
    std::vector<detail::held_pieces> now{{at, q.epoch, q.rank, q.size(), detail::encode(t.export_pieces())}};
    for (int d = 1; d <= std::min(o.copies, q.size() - 1); ++d)
      now.push_back({at, q.epoch, (q.rank + q.size() - d) % q.size(), q.size(),
                     detail::pass_to_buddy(c, now.front().bytes, d)});
    return now;
  };
  std::optional<clock::time_point> began, trained;
  while (committed < o.steps) {
    const quorum q = s.join(committed, ran);
    if (q.finished) break;
    ++out.configurations;
    out.rank = q.rank;
    journal.say(dml::detail::cat("epoch ", q.epoch, ": rank ", q.rank, " of ", q.size(), ", step ", q.step,
                         committed < q.step ? dml::detail::cat(" (behind at ", committed, ")") : ""));
    std::int64_t at = committed;
    comm_ptr comm;
    trainer_ptr t;
    try {
      comm = make_comm(q);
      t = make_trainer(*comm, q);
      if (q.step > 0) {
        const auto sources = detail::collect_pieces(*comm, held, q.step);
        // Every member restores, or none: one that cannot leaves the configuration, and so do the others, keeping
        // their copies for a configuration that holds every piece (a member frozen now may come back).
        std::string missing;
        try {
          t->import_pieces(sources);
        } catch (const invalid_argument& e) {
          missing = e.what();
        }
        std::array<std::int32_t, 1> restored{missing.empty() ? 1 : 0};
        comm::all_reduce_host(*comm, std::span<std::int32_t>(restored), comm::reduce_op::min);
        if (restored[0] == 0) {
          journal.say(dml::detail::cat("epoch ", q.epoch, " cannot restore step ", q.step, " from its members' copies",
                               missing.empty() ? "" : dml::detail::cat(" (", missing, ")"),
                               "; waiting for a configuration that holds them"));
          t.reset();
          comm.reset();
          std::this_thread::sleep_for(std::chrono::milliseconds(250));
          continue;
        }
        if (committed < q.step) ++out.healed;
        // This configuration's own copies (the older ones stay, up to 8): a death now costs nothing.
        auto now = pieces_of(*t, *comm, q, q.step);
        for (auto& h : held)
          if (h.step == q.step && now.size() < 8) now.push_back(std::move(h));
        held = std::move(now);
        committed = q.step;
      }
      at = q.step;
      if (!began) began = clock::now();
      while (at < o.steps) {
        ran = std::max(ran, at + 1);
        out.losses[static_cast<std::size_t>(at)] = run_step(*t, *comm, at, q).loss;
        if (++at == o.steps) trained = clock::now();  // what follows the last step is a one-off: not timed
        // Between commits the steps are tentative: a failure before the next commit runs them again.
        if (at % o.commit_every != 0 && at != o.steps) continue;
        // The update is applied here; it counts once the buddies hold its pieces and every member voted. What
        // needs the others (the hash of the parameters, the final pieces) is done before the vote.
        auto now = pieces_of(*t, *comm, q, at);
        const bool last = at == o.steps;
        const std::uint64_t hash = journal.logs_commits() || last ? parameter_hash(packed_parameters(*t)) : 0;
        auto final_pieces = last ? detail::collect_pieces(*comm, now, at) : std::vector<train::state_pieces>{};
        const verdict v = s.vote(q.epoch, at, true);
        if (v != verdict::commit && v != verdict::commit_and_reconfigure) {
          ++out.failed_steps;
          journal.say(dml::detail::cat("step ", at, " was not committed (epoch ", q.epoch, ")"));
          break;
        }
        committed = at;
        held = std::move(now);
        journal.commit(at, q.epoch, q.size(), hash);
        if (last) out.hash = hash, out.pieces = std::move(final_pieces);
        if (v == verdict::commit_and_reconfigure) break;
      }
    } catch (const comm_error& e) {
      ++out.failed_steps;
      journal.say(dml::detail::cat("epoch ", q.epoch, " failed at step ", at + 1, ": ", e.what()));
    }
    t.reset();
    comm.reset();
  }
  if (began) out.seconds = std::chrono::duration<double>(trained.value_or(clock::now()) - *began).count();
  out.steps = committed;
  detail::say_done(s, o, out, !out.pieces.empty());
  return out;
}

}  // namespace dml::ft
