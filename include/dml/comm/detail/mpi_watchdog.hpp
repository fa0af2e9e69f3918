// SPDX-License-Identifier: Apache-2.0
// dml/comm/detail/mpi_watchdog.hpp — what keeps a comm::mpi job from hanging silently: the watchdog that aborts an
// operation past its timeout or after a lost peer, the SIGTERM hook, and the request of a non-blocking operation.
// Sits on comm/detail/mpi_types.hpp; used by comm/mpi.hpp.
#pragma once

#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/comm/detail/mpi_types.hpp"

namespace dml::comm {

namespace detail::mpi_impl {

// ---- Losing a peer. A rank killed outright (SIGKILL, the OOM killer, a crash) leaves its peers
// waiting in a collective that cannot complete. Open MPI's shared-memory transport never notices,
// and its launcher (mpirun/orted, Open MPI 4.1) answers the death by sending SIGTERM to every other
// rank and SIGKILL one second later (odls_base_sigkill_timeout), so by default the survivors vanish
// without a word about what they were doing. comm::mpi therefore learns, when it is built, which of
// its peers are processes on this host (pid, start time, host and pid namespace), and its watchdog
// uses that in two ways:
//  - on SIGTERM (a handler that only sets a flag), it reports the operation in flight and the peers
//    whose processes are gone, then hands the signal on to the disposition it replaced, so the rank
//    still ends the way the launcher asked, within the launcher's grace second;
//  - when no launcher steps in (mpirun --enable-recovery, other launchers), an operation that has
//    waited peer_check while a peer's process is gone ends the job through MPI_Abort, like the timeout.
// Peers on other hosts cannot be checked from here; their loss is reported by the ranks on their host,
// and here as the timeout.

// Who a rank is, sent as bytes in the constructor's all-gather.
struct process_id {
  std::int64_t pid = -1;
  std::uint64_t start = 0;  // start time in clock ticks after boot: tells a reused pid from the original
  std::uint64_t host = 0;   // hash of host name and pid namespace; 0 when unknown
  std::int32_t world_rank = -1;
  std::int32_t pad = 0;
};

enum class liveness { alive, gone, unknown };

#if defined(__linux__)
// State and start time from /proc/<pid>/stat (fields 3 and 22; field 2 is the name in parentheses).
inline liveness read_stat(std::int64_t pid, char& state, std::uint64_t& start) {
  char path[48];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  std::FILE* f = std::fopen(path, "r");
  if (!f) return errno == ENOENT || errno == ESRCH ? liveness::gone : liveness::unknown;
  char buf[1024];
  const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');
  if (!p || p[1] != ' ' || !p[2]) return liveness::unknown;
  p += 2;
  state = *p;
  for (int field = 3; field < 22 && p; ++field)
    if ((p = std::strchr(p, ' '))) ++p;
  if (!p) return liveness::unknown;
  start = std::strtoull(p, nullptr, 10);
  return liveness::alive;
}
#endif

inline process_id this_process() {
  process_id me;
  int w = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &w);
  me.world_rank = w;
#if defined(__linux__)
  me.pid = ::getpid();
  char state = 0;
  if (read_stat(me.pid, state, me.start) != liveness::alive) return me;  // host stays 0: never checked
  char key[512] = {};
  ::gethostname(key, 255);
  const std::size_t len = std::strlen(key);
  const ssize_t ns = ::readlink("/proc/self/ns/pid", key + len, sizeof key - 1 - len);
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a: the same value in every process
  for (std::size_t i = 0; i < len + std::size_t(ns > 0 ? ns : 0); ++i) h = (h ^ std::uint8_t(key[i])) * 0x100000001b3ull;
  me.host = h | 1;
#endif
  return me;
}

inline liveness check_process(const process_id& p) {
#if defined(__linux__)
  char state = 0;
  std::uint64_t start = 0;
  const auto l = read_stat(p.pid, state, start);
  if (l != liveness::alive) return l;
  return state == 'Z' || state == 'X' || start != p.start ? liveness::gone : liveness::alive;
#else
  (void)p;
  return liveness::unknown;
#endif
}

// Process-wide: the SIGTERM handler only records that the signal came (it may run on any thread, in
// the middle of an MPI call); the watchdogs do the rest on their own threads.
struct sigterm_hook {
  static inline std::atomic<int> watchers{0};      // watchdogs alive that will act on the flag
  static inline std::atomic<bool> pending{false};  // SIGTERM arrived
  static inline std::atomic<bool> claimed{false};  // one watchdog reports and hands the signal on
  static inline std::atomic<bool> passed_on{false};
  static inline struct sigaction previous{};
  static inline std::once_flag once;

