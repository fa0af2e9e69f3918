// SPDX-License-Identifier: Apache-2.0
// dml/ft/coordinator.hpp — the job's coordinator: membership by heartbeat, a quorum per configuration, one
// vote per step, and a key-value store for the communicators' rendezvous. One thread, one poll loop.
// Sits on ft/wire.hpp; dml-run hosts it, ft/session.hpp talks to it. See DESIGN.md §11.
//
// Members are slots 0..nproc-1 (a slot keeps its number across restarts; each start is a new incarnation).
// A configuration is an epoch: the members that asked for a quorum together, in slot order. In an epoch every
// member votes once per step after its reductions; the coordinator answers COMMIT when every member voted ok,
// ABORT when one voted failed, died, or left for a new quorum. A member of an older epoch is FENCED: it must
// ask for a quorum and heal before it votes again. There is one coordinator, so there is one history.
#pragma once

#include <algorithm>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "dml/ft/wire.hpp"

namespace dml::ft {

struct coordinator_options {
  std::string token;             // every connection must present it
  int nproc = 1;                 // member slots
  int min_members = 1;           // a quorum needs at least this many
  int group_size = 1;            // failure domains: slots [k·g, (k+1)·g) join and leave configurations together
  milliseconds heartbeat_deadline{1000};  // a member silent this long is dead
  milliseconds join_deadline{5000};       // a quorum waits this long for live members that have not asked
  milliseconds start_deadline{60000};     // the first quorum waits this long for every slot to join
  std::string host = "127.0.0.1";
  int port = 0;                  // 0: any free port
  std::ostream* log = nullptr;   // one line per event
  int listen_fd = -1;            // a socket already listening (dml-run's, kept across starts): used instead of host:port
  std::string state_file{};      // what must outlive this start (empty: nothing); read back by the next start
};

// What happened, for dml-run's last line and the tests.
struct coordinator_stats {
  std::int64_t quorums = 0, recoveries = 0, commits = 0, refused = 0, deaths = 0;  // recoveries: epochs broken
  std::int64_t steps_lost = 0;  // steps members ran that never committed (each new quorum: the highest step its
                                // members ran past the last committed one)
  std::int64_t last_step = 0;                 // the highest committed step
  std::vector<double> recovery_seconds;       // a death or failed vote to the next epoch's first commit
  std::int64_t starts = 1;                    // this start of the coordinator (2: it died once)
};

// What dml-run reads from the coordinator (in a process of its own) on its supervisor connection: the counters and,
// per slot, whether a start of it joined, is in the final epoch, and holds the last committed step.
struct coordinator_status {
  coordinator_stats stats;
  std::int64_t epoch = 0;
  bool finished = false;
  std::string slots;  // per slot a digit: 1 joined, 2 in the final epoch, 4 holds the last committed step

  bool joined(int s) const { return flag(s, 1); }
  bool in_final_epoch(int s) const { return flag(s, 2); }
  bool holds_last_step(int s) const { return flag(s, 4); }
  bool any_joined() const {
    return std::ranges::any_of(slots, [](char c) { return ((c - '0') & 1) != 0; });
  }

  frame encode() const {
    frame f = make_frame("STATUS", epoch, finished ? 1 : 0, stats.quorums, stats.recoveries, stats.commits,
                         stats.refused, stats.deaths, stats.last_step, stats.starts, stats.steps_lost,
                         slots.empty() ? "-" : slots);
    for (double r : stats.recovery_seconds) f.body += dml::detail::cat(r, " ");
    return f;
  }
  static coordinator_status decode(const frame& f) {
    if (f.verb() != "STATUS" || f.words.size() != 12)
      fail<format_error>("dml::ft: expected a STATUS frame of 12 words, found '", f.verb(), "' with ", f.words.size());
    coordinator_status s;
    s.epoch = f.number(1);
    s.finished = f.number(2) != 0;
    s.stats = {.quorums = f.number(3), .recoveries = f.number(4), .commits = f.number(5), .refused = f.number(6),
               .deaths = f.number(7), .steps_lost = f.number(10), .last_step = f.number(8), .recovery_seconds = {},
               .starts = f.number(9)};
    s.slots = f.at(11) == "-" ? "" : f.at(11);
    std::istringstream in(f.body);
    for (double r; in >> r;) s.stats.recovery_seconds.push_back(r);
    return s;
  }

