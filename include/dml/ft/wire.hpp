// SPDX-License-Identifier: Apache-2.0
// dml/ft/wire.hpp — the coordinator's wire: TCP sockets with deadlines and length-prefixed frames.
// Sits on core/error.hpp (POSIX sockets, no other dependency); ft/coordinator.hpp and ft/session.hpp speak
// it. A frame is a 4-byte little-endian length, then a text line of words ("VERB arg arg ...\n"), then an
// optional binary body. See DESIGN.md §11.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "dml/comm/communicator.hpp"
#include "dml/core/error.hpp"

namespace dml::ft {

using clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The coordinator answered REFUSED (a wrong job token, a slot out of range, a start that is not the slot's
// current one): final, unlike a lost connection, which a new start of the coordinator may mend.
class refused_error : public comm_error {
 public:
  using comm_error::comm_error;
};

// What is left of a deadline, rounded up, at least 1 ms.
inline milliseconds left_until(clock::time_point deadline) {
  return std::max(milliseconds(1), std::chrono::ceil<milliseconds>(deadline - clock::now()));
}

// A message: its words and an optional body (store values, snapshots).
struct frame {
  std::vector<std::string> words;
  std::string body;

  const std::string& verb() const {
    static const std::string none;
    return words.empty() ? none : words[0];
  }
  const std::string& at(std::size_t i) const {
    if (i >= words.size())
      fail<format_error>("dml::ft: a '", verb(), "' frame needs ", i + 1, " words, found ", words.size());
    return words[i];
  }
  std::int64_t number(std::size_t i) const {
    const auto& w = at(i);
    std::size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(w, &used);
    } catch (...) {
      used = 0;
    }
    if (used != w.size() || w.empty())
      fail<format_error>("dml::ft: word ", i, " of a '", verb(), "' frame should be a number, found '", w, "'");
    return v;
  }
};

template <class... W>
frame make_frame(const W&... w) {
  frame f;
  (f.words.push_back(dml::detail::cat(w)), ...);
  return f;
}

inline std::string encode(const frame& f) {
  std::string line;
  for (std::size_t i = 0; i < f.words.size(); ++i) {
    if (i) line += ' ';
    line += f.words[i];
  }
  line += '\n';
  const auto n = static_cast<std::uint32_t>(line.size() + f.body.size());
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + line + f.body;
}

// Frames cut from a byte stream as they arrive (the coordinator's non-blocking reads).
class frame_reader {
 public:
  static constexpr std::uint32_t max_frame = 1u << 30;
  void feed(const char* p, std::size_t n) { buf_.append(p, n); }
  std::optional<frame> next() {
    if (buf_.size() < 4) return std::nullopt;
    std::uint32_t n = 0;
    for (int i = 0; i < 4; ++i) n |= std::uint32_t(static_cast<unsigned char>(buf_[static_cast<std::size_t>(i)])) << (8 * i);
    if (n > max_frame) fail<format_error>("dml::ft: a frame of ", n, " bytes, more than the limit of ", max_frame);
    if (buf_.size() < 4 + std::size_t(n)) return std::nullopt;
    std::string payload = buf_.substr(4, n);
    buf_.erase(0, 4 + std::size_t(n));
    frame f;
    const auto eol = payload.find('\n');
    if (eol == std::string::npos) fail<format_error>("dml::ft: a frame without its header line");
    std::istringstream words(payload.substr(0, eol));
    for (std::string w; words >> w;) f.words.push_back(std::move(w));
    f.body = payload.substr(eol + 1);
    return f;
  }