  static void handler(int) {
    if (watchers.load() == 0) pass_on();  // nobody to report: behave as before
    else pending.store(true);
  }
  // Restores the disposition the hook replaced and raises the signal again under it.
  static void pass_on() {
    ::sigaction(SIGTERM, &previous, nullptr);
    ::raise(SIGTERM);
  }
  // Installed once, and only over a disposition that would end the process or is the program's own
  // handler (which still runs, after the report): a program that ignores SIGTERM keeps ignoring it.
  static void install() {
    std::call_once(once, [] {
      struct sigaction now {};
      if (::sigaction(SIGTERM, nullptr, &now) != 0 || now.sa_handler == SIG_IGN) return;
      struct sigaction sa {};
      sa.sa_handler = &handler;
      sa.sa_flags = SA_RESTART;  // the program's own reads and writes do not see EINTR
      ::sigemptyset(&sa.sa_mask);
      ::sigaction(SIGTERM, &sa, &previous);
    });
  }
};

// Watches the collective in flight; past the timeout it reports the operation and the rank on
// stderr and calls MPI_Abort, because a peer that never arrives cannot be recovered from. It wakes
// 20 times a second (a few microseconds each), so that a SIGTERM is acted on well within a second.
// The calling thread only stores a sequence number and the operation's name (plain stores, no
// clock, no lock): a 4 KiB all-reduce takes about a microsecond, and the wrapper must not show
// next to raw MPI. The watchdog polls and measures how long one operation has stayed. It also
// acts on a lost peer (see "Losing a peer" above).
class watchdog {
 public:
  watchdog(int rank, int size, std::chrono::milliseconds timeout, std::chrono::milliseconds peer_check,
           bool on_sigterm)
      : rank_(rank), size_(size), timeout_(timeout), peer_check_(peer_check), on_sigterm_(on_sigterm) {
    if (on_sigterm_) {
      sigterm_hook::install();
      sigterm_hook::watchers.fetch_add(1);
    }
    thread_ = std::thread([this] { loop(); });
  }
  ~watchdog() {
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    if (on_sigterm_) sigterm_hook::watchers.fetch_sub(1);
  }
  void enter(const char* op) {
    seq_.store(seq_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    last_.store(op, std::memory_order_relaxed);
    op_.store(op, std::memory_order_release);
  }
  void leave() { op_.store(nullptr, std::memory_order_release); }
  // The peers' identities, index = rank in this communicator.
  void set_peers(std::vector<process_id> peers) {
    std::lock_guard lk(m_);
    peers_ = std::move(peers);
  }

 private:
  using clock = std::chrono::steady_clock;
  // How long a rank that saw SIGTERM between operations waits for its main thread to enter the next
  // one (which a lost peer keeps from completing), so the report can name it; well inside the
  // launcher's grace second.
  static constexpr std::chrono::milliseconds sigterm_grace{300};
  // A rank that reports a lost peer ends no sooner than this after SIGTERM: its peers, terminated at
  // the same moment, must still see it alive when they look, or they would name it as lost too.
  static constexpr std::chrono::milliseconds sigterm_hold{500};
  // A watchdog with nothing to report lets the others go first by this much more.
  static constexpr std::chrono::milliseconds quiet_after{100};
  // How long an operation waits before the watchdog starts looking at the peers.
  static constexpr std::chrono::milliseconds look_after{100};

  void loop() {
    const auto poll = std::clamp(timeout_ / 8, std::chrono::milliseconds(10), std::chrono::milliseconds(50));
    std::uint64_t last = ~std::uint64_t(0);
    auto since = clock::now();
    std::unique_lock lk(m_);
    while (!stop_) {
      cv_.wait_for(lk, poll, [&] { return stop_; });
      if (stop_) break;
      const char* op = op_.load(std::memory_order_acquire);
      const std::uint64_t seq = seq_.load(std::memory_order_relaxed);
      const auto now = clock::now();
      if (on_sigterm_ && sigterm_hook::pending.load() && !sigterm_hook::passed_on.load()) {
        on_sigterm(op, now);
        continue;  // still here after passing it on: the program's own handler kept the process
      }
      if (!op || seq != last) {  // idle, or a new operation since the last look
        last = seq;
        since = now;
        continue;
      }
      const auto waited = now - since;
      // Peers are looked at from early on in a wait (a /proc read per peer on this host, each poll),
      // so that the first ones found gone are the lost ones, not ranks that ended after them.
      if (peer_check_.count() > 0 && lost_.empty() && waited >= std::min(look_after, peer_check_))
        lost_ = lost_peers();
      if (!lost_.empty() && waited >= peer_check_) {
        report(op, dml::detail::cat(" waited ", seconds(waited), " s and cannot complete: ", describe(lost_),
                                    "; aborting the job"));
        MPI_Abort(MPI_COMM_WORLD, 125);
      }
      if (waited < timeout_) continue;
      const auto lost = lost_.empty() ? lost_peers() : lost_;
      report(op, dml::detail::cat(" did not complete within ", seconds(timeout_), " s",
                                  lost.empty() ? std::string() : "; " + describe(lost), "; aborting the job"));
      MPI_Abort(MPI_COMM_WORLD, 124);  // the whole job: a stuck peer may sit in any group
    }
  }

  void on_sigterm(const char* op, clock::time_point now) {
    if (!term_seen_) {  // look at once, before the peers terminated with us start to go
      term_seen_ = now;
      term_lost_ = lost_.empty() ? lost_peers() : lost_;
    }
    const auto waited = now - *term_seen_;
    // Priority among watchdogs (one per communicator): one with an operation in flight reports at once;
    // one without, after the grace, lost peers first; quietly when it has nothing to say.
    const bool quiet = !op && term_lost_.empty();
    if (!op && waited < sigterm_grace + (quiet ? quiet_after : clock::duration::zero())) return;
    if (sigterm_hook::claimed.exchange(true)) return;
    if (!quiet) {
      const std::string what = op ? std::string(op) : dml::detail::cat(
          "the next operation after ", last_.load(std::memory_order_relaxed) ? last_.load() : "none");
      report(what.c_str(),
             dml::detail::cat(op ? " cannot complete: " : " cannot start: ",
                              term_lost_.empty() ? "every peer on this host is alive" + remote_note()
                                                 : describe(term_lost_),
                              "; terminated by SIGTERM (the launcher ends the job)"));
    }
    if (!term_lost_.empty()) std::this_thread::sleep_until(*term_seen_ + sigterm_hold);
    sigterm_hook::passed_on.store(true);
    sigterm_hook::pass_on();
  }
  std::vector<int> lost_peers() const {
    std::vector<int> lost;
    if (peers_.size() != std::size_t(size_)) return lost;
    const auto host = peers_[std::size_t(rank_)].host;
    for (int p = 0; p < size_; ++p)
      if (p != rank_ && host != 0 && peers_[std::size_t(p)].host == host &&
          check_process(peers_[std::size_t(p)]) == liveness::gone)
        lost.push_back(p);
    return lost;
  }
  std::string describe(const std::vector<int>& lost) const {
    std::string s = lost.size() == 1 ? "peer rank " : "peer ranks ";
    for (std::size_t i = 0; i < lost.size(); ++i) {
      const auto& q = peers_[std::size_t(lost[i])];
      s += dml::detail::cat(i ? ", " : "", lost[i], " (",
                            q.world_rank != lost[i] ? dml::detail::cat("world rank ", q.world_rank, ", ") : "",
                            "pid ", q.pid, ")");
    }
    return s + (lost.size() == 1 ? " has exited" : " have exited");
  }
  std::string remote_note() const {
    if (peers_.size() != std::size_t(size_)) return " (peers unknown)";
    std::string s;
    for (int p = 0; p < size_; ++p)
      if (p != rank_ && (peers_[std::size_t(p)].host == 0 || peers_[std::size_t(p)].host != peers_[std::size_t(rank_)].host))
        s += dml::detail::cat(s.empty() ? "" : ", ", p);
    return s.empty() ? std::string() : " (ranks " + s + " are elsewhere and were not checked)";
  }
  static std::string seconds(clock::duration d) {
    char text[32];
    std::snprintf(text, sizeof text, "%.1f", std::chrono::duration<double>(d).count());
    return text;
  }
  void report(const char* op, const std::string& what) const {
    std::fprintf(stderr, "dml::comm::mpi: rank %d of %d: %s%s\n", rank_, size_, op, what.c_str());
    std::fflush(stderr);
  }

  int rank_, size_;
  std::chrono::milliseconds timeout_, peer_check_;
  bool on_sigterm_;
  std::atomic<const char*> op_{nullptr};
  std::atomic<const char*> last_{nullptr};
  std::atomic<std::uint64_t> seq_{0};
  std::mutex m_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<process_id> peers_;
  std::optional<clock::time_point> term_seen_;
  std::vector<int> term_lost_;
  std::vector<int> lost_;  // peers first found gone while an operation waited
  std::thread thread_;
};

struct watch {
  watchdog& w;
  watch(watchdog& wd, const char* op) : w(wd) { w.enter(op); }
  ~watch() { w.leave(); }
  watch(const watch&) = delete;
  watch& operator=(const watch&) = delete;
};

struct request_state_mpi final : request_state {
  MPI_Request req = MPI_REQUEST_NULL;
  std::shared_ptr<watchdog> wd;
  const char* op = "";
  std::function<void(const MPI_Status&)> after;  // avg division, in-place moves, count checks
  std::vector<int> keep;                          // counts and displacements MPI reads until done
  bool receive = false;                           // a point-to-point receive, which cancel() may withdraw

  void finish(const MPI_Status& st) {
    if (after) {
      auto f = std::move(after);
      after = nullptr;
      f(st);
    }
  }
  bool test() override {
    int flag = 0;
    MPI_Status st;
    DML_CHECK_MPI(MPI_Test(&req, &flag, &st));
    if (flag) finish(st);
    return flag != 0;
  }
  void wait() override {
    MPI_Status st;
    {
      watch w(*wd, op);
      DML_CHECK_MPI(MPI_Wait(&req, &st));
    }
    finish(st);
  }
  bool cancel() override {
    if (!receive) return false;
    MPI_Status st;
    if (MPI_Cancel(&req) != MPI_SUCCESS || MPI_Wait(&req, &st) != MPI_SUCCESS) return false;
    return true;  // withdrawn, or matched before the cancel took: either way nothing is pending
  }
};

}  // namespace detail::mpi_impl

}  // namespace dml::comm
