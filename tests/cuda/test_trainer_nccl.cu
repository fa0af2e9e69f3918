// SPDX-License-Identifier: Apache-2.0
// tests/cuda/test_trainer_nccl.cu — dml::trainer in the cuda space over comm::nccl (one GPU per MPI rank) against
// the host trainer on one rank with the same initial weights (same seed) and the same global batches: every
// sharding (replicate, zero<1>, zero<2>, zero<3>) in fp32 and in mixed bf16. Per-step losses, gradient norms and
// the trained parameters must agree within the bounds below; every rank must hold the same losses and parameters.
// Then optimizer state offloaded to disk (zero<2>, fp32) and, with it, bf16's master weights (zero<1>, bf16): the
// cuda path stages the state through host memory and must train as the host does without offload.
// Without offload, the bytes the cuda trainer counts (memory().allocated after the steps, and its high-water mark)
// must equal, to the byte, those of the host trainer of the same layout (same sharding, precision and ranks, over
// comm::mpi): dml's buffers are the same in every space, which is what lets the cost model (plan/exact.hpp) price
// a GPU rank from the host's count.
// Run under mpirun (-np 1 and -np 2, label gpu); without one GPU per rank: `SKIPPED: <reason>`, exit 77.
//
// Bounds, and why:
//  - fp32: losses and gradient norms to 1e-4 relative. cuBLASLt and oneDNN, and NCCL's and a single rank's
//    gradient sums, add in different orders: float reassociation leaves ~1e-6 relative in each sum, which ten
//    AdamW steps do not amplify beyond 1e-5. Parameters to 2e-3 absolute: a gradient element at the rounding
//    noise (~1e-9) may change sign between the two runs, and AdamW then moves that weight differently by at
//    most lr·|g|/(|g|+eps) ≈ 0.1·lr per step, 1e-3 over 10 steps at lr 1e-3; a missing update or a wrong shard
//    moves weights by lr per step (1e-2 over the run).
//  - bf16 (bf16 parameters, activations and gradients, float master weights and AdamW state): losses and
//    gradient norms to 1e-2 relative. bf16 keeps 8 significant bits, so a different summation order can flip
//    the rounding of a logit, activation or gradient by one bf16 unit (2^-8 ≈ 3.9e-3 relative); such flips are
//    rare and average out over the batch, and 1e-2 allows about 2.5 units. Parameters to 2·lr·steps = 2e-2
//    absolute: bf16 gradients near zero carry rounding noise far above AdamW's eps, so a sign flip there moves a
//    weight by up to 2·lr in a step.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "dml/comm/mpi.hpp"
#include "dml/comm/nccl.hpp"
#include "dml/dml.hpp"
#include "gpu_skip.hpp"

namespace {

constexpr std::int64_t features = 24, classes = 5, global_batch = 32;
constexpr int steps = 10;
constexpr float lr = 1e-3f;  // AdamW's default, which the trainers use

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

dml::train::trainer_options options(const std::string& offload = "") {
  dml::train::trainer_options o;
  o.offload = offload;
  o.seed = 3;  // the initial weights follow (seed, parameter): the same on host and GPU
  o.bucket_mb = 1000.0 * sizeof(float) / (1024.0 * 1024.0);
  o.clip_norm = 1.f;  // so that every step reports its gradient norm
  return o;
}

struct run {
  std::vector<float> losses;
  std::vector<double> grad_norms;
  std::vector<float> params;  // after the last step, the whole model
  std::int64_t allocated = 0, allocated_peak = 0;  // memory() after the last step
};

// This rank's rows of every step, trained in Space over comm.
template <class Space, class Sharding, class Precision, class Comm>
run train(Comm& comm, const data& d, const std::string& offload = "") {
  dml::trainer<Space, Sharding, Precision> t(comm, make_model(), options(offload));
  const std::int64_t lo = global_batch * comm.rank() / comm.size(), hi = global_batch * (comm.rank() + 1) / comm.size();
  dml::buffer<float, Space> x(static_cast<std::size_t>((hi - lo) * features));
  dml::buffer<std::int32_t, Space> y(static_cast<std::size_t>(hi - lo));
  run out;
  for (int s = 0; s < steps; ++s) {
    dml::copy_n(d.x.data() + (s * global_batch + lo) * features, x.size(), x.data());
    dml::copy_n(d.y.data() + s * global_batch + lo, y.size(), y.data());
    const auto r = t.step(dml::tensor_view<const float, Space>(x.data(), {hi - lo, features}), y.data(), global_batch);
    out.losses.push_back(r.loss);
    out.grad_norms.push_back(r.grad_norm);
  }
  out.allocated = t.memory().allocated;
  out.allocated_peak = t.memory().allocated_peak;
  out.params = t.full_parameters();
  return out;
}

double max_rel(std::span<const double> got, std::span<const double> want) {
  double worst = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(got[i] - want[i]) / std::max(std::fabs(want[i]), 1e-12);
    worst = std::isnan(d) ? INFINITY : std::max(worst, d);
  }
  return worst;
}
std::vector<double> widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Whether every rank holds exactly rank 0's values (the trainer promises one loss, and one model, for all).
bool same_on_every_rank(dml::comm::mpi& world, std::vector<float> v) {
  std::vector<float> first = v;
  world.broadcast(std::span<float>(first), 0);
  int differs = first != v;
  world.all_reduce(std::span<int>(&differs, 1), dml::comm::reduce_op::max);
  return differs == 0;
}

