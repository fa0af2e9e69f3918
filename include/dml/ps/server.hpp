// SPDX-License-Identifier: Apache-2.0
// dml/ps/server.hpp — the parameter server's server: a service loop over the key ranges this rank holds, which
// applies workers' pushes with a server-side optimizer, answers pulls under the consistency bound enforced by
// vector clocks, filters both directions with error feedback, and chain-replicates every range.
// Sits on ps/detail/server_ranges.hpp (what it holds), ps/transport.hpp and comm/compression.hpp; used by
// ps/downpour.hpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/comm/compression.hpp"
#include "dml/core/error.hpp"
#include "dml/ps/detail/server_ranges.hpp"
#include "dml/ps/transport.hpp"

namespace dml::ps {

// The server: a service loop over the ranges this rank holds (as primary or replica).

template <comm::communicator C>
class server {
 public:
  // Collective over `world` with every worker's kv_worker constructor. lengths: every key's length.
  server(C& world, std::vector<std::int64_t> lengths, options o)
      : opt_(std::move(o)), world_size_(world.size()), workers_(world.size() - opt_.servers),
        place_(std::move(lengths), opt_), ep_(world, everyone_but(world.rank(), world.size()),
                                              everyone_but(world.rank(), world.size())),
        me_(world.rank()), pull_filter_(comm::any_filter::parse(opt_.pull_filter)),
        push_filter_(comm::any_filter::parse(opt_.push_filter)), ranges_(place_, opt_, me_, workers_),
        dead_servers_(opt_.servers, false) {
    if (me_ >= opt_.servers)
      fail<invalid_argument>("dml::ps::server: rank ", me_, " is a worker (servers are ranks 0..",
                             opt_.servers - 1, ")");
  }

  // Serves until every worker has left or died (or this server's fault hook fires), then finishes.
  void serve() {
    typename detail::endpoint<C>::backoff b;
    auto last_check = clock::now();
    while (!done()) {
      const bool got = ep_.poll([&](int p, const detail::header& h, std::span<const std::byte> pl) { handle(p, h, pl); });
      if (clock::now() - last_check > opt_.timeout / 8) {
        last_check = clock::now();
        check_liveness();
      }
      if (opt_.fault && opt_.fault(me_, ranges_.max_clock())) {
        stopped_ = true;
        break;
      }
      b.idle(!got);
    }
    // A live server's bye carries the sums the leaving workers sent: [workers counted, sums...].
    detail::bytes_ptr sums;
    if (!stopped_) {
      std::vector<double> v{double(left_count_)};
      v.insert(v.end(), left_sums_.begin(), left_sums_.end());
      std::vector<std::byte> b;
      detail::put_bytes(b, v.data(), v.size() * sizeof(double));
      sums = detail::share(std::move(b));
    }
    ep_.finish(sums, [](int, std::span<const std::byte>) {});
  }

  bool stopped() const { return stopped_; }  // the fault hook fired

 private:
  struct entry {  // one range of a push or forward, checked
    std::uint32_t range;
    std::uint8_t kind;  // 0 gradient, 1 initial values
    detail::wire_floats values;
  };
  struct waiting_pull {
    int peer;
    detail::header h;
    std::vector<std::uint32_t> ranges;
  };
  struct forward_part {
    int dest;
    detail::bytes_ptr entries;  // the encoded entries, kept until acknowledged so they can be re-sent
  };
  struct forwarding {
    int origin;
    std::int64_t origin_id;
    detail::msg ack;
    std::int64_t worker, seq;
    std::map<std::int64_t, forward_part> parts;  // by forward id
  };

  static std::vector<int> everyone_but(int me, int n) {
    std::vector<int> v;
    for (int i = 0; i < n; ++i)
      if (i != me) v.push_back(i);
    return v;
  }
  int worker_index(int rank) const { return rank - opt_.servers; }
  bool is_worker(int rank) const { return rank >= opt_.servers; }
  bool done() const {
    for (int w = 0; w < workers_; ++w)
      if (ranges_.live(w)) return false;
    return forwards_.empty();
  }

  void reply_error(int peer, const detail::header& h, const std::string& what) {
    std::vector<std::byte> b;
    detail::put_bytes(b, what.data(), what.size());
    ep_.send(peer, {std::int64_t(detail::msg::error), h.id}, detail::share(std::move(b)));
  }

