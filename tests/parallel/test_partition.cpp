// SPDX-License-Identifier: Apache-2.0
// tests/parallel/test_partition.cpp — parallel::balance_stages against brute force over every cut set, heavy layers,
// forbidden cuts, and check_cuts / parse_cuts with the errors they give.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dml/parallel/partition.hpp"

namespace test_partition {

using dml::parallel::balance_stages;
using dml::parallel::check_cuts;
using dml::parallel::parse_cuts;
using dml::parallel::stage_costs;
using sizes = std::vector<std::size_t>;

namespace {

double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }
double squares(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return s;
}

// The least maximum stage cost over every partition, and the least sum of squares among those that
// reach it; nullopt-like {inf, inf} when no partition fits.
struct optimum {
  double max = std::numeric_limits<double>::infinity();
  double squares = std::numeric_limits<double>::infinity();
};
optimum brute_force(const std::vector<double>& cost, int stages, const std::vector<bool>& can_cut) {
  const std::size_t n = cost.size();
  std::vector<std::pair<double, double>> all;  // (max, squares) of every valid partition
  for (std::uint32_t set = 0; set < (1u << (n - 1)); ++set) {
    if (std::popcount(set) != stages - 1) continue;
    sizes first{0};
    bool ok = true;
    for (std::size_t i = 1; i < n; ++i)
      if (set >> (i - 1) & 1) {
        ok = ok && can_cut[i];
        first.push_back(i);
      }
    if (!ok) continue;
    const auto c = stage_costs(cost, first);
    all.emplace_back(max_of(c), squares(c));
  }
  optimum o;
  for (const auto& [m, s] : all) o.max = std::min(o.max, m);
  for (const auto& [m, s] : all)
    if (m <= o.max) o.squares = std::min(o.squares, s);
  return o;
}

bool valid(const sizes& first, std::size_t n, int stages, const std::vector<bool>& can_cut) {
  if (first.size() != std::size_t(stages) || first[0] != 0) return false;
  for (std::size_t s = 1; s < first.size(); ++s)
    if (first[s] <= first[s - 1] || first[s] >= n || !can_cut[first[s]]) return false;
  return true;
}

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const dml::invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("balance_stages: optimal against brute force over every cut set (random small cases)") {
  std::mt19937_64 rng(20240611);
  int cases = 0, infeasible = 0;
  double max_rel_diff = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const std::size_t n = 1 + rng() % 11;
    const int stages = 1 + int(rng() % n);
    const bool integers = trial % 2 == 0;
    const bool masked = trial % 3 != 0;
    std::vector<double> cost(n);
    for (auto& c : cost)
      c = integers ? double(rng() % 8) : std::uniform_real_distribution<double>(0, 10)(rng);
    if (trial % 7 == 0) cost[rng() % n] *= 40;  // one heavy layer now and then
    std::vector<bool> can_cut(n, true);
    if (masked)
      for (std::size_t i = 1; i < n; ++i) can_cut[i] = rng() % 4 != 0;
    CAPTURE(trial);
    CAPTURE(n);
    CAPTURE(stages);

    const auto best = brute_force(cost, stages, can_cut);
    if (std::isinf(best.max)) {
      ++infeasible;
      CHECK_THROWS_AS(balance_stages(cost, stages, can_cut), dml::invalid_argument);
      continue;
    }
    const auto first = masked ? balance_stages(cost, stages, can_cut) : balance_stages(cost, stages);
    REQUIRE(valid(first, n, stages, can_cut));
    const auto c = stage_costs(cost, first);
    if (integers) {
      CHECK(max_of(c) == best.max);
      CHECK(squares(c) == best.squares);
    } else {
      max_rel_diff = std::max({max_rel_diff, std::abs(max_of(c) - best.max) / best.max,
                               std::abs(squares(c) - best.squares) / best.squares});
    }
    ++cases;
  }
  MESSAGE("cases=" << cases << " infeasible=" << infeasible << " max_rel_diff=" << max_rel_diff);
  CHECK(max_rel_diff < 1e-12);
  CHECK(cases > 300);
  CHECK(infeasible > 0);
}

