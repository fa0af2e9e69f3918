// SPDX-License-Identifier: Apache-2.0
// dml/ps/worker.hpp — the parameter server's worker side (kv_worker, in the shape of ps-lite's KVWorker):
// push, pull and wait on timestamps, error-feedback push filters, fail-over to the next live server of each
// range's chain, and the servers' reports.
// Sits on ps/transport.hpp and comm/compression.hpp; used by ps/downpour.hpp.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/comm/compression.hpp"
#include "dml/core/error.hpp"
#include "dml/ps/keys.hpp"
#include "dml/ps/transport.hpp"

namespace dml::ps {

// What a server knows about one range at the end: its vector clock, how far the fastest live worker ever
// ran ahead of the slowest, and the push sequence numbers it applied per worker (the acknowledgement log).
struct range_report {
  std::uint32_t range = 0;
  int server = -1;                                   // the rank that reported it (the range's primary)
  std::vector<std::int64_t> clock;                   // per worker
  std::int64_t max_lead = 0;
  std::vector<std::vector<std::uint64_t>> applied;   // per worker, ascending
};

struct traffic {
  std::int64_t bytes_pushed = 0, bytes_pulled = 0;   // payload bytes: requests out, replies in
  std::int64_t pushes = 0, pulls = 0;
  double idle_s = 0;                                 // time spent inside wait()
};

// The worker's side, in the shape of ps-lite's KVWorker: push and pull return a timestamp at once, wait(ts)
// blocks until that operation is done. Values are spans over the concatenation of the keys named, in the
// order named; the spans must stay alive until the operation's wait returns.

template <comm::communicator C>
class kv_worker {
 public:
  kv_worker(C& world, std::vector<std::int64_t> lengths, options o)
      : opt_(std::move(o)), workers_(world.size() - opt_.servers), place_(std::move(lengths), opt_),
        ep_(world, servers_list(opt_.servers), servers_list(opt_.servers)), me_(world.rank()),
        index_(me_ - opt_.servers), push_filter_(comm::any_filter::parse(opt_.push_filter)),
        pull_filter_(comm::any_filter::parse(opt_.pull_filter)), dead_(opt_.servers, false),
        residual_(std::size_t(place_.table.total()), 0.f) {
    if (index_ < 0)
      fail<invalid_argument>("dml::ps::kv_worker: rank ", me_, " is a server (workers are ranks ",
                             opt_.servers, "..", world.size() - 1, ")");
  }

  int index() const { return index_; }   // among the workers
  int workers() const { return workers_; }
  const placement& layout() const { return place_; }
  const traffic& stats() const { return traffic_; }
  std::int64_t pushes() const { return seq_; }

  // Sets the servers' values of `keys` unless another worker did first (every worker may call it with the
  // same values; the first to arrive wins). Waits until every replica has them.
  void init(std::span<const key> keys, std::span<const float> values) {
    wait(send_update(keys, values, 1));
  }

  // Adds `grads` (the concatenation of the keys' gradients) to this worker's error-feedback residual and
  // sends what the push filter lets through. The servers apply it with their optimizer.
  std::int64_t push(std::span<const key> keys, std::span<const float> grads) {
    return send_update(keys, grads, 0);
  }

  // Fetches the servers' values of `keys` into `out`. Under a consistency bound S, the servers answer once
  // every live worker has made at least pushes() - S pushes. With a pull filter, `out` must hold what the
  // last pull of these keys left there: filtered replies carry changes.
  std::int64_t pull(std::span<const key> keys, std::span<float> out) {
    std::int64_t want = 0;
    for (key k : keys) want += place_.table.length(k);
    if (want != std::int64_t(out.size()))
      fail<invalid_argument>("dml::ps::pull: expected ", want, " values for ", keys.size(), " keys, found ",
                             out.size());
    auto req = make_request(false);
    req->out = out;
    std::int64_t at = 0;
    for (key k : keys) {
      for (const auto& r : place_.table.ranges_of(k)) req->where[r.id] = at + r.offset;
      at += place_.table.length(k);
    }
    std::map<int, std::vector<std::byte>> parts;
    for (const auto& [r, off] : req->where) {
      detail::put(parts[primary(r)], r);
    }
    for (auto& [s, bytes] : parts) send_part(*req, s, std::move(bytes));
    ++traffic_.pulls;
    return req->ts;
  }

