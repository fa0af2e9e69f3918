// SPDX-License-Identifier: Apache-2.0
// tools/dml-run.cpp — dml-run: starts N ranks of a program, serves their rendezvous store and the coordinator
// (heartbeats, a quorum per configuration, a vote per step: include/dml/ft/coordinator.hpp), restarts ranks
// that die, and reports what happened. Programs that join the coordinator (ft/elastic.hpp) go on through
// deaths; others (plain --comm gloo) end the job when one rank fails. --chaos-* kills ranks on purpose.
// The coordinator runs in a process of its own on a listening socket dml-run holds: when it dies, dml-run starts
// it again on the same socket, from its state file, and the members ask the new start (ft/session.hpp).
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dml/ft/coordinator.hpp"
#include "dml/train/flags.hpp"

namespace {

using namespace dml;
using namespace dml::ft;

std::string random_token() {
  std::ifstream in("/dev/urandom", std::ios::binary);
  unsigned char b[16] = {};
  in.read(reinterpret_cast<char*>(b), sizeof b);
  if (!in) fail<io_error>("dml-run: cannot read /dev/urandom for the job token");
  std::string t;
  char h[3];
  for (unsigned char c : b) {
    std::snprintf(h, sizeof h, "%02x", c);
    t += h;
  }
  return t;
}

struct rank_proc {
  pid_t pid = -1;
  std::int64_t start = 0;
  bool running = false, stopped = false;
  std::string last;  // how its last process ended
  bool ended_with_group = false;  // dml-run killed it because a rank of its group died
  clock::time_point resume_at{};
};

std::string describe(int status) {
  if (WIFEXITED(status)) return dml::detail::cat("exited with status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return dml::detail::cat("killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  return "ended";
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(std::min<double>(v.size() - 1, std::ceil(p * v.size()) - 1));
  return v[i];
}

volatile sig_atomic_t interrupted = 0;
void on_signal(int) { interrupted = 1; }

// The coordinator in a process of its own, started again when it ends (a crash, or --chaos-coordinator), on the
// listening socket dml-run keeps, from its state file. dml-run reads its status on a supervisor connection.
class coordinator_process {
 public:
  coordinator_process(coordinator_options o, std::ostream& log) : opt_(std::move(o)), log_(log) { start(); }
  ~coordinator_process() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  int starts() const { return starts_; }
  const coordinator_status& status() const { return status_; }

  // True when the coordinator's process ended since the last call (it is not started again here).
  bool ended(std::string& how) {
    int st = 0;
    if (pid_ <= 0 || ::waitpid(pid_, &st, WNOHANG) != pid_) return false;
    how = describe(st);
    pid_ = -1;
    link_.close();
    return true;
  }
  void start() {
    log_.flush();
    std::fflush(nullptr);  // nothing buffered is written twice
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) fail<io_error>("dml-run: fork: ", std::strerror(errno));
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // it never outlives dml-run
      if (::getppid() != parent) ::_exit(1);
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      try {
        coordinator c(opt_);
        for (;;) c.poll_once(milliseconds(100));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "dml-run: the coordinator failed: %s\n", e.what());
      }
      ::_exit(1);
    }
    pid_ = pid;
    ++starts_;
    log_ << "dml-run: coordinator start " << starts_ << " is pid " << pid << std::endl;
  }
  // Reads the coordinator's status; keeps the last one while it is away.
  void refresh() {
    if (auto f = ask(make_frame("STATUS"))) status_ = coordinator_status::decode(*f);
  }
  // A rank's process ended: the coordinator declares it dead at once, not at the heartbeat deadline.
  void process_exited(int slot, const std::string& why) { ask(make_frame("EXITED", slot, why)); }

 private:
  std::optional<frame> ask(const frame& f) {
    if (pid_ <= 0) return std::nullopt;
    try {
      if (!link_) {
        link_ = connection(connect_to(opt_.host, port_of(opt_.listen_fd), milliseconds(2000)));
        if (link_.request(make_frame("HELLO", opt_.token, -1, 0, "supervisor"), milliseconds(2000)).verb() != "OK")
          fail<comm_error>("dml-run: the coordinator refused its supervisor");
      }
      return link_.request(f, milliseconds(2000));
    } catch (const comm_error&) {
      link_.close();  // a coordinator that died: dml-run sees its process end and starts it again
      return std::nullopt;
    }
  }
  coordinator_options opt_;
  std::ostream& log_;
  pid_t pid_ = -1;
  int starts_ = 0;
  connection link_;
  coordinator_status status_;
};

}  // namespace

