// SPDX-License-Identifier: Apache-2.0
// examples/learn/07_custom_communicator.cpp — a communicator written outside dml: one that wraps another and
// counts the bytes each operation hands over.
//
// What it teaches:
//  - what the dml::comm::communicator concept asks for: rank() and size(), the collectives, point-to-point
//    send and recv, barrier, split into sub-groups, and non-blocking forms that return a request;
//  - that a trainer runs on the new communicator unchanged, and trains the same model to the same losses;
//  - what each sharding sends: here zero<3>, which gathers parameters and reduce-scatters gradients.
// Run: learn_07_custom_communicator
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dml/dml.hpp"

template <dml::comm::communicator C>
class counting {
 public:
  using tally = std::map<std::string, std::size_t>;  // operation -> bytes this rank passed to it
  explicit counting(C inner, std::shared_ptr<tally> t = std::make_shared<tally>()) : inner_(std::move(inner)), t_(t) {}
  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  const tally& bytes() const { return *t_; }
  counting split(int color, int key) { return counting(inner_.split(color, key), t_); }  // sub-groups count here too
  void barrier() { inner_.barrier(); }

// Each operation counts the bytes of its first argument (the data it sends, or reduces in place) and forwards.
#define COUNTED(op)                                                                \
  template <class... A>                                                            \
  decltype(auto) op(auto&& data, A&&... rest) {                                    \
    (*t_)[#op] += std::span(data).size_bytes();                                    \
    return inner_.op(std::forward<decltype(data)>(data), std::forward<A>(rest)...); \
  }
  COUNTED(all_reduce) COUNTED(iall_reduce) COUNTED(reduce_scatter) COUNTED(ireduce_scatter)
  COUNTED(all_gather) COUNTED(iall_gather) COUNTED(all_gatherv) COUNTED(broadcast) COUNTED(ibroadcast)
  COUNTED(reduce) COUNTED(ireduce) COUNTED(all_to_all) COUNTED(iall_to_all) COUNTED(all_to_allv)
  COUNTED(send) COUNTED(isend) COUNTED(recv) COUNTED(irecv)
#undef COUNTED

 private:
  C inner_;
  std::shared_ptr<tally> t_;
};
static_assert(dml::comm::diagnose_communicator<counting<dml::comm::local>>());  // names a missing part, if any

constexpr std::int64_t samples = 512, features = 8, batch = 64;

int main() {
  std::vector<float> x(samples * features), losses[2];  // example 01's data
  std::vector<std::int32_t> y(samples);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = dml::rng_stream{42, 0}.uniform(i, -1.f, 1.f);
  for (std::int64_t s = 0; s < samples; ++s) y[s] = (x[s * features] > 0) + 2 * (x[s * features + 1] > 0);
  // The same training loop for any communicator: rank 0 keeps the losses.
  const auto train = [&](auto& comm, std::vector<float>& out) {
    const auto model = dml::nn::sequential{dml::nn::linear{features, 32}, dml::nn::relu{}, dml::nn::linear{32, 4}};
    dml::trainer<dml::parallel::zero<3>> trainer(comm, model, {}, dml::optim::adamw({.lr = 1e-2f}));
    const dml::train::sampler sampler(samples, batch, 1);
    std::vector<float> xb;
    std::vector<std::int32_t> yb;
    for (int step = 0; step < 100; ++step) {
      const auto rows = sampler.gather(step, comm.rank(), comm.size(), x.data(), features, y.data(), xb, yb);
      const float loss = trainer.step({xb.data(), {rows, features}}, yb.data(), batch).loss;
      if (comm.rank() == 0) out.push_back(loss);
    }
  };
  dml::comm::local::run(4, [&](dml::comm::local& comm) { train(comm, losses[0]); });
  dml::comm::local::run(4, [&](dml::comm::local& plain) {
    counting<dml::comm::local> comm(std::move(plain));
    train(comm, losses[1]);
    if (comm.rank() == 0)
      for (const auto& [op, bytes] : comm.bytes()) std::printf("rank 0 %-15s %8zu bytes\n", op.c_str(), bytes);
  });
  std::printf("100 steps of zero<3> on 4 ranks: final loss %.4f; the same losses as on comm::local: %s\n",
              double(losses[1].back()), losses[0] == losses[1] ? "yes" : "no");
  return losses[0] == losses[1] ? 0 : 1;
}