 private:
  std::string buf_;
};

// ---------------------------------------------------------------------------------------------
// A connected or listening TCP socket, closed when it goes.

class socket_fd {
 public:
  socket_fd() = default;
  explicit socket_fd(int fd) : fd_(fd) {}
  socket_fd(socket_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  socket_fd& operator=(socket_fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~socket_fd() { reset(); }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// "host:port" → (host, port); a clear error otherwise.
inline std::pair<std::string, int> parse_address(std::string_view spec, std::string_view what) {
  const auto colon = spec.rfind(':');
  int port = -1;
  if (colon != std::string_view::npos) {
    try {
      std::size_t used = 0;
      port = std::stoi(std::string(spec.substr(colon + 1)), &used);
      if (used != spec.size() - colon - 1) port = -1;
    } catch (...) {
      port = -1;
    }
  }
  if (colon == std::string_view::npos || colon == 0 || port < 0 || port > 65535)
    fail<invalid_argument>(what, ": expected HOST:PORT, found '", spec, "'");
  return {std::string(spec.substr(0, colon)), port};
}

inline sockaddr_in resolve(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || !res)
    fail<invalid_argument>("dml::ft: cannot resolve host '", host, "'");
  sockaddr_in a = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  ::freeaddrinfo(res);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  return a;
}

// Listens on host:port (port 0: any free port; port() tells which).
inline socket_fd listen_on(const std::string& host, int port) {
  socket_fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s) fail<comm_error>("dml::ft: socket(): ", std::strerror(errno));
  const int one = 1;
  ::setsockopt(s.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  auto a = resolve(host, port);
  if (::bind(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    fail<comm_error>("dml::ft: cannot bind ", host, ":", port, ": ", std::strerror(errno));
  if (::listen(s.get(), 256) != 0) fail<comm_error>("dml::ft: listen(): ", std::strerror(errno));
  return s;
}
inline int port_of(int fd) {
  sockaddr_in a{};
  socklen_t n = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  return ntohs(a.sin_port);
}
inline int port_of(const socket_fd& s) { return port_of(s.get()); }

// Connects to host:port, retrying refused connections until the deadline (the peer may not listen yet).
inline socket_fd connect_to(const std::string& host, int port, milliseconds timeout) {
  const auto deadline = clock::now() + timeout;
  const auto a = resolve(host, port);
  for (;;) {
    socket_fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!s) fail<comm_error>("dml::ft: socket(): ", std::strerror(errno));
    if (::connect(s.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0) {
      const int one = 1;
      ::setsockopt(s.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return s;
    }
    const int e = errno;
    if (clock::now() >= deadline)
      fail<comm_error>("dml::ft: cannot reach ", host, ":", port, " within ",
                       std::chrono::duration<double>(timeout).count(), " s: ", std::strerror(e));
    std::this_thread::sleep_for(milliseconds(20));
  }
}

// Waits until fd is readable (or writable) or the deadline passes; false on timeout.
inline bool wait_fd(int fd, short events, clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - clock::now()).count();
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::max<long long>(0, left)));
    if (r > 0) return true;
    if (r == 0) return false;
    if (errno != EINTR) fail<comm_error>("dml::ft: poll(): ", std::strerror(errno));
  }
}

// Sends a whole frame before the deadline; comm_error if the peer is gone or too slow.
inline void send_frame(int fd, const frame& f, clock::time_point deadline) {
  const std::string bytes = encode(f);
  std::size_t done = 0;
  while (done < bytes.size()) {
    if (!wait_fd(fd, POLLOUT, deadline)) fail<comm_error>("dml::ft: sending '", f.verb(), "' timed out");
    const auto n = ::send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      fail<comm_error>("dml::ft: sending '", f.verb(), "': ", std::strerror(errno));
    }
    done += static_cast<std::size_t>(n);
  }
}

// A client's connection: requests and their answers, one at a time, each before a deadline.
class connection {
 public:
  connection() = default;
  explicit connection(socket_fd s) : s_(std::move(s)) {}
  explicit operator bool() const noexcept { return bool(s_); }
  int fd() const noexcept { return s_.get(); }
  void send(const frame& f, clock::time_point deadline) { send_frame(s_.get(), f, deadline); }
  // Reads one frame before the deadline; comm_error if the peer closed the connection or the deadline passed.
  frame receive(clock::time_point deadline, std::string_view waiting_for) {
    char buf[65536];
    for (;;) {
      if (auto f = r_.next()) return std::move(*f);
      if (!wait_fd(s_.get(), POLLIN, deadline))
        fail<comm_error>("dml::ft: no answer to '", waiting_for, "' before the deadline");
      const auto n = ::recv(s_.get(), buf, sizeof buf, 0);
      if (n == 0) fail<comm_error>("dml::ft: the coordinator closed the connection while waiting for '", waiting_for, "'");
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        fail<comm_error>("dml::ft: waiting for '", waiting_for, "': ", std::strerror(errno));
      }
      r_.feed(buf, static_cast<std::size_t>(n));
    }
  }
  frame request(const frame& f, milliseconds timeout) {
    const auto deadline = clock::now() + timeout;
    send(f, deadline);
    return receive(deadline, f.verb());
  }
  void close() { s_.reset(); }

 private:
  socket_fd s_;
  frame_reader r_;
};

}  // namespace dml::ft