  void wait(std::int64_t ts) {
    const auto t0 = clock::now();
    typename detail::endpoint<C>::backoff b;
    for (;;) {
      auto it = requests_.find(ts);
      if (it == requests_.end()) break;
      if (it->second->parts.empty()) {
        auto req = std::move(it->second);
        requests_.erase(it);
        if (!req->error.empty()) throw invalid_argument(req->error);
        break;
      }
      b.idle(!progress());
    }
    traffic_.idle_s += std::chrono::duration<double>(clock::now() - t0).count();
  }

  // Sends a hand-built request to `rank`: what a misbehaving client might send. For tests of the servers'
  // checks; wait(ts) throws the server's answer.
  std::int64_t raw_push(int rank, std::vector<std::byte> payload) {
    if (rank < 0 || rank >= opt_.servers)
      fail<invalid_argument>("dml::ps::kv_worker: expected a server rank in [0, ", opt_.servers,
                             "), found ", rank, " (an unknown server)");
    ++seq_;
    auto req = make_request(true);
    send_part(*req, rank, std::move(payload));
    return req->ts;
  }

  // The servers' reports of every range, each from its current primary.
  std::vector<range_report> report() {
    auto req = make_request(false);
    req->stats = true;
    for (int s = 0; s < opt_.servers; ++s)
      if (!dead_[std::size_t(s)]) send_part(*req, s, detail::bytes_ptr{});
    reports_.clear();
    wait(req->ts);
    std::vector<range_report> out;
    for (std::uint32_t r = 0; r < place_.chains.size(); ++r) {
      const int p = place_.primary(r, dead_);
      for (auto& rep : reports_)
        if (rep.range == r && rep.server == p) out.push_back(rep);
    }
    return out;
  }

  bool server_dead(int s) const { return dead_[std::size_t(s)]; }

  // Leaves the servers' clocks once every request is done, then finishes. `mine` are numbers to sum over the
  // workers (bytes, losses, ...): each live server adds those of every worker that leaves, and the sums come
  // back when the servers are done, element 0 being how many workers they count. No worker-to-worker
  // collective: a worker that finishes early waits for the slowest without any deadline.
  std::vector<double> leave(std::span<const double> mine = {}) {
    while (!requests_.empty()) wait(requests_.begin()->first);
    std::vector<std::byte> b;
    detail::put_bytes(b, mine.data(), mine.size_bytes());
    const auto payload = detail::share(std::move(b));
    for (int s = 0; s < opt_.servers; ++s) ep_.send(s, {std::int64_t(detail::msg::leave)}, payload);
    std::vector<double> sums{0.0};
    ep_.finish({}, [&](int, std::span<const std::byte> pl) {
      std::vector<double> v(pl.size() / sizeof(double));
      if (!v.empty()) std::memcpy(v.data(), pl.data(), v.size() * sizeof(double));
      if (!v.empty() && v[0] > sums[0]) sums = std::move(v);  // the server that counted the most workers
    });
    sums.resize(mine.size() + 1, 0.0);
    return sums;
  }
  // Stops without a word, as a crashed worker would (its closed connections say bye), and drains until the
  // others are done.
  void die() { ep_.finish(); }

 private:
  struct part {
    int server;
    detail::bytes_ptr bytes;  // kept for a re-send to the next primary
  };
  struct request {
    std::int64_t ts = 0;
    bool push = false, stats = false;
    std::int64_t seq = 0;
    std::map<std::int64_t, part> parts;  // by message id
    std::map<std::uint32_t, std::int64_t> where;  // pull: range -> offset in out
    std::span<float> out;
    std::string error;
  };

  static std::vector<int> servers_list(int n) {
    std::vector<int> v(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) v[std::size_t(i)] = i;
    return v;
  }

  int primary(std::uint32_t r) const {
    const int p = place_.primary(r, dead_);
    if (p < 0)
      fail<comm_error>("dml::ps: every server holding key range ", r, " is gone (chain ",
                       chain_text(r), "); raise options::replicas to survive more losses");
    return p;
  }
  std::string chain_text(std::uint32_t r) const {
    std::string s;
    for (int x : place_.chains[r]) s += (s.empty() ? "" : ", ") + std::to_string(x);
    return s;
  }

  request* make_request(bool push) {
    auto req = std::make_unique<request>();
    req->ts = ++next_ts_;
    req->push = push;
    req->seq = seq_;
    auto* p = req.get();
    requests_.emplace(req->ts, std::move(req));
    return p;
  }

