// SPDX-License-Identifier: Apache-2.0
// dml/ft/store.hpp — Gloo's rendezvous store over the coordinator: the key-value store dml-run serves, reached
// only with the job's token. Sits on ft/wire.hpp and Gloo (libgloo-dev); comm::gloo rendezvous through it
// (open_store("tcp:HOST:PORT")). gloo_job is what a program started by dml-run needs to train through deaths over
// comm::gloo: the session with the coordinator, the store, and a communicator per configuration. See DESIGN.md §11.
#pragma once

#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dml/comm/gloo.hpp"
#include "dml/ft/session.hpp"
#include "dml/ft/wire.hpp"

namespace dml::ft {

class tcp_store final : public ::gloo::rendezvous::Store {
 public:
  // Connects to the coordinator at address ("HOST:PORT") and presents the token; a wrong token is refused.
  tcp_store(const std::string& address, const std::string& token, milliseconds timeout)
      : address_(address), token_(token), timeout_(timeout) {
    connect();
  }

  void set(const std::string& key, const std::vector<char>& data) override {
    frame f = make_frame("SET", key);
    f.body.assign(data.begin(), data.end());
    std::lock_guard lk(m_);
    request(f);
  }
  std::vector<char> get(const std::string& key) override {
    wait({key}, timeout_);
    std::lock_guard lk(m_);
    const auto f = request(make_frame("GET", key));
    return {f.body.begin(), f.body.end()};
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    const auto deadline = clock::now() + timeout;
    for (const auto& k : keys) {
      for (auto pause = milliseconds(1);; pause = std::min(pause * 2, milliseconds(20))) {
        {
          std::lock_guard lk(m_);
          if (request(make_frame("GET", k)).verb() == "VALUE") break;
        }
        if (clock::now() > deadline)
          fail<comm_error>("dml::ft::tcp_store: key '", k, "' did not appear at ", address_, " within ",
                           std::chrono::duration<double>(timeout).count(), " s (a rank that never joined?)");
        std::this_thread::sleep_for(pause);
      }
    }
  }

 private:
  void connect() {
    auto [host, port] = parse_address(address_, "the store address");
    c_ = connection(connect_to(host, port, timeout_));
    const auto f = c_.request(make_frame("HELLO", token_, -1, 0, "store"), timeout_);
    if (f.verb() != "OK")
      fail<refused_error>("dml::ft::tcp_store: the store at ", address_, " refused this process: ",
                          f.words.size() > 1 ? f.words[1] : f.verb());
  }
  // One request; a lost connection is made again once (dml-run starts a coordinator that died again, on the same
  // port, with an empty store: the keys of a new configuration's prefix are all that is asked of it then).
  frame request(const frame& f) {
    for (int attempt = 0;; ++attempt) {
      try {
        if (!c_) connect();
        return c_.request(f, timeout_);
      } catch (const refused_error&) {
        throw;
      } catch (const comm_error&) {
        c_.close();
        if (attempt > 0) throw;
      }
    }
  }

  std::string address_, token_;
  milliseconds timeout_;
  std::mutex m_;
  connection c_;
};

// A rank started by dml-run (DML_RUN_* in the environment): its session with the coordinator and the store, and
// each configuration's communicator in a key space of its own ("epoch-E": a member frozen in an older epoch can
// reach no one of a newer one). Give make_comm to ft::train_elastic or ft::train_restarting.
class gloo_job {
 public:
  explicit gloo_job(milliseconds comm_timeout, milliseconds store_timeout = milliseconds(30000))
      : options_(session_options::from_environment()),
        store_(std::make_shared<tcp_store>(options_.address, options_.token, store_timeout)),
        session_(options_),
        comm_timeout_(comm_timeout) {}
  ft::session& session() { return session_; }
  int slot() const { return options_.slot; }
  std::unique_ptr<comm::gloo> make_comm(const quorum& q) {
    auto store = std::make_shared<::gloo::rendezvous::PrefixStore>("epoch-" + std::to_string(q.epoch), *store_);
    return std::make_unique<comm::gloo>(store, q.rank, q.size(), comm::gloo_options{.timeout = comm_timeout_});
  }
  // `path` with "{slot}" replaced by this rank's slot: a file of its own (a commit log).
  std::string slot_path(std::string path) const {
    if (const auto at = path.find("{slot}"); at != std::string::npos) path.replace(at, 6, std::to_string(slot()));
    return path;
  }

 private:
  session_options options_;
  std::shared_ptr<tcp_store> store_;
  ft::session session_;
  milliseconds comm_timeout_;
};

}  // namespace dml::ft
