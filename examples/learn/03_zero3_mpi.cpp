// SPDX-License-Identifier: Apache-2.0
// examples/learn/03_zero3_mpi.cpp — ZeRO-3 across MPI processes, with a checkpoint saved and resumed.
//
// What it teaches:
//  - dml::comm::mpi: one process per rank, launched by mpirun; the trainer code is example 02's, only the
//    communicator and the sharding policy differ (parallel::zero<3>: each rank keeps 1/N of the parameters,
//    gradients and AdamW state, and gathers each layer's parameters just before it runs);
//  - save_checkpoint writes every rank's shard and the caller's position (a string map) in one collective
//    call; load_checkpoint restores parameters, optimizer state, step count and seed into a fresh trainer,
//    so a resumed run repeats the losses of the run it continues, bit for bit.
// Run: mpirun -np 2 learn_03_zero3_mpi [checkpoint-dir]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "dml/comm/mpi.hpp"  // not in dml.hpp: it needs MPI (CMake: link dml::mpi)
#include "dml/dml.hpp"

constexpr std::int64_t samples = 512, features = 8, batch = 64;
constexpr int steps = 100, saved_at = 50;

int main(int argc, char** argv) {
  std::string dir = "learn_03_checkpoint";  // the command line (dml/train/flags.hpp), read before MPI starts
  dml::flags cli("learn_03_zero3_mpi");
  cli.positional("DIR", dir, "where the checkpoint goes (emptied first)");
  if (const auto status = cli.parse_for_main(argc, argv)) return *status;
  const dml::comm::mpi::environment env(&argc, &argv);  // MPI_Init here, MPI_Finalize at the end of main
  dml::comm::mpi comm;                                  // MPI_COMM_WORLD
  if (comm.rank() == 0) std::filesystem::remove_all(dir);  // a stale checkpoint would be the newest one
  comm.barrier();

  std::vector<float> x(samples * features), xb;  // example 01's data, on every process
  std::vector<std::int32_t> y(samples), yb;
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = dml::rng_stream{42, 0}.uniform(i, -1.f, 1.f);
  for (std::int64_t s = 0; s < samples; ++s) y[s] = (x[s * features] > 0) + 2 * (x[s * features + 1] > 0);
  const dml::train::sampler sampler(samples, batch, 1);
  const auto model = dml::nn::sequential{dml::nn::linear{features, 32}, dml::nn::relu{}, dml::nn::linear{32, 4}};
  using zero3_trainer = dml::trainer<dml::parallel::zero<3>>;  // and the defaults: AdamW, fp32, host

  // Steps [from, to) of the global order; every rank calls it (each step is collective). Returns the losses.
  const auto train = [&](zero3_trainer& trainer, int from, int to) {
    std::vector<float> losses;
    for (int step = from; step < to; ++step) {
      const auto rows = sampler.gather(step, comm.rank(), comm.size(), x.data(), features, y.data(), xb, yb);
      losses.push_back(trainer.step({xb.data(), {rows, features}}, yb.data(), batch).loss);
      if (comm.rank() == 0 && (step + 1) % 25 == 0)
        std::printf("step %d global loss %.4f\n", step + 1, double(losses.back()));
    }
    return losses;
  };

  // The uninterrupted run, checkpointed halfway.
  zero3_trainer first(comm, model, {.seed = 1}, dml::optim::adamw({.lr = 1e-2f}));
  auto straight = train(first, 0, saved_at);
  first.save_checkpoint(dir, {{"step", std::to_string(saved_at)}});  // writes dir/step-50, points dir/latest at it
  const auto rest = train(first, saved_at, steps);
  straight.insert(straight.end(), rest.begin(), rest.end());

  // A fresh trainer, as after a restart, with other initial weights: the checkpoint replaces them.
  zero3_trainer resumed(comm, model, {.seed = 2}, dml::optim::adamw({.lr = 1e-2f}));
  const int from = std::stoi(resumed.load_checkpoint(dir).at("step"));
  if (comm.rank() == 0) std::printf("resumed from %s at step %d on %d ranks\n", dir.c_str(), from, comm.size());
  const auto again = train(resumed, from, steps);
  float max_abs_diff = 0;
  for (std::size_t i = 0; i < again.size(); ++i)
    max_abs_diff = std::max(max_abs_diff, std::abs(again[i] - straight[std::size_t(from) + i]));
  if (comm.rank() == 0)
    std::printf("steps %d-%d after resuming: max_abs_diff=%g against the uninterrupted run\n", from + 1, steps,
                double(max_abs_diff));
  return max_abs_diff == 0 ? 0 : 1;
}