  std::int64_t send_update(std::span<const key> keys, std::span<const float> values, std::uint8_t kind) {
    // Checked before the residual changes, so a refused push leaves no trace.
    std::int64_t want = 0;
    for (key k : keys) want += place_.table.length(k);
    if (want != std::int64_t(values.size()))
      fail<invalid_argument>("dml::ps::push: expected ", want, " values for ", keys.size(), " keys, found ",
                             values.size());
    if (kind == 0) ++seq_;
    auto req = make_request(true);
    // Each server's part, sized first where the values go whole: initial values as they are, unfiltered
    // gradients as a dense filter message (its header, then the values).
    const bool dense = kind == 0 && push_filter_.kind() == comm::filter_kind::none;
    std::map<int, std::size_t> sizes;
    if (kind != 0 || dense)
      for (key k : keys)
        for (const auto& r : place_.table.ranges_of(k))
          sizes[primary(r.id)] += detail::entry_head_bytes + (dense ? comm::message_header_bytes : 0) +
                                  std::size_t(r.length) * sizeof(float);
    std::map<int, std::shared_ptr<std::vector<std::byte>>> parts;
    std::int64_t at = 0;
    for (key k : keys) {
      for (const auto& r : place_.table.ranges_of(k)) {
        const auto v = values.subspan(std::size_t(at + r.offset), std::size_t(r.length));
        const int s = primary(r.id);
        auto& slot = parts[s];
        if (!slot) slot = pool_.take(sizes[s]);
        auto& b = *slot;
        const auto body = detail::open_entry(b, r.id, kind);
        if (dense) {
          comm::no_filter{}.encode_copy(v, b);  // sends everything: no residual to keep
        } else if (kind == 0) {
          auto res = std::span<float>(residual_).subspan(std::size_t(r.flat), std::size_t(r.length));
          for (std::size_t i = 0; i < res.size(); ++i) res[i] += v[i];
          push_filter_.encode(res, b);
        } else {
          detail::put_bytes(b, v.data(), v.size_bytes());
        }
        detail::close_entry(b, body);
      }
      at += place_.table.length(k);
    }
    for (auto& [s, bytes] : parts) send_part(*req, s, bytes);
    if (kind == 0) ++traffic_.pushes;
    return req->ts;
  }

  void send_part(request& req, int s, std::vector<std::byte> bytes) { send_part(req, s, detail::share(std::move(bytes))); }
  void send_part(request& req, int s, detail::bytes_ptr shared) {
    const std::int64_t id = ++next_id_;
    detail::header h{std::int64_t(req.stats ? detail::msg::stats : req.push ? detail::msg::push : detail::msg::pull), id,
                     req.seq};
    h.worker = index_;
    h.dead = detail::mask_of(dead_);
    if (req.push && !req.stats) traffic_.bytes_pushed += shared ? std::int64_t(shared->size()) : 0;
    ep_.send(s, h, shared);
    req.parts.emplace(id, part{s, std::move(shared)});
    owner_[id] = req.ts;
  }

  // Handles what has arrived; watches the servers that owe replies. Returns whether anything arrived.
  bool progress() {
    const bool got = ep_.poll([&](int s, const detail::header& h, std::span<const std::byte> pl) { on(s, h, pl); });
    const auto now = clock::now();
    if (now - last_check_ > opt_.timeout / 8) {
      last_check_ = now;
      std::vector<bool> owes(std::size_t(opt_.servers), false);
      for (const auto& [ts, req] : requests_)
        for (const auto& [id, p] : req->parts) owes[std::size_t(p.server)] = true;
      for (int s = 0; s < opt_.servers; ++s) {
        if (dead_[std::size_t(s)]) continue;
        if (owes[std::size_t(s)] && now - ep_.heard(s) > opt_.timeout) {
          fail_over(s);
        } else if (now - ep_.sent(s) > opt_.timeout / 4) {
          // Keep every server hearing from this worker while it waits (silence is death).
          ep_.send(s, {std::int64_t(detail::msg::ping)});
        }
      }
    }
    return got;
  }

