// SPDX-License-Identifier: Apache-2.0
// benchmarks/train_throughput.cpp — training samples/s of an MLP (AdamW) beside the GEMM roofline of this
// machine, measured in the same run. train_throughput_torch.py runs the same model in PyTorch.
#include <chrono>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "dml/dml.hpp"

namespace {

struct options {
  std::vector<std::int64_t> hidden{1024, 1024, 1024};
  std::int64_t batch = 256, steps = 50, warmup = 5;  // batch: rows per rank per step
  int ranks = 1, threads = 1;
  std::string parallel = "none";  // none: one network, no communicator; else ddp | zero1 | zero2 | zero3
  std::string precision = "fp32";
  double bucket_mb = 25.0;
  bool json = false;
};

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

// GFLOP/s of the GEMM dispatch on the model's largest forward GEMM.
double gemm_gflops(std::int64_t m, std::int64_t n, std::int64_t k) {
  std::vector<float> a(static_cast<std::size_t>(m * k), 0.5f), b(static_cast<std::size_t>(k * n), 0.25f),
      c(static_cast<std::size_t>(m * n));
  const dml::gemm_args g{.ta = dml::trans::n, .tb = dml::trans::t, .m = m, .n = n, .k = k, .a = a.data(), .lda = k,
                         .b = b.data(), .ldb = k, .c = c.data(), .ldc = n};
  for (int i = 0; i < 5; ++i) dml::gemm<dml::host>(g);
  int iters = 0;
  const auto t0 = clock_type::now();
  while (seconds_since(t0) < 1.0 || iters < 10) {
    dml::gemm<dml::host>(g);
    ++iters;
  }
  return 2.0 * double(m) * double(n) * double(k) * iters / seconds_since(t0) / 1e9;
}

template <class... L>
double samples_per_second(const dml::nn::sequential<L...>& model, const options& o) {
  dml::nn::network<dml::host, L...> net(model, 1);
  const dml::optim::adamw opt;
  dml::optim::state<dml::optim::adamw> state(net.layout().total);
  dml::nn::softmax_cross_entropy loss_fn;
  const std::int64_t in = 784;
  std::vector<float> x(static_cast<std::size_t>(o.batch * in));
  std::vector<std::int32_t> y(static_cast<std::size_t>(o.batch));
  const dml::rng_stream rng{42, 0};
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = rng.uniform(i);
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(rng.block(1u << 30 | i)[0] % 10);
  dml::tensor<float> dlogits({o.batch, 10});
  std::vector<float> row_loss(static_cast<std::size_t>(o.batch));
  auto step = [&](std::int64_t s) {
    auto logits = net.forward(dml::tensor_view<const float>(x.data(), {o.batch, in}));
    loss_fn.forward_backward<dml::host>(logits, y.data(), dlogits.view(), row_loss.data());
    net.backward(dlogits.cview());
    opt.update<dml::host>({.n = net.layout().total, .w = net.params().data(), .g = net.grads().data(),
                           .state = state.pointers(), .step = s, .lr = 1e-3f});
  };
  for (std::int64_t s = 1; s <= o.warmup; ++s) step(s);
  const auto t0 = clock_type::now();
  for (std::int64_t s = 1; s <= o.steps; ++s) step(o.warmup + s);
  return double(o.steps * o.batch) / seconds_since(t0);
}

struct parallel_result {
  double samples_per_s = 0;
  dml::train::memory_report memory;
  double hidden_fraction = -1;  // share of gradient communication overlapped with backward
};

// Synthetic rows for one rank (the same generator as the single-network path).
void synthetic_batch(std::int64_t batch, int rank, std::vector<float>& x, std::vector<std::int32_t>& y) {
  x.resize(static_cast<std::size_t>(batch * 784));
  y.resize(static_cast<std::size_t>(batch));
  const dml::rng_stream rng{42, static_cast<std::uint64_t>(rank)};
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = rng.uniform(i);
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(rng.block(1u << 30 | i)[0] % 10);
}

// Steps a trainer; returns wall-clock samples/s over all ranks (rank 0's clock, between barriers).
template <class Sharding, class Precision, class Model>
parallel_result run_trainer(dml::comm::local& comm, const Model& model, const options& o) {
  dml::train::trainer_options to;
  to.seed = 1;
  to.bucket_mb = o.bucket_mb;
  to.record_events = true;
  dml::trainer<Sharding, Precision, dml::optim::adamw> t(comm, model, to);
  std::vector<float> x;
  std::vector<std::int32_t> y;
  synthetic_batch(o.batch, comm.rank(), x, y);
  const dml::tensor_view<const float> xv(x.data(), {o.batch, 784});
  const std::int64_t global = o.batch * comm.size();
  for (std::int64_t s = 0; s < o.warmup; ++s) t.step(xv, y.data(), global);
  comm.barrier();
  const auto t0 = clock_type::now();
  for (std::int64_t s = 0; s < o.steps; ++s) t.step(xv, y.data(), global);
  comm.barrier();
  const double secs = seconds_since(t0);
  parallel_result r{.samples_per_s = double(o.steps * global) / secs, .memory = t.memory()};
  r.hidden_fraction = dml::train::hidden_communication(t.events(), o.warmup);
  return r;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto next = [&] {
      if (i + 1 >= argc) dml::fail<dml::invalid_argument>(a, ": expected a value");
      return std::string(argv[++i]);
    };
    if (a == "--hidden") {
      o.hidden.clear();
      const std::string v = next();
      for (std::size_t pos = 0; pos < v.size();) {
        const std::size_t comma = std::min(v.find(',', pos), v.size());
        o.hidden.push_back(std::stoll(v.substr(pos, comma - pos)));
        pos = comma + 1;
      }
    } else if (a == "--batch") o.batch = std::stoll(next());
    else if (a == "--steps") o.steps = std::stoll(next());
    else if (a == "--warmup") o.warmup = std::stoll(next());
    else if (a == "--ranks") o.ranks = std::stoi(next());
    else if (a == "--threads") o.threads = std::stoi(next());
    else if (a == "--parallel") o.parallel = next();
    else if (a == "--precision") o.precision = next();
    else if (a == "--bucket-mb") o.bucket_mb = std::stod(next());
    else if (a == "--json") o.json = true;
    else dml::fail<dml::invalid_argument>("unknown flag '", a,
                                          "'; flags: --hidden a,b,c --batch N (per rank) --steps N --warmup N "
                                          "--ranks N --parallel none|ddp|zero1|zero2|zero3 --precision fp32 "
                                          "--bucket-mb X --threads N (per rank) --json");
  }
  if (o.precision != "fp32" && o.precision != "bf16" && o.precision != "fp16")
    dml::fail<dml::invalid_argument>("--precision: expected fp32, bf16 or fp16, found '", o.precision, "'");
  if (o.parallel == "none" && o.precision != "fp32")
    dml::fail<dml::invalid_argument>("--precision ", o.precision, " runs through the trainer: add --parallel ddp");
  if (o.parallel == "none" && o.ranks != 1)
    dml::fail<dml::invalid_argument>("--ranks ", o.ranks, " needs --parallel ddp|zero1|zero2|zero3");
  if (o.parallel != "none" && o.parallel != "ddp" && o.parallel != "zero1" && o.parallel != "zero2" &&
      o.parallel != "zero3")
    dml::fail<dml::invalid_argument>("--parallel: expected none, ddp, zero1, zero2 or zero3, found '", o.parallel, "'");
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  dml::set_thread_budget(1);  // the roofline is per core; the run below uses ranks x threads cores
  // 2 FLOPs per multiply-add forward, 4 backward (input and weight gradients): 6 per weight per sample.
  double weights = 0;
  std::int64_t width = 784;
  for (auto h : o.hidden) {
    weights += double(width) * double(h);
    width = h;
  }
  weights += double(width) * 10.0;
  const double flop_per_sample = 6.0 * weights;
  const std::int64_t widest = *std::max_element(o.hidden.begin(), o.hidden.end());
  const double gflops = gemm_gflops(o.batch, widest, widest);
  double roofline = gflops * 1e9 / flop_per_sample;
  const std::string isa = dml::host_gemm_impl(o.batch, widest, widest);
  double rate = 0;
  parallel_result pr;
  if (o.parallel == "none") {
    dml::set_thread_budget(o.threads);
    rate = dml::nn::with_mlp(784, o.hidden, 10, [&](auto model) { return samples_per_second(model, o); });
  } else {
    dml::comm::local::run(o.ranks, [&](dml::comm::local& comm) {
      dml::set_thread_budget(o.threads);
      auto by_sharding = [&]<class P>(auto model) {
        if (o.parallel == "zero1") return run_trainer<dml::parallel::zero<1>, P>(comm, model, o);
        if (o.parallel == "zero2") return run_trainer<dml::parallel::zero<2>, P>(comm, model, o);
        if (o.parallel == "zero3") return run_trainer<dml::parallel::zero<3>, P>(comm, model, o);
        return run_trainer<dml::parallel::replicate, P>(comm, model, o);
      };
      auto r = dml::nn::with_mlp(784, o.hidden, 10, [&](auto model) {
        if (o.precision == "bf16") return by_sharding.template operator()<dml::precision::bf16>(model);
        if (o.precision == "fp16") return by_sharding.template operator()<dml::precision::fp16>(model);
        return by_sharding.template operator()<dml::precision::fp32>(model);
      });
      if (comm.rank() == 0) pr = r;
    });
    rate = pr.samples_per_s;
  }
  // The roofline counts every core the run uses.
  roofline *= o.ranks * o.threads;
  if (o.json) {
    std::printf("{\"impl\":\"dml\",\"ranks\":%d,\"parallel\":\"%s\",\"precision\":\"%s\",\"threads\":%d,"
                "\"batch_per_rank\":%lld,\"samples_per_s\":%.1f,\"gemm_gflops\":%.1f,\"gemm_impl\":\"%s\","
                "\"mflop_per_sample\":%.2f,\"roofline_samples_per_s\":%.1f,\"roofline_fraction\":%.3f,"
                "\"model_state_bytes_per_rank\":%lld,\"hidden_comm_fraction\":%.3f}\n",
                o.ranks, o.parallel.c_str(), o.precision.c_str(), o.threads, static_cast<long long>(o.batch), rate, gflops,
                isa.c_str(), flop_per_sample / 1e6, roofline, rate / roofline,
                static_cast<long long>(pr.memory.total()), pr.hidden_fraction);
  } else {
    std::printf("# MLP 784-");
    for (auto h : o.hidden) std::printf("%lld-", static_cast<long long>(h));
    std::printf("10, AdamW, batch %lld per rank, %lld steps after %lld warm-up, %d rank(s) x %d thread(s)\n",
                static_cast<long long>(o.batch), static_cast<long long>(o.steps), static_cast<long long>(o.warmup),
                o.ranks, o.threads);
    std::printf("# GEMM %lldx%lldx%lld via oneDNN (%s), one core: %.1f GFLOP/s; %.2f MFLOP per sample -> roofline "
                "%.0f samples/s on the cores this run uses\n",
                static_cast<long long>(o.batch), static_cast<long long>(widest), static_cast<long long>(widest),
                isa.c_str(), gflops, flop_per_sample / 1e6, roofline);
    std::printf("%8s %6s %9s %10s %14s %12s %16s %12s\n", "impl", "ranks", "parallel", "precision", "samples/s",
                "of roofline", "state B/rank", "comm hidden");
    std::printf("%8s %6d %9s %10s %14.1f %11.1f%% %16lld %12s\n", "dml", o.ranks, o.parallel.c_str(),
                o.precision.c_str(), rate, 100.0 * rate / roofline, static_cast<long long>(pr.memory.total()),
                pr.hidden_fraction < 0 ? "-" : (std::to_string(int(100 * pr.hidden_fraction + 0.5)) + "%").c_str());
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "train_throughput: error: %s\n", e.what());
  return 1;
}
