// SPDX-License-Identifier: Apache-2.0
// dml/parallel/param_server.hpp — a parameter server over any communicator's tagged send/recv: servers hold
// key ranges (ps_keys.hpp), apply workers' pushes with a server-side optimizer, answer pulls under a
// consistency bound enforced by vector clocks, filter both directions with error feedback
// (comm/compression.hpp), and chain-replicate every range so a server's loss loses no acknowledged update.
// Sits on comm/ and optim/; train/downpour.hpp trains a model with it.
//
// Ranks [0, servers) serve; the rest are workers. Every node is one thread of control that polls: a worker
// makes progress inside push/pull/wait, a server inside serve(). Liveness is by silence: a peer that owes a
// reply and has said nothing for `timeout` (pings go out every timeout/4 while waiting) is dead to the one
// waiting; dead servers' ranges fail over to the next live server of their chain, dead workers leave the
// clocks. Nothing ever blocks on a peer without a deadline, so a lost peer cannot hang the others.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/comm/compression.hpp"
#include "dml/core/error.hpp"
#include "dml/optim/adagrad.hpp"
#include "dml/parallel/consistency.hpp"
#include "dml/parallel/ps_keys.hpp"

namespace dml::parallel::ps {

using clock = std::chrono::steady_clock;

// How a server applies a pushed gradient g to its values v.
struct server_optimizer {
  enum kind_t { sgd, adagrad } kind = sgd;
  float lr = 0.1f;
  float eps = 1e-10f;                 // adagrad: v -= lr g / (sqrt(Σg²) + eps)
  float initial_accumulator = 0.f;    // adagrad: Σg² starts here

