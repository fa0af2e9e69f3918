// SPDX-License-Identifier: Apache-2.0
// dml/parallel/ties.hpp — tied parameters (GPT's LM head and token embedding): each copy takes the sum of both
// copies' gradients, so both take the same updates. Sits on nn/network.hpp and comm/; the trainer's program
// runs tie_gradients after the reductions and before the update.
//
// The sum runs on what a rank holds after its reductions: the whole gradients (replicate) or its part of each
// copy (ZeRO; a tied parameter and its target are each a run alone, so a rank owns the same elements of both:
// parallel/buckets.hpp). Both copies start from the same values (the tied one's init_id) and receive equal
// gradients, so they stay equal under every sharding. When the copies sit on different pipeline stages, the
// stages that hold one sum over a group of their own, split once; stages that hold neither take no part.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/nn/network.hpp"

namespace dml::parallel {

template <comm::communicator Comm>
struct tie {
  std::size_t whole = 0;            // the tied parameter's slot in the whole model
  std::ptrdiff_t mine = -1, to = -1;  // its slot and its target's on this rank, or −1
  std::unique_ptr<Comm> group;      // the pipeline ranks that hold a copy, when more than one does
};

// Every tie of the whole model, with this rank's slots; pp (null: one stage) is split into tie groups, a
// collective over pp.
template <comm::communicator Comm>
std::vector<tie<Comm>> find_ties(const nn::param_layout& mine, const nn::param_layout& whole, Comm* pp) {
  auto local = [&](std::size_t id) {
    for (std::size_t i = 0; i < mine.slots.size(); ++i)
      if (mine.slots[i].id == id) return static_cast<std::ptrdiff_t>(i);
    return std::ptrdiff_t{-1};
  };
  std::vector<tie<Comm>> out;
  for (const auto& s : whole.slots) {
    if (s.spec.tied_to.empty()) continue;
    tie<Comm> t{.whole = s.id, .mine = local(s.id), .to = local(s.init_id), .group = nullptr};
    if (pp && pp->size() > 1) {
      const bool holds = t.mine >= 0 || t.to >= 0;
      auto g = std::make_unique<Comm>(pp->split(holds ? 0 : 1, pp->rank()));
      if (holds && g->size() > 1) t.group = std::move(g);
    }
    out.push_back(std::move(t));
  }
  return out;
}

// Sums each tie's pieces: piece(slot) is the span of gradients this rank holds of a slot after its reductions.
template <class Space, class T, comm::communicator Comm, class Piece>
void sum_ties(std::span<tie<Comm>> ties, Piece&& piece) {
  for (auto& t : ties) {
    if (t.mine < 0 && t.to < 0) continue;
    const std::ptrdiff_t copies[] = {t.mine, t.to};  // an array: nvcc's host pass cannot range over a braced list
    std::int64_t count = 0;
    for (auto slot : copies)
      if (slot >= 0) count = static_cast<std::int64_t>(piece(static_cast<std::size_t>(slot)).size());
    buffer<float, Space> sum(static_cast<std::size_t>(count));
    fill_n<Space>(sum.data(), count, 0.f);
    for (auto slot : copies)
      if (slot >= 0) accumulate_n<Space>(static_cast<const T*>(piece(static_cast<std::size_t>(slot)).data()), sum.data(), count);
    if (t.group) t.group->all_reduce(sum.span(), comm::reduce_op::sum);
    for (auto slot : copies)
      if (slot >= 0) cast_n<Space>(sum.data(), piece(static_cast<std::size_t>(slot)).data(), count);
  }
}

}  // namespace dml::parallel
