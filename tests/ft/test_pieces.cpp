// SPDX-License-Identifier: Apache-2.0
// tests/ft/test_pieces.cpp — what train_restarting moves between members: pieces as bytes (and bad bytes refused),
// copies handed to the next members, and a new configuration gathering one step's pieces from whoever holds them.
#include <doctest/doctest.h>

#include <mutex>
#include <numeric>

#include "dml/comm/local.hpp"
#include "dml/ft/elastic.hpp"

namespace test_pieces {

using namespace dml;
using ft::detail::held_pieces;

namespace {

// Rank r of an old configuration of 4 owned elements [10 r, 10 r + 10) of "param/w", valued 10 r + i.
train::state_pieces piece(int r, std::int64_t step = 7) {
  train::state_pieces p;
  p.meta.step = step;
  p.meta.optimizer_step = step;
  p.meta.seed = 3;
  p.meta.loss_scale = 0.5f;
  p.ranges.push_back({"param/w", 10 * r, 10 * r + 10});
  p.meta.values.resize(10);
  std::iota(p.meta.values.begin(), p.meta.values.end(), static_cast<float>(10 * r));
  return p;
}
held_pieces held(int r, std::int64_t epoch = 1, int size = 4, std::int64_t step = 7) {
  return {step, epoch, r, size, ft::detail::encode(piece(r, step))};
}

}  // namespace

TEST_CASE("pieces survive the wire, and bad bytes are refused") {
  auto p = piece(2);
  p.ranges.push_back({"state0/layer.1.bias", 0, 0});
  const auto bytes = ft::detail::encode(p);
  const auto q = ft::detail::decode(bytes);
  CHECK(q.meta.step == 7);
  CHECK(q.meta.seed == 3);
  CHECK(q.meta.loss_scale == 0.5f);
  CHECK(q.meta.values == p.meta.values);
  REQUIRE(q.ranges.size() == 2);
  CHECK(q.ranges[0].tensor == "param/w");
  CHECK(q.ranges[0].begin == 20);
  CHECK(q.ranges[1].tensor == "state0/layer.1.bias");
  auto cut = bytes;
  cut.pop_back();
  CHECK_THROWS_WITH_AS(ft::detail::decode(cut), doctest::Contains("before their end"), format_error);
  auto longer = bytes;
  longer.push_back(0);
  CHECK_THROWS_WITH_AS(ft::detail::decode(longer), doctest::Contains("1 bytes past their end"), format_error);
  auto huge = bytes;
  const std::int64_t many = std::int64_t{1} << 50;
  std::memcpy(huge.data() + 6 * sizeof(std::int64_t), &many, sizeof many);  // the count of values
  CHECK_THROWS_WITH_AS(ft::detail::decode(huge), doctest::Contains("announce"), format_error);
}

TEST_CASE("each member receives the pieces of the member d before it") {
  comm::local::run(3, [](comm::local& c) {
    for (int d = 1; d <= 2; ++d) {
      const auto mine = ft::detail::encode(piece(c.rank()));
      const auto got = ft::detail::decode(ft::detail::pass_to_buddy(c, mine, d));
      CHECK(got.meta.values == piece((c.rank() + 3 - d) % 3).meta.values);
    }
  });
}

TEST_CASE("a configuration gathers one step's pieces from own copies and buddies' copies") {
  // An old configuration (epoch 1) of 4 ranks, each copied to the next; its ranks 0-2 are now members 0-2 of a
  // new configuration of 3 (rank 3 is gone: member 0 holds its copy). Member 1 also holds a piece of an
  // incomplete later configuration (epoch 2 of 3 ranks) and one of another step: neither is taken.
  std::vector<std::vector<held_pieces>> holds(3);
  for (int r = 0; r < 3; ++r) holds[static_cast<std::size_t>(r)] = {held(r), held((r + 3) % 4)};
  holds[1].push_back(held(0, 2, 3));
  holds[1].push_back(held(2, 1, 4, 6));
  std::mutex m;
  std::vector<std::vector<float>> got(3);
  comm::local::run(3, [&](comm::local& c) {
    const auto pieces = ft::detail::collect_pieces(c, holds[static_cast<std::size_t>(c.rank())], 7);
    CHECK(pieces.size() == 4);  // the epoch-1 copies, one each
    std::vector<float> all(40);
    float* out = all.data();
    const std::vector<train::checkpoint_range> need{{"param/w", 0, 40}};
    train::detail::read_pieces(pieces, need, std::span<float* const>(&out, 1));
    std::lock_guard lock(m);
    got[static_cast<std::size_t>(c.rank())] = all;
  });
  std::vector<float> want(40);
  std::iota(want.begin(), want.end(), 0.f);
  for (const auto& g : got) CHECK(g == want);
}

TEST_CASE("without a copy of some rank's pieces, restoring names what is missing") {
  // Ranks 2 and 3 of the old configuration are both gone, and only rank 3 held rank 2's copy.
  std::vector<std::vector<held_pieces>> holds{{held(0), held(3)}, {held(1), held(0)}};
  comm::local::run(2, [&](comm::local& c) {
    const auto pieces = ft::detail::collect_pieces(c, holds[static_cast<std::size_t>(c.rank())], 7);
    CHECK(pieces.size() == 3);  // no complete configuration: every copy offered
    std::vector<float> all(40);
    float* out = all.data();
    const std::vector<train::checkpoint_range> need{{"param/w", 0, 40}};
    CHECK_THROWS_WITH_AS(train::detail::read_pieces(pieces, need, std::span<float* const>(&out, 1)),
                         doctest::Contains("elements [20, 30) of 'param/w' are held by none"), invalid_argument);
  });
}

}  // namespace test_pieces