  void handle(int peer, const detail::header& h, std::span<const std::byte> payload) {
    if (is_worker(peer) && h.type != std::int64_t(detail::msg::pong)) {
      const int w = worker_index(peer);
      if (ranges_.dead(w) && h.type != std::int64_t(detail::msg::leave) && h.type != std::int64_t(detail::msg::ping) &&
          h.type != std::int64_t(detail::msg::bye)) {
        reply_error(peer, h, dml::detail::cat("dml::ps: server ", me_, " declared worker ", w, " dead after ",
                                         opt_.timeout.count(), " ms of silence; it cannot rejoin"));
        return;
      }
    }
    for (int s = 0; s < opt_.servers; ++s)
      if ((h.dead >> s) & 1) mark_server_dead(s);
    try {
      switch (detail::msg(h.type)) {
        case detail::msg::push:
        case detail::msg::forward: on_update(peer, h, payload); break;
        case detail::msg::pull: on_pull(peer, h, payload); break;
        case detail::msg::forward_ack: on_forward_ack(peer, h); break;
        case detail::msg::ping: ep_.send(peer, {std::int64_t(detail::msg::pong), h.id}); break;
        case detail::msg::pong: break;
        case detail::msg::dead_worker: mark_worker_dead(int(h.worker), false); break;
        case detail::msg::leave: on_leave(peer, payload); break;
        case detail::msg::bye: break;  // a peer that stopped: silence decides whether it is dead
        case detail::msg::stats: on_stats(peer, h); break;
        default:
          fail<invalid_argument>("dml::ps: server ", me_, " expected a request, found message type ",
                                 h.type, " from rank ", peer);
      }
    } catch (const invalid_argument& e) {
      // A bad request fails alone: its sender gets the reason, everyone else goes on being served.
      reply_error(peer, h, e.what());
    }
  }

  // Validates every entry before applying any, so a bad request changes nothing. Dense entries (initial values,
  // unfiltered gradients) are applied from the payload where they lie; filtered ones are decoded into decoded_
  // (kept between messages, so steady traffic allocates nothing).
  std::vector<entry> parse_entries(int peer, std::span<const std::byte> payload) {
    std::vector<entry> es;
    std::vector<std::size_t> first;  // per entry: where its decoded values start, or npos
    constexpr auto direct = std::size_t(-1);
    std::size_t total = 0;
    decoded_.clear();
    detail::reader rd{payload};
    const bool from_worker = is_worker(peer);
    while (!rd.done()) {
      entry e;
      e.range = rd.get<std::uint32_t>("a range id");
      e.kind = rd.get<std::uint8_t>("an entry kind");
      const auto n = rd.get<std::uint32_t>("an entry length");
      const auto bytes = rd.take(n, "an entry");
      if (e.range >= ranges_.size())
        fail<invalid_argument>("dml::ps: expected a key range below ", ranges_.size(),
                               " (keys outside every range), found range ", e.range);
      if (e.kind > 1) fail<invalid_argument>("dml::ps: expected entry kind 0 or 1, found ", int(e.kind));
      const auto& ch = place_.chains[e.range];
      if (!ranges_[e.range].held)
        fail<invalid_argument>("dml::ps: range ", e.range, " lives on servers ", list(ch), ", not on server ",
                               me_);
      if (from_worker) {
        const int prim = place_.primary(e.range, dead_servers_);
        if (prim != me_)
          fail<invalid_argument>("dml::ps: range ", e.range, "'s primary is server ", prim, " (chain ", list(ch),
                                 "), not server ", me_);
      }
      const auto len = std::size_t(place_.table.range(e.range).length);
      if (e.kind == 1) {
        if (bytes.size() != len * sizeof(float))
          fail<invalid_argument>("dml::ps: expected ", len, " initial values for range ", e.range, ", found ",
                                 bytes.size() / sizeof(float));
        e.values = detail::wire_floats(bytes);
        first.push_back(direct);
      } else if (push_filter_.kind() == comm::filter_kind::none) {
        const auto v = comm::no_filter::values(bytes, len);
        if (comm::message_header_bytes + v.size() != bytes.size())
          fail<invalid_argument>("dml::ps: expected range ", e.range, "'s entry to be ", bytes.size(),
                                 " bytes, the filter read ", comm::message_header_bytes + v.size());
        e.values = detail::wire_floats(v);
        first.push_back(direct);
      } else {
        decoded_.resize(total + len, 0.f);  // zeros: filters add what they carry
        const auto used = push_filter_.decode(bytes, std::span<float>(decoded_).subspan(total, len));
        if (used != bytes.size())
          fail<invalid_argument>("dml::ps: expected range ", e.range, "'s entry to be ", bytes.size(),
                                 " bytes, the filter read ", used);
        first.push_back(total);
        total += len;
      }
      es.push_back(e);
    }
    for (std::size_t i = 0; i < es.size(); ++i)  // decoded_ no longer moves
      if (first[i] != direct)
        es[i].values = detail::wire_floats(std::span<const float>(decoded_).subspan(
            first[i], std::size_t(place_.table.range(es[i].range).length)));
    return es;
  }

  static std::string list(const std::vector<int>& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  }