 private:
  bool flag(int s, int bit) const {
    return s >= 0 && s < static_cast<int>(slots.size()) && ((slots[static_cast<std::size_t>(s)] - '0') & bit) != 0;
  }
};

class coordinator {
 public:
  explicit coordinator(coordinator_options o)
      : opt_(std::move(o)),
        listen_(opt_.listen_fd >= 0 ? socket_fd(::fcntl(opt_.listen_fd, F_DUPFD_CLOEXEC, 0)) : listen_on(opt_.host, opt_.port)),
        members_(static_cast<std::size_t>(opt_.nproc)) {
    if (!listen_) fail<comm_error>("dml::ft::coordinator: cannot use listening socket ", opt_.listen_fd, ": ", std::strerror(errno));
    if (opt_.nproc < 1) fail<invalid_argument>("dml::ft::coordinator: nproc must be at least 1, found ", opt_.nproc);
    if (opt_.min_members < 1 || opt_.min_members > opt_.nproc)
      fail<invalid_argument>("dml::ft::coordinator: --min must be in [1, ", opt_.nproc, "], found ", opt_.min_members);
    if (opt_.group_size < 1 || opt_.nproc % opt_.group_size != 0)
      fail<invalid_argument>("dml::ft::coordinator: expected groups of equal size that divide the ", opt_.nproc,
                             " slots, found a group size of ", opt_.group_size);
    ::fcntl(listen_.get(), F_SETFL, O_NONBLOCK);
    if (!opt_.state_file.empty()) restore_state();
  }
  int port() const { return port_of(listen_); }
  const coordinator_stats& stats() const { return stats_; }
  std::int64_t epoch() const { return epoch_; }
  // True once every member left in the epoch has said DONE.
  bool finished() const { return finished_; }
  // Whether a start of the slot has joined as a member (a program that trains through deaths).
  bool joined(int slot) const { return members_.at(static_cast<std::size_t>(slot)).incarnation >= 0; }
  bool any_joined() const {
    return std::ranges::any_of(members_, [](const member& m) { return m.incarnation >= 0; });
  }
  // Whether the slot is a member of the current epoch (the one that finished, at the end).
  bool in_final_epoch(int slot) const { return (finished_ ? final_members_ : in_epoch_).count(slot) > 0; }
  // Whether the slot's current start is alive and holds the last committed step (it took part in that commit).
  bool holds_last_step(int slot) const {
    const auto& m = members_.at(static_cast<std::size_t>(slot));
    return m.alive && m.incarnation >= 0 && m.step == stats_.last_step;
  }
  coordinator_status status() const {
    coordinator_status s{.stats = stats_, .epoch = epoch_, .finished = finished_, .slots = {}};
    for (int slot = 0; slot < opt_.nproc; ++slot)
      s.slots += static_cast<char>('0' + (joined(slot) ? 1 : 0) + (in_final_epoch(slot) ? 2 : 0) +
                                   (holds_last_step(slot) ? 4 : 0));
    return s;
  }
  // A slot whose process is gone (dml-run saw it exit): dead at once, not at the heartbeat deadline.
  void process_exited(int slot, const std::string& why) {
    if (slot >= 0 && slot < opt_.nproc) declare_dead(slot, why);
  }

  // Serves for up to `wait`: accepts, reads, answers, and checks deadlines.
  void poll_once(milliseconds wait) {
    std::vector<pollfd> fds{{listen_.get(), POLLIN, 0}};
    for (auto& c : clients_) fds.push_back({c.fd.get(), POLLIN, 0});
    const int r = ::poll(fds.data(), fds.size(), static_cast<int>(wait.count()));
    if (r < 0 && errno != EINTR) fail<comm_error>("dml::ft::coordinator: poll(): ", std::strerror(errno));
    if (r > 0) {
      for (std::size_t i = 1; i < fds.size(); ++i)
        if (fds[i].revents) read_client(fds[i].fd);
      if (fds[0].revents & POLLIN) accept_all();
    }
    std::erase_if(clients_, [](const client& c) { return !c.fd; });
    check_deadlines();
  }

