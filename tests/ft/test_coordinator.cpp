// SPDX-License-Identifier: Apache-2.0
// tests/ft/test_coordinator.cpp — the coordinator against members in threads: quorums, unanimous commits,
// aborts, deaths by lost heartbeat and by closed connection, fencing of an old epoch, joiners, the store and
// the job token, and a coordinator that dies and starts again from its state file.
#include <doctest/doctest.h>

#include <atomic>
#include <future>
#include <mutex>
#include <thread>

#include <fstream>

#include "dml/ft/coordinator.hpp"
#include "dml/ft/session.hpp"
#include "temp_dir.hpp"

namespace test_coordinator {

using namespace dml;
using namespace dml::ft;
using namespace std::chrono_literals;

namespace {

// The coordinator serving from a thread of its own; the test reads its state under the same lock.
struct served {
  coordinator c;
  std::atomic<bool> stop{false};
  std::mutex m;
  std::thread t;
  explicit served(coordinator_options o) : c((o.log = nullptr, o)) {
    t = std::thread([this] {
      while (!stop) {
        {
          std::lock_guard lk(m);
          c.poll_once(2ms);
        }
        std::this_thread::yield();
      }
    });
  }
  coordinator_stats stats() {
    std::lock_guard lk(m);
    return c.stats();
  }
  bool finished() {
    std::lock_guard lk(m);
    return c.finished();
  }
  ~served() {
    stop = true;
    t.join();
  }
  session_options member(int slot, std::int64_t start = 0) const {
    return {.address = "127.0.0.1:" + std::to_string(c.port()), .token = "secret", .slot = slot, .start = start,
            .heartbeat = 50ms, .timeout = 20000ms};
  }
};

coordinator_options options(int n, int min = 1) {
  return {.token = "secret", .nproc = n, .min_members = min, .heartbeat_deadline = 500ms, .join_deadline = 2000ms,
          .start_deadline = 300ms};
}

// What dml-run keeps across starts of the coordinator: its listening socket and a state file (2 slots, 2 needed).
struct restartable {
  dml_test::temp_dir dir{"dml-coordinator"};
  socket_fd listener = listen_on("127.0.0.1", 0);
  coordinator_options o = [this] {
    auto x = options(2, 2);
    x.listen_fd = listener.get();
    x.state_file = (dir / "state").string();
    return x;
  }();
};

// Every member joins at `step` from a thread; returns their quorums in slot order.
std::vector<quorum> join_all(std::vector<session*> ss, std::vector<std::int64_t> steps) {
  std::vector<std::future<quorum>> fs;
  for (std::size_t i = 0; i < ss.size(); ++i) fs.push_back(std::async(std::launch::async, [&, i] { return ss[i]->join(steps[i]); }));
  std::vector<quorum> out;
  for (auto& f : fs) out.push_back(f.get());
  return out;
}
std::vector<verdict> vote_all(std::vector<session*> ss, std::int64_t epoch, std::int64_t step, std::vector<bool> ok) {
  std::vector<std::future<verdict>> fs;
  for (std::size_t i = 0; i < ss.size(); ++i)
    fs.push_back(std::async(std::launch::async, [&, i] { return ss[i]->vote(epoch, step, ok[i]); }));
  std::vector<verdict> out;
  for (auto& f : fs) out.push_back(f.get());
  return out;
}

}  // namespace

TEST_CASE("a quorum of every member, unanimous commits, and an abort on one failed vote") {
  served s(options(3));
  session a(s.member(0)), b(s.member(1)), c(s.member(2));
  const auto q = join_all({&a, &b, &c}, {0, 0, 0});
  for (int i = 0; i < 3; ++i) {
    CHECK(q[static_cast<std::size_t>(i)].epoch == 1);
    CHECK(q[static_cast<std::size_t>(i)].rank == i);
    CHECK(q[static_cast<std::size_t>(i)].size() == 3);
  }
  CHECK(vote_all({&a, &b, &c}, 1, 1, {true, true, true}) == std::vector{verdict::commit, verdict::commit, verdict::commit});
  CHECK(vote_all({&a, &b, &c}, 1, 2, {true, false, true}) == std::vector{verdict::abort, verdict::abort, verdict::abort});
  // The broken epoch commits nothing more; a new quorum starts from the committed step.
  CHECK(a.vote(1, 2, true) == verdict::abort);
  const auto r = join_all({&a, &b, &c}, {1, 1, 1});
  CHECK(r[0].epoch == 2);
  CHECK(r[0].step == 1);
  CHECK(vote_all({&a, &b, &c}, 2, 2, {true, true, true})[2] == verdict::commit);
  CHECK(s.stats().commits == 2);
  CHECK(s.stats().recoveries == 1);
}

TEST_CASE("a member that stops its heartbeats is dead; the survivors' votes abort and a smaller quorum forms") {
  served s(options(3, 2));
  session a(s.member(0)), b(s.member(1));
  auto frozen = std::make_unique<session>(s.member(2));
  auto q = join_all({&a, &b, frozen.get()}, {0, 0, 0});
  CHECK(q[0].size() == 3);
  // A member whose process is gone closes its connections: dead at once.
  frozen.reset();
  const auto v = vote_all({&a, &b}, 1, 1, {true, true});
  CHECK(v == std::vector{verdict::abort, verdict::abort});
  q = join_all({&a, &b}, {0, 0});
  CHECK(q[0].epoch == 2);
  CHECK(q[0].slots == std::vector{0, 1});
  CHECK(s.stats().deaths == 1);
}

TEST_CASE("a silent connection is declared dead at the heartbeat deadline, and fenced when it speaks again") {
  served s(options(2, 1));
  session a(s.member(0));
  // A member without a heartbeat thread: its control connection alone, silent after its quorum.
  auto [host, port] = parse_address("127.0.0.1:" + std::to_string(s.c.port()), "test");
  connection mute(connect_to(host, port, 2000ms));
  CHECK(mute.request(make_frame("HELLO", "secret", 1, 0, "control"), 2000ms).verb() == "OK");
  auto fq = std::async(std::launch::async, [&] { return a.join(0); });
  const auto mq = mute.request(make_frame("QUORUM", 0), 5000ms);
  CHECK(mq.verb() == "QUORUM");
  const auto q = fq.get();
  CHECK(q.size() == 2);
  // a votes; the mute member never does: its death aborts the step.
  CHECK(a.vote(q.epoch, 1, true) == verdict::abort);
  CHECK(s.stats().deaths == 1);
  const auto q2 = a.join(0);
  CHECK(q2.size() == 1);
  CHECK(a.vote(q2.epoch, 1, true) == verdict::commit);
  // The mute member speaks again with its old epoch: fenced.
  CHECK(mute.request(make_frame("VOTE", q.epoch, 1, "ok"), 2000ms).verb() == "FENCED");
}

TEST_CASE("a joiner is taken in after the next commit and learns it is behind") {
  served s(options(3, 2));
  session a(s.member(0)), b(s.member(1));
  auto q = join_all({&a, &b}, {0, 0});
  // Slot 2 never started: the first quorum waited for it until the start deadline, then formed without it.
  CHECK(q[0].size() == 2);
  CHECK(vote_all({&a, &b}, q[0].epoch, 1, {true, true})[0] == verdict::commit);
  session c(s.member(2, 1));
  auto joined = std::async(std::launch::async, [&] { return c.join(0); });
  std::this_thread::sleep_for(100ms);  // let the join request arrive before the vote
  CHECK(vote_all({&a, &b}, q[0].epoch, 2, {true, true}) ==
        std::vector{verdict::commit_and_reconfigure, verdict::commit_and_reconfigure});
  auto r = join_all({&a, &b}, {2, 2});
  const auto rc = joined.get();
  CHECK(rc.size() == 3);
  CHECK(rc.step == 2);
  CHECK(rc.behind(rc.rank));
  CHECK(rc.source() == 0);
  CHECK(!r[0].behind(r[0].rank));
  // The job ends when every member of the epoch says so; a later joiner is told it finished.
  CHECK(a.done(2, true));
  a.reported();
  CHECK(!b.done(2, true));
  CHECK(!c.done(2, true));
  for (int i = 0; i < 100 && !s.finished(); ++i) std::this_thread::sleep_for(10ms);
  CHECK(s.finished());
}

TEST_CASE("a member frozen while it waits for a quorum is answered when it resumes") {
  served s(options(2, 2));
  session a(s.member(0));
  auto [host, port] = parse_address("127.0.0.1:" + std::to_string(s.c.port()), "test");
  connection mute(connect_to(host, port, 2000ms));  // slot 1's control connection, without heartbeats
  CHECK(mute.request(make_frame("HELLO", "secret", 1, 0, "control"), 2000ms).verb() == "OK");
  auto fq = std::async(std::launch::async, [&] { return a.join(0); });
  CHECK(mute.request(make_frame("QUORUM", 0), 5000ms).verb() == "QUORUM");
  const auto q = fq.get();
  auto fv = std::async(std::launch::async, [&] { return a.vote(q.epoch, 1, true); });
  CHECK(mute.request(make_frame("VOTE", q.epoch, 1, "ok"), 5000ms).verb() == "COMMIT");
  CHECK(fv.get() == verdict::commit);
  // Both ask for a new quorum; slot 1 falls silent past the deadline (frozen) before one forms without it.
  auto fm = std::async(std::launch::async, [&] { return mute.request(make_frame("QUORUM", 1), 10000ms); });
  auto fa = std::async(std::launch::async, [&] { return a.join(1); });
  std::this_thread::sleep_for(50ms);
  for (int i = 0; i < 100 && s.stats().deaths == 0; ++i) std::this_thread::sleep_for(20ms);
  CHECK(s.stats().deaths == 1);
  // It resumes: a heartbeat. Its question still stands, and the quorum of both forms.
  connection beat(connect_to(host, port, 2000ms));
  CHECK(beat.request(make_frame("HELLO", "secret", 1, 0, "heartbeat"), 2000ms).verb() == "OK");
  beat.send(make_frame("HB"), clock::now() + 2000ms);
  CHECK(fm.get().verb() == "QUORUM");
  CHECK(fa.get().size() == 2);
}

TEST_CASE("a member that says DONE and leaves before the others do is not a death") {
  served s(options(2, 2));
  auto a = std::make_unique<session>(s.member(0));
  session b(s.member(1));
  auto q = join_all({a.get(), &b}, {0, 0});
  CHECK(vote_all({a.get(), &b}, q[0].epoch, 1, {true, true})[0] == verdict::commit);
  CHECK(a->done(1, true));  // the first to hold the final state: it reports it
  a->reported();
  a.reset();  // its connections close
  std::this_thread::sleep_for(100ms);
  CHECK(!s.finished());
  CHECK(!b.done(1, true));
  for (int i = 0; i < 100 && !s.finished(); ++i) std::this_thread::sleep_for(10ms);
  CHECK(s.finished());
  CHECK(s.stats().deaths == 0);
}

TEST_CASE("a member that dies after the last commit, before its DONE, does not stall the job") {
  // Two members needed (min 2). Both commit the last step; one leaves with DONE, the other dies (or freezes)
  // before saying it: the epoch is left with one member, below min_members, and every step is committed.
  for (const bool done_first : {true, false}) {
    CAPTURE(done_first);
    served s(options(3, 2));
    auto a = std::make_unique<session>(s.member(0));
    auto b = std::make_unique<session>(s.member(1));
    auto q = join_all({a.get(), b.get()}, {0, 0});
    CHECK(vote_all({a.get(), b.get()}, q[0].epoch, 1, {true, true})[0] == verdict::commit);
    if (done_first) CHECK(a->done(1, true));
    b.reset();  // dies without DONE
    for (int i = 0; i < 100 && s.stats().deaths == 0; ++i) std::this_thread::sleep_for(10ms);
    CHECK(s.stats().deaths == 1);
    if (!done_first) CHECK(a->done(1, true));
    for (int i = 0; i < 100 && !s.finished(); ++i) std::this_thread::sleep_for(10ms);
    CHECK(s.finished());
    // A new start of the dead member is told the job finished (it cannot heal: nobody alive holds step 1).
    session c(s.member(1, 1));
    CHECK(c.join(0).finished);
  }
}

TEST_CASE("the first member at the last step that holds the final state reports it") {
  served s(options(3, 3));
  session a(s.member(0)), b(s.member(1)), c(s.member(2));
  auto q = join_all({&a, &b, &c}, {0, 0, 0});
  CHECK(vote_all({&a, &b, &c}, q[0].epoch, 1, {true, true, true})[0] == verdict::commit);
  CHECK(!a.done(1, false));  // its gathering of the final state failed (a peer died after the commit)
  CHECK(b.done(1, true));
  // Another holder waits until the state is reported.
  auto fc = std::async(std::launch::async, [&] { return c.done(1, true); });
  CHECK(fc.wait_for(200ms) == std::future_status::timeout);
  b.reported();
  CHECK(!fc.get());
  for (int i = 0; i < 100 && !s.finished(); ++i) std::this_thread::sleep_for(10ms);
  CHECK(s.finished());
}

TEST_CASE("a member that dies before it reports the final state passes the report to another holder") {
  served s(options(3, 3));
  auto a = std::make_unique<session>(s.member(0));
  session b(s.member(1)), c(s.member(2));
  auto q = join_all({a.get(), &b, &c}, {0, 0, 0});
  CHECK(vote_all({a.get(), &b, &c}, q[0].epoch, 1, {true, true, true})[0] == verdict::commit);
  CHECK(a->done(1, true));
  auto fb = std::async(std::launch::async, [&] { return b.done(1, true); });
  CHECK(fb.wait_for(200ms) == std::future_status::timeout);
  auto fc = std::async(std::launch::async, [&] { return c.done(1, true); });
  CHECK(fc.wait_for(200ms) == std::future_status::timeout);
  a.reset();  // dies while it reports: the first holder that waits (slot 1) is told to report instead
  CHECK(fb.get());
  CHECK(fc.wait_for(200ms) == std::future_status::timeout);
  b.reported();
  CHECK(!fc.get());
  for (int i = 0; i < 100 && !s.finished(); ++i) std::this_thread::sleep_for(10ms);
  CHECK(s.finished());
}

TEST_CASE("the store serves keys, and refuses a process without the job token") {
  served s(options(1));
  auto [host, port] = parse_address("127.0.0.1:" + std::to_string(s.c.port()), "test");
  connection good(connect_to(host, port, 2000ms));
  CHECK(good.request(make_frame("HELLO", "secret", -1, 0, "store"), 2000ms).verb() == "OK");
  frame set = make_frame("SET", "k");
  set.body = std::string("v\0w", 3);
  CHECK(good.request(set, 2000ms).verb() == "OK");
  const auto got = good.request(make_frame("GET", "k"), 2000ms);
  CHECK(got.verb() == "VALUE");
  CHECK(got.body == std::string("v\0w", 3));
  CHECK(good.request(make_frame("GET", "other"), 2000ms).verb() == "MISSING");
  connection intruder(connect_to(host, port, 2000ms));
  CHECK(intruder.request(make_frame("HELLO", "guess", -1, 0, "store"), 2000ms).verb() == "REFUSED");
  connection silent(connect_to(host, port, 2000ms));
  CHECK(silent.request(make_frame("GET", "k"), 2000ms).verb() == "REFUSED");
  CHECK(s.stats().refused == 2);
  auto o = s.member(0);
  o.token = "guess";
  CHECK_THROWS_WITH_AS(session{o}, doctest::Contains("refused"), comm_error);
}

TEST_CASE("bad settings are refused at construction") {
  auto o = options(2);
  o.min_members = 3;
  CHECK_THROWS_WITH_AS(coordinator{o}, doctest::Contains("--min must be in [1, 2], found 3"), invalid_argument);
  CHECK_THROWS_WITH_AS(parse_address("nohost", "--coordinator"), doctest::Contains("expected HOST:PORT"), invalid_argument);
}

TEST_CASE("no configuration forms without a member that holds the last committed step") {
  served s(options(3, 1));
  auto a = std::make_unique<session>(s.member(0));
  auto b = std::make_unique<session>(s.member(1));
  auto c = std::make_unique<session>(s.member(2));
  auto q = join_all({a.get(), b.get(), c.get()}, {0, 0, 0});
  CHECK(vote_all({a.get(), b.get(), c.get()}, q[0].epoch, 1, {true, true, true})[0] == verdict::commit);
  // Every member that holds step 1 dies; a new start of slot 0 knows nothing: it must not train from step 0.
  a.reset();
  b.reset();
  c.reset();
  auto o = s.member(0, 1);
  o.timeout = 1500ms;
  session fresh(o);
  CHECK_THROWS_WITH_AS(fresh.join(0), doctest::Contains("no answer to 'QUORUM'"), comm_error);
  CHECK(s.stats().quorums == 1);
}

TEST_CASE("groups join whole; a member behind heals from its place in another group") {
  auto o = options(4, 2);
  o.group_size = 2;
  served s(o);
  session a(s.member(0)), b(s.member(1)), c(s.member(2));
  auto d = std::make_unique<session>(s.member(3));
  auto q = join_all({&a, &b, &c, d.get()}, {0, 0, 0, 0});
  CHECK(q[0].size() == 4);
  CHECK(q[0].group == 2);
  CHECK(vote_all({&a, &b, &c, d.get()}, q[0].epoch, 1, {true, true, true, true})[0] == verdict::commit);
  // Slot 3 dies: its group (slots 2 and 3) is out, though slot 2 lives and asks; slots 0 and 1 go on.
  d.reset();
  auto lone = std::async(std::launch::async, [&] { return c.join(1); });
  q = join_all({&a, &b}, {1, 1});
  CHECK(q[0].slots == std::vector{0, 1});
  CHECK(vote_all({&a, &b}, q[0].epoch, 2, {true, true})[0] == verdict::commit);
  // A new start of slot 3 completes the group: it comes in after the next commit, both its ranks behind, each
  // healing from the member in the same place of the group that holds the step.
  session d2(s.member(3, 1));
  auto back = std::async(std::launch::async, [&] { return d2.join(0); });
  std::this_thread::sleep_for(100ms);
  CHECK(vote_all({&a, &b}, q[0].epoch, 3, {true, true})[0] == verdict::commit_and_reconfigure);
  q = join_all({&a, &b}, {3, 3});
  const auto qc = lone.get(), qd = back.get();
  CHECK(qc.slots == std::vector{0, 1, 2, 3});
  CHECK(qc.step == 3);
  CHECK(qc.behind(2));
  CHECK(qd.behind(3));
  CHECK(qc.source(2) == 0);
  CHECK(qd.source(3) == 1);
  CHECK(q[0].source(1) == 1);
}

TEST_CASE("groups must divide the slots") {
  auto o = options(4);
  o.group_size = 3;
  CHECK_THROWS_WITH_AS(coordinator{o}, doctest::Contains("a group size of 3"), invalid_argument);
}

TEST_CASE("a coordinator that dies starts again from its state file: members ask the new start, epochs rise, and "
          "no committed step is lost") {
  restartable job;
  auto first = std::make_unique<served>(job.o);
  session a(first->member(0)), b(first->member(1));
  const auto q = join_all({&a, &b}, {0, 0});
  CHECK(vote_all({&a, &b}, q[0].epoch, 1, {true, true})[0] == verdict::commit);
  CHECK(vote_all({&a, &b}, q[0].epoch, 2, {true, true})[0] == verdict::commit);
  first.reset();  // its memory and connections are gone
  // A vote whose verdict died with the coordinator counts as fenced: the member must join again.
  CHECK(a.vote(q[0].epoch, 3, true) == verdict::fenced);
  served second(job.o);
  const auto st = second.stats();
  CHECK(st.starts == 2);
  CHECK(st.last_step == 2);
  CHECK(st.commits == 2);
  CHECK(st.recoveries == 1);  // the epoch that died with the first start
  // The members ask the new start (their connections are made again): a later epoch, at the committed step.
  const auto r = join_all({&a, &b}, {2, 2});
  CHECK(r[0].epoch == q[0].epoch + 1);
  CHECK(r[0].step == 2);
  CHECK(!r[0].behind(0));
  // A vote of the old epoch is fenced; the new one commits, and the recovery is timed.
  CHECK(b.vote(q[0].epoch, 3, true) == verdict::fenced);
  CHECK(vote_all({&a, &b}, r[0].epoch, 3, {true, true}) == std::vector{verdict::commit, verdict::commit});
  CHECK(second.stats().recovery_seconds.size() == 1);
  CHECK(second.stats().last_step == 3);
}

TEST_CASE("a new start of the coordinator learns the job finished from a member that committed the last step") {
  restartable job;
  auto first = std::make_unique<served>(job.o);
  session a(first->member(0)), b(first->member(1));
  const auto q = join_all({&a, &b}, {0, 0});
  CHECK(vote_all({&a, &b}, q[0].epoch, 1, {true, true})[0] == verdict::commit);
  first.reset();
  served second(job.o);
  // Member a was told step 1 (the last) committed; b's verdict was lost. a says DONE: the job is finished, and b,
  // asking for a quorum, is told so.
  CHECK(a.done(1, true));  // it holds the final state: it reports it
  for (int i = 0; i < 100 && !second.finished(); ++i) std::this_thread::sleep_for(10ms);
  CHECK(second.finished());
  CHECK(b.join(0).finished);
}

TEST_CASE("a state file that is not a coordinator's is refused by name") {
  dml_test::temp_dir dir("dml-coordinator");
  auto o = options(2);
  o.state_file = (dir / "state").string();
  std::ofstream(o.state_file) << "something else\n";
  CHECK_THROWS_WITH_AS(coordinator{o}, doctest::Contains("is not a coordinator's state"), format_error);
}

TEST_CASE("steps lost are the steps members ran past the last committed one") {
  served s(options(2, 2));
  session a(s.member(0)), b(s.member(1));
  const auto q = join_all({&a, &b}, {0, 0});
  CHECK(vote_all({&a, &b}, q[0].epoch, 1, {true, true})[0] == verdict::commit);
  // A vote every 3 steps: both ran steps 2 to 4 tentatively, and the vote on step 4 fails.
  CHECK(vote_all({&a, &b}, q[0].epoch, 4, {true, false})[0] == verdict::abort);
  auto fa = std::async(std::launch::async, [&] { return a.join(1, 4); });
  auto fb = std::async(std::launch::async, [&] { return b.join(1, 3); });
  const auto r = fa.get();
  CHECK(fb.get().epoch == r.epoch);
  CHECK(r.step == 1);
  CHECK(s.stats().steps_lost == 3);
  // A step that committed is not lost, though the members ran it: they ask again at it.
  CHECK(vote_all({&a, &b}, r.epoch, 2, {true, true})[0] == verdict::commit);
  join_all({&a, &b}, {2, 2});
  CHECK(s.stats().steps_lost == 3);
}

}  // namespace test_coordinator