  // A push from a worker or a forward from the previous server of the chains: apply what is new, pass every
  // entry on to the next live server of its chain, acknowledge upstream once all of those have.
  void on_update(int peer, const detail::header& h, std::span<const std::byte> payload) {
    const bool from_worker = is_worker(peer);
    const int w = from_worker ? worker_index(peer) : int(h.worker);
    if (w < 0 || w >= workers_)
      fail<invalid_argument>("dml::ps: expected a worker index in [0, ", workers_, "), found ", w);
    for (const auto& e : parse_entries(peer, payload)) ranges_.apply(e.range, e.kind, w, std::uint64_t(h.seq), e.values);
    forwarding f{peer, h.id, from_worker ? detail::msg::push_ack : detail::msg::forward_ack, w, h.seq, {}};
    dispatch(f, payload);
    if (f.parts.empty()) acknowledge(f);
    else forwards_.push_back(std::move(f));
    serve_waiting();
  }

  // Passes the entries on, each to the next live server of its chain after this one (a tail keeps them).
  void dispatch(forwarding& f, std::span<const std::byte> entries) {
    std::map<int, std::shared_ptr<std::vector<std::byte>>> by_dest;
    detail::reader rd{entries};
    while (!rd.done()) {
      const auto from = rd.at;
      const auto range = rd.get<std::uint32_t>("a range id");
      rd.get<std::uint8_t>("an entry kind");
      rd.take(rd.get<std::uint32_t>("an entry length"), "an entry");
      const int next = successor(range);
      if (next < 0) continue;
      auto& b = by_dest[next];
      if (!b) b = pool_.take();
      detail::put_bytes(*b, entries.data() + from, rd.at - from);
    }
    for (auto& [dest, bytes] : by_dest) {
      const std::int64_t id = ++next_forward_;
      detail::header fh{std::int64_t(detail::msg::forward), id, f.seq};
      fh.worker = f.worker;
      fh.dead = detail::mask_of(dead_servers_);
      forward_part part{dest, bytes};
      ep_.send(dest, fh, part.entries);
      f.parts.emplace(id, std::move(part));
    }
  }

  void acknowledge(const forwarding& f) { ep_.send(f.origin, {std::int64_t(f.ack), f.origin_id}); }

  void on_forward_ack(int peer, const detail::header& h) {
    for (auto it = forwards_.begin(); it != forwards_.end(); ++it) {
      auto p = it->parts.find(h.id);
      if (p == it->parts.end() || p->second.dest != peer) continue;
      it->parts.erase(p);
      if (it->parts.empty()) {
        acknowledge(*it);
        forwards_.erase(it);
      }
      return;
    }
  }

  // The next live server after this one in range r's chain, or -1 when this one is the tail.
  int successor(std::uint32_t r) const {
    const auto& ch = place_.chains[r];
    const auto at = std::size_t(std::ranges::find(ch, me_) - ch.begin());
    return detail::next_live(ch, at + 1, dead_servers_);
  }

  void on_pull(int peer, const detail::header& h, std::span<const std::byte> payload) {
    if (!is_worker(peer)) fail<invalid_argument>("dml::ps: expected pulls from workers, found one from server ", peer);
    waiting_pull wp{peer, h, {}};
    detail::reader rd{payload};
    while (!rd.done()) {
      const auto r = rd.get<std::uint32_t>("a range id");
      if (r >= ranges_.size())
        fail<invalid_argument>("dml::ps: expected a key range below ", ranges_.size(),
                               " (keys outside every range), found range ", r);
      const int prim = place_.primary(r, dead_servers_);
      if (prim != me_)
        fail<invalid_argument>("dml::ps: range ", r, "'s primary is server ", prim, " (chain ",
                               list(place_.chains[r]), "), not server ", me_);
      wp.ranges.push_back(r);
    }
    if (ready(wp)) answer(wp);
    else waiting_.push_back(std::move(wp));
  }

  bool ready(const waiting_pull& wp) const { return ranges_.ready(wp.ranges, wp.h.seq); }

  void answer(const waiting_pull& wp) {
    const int w = worker_index(wp.peer);
    // Whole values (no pull filter) have a size known before any is written.
    std::size_t bytes = 0;
    if (pull_filter_.kind() == comm::filter_kind::none)
      for (auto r : wp.ranges) bytes += detail::entry_head_bytes + ranges_[r].value.size() * sizeof(float);
    auto buffer = pool_.take(bytes);
    auto& out = *buffer;
    for (auto r : wp.ranges) {
      auto& s = ranges_[r];
      auto& view = s.view[std::size_t(w)];
      // Mode 0: the values, which replace the worker's copy; 1: a filtered change to add to it.
      const bool whole = pull_filter_.kind() == comm::filter_kind::none || view.empty();
      const auto body = detail::open_entry(out, r, whole ? 0 : 1);
      if (whole) {
        detail::put_bytes(out, s.value.data(), s.value.size() * sizeof(float));
        if (pull_filter_.kind() != comm::filter_kind::none) view = s.value;
      } else {
        std::vector<float> change(s.value.size());
        for (std::size_t i = 0; i < change.size(); ++i) change[i] = s.value[i] - view[i];
        pull_filter_.encode(std::span<float>(change), out);
        // The worker adds exactly what was sent.
        pull_filter_.decode(std::span<const std::byte>(out).subspan(body), std::span<float>(view));
      }
      detail::close_entry(out, body);
    }
    ep_.send(wp.peer, {std::int64_t(detail::msg::pull_reply), wp.h.id}, buffer);
  }

