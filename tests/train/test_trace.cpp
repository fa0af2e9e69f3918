// SPDX-License-Identifier: Apache-2.0
// tests/train/test_trace.cpp — trainer_options::trace: the timeline of a pp 2 × tp 2 GPT step as Chrome trace-event
// JSON (one process per rank, every micro-batch's forward and backward, transfers and collectives with their bytes,
// slices nested per track), gradient reductions of a data-parallel run, losses equal bit for bit with tracing on and
// off, and a path that cannot be written.
#include <doctest/doctest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpt_fixture.hpp"
#include "temp_dir.hpp"

namespace test_trace {

namespace {

using namespace gpt_fixture;
using nlohmann::json;

// Trains a small GPT for n_steps on l.size() local ranks with the trace at `trace` (empty: none), writes it, and
// returns rank 0's losses.
std::vector<float> run(const layout& l, const std::string& trace, int n_steps, std::int64_t micro) {
  std::vector<float> losses;
  comm::local::run(l.size(), [&](comm::local& c) {
    train::trainer_options o{.seed = 9, .micro_batches = micro, .trace = trace, .pipeline_stages = l.pp,
                             .tensor_parallel = l.tp};
    trainer<parallel::replicate, optim::adamw> t(c, nn::gpt(config()), o, optim::adamw({.lr = 3e-3f}));
    const int data_rank = c.rank() / l.tp % l.dp;
    const std::int64_t first = batch * data_rank / l.dp, rows = batch / l.dp;
    std::vector<float> x(static_cast<std::size_t>(rows * seq));
    std::vector<std::int32_t> y(x.size());
    std::vector<float> mine;
    for (int s = 1; s <= n_steps; ++s) {
      corpus().batch(4, static_cast<std::uint64_t>(s), first, rows, seq, x.data(), y.data());
      mine.push_back(t.step(tensor_view<const float>(x.data(), {rows, seq}), y.data(), batch).loss);
    }
    if (!trace.empty()) t.write_trace();
    if (c.rank() == 0) losses = std::move(mine);
  });
  return losses;
}

json read(const std::filesystem::path& p) {
  std::ifstream f(p);
  return json::parse(f);
}

// "" when the complete events of each (process, thread) nest, else the first pair that overlaps.
std::string check_nesting(const json& events) {
  std::map<std::pair<int, int>, std::vector<std::pair<double, double>>> tracks;
  for (const auto& e : events)
    if (e["ph"] == "X") {
      const double ts = e["ts"], dur = e["dur"];
      tracks[{e["pid"].get<int>(), e["tid"].get<int>()}].push_back({ts, ts + dur});
    }
  for (auto& [key, s] : tracks) {
    std::ranges::sort(s, [](auto a, auto b) { return a.first != b.first ? a.first < b.first : a.second > b.second; });
    std::vector<double> open;
    for (const auto& [b, e] : s) {
      while (!open.empty() && open.back() <= b) open.pop_back();
      if (!open.empty() && e > open.back())
        return "pid " + std::to_string(key.first) + " tid " + std::to_string(key.second) + ": a slice at " +
               std::to_string(b) + " overlaps one ending at " + std::to_string(open.back());
      open.push_back(e);
    }
  }
  return {};
}

}  // namespace

TEST_CASE("trace: a pp 2 x tp 2 GPT step is one trace with a process per rank, every micro-batch and its transfers") {
  dml_test::temp_dir dir("dml-trace");
  const auto path = dir / "trace.json";
  constexpr std::int64_t micro = 4;
  run({.tp = 2, .pp = 2}, path.string(), 2, micro);
  const json trace = read(path);
  REQUIRE(trace.contains("traceEvents"));
  const auto& events = trace["traceEvents"];
  std::set<int> processes;
  std::map<int, std::set<std::pair<std::string, int>>> computed;  // per rank: (forward or backward, micro-batch)
  std::map<int, int> transfers, collectives, counters;
  for (const auto& e : events) {
    const int pid = e["pid"];
    if (e["ph"] == "M" && e["name"] == "process_name") processes.insert(pid);
    if (e["ph"] == "C") ++counters[pid];
    if (e["ph"] != "X") continue;
    const std::string name = e["name"];
    const auto& args = e["args"];
    if (e["cat"] == "compute" && args.contains("micro_batch"))
      computed[pid].insert({name.substr(0, name.find(' ')), args["micro_batch"].get<int>()});
    if ((name.starts_with("send_") || name.starts_with("recv_")) && args.value("bytes", 0) > 0 && args["group"] == "pp")
      ++transfers[pid];
    if (name.starts_with("all_") && args.value("bytes", 0) > 0 && args["group"] == "tp") ++collectives[pid];
  }
  CHECK(processes == std::set<int>{0, 1, 2, 3});
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    for (int m = 0; m < micro; ++m) {
      CHECK(computed[r].contains({"forward", m}));
      CHECK(computed[r].contains({"backward", m}));
    }
    CHECK(transfers[r] == 2 * 2 * micro);  // each step: every micro-batch's activation and gradient, sent or received
    CHECK(collectives[r] > 0);
    CHECK(counters[r] > 0);
  }
  const auto nesting = check_nesting(events);
  CHECK_MESSAGE(nesting.empty(), nesting);
}

TEST_CASE("trace: gradient reductions of a data-parallel run are slices with their bytes") {
  dml_test::temp_dir dir("dml-trace");
  const auto path = dir / "trace.json";
  run({.dp = 2}, path.string(), 2, 2);
  const json trace = read(path);
  int reductions = 0;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X" && e["name"].get<std::string>().starts_with("reduce bucket") && e["args"]["bytes"] > 0 &&
        e["args"]["group"] == "dp")
      ++reductions;
  CHECK(reductions >= 2 * 2);  // a bucket at least per step and rank
  const auto nesting = check_nesting(trace["traceEvents"]);
  CHECK_MESSAGE(nesting.empty(), nesting);
}

TEST_CASE("trace: losses with tracing on and off are equal bit for bit") {
  dml_test::temp_dir dir("dml-trace");
  const layout l{.tp = 2, .pp = 2};
  const auto off = run(l, "", 3, 2);
  const auto on = run(l, (dir / "trace.json").string(), 3, 2);
  REQUIRE(off.size() == 3);
  CHECK(on == off);
}

TEST_CASE("trace: a path that cannot be written fails at construction with one line naming it") {
  dml_test::temp_dir dir("dml-trace");
  const std::string path = (dir / "missing" / "trace.json").string();
  std::string message;
  try {
    run({.dp = 2}, path, 1, 1);
  } catch (const io_error& e) {
    message = e.what();
  }
  CHECK(message == "dml::trainer: trace " + path + ": cannot open for writing");
}

}  // namespace test_trace
