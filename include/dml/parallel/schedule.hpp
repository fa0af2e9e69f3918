// SPDX-License-Identifier: Apache-2.0
// dml/parallel/schedule.hpp — pipeline schedules: single, GPipe, 1F1B, interleaved 1F1B and ZB-H1 as policies,
// CSV, a text picture, choice by name. Sits on schedule_check.hpp (the checker and simulator, and through it the
// tables of schedule_table.hpp); the trainer runs them.
#pragma once

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <istream>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "dml/core/error.hpp"
#include "dml/parallel/schedule_check.hpp"

namespace dml::schedule {

namespace detail {

inline void check_sizes(std::string_view who, int stages, int micro_batches) {
  if (stages < 1) fail<invalid_argument>("dml::schedule::", who, ": stages must be >= 1, found ", stages);
  if (micro_batches < 1)
    fail<invalid_argument>("dml::schedule::", who, ": micro_batches must be >= 1, found ", micro_batches);
}

// Turns each rank's order of compute actions into its full list: a recv right before the compute
// that needs it, a send right after the compute that produced it, then reduce_gradients, update.
inline table with_comm(int stages, int micro_batches, int chunks, const std::vector<std::vector<action>>& compute) {
  table t{stages, micro_batches, chunks, {}};
  t.ranks.resize(std::size_t(stages));
  const int last = stages * chunks - 1;
  const bool p2p = stages > 1;
  for (int r = 0; r < stages; ++r) {
    auto& out = t.ranks[std::size_t(r)];
    for (const action& a : compute[std::size_t(r)]) {
      const int v = virtual_stage(stages, r, a.chunk);
      switch (a.kind) {
        case op::forward:
          if (p2p && v > 0) out.push_back({op::recv_activation, a.micro, a.chunk});
          out.push_back(a);
          if (p2p && v < last) out.push_back({op::send_activation, a.micro, a.chunk});
          break;
        case op::backward:
        case op::backward_input:
          if (p2p && v < last) out.push_back({op::recv_gradient, a.micro, a.chunk});
          out.push_back(a);
          if (p2p && v > 0) out.push_back({op::send_gradient, a.micro, a.chunk});
          break;
        default: out.push_back(a);
      }
    }
    out.push_back({op::reduce_gradients});
    out.push_back({op::update});
  }
  return t;
}

inline table one_f_one_b(int stages, int micro_batches) {
  std::vector<std::vector<action>> compute(static_cast<std::size_t>(stages));
  for (int r = 0; r < stages; ++r) {
    auto& c = compute[std::size_t(r)];
    const int warmup = std::min(stages - r - 1, micro_batches);
    for (int m = 0; m < warmup; ++m) c.push_back({op::forward, m});
    for (int i = 0; i < micro_batches - warmup; ++i) {
      c.push_back({op::forward, warmup + i});
      c.push_back({op::backward, i});
    }
    for (int m = micro_batches - warmup; m < micro_batches; ++m) c.push_back({op::backward, m});
  }
  return with_comm(stages, micro_batches, 1, compute);
}

// Megatron's interleaved order, generalised to any M. Micro-batches go in groups; within a group
// a rank runs every micro-batch through chunk 0, then chunk 1, ... (backwards: last chunk first).
// Groups hold K micro-batches; when K does not divide M the remainder joins the first group, and
// when M < 2K there is one group of all M. A group never holds fewer than K micro-batches unless
// M < K, because a smaller group makes rank 0 wait on rank K-1 for the next chunk (with the
// warm-up below, a short last group deadlocks), and the largest group comes first because the
// warm-up must cover a group's chunks before its first backward. Rank r warms up with
// 2(K-r-1) + (V-1)·G forwards (G: the first group's size), then alternates one forward and one
// backward, then drains the backwards.
inline table interleaved(int stages, int micro_batches, int chunks) {
  if (chunks < 1) fail<invalid_argument>("dml::schedule::interleaved: V must be >= 1, found ", chunks);
  if (chunks == 1) return one_f_one_b(stages, micro_batches);
  const int k = stages, m = micro_batches, v = chunks;
  std::vector<std::pair<int, int>> groups;  // [first, end) micro-batches
  if (m < 2 * k) {
    groups.emplace_back(0, m);
  } else {
    groups.emplace_back(0, k + m % k);
    for (int g = k + m % k; g < m; g += k) groups.emplace_back(g, g + k);
  }
  std::vector<action> fwd, bwd;
  for (const auto& [first, end] : groups) {
    for (int c = 0; c < v; ++c)
      for (int i = first; i < end; ++i) fwd.push_back({op::forward, i, c});
    for (int c = v - 1; c >= 0; --c)
      for (int i = first; i < end; ++i) bwd.push_back({op::backward, i, c});
  }
  const int total = m * v, group = groups.front().second - groups.front().first;
  std::vector<std::vector<action>> compute(static_cast<std::size_t>(k));
  for (int r = 0; r < k; ++r) {
    auto& c = compute[std::size_t(r)];
    const int warmup = std::min(total, 2 * (k - r - 1) + (v - 1) * group);
    for (int i = 0; i < warmup; ++i) c.push_back(fwd[std::size_t(i)]);
    for (int i = 0; i < total - warmup; ++i) {
      c.push_back(fwd[std::size_t(warmup + i)]);
      c.push_back(bwd[std::size_t(i)]);
    }
    for (int i = total - warmup; i < total; ++i) c.push_back(bwd[std::size_t(i)]);
  }
  return with_comm(k, m, v, compute);
}

// ZB-H1: forwards and backward_inputs in 1F1B's order (so activations in flight, counted until
// backward_input, are 1F1B's K-r on rank r), and rank r runs each backward_weight r steps late:
// the postponed W fill the idle slots at the end, where 1F1B's backwards would wait. With
// F = I = W and M >= K the makespan is 3M + K - 1 units: the bubble is (K-1)·(F + I - W), a third
// of 1F1B's (K-1)·(F + B). Counted until W, every rank holds up to K micro-batches (1F1B's rank 0).
inline table zero_bubble(int stages, int micro_batches) {
  std::vector<std::vector<action>> compute(static_cast<std::size_t>(stages));
  for (int r = 0; r < stages; ++r) {
    auto& c = compute[std::size_t(r)];
    const int warmup = std::min(stages - r - 1, micro_batches);
    int next_w = 0, inputs = 0;
    const auto input = [&](int m) {
      c.push_back({op::backward_input, m});
      if (++inputs - next_w > r) c.push_back({op::backward_weight, next_w++});
    };
    for (int m = 0; m < warmup; ++m) c.push_back({op::forward, m});
    for (int i = 0; i < micro_batches - warmup; ++i) {
      c.push_back({op::forward, warmup + i});
      input(i);
    }
    for (int m = micro_batches - warmup; m < micro_batches; ++m) input(m);
    while (next_w < micro_batches) c.push_back({op::backward_weight, next_w++});
  }
  return with_comm(stages, micro_batches, 1, compute);
}

// "interleaved:" followed by V, as a constant string for interleaved<V>::name.
template <int V>
struct interleaved_name {
  static constexpr auto value = [] {
    std::array<char, 24> s{};
    constexpr std::string_view prefix = "interleaved:";
    std::size_t n = 0;
    for (char ch : prefix) s[n++] = ch;
    char digits[12]{};
    int d = 0;
    for (int x = V; d == 0 || x > 0; x /= 10) digits[d++] = char('0' + x % 10);
    while (d > 0) s[n++] = digits[--d];
    return s;
  }();
};

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// The built-in schedules. Each is a policy (family schedule_family) whose make(K, M) returns every
// rank's list; all pass check() for every K >= 1, M >= 1.

// One stage: F0 B0 F1 B1 ... then reduce_gradients, update: gradient accumulation over micro-batches.
struct single {
  using policy_family = schedule_family;
  static constexpr const char* name = "single";
  static constexpr int virtual_stages = 1;
  static table make(int stages, int micro_batches) {
    detail::check_sizes(name, stages, micro_batches);
    if (stages != 1)
      fail<invalid_argument>("dml::schedule::single runs one stage, found stages = ", stages,
                             "; a pipeline needs gpipe, 1f1b, interleaved:V or zb");
    return detail::one_f_one_b(1, micro_batches);
  }
};

// GPipe: every forward, then every backward. Backwards go in ascending micro-batch order (as
// PyTorch's ScheduleGPipe), so gradients accumulate in the order of `single` and 1F1B; with equal
// per-micro-batch costs the bubble is (K-1)/(M+K-1) either way. Rank r holds all M activations.
struct gpipe {
  using policy_family = schedule_family;
  static constexpr const char* name = "gpipe";
  static constexpr int virtual_stages = 1;
  static table make(int stages, int micro_batches) {
    detail::check_sizes(name, stages, micro_batches);
    std::vector<std::vector<action>> compute(static_cast<std::size_t>(stages));
    for (auto& c : compute) {
      for (int m = 0; m < micro_batches; ++m) c.push_back({op::forward, m});
      for (int m = 0; m < micro_batches; ++m) c.push_back({op::backward, m});
    }
    return detail::with_comm(stages, micro_batches, 1, compute);
  }
};

// 1F1B (PipeDream-flush, Megatron's default): rank r warms up with min(K-r-1, M) forwards, then
// alternates one forward and one backward, then drains. GPipe's bubble with at most K-r
// micro-batches in flight on rank r instead of M.
struct one_f_one_b {
  using policy_family = schedule_family;
  static constexpr const char* name = "1f1b";
  static constexpr int virtual_stages = 1;
  static table make(int stages, int micro_batches) {
    detail::check_sizes(name, stages, micro_batches);
    return detail::one_f_one_b(stages, micro_batches);
  }
};

// Megatron's interleaved 1F1B: V chunks per rank (virtual stage c·K + r), bubble (K-1)/(V·M + K-1)
// for M >= K at V times the messages. interleaved<1> is one_f_one_b. With M < K a micro-batch
// comes back to rank 0 for its next chunk before the pipeline is full, and the bubble lies
// between that and 1F1B's (K-1)/(M+K-1).
template <int V>
struct interleaved {
  static_assert(V >= 1, "dml::schedule::interleaved<V>: V (chunks per rank) must be >= 1");
  using policy_family = schedule_family;
  static constexpr const char* name = detail::interleaved_name<V>::value.data();
  static constexpr int virtual_stages = V;
  static table make(int stages, int micro_batches) {
    detail::check_sizes(name, stages, micro_batches);
    return detail::interleaved(stages, micro_batches, V);
  }
};

// ZB-H1 (Qi et al. 2023, arXiv 2401.10241): backward split into backward_input (I) and
// backward_weight (W); F and I in 1F1B's order, W postponed to fill the bubbles. At F = I = W
// its bubble time is a third of 1F1B's with the same activations in flight.
struct zero_bubble {
  using policy_family = schedule_family;
  static constexpr const char* name = "zb";
  static constexpr int virtual_stages = 1;
  static table make(int stages, int micro_batches) {
    detail::check_sizes(name, stages, micro_batches);
    return detail::zero_bubble(stages, micro_batches);
  }
};

// ---------------------------------------------------------------------------------------------
// The concept, in named parts so a failure names what is missing.

// What a trainer runs when no schedule is given: single on one stage, 1F1B on a pipeline.
struct automatic {
  using policy_family = schedule_family;
  static constexpr const char* name = "auto";
  static constexpr int virtual_stages = 1;
  static table make(int stages, int micro_batches) {
    return stages == 1 ? single::make(1, micro_batches) : one_f_one_b::make(stages, micro_batches);
  }
};

template <class S>
concept in_schedule_family = requires { typename S::policy_family; } &&
                             std::same_as<typename S::policy_family, schedule_family>;
template <class S>
concept has_schedule_name = requires {
  { S::name } -> std::convertible_to<std::string_view>;
};
template <class S>
concept has_virtual_stages = requires {
  { S::virtual_stages } -> std::convertible_to<int>;
};
template <class S>
concept has_make_table = requires(int stages, int micro_batches) {
  { S::make(stages, micro_batches) } -> std::same_as<table>;
};

template <class S>
concept schedule_policy = in_schedule_family<S> && has_schedule_name<S> && has_virtual_stages<S> && has_make_table<S>;

// static_assert(diagnose_schedule<S>()) names what S lacks.
template <class S>
consteval bool diagnose_schedule() {
  static_assert(in_schedule_family<S>, "dml: a schedule policy needs `using policy_family = dml::schedule_family;`");
  static_assert(has_schedule_name<S>, "dml: a schedule policy needs `static constexpr const char* name`");
  static_assert(has_virtual_stages<S>, "dml: a schedule policy needs `static constexpr int virtual_stages` (chunks per rank)");
  static_assert(has_make_table<S>,
                "dml: a schedule policy needs `static dml::schedule::table make(int stages, int micro_batches)`");
  return true;
}

static_assert(schedule_policy<single> && schedule_policy<gpipe> && schedule_policy<one_f_one_b> &&
              schedule_policy<interleaved<2>> && schedule_policy<zero_bubble>);

// ---------------------------------------------------------------------------------------------
// A text picture for --print-schedule: a header line with K, M, V and the simulated bubble, then
// one line per rank ("rank 0: F0 F1 B0 -  ..."), one cell per time quantum (the shortest compute
// action, or makespan / 4096 if longer), each compute action in the cell where it starts and "-" in the cells it goes on for,
// "." where the rank idles. Sends, receives, reduce_gradients and update take no time and are not drawn.
inline std::string render(const table& t, const costs& c = {}) {
  const timeline tl = simulate(t, c);
  double quantum = std::numeric_limits<double>::infinity();
  std::size_t width = 1;
  for (const auto& list : t.ranks)
    for (const action& a : list)
      if (is_compute(a.kind)) {
        if (const double d = duration(a.kind, c, t.virtual_stages); d > 0) quantum = std::min(quantum, d);
        width = std::max(width, to_string(a, t.virtual_stages).size());
      }
  if (!std::isfinite(quantum)) quantum = 1;
  quantum = std::max(quantum, tl.makespan / 4096);  // a line stays printable whatever the cost ratios
  const auto cells = std::size_t(std::max(0.0, std::ceil(tl.makespan / quantum - 1e-9)));
  std::string out = detail::cat("schedule K=", t.stages, " M=", t.micro_batches, " V=", t.virtual_stages,
                                ": bubble ", tl.bubble, " (makespan ", tl.makespan, ", one cell = ", quantum,
                                "; forward ", c.forward, ", backward ", c.backward, ", backward_input ",
                                c.backward_input, ", backward_weight ", c.backward_weight, ", comm ", c.comm, ")\n");
  for (std::size_t r = 0; r < t.ranks.size(); ++r) {
    std::vector<std::string> row(cells, ".");
    for (std::size_t i = 0; i < t.ranks[r].size(); ++i) {
      const action& a = t.ranks[r][i];
      const double d = tl.end[r][i] - tl.start[r][i];
      if (!is_compute(a.kind) || d <= 0) continue;
      const auto first = std::size_t(std::llround(tl.start[r][i] / quantum));
      const auto n = std::size_t(std::max(1LL, std::llround(d / quantum)));
      for (std::size_t j = first; j < std::min(cells, first + n); ++j)
        row[j] = j == first ? to_string(a, t.virtual_stages) : "-";
    }
    std::string line = detail::cat("rank ", r, ":");
    for (const auto& cell : row) line += " " + cell + std::string(width - cell.size(), ' ');
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// CSV: a header line `rank,op,micro,chunk`, then one row per action in list order, op by its long
// name (the short one is read too); micro is -1 for reduce_gradients and update. Blank lines and
// lines starting with '#' are skipped. Reading sets stages = max rank + 1, micro_batches = max
// micro + 1, virtual_stages = max chunk + 1; it does not check() the table.

inline std::string to_csv(const table& t) {
  std::string out = "rank,op,micro,chunk\n";
  for (std::size_t r = 0; r < t.ranks.size(); ++r)
    for (const action& a : t.ranks[r]) out += detail::cat(r, ",", name(a.kind), ",", a.micro, ",", a.chunk, "\n");
  return out;
}

namespace detail {

inline std::string_view trim(std::string_view s) {
  const auto ws = [](char ch) { return ch == ' ' || ch == '\t' || ch == '\r'; };
  while (!s.empty() && ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && ws(s.back())) s.remove_suffix(1);
  return s;
}

inline std::optional<int> parse_int(std::string_view s) {
  int x = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
  if (ec != std::errc{} || p != s.data() + s.size() || s.empty()) return std::nullopt;
  return x;
}

template <class... What>
[[noreturn]] void bad_row(std::string_view where, std::size_t line, std::string_view row, const What&... what) {
  fail<format_error>(where, ":", line, ": ", what..., " in '", row, "'");
}

inline table read_csv(std::istream& in, std::string_view where) {
  // Bounds keep a typo from allocating a huge table; they are far beyond any real pipeline.
  constexpr int max_rank = 1 << 16, max_micro = 1 << 20, max_chunk = 1 << 10;
  table t;
  t.ranks.clear();
  bool header = false;
  std::string line;
  int max_m = 0, max_c = 0;
  for (std::size_t n = 1; std::getline(in, line); ++n) {
    const auto row = trim(line);
    if (row.empty() || row.front() == '#') continue;
    const auto bad = [&](const auto&... what) { bad_row(where, n, row, what...); };
    std::vector<std::string_view> f;
    for (std::size_t b = 0;;) {
      const auto e = row.find(',', b);
      f.push_back(trim(row.substr(b, e == std::string_view::npos ? std::string_view::npos : e - b)));
      if (e == std::string_view::npos) break;
      b = e + 1;
    }
    if (!header) {
      if (f.size() != 4 || f[0] != "rank" || f[1] != "op" || f[2] != "micro" || f[3] != "chunk")
        bad("expected the header 'rank,op,micro,chunk'");
      header = true;
      continue;
    }
    if (f.size() != 4) bad("expected 4 fields (rank,op,micro,chunk), found ", f.size());
    const auto rank = parse_int(f[0]);
    if (!rank || *rank < 0 || *rank >= max_rank)
      bad("rank: expected an integer in [0, ", max_rank, "), found '", f[0], "'");
    const auto kind = parse_op(f[1]);
    if (!kind)
      bad("op: expected forward, backward, backward_input, backward_weight, send_activation, recv_activation, "
          "send_gradient, recv_gradient, reduce_gradients or update, found '",
          f[1], "'");
    action a{*kind, -1, 0};
    if (has_unit(*kind)) {
      const auto m = parse_int(f[2]);
      if (!m || *m < 0 || *m >= max_micro)
        bad("micro: expected an integer in [0, ", max_micro, ") for ", f[1], ", found '", f[2], "'");
      const auto c = parse_int(f[3]);
      if (!c || *c < 0 || *c >= max_chunk)
        bad("chunk: expected an integer in [0, ", max_chunk, ") for ", f[1], ", found '", f[3], "'");
      a.micro = *m;
      a.chunk = *c;
      max_m = std::max(max_m, *m);
      max_c = std::max(max_c, *c);
    } else {
      if (!f[2].empty() && f[2] != "-1") bad("micro: expected -1 or nothing for ", f[1], ", found '", f[2], "'");
      if (!f[3].empty() && f[3] != "0") bad("chunk: expected 0 or nothing for ", f[1], ", found '", f[3], "'");
    }
    if (std::size_t(*rank) >= t.ranks.size()) t.ranks.resize(std::size_t(*rank) + 1);
    t.ranks[std::size_t(*rank)].push_back(a);
  }
  if (in.bad()) fail<io_error>(where, ": read failed");
  if (t.ranks.empty()) fail<format_error>(where, ": no actions (expected the header 'rank,op,micro,chunk' and rows)");
  t.stages = int(t.ranks.size());
  t.micro_batches = max_m + 1;
  t.virtual_stages = max_c + 1;
  return t;
}

}  // namespace detail

inline table read_csv(std::istream& in) { return detail::read_csv(in, "schedule csv"); }

inline table read_csv(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) fail<io_error>("dml::schedule::read_csv: cannot open '", path.string(), "'");
  return detail::read_csv(in, path.string());
}

// ---------------------------------------------------------------------------------------------
// Runtime choice: "single", "gpipe", "1f1b", "interleaved:V" (V >= 1), "zb"; anything else is read
// as the path of a CSV file (read_csv), which must be for `stages` ranks and `micro_batches`
// micro-batches and pass check().
inline table make(std::string_view spec, int stages, int micro_batches) {
  if (spec == single::name) return single::make(stages, micro_batches);
  if (spec == gpipe::name) return gpipe::make(stages, micro_batches);
  if (spec == one_f_one_b::name) return one_f_one_b::make(stages, micro_batches);
  if (spec == zero_bubble::name) return zero_bubble::make(stages, micro_batches);
  if (constexpr std::string_view il = "interleaved:"; spec.starts_with(il)) {
    const auto v = detail::parse_int(spec.substr(il.size()));
    if (!v || *v < 1)
      fail<invalid_argument>("dml::schedule::make: '", spec, "': expected interleaved:V with an integer V >= 1");
    detail::check_sizes("interleaved", stages, micro_batches);
    return detail::interleaved(stages, micro_batches, *v);
  }
  const std::filesystem::path path{spec};
  std::error_code ec;
  if (!spec.ends_with(".csv") && !std::filesystem::is_regular_file(path, ec))
    fail<invalid_argument>("dml::schedule::make: unknown schedule '", spec,
                           "'; expected single, gpipe, 1f1b, interleaved:V (V >= 1), zb, or the path of a CSV "
                           "file (rank,op,micro,chunk)");
  table t = read_csv(path);
  if (t.stages != stages || t.micro_batches != micro_batches)
    fail<invalid_argument>("dml::schedule::make: '", spec, "' is a schedule for ", t.stages, " stages and ",
                           t.micro_batches, " micro-batches; the run has ", stages, " and ", micro_batches);
  check(t);
  return t;
}

// t, after checking that it is for `stages` ranks, `micro_batches` and `virtual_stages` chunks per rank
// and that it passes check(): what a trainer runs.
inline table checked(table t, int stages, int micro_batches, int virtual_stages) {
  if (t.stages != stages || t.micro_batches != micro_batches || t.virtual_stages != virtual_stages)
    fail<invalid_argument>("dml::schedule: expected a schedule of ", stages, " stages, ", micro_batches,
                           " micro-batches and ", virtual_stages, " chunks per rank, found ", t.stages, ", ",
                           t.micro_batches, " and ", t.virtual_stages);
  check(t);
  return t;
}
// Whether t splits backward into input and weight passes (zero-bubble schedules).
inline bool splits_backward(const table& t) {
  for (const auto& list : t.ranks)
    for (const auto& a : list)
      if (a.kind == op::backward_input) return true;
  return false;
}

}  // namespace dml::schedule