  void serve_waiting() {
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (ready(*it)) {
        answer(*it);
        it = waiting_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void after_membership_change() {
    ranges_.complete_steps();
    serve_waiting();
  }

  void on_leave(int peer, std::span<const std::byte> payload) {
    const int w = worker_index(peer);
    if (ranges_.left(w)) return;
    ranges_.set_left(w);
    const std::size_t n = payload.size() / sizeof(double);
    if (left_sums_.size() < n) left_sums_.resize(n, 0.0);
    for (std::size_t i = 0; i < n; ++i) {
      double v;
      std::memcpy(&v, payload.data() + i * sizeof(double), sizeof(double));
      left_sums_[i] += v;
    }
    ++left_count_;
    after_membership_change();
  }

  void mark_worker_dead(int w, bool tell) {
    if (w < 0 || w >= workers_ || !ranges_.live(w)) return;
    ranges_.set_dead(w);
    // A dead worker's pulls are never answered.
    std::erase_if(waiting_, [&](const waiting_pull& p) { return worker_index(p.peer) == w; });
    if (tell)
      for (int s = 0; s < opt_.servers; ++s)
        if (s != me_ && !dead_servers_[s]) {
          detail::header h{std::int64_t(detail::msg::dead_worker)};
          h.worker = w;
          ep_.send(s, h);
        }
    after_membership_change();
  }

  void mark_server_dead(int s) {
    if (s == me_ || dead_servers_[s]) return;
    dead_servers_[s] = true;
    // Forwards to it go to the next live server of each chain instead, or are acknowledged here (tail).
    for (auto it = forwards_.begin(); it != forwards_.end();) {
      std::vector<std::int64_t> lost;
      for (auto& [id, part] : it->parts)
        if (part.dest == s) lost.push_back(id);
      for (auto id : lost) {
        const auto old = it->parts[id].entries;
        it->parts.erase(id);
        dispatch(*it, *old);
      }
      if (it->parts.empty()) {
        acknowledge(*it);
        it = forwards_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Peers that owe this server something and have been silent: ping them, and past the timeout count them
  // as dead. Workers owe a push while a bsp step or a waiting pull needs them; servers owe forward acks.
  void check_liveness() {
    const auto now = clock::now();
    std::vector<bool> owes(std::size_t(world_size_), false);
    for (const auto& f : forwards_)
      for (const auto& [id, part] : f.parts) owes[std::size_t(part.dest)] = true;
    // Every worker owes a push or a leave; while it waits it pings, so only a stopped worker falls silent.
    for (int w = 0; w < workers_; ++w) owes[std::size_t(opt_.servers + w)] = ranges_.live(w);
    for (int p = 0; p < world_size_; ++p) {
      if (!owes[std::size_t(p)]) continue;
      if (now - ep_.heard(p) > opt_.timeout) {
        if (is_worker(p)) mark_worker_dead(worker_index(p), true);
        else mark_server_dead(p);
      } else if (!is_worker(p) && now - ep_.heard(p) > opt_.timeout / 4 && now - ep_.sent(p) > opt_.timeout / 4) {
        // Servers answer pings; workers ping the servers themselves while they wait.
        ep_.send(p, {std::int64_t(detail::msg::ping)});
      }
    }
  }
  void on_stats(int peer, const detail::header& h) {
    std::vector<std::byte> out;
    ranges_.stats(out);
    ep_.send(peer, {std::int64_t(detail::msg::stats_reply), h.id}, detail::share(std::move(out)));
  }

  options opt_;
  int world_size_, workers_;
  placement place_;
  detail::endpoint<C> ep_;
  int me_;
  comm::any_filter pull_filter_, push_filter_;
  detail::server_ranges ranges_;  // the ranges' state and the workers' membership
  std::vector<bool> dead_servers_;
  std::list<forwarding> forwards_;
  std::list<waiting_pull> waiting_;
  std::int64_t next_forward_ = 0;
  detail::buffer_pool pool_;
  std::vector<float> decoded_;
  std::vector<double> left_sums_;  // what the workers that left asked to have summed
  int left_count_ = 0;
  bool stopped_ = false;
};

}  // namespace dml::ps
