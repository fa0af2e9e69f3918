// SPDX-License-Identifier: Apache-2.0
// A sharding whose sync has every part of dml::parallel::sharding_sync but those a test drops with
// DROP_<PART> defined before including it; compile_fail/sync_no_<part>.cpp each drop one and must fail with
// that part's diagnostic, and sync_complete.cpp drops none and must compile.
#include <span>
#include <vector>

#include "dml/dml.hpp"

namespace dp = dml::parallel;

template <class Space, class Comm, class Optimizer, class Precision, class Net>
struct stub_sync : dml::nn::layer_hooks {
  using T = typename Precision::type;
#ifndef DROP_CONSTRUCTION
  stub_sync(dp::shard_groups<Comm>, Net&, const dp::sync_options&) {}
#endif
#ifndef DROP_SETUP
  static constexpr bool streams_gradients = false;
  static dml::nn::network_options network_options(int, bool) { return {}; }
#endif
#ifndef DROP_RESIDENCY
  void begin_pass() {}
  void unshard(int) {}
  void reshard(int) {}
#endif
#ifndef DROP_GRADIENTS
  void begin_backward(bool) {}
  void reduce(int, bool) {}
  std::span<T> grad_piece(std::size_t) { return {}; }
#endif
#ifndef DROP_UPDATE
  using optimizer_type = Optimizer;
  double grad_squared_norm(const std::vector<bool>&) { return 0; }
  bool has_overflow() { return false; }
  void update(Optimizer&, float, std::int64_t, float) {}
#endif
#ifndef DROP_STATE
  std::vector<float> parameters() { return {}; }
  void load_parameters(std::span<const float>) {}
  void refresh_working() {}
  dp::memory_report memory() const { return {}; }
  std::span<const dp::bucket> buckets() const { return {}; }
#endif
#ifndef DROP_CHECKPOINT
  std::vector<dp::owned_piece> owned_pieces() const { return {}; }
  bool writes_checkpoint() const { return false; }
  float* held(int, const dp::owned_piece&) { return nullptr; }
  bool loads_pieces(int) { return false; }
  float* whole(int) { return nullptr; }
#endif
};

struct stub_sharding {
  using policy_family = dml::sharding_family;
  static constexpr const char* name = "stub";
  static constexpr bool shards_optimizer_state = false, shards_gradients = false, shards_parameters = false;
  template <class Space, class Comm, class Optimizer, class Precision, class Net>
  using sync = stub_sync<Space, Comm, Optimizer, Precision, Net>;
};

// Builds a trainer, which instantiates the engine and its check of the sync.
inline void build(dml::comm::local& comm) {
  const dml::trainer<stub_sharding> trainer(comm, dml::nn::sequential{dml::nn::linear{2, 2}});
}
