// SPDX-License-Identifier: Apache-2.0
// examples/fashion_mnist/fashion_mnist.hpp — MLP training on Fashion-MNIST, one template for host and CUDA.
// Flags: see command_line() below, or run it with --help. Prints test_accuracy=0.xxxx after every epoch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <array>
#include <fstream>
#include <numeric>
#include <variant>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dml/dml.hpp"
#if !defined(__CUDACC__)
#  include "dml/plan/calibrate.hpp"
#endif
#include "dml/train/flags.hpp"

namespace fashion_mnist {

struct options {
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::vector<std::int64_t> hidden{256, 256};
  std::int64_t epochs = 5;
  std::string memory;  // the most bytes of dml buffers a rank may hold ("64MiB"; empty: no limit)
  std::int64_t steps = 0;  // 0: no limit
  std::int64_t batch = 128;
  std::optional<float> lr;
  std::string optimizer = "adamw";
  std::string lr_schedule = "cosine";  // constant | cosine (linear warmup, then cosine decay to 0)
  std::int64_t warmup = 100;
  std::optional<float> warmup_fraction;  // warmup as a fraction of the run; overrides --warmup and its cap
  std::optional<float> weight_decay;
  float trust_clip = 0.f;  // lamb, lars: upper bound on the trust ratio; 0: none
  std::uint64_t seed = 1;
  std::string init, save, log;
  std::string trace;  // the run's timeline, Chrome trace-event JSON (trainer_options::trace)
  bool shuffle = true;
  // One thread per rank by default: this model's GEMMs are small enough that a second OpenMP thread
  // costs more in synchronisation than it gains, and far more when another process shares the cores.
  int threads = 1;
  int ranks = 1;                  // comm::local ranks (threads of this process)
  std::string comm = "local";     // local | mpi (launch with mpirun; ranks = the MPI world) | gloo (DML_RANK, ...)
  std::string parallel = "ddp";   // ddp | zero1 | zero2 | zero3
  int replicas = 1;               // > 1 with zeroN: hybrid sharding, ZeRO within each of this many replicas
  std::string precision = "fp32";
  double bucket_mb = 25.0;
  std::string compress = "none";  // none | onebit | onebit:B | topk:F | onebit-adam:W: compression, error feedback
  int pp = 1;                  // pipeline stages
  int dp = 0;                  // data-parallel ranks per stage; 0: ranks / pp
  std::int64_t microbatches = 1;
  std::string schedule;        // gpipe | 1f1b | interleaved:V | zb | FILE.csv; empty: 1f1b (single for one stage)
  std::vector<std::size_t> cuts;  // first layer of each stage after the first; empty: balanced
  bool recompute = false;
  bool print_schedule = false;
  std::string checkpoint;  // save a sharded checkpoint here after every epoch
  bool checkpoint_async = false;  // ... in the background, while the next epoch trains
  std::string resume;      // continue from the newest checkpoint here
  std::string offload;     // optimizer[,master]:disk:DIR keeps the optimizer state (and master weights) in files in DIR
  bool elastic = false;    // under dml-run: train through deaths of ranks (main_elastic.cpp)
  std::string commit_log;  // --elastic: append "step epoch members hash" per committed step
  std::int64_t comm_timeout_ms = 1000;  // --elastic: the deadline of every collective
  int copies = 1;  // --elastic with parts of the model: the members after each that hold a copy of its pieces
  std::int64_t commit_every = 1;  // --elastic, restarting: vote and copy the state every this many steps
};

// The command line: every flag bound to its member of `o`, with its default and its rules (dml/train/flags.hpp).
inline dml::flags command_line(options& o) {
  dml::flags f(
      "fashion_mnist", "Trains an MLP on Fashion-MNIST; prints test_accuracy=0.xxxx after every epoch.",
      "--batch is the global batch: with N ranks each takes its slice of every batch, and the run trains the\n"
      "same model as one rank does. Under mpirun, pass --comm mpi. With --comm gloo each process is one rank\n"
      "named by DML_RANK, DML_WORLD_SIZE and DML_STORE (file:DIR, a directory every rank shares). --pp K cuts the model into K pipeline\n"
      "stages (each of D = ranks / K data-parallel ranks); with --pp and --dp, --ranks must be K * D.\n"
      "--replicas R with --parallel zero1|zero2|zero3 is hybrid sharding: the D data-parallel ranks form R\n"
      "replicas of D / R consecutive ranks, ZeRO shards within each, and the replicas sum their gradients.");
  f.add("--data", o.data, "DIR", "the Fashion-MNIST IDX files");
  f.add("--hidden", o.hidden, "W,W", "hidden layer widths, 0 to 3 of them").min(1);
  f.add("--epochs", o.epochs, "N", "epochs").min(0);
  f.add("--steps", o.steps, "N", "stop after N steps; 0: no limit").min(0);
  f.add("--batch", o.batch, "N", "global batch").min(1);
  f.add("--lr", o.lr, "X", "learning rate").default_text("the optimizer's, as PyTorch's").min(0.f);
  f.add("--optimizer", o.optimizer, "O", "optimizer").choices({"sgd", "adam", "adamw", "adagrad", "lamb", "lars"});
  f.add("--weight-decay", o.weight_decay, "X", "weight decay").default_text("the optimizer's, as PyTorch's").min(0.f);
  f.add("--trust-clip", o.trust_clip, "X", "lamb, lars: upper bound on the trust ratio; 0: none").min(0.f);
  f.add("--seed", o.seed, "N", "seed of the initial weights and the shuffle");
  f.add("--lr-schedule", o.lr_schedule, "S", "constant, or linear warmup then cosine decay to 0")
      .choices({"constant", "cosine"});
  f.add("--warmup", o.warmup, "N", "warmup steps of the cosine schedule, at most a tenth of the run").min(0);
  f.add("--warmup-fraction", o.warmup_fraction, "F", "warmup as a fraction of the run's steps, instead of --warmup")
      .min(0.f)
      .max(1.f);
  f.add("--init", o.init, "FILE", "initial weights, .safetensors");
  f.add("--save", o.save, "FILE", "save the trained weights, .safetensors");
  f.add_switch("--no-shuffle", o.shuffle, "keep the training set's order", false);
  f.add("--log", o.log, "FILE", "write the loss and learning rate per step, .csv");
  f.add("--trace", o.trace, "FILE", "write the run's timeline, .json (Perfetto UI, chrome://tracing)");
  f.add("--memory", o.memory, "BYTES",
        "the most bytes of dml buffers a rank may hold (64MiB, 1GB, ...): an allocation past it stops the run, naming "
        "what is held")
      .check([](const std::string& s) {
        try {
          dml::parse_bytes(s);
          return std::string{};
        } catch (const dml::error&) {
          return std::string("a positive size such as 64MiB, 1GB or 1e9");
        }
      });
  f.add("--threads", o.threads, "N", "OpenMP threads per rank").min(1);
  f.add("--ranks", o.ranks, "N", "comm::local ranks; with --comm mpi or gloo the world (leave it out)").min(1);
  f.add("--comm", o.comm, "C", "communicator").choices({"local", "mpi", "gloo"});
  f.add("--parallel", o.parallel, "P", "sharding").choices({"ddp", "zero1", "zero2", "zero3"});
  f.add("--replicas", o.replicas, "R", "replicas of hybrid sharding, with zero1-3").min(1);
  f.add("--precision", o.precision, "P",
        "arithmetic; auto: fp32 or bf16, whichever runs a forward and backward of the model faster here (timed first)")
      .choices({"fp32", "bf16", "fp16", "auto"});
  f.add("--bucket-mb", o.bucket_mb, "X", "gradient bucket size in MB")
      .check([](double mb) { return mb > 0 ? std::string() : "a size > 0"; }, "> 0");
  f.add("--compress", o.compress, "C",
        "gradient compression with error feedback: none, onebit, onebit:B, topk:F or onebit-adam:W")
      .check(dml::parallel::gradient_compression::spec_problem, "fp32, ddp or zero1-3");
  f.add("--checkpoint", o.checkpoint, "DIR", "save a sharded checkpoint here after every epoch");
  f.add_switch("--checkpoint-async", o.checkpoint_async, "write the checkpoints in the background while training goes on");
  f.add("--resume", o.resume, "DIR", "continue from the newest checkpoint in DIR");
  f.add("--offload", o.offload, "optimizer[,master]:disk:DIR",
        "keep the optimizer state (with master, also bf16's fp32 master weights) in files in DIR (an existing, "
        "writable directory)")
      .check(dml::parallel::offload_spec_problem);
  f.add("--pp", o.pp, "K", "pipeline stages").min(1);
  f.add("--dp", o.dp, "D", "data-parallel ranks per stage; 0: ranks / K").min(0);
  f.add("--microbatches", o.microbatches, "M", "microbatches per step").min(1);
  f.add("--schedule", o.schedule, "S", "pipeline schedule: gpipe, 1f1b, interleaved:V, zb or FILE.csv")
      .default_text("1f1b (single for one stage)");
  f.add("--cuts", o.cuts, "L,L", "first layer of each stage after the first").default_text("balanced");
  f.add_switch("--recompute", o.recompute, "recompute activations in the backward pass");
  f.add_switch("--print-schedule", o.print_schedule, "print the pipeline schedule's table");
  f.add_switch("--elastic", o.elastic, "under dml-run: train through deaths, freezes and restarts of ranks (fp32; ddp heals from peers, zero1-3 and --pp restart at the new size)");
  f.add("--commit-log", o.commit_log, "FILE", "with --elastic: append one line per committed step");
  f.add("--comm-timeout-ms", o.comm_timeout_ms, "MS", "with --elastic: the deadline of every collective").min(1);
  f.add("--copies", o.copies, "K",
        "with --elastic and zero1-3 or --pp: the members after each that hold a copy of its state (deaths survived "
        "at once)")
      .min(1);
  f.add("--commit-every", o.commit_every, "K",
        "with --elastic where members hold parts of the model: vote and copy the state every K steps (a failure "
        "runs up to K steps again)")
      .min(1);
  return f;
}

// What the table cannot check alone: rules across flags.
inline void check_across(const options& o) {
  if (o.replicas > 1 && o.parallel == "ddp")
    dml::fail<dml::invalid_argument>("--replicas ", o.replicas, ": hybrid sharding shards within each replica, so it "
                                     "needs --parallel zero1, zero2 or zero3; found --parallel ddp (which holds "
                                     "everything on every rank: leave --replicas out)");
  if (o.precision != "fp32" && o.optimizer == "adagrad")
    dml::fail<dml::invalid_argument>("--precision ", o.precision, ": expected --optimizer sgd, adam or adamw (adagrad "
                                     "does not write a working copy), found adagrad");
  if (o.trust_clip > 0 && o.optimizer != "lamb" && o.optimizer != "lars")
    dml::fail<dml::invalid_argument>("--trust-clip ", o.trust_clip, ": expected --optimizer lamb or lars, found ",
                                     o.optimizer);
  if (o.checkpoint_async && o.checkpoint.empty())
    dml::fail<dml::invalid_argument>("--checkpoint-async: expected --checkpoint DIR to save into, found none");
  if (o.elastic && !o.trace.empty())
    dml::fail<dml::invalid_argument>("--trace: expected no --elastic (its trainers change with the membership)");
  if (o.precision == "auto" && (o.comm != "local" || o.elastic))
    dml::fail<dml::invalid_argument>("--precision auto times this host before training: expected --comm local, found ",
                                     o.elastic ? "--elastic" : "--comm " + o.comm,
                                     " (every process would time on its own and might choose otherwise); give fp32 or bf16");
  if (dml::parallel::offload_master(o.offload) && (o.precision == "fp32" || o.precision == "auto"))
    dml::fail<dml::invalid_argument>("--offload ", o.offload, ": expected --precision bf16 or fp16 for the master "
                                     "weights on disk, found fp32 (its weights are the working copy)");
  if (o.compress != "none" && o.precision != "fp32")
    dml::fail<dml::invalid_argument>("--compress ", o.compress, ": expected --precision fp32 (compressed reductions "
                                     "sum fp32 gradients), found ", o.precision);
  if (o.dp > 0 && o.comm == "local" && o.ranks != o.pp * o.dp)
    dml::fail<dml::invalid_argument>("--ranks: expected --pp × --dp = ", o.pp * o.dp, " ranks, found ", o.ranks);
}

// The optimizer named by --optimizer, chosen at run time, with PyTorch's defaults where a flag is absent.
// lamb and lars (layer-wise: per-tensor trust ratios; 1-D tensors take no decay or ratio) take --trust-clip.
using any_optimizer = dml::optim::any_of<dml::optim::sgd, dml::optim::adam, dml::optim::adamw, dml::optim::adagrad,
                                         dml::optim::lamb, dml::optim::lars>;
inline any_optimizer make_optimizer(const options& o) {
  auto opt = any_optimizer::by_name(o.optimizer);
  std::visit(
      [&](auto& chosen) {
        auto p = chosen.opt;
        if (o.lr) p.lr = *o.lr;
        if (o.weight_decay) p.weight_decay = *o.weight_decay;
        if constexpr (requires { p.trust_clip; }) p.trust_clip = o.trust_clip;
        chosen = std::remove_cvref_t<decltype(chosen)>{p};
      },
      opt.chosen);
  return opt;
}

// The learning rate of step s (from 1) of `planned`.
inline float learning_rate(const options& o, float base, std::int64_t s, std::int64_t planned) {
  if (o.lr_schedule == "constant") return base;
  const std::int64_t warmup = o.warmup_fraction
                                  ? std::llround(static_cast<double>(*o.warmup_fraction) * static_cast<double>(planned))
                                  : std::min(o.warmup, planned / 10);
  return dml::optim::warmup_cosine{base, warmup, planned}(s);
}

inline std::int64_t planned_steps(const options& o, std::int64_t per_epoch) {
  return o.steps > 0 ? std::min(o.steps, per_epoch * o.epochs) : per_epoch * o.epochs;
}

// Copies rows `idx` of the dataset into a contiguous batch in Space (on the host straight into the
// batch; for a device through one staging copy).
template <class Space>
struct batch_loader {
  std::vector<float> x_host;
  std::vector<std::int32_t> y_host;
  dml::tensor<float, Space> x;
  dml::buffer<std::int32_t, Space> y;