TEST_CASE("balance_stages: equal layers split evenly; a heavy first or last layer gets a stage of its own") {
  const std::vector<double> even(8, 1.0);
  CHECK(balance_stages(even, 4) == sizes{0, 2, 4, 6});
  CHECK(balance_stages(even, 1) == sizes{0});
  CHECK(balance_stages(even, 8) == sizes{0, 1, 2, 3, 4, 5, 6, 7});
  // Ten over four: stages of 3, 3, 2, 2 layers in some order, never a stage of 1.
  const std::vector<double> ten(10, 1.0);
  auto c = stage_costs(ten, balance_stages(ten, 4));
  std::sort(c.begin(), c.end());
  CHECK(c == std::vector<double>{2, 2, 3, 3});

  const std::vector<double> heavy_first{100, 1, 1, 1, 1, 1, 1};
  CHECK(balance_stages(heavy_first, 2) == sizes{0, 1});
  CHECK(balance_stages(heavy_first, 3)[1] == 1);
  CHECK(stage_costs(heavy_first, balance_stages(heavy_first, 3)) == std::vector<double>{100, 3, 3});
  const std::vector<double> heavy_last{1, 1, 1, 1, 1, 1, 100};
  CHECK(balance_stages(heavy_last, 2) == sizes{0, 6});
  CHECK(stage_costs(heavy_last, balance_stages(heavy_last, 3)) == std::vector<double>{3, 3, 100});
  // Zero-cost layers still need a stage each to fill the stages.
  CHECK(balance_stages(std::vector<double>{0, 0, 0}, 3) == sizes{0, 1, 2});
}

TEST_CASE("balance_stages: forbidden cuts keep a relu on its linear's stage") {
  // linear relu linear relu linear relu linear: a stage may start only at a linear.
  const std::vector<double> cost{10, 1, 10, 1, 10, 1, 10};
  const std::vector<bool> can_cut{true, false, true, false, true, false, true};
  CHECK(balance_stages(cost, 4, can_cut) == sizes{0, 2, 4, 6});
  CHECK(balance_stages(cost, 2, can_cut) == sizes{0, 4});
  // Only one place left to cut: at most two stages.
  const std::vector<bool> one{true, false, false, true, false, false, false};
  CHECK(balance_stages(cost, 2, one) == sizes{0, 3});
  CHECK(error_of([&] { balance_stages(cost, 3, one); }) ==
        "dml::parallel::balance_stages: 3 stages over 7 layers would leave an empty stage: at most 2 fit (1 places to "
        "cut)");
  // A span of bools works as well as a std::vector<bool>; entry 0 is ignored.
  const bool raw[] = {false, false, true, false, true, false, true};
  CHECK(balance_stages(cost, 4, std::span<const bool>(raw)) == sizes{0, 2, 4, 6});
}

TEST_CASE("balance_stages: errors say what was expected and what was found") {
  const std::vector<double> cost{1, 2, 3};
  CHECK(error_of([&] { balance_stages(cost, 0); }) == "dml::parallel::balance_stages: expected stages >= 1, found 0");
  CHECK(error_of([&] { balance_stages(cost, 4); }) ==
        "dml::parallel::balance_stages: 4 stages over 3 layers would leave an empty stage: at most 3 fit (2 places to "
        "cut)");
  CHECK(error_of([&] { balance_stages({}, 1); }) ==
        "dml::parallel::balance_stages: 1 stages over 0 layers would leave an empty stage: at most 0 fit (0 places to "
        "cut)");
  CHECK(error_of([&] { balance_stages(std::vector<double>{1, -2, 3}, 2); }) ==
        "dml::parallel::balance_stages: expected every layer's cost to be finite and >= 0, found -2 for layer 1");
  CHECK(error_of([&] { balance_stages(std::vector<double>{1, std::nan(""), 3}, 2); }).find("for layer 1") !=
        std::string::npos);
  CHECK(error_of([&] { balance_stages(cost, 2, std::vector<bool>{true, true}); }) ==
        "dml::parallel::balance_stages: expected can_cut_before to be empty or have one entry per layer (3), found 2");
}

