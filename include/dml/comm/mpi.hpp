// SPDX-License-Identifier: Apache-2.0
// dml/comm/mpi.hpp — communicator over an MPI communicator: one rank per process (Open MPI).
// Sits on comm/communicator.hpp; how CPU training scales past one process. See DESIGN.md §4.
#pragma once

#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/comm/detail/reduce.hpp"

namespace dml::comm::detail::mpi_impl {

[[noreturn]] inline void fail_call(int rc, const char* call, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  throw comm_error(dml::detail::cat(file, ":", line, ": ", call, " failed: ",
                                    len ? std::string(text, len) : std::string("MPI error ") + std::to_string(rc)));
}

}  // namespace dml::comm::detail::mpi_impl

// Turns an MPI error code (the communicator returns errors, MPI_ERRORS_RETURN) into comm_error.
#define DML_CHECK_MPI(expr)                                                            \
  do {                                                                                 \
    const int dml_mpi_rc_ = (expr);                                                    \
    if (dml_mpi_rc_ != MPI_SUCCESS)                                                    \
      ::dml::comm::detail::mpi_impl::fail_call(dml_mpi_rc_, #expr, __FILE__, __LINE__); \
  } while (0)

namespace dml::comm {

namespace detail::mpi_impl {

// Native MPI types where MPI has them; bf16/fp16 travel as 16-bit words and reduce through
// user-defined ops; any other trivially copyable type travels as bytes.
template <class T>
MPI_Datatype datatype() {
  if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, std::int32_t>) return MPI_INT32_T;
  else if constexpr (std::is_same_v<T, std::int64_t>) return MPI_INT64_T;
  else if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, fp16>) return MPI_UINT16_T;
  else return MPI_BYTE;
}
template <class T>
constexpr std::size_t units() {  // MPI elements per T
  return reducible<T> ? 1 : sizeof(T);
}
template <class T>
int count(std::size_t n, const char* op) {
  const std::size_t c = n * units<T>();
  if (c > std::size_t(INT_MAX))
    fail<invalid_argument>("dml::comm::mpi::", op, ": expected at most ", INT_MAX / units<T>(),
                           " elements (MPI counts are int), found ", n);
  return int(c);
}

template <reducible T, reduce_op Op>
void user_op(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_pair<T>(static_cast<const T*>(in), static_cast<T*>(inout), std::size_t(*len), Op);
}

// Created on first use, after MPI_Init; freed by MPI_Finalize.
template <reducible T>
MPI_Op user_ops(reduce_op op) {
  static const std::array<MPI_Op, 4> ops = [] {
    std::array<MPI_Op, 4> o{};
    DML_CHECK_MPI(MPI_Op_create(&user_op<T, reduce_op::sum>, 1, &o[0]));
    DML_CHECK_MPI(MPI_Op_create(&user_op<T, reduce_op::max>, 1, &o[1]));
    DML_CHECK_MPI(MPI_Op_create(&user_op<T, reduce_op::min>, 1, &o[2]));
    DML_CHECK_MPI(MPI_Op_create(&user_op<T, reduce_op::prod>, 1, &o[3]));
    return o;
  }();
  switch (op) {
    case reduce_op::max: return ops[1];
    case reduce_op::min: return ops[2];
    case reduce_op::prod: return ops[3];
    default: return ops[0];
  }
}

// MPI has no average: reduce as sum, divide on completion.
template <reducible T>
MPI_Op mpi_op(reduce_op op) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, fp16>) {
    return user_ops<T>(op);
  } else {
    switch (op) {
      case reduce_op::max: return MPI_MAX;
      case reduce_op::min: return MPI_MIN;
      case reduce_op::prod: return MPI_PROD;
      default: return MPI_SUM;
    }
  }
}

template <reducible T>
void divide(std::span<T> x, int n) {
  using A = acc_t<T>;
  for (auto& v : x) v = T(A(v) / A(n));
}

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