int main(int argc, char** argv) {
  int nproc = 1, min_members = 0, max_restarts = 10, chaos_events = 0, chaos_keep = 1, groups = 0;
  std::string host = "127.0.0.1", chaos_signals = "kill", log_file;
  std::int64_t heartbeat_ms = 1000, join_ms = 5000, stall_s = 120, chaos_every_ms = 2000, chaos_seed = 1;
  double chaos_double = 0.0, chaos_coordinator = 0.0;
  dml::flags cli("dml-run",
                 "Starts N ranks of PROGRAM with a rendezvous store and a coordinator; restarts ranks that die.\n"
                 "usage: dml-run [flags] PROGRAM [ARGS...]",
                 "Each rank gets DML_RANK, DML_WORLD_SIZE and DML_STORE (comm::gloo's rendezvous, reached with the job\n"
                 "token DML_RUN_TOKEN), and DML_RUN_COORDINATOR and DML_RUN_SLOT for programs that train through\n"
                 "deaths (ft/elastic.hpp). The last line: recoveries=N steps_lost=K (steps run but never committed)\n"
                 "restarts=R last_step=S recovery_seconds=P50/P99/MAX coordinator_starts=C.");
  cli.add("--nproc", nproc, "N", "ranks to start").min(1);
  cli.add("--min", min_members, "N", "the fewest ranks a configuration may have (0: --nproc, no shrinking)").min(0);
  cli.add("--groups", groups, "G",
          "failure domains: G groups of nproc / G consecutive ranks; a rank's death ends and restarts its group, and "
          "configurations take whole groups (0: every rank its own)")
      .min(0);
  cli.add("--host", host, "HOST", "the interface the store and coordinator listen on");
  cli.add("--heartbeat-deadline-ms", heartbeat_ms, "MS", "a rank silent this long is dead").min(100);
  cli.add("--join-deadline-ms", join_ms, "MS", "a quorum waits this long for live ranks that have not asked").min(100);
  cli.add("--max-restarts", max_restarts, "N", "restarts of dead ranks over the whole job").min(0);
  cli.add("--stall-seconds", stall_s, "S", "ends the job when no step commits for this long").min(1);
  cli.add("--log", log_file, "FILE", "the coordinator's events (default: stderr)");
  cli.add("--chaos-events", chaos_events, "N", "kill or freeze ranks this many times, at random").min(0);
  cli.add("--chaos-every-ms", chaos_every_ms, "MS", "mean time between chaos events").min(1);
  cli.add("--chaos-seed", chaos_seed, "S", "seed of the chaos (victims, moments, signals)");
  cli.add("--chaos-signals", chaos_signals, "LIST", "kill, stop (SIGSTOP, SIGCONT 0.5-2.5 s later) or kill,stop");
  cli.add("--chaos-double", chaos_double, "P", "chance that an event hits two ranks at once").min(0.0).max(1.0);
  cli.add("--chaos-coordinator", chaos_coordinator, "P",
          "chance that an event kills the coordinator instead (SIGKILL; dml-run starts it again)")
      .min(0.0)
      .max(1.0);
  cli.add("--chaos-keep", chaos_keep, "N",
          "a SIGKILL never leaves fewer than N live ranks holding the last committed step (it freezes instead): 1 "
          "for replicas, members - copies for state held in parts")
      .min(1);
  // dml-run's flags come first; the program and its arguments are the rest of the line.
  int first = 1;
  while (first < argc && std::string_view(argv[first]).starts_with("--")) {
    const std::string_view w = argv[first];
    first += (w.find('=') != std::string_view::npos || w == "--help") ? 1 : 2;
  }
  first = std::min(first, argc);
  if (auto rc = cli.parse_for_main(first, argv, [&] {
        if (first >= argc && !cli.given("--help")) fail<invalid_argument>("expected a PROGRAM after the flags");
        if (min_members > nproc)
          fail<invalid_argument>("--min ", min_members, " is above --nproc ", nproc);
        if (groups > 0 && nproc % groups != 0)
          fail<invalid_argument>("--groups ", groups, " does not divide --nproc ", nproc, " into groups of equal size");
        if (chaos_signals != "kill" && chaos_signals != "stop" && chaos_signals != "kill,stop")
          fail<invalid_argument>("--chaos-signals: expected kill, stop or kill,stop, found '", chaos_signals, "'");
      }))
    return *rc;
  if (min_members == 0) min_members = nproc;
  const int group = groups > 0 ? nproc / groups : 1;  // ranks per group

  std::ofstream log_out;
  if (!log_file.empty()) {
    log_out.open(log_file);
    if (!log_out) {
      std::fprintf(stderr, "dml-run: error: cannot write --log %s\n", log_file.c_str());
      return 2;
    }
  }
  std::ostream& log = log_file.empty() ? std::cerr : log_out;
  try {
    const std::string token = random_token();
    const socket_fd listener = listen_on(host, 0);
    char dir_template[] = "/tmp/dml-run-XXXXXX";
    if (!::mkdtemp(dir_template)) fail<io_error>("dml-run: cannot make a directory in /tmp: ", std::strerror(errno));
    const std::filesystem::path state_dir = dir_template;
    struct remove_dir {
      std::filesystem::path p;
      ~remove_dir() {
        std::error_code ec;
        std::filesystem::remove_all(p, ec);
      }
    } remove_state{state_dir};
    const std::string address = dml::detail::cat(host, ":", port_of(listener));
    log << "dml-run: coordinator and store at " << address << std::endl;
    coordinator_process coord({.token = token, .nproc = nproc, .min_members = min_members, .group_size = group,
                               .heartbeat_deadline = milliseconds(heartbeat_ms), .join_deadline = milliseconds(join_ms),
                               .host = host, .port = 0, .log = &log, .listen_fd = listener.get(),
                               .state_file = (state_dir / "coordinator.state").string()},
                              log);
    ::signal(SIGINT, on_signal);
    ::signal(SIGTERM, on_signal);

    std::vector<rank_proc> ranks(static_cast<std::size_t>(nproc));
    auto spawn = [&](int slot) {
      auto& r = ranks[static_cast<std::size_t>(slot)];
      const pid_t pid = ::fork();
      if (pid < 0) fail<io_error>("dml-run: fork: ", std::strerror(errno));
      if (pid == 0) {
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // no rank outlives dml-run
        ::setenv("DML_RANK", std::to_string(slot).c_str(), 1);
        ::setenv("DML_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
        ::setenv("DML_STORE", ("tcp:" + address).c_str(), 1);
        ::setenv("DML_RUN_TOKEN", token.c_str(), 1);
        ::setenv("DML_RUN_COORDINATOR", address.c_str(), 1);
        ::setenv("DML_RUN_SLOT", std::to_string(slot).c_str(), 1);
        ::setenv("DML_RUN_START", std::to_string(r.start).c_str(), 1);
        ::setenv("DML_RUN_NPROC", std::to_string(nproc).c_str(), 1);
        ::setenv("DML_RUN_GROUP_SIZE", std::to_string(group).c_str(), 1);
        ::execvp(argv[first], argv + first);
        std::fprintf(stderr, "dml-run: cannot run %s: %s\n", argv[first], std::strerror(errno));
        ::_exit(127);
      }
      r.pid = pid;
      r.running = true;
      r.stopped = false;
      log << "dml-run: slot " << slot << " start " << r.start << " is pid " << pid << std::endl;
    };
    for (int s = 0; s < nproc; ++s) spawn(s);

    std::mt19937_64 rng(static_cast<std::uint64_t>(chaos_seed));
    auto next_gap = [&] {
      return milliseconds(std::uniform_int_distribution<std::int64_t>(chaos_every_ms / 2, chaos_every_ms * 3 / 2)(rng));
    };
    auto next_chaos = clock::now() + next_gap();
    int chaos_left = chaos_events, restarts = 0;
    std::vector<double> recovery;                       // a chaos event to the next commit of a later epoch
    bool pending_event = false;  // a chaos event waits for its recovery, which began at event_at
    clock::time_point event_at{};
    std::int64_t event_epoch = 0, commits_seen = 0;
    auto last_progress = clock::now();
    bool failed = false;
    std::string why_failed;

    for (;;) {
      std::this_thread::sleep_for(milliseconds(10));
      if (std::string how; coord.ended(how)) {
        log << "dml-run: the coordinator " << how << std::endl;
        if (coord.starts() <= max_restarts) {
          coord.start();
        } else {
          failed = true;
          why_failed = dml::detail::cat("the coordinator ", how, " after ", coord.starts(), " starts (--max-restarts)");
        }
      }
      coord.refresh();
      const auto& cs = coord.status();
      const auto now = clock::now();
      if (cs.stats.commits != commits_seen) {
        commits_seen = cs.stats.commits;
        last_progress = now;
        if (pending_event && cs.epoch > event_epoch) {
          recovery.push_back(std::chrono::duration<double>(now - event_at).count());
          pending_event = false;
          log << "dml-run: recovery=" << recovery.back() << " s (a chaos event to the next commit of a new configuration)"
              << std::endl;
        }
      }
      // Reap the ranks that ended.
      for (int s = 0; s < nproc; ++s) {
        auto& r = ranks[static_cast<std::size_t>(s)];
        if (!r.running) continue;
        int status = 0;
        if (::waitpid(r.pid, &status, WNOHANG) != r.pid) continue;
        r.running = false;
        r.last = describe(status);
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        log << "dml-run: slot " << s << " (pid " << r.pid << ") " << r.last << std::endl;
        if (ok) continue;
        coord.process_exited(s, r.last);
        const bool elastic = cs.joined(s);
        // A group fails whole: its other ranks are ended too and start again with it (one restart, not several).
        const bool with_group = std::exchange(r.ended_with_group, false);
        if (elastic && group > 1 && !with_group && !cs.finished)
          for (int t = s - s % group; t < s - s % group + group; ++t) {
            auto& mate = ranks[static_cast<std::size_t>(t)];
            if (t == s || !mate.running || mate.ended_with_group) continue;
            log << "dml-run: slot " << t << " ends with its group (slot " << s << ")" << std::endl;
            mate.ended_with_group = true;
            ::kill(mate.pid, SIGKILL);
          }
        if (elastic && !cs.finished && (with_group || restarts < max_restarts)) {
          if (!with_group) ++restarts;
          ++r.start;
          spawn(s);
        } else if (!cs.finished) {
          failed = true;
          why_failed = dml::detail::cat("slot ", s, " ", r.last,
                                        elastic ? dml::detail::cat(" after ", restarts, " restarts (--max-restarts)")
                                                : " (the program does not train through deaths)");
        }
      }
      // Frozen ranks resume when their time comes.
      for (auto& r : ranks)
        if (r.running && r.stopped && now >= r.resume_at) {
          ::kill(r.pid, SIGCONT);
          r.stopped = false;
        }
      // Chaos: after the first commit, a random victim (or two) at random moments.
      if (chaos_left > 0 && commits_seen > 0 && now >= next_chaos && !cs.finished &&
          std::bernoulli_distribution(chaos_coordinator)(rng)) {
        log << "dml-run: chaos: SIGKILL the coordinator (pid " << coord.pid() << ") at step " << cs.stats.last_step
            << std::endl;
        ::kill(coord.pid(), SIGKILL);
        if (!pending_event) {
          pending_event = true;
          event_at = now;
          event_epoch = cs.epoch;
        }
        --chaos_left;
        next_chaos = now + next_gap();
      }
      if (chaos_left > 0 && commits_seen > 0 && now >= next_chaos && !cs.finished) {
        std::vector<int> live;
        for (int s = 0; s < nproc; ++s)
          if (ranks[static_cast<std::size_t>(s)].running && !ranks[static_cast<std::size_t>(s)].stopped) live.push_back(s);
        std::shuffle(live.begin(), live.end(), rng);
        const int victims = std::min<int>(static_cast<int>(live.size()) - 1,
                                          std::bernoulli_distribution(chaos_double)(rng) ? 2 : 1);
        std::vector<int> killed;  // in this event
        for (int i = 0; i < victims; ++i) {
          const int victim = live[static_cast<std::size_t>(i)];
          auto& r = ranks[static_cast<std::size_t>(victim)];
          bool stop = chaos_signals == "stop" || (chaos_signals == "kill,stop" && std::bernoulli_distribution(0.5)(rng));
          // The state lives in the members' memory: a SIGKILL never leaves fewer than --chaos-keep processes that
          // hold the last committed step (a frozen one still holds it); that one is frozen instead.
          // With groups, the victim's whole group goes.
          auto same_group = [&](int a, int b) { return a / group == b / group; };
          int other_holders = 0;
          for (int s = 0; s < nproc; ++s)
            if (!same_group(s, victim) &&
                std::ranges::none_of(killed, [&](int k) { return same_group(k, s); }) &&
                ranks[static_cast<std::size_t>(s)].running && cs.holds_last_step(s))
              ++other_holders;
          if (!stop && other_holders < chaos_keep) stop = true;
          if (!stop) killed.push_back(victim);
          log << "dml-run: chaos: " << (stop ? "SIGSTOP" : "SIGKILL") << " slot " << victim
              << " at step " << cs.stats.last_step << std::endl;
          ::kill(r.pid, stop ? SIGSTOP : SIGKILL);
          if (stop) {
            r.stopped = true;
            r.resume_at = now + milliseconds(std::uniform_int_distribution<int>(500, 2500)(rng));
          }
        }
        if (victims > 0 && !pending_event) {
          pending_event = true;
          event_at = now;
          event_epoch = cs.epoch;
        }
        --chaos_left;
        next_chaos = now + next_gap();
      }
      if (interrupted) {
        failed = true;
        why_failed = "interrupted";
      }
      if (!failed && now - last_progress > std::chrono::seconds(stall_s) && cs.any_joined()) {
        failed = true;
        why_failed = dml::detail::cat("no step committed for ", stall_s, " s (--stall-seconds)");
      }
      bool any_running = false;
      for (const auto& r : ranks) any_running |= r.running;
      if (failed) {
        for (auto& r : ranks)
          if (r.running) {
            ::kill(r.pid, SIGCONT);
            ::kill(r.pid, SIGTERM);
          }
        const auto grace = clock::now() + std::chrono::seconds(5);
        for (auto& r : ranks) {
          while (r.running) {
            int status = 0;
            if (::waitpid(r.pid, &status, WNOHANG) == r.pid) {
              r.running = false;
              r.last = describe(status);
            } else if (clock::now() > grace) {
              ::kill(r.pid, SIGKILL);
            } else {
              std::this_thread::sleep_for(milliseconds(10));
            }
          }
        }
        break;
      }
      if (!any_running) break;
      // The job is over: ranks left over (a frozen one, say) are ended, so no process outlives dml-run.
      if (cs.finished) {
        bool members_done = true;
        for (int s = 0; s < nproc; ++s)
          if (ranks[static_cast<std::size_t>(s)].running && cs.in_final_epoch(s)) members_done = false;
        if (members_done)
          for (auto& r : ranks)
            if (r.running) {
              ::kill(r.pid, SIGCONT);
              ::kill(r.pid, SIGTERM);
            }
      }
    }

    coord.refresh();
    const auto& cs = coord.status();
    const auto& st = cs.stats;
    bool all_ok = !failed;
    if (!cs.finished && cs.any_joined()) all_ok = false;
    if (!cs.any_joined())
      for (const auto& r : ranks) all_ok &= r.last == "exited with status 0";
    std::vector<double> rec = recovery.empty() ? st.recovery_seconds : recovery;
    if (!all_ok) {
      std::fprintf(stderr, "dml-run: the job failed: %s\n", why_failed.empty() ? "a rank failed" : why_failed.c_str());
      for (int s = 0; s < nproc; ++s)
        std::fprintf(stderr, "dml-run:   slot %d (start %lld): %s\n", s, static_cast<long long>(ranks[static_cast<std::size_t>(s)].start),
                     ranks[static_cast<std::size_t>(s)].last.c_str());
    }
    std::printf("recoveries=%lld steps_lost=%lld restarts=%d last_step=%lld recovery_seconds=%.3f/%.3f/%.3f "
                "coordinator_starts=%d\n",
                static_cast<long long>(st.recoveries), static_cast<long long>(st.steps_lost), restarts,
                static_cast<long long>(st.last_step), percentile(rec, 0.5), percentile(rec, 0.99),
                rec.empty() ? 0.0 : *std::max_element(rec.begin(), rec.end()), coord.starts());
    return all_ok ? 0 : 1;
  } catch (const dml::error& e) {
    std::fprintf(stderr, "dml-run: error: %s\n", e.what());
    return 1;
  }
}