  static server_optimizer parse(std::string_view s, float lr) {
    if (s == "sgd") return {sgd, lr};
    if (s == "adagrad") return {adagrad, lr};
    fail<invalid_argument>("dml::parallel::ps: expected a server optimizer sgd or adagrad, found '", s, "'");
  }
  std::string name() const { return kind == sgd ? "sgd" : "adagrad"; }
};

struct options {
  int servers = 1;                         // ranks [0, servers) serve
  int replicas = 0;                        // each range also lives on the next `replicas` servers of the ring
  std::int64_t max_range = 1 << 16;        // elements per key range
  int vnodes = 64;                         // ring points per server
  int staleness = consistency::unbounded;  // from the consistency policy: 0 bsp, S ssp, < 0 async
  server_optimizer optimizer{};
  std::string push_filter = "none", pull_filter = "none";  // comm::any_filter::parse forms
  std::chrono::milliseconds timeout{10000};                // silence after which a peer that owes us is dead
  // Fault hook, for tests and the example: server `s` stops without a word (it keeps draining its inbox and
  // never answers) once it returns true. `max_clock` is the most pushes any worker has had applied there.
  std::function<bool(int s, std::int64_t max_clock)> fault;
};

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

namespace detail {

enum class msg : std::int64_t {
  push = 1, push_ack, pull, pull_reply, forward, forward_ack, error, ping, pong, dead_worker, leave, stats,
  stats_reply, bye
};

struct header {
  std::int64_t type = 0;
  std::int64_t id = 0;      // request id of the sender, echoed in the reply
  std::int64_t seq = 0;     // push: the worker's push count; pull: pushes it made before pulling
  std::int64_t bytes = 0;   // payload that follows with the payload tag
  std::int64_t dead = 0;    // bit s: the sender counts server s as dead
  std::int64_t worker = -1; // push/pull/forward: the worker index the request is for
  std::int64_t aux = 0;
  std::int64_t pad = 0;
};

inline constexpr int header_tag = 0x5053;   // "PS"
inline constexpr int payload_tag = 0x5054;

// Payload writing (appending to a byte vector) and bounds-checked reading.
template <class T>
void put(std::vector<std::byte>& b, const T& v) {
  const auto n = b.size();
  b.resize(n + sizeof(T));
  std::memcpy(b.data() + n, &v, sizeof(T));
}
inline void put_bytes(std::vector<std::byte>& b, const void* p, std::size_t bytes) {
  if (bytes == 0) return;
  const auto* q = static_cast<const std::byte*>(p);
  b.insert(b.end(), q, q + bytes);  // into kept capacity, without zero-filling it first
}
// An entry is (u32 range, u8 kind, u32 length, bytes): open_entry writes the head, whose length
// close_entry fills in once the body has been appended in place.
inline std::size_t open_entry(std::vector<std::byte>& b, std::uint32_t range, std::uint8_t kind) {
  put(b, range);
  put(b, kind);
  put(b, std::uint32_t(0));
  return b.size();
}
inline void close_entry(std::vector<std::byte>& b, std::size_t body) {
  const auto n = std::uint32_t(b.size() - body);
  std::memcpy(b.data() + body - sizeof(n), &n, sizeof(n));
}

struct reader {
  std::span<const std::byte> s;
  std::size_t at = 0;
  template <class T>
  T get(const char* what) {
    if (s.size() - at < sizeof(T))
      fail<invalid_argument>("dml::parallel::ps: expected ", sizeof(T), " more bytes for ", what, " at byte ", at,
                             ", found ", s.size() - at, " (a truncated message)");
    T v;
    std::memcpy(&v, s.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
  std::span<const std::byte> take(std::size_t n, const char* what) {
    if (s.size() - at < n)
      fail<invalid_argument>("dml::parallel::ps: expected ", n, " bytes for ", what, " at byte ", at, ", found ",
                             s.size() - at, " (a truncated message)");
    auto out = s.subspan(at, n);
    at += n;
    return out;
  }
  bool done() const { return at == s.size(); }
};

using bytes_ptr = std::shared_ptr<const std::vector<std::byte>>;
inline bytes_ptr share(std::vector<std::byte> b) { return std::make_shared<const std::vector<std::byte>>(std::move(b)); }

// Payload buffers that keep their capacity: one is free again once no send or re-send record holds it, so
// steady pushes and pulls reuse memory instead of mapping (and faulting in) fresh pages for every message.
class buffer_pool {
 public:
  std::shared_ptr<std::vector<std::byte>> take() {
    for (auto& b : all_)
      if (b.use_count() == 1) {
        b->clear();
        return b;
      }
    return all_.emplace_back(std::make_shared<std::vector<std::byte>>());
  }

 private:
  std::vector<std::shared_ptr<std::vector<std::byte>>> all_;
};

// A node's transport: one header receive posted per peer it listens to, payloads fetched as headers name
// them, sends non-blocking and retired as they complete. Finishing is a protocol of its own (finish()), so
// no receive is ever left posted and no send left unmatched, whichever nodes died.
template <class C>
class endpoint {
 public:
  endpoint(C& world, std::vector<int> listen, std::vector<int> talk)
      : comm_(world.split(0, world.rank())), rank_(comm_.rank()), listen_(std::move(listen)), talk_(std::move(talk)),
        in_(comm_.size()), heard_(comm_.size(), clock::now()), sent_(comm_.size(), clock::now()) {
    for (int p : listen_) post(p);
  }
  endpoint(const endpoint&) = delete;
  endpoint& operator=(const endpoint&) = delete;
  ~endpoint() {
    // After finish() nothing is posted; while an exception unwinds, withdraw what is.
    for (auto& in : in_)
      if (in.posted) in.r.cancel();
  }

  int rank() const { return rank_; }
  int size() const { return comm_.size(); }

  // The payload is shared, not copied: a sender may keep it to send again elsewhere.
  void send(int peer, header h, bytes_ptr payload = {}) {
    auto m = std::make_unique<out_msg>();
    h.bytes = payload ? std::int64_t(payload->size()) : 0;
    m->h = h;
    m->payload = std::move(payload);
    m->hr = comm_.isend(std::span<const header>(&m->h, 1), peer, header_tag);
    if (h.bytes > 0) m->pr = comm_.isend(std::span<const std::byte>(*m->payload), peer, payload_tag);
    sent_[peer] = clock::now();
    out_.push_back(std::move(m));
  }

  // One pass over the peers: every header that has arrived is handed to on(peer, header, payload).
  // Returns whether anything arrived.
  template <class F>
  bool poll(F&& on) {
    retire();
    bool any = false;
    for (int p : listen_) {
      auto& in = in_[p];
      if (!in.posted || !in.r.test()) continue;
      in.posted = false;
      any = true;
      heard_[p] = clock::now();
      const header h = in.h;
      if (payload_.size() < std::size_t(h.bytes)) payload_.resize(std::size_t(h.bytes));
      const auto payload = std::span<std::byte>(payload_).first(std::size_t(h.bytes));
      if (h.bytes > 0) comm_.recv(payload, p, payload_tag);
      if (h.type == std::int64_t(msg::bye)) ++byes_;  // nothing more comes from p
      else post(p);
      on(p, h, std::span<const std::byte>(payload));
    }
    return any;
  }

  clock::time_point heard(int p) const { return heard_[p]; }
  clock::time_point sent(int p) const { return sent_[p]; }

  // A bye tells a peer that this node will send it nothing more (as a closing connection does); it may
  // carry a last payload. finish() says bye to every peer that listens to this node, then drains (dropping
  // all but byes, which go to on_bye) until every peer it listens to has said bye and its own sends have
  // completed. No collective and no deadline: a node that finishes early waits for the slowest by polling.
  template <class F>
  void finish(bytes_ptr last, F&& on_bye) {
    for (int p : talk_) send(p, header{std::int64_t(msg::bye)}, last);
    backoff b;
    auto pass = [&](int p, const header& h, std::span<const std::byte> pl) {
      if (h.type == std::int64_t(msg::bye)) on_bye(p, pl);
    };
    while (byes_ < int(listen_.size()) || !out_.empty()) b.idle(!poll(pass));
  }
  void finish() {
    finish({}, [](int, std::span<const std::byte>) {});
  }

  // Sleeps a little longer each idle pass (up to 200 µs), so idle nodes leave the cores to busy ones.
  struct backoff {
    int n = 0;
    void idle(bool nothing) {
      if (!nothing) {
        n = 0;
        return;
      }
      if (++n < 32) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(std::min(200, (n - 31) * 10)));
    }
  };

 private:
  struct inbound {
    header h;
    comm::request r;
    bool posted = false;
  };
  struct out_msg {
    header h;
    bytes_ptr payload;
    comm::request hr, pr;
  };
  void post(int p) {
    in_[p].r = comm_.irecv(std::span<header>(&in_[p].h, 1), p, header_tag);
    in_[p].posted = true;
  }
  void retire() {
    while (!out_.empty() && out_.front()->hr.test() && out_.front()->pr.test()) out_.pop_front();
  }

  C comm_;
  int rank_;
  std::vector<int> listen_, talk_;
  std::vector<inbound> in_;
  std::deque<std::unique_ptr<out_msg>> out_;
  std::vector<clock::time_point> heard_, sent_;
  std::vector<std::byte> payload_;  // the last payload received, handed out as a span
  int byes_ = 0;
};

inline std::int64_t mask_of(const std::vector<bool>& dead) {
  std::int64_t m = 0;
  for (std::size_t s = 0; s < dead.size(); ++s)
    if (dead[s]) m |= std::int64_t(1) << s;
  return m;
}

// The first live server of range r's chain from position `from` on, or -1.
inline int next_live(const std::vector<int>& chain, std::size_t from, const std::vector<bool>& dead) {
  for (std::size_t i = from; i < chain.size(); ++i)
    if (!dead[chain[i]]) return chain[i];
  return -1;
}

}  // namespace detail

// The placement every node computes alike: key table, ring and chains.
struct placement {
  key_table table;
  ring hash_ring;
  int replicas = 0;
  std::vector<std::vector<int>> chains;  // per range: servers, primary first

