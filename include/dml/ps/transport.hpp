// SPDX-License-Identifier: Apache-2.0
// dml/ps/transport.hpp — the parameter server's wire and shared setup: options, message framing, the polling
// endpoint over any communicator's tagged send/recv, and the placement of key ranges every node computes alike.
// Sits on comm/, ps/keys.hpp, ps/consistency.hpp and optim/ (the server optimizers' rules); used by ps/server.hpp and
// ps/worker.hpp.
//
// Every node is one thread of control that polls. Liveness is by silence: a peer that owes a reply and has
// said nothing for `options::timeout` is dead to the one waiting. Nothing ever blocks on a peer without a
// deadline, and finishing is a protocol of its own (endpoint::finish), so a lost peer cannot hang the others.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/core/error.hpp"
#include "dml/optim/adagrad.hpp"
#include "dml/optim/sgd.hpp"
#include "dml/ps/consistency.hpp"
#include "dml/ps/keys.hpp"

namespace dml::ps {

using clock = std::chrono::steady_clock;

// How a server applies a pushed gradient g to its values v.
struct server_optimizer {
  enum kind_t { sgd, adagrad } kind = sgd;
  float lr = 0.1f;
  float eps = 1e-10f;                 // adagrad: v -= lr g / (sqrt(Σg²) + eps)
  float initial_accumulator = 0.f;    // adagrad: Σg² starts here

  static server_optimizer parse(std::string_view s, float lr) {
    server_optimizer o{sgd, lr};
    if (s == "adagrad") o.kind = adagrad;
    else if (s != "sgd") fail<invalid_argument>("dml::ps: expected a server optimizer sgd or adagrad, found '", s, "'");
    o.validate();
    return o;
  }
  // The rules of the optimizer a server runs (optim::sgd's, optim::adagrad's: its message names it), and Σg²
  // starting at 0 or above. parse() and every node's placement check them.
  void validate() const {
    if (kind == sgd) (void)optim::sgd({.lr = lr});
    else (void)optim::adagrad({.lr = lr, .eps = eps});
    if (!(initial_accumulator >= 0.f) || !std::isfinite(initial_accumulator))
      fail<invalid_argument>("dml::ps::server_optimizer: expected a finite initial_accumulator >= 0, found ",
                             initial_accumulator);
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
inline constexpr std::size_t entry_head_bytes = sizeof(std::uint32_t) + sizeof(std::uint8_t) + sizeof(std::uint32_t);
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
      fail<invalid_argument>("dml::ps: expected ", sizeof(T), " more bytes for ", what, " at byte ", at,
                             ", found ", s.size() - at, " (a truncated message)");
    T v;
    std::memcpy(&v, s.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
  std::span<const std::byte> take(std::size_t n, const char* what) {
    if (s.size() - at < n)
      fail<invalid_argument>("dml::ps: expected ", n, " bytes for ", what, " at byte ", at, ", found ",
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
// take(bytes) hands out the free buffer of the largest capacity, empty, with room for `bytes` (the message's
// size where the caller knows it): a buffer that must grow then grows once, not by doubling through a chain of
// fresh mappings whose pages all fault in (a 32 MiB pull reply grown so took 4-8 times as long as one reused).
class buffer_pool {
 public:
  std::shared_ptr<std::vector<std::byte>> take(std::size_t bytes = 0) {
    std::shared_ptr<std::vector<std::byte>>* best = nullptr;
    for (auto& b : all_)
      if (b.use_count() == 1 && (!best || b->capacity() > (*best)->capacity())) best = &b;
    auto& b = best ? *best : all_.emplace_back(std::make_shared<std::vector<std::byte>>());
    b->clear();
    b->reserve(bytes);
    return b;
  }

 private:
  std::vector<std::shared_ptr<std::vector<std::byte>>> all_;
};

// A node's transport: one header receive posted per peer it listens to, payloads fetched as headers name
// them, sends non-blocking and retired as they complete. Finishing is a protocol of its own (finish()), so
// no receive is ever left posted and no send left unmatched, whichever nodes died.
template <class C>
class endpoint {
  static_assert(comm::moves_host_memory<C>, "dml::ps: servers and workers exchange host memory: run them over "
                                            "comm::local or comm::mpi");

 public:
  endpoint(C& world, std::vector<int> listen, std::vector<int> talk)
      : comm_(world.split(0, world.rank())), rank_(comm_.rank()), listen_(std::move(listen)), talk_(std::move(talk)),
        in_(comm_.size()), heard_(comm_.size(), clock::now()), sent_(comm_.size(), clock::now()) {
    for (int p : listen_) post(p);
  }
  endpoint(const endpoint&) = delete;
  endpoint& operator=(const endpoint&) = delete;
  ~endpoint() {
    // After finish() nothing is posted and nothing is in flight; while an exception unwinds, withdraw what is.
    for (auto& in : in_)
      if (in.posted) in.r.cancel();
    for (auto& m : out_) m->pr.cancel();
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
    if (h.bytes > 0) {
      // Where the communicator can, the peer reads the payload where it lies: it stays alive in out_ until then.
      const auto bytes = std::span<const std::byte>(*m->payload);
      if constexpr (requires { comm_.issend(bytes, peer, payload_tag); }) m->pr = comm_.issend(bytes, peer, payload_tag);
      else m->pr = comm_.isend(bytes, peer, payload_tag);
    }
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
      if (h.type == std::int64_t(msg::bye)) ++byes_;  // nothing more comes from p
      else post(p);
      if (h.bytes == 0) {
        on(p, h, std::span<const std::byte>{});
      } else if constexpr (requires { comm_.recv_borrowed(p, payload_tag); }) {
        const auto held = comm_.recv_borrowed(p, payload_tag);  // read where it lies, no copy
        if (held.bytes().size() != std::size_t(h.bytes))
          fail<invalid_argument>("dml::ps: expected a payload of ", h.bytes, " bytes from rank ", p, ", found ",
                                 held.bytes().size());
        on(p, h, held.bytes());
      } else {
        if (payload_.size() < std::size_t(h.bytes)) payload_.resize(std::size_t(h.bytes));
        const auto payload = std::span<std::byte>(payload_).first(std::size_t(h.bytes));
        comm_.recv(payload, p, payload_tag);
        on(p, h, std::span<const std::byte>(payload));
      }
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
  // Every completed send lets go of its payload, in whatever order they completed: a reply that one slow peer
  // has not yet read must not keep the pooled buffers of later replies held (buffer_pool would then take fresh
  // ones, whose pages fault in on every large reply).
  void retire() {
    std::erase_if(out_, [](const std::unique_ptr<out_msg>& m) { return m->hr.test() && m->pr.test(); });
  }

  C comm_;
  int rank_;
  std::vector<int> listen_, talk_;
  std::vector<inbound> in_;
  std::deque<std::unique_ptr<out_msg>> out_;
  std::vector<clock::time_point> heard_, sent_;
  std::vector<std::byte> payload_;  // the last payload received, handed out as a span (where it is copied)
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
      fail<invalid_argument>("dml::ps: expected 0 <= replicas < servers (", o.servers, "), found ", o.replicas);
    if (o.servers > 62) fail<invalid_argument>("dml::ps: expected at most 62 servers, found ", o.servers);
    o.optimizer.validate();
    for (const auto& r : table.ranges()) chains.push_back(hash_ring.chain(r, replicas));
  }
  int primary(std::uint32_t r, const std::vector<bool>& dead) const { return detail::next_live(chains[r], 0, dead); }
};

}  // namespace dml::ps