  void load(const dml::train::dataset& d, std::span<const std::int64_t> idx) {
    const std::int64_t f = d.features(), n = static_cast<std::int64_t>(idx.size());
    x.resize({n, f});
    y.resize(static_cast<std::size_t>(n));
    constexpr bool on_host = std::same_as<Space, dml::host>;
    if constexpr (!on_host) {
      x_host.resize(static_cast<std::size_t>(n * f));
      y_host.resize(static_cast<std::size_t>(n));
    }
    float* xs = on_host ? x.data() : x_host.data();
    std::int32_t* ys = on_host ? y.data() : y_host.data();
    for (std::int64_t i = 0; i < n; ++i) {
      std::copy_n(d.images.data() + idx[i] * f, f, xs + i * f);
      ys[i] = d.labels[static_cast<std::size_t>(idx[i])];
    }
    if constexpr (!on_host) {
      dml::copy_n(x_host.data(), x_host.size(), x.data());
      dml::copy_n(y_host.data(), y_host.size(), y.data());
    }
  }
};

template <class Space, class Net>
double evaluate(Net& net, const dml::train::dataset& test) {
  batch_loader<Space> loader;
  std::vector<std::int64_t> idx;
  std::int64_t correct = 0;
  const std::int64_t chunk = 1000;
  for (std::int64_t begin = 0; begin < test.size(); begin += chunk) {
    idx.clear();
    for (std::int64_t i = begin; i < std::min(test.size(), begin + chunk); ++i) idx.push_back(i);
    loader.load(test, idx);
    auto logits = net.forward(loader.x.cview(), {.training = false});
    correct += dml::nn::count_correct<Space>(logits, loader.y.data());
  }
  return static_cast<double>(correct) / static_cast<double>(test.size());
}

// One device, no communicator: the loop the trainer runs, spelled out (the CUDA build uses it).
template <class Space, class Model>
int run_single(const options& o, Model model, const dml::train::dataset& train_set, const dml::train::dataset& test_set) {
  using O = any_optimizer;
  const O opt = make_optimizer(o);
  auto run = [&]<class... L>(const dml::nn::sequential<L...>& m) {
    dml::nn::network<Space, L...> net(m, o.seed);
    if (!o.init.empty()) dml::train::load_weights(net, o.init);
    dml::optim::state<O, Space> state(net.layout().total);
    dml::nn::softmax_cross_entropy loss_fn;
    dml::train::sampler sampler(train_set.size(), o.batch, o.seed, o.shuffle);
    batch_loader<Space> loader;
    dml::tensor<float, Space> dlogits;
    dml::buffer<float, Space> row_loss;
    std::ofstream log;
    if (!o.log.empty()) {
      log.open(o.log);
      if (!log) dml::fail<dml::io_error>(o.log, ": cannot open for writing");
      log << "step,epoch,loss,lr\n";
    }
    std::printf("model: %zu layers, %lld parameters (%lld floats with padding); optimizer %s lr=%g; batch %lld; "
                "%d threads; gemm %s\n",
                sizeof...(L), static_cast<long long>(net.layout().numel), static_cast<long long>(net.layout().total),
                opt.chosen_name(), static_cast<double>(opt.default_lr()), static_cast<long long>(o.batch), dml::thread_budget(),
                std::same_as<Space, dml::host> ? dml::host_gemm_impl().c_str() : "cublasLt");
    std::int64_t step = 0;
    const std::int64_t per_epoch = sampler.batches_per_epoch();
    const std::int64_t planned = planned_steps(o, per_epoch);
    dml::train::progress bar("train", planned, 100);
    double trained = 0;  // seconds in the training loops, the scoring of the test set not counted
    for (std::int64_t epoch = 0; epoch < o.epochs && (o.steps == 0 || step < o.steps); ++epoch) {
      const auto order = sampler.order(static_cast<std::uint64_t>(epoch));
      const double epoch_began = bar.elapsed();
      for (std::int64_t b = 0; b < per_epoch && (o.steps == 0 || step < o.steps); ++b) {
        const auto idx = dml::train::sampler::slice(order, b, o.batch);
        loader.load(train_set, idx);
        ++step;
        const dml::nn::context ctx{.training = true, .seed = o.seed, .step = static_cast<std::uint64_t>(step)};
        auto logits = net.forward(loader.x.cview(), ctx);
        dlogits.resize(logits.shape);
        row_loss.resize(static_cast<std::size_t>(logits.rows()));
        const float loss = loss_fn.forward_backward<Space>(logits, loader.y.data(), dlogits.view(), row_loss.data());
        net.backward(dlogits.cview(), ctx);
        const float lr = learning_rate(o, opt.default_lr(), step, planned);
        dml::optim::update_layout<Space>(opt, {.n = net.layout().total, .w = net.params().data(), .g = net.grads().data(),
                                               .state = state.pointers(), .step = step, .lr = lr}, net.layout());
        if (log) log << step << ',' << epoch << ',' << loss << ',' << lr << '\n';
        bar.update(step, loss, static_cast<std::int64_t>(idx.size()));
      }
      trained += bar.elapsed() - epoch_began;  // each step ends with the loss on the host: the device is done
      const double accuracy = evaluate<Space>(net, test_set);
      std::printf("epoch=%lld steps=%lld seconds=%.3f\ntest_accuracy=%.4f\n", static_cast<long long>(epoch + 1),
                  static_cast<long long>(step), trained, accuracy);
      std::fflush(stdout);
    }
    if (!o.save.empty()) dml::train::save_weights(net, o.save);
    return 0;
  };
  return run(model);
}

// Every rank runs this with its communicator; rank 0 prints and writes files.
template <class Sharding, class Precision, class Comm, class Model>
int run_trainer(const options& o, Comm& comm, Model model, const dml::train::dataset& train_set,
                const dml::train::dataset& test_set) {
  const int rank = comm.rank();
  if (o.dp > 0 && comm.size() != o.pp * o.dp)
    dml::fail<dml::invalid_argument>("expected --pp × --dp = ", o.pp * o.dp, " ranks, found ", comm.size());
  // Pipeline stages share their data-parallel rank's rows (dp rank fastest, as in Megatron).
  const int ranks = comm.size() / o.pp, dp_rank = rank % ranks;
  if (ranks % o.replicas != 0)
    dml::fail<dml::invalid_argument>("--replicas: the ", ranks, " data-parallel ranks form replicas of equal size: "
                                     "expected a divisor of ", ranks, ", found ", o.replicas);
  const any_optimizer opt = make_optimizer(o);
  dml::train::sampler sampler(train_set.size(), o.batch, o.seed, o.shuffle);
  const std::int64_t per_epoch = sampler.batches_per_epoch();
  const std::int64_t planned = planned_steps(o, per_epoch);
  dml::train::trainer_options to;
  to.seed = o.seed;
  to.bucket_mb = o.bucket_mb;
  to.compress = o.compress;
  to.pipeline_stages = o.pp;
  to.micro_batches = o.microbatches;
  to.schedule = o.schedule;
  to.stage_cuts = o.cuts;
  to.recompute = o.recompute;
  if (!o.memory.empty()) to.memory_limit = static_cast<std::int64_t>(dml::parse_bytes(o.memory));
  to.replicas = o.replicas;
  to.offload = o.offload;
  to.trace = o.trace;
  to.lr = [&o, base = opt.default_lr(), planned](std::int64_t s) { return learning_rate(o, base, s, planned); };
  dml::trainer<Sharding, Precision, any_optimizer> trainer(comm, model, to, opt);
  if (!o.init.empty()) {
    std::vector<float> full(static_cast<std::size_t>(trainer.layout().total));
    dml::train::load_weights(trainer.layout(), full, o.init);
    trainer.load_full_parameters(full);
  }
  std::ofstream log;
  if (rank == 0 && !o.log.empty()) {
    log.open(o.log);
    if (!log) dml::fail<dml::io_error>(o.log, ": cannot open for writing");
    log << "step,epoch,loss,lr\n";
  }
  if (rank == 0) {
    const auto mem = trainer.memory();
    const std::string sharding = o.replicas > 1 ? o.parallel + " (hybrid, " + std::to_string(o.replicas) + " replicas)"
                                                : o.parallel;
    std::printf("model: %zu layers, %lld parameters; %s %s on %d %s rank(s), optimizer %s lr=%g, global batch %lld; "
                "per-rank model state (rank 0) %.2f MiB (params %.2f, grads %.2f, optimizer %.2f, buffers %.2f); gemm %s\n",
                Model::size, static_cast<long long>(trainer.layout().numel), sharding.c_str(), Precision::name, comm.size(),
                o.comm.c_str(),
                opt.chosen_name(),
                static_cast<double>(opt.default_lr()), static_cast<long long>(o.batch), mem.total() / 1048576.0,
                mem.params / 1048576.0, mem.grads / 1048576.0, mem.optimizer / 1048576.0, mem.buffers / 1048576.0,
                // On CPUs without 16-bit matmul kernels (AVX2) this says "widened to f32: ...".
                dml::host_gemm_impl(256, 1024, 1024, dml::dtype_v<typename Precision::type>).c_str());
    if (!o.offload.empty())
      std::printf("offload: optimizer state %.2f MiB on disk in %s; optimizer bytes in memory %.2f MiB (two buckets "
                  "of state, and any fp32 master weights not on disk)\n",
                  mem.offloaded / 1048576.0, dml::parallel::offload_directory(o.offload).c_str(), mem.optimizer / 1048576.0);
    if (o.pp > 1 || o.microbatches > 1)
      std::printf("pipeline: %d stage(s) x %d data-parallel rank(s), %lld micro-batch(es), schedule %s%s\n", o.pp,
                  ranks, static_cast<long long>(o.microbatches), o.schedule.empty() ? "default" : o.schedule.c_str(),
                  o.recompute ? ", recompute" : "");
    if (o.print_schedule) std::fputs(dml::schedule::render(trainer.schedule_table(o.microbatches)).c_str(), stdout);
    std::fflush(stdout);
  }
  std::int64_t step = 0, first_epoch = 0;
  if (!o.resume.empty()) {
    // Checkpoints are written at epoch ends: the saved position is the next epoch and the step count.
    const auto meta = trainer.load_checkpoint(o.resume);
    auto number = [&](const char* key) {
      const auto it = meta.find(key);
      if (it == meta.end())
        dml::fail<dml::format_error>(o.resume, ": expected '", key, "' in the checkpoint's metadata, found none");
      return dml::parse_number<std::int64_t>(key, it->second);
    };
    first_epoch = number("epoch");
    step = number("step");
    if (rank == 0) std::printf("resumed from %s at epoch %lld, step %lld\n", o.resume.c_str(),
                               static_cast<long long>(first_epoch), static_cast<long long>(step));
  }
  batch_loader<dml::host> loader;
  dml::train::progress bar("train", planned, 100);
  dml::parallel::wire_bytes bytes{}, run_bytes{};  // of the last step and of the run so far, rank 0's
  double trained = 0;  // seconds in the training loops, the scoring of the test set not counted
  for (std::int64_t epoch = first_epoch; epoch < o.epochs && step < planned; ++epoch) {
    const auto order = sampler.order(static_cast<std::uint64_t>(epoch));
    const double epoch_began = bar.elapsed();
    for (std::int64_t b = 0; b < per_epoch && step < planned; ++b) {
      const auto idx = dml::train::sampler::slice(order, b, o.batch, dp_rank, ranks);
      const std::int64_t global = std::min(o.batch, train_set.size() - b * o.batch);
      loader.load(train_set, idx);
      const auto r = trainer.step(loader.x.cview(), loader.y.data(), global);
      ++step;
      bytes = {r.gradient_bytes, r.dense_gradient_bytes};
      run_bytes.sent += r.gradient_bytes;
      run_bytes.dense += r.dense_gradient_bytes;
      if (rank == 0) {
        if (log) log << step << ',' << epoch << ',' << r.loss << ',' << to.lr(step) << '\n';
        bar.update(step, r.loss, global);
      }
    }
    trained += bar.elapsed() - epoch_began;
    // Every rank scores its slice of each chunk of the test set; the counts are summed.
    std::array<std::int64_t, 1> correct{0};
    std::vector<std::int64_t> all(static_cast<std::size_t>(test_set.size()));
    std::iota(all.begin(), all.end(), std::int64_t{0});
    const std::int64_t chunk = 1000;
    for (std::int64_t c = 0; c * chunk < test_set.size(); ++c) {
      loader.load(test_set, dml::train::sampler::slice(all, c, chunk, dp_rank, ranks));
      correct[0] += trainer.correct(loader.x.cview(), loader.y.data());
    }
    comm.all_reduce(std::span<std::int64_t>(correct), dml::comm::reduce_op::sum);
    if (!o.checkpoint.empty())
      trainer.save_checkpoint(o.checkpoint, {{"epoch", std::to_string(epoch + 1)}, {"step", std::to_string(step)}},
                              o.checkpoint_async ? dml::train::save_mode::async : dml::train::save_mode::sync);
    if (rank == 0) {
      std::printf("epoch=%lld steps=%lld seconds=%.3f\ntest_accuracy=%.4f\n", static_cast<long long>(epoch + 1),
                  static_cast<long long>(step), trained, double(correct[0]) / double(test_set.size()));
      std::printf("compress=%s compressed_bytes_per_step=%lld dense_bytes_per_step=%lld run_bytes=%lld "
                  "dense_run_bytes=%lld\n",
                  o.compress.c_str(), static_cast<long long>(bytes.sent), static_cast<long long>(bytes.dense),
                  static_cast<long long>(run_bytes.sent), static_cast<long long>(run_bytes.dense));
      std::fflush(stdout);
    }
  }
  trainer.wait_checkpoint();  // collective: the last save in the background is complete
  // dml's buffers by category over the run, training and evaluation; the rest of their high-water mark is
  // workspaces and transients.
  if (rank == 0) std::printf("memory per rank (rank 0): %s\n", trainer.memory().by_category().c_str());
  if (!o.trace.empty()) {
    trainer.write_trace();  // collective
    if (rank == 0) std::printf("trace %s\n", o.trace.c_str());
  }
  if (!o.save.empty()) {
    const auto full = trainer.full_parameters();  // collective under zero3
    if (rank == 0) dml::train::save_weights(trainer.layout(), full, o.save);
  }
  return 0;
}

template <class Precision, class Comm, class Model>
int run_sharding(const options& o, Comm& comm, Model model, const dml::train::dataset& tr, const dml::train::dataset& te) {
  // zeroN is always hybrid<zero<N>>: with --replicas 1 that is plain ZeRO, and it keeps the trainers compiled as many.
  using dml::parallel::hybrid, dml::parallel::zero;
  if (o.parallel == "zero1") return run_trainer<hybrid<zero<1>>, Precision>(o, comm, model, tr, te);
  if (o.parallel == "zero2") return run_trainer<hybrid<zero<2>>, Precision>(o, comm, model, tr, te);
  if (o.parallel == "zero3") return run_trainer<hybrid<zero<3>>, Precision>(o, comm, model, tr, te);
  return run_trainer<dml::parallel::replicate, Precision>(o, comm, model, tr, te);
}


// Depths 0 to 3 hidden layers: each is its own static model type, compiled for every sharding.
inline constexpr std::size_t max_hidden = 3;

// The trainers of one communicator and precision: every sharding and depth, 16 engines. A unit that compiles any
// engine also compiles what all engines share (kernels, collectives, checkpoints: about 75 CPU seconds here), so
// the program compiles as two units (CMakeLists.txt): local_engines.cpp's comm::local engines of every precision
// with the MPI ones, and main.cpp with the Gloo ones; the declarations below keep main.cpp's dispatch from
// compiling the comm::local ones a second time.
template <class Precision, class Comm>
int run_engines(const options& o, Comm& comm, const dml::train::dataset& tr, const dml::train::dataset& te) {
  return dml::nn::with_mlp<max_hidden>(tr.features(), o.hidden, 10,
                                       [&](auto model) { return run_sharding<Precision>(o, comm, model, tr, te); });
}
#define DML_FASHION_MNIST_LOCAL_ENGINES(extern_, Precision)                                                         \
  extern_ template int run_engines<Precision, dml::comm::local>(const options&, dml::comm::local&,                  \
                                                                const dml::train::dataset&, const dml::train::dataset&)
#if !defined(__CUDACC__)
DML_FASHION_MNIST_LOCAL_ENGINES(extern, dml::precision::fp32);
DML_FASHION_MNIST_LOCAL_ENGINES(extern, dml::precision::bf16);
DML_FASHION_MNIST_LOCAL_ENGINES(extern, dml::precision::fp16);
#endif

// Dispatches --precision to the engines of Comm.
template <class Comm>
int run_parallel(const options& o, Comm& comm, const dml::train::dataset& tr, const dml::train::dataset& te) {
  if (o.precision == "bf16") return run_engines<dml::precision::bf16>(o, comm, tr, te);
  if (o.precision == "fp16") return run_engines<dml::precision::fp16>(o, comm, tr, te);
  return run_engines<dml::precision::fp32>(o, comm, tr, te);
}

#if defined(DML_EXAMPLE_WITH_MPI)
int run_mpi(const options& o, int argc, char** argv, const dml::train::dataset& tr, const dml::train::dataset& te);
int run_elastic(const options& o, const dml::train::dataset& tr, const dml::train::dataset& te);
#endif
#if defined(DML_EXAMPLE_WITH_GLOO)
int run_gloo(const options& o, const dml::train::dataset& tr, const dml::train::dataset& te);
#endif

// --precision auto: fp32 or bf16, whichever runs a forward and backward of the model over a rank's micro-batch faster
// on this host with --threads threads (dml::cost::probe_precisions), printed before training with both times.
inline options choose_precision(options o, std::int64_t features) {
  if (o.precision != "auto") return o;
#if defined(__CUDACC__)
  (void)features;
  dml::fail<dml::invalid_argument>("--precision auto: expected a host build (it times the host's GEMMs)");
#else
  const int dp = std::max(1, o.ranks / o.pp);
  const std::int64_t rows = std::max<std::int64_t>(1, o.batch / dp / o.microbatches);
  dml::nn::with_mlp<max_hidden>(features, o.hidden, 10, [&](auto model) {
    const auto p = dml::cost::probe_precisions(model, rows, o.threads);
    o.precision = dml::cost::to_string(p.faster);
    std::printf("precision: %s (a forward and backward of %lld rows: fp32 %.3g ms, bf16 %.3g ms; bf16's products %s "
                "here)\n", o.precision.c_str(), static_cast<long long>(rows), 1e3 * p.fp32_seconds,
                1e3 * p.bf16_seconds, dml::host_gemm_native(dml::dtype::bf16) ? "on native kernels" : "widened to f32");
    std::fflush(stdout);
    return 0;
  });
  return o;
#endif
}

template <class Space>
int main(int argc, char** argv) {
  options o;
  auto cli = command_line(o);
  if (const auto status = cli.parse_for_main(argc, argv, [&] { check_across(o); })) return *status;
  try {
    const auto train_set = dml::train::load_mnist(o.data, dml::train::split::train);
    const auto test_set = dml::train::load_mnist(o.data, dml::train::split::test);
    if constexpr (!std::same_as<Space, dml::host>) {
      if (o.ranks != 1 || o.comm != "local" || o.parallel != "ddp" || o.precision != "fp32" || !o.trace.empty())
        dml::fail<dml::invalid_argument>("the CUDA build trains on one GPU in fp32; --ranks, --comm, --parallel, "
                                         "--precision and --trace are for the host build");
      dml::set_thread_budget(o.threads);
      return dml::nn::with_mlp<max_hidden>(train_set.features(), o.hidden, 10,
                                           [&](auto model) { return run_single<Space>(o, model, train_set, test_set); });
    } else {
      if (o.elastic) {
#if defined(DML_EXAMPLE_WITH_GLOO)
        return run_elastic(o, train_set, test_set);
#else
        dml::fail<dml::invalid_argument>("--elastic: this build has no Gloo");
#endif
      }
      if (o.comm == "mpi") {
#if defined(DML_EXAMPLE_WITH_MPI)
        return run_mpi(o, argc, argv, train_set, test_set);
#else
        dml::fail<dml::invalid_argument>("--comm mpi: this build has no MPI");
#endif
      }
      if (o.comm == "gloo") {
#if defined(DML_EXAMPLE_WITH_GLOO)
        return run_gloo(o, train_set, test_set);
#else
        dml::fail<dml::invalid_argument>("--comm gloo: this build has no Gloo");
#endif
      }
      const options chosen = choose_precision(o, train_set.features());
      int status = 0;
      dml::comm::local::run(o.ranks, [&](dml::comm::local& comm) {
        dml::set_thread_budget(o.threads);
        const int s = run_parallel(chosen, comm, train_set, test_set);
        if (comm.rank() == 0) status = s;
      });
      return status;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace fashion_mnist
