// SPDX-License-Identifier: Apache-2.0
// tests/parallel/test_program.cpp — schedules lowered into programs (parallel/program.hpp): every built-in
// schedule × stages × micro-batches × reduction mode × ties lowers into programs the checker accepts, with one
// unshard and reshard per chunk around its compute and one reduction per step (or per micro-batch); broken
// programs are refused with the offending instruction named.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "dml/parallel/program.hpp"
#include "dml/parallel/schedule.hpp"

namespace test_program {

using namespace dml;
using parallel::instruction;
using k = instruction::kind;

namespace {
int count(const parallel::program& p, k what) {
  return static_cast<int>(std::ranges::count_if(p, [&](const instruction& i) { return i.what == what; }));
}
}  // namespace

TEST_CASE("every schedule lowers into sound programs, per step and (where backward is whole) per micro-batch") {
  int programs = 0;
  for (const std::string name : {"gpipe", "1f1b", "interleaved:2", "zb"})
    for (int stages : {1, 2, 4})
      for (int m : {1, 2, 4, 8})
        for (bool ties : {false, true})
          for (bool per_micro : {false, true}) {
            const auto t = schedule::make(name, stages, m);
            if (per_micro && schedule::splits_backward(t)) continue;  // pipelines too (micro_batch_residency)
            const parallel::lowering how{.per_micro_batch = per_micro, .ties = ties};
            for (int r = 0; r < stages; ++r) {
              const auto p = parallel::lower(t, r, how);
              INFO(name, " stages ", stages, " m ", m, " rank ", r, per_micro ? " per micro-batch" : " per step");
              CHECK(parallel::check(p, t.virtual_stages, how) == "");
              CHECK(count(p, k::unshard) == t.virtual_stages);
              CHECK(count(p, k::reshard) == t.virtual_stages);
              const int launches = static_cast<int>(std::ranges::count_if(p, [](const instruction& i) { return i.reduces; }));
              CHECK(launches == (per_micro ? m * t.virtual_stages : t.virtual_stages));
              CHECK(count(p, k::reduce_gradients) == launches);
              CHECK(count(p, k::tie_gradients) == (ties ? 1 : 0));
              CHECK(p.back().what == k::update);
              ++programs;
            }
          }
  CHECK(programs > 100);
}

TEST_CASE("a chunk's last backward (or weight pass) reduces; passes after its first add") {
  const auto t = schedule::make("zb", 2, 4);
  const auto p = parallel::lower(t, 0, {});
  std::ptrdiff_t last_w = -1, reducer = -1;
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (p[i].what == k::run && p[i].a.kind == schedule::op::backward_weight) last_w = static_cast<std::ptrdiff_t>(i);
    if (p[i].reduces) reducer = static_cast<std::ptrdiff_t>(i);
  }
  CHECK(reducer == last_w);
  int firsts = 0;
  for (const auto& i : p) firsts += i.first ? 1 : 0;
  CHECK(firsts == 2);  // the first backward_input and the first backward_weight
}

TEST_CASE("broken programs are refused, naming the instruction") {
  const auto t = schedule::make("1f1b", 2, 2);
  const parallel::lowering how{.ties = true};
  const auto good = parallel::lower(t, 1, how);
  REQUIRE(parallel::check(good, 1, how) == "");
  auto without = [&](k what) {
    auto p = good;
    p.erase(std::ranges::find_if(p, [&](const instruction& i) { return i.what == what; }));
    return parallel::check(p, 1, how);
  };
  CHECK(without(k::unshard).find("computes outside its unshard and reshard") != std::string::npos);
  CHECK(without(k::reshard).find("still resident") != std::string::npos);
  CHECK(without(k::reduce_gradients).find("before chunk 0's final reduce_gradients") != std::string::npos);
  CHECK(without(k::tie_gradients).find("no tie_gradients came before update") != std::string::npos);
  CHECK(without(k::update).find("does not end with update") != std::string::npos);
  auto p = good;
  std::ranges::find_if(p, [](const instruction& i) { return i.reduces; })->reduces = false;
  CHECK(parallel::check(p, 1, how).find("no reductions of chunk 0 were launched") != std::string::npos);
  p = good;  // ties before the reduction
  auto tie = std::ranges::find_if(p, [](const instruction& i) { return i.what == k::tie_gradients; });
  std::iter_swap(tie, std::ranges::find_if(p, [](const instruction& i) { return i.what == k::reduce_gradients; }));
  CHECK(parallel::check(p, 1, how).find("before chunk 0's final reduce_gradients") != std::string::npos);
  // Per micro-batch reduction cannot follow a split backward.
  const auto zb = schedule::make("zb", 1, 2);
  CHECK(parallel::check(parallel::lower(zb, 0, {.per_micro_batch = true}), 1, {.per_micro_batch = true})
            .find("cannot split backward") != std::string::npos);
}

}  // namespace test_program
