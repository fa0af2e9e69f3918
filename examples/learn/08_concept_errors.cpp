// SPDX-License-Identifier: Apache-2.0
// examples/learn/08_concept_errors.cpp — what the compiler says when a type you wrote misses one part of a
// concept. Never built on its own: each compile-fail test defines one LEARN_BROKEN_* macro and checks
// that the error names the missing part in one line, such as
//   error: static assertion failed: dml: a schedule policy needs `static constexpr int virtual_stages` ...
//
// What it teaches: each family's concept is made of named parts, and dml checks a type where you hand it
// over (sequential for layers, trainer<...> for policies, downpour for consistency) with a diagnose_*
// function whose static_asserts name the first part that is missing. A type of your own that dml does not
// take from you (a communicator passed to a constructor, a compression filter) is checked the same way by
// one line next to it: static_assert(dml::comm::diagnose_communicator<my_comm>()).
#include "dml/dml.hpp"
#include "dml/ps/downpour.hpp"

#if defined(LEARN_BROKEN_LAYER)  // no backward
struct half_layer {
  static constexpr std::int64_t static_in = dml::nn::dynamic, static_out = dml::nn::dynamic;
  static constexpr const char* kind = "half_layer";
  std::vector<dml::nn::param_spec> parameters() const { return {}; }
  dml::shape output_shape(dml::shape x) const { return x; }
  template <dml::execution_space S, class T>
  void forward(const dml::nn::context&, dml::nn::layer_params<T>, dml::tensor_view<const T, S>, dml::tensor_view<T, S>) const {}
};
const dml::nn::sequential model{dml::nn::linear{4, 4}, half_layer{}};
#elif defined(LEARN_BROKEN_OPTIMIZER)  // no state_slots
struct stateless {
  using policy_family = dml::optim::optimizer_family;
  static constexpr const char* name = "stateless";
  float default_lr() const { return 0.1f; }
  template <dml::execution_space S>
  void update(const dml::optim::step_args&) const {}
};
static_assert(sizeof(dml::trainer<stateless>) > 0);
#elif defined(LEARN_BROKEN_SCHEDULE)  // no virtual_stages
struct flat_schedule {
  using policy_family = dml::schedule_family;
  static constexpr const char* name = "flat";
  static dml::schedule::table make(int stages, int micro_batches) { return dml::schedule::gpipe::make(stages, micro_batches); }
};
static_assert(sizeof(dml::trainer<flat_schedule>) > 0);
#elif defined(LEARN_BROKEN_SHARDING)  // no name
struct nameless {
  using policy_family = dml::sharding_family;
  static constexpr bool shards_optimizer_state = true, shards_gradients = false, shards_parameters = false;
};
static_assert(sizeof(dml::trainer<nameless>) > 0);
#elif defined(LEARN_BROKEN_PRECISION)  // no loss_scaling
struct half_precision {
  using policy_family = dml::precision_family;
  using type = dml::fp16;
  static constexpr const char* name = "half";
};
static_assert(sizeof(dml::trainer<half_precision>) > 0);
#elif defined(LEARN_BROKEN_CONSISTENCY)  // no pull_every, push_every
struct eager {
  using policy_family = dml::ps::consistency_family;
  static constexpr const char* name = "eager";
  int staleness() const { return 0; }
};
void run(dml::comm::local& c, const dml::train::dataset& d) {
  dml::ps::downpour(c, dml::nn::sequential{dml::nn::linear{4, 2}}, d, d, eager{}, {}, {});
}
#elif defined(LEARN_BROKEN_COMMUNICATOR)  // split returns the base class, not the communicator itself
struct logged : dml::comm::local {};
static_assert(dml::comm::diagnose_communicator<logged>());
#elif defined(LEARN_BROKEN_COMMUNICATOR_IN_TRAINER)  // the same, handed to a trainer: its constraint names the part
struct logged : dml::comm::local {};
void train(logged& comm) { dml::trainer<> t(comm, dml::nn::sequential{dml::nn::linear{4, 2}}); }
#elif defined(LEARN_BROKEN_FILTER)  // no decode
struct sign_only {
  std::string name() const { return "sign"; }
  void encode(std::span<float>, std::vector<std::byte>&) {}
};
static_assert(dml::comm::diagnose_filter<sign_only>());
#else
#  error "define one LEARN_BROKEN_* macro (see tests/examples/CMakeLists.txt)"
#endif

int main() {}