TEST_CASE("check_cuts: the first layer of each stage after the first") {
  const sizes cuts{3, 5};
  CHECK(check_cuts(cuts, 8) == sizes{0, 3, 5});
  CHECK(check_cuts({}, 8) == sizes{0});
  CHECK(check_cuts(sizes{7}, 8) == sizes{0, 7});
  const std::vector<bool> can_cut{true, true, true, false, true, true, true, true};
  CHECK(check_cuts(sizes{2, 4}, 8, can_cut) == sizes{0, 2, 4});

  CHECK(error_of([&] { check_cuts(sizes{3, 8}, 8); }) ==
        "dml::parallel::check_cuts: cut 2 is 8, expected a layer in [1, 8) (there are 8 layers)");
  CHECK(error_of([&] { check_cuts(sizes{0, 3}, 8); }) ==
        "dml::parallel::check_cuts: cut 1 is 0, expected a layer in [1, 8): list the first layer of each stage after "
        "the first (the first starts at 0)");
  CHECK(error_of([&] { check_cuts(sizes{5, 3}, 8); }) ==
        "dml::parallel::check_cuts: cut 2 is 3 after 5, expected increasing cuts: stage 1 would be empty");
  CHECK(error_of([&] { check_cuts(sizes{3, 3}, 8); }) ==
        "dml::parallel::check_cuts: cut 2 is 3 after 3, expected increasing cuts: stage 1 would be empty");
  CHECK(error_of([&] { check_cuts(sizes{3}, 8, can_cut); }) ==
        "dml::parallel::check_cuts: the cut before layer 3 is not allowed: layer 3 cannot start a stage");
  CHECK(error_of([&] { check_cuts(sizes{1, 3}, 8, can_cut, "separates a relu from the linear it is fused into"); }) ==
        "dml::parallel::check_cuts: the cut before layer 3 separates a relu from the linear it is fused into");
  CHECK(error_of([&] { check_cuts(sizes{1}, 8, std::vector<bool>{true}); }) ==
        "dml::parallel::check_cuts: expected can_cut_before to be empty or have one entry per layer (8), found 1");
  CHECK(error_of([&] { check_cuts({}, 0); }) ==
        "dml::parallel::check_cuts: expected at least one layer to cut into stages, found 0");
}

TEST_CASE("parse_cuts: a --cuts flag's text") {
  CHECK(parse_cuts("3,5") == sizes{3, 5});
  CHECK(parse_cuts("12") == sizes{12});
  CHECK(parse_cuts("").empty());
  CHECK(check_cuts(parse_cuts("3,5"), 8) == sizes{0, 3, 5});
  CHECK(error_of([] { parse_cuts("3,,5"); }) ==
        "dml::parallel::parse_cuts: expected layer numbers separated by commas (\"3,5\"), found '' in '3,,5'");
  CHECK(error_of([] { parse_cuts("3,x"); }).find("found 'x' in '3,x'") != std::string::npos);
  CHECK(error_of([] { parse_cuts("3,"); }).find("found '' in '3,'") != std::string::npos);
  CHECK(error_of([] { parse_cuts("-1"); }).find("found '-1'") != std::string::npos);
  CHECK(error_of([] { parse_cuts("3 ,5"); }).find("found '3 '") != std::string::npos);
}

TEST_CASE("stage_costs: sums each stage's layers") {
  const std::vector<double> cost{1, 2, 3, 4};
  CHECK(stage_costs(cost, sizes{0, 1, 3}) == std::vector<double>{1, 5, 4});
  CHECK(stage_costs(cost, sizes{0}) == std::vector<double>{10});
}

TEST_CASE("balance_stages: a few hundred layers over many stages stays quick and exact on a known answer") {
  // 300 layers of cost 1 with a heavy layer every 30: 10 stages each starting at a heavy layer.
  std::vector<double> cost(300, 1.0);
  for (std::size_t i = 0; i < cost.size(); i += 30) cost[i] = 100;
  const auto first = balance_stages(cost, 10);
  const auto c = stage_costs(cost, first);
  CHECK(max_of(c) == 129);
  const auto many = balance_stages(cost, 64);
  CHECK(many.size() == 64);
  CHECK(max_of(stage_costs(cost, many)) == 100);
}

}  // namespace test_partition
