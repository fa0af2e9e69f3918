// SPDX-License-Identifier: Apache-2.0
// dml/comm/gloo_store.hpp — the rendezvous store of comm::gloo, named by a spec string: `file:DIR` (a directory all
// ranks share; Gloo's FileStore) or `tcp:HOST:PORT` (the store dml-run serves, ft/store.hpp, reached with the job
// token in DML_RUN_TOKEN).
// Sits on core/error.hpp; the examples open their store with it from DML_STORE. See DESIGN.md §4.
#pragma once

#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/store.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

#include "dml/core/error.hpp"
#include "dml/ft/store.hpp"

namespace dml::comm {

namespace detail::gloo_impl {

// A directory this process can create files in: the check is a file made and removed, so that it holds for root
// and on read-only mounts too.
inline void check_store_dir(const std::string& dir, std::string_view spec) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    fail<invalid_argument>("dml::comm::open_store: expected an existing directory in '", spec, "', found ",
                           std::filesystem::exists(dir, ec) ? "something else" : "nothing", " at ", dir);
  std::string probe = dir + "/.dml-store-probe-XXXXXX";
  const int fd = ::mkstemp(probe.data());
  if (fd < 0)
    fail<invalid_argument>("dml::comm::open_store: expected a writable directory in '", spec, "', found ", dir,
                           " not writable (", std::strerror(errno), ")");
  ::close(fd);
  ::unlink(probe.c_str());
}

}  // namespace detail::gloo_impl

// Opens the store that spec names: `file:DIR` or `tcp:HOST:PORT`. The deadlines of the waits are those of the communicator built over
// the store (gloo_options::timeout); timeout bounds opening the store itself where that waits (a remote store).
inline std::shared_ptr<::gloo::rendezvous::Store> open_store(std::string_view spec,
                                                             std::chrono::milliseconds timeout) {
  const auto colon = spec.find(':');
  const std::string_view scheme = spec.substr(0, colon), rest = colon == spec.npos ? "" : spec.substr(colon + 1);
  if (scheme == "file" && !rest.empty()) {
    const std::string dir(rest);
    detail::gloo_impl::check_store_dir(dir, spec);
    return std::make_shared<::gloo::rendezvous::FileStore>(dir);
  }
  if (scheme == "tcp" && !rest.empty()) {
    const char* token = std::getenv("DML_RUN_TOKEN");
    if (!token || !*token)
      fail<invalid_argument>("dml::comm::open_store: '", spec, "' needs the job token in DML_RUN_TOKEN (dml-run sets it)");
    ft::parse_address(rest, "dml::comm::open_store");
    return std::make_shared<ft::tcp_store>(std::string(rest), token, timeout);
  }
  fail<invalid_argument>("dml::comm::open_store: expected a store spec file:DIR or tcp:HOST:PORT, found '", spec, "'");
}

}  // namespace dml::comm
