// SPDX-License-Identifier: Apache-2.0
// tests/cuda/test_trainer_nccl.cu — dml::trainer in the cuda space over comm::nccl (one GPU per MPI rank):
// every sharding trains to the per-step losses of the host trainer on one rank with the same global batch.
// Compiled wherever nvcc exists; runs (label gpu, under mpirun) only where GPUs are, else exits 77.
#include <cmath>
#include <cstdio>
#include <vector>

#include "dml/comm/mpi.hpp"
#include "dml/comm/nccl.hpp"
#include "dml/dml.hpp"

namespace {

constexpr std::int64_t features = 24, classes = 5, global_batch = 32;
constexpr int steps = 10;

// With dropout: each GPU rank draws the mask bits of its own global rows, as the host rank does.
auto make_model() {
  return dml::nn::sequential{dml::nn::linear{features, 40}, dml::nn::relu{}, dml::nn::dropout{0.1f},
                             dml::nn::layernorm{40}, dml::nn::linear{40, classes}};
}

struct data {
  std::vector<float> x = std::vector<float>(steps * global_batch * features);
  std::vector<std::int32_t> y = std::vector<std::int32_t>(steps * global_batch);
  data() {
    const dml::rng_stream rng{9, 1};
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = rng.normal(i);
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(rng.block(1u << 30 | i)[0] % classes);
  }
};

dml::train::trainer_options options() {
  dml::train::trainer_options o;
  o.seed = 3;
  o.bucket_mb = 1000.0 * sizeof(float) / (1024.0 * 1024.0);
  o.clip_norm = 1.f;
  return o;
}

// This rank's rows of every step, trained in Space over comm; the per-step global losses.
template <class Space, class Sharding, class Comm, class Precision = dml::precision::fp32>
std::vector<float> train(Comm& comm, const data& d) {
  dml::trainer<Space, Sharding, Precision> t(comm, make_model(), options());
  const std::int64_t lo = global_batch * comm.rank() / comm.size(), hi = global_batch * (comm.rank() + 1) / comm.size();
  dml::buffer<float, Space> x(static_cast<std::size_t>((hi - lo) * features));
  dml::buffer<std::int32_t, Space> y(static_cast<std::size_t>(hi - lo));
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) {
    dml::copy_n(d.x.data() + (s * global_batch + lo) * features, x.size(), x.data());
    dml::copy_n(d.y.data() + s * global_batch + lo, y.size(), y.data());
    losses.push_back(t.step(dml::tensor_view<const float, Space>(x.data(), {hi - lo, features}), y.data(), global_batch).loss);
  }
  return losses;
}

template <class Sharding, class Precision = dml::precision::fp32>
int check(dml::comm::nccl& gpu, dml::comm::mpi& alone, const data& d, const char* name, double bound = 1e-4) {
  const auto ref = train<dml::host, dml::parallel::replicate, dml::comm::mpi, Precision>(alone, d);
  const auto got = train<dml::cuda, Sharding, dml::comm::nccl, Precision>(gpu, d);
  double worst = 0;
  for (int s = 0; s < steps; ++s) worst = std::max(worst, std::abs(double(got[s]) - ref[s]) / std::abs(double(ref[s])));
  if (gpu.rank() == 0) std::printf("%s on %d GPUs: max_rel_loss_diff=%.3g\n", name, gpu.size(), worst);
  return worst <= bound ? 0 : 1;  // cuBLASLt and oneDNN sum in different orders
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::puts("no GPU: nothing to run");
    return 77;
  }
  try {
    dml::comm::mpi::environment env;
    dml::comm::mpi world;
    DML_CHECK_CUDA(cudaSetDevice(world.rank() % devices));
    dml::comm::mpi alone = world.split(world.rank(), 0);
    dml::comm::nccl gpu(world);
    const data d;
    int failures = check<dml::parallel::replicate>(gpu, alone, d, "ddp");
    failures += check<dml::parallel::zero<1>>(gpu, alone, d, "zero1");
    failures += check<dml::parallel::zero<2>>(gpu, alone, d, "zero2");
    failures += check<dml::parallel::zero<3>>(gpu, alone, d, "zero3");
    failures += check<dml::parallel::zero<2>, dml::precision::bf16>(gpu, alone, d, "zero2 bf16", 2e-2);
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test_trainer_nccl: %s\n", e.what());
    return 1;
  }
}
