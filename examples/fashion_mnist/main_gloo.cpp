// SPDX-License-Identifier: Apache-2.0
// examples/fashion_mnist/main_gloo.cpp — the --comm gloo path: one rank per process, started by hand or by a
// launcher, which names each rank and the rendezvous store in the environment: DML_RANK, DML_WORLD_SIZE and
// DML_STORE (a store spec, file:DIR). Its trainers compile here, in a unit of their own (fashion_mnist.hpp).
#include <cstdlib>
#include <optional>
#include <string>

#include "dml/comm/gloo.hpp"
#include "dml/comm/gloo_store.hpp"
#include "fashion_mnist.hpp"

namespace fashion_mnist {

namespace {
std::string from_env(const char* name, const char* what) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0')
    dml::fail<dml::invalid_argument>("--comm gloo: expected the environment variable ", name, " (", what,
                                     "), found it unset");
  return v;
}
}  // namespace

int run_gloo(const options& o, const dml::train::dataset& tr, const dml::train::dataset& te) {
  const int size = dml::detail::parse_number_in<int>(
      "DML_WORLD_SIZE", from_env("DML_WORLD_SIZE", "the number of ranks"), 1, std::nullopt);
  const int rank = dml::detail::parse_number_in<int>("DML_RANK", from_env("DML_RANK", "this process's rank"), 0,
                                                     size - 1);
  const std::string spec = from_env("DML_STORE", "the rendezvous store, file:DIR");
  if (o.ranks != 1 && o.ranks != size)
    dml::fail<dml::invalid_argument>("--ranks ", o.ranks, " with --comm gloo: DML_WORLD_SIZE is ", size,
                                     "; leave --ranks out or make them agree");
  const dml::comm::gloo_options opt;
  dml::comm::gloo comm(dml::comm::open_store(spec, opt.timeout), rank, size, opt);
  dml::set_thread_budget(o.threads);
  return run_parallel(o, comm, tr, te);
}

}  // namespace fashion_mnist