 private:
  struct client {
    socket_fd fd;
    frame_reader in;
    bool hello = false;
    int slot = -1;
    std::int64_t incarnation = -1;
    std::string role, peer;
  };
  struct member {
    std::int64_t incarnation = -1;
    bool alive = false, wants_quorum = false, voted = false, vote_ok = false, done = false;
    bool awaits_report = false;  // said DONE holding the final state; answered when it is reported
    clock::time_point last_seen{};
    std::int64_t step = 0;  // its committed step
    std::int64_t ran = 0;   // the highest step it started, as it last asked for a quorum
    int control = -1;       // fd of its control connection (answers go there)
  };

  void say(const std::string& line) {
    if (opt_.log) *opt_.log << "dml-run: " << line << std::endl;
  }
  client* find(int fd) {
    for (auto& c : clients_)
      if (c.fd.get() == fd) return &c;
    return nullptr;
  }
  void answer(int fd, const frame& f) {
    try {
      send_frame(fd, f, clock::now() + milliseconds(2000));
    } catch (const comm_error&) {
      // The reader side notices the closed connection.
    }
  }

  void accept_all() {
    for (;;) {
      sockaddr_in a{};
      socklen_t n = sizeof a;
      const int fd = ::accept4(listen_.get(), reinterpret_cast<sockaddr*>(&a), &n, SOCK_CLOEXEC);
      if (fd < 0) return;
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      char ip[INET_ADDRSTRLEN] = {};
      ::inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip);
      client c;
      c.fd = socket_fd(fd);
      c.peer = dml::detail::cat(ip, ":", ntohs(a.sin_port));
      clients_.push_back(std::move(c));
    }
  }

  void read_client(int fd) {
    client* c = find(fd);
    if (!c) return;
    char buf[65536];
    const auto n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return drop(*c, "closed its connection");
    if (n < 0) return;
    c->in.feed(buf, static_cast<std::size_t>(n));
    try {
      while (c->fd)
        if (auto f = c->in.next()) handle(*c, *f);
        else break;
    } catch (const error& e) {
      say(dml::detail::cat("dropped ", c->peer, ": ", e.what()));
      drop(*c, "sent a malformed frame");
    }
  }

  void drop(client& c, const std::string& why) {
    const int slot = c.slot;
    const bool control = c.role == "control" || c.role == "heartbeat";
    c.fd.reset();
    // An old start's connection closing says nothing about the slot's current start.
    if (slot >= 0 && control && members_[static_cast<std::size_t>(slot)].incarnation == c.incarnation)
      declare_dead(slot, why);
  }