template <class Sharding, class Precision>
int check(dml::comm::nccl& gpu, dml::comm::mpi& world, dml::comm::mpi& alone, const data& d, const char* sharding,
          double loss_bound, double param_bound, const std::string& offload = "") {
  const auto ref = train<dml::host, dml::parallel::replicate, Precision>(alone, d);
  const auto got = train<dml::cuda, Sharding, Precision>(gpu, d, offload);
  const double loss_diff = max_rel(widen(got.losses), widen(ref.losses));
  const double norm_diff = max_rel(got.grad_norms, ref.grad_norms);
  double param_diff = got.params.size() == ref.params.size() ? 0.0 : INFINITY;
  for (std::size_t i = 0; i < ref.params.size() && i < got.params.size(); ++i) {
    const double p = std::fabs(double(got.params[i]) - ref.params[i]);
    param_diff = std::isnan(p) ? INFINITY : std::max(param_diff, p);
  }
  const bool agree = same_on_every_rank(world, got.losses) && same_on_every_rank(world, got.params);
  // The same layout in host memory counts the same bytes (offload stages through host buffers on cuda alone).
  bool same_bytes = true;
  char bytes_note[160] = "";
  if (offload.empty()) {
    const auto host = train<dml::host, Sharding, Precision>(world, d);
    same_bytes = host.allocated == got.allocated && host.allocated_peak == got.allocated_peak;
    std::snprintf(bytes_note, sizeof bytes_note, "; allocated %lld peak %lld (host, same layout: %lld peak %lld)%s",
                  static_cast<long long>(got.allocated), static_cast<long long>(got.allocated_peak),
                  static_cast<long long>(host.allocated), static_cast<long long>(host.allocated_peak),
                  same_bytes ? "" : " DIFFER");
    int differs = !same_bytes;
    world.all_reduce(std::span<int>(&differs, 1), dml::comm::reduce_op::max);
    same_bytes = differs == 0;
  }
  const bool ok =
      loss_diff <= loss_bound && norm_diff <= loss_bound && param_diff <= param_bound && agree && same_bytes;
  if (gpu.rank() == 0)
    std::printf("%-4s trainer<cuda, %s, %s> on %d GPU(s) vs host on 1 rank: max_rel_loss_diff=%.3g "
                "max_rel_grad_norm_diff=%.3g (bound %.0e), max_abs_param_diff=%.3g (bound %.0e), ranks agree: %s; "
                "loss %.5f -> %.5f%s%s%s\n",
                ok ? "ok" : "FAIL", sharding, Precision::name, gpu.size(), loss_diff, norm_diff, loss_bound,
                param_diff, param_bound, agree ? "yes" : "NO", ref.losses.front(), ref.losses.back(),
                offload.empty() ? "" : "; offload ", offload.c_str(), bytes_note);
  std::fflush(stdout);
  return ok ? 0 : 1;
}

template <class Precision>
int check_every_sharding(dml::comm::nccl& gpu, dml::comm::mpi& world, dml::comm::mpi& alone, const data& d,
                         double loss_bound, double param_bound) {
  using namespace dml::parallel;
  int failures = check<replicate, Precision>(gpu, world, alone, d, "replicate", loss_bound, param_bound);
  failures += check<zero<1>, Precision>(gpu, world, alone, d, "zero<1>", loss_bound, param_bound);
  failures += check<zero<2>, Precision>(gpu, world, alone, d, "zero<2>", loss_bound, param_bound);
  failures += check<zero<3>, Precision>(gpu, world, alone, d, "zero<3>", loss_bound, param_bound);
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  dml::comm::mpi::environment env(&argc, &argv);
  dml::comm::mpi world;
  if (gpu_skip::skip_without_devices(world.native())) return gpu_skip::exit_code;
  try {
    dml::comm::mpi alone = world.split(world.rank(), 0);  // the host reference, on each rank by itself
    dml::comm::nccl gpu(world);                           // selects this rank's node-local device
    const data d;
    int failures = check_every_sharding<dml::precision::fp32>(gpu, world, alone, d, 1e-4, 2e-3);
    failures += check_every_sharding<dml::precision::bf16>(gpu, world, alone, d, 1e-2, 2.0 * lr * steps);
    // Every rank's offload files carry its process and rank in their names: one directory serves all.
    const auto dir = std::filesystem::temp_directory_path() / "dml_trainer_nccl_offload";
    if (world.rank() == 0) std::filesystem::create_directories(dir);
    world.barrier();
    using dml::parallel::zero;
    failures += check<zero<2>, dml::precision::fp32>(gpu, world, alone, d, "zero<2>", 1e-4, 2e-3,
                                                     "optimizer:disk:" + dir.string());
    failures += check<zero<1>, dml::precision::bf16>(gpu, world, alone, d, "zero<1>", 1e-2, 2.0 * lr * steps,
                                                     "optimizer,master:disk:" + dir.string());
    world.barrier();
    if (world.rank() == 0) std::filesystem::remove_all(dir);
    world.all_reduce(std::span<int>(&failures, 1), dml::comm::reduce_op::max);  // a check fails if it did on any rank
    if (world.rank() == 0) std::printf("test_trainer_nccl: 10 checks, %d failed\n", failures);
    std::fflush(stdout);
    world.barrier();
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    // A rank that cannot go on would leave the others waiting in a collective: end the job.
    std::printf("FAIL rank %d: test_trainer_nccl: %s\n", world.rank(), e.what());
    std::fflush(stdout);
    MPI_Abort(world.native(), 1);
    return 1;
  }
}
