// SPDX-License-Identifier: Apache-2.0
// dml/ft/session.hpp — a member's side of the coordinator: join, heartbeats from a thread of their own, a quorum
// per configuration, one vote per step. Sits on ft/wire.hpp; ft/elastic.hpp drives it. See DESIGN.md §11.
// The coordinator may die and start again (dml-run keeps its port): a lost connection is made again, a vote whose
// verdict was lost with it counts as fenced (the member joins the next configuration and heals if it is behind),
// and questions (a quorum, the end) are asked again of the new start, until the timeout.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "dml/ft/wire.hpp"

namespace dml::ft {

struct session_options {
  std::string address;            // the coordinator's HOST:PORT
  std::string token;              // the job's token
  int slot = 0;                   // this member's slot
  std::int64_t start = 0;         // which start of the slot this process is (dml-run counts them)
  int group = 1;                  // ranks per failure domain (dml-run --groups: nproc / groups)
  milliseconds heartbeat{100};    // one heartbeat per period
  milliseconds timeout{120000};   // the longest wait for a quorum or a vote's verdict

  // What dml-run hands its ranks: DML_RUN_COORDINATOR, DML_RUN_TOKEN, DML_RUN_SLOT, DML_RUN_START, and
  // DML_RUN_GROUP_SIZE (1 when unset).
  static bool in_environment() { return std::getenv("DML_RUN_COORDINATOR") != nullptr; }
  static session_options from_environment() {
    auto need = [](const char* name) -> std::string {
      const char* v = std::getenv(name);
      if (!v || !*v) fail<invalid_argument>("dml::ft: the environment variable ", name, " is missing (dml-run sets it)");
      return v;
    };
    auto number = [&](const char* name) {
      const auto v = need(name);
      std::size_t used = 0;
      long long n = -1;
      try {
        n = std::stoll(v, &used);
      } catch (...) {
      }
      if (used != v.size() || n < 0) fail<invalid_argument>("dml::ft: ", name, " should be a number >= 0, found '", v, "'");
      return n;
    };
    session_options o;
    o.address = need("DML_RUN_COORDINATOR");
    o.token = need("DML_RUN_TOKEN");
    o.slot = static_cast<int>(number("DML_RUN_SLOT"));
    o.start = number("DML_RUN_START");
    if (std::getenv("DML_RUN_GROUP_SIZE")) o.group = static_cast<int>(number("DML_RUN_GROUP_SIZE"));
    if (o.group < 1) fail<invalid_argument>("dml::ft: DML_RUN_GROUP_SIZE should be at least 1, found ", o.group);
    return o;
  }
};

// A configuration: the members in rank order, and the step each has committed.
struct quorum {
  std::int64_t epoch = 0, step = 0;  // step: the highest committed step among the members
  int rank = -1;                     // this member's rank in the configuration
  std::vector<int> slots;
  std::vector<std::int64_t> steps;
  int group = 1;                     // ranks [k·group, (k+1)·group) are one failure domain (dml-run --groups)
  bool finished = false;             // the job reached its last step without this member
  int size() const { return static_cast<int>(slots.size()); }
  // The member that hands its state to rank r when r is behind: the first at the highest step in the same place
  // of its group (with groups of one, the first at the highest step). Groups join whole, so a rank's place is
  // its slot's.
  int source(int r = 0) const {
    for (int s = r % group; s < size(); s += group)
      if (steps[static_cast<std::size_t>(s)] == step) return s;
    fail<comm_error>("dml::ft: no member of the configuration holds step ", step, " for place ", r % group,
                     " of a group");
  }
  bool behind(int r) const { return steps[static_cast<std::size_t>(r)] < step; }
};

enum class verdict { commit, commit_and_reconfigure, abort, fenced };

class session {
 public:
  explicit session(session_options o) : opt_(std::move(o)) {
    control_ = open("control");
    beat_ = std::thread([this] { beat(); });
  }
  session(const session&) = delete;
  session& operator=(const session&) = delete;
  ~session() {
    stop_ = true;
    if (beat_.joinable()) beat_.join();
  }
  const session_options& options() const { return opt_; }