  void handle(client& c, const frame& f) {
    if (!c.hello) {
      // HELLO token slot incarnation role: nothing else is read from a connection without the job's token.
      if (f.verb() != "HELLO" || f.words.size() != 5 || f.words[1] != opt_.token) {
        ++stats_.refused;
        say(dml::detail::cat("refused a connection from ", c.peer, ": it did not present the job token"));
        answer(c.fd.get(), make_frame("REFUSED", "the job token is missing or wrong"));
        c.fd.reset();
        return;
      }
      const auto slot = f.number(2);
      c.role = f.at(4);
      const bool member_role = c.role == "control" || c.role == "heartbeat";
      if (member_role && (slot < 0 || slot >= opt_.nproc)) {
        answer(c.fd.get(), make_frame("REFUSED", dml::detail::cat("slot ", slot, " outside [0, ", opt_.nproc, ")")));
        c.fd.reset();
        return;
      }
      if (!member_role && c.role != "store" && c.role != "supervisor") {
        answer(c.fd.get(), make_frame("REFUSED", dml::detail::cat("unknown role '", c.role, "'")));
        c.fd.reset();
        return;
      }
      c.hello = true;
      c.slot = member_role ? static_cast<int>(slot) : -1;
      if (c.slot >= 0) {
        auto& m = members_[static_cast<std::size_t>(c.slot)];
        const auto inc = f.number(3);
        c.incarnation = inc;
        if (c.role != "control" && inc != m.incarnation) {
          answer(c.fd.get(), make_frame("REFUSED", dml::detail::cat("start ", inc, " of slot ", c.slot, " is not its current one")));
          c.fd.reset();
          return;
        }
        if (c.role == "control") {
          if (m.alive && m.incarnation != inc) declare_dead(c.slot, "was replaced by a new start");
          if (m.incarnation != inc) {
            m = member{};
            m.incarnation = inc;
            say(dml::detail::cat("slot ", c.slot, " joined (start ", inc, ")"));
          } else {
            say(dml::detail::cat("slot ", c.slot, " is back"));
          }
          m.control = c.fd.get();
        }
        m.alive = true;
        m.last_seen = clock::now();
      }
      answer(c.fd.get(), make_frame("OK", epoch_));
      return;
    }
    if (c.slot >= 0) {
      auto& m = members_[static_cast<std::size_t>(c.slot)];
      if (!m.alive) {
        m.alive = true;  // a frozen member that resumed: alive, but fenced from the epoch it was in
        say(dml::detail::cat("slot ", c.slot, " resumed after being declared dead; it must heal"));
        in_epoch_.erase(c.slot);
        if (m.awaits_report && reported_) {
          m.awaits_report = false;
          answer(m.control, make_frame("OK"));
        }
      }
      m.last_seen = clock::now();
    }
    const auto& v = f.verb();
    if (v == "HB") return;
    if (v == "SET") {
      store_[f.at(1)] = f.body;
      return answer(c.fd.get(), make_frame("OK"));
    }
    if (v == "GET") {
      auto it = store_.find(f.at(1));
      if (it == store_.end()) return answer(c.fd.get(), make_frame("MISSING"));
      frame out = make_frame("VALUE");
      out.body = it->second;
      return answer(c.fd.get(), out);
    }
    if (c.role == "supervisor") {
      if (v == "STATUS") return answer(c.fd.get(), status().encode());
      if (v == "EXITED") {
        std::string why;
        for (std::size_t i = 2; i < f.words.size(); ++i) why += (i > 2 ? " " : "") + f.words[i];
        process_exited(static_cast<int>(f.number(1)), why.empty() ? "exited" : why);
        return answer(c.fd.get(), make_frame("OK"));
      }
    }
    if (c.role != "control") fail<format_error>("'", v, "' on a ", c.role, " connection");
    auto& m = members_[static_cast<std::size_t>(c.slot)];
    if (v == "QUORUM") return ask_quorum(c.slot, f.number(1), f.words.size() > 2 ? f.number(2) : f.number(1));
    if (v == "VOTE") return vote(c.slot, f.number(1), f.number(2), f.at(3) == "ok");
    if (v == "DONE") {
      m.done = true;
      m.step = f.words.size() > 1 ? f.number(1) : m.step;
      // A member at the last step that says it holds the final state may report it (answer_done). Not the last
      // configuration's first member: a death right after the last commit may leave that one without the state
      // (under ZeRO its gathering fails) while others hold it.
      const bool holds = f.words.size() > 2 && f.number(2) != 0 && m.step >= stats_.last_step;
      // A new start of the coordinator that has formed no configuration yet: a member that committed the last
      // step finished the job (the last step was committed by the start before); the members that ask next are
      // told the job finished.
      if (stats_.starts > 1 && in_epoch_.empty() && !finished_ && m.step >= stats_.last_step) {
        in_epoch_ = {c.slot};
        finished_ = true;
        final_members_ = in_epoch_;
        say(dml::detail::cat("slot ", c.slot, " finished at step ", m.step, " before this start: the job is finished"));
        persist();
        answer_done(c.slot, holds);
        for (int s = 0; s < opt_.nproc; ++s) {
          auto& x = members_[static_cast<std::size_t>(s)];
          if (x.alive && x.wants_quorum) answer(x.control, make_frame("FINISHED", stats_.last_step));
        }
        return;
      }
      answer_done(c.slot, holds);
      if (finished_) final_members_.insert(c.slot);
      return check_finished();
    }
    if (v == "REPORTED") {
      // The final state is reported: the holders that wait are let go (a frozen one when it resumes).
      reported_ = true;
      answer(m.control, make_frame("OK"));
      for (auto& x : members_)
        if (x.awaits_report && x.alive) {
          x.awaits_report = false;
          answer(x.control, make_frame("OK"));
        }
      return;
    }
    fail<format_error>("unknown request '", v, "'");
  }

  // ---- quorum
  void ask_quorum(int slot, std::int64_t step, std::int64_t ran) {
    auto& m = members_[static_cast<std::size_t>(slot)];
    m.wants_quorum = true;
    m.step = step;
    m.ran = std::max(step, ran);
    if (in_epoch_.count(slot)) {
      if (reconfiguring_) {
        epoch_broken_ = true;  // asked to come after a commit: the epoch ends without a failure
      } else {
        break_epoch(dml::detail::cat("slot ", slot, " left epoch ", epoch_));
      }
    }
    if (finished_) return answer(m.control, make_frame("FINISHED", stats_.last_step));
    if (!waiting_since_) waiting_since_ = clock::now();
    try_form_quorum();
  }

