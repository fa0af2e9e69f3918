// SPDX-License-Identifier: Apache-2.0
// examples/learn/02_ddp_threads.cpp — data parallelism (DDP) on 4 ranks that are threads of this process.
//
// What it teaches:
//  - dml::comm::local::run(n, fn) starts n ranks as threads and calls fn with each rank's communicator;
//  - dml::trainer<parallel::replicate> runs example 01's step on every rank: each rank takes its slice
//    of the global batch, gradients are averaged over the ranks in buckets while backward still runs,
//    and every rank applies the same update, so the replicas stay identical;
//  - step() returns the loss of the whole global batch, the same number on every rank, and the run
//    trains the model that one rank with the same global batch would (DESIGN.md §5).
// Run: learn_02_ddp_threads [steps]
#include <cstdio>
#include <vector>

#include "dml/dml.hpp"

constexpr std::int64_t samples = 512, features = 8, classes = 4, batch = 64;  // batch: the global batch
constexpr int ranks = 4;

// Points in [-1, 1)^8 whose class is the quadrant of their first two coordinates (as in example 01).
void make_data(std::vector<float>& x, std::vector<std::int32_t>& y) {
  const dml::rng_stream rng{42, 0};
  x.resize(samples * features);
  y.resize(samples);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = rng.uniform(i, -1.f, 1.f);
  for (std::int64_t s = 0; s < samples; ++s) y[s] = (x[s * features] > 0) + 2 * (x[s * features + 1] > 0);
}

int main(int argc, char** argv) {
  int steps = 200;  // the command line (dml/train/flags.hpp): --help describes it, a bad number is refused
  dml::flags cli("learn_02_ddp_threads");
  cli.positional("STEPS", steps, "optimizer steps").min(0);
  if (const auto status = cli.parse_for_main(argc, argv)) return *status;
  std::vector<float> x;
  std::vector<std::int32_t> y;
  make_data(x, y);  // shared, read-only: every rank reads its own rows of it

  dml::comm::local::run(ranks, [&](dml::comm::local& comm) {
    const auto model = dml::nn::sequential{dml::nn::linear{features, 32}, dml::nn::relu{}, dml::nn::linear{32, classes}};
    // Policies come in any order and each has a default; here the sharding and the optimizer are named.
    // The seed gives the initial weights: the same on every rank, and the same as example 01's.
    dml::trainer<dml::parallel::replicate, dml::optim::adamw> trainer(comm, model, {.seed = 1},
                                                                      dml::optim::adamw({.lr = 1e-2f}));
    const dml::train::sampler sampler(samples, batch, /*seed=*/1);  // one global order, whatever the rank count
    std::vector<float> xb;
    std::vector<std::int32_t> yb;
    for (int step = 1; step <= steps; ++step) {
      // This rank's contiguous slice of the step's global batch.
      const std::int64_t rows = sampler.gather(step - 1, comm.rank(), comm.size(), x.data(), features, y.data(), xb, yb);
      const auto r = trainer.step({xb.data(), {rows, features}}, yb.data(), batch);
      if (comm.rank() == 0 && step % 50 == 0)
        std::printf("step %d global loss %.4f (rank 0 holds %lld of %lld rows)\n", step, static_cast<double>(r.loss),
                    static_cast<long long>(rows), static_cast<long long>(batch));
    }
    // Each rank scores its quarter of the data; a sum over the ranks gives the whole count.
    const std::int64_t first = samples * comm.rank() / ranks, count = samples / ranks;
    std::int64_t correct[] = {trainer.correct({x.data() + first * features, {count, features}}, y.data() + first)};
    comm.all_reduce(std::span<std::int64_t>(correct), dml::comm::reduce_op::sum);
    if (comm.rank() == 0)
      std::printf("%d ranks, accuracy=%.3f\n", comm.size(), static_cast<double>(correct[0]) / samples);
  });
  return 0;
}