  // Waits for the coordinator to form a configuration with this member in it; `step` is this member's
  // committed step (0 for a new start), `ran` the highest step it started (a failed or tentative one: the
  // coordinator counts the steps lost, those run but never committed).
  quorum join(std::int64_t step, std::int64_t ran = 0) {
    const auto f = request(make_frame("QUORUM", step, std::max(step, ran)));
    quorum q;
    if (f.verb() == "FINISHED") {
      q.finished = true;
      q.step = f.number(1);
      return q;
    }
    if (f.verb() != "QUORUM") fail<comm_error>("dml::ft: asked for a quorum, the coordinator answered '", f.verb(), "'");
    q.epoch = f.number(1);
    q.step = f.number(2);
    const auto n = f.number(3);
    for (std::int64_t i = 0; i < n; ++i) {
      const auto& w = f.at(static_cast<std::size_t>(4 + i));
      const auto colon = w.find(':');
      q.slots.push_back(std::stoi(w.substr(0, colon)));
      q.steps.push_back(std::stoll(w.substr(colon + 1)));
      if (q.slots.back() == opt_.slot) q.rank = static_cast<int>(i);
    }
    if (f.words.size() > static_cast<std::size_t>(4 + n)) q.group = static_cast<int>(f.number(static_cast<std::size_t>(4 + n)));
    if (q.group < 1 || q.size() % q.group != 0)
      fail<format_error>("dml::ft: a quorum of ", q.size(), " members in groups of ", q.group);
    if (q.rank < 0) fail<comm_error>("dml::ft: a quorum without this member (slot ", opt_.slot, ")");
    return q;
  }

  // This member's vote on `step` of `epoch`; the verdict is the same for every member of the epoch.
  // A verdict lost with the coordinator (a closed connection, no answer before the timeout) is `fenced`: the
  // epoch went with it, and whether the step committed elsewhere is the next quorum's to say.
  verdict vote(std::int64_t epoch, std::int64_t step, bool ok) {
    frame f;
    try {
      if (!control_) return verdict::fenced;
      f = control_.request(make_frame("VOTE", epoch, step, ok ? "ok" : "failed"), opt_.timeout);
    } catch (const comm_error&) {
      control_.close();
      return verdict::fenced;
    }
    if (f.verb() == "COMMIT") return f.at(1) == "RECONF" ? verdict::commit_and_reconfigure : verdict::commit;
    if (f.verb() == "ABORT") return verdict::abort;
    if (f.verb() == "FENCED") return verdict::fenced;
    fail<comm_error>("dml::ft: voted, the coordinator answered '", f.verb(), "'");
  }

  // The member committed the last step, `step`, and holds the final state (and would report it) or not. True
  // when it is the one to report that state, which it then does and says so with reported(); one member of the
  // job is told so. A holder not told so waits here until the state is reported, and is told to report it if
  // the one told first dies before it says reported().
  bool done(std::int64_t step, bool holds_final_state) {
    const auto f = request(make_frame("DONE", step, holds_final_state ? 1 : 0));
    return f.words.size() > 1 && f.at(1) == "REPORT";
  }
  // The final state is reported (after done() answered true): the holders waiting in done() go.
  void reported() { request(make_frame("REPORTED")); }

 private:
  connection open(const std::string& role, milliseconds timeout = milliseconds(10000)) {
    auto [host, port] = parse_address(opt_.address, "DML_RUN_COORDINATOR");
    connection c(connect_to(host, port, timeout));
    const auto f = c.request(make_frame("HELLO", opt_.token, opt_.slot, opt_.start, role), timeout);
    if (f.verb() != "OK")
      fail<refused_error>("dml::ft: the coordinator at ", opt_.address, " refused slot ", opt_.slot, ": ",
                          f.words.size() > 1 ? f.words[1] : f.verb());
    return c;
  }
  // A question on the control connection; a lost connection is made again and the question asked again (of the
  // coordinator's next start), until the timeout. REFUSED is final.
  frame request(const frame& f) {
    const auto deadline = clock::now() + opt_.timeout;
    std::string first;  // what went wrong first: the question's own failure, said when the time is up
    for (;;) {
      try {
        if (!control_) control_ = open("control", left_until(deadline));
        return control_.request(f, left_until(deadline));
      } catch (const refused_error&) {
        throw;
      } catch (const comm_error& e) {
        control_.close();
        if (first.empty()) first = e.what();
        if (clock::now() >= deadline)
          fail<comm_error>(first, first == e.what() ? "" : dml::detail::cat("; asked again until the timeout: ", e.what()));
        std::this_thread::sleep_for(milliseconds(50));
      }
    }
  }
  // Heartbeats, on a connection of their own; when it is lost, again every 100 ms (a new start of the coordinator
  // refuses them until this member's control connection has said HELLO to it).
  void beat() {
    while (!stop_) {
      try {
        auto c = open("heartbeat", milliseconds(1000));
        while (!stop_) {
          c.send(make_frame("HB"), clock::now() + opt_.heartbeat * 10);
          pause(opt_.heartbeat);
        }
      } catch (const error&) {
        pause(milliseconds(100));
      }
    }
  }
  void pause(milliseconds d) {
    for (auto waited = milliseconds(0); waited < d && !stop_; waited += milliseconds(10))
      std::this_thread::sleep_for(milliseconds(10));
  }

  session_options opt_;
  connection control_;
  std::atomic<bool> stop_{false};
  std::thread beat_;
};

}  // namespace dml::ft
