// SPDX-License-Identifier: Apache-2.0
// examples/learn/06_custom_schedule.cpp — pipeline schedules written outside dml, one good and one broken.
//
// What it teaches:
//  - a schedule is a type whose make(stages, micro_batches) returns every pipeline rank's list of actions
//    (forward, backward, send and receive of activations and gradients, reduce_gradients, update);
//  - before any real work, dml::schedule::check runs every rank's list symbolically (so does the trainer):
//    a schedule that would deadlock fails with a message naming the rank, the action and what it waits for.
// reversed_gpipe runs every forward, then the backwards in reverse (GPipe as first published). In
// lockstep_first rank 0 runs each backward right after its forward while rank 1 runs all forwards first:
// rank 0 waits for a gradient that rank 1 sends only after rank 0's next activation.
// Run: learn_06_custom_schedule
#include <cstdio>
#include <vector>

#include "dml/dml.hpp"

namespace sch = dml::schedule;

// Micro-batch m's forward or backward on rank r of k, with the receive before it and the send after it.
void forward(std::vector<sch::action>& list, int r, int k, int m) {
  if (r > 0) list.push_back({sch::op::recv_activation, m});
  list.push_back({sch::op::forward, m});
  if (r < k - 1) list.push_back({sch::op::send_activation, m});
}
void backward(std::vector<sch::action>& list, int r, int k, int m) {
  if (r < k - 1) list.push_back({sch::op::recv_gradient, m});
  list.push_back({sch::op::backward, m});
  if (r > 0) list.push_back({sch::op::send_gradient, m});
}

template <bool Lockstep_first>
struct my_schedule {
  using policy_family = dml::schedule_family;  // lets trainer<...> find it among its policies
  static constexpr const char* name = Lockstep_first ? "lockstep_first" : "reversed_gpipe";
  static constexpr int virtual_stages = 1;  // model chunks per rank (2 or more: interleaved)
  static sch::table make(int stages, int micro_batches) {
    sch::table t{stages, micro_batches, 1, std::vector<std::vector<sch::action>>(std::size_t(stages))};
    for (int r = 0; r < stages; ++r) {
      auto& list = t.ranks[std::size_t(r)];
      for (int m = 0; m < micro_batches; ++m) {
        forward(list, r, stages, m);
        if (Lockstep_first && r == 0) backward(list, r, stages, m);
      }
      if (!Lockstep_first || r > 0)
        for (int m = micro_batches - 1; m >= 0; --m) backward(list, r, stages, m);
      list.push_back({sch::op::reduce_gradients});
      list.push_back({sch::op::update});
    }
    return t;
  }
};
using reversed_gpipe = my_schedule<false>;
using lockstep_first = my_schedule<true>;

int main() {
  std::fputs(sch::render(reversed_gpipe::make(2, 4)).c_str(), stdout);
  std::printf("checker on lockstep_first: %s\n", sch::verify(lockstep_first::make(2, 4)).value_or("ok").c_str());

  // Both as trainer policies on 2 pipeline stages (rank r runs stage r) with 4 micro-batches per step.
  std::vector<float> x(64 * 8);
  std::vector<std::int32_t> y(64);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = dml::rng_stream{42, 0}.uniform(i, -1.f, 1.f);
  for (std::size_t s = 0; s < y.size(); ++s) y[s] = (x[s * 8] > 0) + 2 * (x[s * 8 + 1] > 0);
  const auto model = dml::nn::sequential{dml::nn::linear{8, 32}, dml::nn::relu{}, dml::nn::linear{32, 4}};
  const dml::train::trainer_options options{.micro_batches = 4, .pipeline_stages = 2};
  dml::comm::local::run(2, [&](dml::comm::local& comm) {
    dml::trainer<reversed_gpipe> trainer(comm, model, options, dml::optim::adamw({.lr = 1e-2f}));
    for (int step = 1; step <= 50; ++step) {
      const float loss = trainer.step({x.data(), {64, 8}}, y.data(), 64).loss;  // both stages pass the rows
      if (comm.rank() == 0 && step % 25 == 0) std::printf("reversed_gpipe step %d loss %.4f\n", step, double(loss));
    }
  });
  try {
    dml::comm::local::run(2, [&](dml::comm::local& comm) { dml::trainer<lockstep_first> t(comm, model, options); });
  } catch (const dml::invalid_argument& e) {
    std::printf("trainer<lockstep_first> refused: %s\n", e.what());
  }
  return 0;
}