  placement() = default;
  placement(std::vector<std::int64_t> lengths, const options& o)
      : table(std::move(lengths), o.max_range), hash_ring(o.servers, o.vnodes), replicas(o.replicas) {
    if (o.replicas < 0 || o.replicas >= o.servers)
      fail<invalid_argument>("dml::parallel::ps: expected 0 <= replicas < servers (", o.servers, "), found ", o.replicas);
    if (o.servers > 62) fail<invalid_argument>("dml::parallel::ps: expected at most 62 servers, found ", o.servers);
    for (const auto& r : table.ranges()) chains.push_back(hash_ring.chain(r, replicas));
  }
  int primary(std::uint32_t r, const std::vector<bool>& dead) const { return detail::next_live(chains[r], 0, dead); }
};

// ---------------------------------------------------------------------------------------------------------
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
        push_filter_(comm::any_filter::parse(opt_.push_filter)), dead_servers_(opt_.servers, false),
        dead_workers_(workers_, false), left_(workers_, false) {
    if (me_ >= opt_.servers)
      fail<invalid_argument>("dml::parallel::ps::server: rank ", me_, " is a worker (servers are ranks 0..",
                             opt_.servers - 1, ")");
    const auto ranges = place_.table.ranges();
    state_.resize(ranges.size());
    for (std::size_t r = 0; r < ranges.size(); ++r) {
      const auto& ch = place_.chains[r];
      if (std::ranges::find(ch, me_) == ch.end()) continue;
      auto& s = state_[r];
      s.held = true;
      s.value.assign(std::size_t(ranges[r].length), 0.f);
      if (opt_.optimizer.kind == server_optimizer::adagrad)
        s.accum.assign(std::size_t(ranges[r].length), opt_.optimizer.initial_accumulator);
      s.clock.assign(std::size_t(workers_), 0);
      s.applied.resize(std::size_t(workers_));
      s.view.resize(std::size_t(workers_));
    }
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
      if (opt_.fault && opt_.fault(me_, max_clock_)) {
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
  struct range_state {
    bool held = false, initialised = false;
    std::vector<float> value, accum;
    std::vector<std::int64_t> clock;                  // per worker: pushes applied
    std::vector<std::vector<std::uint64_t>> applied;  // per worker: push sequence numbers received, ascending
    std::map<std::int64_t, std::map<int, std::vector<float>>> pending;  // bsp: step -> worker -> gradient
    std::vector<std::vector<float>> view;             // per worker: what its copy holds (pull filters)
    std::int64_t max_lead = 0;
  };
  struct entry {  // one range of a push or forward, decoded
    std::uint32_t range;
    std::uint8_t kind;  // 0 gradient, 1 initial values
    std::span<const std::byte> bytes;
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
      if (!left_[w] && !dead_workers_[w]) return false;
    return forwards_.empty();
  }
  std::int64_t min_live_clock(const range_state& s) const {
    std::int64_t m = std::numeric_limits<std::int64_t>::max();
    for (int w = 0; w < workers_; ++w)
      if (!dead_workers_[w] && !left_[w]) m = std::min(m, s.clock[w]);
    return m;
  }

  void reply_error(int peer, const detail::header& h, const std::string& what) {
    std::vector<std::byte> b;
    detail::put_bytes(b, what.data(), what.size());
    ep_.send(peer, {std::int64_t(detail::msg::error), h.id}, detail::share(std::move(b)));
  }

  void handle(int peer, const detail::header& h, std::span<const std::byte> payload) {
    if (is_worker(peer) && h.type != std::int64_t(detail::msg::pong)) {
      const int w = worker_index(peer);
      if (dead_workers_[w] && h.type != std::int64_t(detail::msg::leave) && h.type != std::int64_t(detail::msg::ping) &&
          h.type != std::int64_t(detail::msg::bye)) {
        reply_error(peer, h, dml::detail::cat("dml::parallel::ps: server ", me_, " declared worker ", w, " dead after ",
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
          fail<invalid_argument>("dml::parallel::ps: server ", me_, " expected a request, found message type ",
                                 h.type, " from rank ", peer);
      }
    } catch (const invalid_argument& e) {
      // A bad request fails alone: its sender gets the reason, everyone else goes on being served.
      reply_error(peer, h, e.what());
    }
  }

  // Decodes and validates every entry before applying any, so a bad request changes nothing.
  // The entries' values land in decoded_ (kept between messages, so steady traffic allocates nothing);
  // entry i's are decoded_[first[i], first[i] + its range's length).
  std::vector<entry> parse_entries(int peer, std::span<const std::byte> payload, std::vector<std::size_t>& first) {
    std::vector<entry> es;
    std::size_t total = 0;
    decoded_.clear();
    detail::reader rd{payload};
    const bool from_worker = is_worker(peer);
    while (!rd.done()) {
      entry e;
      e.range = rd.get<std::uint32_t>("a range id");
      e.kind = rd.get<std::uint8_t>("an entry kind");
      const auto n = rd.get<std::uint32_t>("an entry length");
      e.bytes = rd.take(n, "an entry");
      if (e.range >= state_.size())
        fail<invalid_argument>("dml::parallel::ps: expected a key range below ", state_.size(),
                               " (keys outside every range), found range ", e.range);
      if (e.kind > 1) fail<invalid_argument>("dml::parallel::ps: expected entry kind 0 or 1, found ", int(e.kind));
      const auto& ch = place_.chains[e.range];
      if (!state_[e.range].held)
        fail<invalid_argument>("dml::parallel::ps: range ", e.range, " lives on servers ", list(ch), ", not on server ",
                               me_);
      if (from_worker) {
        const int prim = place_.primary(e.range, dead_servers_);
        if (prim != me_)
          fail<invalid_argument>("dml::parallel::ps: range ", e.range, "'s primary is server ", prim,
                                 " (chain ", list(ch), "), not server ", me_);
      }
      const auto len = std::size_t(place_.table.range(e.range).length);
      decoded_.resize(total + len, 0.f);  // zeros: filters add what they carry
      const auto g = std::span<float>(decoded_).subspan(total, len);
      first.push_back(total);
      total += len;
      if (e.kind == 0) {
        const auto used = push_filter_.decode(e.bytes, std::span<float>(g));
        if (used != e.bytes.size())
          fail<invalid_argument>("dml::parallel::ps: expected range ", e.range, "'s entry to be ", e.bytes.size(),
                                 " bytes, the filter read ", used);
      } else {
        if (e.bytes.size() != len * sizeof(float))
          fail<invalid_argument>("dml::parallel::ps: expected ", len, " initial values for range ", e.range,
                                 ", found ", e.bytes.size() / sizeof(float));
        std::memcpy(g.data(), e.bytes.data(), e.bytes.size());
      }
      es.push_back(e);
    }
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
      fail<invalid_argument>("dml::parallel::ps: expected a worker index in [0, ", workers_, "), found ", w);
    std::vector<std::size_t> first;
    const auto es = parse_entries(peer, payload, first);
    for (std::size_t i = 0; i < es.size(); ++i)
      apply(es[i], w, std::uint64_t(h.seq),
            std::span<const float>(decoded_).subspan(first[i], std::size_t(place_.table.range(es[i].range).length)));
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

  void apply(const entry& e, int w, std::uint64_t seq, std::span<const float> g) {
    auto& s = state_[e.range];
    if (e.kind == 1) {  // initial values: the first to arrive wins
      if (!s.initialised) s.value.assign(g.begin(), g.end());
      s.initialised = true;
      return;
    }
    auto& seen = s.applied[std::size_t(w)];
    auto pos = std::ranges::lower_bound(seen, seq);
    if (pos != seen.end() && *pos == seq) return;  // a retry of what this server already has
    seen.insert(pos, seq);
    if (opt_.staleness == 0) {
      s.pending[std::int64_t(seq)][w].assign(g.begin(), g.end());
      complete_steps(s);
    } else {
      step(s, g);
      ++s.clock[std::size_t(w)];
      note_clock(s);
    }
  }

  void step(range_state& s, std::span<const float> g) {
    const auto n = std::int64_t(g.size());
    if (opt_.optimizer.kind == server_optimizer::sgd) {
      const float lr = opt_.optimizer.lr;
      float* v = s.value.data();
      for (std::int64_t i = 0; i < n; ++i) v[i] -= lr * g[std::size_t(i)];
    } else {
      for_each_index<host>(n, optim::kernels::adagrad_update<float>{s.value.data(), g.data(), s.accum.data(),
                                                                     opt_.optimizer.lr, opt_.optimizer.eps, 0.f, 1.f});
    }
  }

  // bsp: step t is applied when every live worker's push of it is in, summed in worker order.
  void complete_steps(range_state& s) {
    while (!s.pending.empty()) {
      auto it = s.pending.begin();
      bool all = true;
      for (int w = 0; w < workers_; ++w)
        if (!dead_workers_[w] && !left_[w] && !it->second.contains(w)) all = false;
      if (!all) return;
      std::vector<float> sum(s.value.size(), 0.f);
      for (auto& [w, g] : it->second) {
        for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += g[i];
        ++s.clock[std::size_t(w)];
      }
      step(s, sum);
      s.pending.erase(it);
      note_clock(s);
    }
  }

  void note_clock(range_state& s) {
    const std::int64_t lo = min_live_clock(s);
    for (int w = 0; w < workers_; ++w) {
      max_clock_ = std::max(max_clock_, s.clock[std::size_t(w)]);
      if (!dead_workers_[w] && !left_[w] && lo != std::numeric_limits<std::int64_t>::max())
        s.max_lead = std::max(s.max_lead, s.clock[std::size_t(w)] - lo);
    }
  }

  void on_pull(int peer, const detail::header& h, std::span<const std::byte> payload) {
    if (!is_worker(peer)) fail<invalid_argument>("dml::parallel::ps: expected pulls from workers, found one from server ", peer);
    waiting_pull wp{peer, h, {}};
    detail::reader rd{payload};
    while (!rd.done()) {
      const auto r = rd.get<std::uint32_t>("a range id");
      if (r >= state_.size())
        fail<invalid_argument>("dml::parallel::ps: expected a key range below ", state_.size(),
                               " (keys outside every range), found range ", r);
      const int prim = place_.primary(r, dead_servers_);
      if (prim != me_)
        fail<invalid_argument>("dml::parallel::ps: range ", r, "'s primary is server ", prim, " (chain ",
                               list(place_.chains[r]), "), not server ", me_);
      wp.ranges.push_back(r);
    }
    if (ready(wp)) answer(wp);
    else waiting_.push_back(std::move(wp));
  }

  bool ready(const waiting_pull& wp) const {
    if (opt_.staleness < 0) return true;
    for (auto r : wp.ranges)
      if (min_live_clock(state_[r]) < wp.h.seq - opt_.staleness) return false;
    return true;
  }

  void answer(const waiting_pull& wp) {
    const int w = worker_index(wp.peer);
    auto buffer = pool_.take();
    auto& out = *buffer;
    for (auto r : wp.ranges) {
      auto& s = state_[r];
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
    for (auto& s : state_)
      if (s.held) {
        if (opt_.staleness == 0) complete_steps(s);
      }
    serve_waiting();
  }

  void on_leave(int peer, std::span<const std::byte> payload) {
    const int w = worker_index(peer);
    if (left_[w]) return;
    left_[w] = true;
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
    if (w < 0 || w >= workers_ || dead_workers_[w] || left_[w]) return;
    dead_workers_[w] = true;
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
    for (int w = 0; w < workers_; ++w) owes[std::size_t(opt_.servers + w)] = !left_[w] && !dead_workers_[w];
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
    for (std::uint32_t r = 0; r < state_.size(); ++r) {
      const auto& s = state_[r];
      if (!s.held) continue;
      detail::put(out, r);
      detail::put(out, s.max_lead);
      for (int w = 0; w < workers_; ++w) {
        const auto& seen = s.applied[std::size_t(w)];
        detail::put(out, s.clock[std::size_t(w)]);
        detail::put(out, std::uint32_t(seen.size()));
        detail::put_bytes(out, seen.data(), seen.size() * sizeof(std::uint64_t));
      }
    }
    ep_.send(peer, {std::int64_t(detail::msg::stats_reply), h.id}, detail::share(std::move(out)));
  }

  options opt_;
  int world_size_, workers_;
  placement place_;
  detail::endpoint<C> ep_;
  int me_;
  comm::any_filter pull_filter_, push_filter_;
  std::vector<range_state> state_;
  std::vector<bool> dead_servers_, dead_workers_, left_;
  std::list<forwarding> forwards_;
  std::list<waiting_pull> waiting_;
  std::int64_t next_forward_ = 0, max_clock_ = 0;
  detail::buffer_pool pool_;
  std::vector<float> decoded_;
  std::vector<double> left_sums_;  // what the workers that left asked to have summed
  int left_count_ = 0;
  bool stopped_ = false;
};

// ---------------------------------------------------------------------------------------------------------
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
      fail<invalid_argument>("dml::parallel::ps::kv_worker: rank ", me_, " is a server (workers are ranks ",
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
      fail<invalid_argument>("dml::parallel::ps::pull: expected ", want, " values for ", keys.size(), " keys, found ",
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
      fail<invalid_argument>("dml::parallel::ps::kv_worker: expected a server rank in [0, ", opt_.servers,
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
      fail<comm_error>("dml::parallel::ps: every server holding key range ", r, " is gone (chain ",
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
      fail<invalid_argument>("dml::parallel::ps::push: expected ", want, " values for ", keys.size(), " keys, found ",
                             values.size());
    if (kind == 0) ++seq_;
    auto req = make_request(true);
    std::map<int, std::shared_ptr<std::vector<std::byte>>> parts;
    std::int64_t at = 0;
    for (key k : keys) {
      for (const auto& r : place_.table.ranges_of(k)) {
        const auto v = values.subspan(std::size_t(at + r.offset), std::size_t(r.length));
        auto& slot = parts[primary(r.id)];
        if (!slot) slot = pool_.take();
        auto& b = *slot;
        const auto body = detail::open_entry(b, r.id, kind);
        if (kind == 0 && push_filter_.kind() == comm::filter_kind::none) {
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
          fail<invalid_argument>("dml::parallel::ps::pull: expected ", dst.size(), " values for range ", r,
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

}  // namespace dml::parallel::ps