  // Whether every member of the slot's group is alive and asks for a quorum (always, in groups of one).
  bool group_ready(int slot) const {
    const int first = slot - slot % opt_.group_size;
    for (int t = first; t < first + opt_.group_size; ++t) {
      const auto& m = members_[static_cast<std::size_t>(t)];
      if (!m.alive || !m.wants_quorum) return false;
    }
    return true;
  }

  void try_form_quorum() {
    if (!waiting_since_ || finished_) return;
    std::vector<int> ready, busy;
    for (int s = 0; s < opt_.nproc; ++s) {
      const auto& m = members_[static_cast<std::size_t>(s)];
      if (!m.alive) continue;
      (m.wants_quorum ? ready : busy).push_back(s);
    }
    // Members still training in an unbroken epoch come at their next vote (answered RECONF); others that
    // have not asked within the join deadline are left out (they are fenced when they vote).
    // The first configuration waits for every slot to join (up to the start deadline); later ones go on with
    // the members present, and a slot that comes back joins at a later step.
    // A new start of the coordinator waits up to the heartbeat deadline for slots it has not heard from yet: the
    // members of the epoch it lost come back at their next question (a vote: one step).
    const bool new_start = stats_.starts > 1 && !formed_since_start_;
    const auto patience = epoch_ == 0 ? opt_.start_deadline : new_start ? opt_.heartbeat_deadline : opt_.join_deadline;
    const bool late = clock::now() - *waiting_since_ > patience;
    if (epoch_ == 0 || new_start)
      for (int s = 0; s < opt_.nproc; ++s)
        if (!members_[static_cast<std::size_t>(s)].alive) busy.push_back(s);
    // Groups join whole: a member whose group is not all here is left out (it comes with its group, after a
    // later commit).
    const int g = opt_.group_size;
    std::erase_if(ready, [&](int s) { return !group_ready(s); });
    if (!busy.empty() && !late) return;
    if (static_cast<int>(ready.size()) < opt_.min_members) return;
    // No committed step is ever lost: a configuration needs a member that holds the last one (a restarted member
    // cannot heal from nobody); with groups, one for each place in a group (the state of a place is its own).
    // Until one asks (a frozen member resumes), the others wait; if none ever does, the job stalls and dml-run
    // ends it.
    std::int64_t holds = stats_.last_step;
    for (int place = 0; place < g; ++place) {
      std::int64_t top = 0;
      for (int s : ready)
        if (s % g == place) top = std::max(top, members_[static_cast<std::size_t>(s)].step);
      holds = std::min(holds, top);
    }
    if (holds < stats_.last_step) {
      if (!said_waiting_) say(dml::detail::cat("waiting for a member that holds step ", stats_.last_step));
      said_waiting_ = true;
      return;
    }
    said_waiting_ = false;
    formed_since_start_ = true;
    ++epoch_;
    ++stats_.quorums;
    in_epoch_ = std::set<int>(ready.begin(), ready.end());
    epoch_broken_ = reconfiguring_ = false;
    waiting_since_.reset();
    std::int64_t top = 0, ran = 0;
    for (int s : ready) {
      top = std::max(top, members_[static_cast<std::size_t>(s)].step);
      ran = std::max(ran, members_[static_cast<std::size_t>(s)].ran);
    }
    stats_.steps_lost += std::max<std::int64_t>(0, ran - std::max(top, stats_.last_step));
    frame f = make_frame("QUORUM", epoch_, top, ready.size());
    for (int s : ready) f.words.push_back(dml::detail::cat(s, ":", members_[static_cast<std::size_t>(s)].step));
    f.words.push_back(std::to_string(g));
    std::string who;
    for (int s : ready) who += dml::detail::cat(who.empty() ? "" : ",", s);
    say(dml::detail::cat("epoch ", epoch_, ": members ", who, " at step ", top,
                         busy.empty() ? "" : dml::detail::cat(" (", busy.size(), " late members left out)")));
    persist();
    for (int s : ready) {
      auto& m = members_[static_cast<std::size_t>(s)];
      m.wants_quorum = m.voted = false;
      answer(m.control, f);
    }
  }

