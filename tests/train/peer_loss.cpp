// SPDX-License-Identifier: Apache-2.0
// tests/train/peer_loss.cpp — a trainer over comm::mpi that runs until it is killed; peer_loss.py, under
// mpirun, kills one rank and checks that every other rank reports the operation and the lost peer.
// Usage: train_peer_loss <ddp|zero1|zero2|zero3> [seconds]   (prints "rank R pid P", then "step S")
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "dml/comm/mpi.hpp"
#include "dml/dml.hpp"

namespace {

constexpr std::int64_t features = 64, classes = 10, samples = 1024, global_batch = 64;

template <class Sharding>
int train(dml::comm::mpi& comm, double seconds) {
  using namespace dml;
  auto model = nn::sequential{nn::linear{features, 128}, nn::relu{}, nn::linear{128, 128}, nn::gelu{},
                              nn::linear{128, classes}};
  train::trainer_options opt;
  opt.seed = 3;
  opt.lr = [](std::int64_t) { return 1e-3f; };
  opt.bucket_mb = 0.02;  // several buckets: several collectives per step
  trainer<Sharding, optim::adamw> t(comm, model, opt);
  std::vector<float> x(samples * features);
  std::vector<std::int32_t> y(samples);
  const rng_stream rng{7, 1};
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = rng.normal(i);
  for (std::int64_t s = 0; s < samples; ++s) y[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(s % classes);
  train::sampler sampler(samples, global_batch, 5);
  std::vector<float> xb;
  std::vector<std::int32_t> yb;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (std::int64_t s = 0;; ++s) {
    // Every rank stops at the same step: rank 0 decides, the others learn it in the same collective.
    std::int32_t go = std::chrono::steady_clock::now() < end ? 1 : 0;
    comm.broadcast(std::span<std::int32_t>(&go, 1), 0);
    if (!go) break;
    const std::int64_t rows = sampler.gather(s, comm.rank(), comm.size(), x.data(), features, y.data(), xb, yb);
    const auto r = t.step(tensor_view<const float>(xb.data(), {rows, features}), yb.data(), global_batch);
    if (comm.rank() == 0 && s % 10 == 0) {
      std::printf("step %lld loss %.6f\n", static_cast<long long>(s), static_cast<double>(r.loss));
      std::fflush(stdout);
    }
  }
  std::printf("rank %d done\n", comm.rank());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  dml::comm::mpi::environment env(&argc, &argv);
  dml::comm::mpi world;
  const std::string sharding = argc > 1 ? argv[1] : "ddp";
  const double seconds = argc > 2 ? std::atof(argv[2]) : 60.0;
  std::printf("rank %d pid %d\n", world.rank(), static_cast<int>(::getpid()));
  std::fflush(stdout);
  if (sharding == "zero1") return train<dml::parallel::zero<1>>(world, seconds);
  if (sharding == "zero2") return train<dml::parallel::zero<2>>(world, seconds);
  if (sharding == "zero3") return train<dml::parallel::zero<3>>(world, seconds);
  return train<dml::parallel::replicate>(world, seconds);
}