  void on(int s, const detail::header& h, std::span<const std::byte> payload) {
    auto o = owner_.find(h.id);
    if (o == owner_.end()) return;  // pong, or a late answer to a request re-sent elsewhere
    auto rq = requests_.find(o->second);
    if (rq == requests_.end()) return;
    auto& req = *rq->second;
    auto pi = req.parts.find(h.id);
    if (pi == req.parts.end() || pi->second.server != s) return;
    switch (detail::msg(h.type)) {
      case detail::msg::push_ack: break;
      case detail::msg::error:
        if (req.error.empty())
          req.error = std::string(reinterpret_cast<const char*>(payload.data()), payload.size());
        break;
      case detail::msg::pull_reply: read_pull(req, payload); break;
      case detail::msg::stats_reply: read_stats(s, payload); break;
      default: return;
    }
    req.parts.erase(pi);
    owner_.erase(o);
  }

  void read_pull(request& req, std::span<const std::byte> payload) {
    traffic_.bytes_pulled += std::int64_t(payload.size());
    detail::reader rd{payload};
    while (!rd.done()) {
      const auto r = rd.get<std::uint32_t>("a range id");
      const auto mode = rd.get<std::uint8_t>("a reply mode");
      const auto bytes = rd.take(rd.get<std::uint32_t>("a reply length"), "a reply");
      const auto at = req.where.find(r);
      if (at == req.where.end()) continue;
      auto dst = req.out.subspan(std::size_t(at->second), std::size_t(place_.table.range(r).length));
      if (mode == 0) {
        if (bytes.size() != dst.size_bytes())
          fail<invalid_argument>("dml::ps::pull: expected ", dst.size(), " values for range ", r,
                                 ", found ", bytes.size() / sizeof(float));
        std::memcpy(dst.data(), bytes.data(), bytes.size());
      } else {
        pull_filter_.decode(bytes, dst);
      }
    }
  }

  void read_stats(int s, std::span<const std::byte> payload) {
    detail::reader rd{payload};
    while (!rd.done()) {
      range_report rep;
      rep.range = rd.get<std::uint32_t>("a range id");
      rep.server = s;
      rep.max_lead = rd.get<std::int64_t>("a lead");
      rep.clock.resize(std::size_t(workers_));
      rep.applied.resize(std::size_t(workers_));
      for (int w = 0; w < workers_; ++w) {
        rep.clock[std::size_t(w)] = rd.get<std::int64_t>("a clock");
        const auto n = rd.get<std::uint32_t>("a count");
        for (std::uint32_t i = 0; i < n; ++i) rep.applied[std::size_t(w)].push_back(rd.get<std::uint64_t>("a seq"));
      }
      reports_.push_back(std::move(rep));
    }
  }

  // Server s is gone: every part it owed goes to the next live server of each range's chain.
  void fail_over(int s) {
    dead_[std::size_t(s)] = true;
    for (auto& [ts, req] : requests_) {
      std::vector<std::int64_t> lost;
      for (const auto& [id, p] : req->parts)
        if (p.server == s) lost.push_back(id);
      for (auto id : lost) {
        const auto old = req->parts[id].bytes;
        req->parts.erase(id);
        owner_.erase(id);
        if (req->stats) continue;
        std::map<int, std::vector<std::byte>> regroup;
        detail::reader rd{*old};
        while (!rd.done()) {
          const auto from = rd.at;
          const auto r = rd.get<std::uint32_t>("a range id");
          if (req->push) {
            rd.get<std::uint8_t>("an entry kind");
            rd.take(rd.get<std::uint32_t>("an entry length"), "an entry");
          }
          detail::put_bytes(regroup[primary(r)], old->data() + from, rd.at - from);
        }
        for (auto& [to, bytes] : regroup) send_part(*req, to, std::move(bytes));
        // A pull's new primary has no record of this worker's copy: it answers with whole values.
      }
    }
  }

  options opt_;
  int workers_;
  placement place_;
  detail::endpoint<C> ep_;
  int me_, index_;
  comm::any_filter push_filter_, pull_filter_;
  std::vector<bool> dead_;
  std::vector<float> residual_;
  std::map<std::int64_t, std::unique_ptr<request>> requests_;
  std::map<std::int64_t, std::int64_t> owner_;  // message id -> request ts
  std::vector<range_report> reports_;
  detail::buffer_pool pool_;
  std::int64_t next_ts_ = 0, next_id_ = 0, seq_ = 0;
  clock::time_point last_check_ = clock::now();
  traffic traffic_;
};

}  // namespace dml::ps
