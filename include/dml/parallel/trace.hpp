// SPDX-License-Identifier: Apache-2.0
// dml/parallel/trace.hpp — a run's timeline as Chrome trace-event JSON, which Perfetto UI and chrome://tracing open:
// one process per rank, a compute and a communication track each, counters; every rank's event log gathered to
// rank 0 of a communicator and written as one file. Sits on parallel/events.hpp, comm/ and nlohmann/json; the trainer
// writes it (trainer_options::trace). See DESIGN.md §1.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dml/comm/communicator.hpp"
#include "dml/core/error.hpp"
#include "dml/parallel/events.hpp"

namespace dml::parallel {

// What a rank's trace shows besides its log's slices and samples.
struct trace_rank {
  std::string name;                        // the process's name ("rank 3 (pp 1, tp 1)")
  std::vector<std::int64_t> bucket_bytes;  // per gradient bucket: the bytes its reduction moves
};

namespace detail {

// Tracks are lanes of slices that nest: track t's lane k is thread 2k + t (compute 0, communication 1). Slices
// that overlap without nesting (gradient reductions in flight together) go to the first lane where they nest.
inline std::vector<int> trace_lanes(std::span<const slice> s) {
  std::vector<std::size_t> order(s.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::ranges::sort(order, [&](std::size_t a, std::size_t b) {
    return s[a].begin != s[b].begin ? s[a].begin < s[b].begin : s[a].end > s[b].end;
  });
  std::vector<int> tid(s.size());
  std::vector<std::vector<double>> open[2];  // per track, per lane: the ends of the slices open there
  for (const auto i : order) {
    auto& lanes = open[static_cast<int>(s[i].on)];
    std::size_t k = 0;
    for (; k < lanes.size(); ++k) {
      auto& ends = lanes[k];
      while (!ends.empty() && ends.back() <= s[i].begin) ends.pop_back();
      if (ends.empty() || s[i].end <= ends.back()) break;
    }
    if (k == lanes.size()) lanes.emplace_back();
    lanes[k].push_back(s[i].end);
    tid[i] = 2 * static_cast<int>(k) + static_cast<int>(s[i].on);
  }
  return tid;
}

// The log's gradient reductions: each bucket's from its launch to the moment it was seen complete.
inline std::vector<slice> bucket_slices(std::span<const event> log, std::span<const std::int64_t> bytes) {
  std::vector<slice> out;
  std::vector<double> launched;
  for (const auto& e : log) {
    if (e.bucket < 0) continue;
    const auto b = static_cast<std::size_t>(e.bucket);
    if (e.kind == event_kind::bucket_launch) {
      launched.resize(std::max(launched.size(), b + 1), -1.0);
      launched[b] = e.t;
    } else if (e.kind == event_kind::comm_done && b < launched.size() && launched[b] >= 0) {
      out.push_back({.name = "reduce bucket " + std::to_string(b), .begin = launched[b], .end = e.t,
                     .on = track::communication, .bytes = b < bytes.size() ? bytes[b] : -1, .group = "dp"});
      launched[b] = -1;
    }
  }
  return out;
}

}  // namespace detail

// This rank's trace events as process `pid`: the elements of a JSON array, comma-separated, without brackets.
inline std::string trace_events(const event_log& log, int pid, const trace_rank& r) {
  using nlohmann::json;
  auto slices = log.slices();
  for (auto& s : detail::bucket_slices(log.events(), r.bucket_bytes)) slices.push_back(std::move(s));
  const auto tid = detail::trace_lanes(slices);
  const auto us = [](double seconds) { return seconds * 1e6; };
  std::string out;
  const auto put = [&](const json& e) {
    if (!out.empty()) out += ',';
    out += e.dump();
  };
  put({{"ph", "M"}, {"pid", pid}, {"name", "process_name"}, {"args", {{"name", r.name}}}});
  put({{"ph", "M"}, {"pid", pid}, {"name", "process_sort_index"}, {"args", {{"sort_index", pid}}}});
  std::vector<bool> used(2, true);  // compute and communication, and the further lanes that hold a slice
  for (const int t : tid) {
    used.resize(std::max(used.size(), static_cast<std::size_t>(t) + 1), false);
    used[static_cast<std::size_t>(t)] = true;
  }
  for (int t = 0; t < static_cast<int>(used.size()); ++t) {
    if (!used[static_cast<std::size_t>(t)]) continue;
    std::string name = t % 2 == 0 ? "compute" : "communication";
    if (t >= 2) name += " " + std::to_string(t / 2 + 1);
    put({{"ph", "M"}, {"pid", pid}, {"tid", t}, {"name", "thread_name"}, {"args", {{"name", name}}}});
    put({{"ph", "M"}, {"pid", pid}, {"tid", t}, {"name", "thread_sort_index"}, {"args", {{"sort_index", t}}}});
  }
  for (std::size_t i = 0; i < slices.size(); ++i) {
    const auto& s = slices[i];
    json args = json::object();
    if (s.micro >= 0) args["micro_batch"] = s.micro;
    if (s.chunk >= 0) args["chunk"] = s.chunk;
    if (s.bytes >= 0) args["bytes"] = s.bytes;
    if (s.group) args["group"] = s.group;
    put({{"ph", "X"}, {"pid", pid}, {"tid", tid[i]}, {"name", s.name},
         {"cat", s.on == track::compute ? "compute" : "communication"}, {"ts", us(s.begin)},
         {"dur", us(s.end - s.begin)}, {"args", std::move(args)}});
  }
  for (const auto& c : log.samples())
    put({{"ph", "C"}, {"pid", pid}, {"name", c.name}, {"ts", us(c.t)}, {"args", {{"value", c.value}}}});
  return out;
}

// Writes an empty trace at `path` on rank 0 of world, so that a path that cannot be written fails before any
// training; every rank throws the same one-line io_error then. Collective: it is also the moment every rank takes
// as time zero (restart the logs right after it).
template <class Comm>
void open_trace(Comm& world, const std::filesystem::path& path) {
  double failed = 0;
  if (world.rank() == 0) {
    std::ofstream f(path, std::ios::trunc);
    f << R"({"traceEvents":[]})" << '\n';
    f.close();
    failed = f.fail() ? 1 : 0;
  }
  comm::all_reduce_host(world, std::span<double>(&failed, 1), comm::reduce_op::max);
  if (failed > 0) fail<io_error>("dml::trainer: trace ", path.string(), ": cannot open for writing");
}

// Gathers every rank's trace events to rank 0 of world, which writes them at `path` as one trace (rank r is process
// r). Collective; rewrites the whole file each time, so it may be called during training as well as after it.
template <class Comm>
void write_trace(Comm& world, const std::filesystem::path& path, const event_log& log, const trace_rank& r) {
  const std::string mine = trace_events(log, world.rank(), r);
  const auto n = static_cast<std::size_t>(world.size());
  std::int64_t size = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> sizes(n);
  comm::all_gather_host(world, std::span<const std::int64_t>(&size, 1), std::span<std::int64_t>(sizes));
  const auto width = static_cast<std::size_t>(*std::ranges::max_element(sizes));
  std::vector<char> block(width), all(width * n);
  std::ranges::copy(mine, block.begin());
  comm::all_gather_host(world, std::span<const char>(block), std::span<char>(all));
  double failed = 0;
  if (world.rank() == 0) {
    std::ofstream f(path, std::ios::trunc | std::ios::binary);
    f << R"({"displayTimeUnit":"ms","traceEvents":[)";
    bool first = true;
    for (std::size_t q = 0; q < n; ++q) {
      if (sizes[q] == 0) continue;
      if (!first) f << ",\n";
      f.write(all.data() + q * width, sizes[q]);
      first = false;
    }
    f << "]}\n";
    f.close();
    failed = f.fail() ? 1 : 0;
  }
  comm::all_reduce_host(world, std::span<double>(&failed, 1), comm::reduce_op::max);
  if (failed > 0) fail<io_error>("dml::trainer: trace ", path.string(), ": cannot write");
}

}  // namespace dml::parallel