  // ---- votes
  void vote(int slot, std::int64_t epoch, std::int64_t step, bool ok) {
    auto& m = members_[static_cast<std::size_t>(slot)];
    if (epoch != epoch_ || !in_epoch_.count(slot)) return answer(m.control, make_frame("FENCED", epoch_));
    if (epoch_broken_) return answer(m.control, make_frame("ABORT"));
    m.voted = true;
    m.vote_ok = ok;
    voting_step_ = step;
    if (!ok) return break_epoch(dml::detail::cat("slot ", slot, " failed step ", step));
    for (int s : in_epoch_)
      if (!members_[static_cast<std::size_t>(s)].voted) return;
    // Unanimous: the step commits. Members that wait for a quorum are asked to come after it.
    bool joiners = false;
    for (int s = 0; s < opt_.nproc; ++s)
      joiners |= members_[static_cast<std::size_t>(s)].alive && members_[static_cast<std::size_t>(s)].wants_quorum &&
                 group_ready(s);
    ++stats_.commits;
    stats_.last_step = std::max(stats_.last_step, step);
    if (recovery_started_) {
      stats_.recovery_seconds.push_back(std::chrono::duration<double>(clock::now() - *recovery_started_).count());
      recovery_started_.reset();
    }
    reconfiguring_ = joiners;
    for (int s : in_epoch_) {
      auto& x = members_[static_cast<std::size_t>(s)];
      x.voted = false;
      x.step = step;
      answer(x.control, make_frame("COMMIT", joiners ? "RECONF" : "STAY"));
    }
    persist();
  }

  // The epoch can commit nothing more: voters are answered ABORT, later votes too.
  void break_epoch(const std::string& why) {
    if (epoch_broken_ || in_epoch_.empty()) return;
    epoch_broken_ = true;
    ++stats_.recoveries;
    if (!recovery_started_) recovery_started_ = clock::now();
    say(dml::detail::cat("epoch ", epoch_, " aborted at step ", voting_step_ + 1, ": ", why));
    persist();
    for (int s : in_epoch_) {
      auto& m = members_[static_cast<std::size_t>(s)];
      if (m.voted) answer(m.control, make_frame("ABORT"));
      m.voted = false;
    }
    if (!waiting_since_) waiting_since_ = clock::now();
  }

  void declare_dead(int slot, const std::string& why) {
    auto& m = members_[static_cast<std::size_t>(slot)];
    if (!m.alive) return;
    // A question for a quorum stays asked: a frozen member that resumes is answered (a new start replaces it).
    m.alive = m.voted = false;
    if (slot == reporter_ && !reported_) pass_report(slot);
    if (finished_) return;  // after the last step, members leave
    if (m.done && in_epoch_.count(slot)) {
      // It reached the last step and left before the others said so: not a failure; the epoch waits for them.
      say(dml::detail::cat("slot ", slot, " left after the last step"));
      return check_finished();
    }
    ++stats_.deaths;
    say(dml::detail::cat("slot ", slot, " is dead: ", why));
    if (in_epoch_.count(slot) && !finished_) break_epoch(dml::detail::cat("slot ", slot, " died"));
    in_epoch_.erase(slot);
    try_form_quorum();
    check_finished();
  }

  void check_deadlines() {
    const auto now = clock::now();
    for (int s = 0; s < opt_.nproc; ++s) {
      auto& m = members_[static_cast<std::size_t>(s)];
      if (m.alive && now - m.last_seen > opt_.heartbeat_deadline)
        declare_dead(s, dml::detail::cat("no heartbeat for ", std::chrono::duration<double>(opt_.heartbeat_deadline).count(), " s"));
    }
    try_form_quorum();
  }

  // One member reports the final state (the example scores it), and it is not lost with that member: the first to
  // say DONE at the last step holding the state is answered REPORT; the other holders wait, answered OK when it
  // says REPORTED, or one of them REPORT if it dies first. The others are answered OK at once.
  void answer_done(int slot, bool holds) {
    auto& m = members_[static_cast<std::size_t>(slot)];
    if (!holds || reported_) return answer(m.control, make_frame("OK"));
    if (reporter_ < 0 || reporter_ == slot) {
      reporter_ = slot;
      return answer(m.control, make_frame("OK", "REPORT"));
    }
    m.awaits_report = true;
  }
  void pass_report(int dead) {
    reporter_ = -1;
    for (int s = 0; s < opt_.nproc; ++s) {
      auto& x = members_[static_cast<std::size_t>(s)];
      if (!x.awaits_report || !x.alive) continue;
      say(dml::detail::cat("slot ", dead, " died before reporting the final state; slot ", s, " reports it"));
      x.awaits_report = false;
      reporter_ = s;
      return answer(x.control, make_frame("OK", "REPORT"));
    }
  }

