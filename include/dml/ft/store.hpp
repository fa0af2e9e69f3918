// SPDX-License-Identifier: Apache-2.0
// dml/ft/store.hpp — Gloo's rendezvous store over the coordinator: the key-value store dml-run serves, reached
// only with the job's token. Sits on ft/wire.hpp and Gloo (libgloo-dev); comm::gloo rendezvous through it
// (open_store("tcp:HOST:PORT")). See DESIGN.md §11.
#pragma once

#include <gloo/rendezvous/store.h>

#include <mutex>
#include <string>
#include <vector>

#include "dml/ft/wire.hpp"

namespace dml::ft {

class tcp_store final : public ::gloo::rendezvous::Store {
 public:
  // Connects to the coordinator at address ("HOST:PORT") and presents the token; a wrong token is refused.
  tcp_store(const std::string& address, const std::string& token, milliseconds timeout)
      : address_(address), timeout_(timeout) {
    auto [host, port] = parse_address(address, "the store address");
    c_ = connection(connect_to(host, port, timeout));
    const auto f = c_.request(make_frame("HELLO", token, -1, 0, "store"), timeout);
    if (f.verb() != "OK")
      fail<comm_error>("dml::ft::tcp_store: the store at ", address, " refused this process: ",
                       f.words.size() > 1 ? f.words[1] : f.verb());
  }

  void set(const std::string& key, const std::vector<char>& data) override {
    frame f = make_frame("SET", key);
    f.body.assign(data.begin(), data.end());
    std::lock_guard lk(m_);
    c_.request(f, timeout_);
  }
  std::vector<char> get(const std::string& key) override {
    wait({key}, timeout_);
    std::lock_guard lk(m_);
    const auto f = c_.request(make_frame("GET", key), timeout_);
    return {f.body.begin(), f.body.end()};
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    const auto deadline = clock::now() + timeout;
    for (const auto& k : keys) {
      for (auto pause = milliseconds(1);; pause = std::min(pause * 2, milliseconds(20))) {
        {
          std::lock_guard lk(m_);
          if (c_.request(make_frame("GET", k), timeout_).verb() == "VALUE") break;
        }
        if (clock::now() > deadline)
          fail<comm_error>("dml::ft::tcp_store: key '", k, "' did not appear at ", address_, " within ",
                           std::chrono::duration<double>(timeout).count(), " s (a rank that never joined?)");
        std::this_thread::sleep_for(pause);
      }
    }
  }

 private:
  std::string address_;
  milliseconds timeout_;
  std::mutex m_;
  connection c_;
};

}  // namespace dml::ft
