// SPDX-License-Identifier: Apache-2.0
// examples/learn/09_custom_sharding.cpp — a sharding policy written outside dml, from the sharding_sync concept alone.
//
// What it teaches:
//  - what a sharding is: a policy (a name, what it shards) that names a class template sync<Space, Comm,
//    Optimizer, Precision, Net>, one per rank, holding that rank's gradients and optimizer state and doing
//    the gradient work the trainer hands it. dml::parallel::sharding_sync is the whole contract, in named
//    parts (sync_setup, sync_residency, sync_gradients, sync_update, sync_state, sync_checkpoint, and the
//    constructor, sync_construction); each member below says which part it belongs to and when it is called;
//  - flat_allreduce: plain data parallelism without overlap. Every rank keeps whole parameters, gradients
//    and optimizer state; after the step's last backward one all-reduce sums the whole gradient buffer;
//  - that it trains exactly as dml::parallel::replicate (bucketed all-reduce during backward) on 2 ranks,
//    and that its checkpoints load into any other sharding: here replicate resumes from one.
// Run: learn_09_custom_sharding [checkpoint_dir]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "dml/dml.hpp"

namespace dp = dml::parallel;

// fp32 only: under bf16/fp16 a sharding also keeps float master weights beside the network's working copy.
template <class Space, class Comm, class Optimizer, class Precision, class Net>
class flat_allreduce_sync : public dml::nn::layer_hooks {  // the backward's per-layer hooks: none needed here
  static_assert(std::same_as<typename Precision::type, float>, "flat_allreduce: fp32 only");

 public:
  using optimizer_type = Optimizer;

  // ---- sync_setup, asked before the network is built.
  static constexpr bool streams_gradients = false;  // gradients stay whole until the step's last backward
  static dml::nn::network_options network_options(int /*ranks*/, bool /*per_step*/) {
    return {.own_params = true, .own_grads = true};  // the network holds both; this sync works on them in place
  }

  // ---- sync_construction: the groups to reduce over, the network (its layout is the flat index space of
  // parameters, gradients and state), and the trainer's options (this rank's chunks of layers).
  flat_allreduce_sync(dp::shard_groups<Comm> g, Net& net, const dp::sync_options& o)
      : comm_(g.dense), net_(net), chunks_(std::max<std::size_t>(o.chunks.size(), 1)) {
    if (g.expert) dml::fail<dml::invalid_argument>("flat_allreduce: experts would reduce over their own group");
    state_.resize(net_.layout().total);  // Optimizer::state_slots zeroed floats per parameter
  }

  // ---- sync_residency: every rank holds every parameter, so there is nothing to gather or free.
  void begin_pass() {}  // before each forward or backward pass
  void unshard(int) {}  // before a chunk's first compute of the step
  void reshard(int) {}  // after its last

  // ---- sync_gradients
  void begin_backward(bool /*first*/) {}  // the network writes, then adds into, whole gradients itself
  // After each chunk's last backward (final); once every chunk of this rank is there, one flat all-reduce.
  // A sum, not a mean: the trainer's loss already divides by the global batch.
  void reduce(int /*chunk*/, bool final) {
    if (!final || ++finals_ < chunks_) return;
    finals_ = 0;
    comm_.all_reduce(net_.grads(), dml::comm::reduce_op::sum);  // on a GPU, after the backward's kernels: the
                                                                 // communicator orders itself (comm/communicator.hpp)
  }
  // A slot's gradient as this rank holds it after the reduction (tied parameters sum theirs): whole.
  dml::span_in<float, Space> grad_piece(std::size_t slot) {
    return {net_.grad(slot), static_cast<std::size_t>(net_.layout().slots[slot].shape.numel())};
  }

  // ---- sync_update, the step's tail.
  // Squares of the gradients this rank owns (see owned_pieces), but slots another rank counts (skip[slot]).
  double grad_squared_norm(const std::vector<bool>& skip) {
    double n = 0;
    for (const auto& p : owned_pieces())
      if (skip.empty() || !skip[p.slot]) n += dml::optim::squared_norm<Space>(net_.grads().data() + p.flat, p.end - p.begin);
    return n;
  }
  bool has_overflow() { return dml::optim::has_nonfinite<Space>(net_.grads().data(), net_.layout().total); }
  // One fused optimizer pass over every parameter: the gradients times grad_scale (clipping, loss scale).
  void update(Optimizer& opt, float lr, std::int64_t step, float grad_scale) {
    opt.template update<Space>({.n = net_.layout().total, .w = net_.params().data(), .g = net_.grads().data(),
                                .state = state_.pointers(), .step = step, .lr = lr, .grad_scale = grad_scale});
  }

  // ---- sync_state
  std::vector<float> parameters() {  // every parameter, in the layout's flat order
    std::vector<float> out(net_.params().size());
    dml::copy_n(net_.params().data(), out.size(), out.data());
    return out;
  }
  void load_parameters(std::span<const float> full) { dml::copy_n(full.data(), full.size(), net_.params().data()); }
  void refresh_working() {}  // fp32: the float parameters are the working copy
  dp::memory_report memory() const {
    const auto& L = net_.layout();
    const std::int64_t bytes = L.total * std::int64_t(sizeof(float));
    return {.numel = L.numel, .padded = L.total, .params = bytes, .grads = bytes, .optimizer = state_.bytes()};
  }
  std::span<const dp::bucket> buckets() const { return {}; }  // no buckets: one flat reduction