  // The members of the epoch still in it have all said DONE. Not bound by min_members: a member that dies after
  // the last commit (before its DONE) leaves the epoch, and the step was committed by a quorum that had them all.
  void check_finished() {
    if (finished_ || in_epoch_.empty()) return;
    for (int s : in_epoch_)
      if (!members_[static_cast<std::size_t>(s)].done) return;
    finished_ = true;
    final_members_ = in_epoch_;
    say(dml::detail::cat("finished at step ", stats_.last_step, " in epoch ", epoch_));
    persist();
    for (int s = 0; s < opt_.nproc; ++s) {
      auto& m = members_[static_cast<std::size_t>(s)];
      if (m.alive && m.wants_quorum) answer(m.control, make_frame("FINISHED", stats_.last_step));
    }
  }

  // ---- the state file: one line, rewritten in place at a fixed width (a death between writes leaves the last one)
  static constexpr std::size_t state_width = 255;
  void persist() {
    if (opt_.state_file.empty()) return;
    if (!state_) {
      state_ = socket_fd(::open(opt_.state_file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
      if (!state_) fail<io_error>("dml::ft::coordinator: cannot open the state file ", opt_.state_file, ": ", std::strerror(errno));
    }
    auto line = dml::detail::cat("dml-coordinator 1 ", epoch_, " ", stats_.last_step, " ", stats_.commits, " ",
                                 stats_.recoveries, " ", stats_.deaths, " ", stats_.quorums, " ", stats_.refused, " ",
                                 stats_.starts, " ", finished_ ? 1 : 0, " ", stats_.steps_lost);
    line.resize(state_width - 1, ' ');
    line += '\n';
    if (::pwrite(state_.get(), line.data(), line.size(), 0) != static_cast<ssize_t>(line.size()))
      fail<io_error>("dml::ft::coordinator: cannot write the state file ", opt_.state_file, ": ", std::strerror(errno));
  }
  void restore_state() {
    std::ifstream in(opt_.state_file);
    if (!in) return;  // the first start
    std::string magic;
    int version = 0, finished = 0;
    in >> magic >> version >> epoch_ >> stats_.last_step >> stats_.commits >> stats_.recoveries >> stats_.deaths >>
        stats_.quorums >> stats_.refused >> stats_.starts >> finished >> stats_.steps_lost;
    if (!in || magic != "dml-coordinator" || version != 1)
      fail<format_error>("dml::ft::coordinator: the state file ", opt_.state_file,
                         " is not a coordinator's state (expected 'dml-coordinator 1' and 10 numbers)");
    finished_ = finished != 0;
    ++stats_.starts;
    if (epoch_ > 0 && !finished_) {
      ++stats_.recoveries;  // the epoch died with the last start
      recovery_started_ = clock::now();
    }
    say(dml::detail::cat("coordinator start ", stats_.starts, ": epoch ", epoch_, ", last committed step ",
                         stats_.last_step, finished_ ? ", finished" : "; every member joins a new configuration"));
    persist();
  }

  coordinator_options opt_;
  socket_fd listen_, state_;
  std::vector<client> clients_;
  std::vector<member> members_;
  std::map<std::string, std::string> store_;
  std::set<int> in_epoch_, final_members_;
  std::int64_t epoch_ = 0, voting_step_ = 0;
  bool epoch_broken_ = false, finished_ = false;
  bool reconfiguring_ = false;  // the last commit asked the members to come for a new quorum
  bool said_waiting_ = false;   // "waiting for a member that holds step N" was logged
  int reporter_ = -1;           // the member answered REPORT that has not said REPORTED (this start)
  bool reported_ = false;       // the final state was reported (this start of the coordinator)
  bool formed_since_start_ = false;  // a configuration formed since this start of the coordinator
  std::optional<clock::time_point> waiting_since_, recovery_started_;
  coordinator_stats stats_;
};

}  // namespace dml::ft