// Outside the class so that `options opt = {}` works as a default argument inside it.
struct mpi_options {
  // A collective or wait running longer than this aborts the whole job (see watchdog).
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // An operation that has waited this long while the process of a peer on this host is gone ends
  // the job with an error naming the operation and the peer (MPI_Abort, exit status 125). 0: never.
  std::chrono::milliseconds peer_check{std::chrono::seconds(1)};
  // On SIGTERM (how mpirun ends the other ranks when one dies), print the operation in flight and
  // the peers on this host that are gone, then let the signal take its course. See "Losing a peer".
  bool report_on_sigterm = true;
  // Compare counts, types, ops and roots across ranks before each collective, so a mismatch
  // is an invalid_argument on every rank instead of undefined behaviour. Costs one small
  // all-reduce per collective; off by default.
  bool check_arguments = false;
};


class mpi {
 public:
  using options = mpi_options;

  // Initialises MPI for the process's lifetime (MPI_THREAD_MULTIPLE asked for: the watchdog
  // calls MPI_Abort from its own thread); finalises it unless someone else had initialised it.
  class environment {
   public:
    environment(int* argc, char*** argv, int required = MPI_THREAD_MULTIPLE) {
      int inited = 0;
      MPI_Initialized(&inited);
      if (inited) {
        MPI_Query_thread(&provided_);
        return;
      }
      DML_CHECK_MPI(MPI_Init_thread(argc, argv, required, &provided_));
      owned_ = true;
    }
    environment() : environment(nullptr, nullptr) {}
    environment(const environment&) = delete;
    environment& operator=(const environment&) = delete;
    ~environment() {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (owned_ && !finalized) MPI_Finalize();
    }
    int provided() const { return provided_; }

   private:
    int provided_ = 0;
    bool owned_ = false;
  };

  // Borrows comm (it must outlive this object). Sets MPI_ERRORS_RETURN on it so that MPI errors
  // become comm_error instead of aborting. Collective: the ranks tell each other who they are
  // (process, host), so that a rank can name a peer it has lost.
  explicit mpi(MPI_Comm comm = MPI_COMM_WORLD, options opt = {}) : comm_(comm), opt_(opt) {
    DML_CHECK_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    DML_CHECK_MPI(MPI_Comm_rank(comm_, &rank_));
    DML_CHECK_MPI(MPI_Comm_size(comm_, &size_));
    wd_ = std::make_shared<detail::mpi_impl::watchdog>(rank_, size_, opt_.timeout, opt_.peer_check,
                                                       opt_.report_on_sigterm);
    using detail::mpi_impl::process_id;
    const process_id me = detail::mpi_impl::this_process();
    std::vector<process_id> peers(static_cast<std::size_t>(size_));
    {
      detail::mpi_impl::watch w(*wd_, "construction");
      DML_CHECK_MPI(MPI_Allgather(&me, int(sizeof me), MPI_BYTE, peers.data(), int(sizeof me), MPI_BYTE, comm_));
    }
    wd_->set_peers(std::move(peers));
  }
  // Takes ownership: comm is freed with MPI_Comm_free when this object goes.
  static mpi adopt(MPI_Comm comm, options opt = {}) {
    mpi m(comm, opt);
    m.owned_ = true;
    return m;
  }
  mpi(mpi&& o) noexcept
      : comm_(std::exchange(o.comm_, MPI_COMM_NULL)), owned_(std::exchange(o.owned_, false)),
        rank_(o.rank_), size_(o.size_), opt_(o.opt_), wd_(std::move(o.wd_)) {}
  mpi& operator=(mpi&& o) noexcept {
    if (this != &o) {
      release();
      comm_ = std::exchange(o.comm_, MPI_COMM_NULL);
      owned_ = std::exchange(o.owned_, false);
      rank_ = o.rank_;
      size_ = o.size_;
      opt_ = o.opt_;
      wd_ = std::move(o.wd_);
    }
    return *this;
  }
  ~mpi() { release(); }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  MPI_Comm native() const noexcept { return comm_; }

