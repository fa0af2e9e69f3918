// SPDX-License-Identifier: Apache-2.0
// tests/parallel/mesh_check.hpp — one check of parallel::mesh for every communicator: each group's members, gathered
// inside the group, against the layout formula. Used by test_mesh.cpp (comm::local) and test_mesh_mpi.cpp (mpirun).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dml/core/error.hpp"
#include "dml/parallel/mesh.hpp"

namespace mesh_check {

using dml::parallel::mesh_shape;

// Every shape of n ranks: each tp × dp × pp == n, with each ep that divides dp, and each cp that divides dp
// (with ep 1, and with the largest ep).
inline std::vector<mesh_shape> shapes_of(int n) {
  std::vector<mesh_shape> out;
  for (int tp = 1; tp <= n; ++tp)
    for (int dp = 1; tp * dp <= n; ++dp)
      if (n % (tp * dp) == 0) {
        for (int ep = 1; ep <= dp; ++ep)
          if (dp % ep == 0) out.push_back({.tp = tp, .dp = dp, .pp = n / (tp * dp), .ep = ep});
        for (int cp = 2; cp <= dp; ++cp)
          if (dp % cp == 0) {
            out.push_back({.tp = tp, .dp = dp, .pp = n / (tp * dp), .cp = cp});
            out.push_back({.tp = tp, .dp = dp, .pp = n / (tp * dp), .ep = dp, .cp = cp});
          }
      }
  return out;
}

// Failures on one rank, as text; the test case checks them after the ranks have joined.
struct report {
  std::vector<std::string> failures;
  template <class... A>
  void expect(bool ok, const A&... what) {
    if (!ok) failures.push_back(dml::detail::cat(what...));
  }
};

template <class Comm>
std::vector<std::int32_t> gather_world_ranks(Comm& group, int world_rank) {
  const std::int32_t me = world_rank;
  std::vector<std::int32_t> all(std::size_t(group.size()), -1);
  group.all_gather(std::span<const std::int32_t>(&me, 1), std::span<std::int32_t>(all));
  return all;
}

template <class V>
std::string str(const V& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i) s += ' ';
    s += std::to_string(v[i]);
  }
  return s + "]";
}

// Builds the mesh of `s` on `world` and checks coordinates, group sizes, group members (in order),
// the pipeline neighbours (with a message passed along each pipeline) and describe().
template <class Comm>
report check(Comm& world, mesh_shape s) {
  report rep;
  dml::parallel::mesh<Comm> m(world, s);
  const std::string where = dml::detail::cat(dml::parallel::to_string(s), ", world rank ", world.rank(), ": ");
  const int r = world.rank();
  const int t = r % s.tp, d = r / s.tp % s.dp, p = r / (s.tp * s.dp);
  const auto at = [&](int tp, int dp, int pp) { return tp + s.tp * (dp + s.dp * pp); };

  rep.expect(m.shape() == s, where, "shape() differs from the shape given");
  rep.expect(m.world_rank() == r && m.world_size() == world.size() && &m.world() == &world, where, "world");
  rep.expect(m.tp_rank() == t && m.dp_rank() == d && m.pp_rank() == p, where, "coordinates tp ", m.tp_rank(), " dp ",
             m.dp_rank(), " pp ", m.pp_rank(), ", expected ", t, " ", d, " ", p);
  rep.expect(m.ep_rank() == d % s.ep && m.edp_rank() == d / s.ep, where, "ep_rank ", m.ep_rank(), " edp_rank ",
             m.edp_rank());
  rep.expect(m.world_rank_of(t, d, p) == r, where, "world_rank_of(", t, ", ", d, ", ", p, ") = ",
             m.world_rank_of(t, d, p));
  rep.expect(m.tp_size() == s.tp && m.dp_size() == s.dp && m.pp_size() == s.pp && m.ep_size() == s.ep &&
                 m.edp_size() == s.dp / s.ep,
             where, "sizes");

  struct axis {
    const char* name;
    Comm& group;
    int rank;  // this rank's coordinate along the axis
    std::vector<std::int32_t> expected;
  };
  std::vector<axis> axes{{"tp", m.tp(), t, {}},        {"dp", m.dp(), d, {}},           {"pp", m.pp(), p, {}},
                         {"ep", m.ep(), d % s.ep, {}}, {"edp", m.edp(), d / s.ep, {}}, {"cp", m.cp(), d % s.cp, {}}};
  for (int i = 0; i < s.tp; ++i) axes[0].expected.push_back(at(i, d, p));
  for (int i = 0; i < s.dp; ++i) axes[1].expected.push_back(at(t, i, p));
  for (int i = 0; i < s.pp; ++i) axes[2].expected.push_back(at(t, d, i));
  for (int i = 0; i < s.ep; ++i) axes[3].expected.push_back(at(t, d / s.ep * s.ep + i, p));
  for (int i = 0; i < s.dp / s.ep; ++i) axes[4].expected.push_back(at(t, d % s.ep + i * s.ep, p));
  for (int i = 0; i < s.cp; ++i) axes[5].expected.push_back(at(t, d / s.cp * s.cp + i, p));
  rep.expect(m.cp_rank() == d % s.cp && m.cp_size() == s.cp && m.data_rank() == d / s.cp && m.data_ranks() == s.dp / s.cp,
             where, "cp_rank ", m.cp_rank(), " data_rank ", m.data_rank());
  for (auto& a : axes) {
    const auto got = gather_world_ranks(a.group, r);
    rep.expect(a.group.size() == int(a.expected.size()) && a.group.rank() == a.rank, where, a.name, " group: rank ",
               a.group.rank(), " of ", a.group.size(), ", expected ", a.rank, " of ", a.expected.size());
    rep.expect(got == a.expected, where, a.name, " group holds world ranks ", str(got), ", expected ",
               str(a.expected));
  }

  // Each stage sends its world rank to the next and receives the previous stage's.
  rep.expect(m.pp_prev() == (p > 0 ? p - 1 : -1) && m.pp_next() == (p + 1 < s.pp ? p + 1 : -1), where,
             "pp_prev ", m.pp_prev(), " pp_next ", m.pp_next());
  const std::int32_t mine = r;
  std::int32_t from_prev = -1;
  dml::comm::request sent;
  if (m.pp_next() >= 0) sent = m.pp().isend(std::span<const std::int32_t>(&mine, 1), m.pp_next(), 7);
  if (m.pp_prev() >= 0) {
    m.pp().recv(std::span<std::int32_t>(&from_prev, 1), m.pp_prev(), 7);
    rep.expect(from_prev == at(t, d, p - 1), where, "received ", from_prev, " from the previous stage, expected ",
               at(t, d, p - 1));
  }
  sent.wait();

  const std::string text = m.describe();
  const std::string head = dml::detail::cat("tp ", s.tp, " × dp ", s.dp);
  rep.expect(text.starts_with(head), where, "describe() = '", text, "'");
  return rep;
}

}  // namespace mesh_check
