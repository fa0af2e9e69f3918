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
  std::int64_t batch = 256, steps = 50, warmup = 5;
  int ranks = 1, threads = 1;
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
    else if (a == "--json") o.json = true;
    else dml::fail<dml::invalid_argument>("unknown flag '", a,
                                          "'; flags: --hidden a,b,c --batch N --steps N --warmup N --ranks 1 "
                                          "--threads N --json");
  }
  if (o.ranks != 1)
    dml::fail<dml::invalid_argument>("--ranks: this build trains on one rank; expected 1, found ", o.ranks);
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  dml::set_thread_budget(o.threads);
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
  const double roofline = gflops * 1e9 / flop_per_sample;
  const double rate = dml::nn::with_mlp(784, o.hidden, 10, [&](auto model) { return samples_per_second(model, o); });
  const std::string isa = dml::host_gemm_impl(o.batch, widest, widest);
  if (o.json) {
    std::printf("{\"impl\":\"dml\",\"ranks\":%d,\"parallel\":\"none\",\"threads\":%d,\"batch\":%lld,\"samples_per_s\":%.1f,"
                "\"gemm_gflops\":%.1f,\"gemm_impl\":\"%s\",\"mflop_per_sample\":%.2f,\"roofline_samples_per_s\":%.1f,"
                "\"roofline_fraction\":%.3f}\n",
                o.ranks, o.threads, static_cast<long long>(o.batch), rate, gflops, isa.c_str(), flop_per_sample / 1e6,
                roofline, rate / roofline);
  } else {
    std::printf("# MLP 784-");
    for (auto h : o.hidden) std::printf("%lld-", static_cast<long long>(h));
    std::printf("10, AdamW, batch %lld, %lld steps after %lld warm-up, %d thread(s)\n", static_cast<long long>(o.batch),
                static_cast<long long>(o.steps), static_cast<long long>(o.warmup), o.threads);
    std::printf("# GEMM %lldx%lldx%lld via oneDNN (%s): %.1f GFLOP/s; %.2f MFLOP per sample -> roofline %.0f samples/s\n",
                static_cast<long long>(o.batch), static_cast<long long>(widest), static_cast<long long>(widest),
                isa.c_str(), gflops, flop_per_sample / 1e6, roofline);
    std::printf("%8s %6s %9s %14s %12s\n", "impl", "ranks", "parallel", "samples/s", "of roofline");
    std::printf("%8s %6d %9s %14.1f %11.1f%%\n", "dml", o.ranks, "none", rate, 100.0 * rate / roofline);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "train_throughput: error: %s\n", e.what());
  return 1;
}