  // ---- all_reduce (in place when send and recv are the same memory)
  template <reducible T>
  void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    prepare_all_reduce<T>(send, recv, op);
    {
      detail::mpi_impl::watch w(*wd_, "all_reduce");
      DML_CHECK_MPI(MPI_Allreduce(in_place(send.data(), recv.data()), recv.data(),
                                  count<T>(recv.size(), "all_reduce"), dt<T>(),
                                  detail::mpi_impl::mpi_op<T>(op), comm_));
    }
    if (op == reduce_op::avg) detail::mpi_impl::divide(recv, size_);
  }
  template <reducible T>
  void all_reduce(std::span<T> data, reduce_op op) {
    all_reduce(std::span<const T>(data), data, op);
  }
  template <reducible T>
  request iall_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    prepare_all_reduce<T>(send, recv, op);
    auto s = state("all_reduce");
    DML_CHECK_MPI(MPI_Iallreduce(in_place(send.data(), recv.data()), recv.data(),
                                 count<T>(recv.size(), "all_reduce"), dt<T>(),
                                 detail::mpi_impl::mpi_op<T>(op), comm_, &s->req));
    if (op == reduce_op::avg) s->after = [recv, n = size_](const MPI_Status&) { detail::mpi_impl::divide(recv, n); };
    return request(std::move(s));
  }
  template <reducible T>
  request iall_reduce(std::span<T> data, reduce_op op) {
    return iall_reduce(std::span<const T>(data), data, op);
  }

  // ---- reduce_scatter: send holds size() blocks of recv's size.
  template <reducible T>
  void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    prepare_reduce_scatter<T>(send, recv, op);
    {
      detail::mpi_impl::watch w(*wd_, "reduce_scatter");
      DML_CHECK_MPI(MPI_Reduce_scatter_block(send.data(), recv.data(), count<T>(recv.size(), "reduce_scatter"),
                                             dt<T>(), detail::mpi_impl::mpi_op<T>(op), comm_));
    }
    if (op == reduce_op::avg) detail::mpi_impl::divide(recv, size_);
  }
  // In place: the result lands in block rank() of data (returned); other blocks are left
  // with unspecified values.
  template <reducible T>
  std::span<T> reduce_scatter(std::span<T> data, reduce_op op) {
    const auto mine = own_block(data, "reduce_scatter");
    prepare_reduce_scatter<T>(std::span<const T>(data), mine, op);
    {
      detail::mpi_impl::watch w(*wd_, "reduce_scatter");
      // MPI leaves an in-place result at the front of the buffer.
      DML_CHECK_MPI(MPI_Reduce_scatter_block(MPI_IN_PLACE, data.data(), count<T>(mine.size(), "reduce_scatter"),
                                             dt<T>(), detail::mpi_impl::mpi_op<T>(op), comm_));
    }
    if (rank_ != 0 && !mine.empty()) std::memmove(mine.data(), data.data(), mine.size_bytes());
    if (op == reduce_op::avg) detail::mpi_impl::divide(mine, size_);
    return mine;
  }
  template <reducible T>
  request ireduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op) {
    prepare_reduce_scatter<T>(send, recv, op);
    auto s = state("reduce_scatter");
    DML_CHECK_MPI(MPI_Ireduce_scatter_block(send.data(), recv.data(), count<T>(recv.size(), "reduce_scatter"),
                                            dt<T>(), detail::mpi_impl::mpi_op<T>(op), comm_, &s->req));
    if (op == reduce_op::avg) s->after = [recv, n = size_](const MPI_Status&) { detail::mpi_impl::divide(recv, n); };
    return request(std::move(s));
  }

  // ---- all_gather: recv holds size() blocks of send's size.
  template <transferable T>
  void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    prepare_all_gather<T>(send, recv);
    detail::mpi_impl::watch w(*wd_, "all_gather");
    DML_CHECK_MPI(MPI_Allgather(gather_in_place(send, recv), count<T>(send.size(), "all_gather"), dt<T>(),
                                recv.data(), count<T>(send.size(), "all_gather"), dt<T>(), comm_));
  }
  template <transferable T>
  void all_gather(std::span<T> data) {
    auto mine = own_block(data, "all_gather");
    all_gather(std::span<const T>(mine), data);
  }
  template <transferable T>
  request iall_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    prepare_all_gather<T>(send, recv);
    auto s = state("all_gather");
    DML_CHECK_MPI(MPI_Iallgather(gather_in_place(send, recv), count<T>(send.size(), "all_gather"), dt<T>(),
                                 recv.data(), count<T>(send.size(), "all_gather"), dt<T>(), comm_, &s->req));
    return request(std::move(s));
  }
  template <transferable T>
  void all_gatherv(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                   std::span<const std::size_t> counts) {
    if (counts.size() != std::size_t(size_))
      fail<invalid_argument>("dml::comm::mpi::all_gatherv: expected ", size_, " counts, found ", counts.size());
    if (send.size() != counts[rank_])
      fail<invalid_argument>("dml::comm::mpi::all_gatherv: expected send of counts[", rank_, "] = ",
                             counts[rank_], " elements, found ", send.size());
    std::vector<int> c(size_), d(size_);
    std::size_t off = 0;
    for (int p = 0; p < size_; ++p) {
      c[p] = count<T>(counts[p], "all_gatherv");
      d[p] = count<T>(off, "all_gatherv");
      off += counts[p];
    }
    if (recv.size() != off)
      fail<invalid_argument>("dml::comm::mpi::all_gatherv: expected recv of sum(counts) = ", off,
                             " elements, found ", recv.size());
    agree<T>("all_gatherv", 0, reduce_op::sum, 0);
    const void* in = send.data() == recv.data() + (d[rank_] / detail::mpi_impl::units<T>())
                         ? MPI_IN_PLACE : static_cast<const void*>(send.data());
    detail::mpi_impl::watch w(*wd_, "all_gatherv");
    DML_CHECK_MPI(MPI_Allgatherv(in, c[rank_], dt<T>(), recv.data(), c.data(), d.data(), dt<T>(), comm_));
  }

  // ---- broadcast
  template <transferable T>
  void broadcast(std::span<T> data, int root) {
    check_rank(root, "broadcast", "root");
    agree<T>("broadcast", data.size(), reduce_op::sum, root);
    detail::mpi_impl::watch w(*wd_, "broadcast");
    DML_CHECK_MPI(MPI_Bcast(data.data(), count<T>(data.size(), "broadcast"), dt<T>(), root, comm_));
  }
  template <transferable T>
  request ibroadcast(std::span<T> data, int root) {
    check_rank(root, "broadcast", "root");
    agree<T>("broadcast", data.size(), reduce_op::sum, root);
    auto s = state("broadcast");
    DML_CHECK_MPI(MPI_Ibcast(data.data(), count<T>(data.size(), "broadcast"), dt<T>(), root, comm_, &s->req));
    return request(std::move(s));
  }

  // ---- reduce to root (recv is read at the root only)
  template <reducible T>
  void reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op, int root) {
    prepare_reduce<T>(send, recv, op, root);
    {
      detail::mpi_impl::watch w(*wd_, "reduce");
      DML_CHECK_MPI(MPI_Reduce(rank_ == root ? in_place(send.data(), recv.data()) : send.data(),
                               recv.data(), count<T>(send.size(), "reduce"), dt<T>(),
                               detail::mpi_impl::mpi_op<T>(op), root, comm_));
    }
    if (op == reduce_op::avg && rank_ == root) detail::mpi_impl::divide(recv, size_);
  }
  template <reducible T>
  void reduce(std::span<T> data, reduce_op op, int root) {
    reduce(std::span<const T>(data), rank_ == root ? data : std::span<T>{}, op, root);
  }
  template <reducible T>
  request ireduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op, int root) {
    prepare_reduce<T>(send, recv, op, root);
    auto s = state("reduce");
    DML_CHECK_MPI(MPI_Ireduce(rank_ == root ? in_place(send.data(), recv.data()) : send.data(), recv.data(),
                              count<T>(send.size(), "reduce"), dt<T>(), detail::mpi_impl::mpi_op<T>(op),
                              root, comm_, &s->req));
    if (op == reduce_op::avg && rank_ == root)
      s->after = [recv, n = size_](const MPI_Status&) { detail::mpi_impl::divide(recv, n); };
    return request(std::move(s));
  }

  // ---- all_to_all: block p of send to rank p, block p of recv from rank p.
  template <transferable T>
  void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    const int c = prepare_all_to_all<T>(send, recv);
    detail::mpi_impl::watch w(*wd_, "all_to_all");
    DML_CHECK_MPI(MPI_Alltoall(in_place(send.data(), recv.data()), c, dt<T>(), recv.data(), c, dt<T>(), comm_));
  }
  template <transferable T>
  request iall_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    const int c = prepare_all_to_all<T>(send, recv);
    auto s = state("all_to_all");
    DML_CHECK_MPI(MPI_Ialltoall(in_place(send.data(), recv.data()), c, dt<T>(), recv.data(), c, dt<T>(), comm_,
                                &s->req));
    return request(std::move(s));
  }
  template <transferable T>
  void all_to_allv(std::span<const std::type_identity_t<T>> send, std::span<const std::size_t> send_counts,
                   std::span<T> recv, std::span<const std::size_t> recv_counts) {
    if (send_counts.size() != std::size_t(size_) || recv_counts.size() != std::size_t(size_))
      fail<invalid_argument>("dml::comm::mpi::all_to_allv: expected ", size_, " send and receive counts, found ",
                             send_counts.size(), " and ", recv_counts.size());
    std::vector<int> sc(size_), sd(size_), rc(size_), rd(size_);
    std::size_t so = 0, ro = 0;
    for (int p = 0; p < size_; ++p) {
      sc[p] = count<T>(send_counts[p], "all_to_allv");
      sd[p] = count<T>(so, "all_to_allv");
      rc[p] = count<T>(recv_counts[p], "all_to_allv");
      rd[p] = count<T>(ro, "all_to_allv");
      so += send_counts[p];
      ro += recv_counts[p];
    }
    if (send.size() != so || recv.size() != ro)
      fail<invalid_argument>("dml::comm::mpi::all_to_allv: expected send of ", so, " and recv of ", ro,
                             " elements, found ", send.size(), " and ", recv.size());
    if (opt_.check_arguments) {
      // what each rank sends to me must be what I expect from it
      std::vector<int> incoming(size_);
      {
        detail::mpi_impl::watch w(*wd_, "all_to_allv");
        DML_CHECK_MPI(MPI_Alltoall(sc.data(), 1, MPI_INT, incoming.data(), 1, MPI_INT, comm_));
      }
      long long bad = -1;
      for (int p = 0; p < size_; ++p)
        if (incoming[p] != rc[p]) bad = p;
      long long worst = bad;
      {
        detail::mpi_impl::watch w(*wd_, "all_to_allv");
        DML_CHECK_MPI(MPI_Allreduce(&bad, &worst, 1, MPI_LONG_LONG, MPI_MAX, comm_));
      }
      if (worst >= 0)
        fail<invalid_argument>("dml::comm::mpi::all_to_allv: send and receive counts disagree",
                               bad >= 0 ? dml::detail::cat("; rank ", bad, " sends ", incoming[bad],
                                                           " elements to rank ", rank_, ", which expects ", rc[bad])
                                        : std::string());
    }
    detail::mpi_impl::watch w(*wd_, "all_to_allv");
    DML_CHECK_MPI(MPI_Alltoallv(in_place(send.data(), recv.data()), sc.data(), sd.data(), dt<T>(), recv.data(),
                                rc.data(), rd.data(), dt<T>(), comm_));
  }

  // ---- point to point
  template <transferable T>
  void send(std::span<const T> data, int peer, int tag) {
    check_rank(peer, "send", "peer");
    detail::mpi_impl::watch w(*wd_, "send");
    DML_CHECK_MPI(MPI_Send(data.data(), count<T>(data.size(), "send"), dt<T>(), peer, tag, comm_));
  }
  template <transferable T>
  void send(std::span<T> data, int peer, int tag) {
    send(std::span<const T>(data), peer, tag);
  }
  template <transferable T>
  request isend(std::span<const T> data, int peer, int tag) {
    check_rank(peer, "send", "peer");
    auto s = state("send");
    DML_CHECK_MPI(MPI_Isend(data.data(), count<T>(data.size(), "send"), dt<T>(), peer, tag, comm_, &s->req));
    return request(std::move(s));
  }
  template <transferable T>
  request isend(std::span<T> data, int peer, int tag) {
    return isend(std::span<const T>(data), peer, tag);
  }
  template <transferable T>
  void recv(std::span<T> data, int peer, int tag) {
    check_rank(peer, "recv", "peer");
    MPI_Status st;
    {
      detail::mpi_impl::watch w(*wd_, "recv");
      DML_CHECK_MPI(MPI_Recv(data.data(), count<T>(data.size(), "recv"), dt<T>(), peer, tag, comm_, &st));
    }
    check_received<T>(st, data.size(), peer, tag);
  }
  template <transferable T>
  request irecv(std::span<T> data, int peer, int tag) {
    check_rank(peer, "recv", "peer");
    auto s = state("recv");
    s->receive = true;
    DML_CHECK_MPI(MPI_Irecv(data.data(), count<T>(data.size(), "recv"), dt<T>(), peer, tag, comm_, &s->req));
    s->after = [n = data.size(), peer, tag](const MPI_Status& st) { check_received<T>(st, n, peer, tag); };
    return request(std::move(s));
  }

  void barrier() {
    detail::mpi_impl::watch w(*wd_, "barrier");
    DML_CHECK_MPI(MPI_Barrier(comm_));
  }

  // Ranks with the same color form a group, ordered by (key, rank). Collective.
  mpi split(int color, int key) const {
    if (color < 0) fail<invalid_argument>("dml::comm::mpi::split: expected a color >= 0, found ", color);
    MPI_Comm out = MPI_COMM_NULL;
    {
      detail::mpi_impl::watch w(*wd_, "split");
      DML_CHECK_MPI(MPI_Comm_split(comm_, color, key, &out));
    }
    return adopt(out, opt_);
  }

 private:
  template <class T>
  static MPI_Datatype dt() {
    return detail::mpi_impl::datatype<T>();
  }
  template <class T>
  static int count(std::size_t n, const char* op) {
    return detail::mpi_impl::count<T>(n, op);
  }
  static const void* in_place(const void* send, const void* recv) {
    return send == recv ? MPI_IN_PLACE : send;
  }
  template <class T>
  const void* gather_in_place(std::span<const T> send, std::span<T> recv) const {
    return !send.empty() && send.data() == recv.data() + send.size() * rank_ ? MPI_IN_PLACE
                                                                            : static_cast<const void*>(send.data());
  }

  std::unique_ptr<detail::mpi_impl::request_state_mpi> state(const char* op) const {
    auto s = std::make_unique<detail::mpi_impl::request_state_mpi>();
    s->wd = wd_;
    s->op = op;
    return s;
  }

  void release() noexcept {
    wd_.reset();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
    owned_ = false;
  }

  void check_rank(int r, const char* op, const char* what) const {
    if (r < 0 || r >= size_)
      fail<invalid_argument>("dml::comm::mpi::", op, ": expected a ", what, " in [0, ", size_, "), found ", r);
  }
  template <class T>
  std::span<T> own_block(std::span<T> data, const char* op) const {
    if (data.size() % size_ != 0)
      fail<invalid_argument>("dml::comm::mpi::", op, ": expected a size divisible by the group size ", size_,
                             ", found ", data.size());
    const std::size_t m = data.size() / size_;
    return data.subspan(m * rank_, m);
  }

  template <class T>
  static void check_received(const MPI_Status& st, std::size_t expected, int peer, int tag) {
    int got = 0;
    DML_CHECK_MPI(MPI_Get_count(&st, dt<T>(), &got));
    if (std::size_t(got) != expected * detail::mpi_impl::units<T>())
      fail<invalid_argument>("dml::comm::mpi::recv: expected ", expected, " elements from rank ", peer,
                             " with tag ", tag, ", the message has ", got / detail::mpi_impl::units<T>());
  }

  // With options::check_arguments, every rank compares (count, type, op, root) with every other:
  // the max and the min of each must agree, else all ranks throw together.
  template <class T>
  void agree(const char* op, std::size_t n, reduce_op rop, int root) {
    if (!opt_.check_arguments) return;
    const long long mine[4] = {(long long)n, (long long)sizeof(T) * 16 + (long long)reducible<T>,
                               (long long)rop, root};
    long long both[8], out[8];
    for (int i = 0; i < 4; ++i) both[i] = mine[i], both[4 + i] = -mine[i];
    {
      detail::mpi_impl::watch w(*wd_, op);
      DML_CHECK_MPI(MPI_Allreduce(both, out, 8, MPI_LONG_LONG, MPI_MAX, comm_));
    }
    static constexpr const char* what[4] = {"count", "element type", "reduce_op", "root"};
    for (int i = 0; i < 4; ++i)
      if (out[i] != -out[4 + i])
        fail<invalid_argument>("dml::comm::mpi::", op, ": expected the same ", what[i],
                               " on every rank; found values from ", -out[4 + i], " to ", out[i],
                               " (this rank: ", mine[i], ")");
  }

  template <reducible T>
  void prepare_all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op) {
    check_reduce<T>(op, "dml::comm::mpi::all_reduce");
    if (send.size() != recv.size())
      fail<invalid_argument>("dml::comm::mpi::all_reduce: expected recv of send's size ", send.size(), ", found ",
                             recv.size());
    agree<T>("all_reduce", send.size(), op, 0);
  }
  template <reducible T>
  void prepare_reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
    check_reduce<T>(op, "dml::comm::mpi::reduce_scatter");
    if (send.size() != recv.size() * size_)
      fail<invalid_argument>("dml::comm::mpi::reduce_scatter: expected send of group size ", size_, " x recv size ",
                             recv.size(), " = ", recv.size() * size_, " elements, found ", send.size());
    agree<T>("reduce_scatter", recv.size(), op, 0);
  }
  template <class T>
  void prepare_all_gather(std::span<const T> send, std::span<T> recv) {
    if (recv.size() != send.size() * size_)
      fail<invalid_argument>("dml::comm::mpi::all_gather: expected recv of group size ", size_, " x send size ",
                             send.size(), " = ", send.size() * size_, " elements, found ", recv.size());
    agree<T>("all_gather", send.size(), reduce_op::sum, 0);
  }
  template <reducible T>
  void prepare_reduce(std::span<const T> send, std::span<T> recv, reduce_op op, int root) {
    check_reduce<T>(op, "dml::comm::mpi::reduce");
    check_rank(root, "reduce", "root");
    if (rank_ == root && recv.size() != send.size())
      fail<invalid_argument>("dml::comm::mpi::reduce: expected recv of send's size ", send.size(),
                             " at the root, found ", recv.size());
    agree<T>("reduce", send.size(), op, root);
  }
  template <class T>
  int prepare_all_to_all(std::span<const T> send, std::span<T> recv) {
    if (send.size() % size_ != 0 || recv.size() != send.size())
      fail<invalid_argument>("dml::comm::mpi::all_to_all: expected send and recv of equal size divisible by the "
                             "group size ", size_, ", found ", send.size(), " and ", recv.size());
    agree<T>("all_to_all", send.size(), reduce_op::sum, 0);
    return count<T>(send.size() / size_, "all_to_all");
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  bool owned_ = false;
  int rank_ = 0;
  int size_ = 1;
  options opt_;
  std::shared_ptr<detail::mpi_impl::watchdog> wd_;
};

static_assert(diagnose_communicator<mpi>());

}  // namespace dml::comm