  // ---- sync_checkpoint. Rank 0 of the group owns every parameter whole (it writes them and counts them in
  // the norm), the others own nothing, so each element is written and counted once. Loads read whole.
  std::vector<dp::owned_piece> owned_pieces() const {
    std::vector<dp::owned_piece> out;
    const auto& slots = net_.layout().slots;
    if (comm_.rank() == 0)
      for (std::size_t s = 0; s < slots.size(); ++s)
        out.push_back({.slot = s, .begin = 0, .end = slots[s].shape.numel(), .flat = slots[s].offset,
                        .shard = slots[s].offset});
    return out;
  }
  bool writes_checkpoint() const { return true; }  // a rank that owns nothing writes nothing anyway
  // k = −1: the parameters; k ≥ 0: optimizer state slot k. Both use the layout's flat offsets.
  float* whole(int k) { return k < 0 ? net_.params().data() : state_.slot(k).data(); }
  float* held(int k, const dp::owned_piece& p) { return whole(k) + p.flat; }
  bool loads_pieces(int /*k*/) { return false; }  // every rank reads everything, into whole(k)

 private:
  Comm& comm_;
  Net& net_;
  std::size_t chunks_, finals_ = 0;                // this rank's chunks (pipelines), final reductions seen
  dml::optim::state<Optimizer, Space> state_;      // the optimizer's state, whole
};

// The policy: its family, its name, what it shards (nothing), and its sync.
struct flat_allreduce {
  using policy_family = dml::sharding_family;
  static constexpr const char* name = "flat_allreduce";
  static constexpr bool shards_optimizer_state = false, shards_gradients = false, shards_parameters = false;
  template <class Space, class Comm, class Optimizer, class Precision, class Net>
  using sync = flat_allreduce_sync<Space, Comm, Optimizer, Precision, Net>;
};
// The trainer checks the sync where it builds it: static_assert(dml::parallel::diagnose_sharding_sync<S, Comm,
// Net>()) names each missing part, with its members (examples/learn/08 shows such errors).
static_assert(dp::sharding_policy<flat_allreduce>);

constexpr std::int64_t samples = 512, features = 8, classes = 4, batch = 64;
constexpr int ranks = 2, steps = 20;

int main(int argc, char** argv) {
  std::string dir = "learn_09_checkpoint";  // the command line (dml/train/flags.hpp)
  dml::flags cli("learn_09_custom_sharding");
  cli.positional("DIR", dir, "where the checkpoint goes (emptied first)");
  if (const auto status = cli.parse_for_main(argc, argv)) return *status;
  std::filesystem::remove_all(dir);
  std::vector<float> x(samples * features);  // example 01's data
  std::vector<std::int32_t> y(samples);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = dml::rng_stream{42, 0}.uniform(i, -1.f, 1.f);
  for (std::int64_t s = 0; s < samples; ++s) y[s] = (x[s * features] > 0) + 2 * (x[s * features + 1] > 0);

  double worst = 0, worst_resumed = 0;  // the largest relative differences between two trainers' losses
  dml::comm::local::run(ranks, [&](dml::comm::local& comm) {
    const auto model = dml::nn::sequential{dml::nn::linear{features, 32}, dml::nn::relu{}, dml::nn::linear{32, classes}};
    const dml::optim::adamw adamw({.lr = 1e-2f});
    dml::trainer<flat_allreduce> mine(comm, model, {.seed = 1}, adamw);
    dml::trainer<dp::replicate> ddp(comm, model, {.seed = 1}, adamw);
    const dml::train::sampler sampler(samples, batch, 1);
    std::vector<float> xb;
    std::vector<std::int32_t> yb;
    auto step = [&](auto& trainer, int s) {
      const auto rows = sampler.gather(s - 1, comm.rank(), comm.size(), x.data(), features, y.data(), xb, yb);
      return double(trainer.step({xb.data(), {rows, features}}, yb.data(), batch).loss);
    };
    auto relative = [](double a, double b) {  // NaN counts as the largest difference
      const double r = std::abs(a - b) / std::max(std::abs(b), 1e-30);
      return std::isnan(r) ? HUGE_VAL : r;
    };
    for (int s = 1; s <= steps; ++s) {
      const double a = step(mine, s), b = step(ddp, s);
      if (comm.rank() == 0) {
        worst = std::max(worst, relative(a, b));
        std::printf("step %2d  flat_allreduce %.6f  replicate %.6f\n", s, a, b);
      }
    }
    // flat_allreduce's owned_pieces, held and whole write its parameters and AdamW state; a replicate trainer
    // (another layout, other initial weights) loads them and takes the next steps as flat_allreduce does,
    // which needs the state: a step's loss depends on the update before it.
    mine.save_checkpoint(dir);
    dml::trainer<dp::replicate> resumed(comm, model, {.seed = 2}, adamw);
    resumed.load_checkpoint(dir);
    for (int s = steps + 1; s <= steps + 3; ++s) {
      const double a = step(mine, s), b = step(resumed, s);
      if (comm.rank() == 0) worst_resumed = std::max(worst_resumed, relative(a, b));
    }
  });
  std::filesystem::remove_all(dir);
  const bool same = worst <= 1e-5, resumed_same = worst_resumed <= 1e-5;
  std::printf("the same losses as parallel::replicate: %s (largest relative difference %.2g)\n", same ? "yes" : "no",
              worst);
  std::printf("a checkpoint of flat_allreduce resumed under parallel::replicate, the next 3 losses: %s\n",
              resumed_same ? "the same" : "different");
  return same && resumed_same ? 0 : 1;
}
