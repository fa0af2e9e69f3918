// SPDX-License-Identifier: Apache-2.0
// benchmarks/train_throughput.cpp — training samples/s of an MLP (AdamW) beside the GEMM roofline of this
// machine, measured in the same run. train_throughput_torch.py runs the same model in PyTorch.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dml/dml.hpp"
#include "dml/plan/calibrate.hpp"

#include "bench_common.hpp"

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

using dml_bench::clock_type;
using dml_bench::seconds_since;
using dml_bench::step_trace;
using dml_bench::synthetic_batch;
using dml_bench::trace_step;

// GFLOP/s of one problem shape on one library (or, for 16-bit inputs, through the dispatch), on
// fresh buffers, over at least 0.2 s; padded: on copies of A and B with longer rows, the copies timed too.
double shape_gflops(const dml::gemm_args& shape, std::optional<dml::host_gemm_library> lib, bool padded = false) {
  const std::int64_t m = shape.m, n = shape.n, k = shape.k;
  const auto elems = [](dml::dtype t, std::int64_t count) { return static_cast<std::size_t>(count) * dml::dtype_size(t); };
  std::vector<std::byte> a(elems(shape.a.type, m * k)), b(elems(shape.a.type, k * n)), c(elems(shape.c.type, m * n)),
      bias(elems(shape.c.type, n));
  dml::gemm_args g = shape;
  g.a.ptr = a.data();
  g.b.ptr = b.data();
  g.c.ptr = c.data();
  g.bias.ptr = shape.bias.ptr ? bias.data() : nullptr;  // types stay the traced call's
  g.lda = shape.ta == dml::trans::n ? k : m;
  g.ldb = shape.tb == dml::trans::n ? n : k;
  g.ldc = n;
  const auto run = [&] { lib ? dml::host_gemm_on(*lib, g, padded) : dml::gemm<dml::host>(g); };
  for (int i = 0; i < 3; ++i) run();
  int iters = 0;
  const auto t0 = clock_type::now();
  while (seconds_since(t0) < 0.2 || iters < 5) {
    run();
    ++iters;
  }
  return 2.0 * double(m) * double(n) * double(k) * iters / seconds_since(t0) / 1e9;
}

// The step's roofline: every traced GEMM at the speed of the fastest library for its shape, nothing
// else taking time. Prints one row per shape: GFLOP/s per library, the dispatch's pick and the
// shape's share of the traced step. Returns the roofline step time on one core.
double gemm_roofline(const step_trace& trace, bool print) {
  using lib = dml::host_gemm_library;
  struct row {
    dml::gemm_call call;
    int calls = 0;
    double seconds = 0;
  };
  std::vector<row> rows;
  for (const auto& c : trace.calls) {
    const auto& g = c.args;
    auto same = [&](const row& r) {
      const auto& h = r.call.args;
      return h.ta == g.ta && h.tb == g.tb && h.m == g.m && h.n == g.n && h.k == g.k && h.a.type == g.a.type &&
             h.c.type == g.c.type && (h.bias.ptr != nullptr) == (g.bias.ptr != nullptr) && h.ep == g.ep &&
             (h.beta != 0.f) == (g.beta != 0.f);
    };
    auto it = std::find_if(rows.begin(), rows.end(), same);
    if (it == rows.end()) it = rows.insert(rows.end(), row{c});
    ++it->calls;
    it->seconds += c.seconds;
  }
  const auto libraries = dml::host_gemm_libraries();
  if (print) {
    std::printf("# host GEMM libraries:");
    for (const auto& [l, name] : libraries) std::printf(" %s = %s;", std::string(dml::to_string(l)).c_str(), name.c_str());
    std::printf("\n# GEMMs of one step (rank 0), GFLOP/s on one core per library (+pad: A and B multiplied from copies with longer rows); the step took %.2f ms\n",
                trace.seconds * 1e3);
    std::printf("%-12s %-16s %-5s %-5s %6s %9s %9s %9s %9s %16s %12s\n", "pass", "m x n x k", "op", "type", "calls",
                "onednn", "sgemm", "openblas", "blis", "used", "step share");
  }
  double roofline = 0;
  for (const auto& r : rows) {
    const auto& g = r.call.args;
    const bool f32 = g.a.type == dml::dtype::f32;
    double best = 0;
    double per_lib[std::size(dml::host_gemm_all_libraries)];  // in the order of the enumeration
    std::fill(std::begin(per_lib), std::end(per_lib), -1.0);
    for (const auto& [l, name] : libraries) {
      if (!f32 && l != lib::onednn) continue;
      // Where rows lie a multiple of 1 KiB apart, the faster of the library's plain and padded runs.
      per_lib[int(l)] = f32 ? shape_gflops(g, l) : shape_gflops(g, std::nullopt);
      if (f32 && dml::detail::host_gemm_strides_conflict(g)) per_lib[int(l)] = std::max(per_lib[int(l)], shape_gflops(g, l, true));
      best = std::max(best, per_lib[int(l)]);
    }
    roofline += r.calls * 2.0 * double(g.m) * double(g.n) * double(g.k) / (best * 1e9);
    if (!print) continue;
    // nn::linear's three products: y = x·Wᵀ, dx = dy·W, dW = dyᵀ·x.
    const char* pass = g.ta == dml::trans::n && g.tb == dml::trans::t   ? "forward"
                       : g.ta == dml::trans::n && g.tb == dml::trans::n ? "input grad"
                       : g.ta == dml::trans::t && g.tb == dml::trans::n ? "weight grad"
                                                                         : "other";
    char shape[48], op[8];
    std::snprintf(shape, sizeof shape, "%lldx%lldx%lld", static_cast<long long>(g.m), static_cast<long long>(g.n),
                  static_cast<long long>(g.k));
    std::snprintf(op, sizeof op, "%c%c", g.ta == dml::trans::n ? 'N' : 'T', g.tb == dml::trans::n ? 'N' : 'T');
    const std::string used = (r.call.native ? "" : "w:") + std::string(dml::to_string(r.call.library)) +
                             (r.call.padded ? "+pad" : "");
    std::printf("%-12s %-16s %-5s %-5s %6d", pass, shape, op, std::string(dml::dtype_name(g.a.type)).c_str(), r.calls);
    for (double v : per_lib) v < 0 ? std::printf(" %9s", "-") : std::printf(" %9.1f", v);
    std::printf(" %16s %11.1f%%\n", used.c_str(), 100.0 * r.seconds / trace.seconds);
  }
  if (print) {
    double gemm_seconds = 0;
    for (const auto& r : rows) gemm_seconds += r.seconds;
    std::printf("# GEMMs took %.1f%% of the step; at the best library's speed they would take %.2f ms\n",
                100.0 * gemm_seconds / trace.seconds, roofline * 1e3);
  }
  return roofline;
}

// Milliseconds of a weight gradient accumulated into (dW[out, in] += dyᵀ·x over `rows` rows) on one library, timed as
// the dispatch's choice times it (detail::host_gemm_time: A, B and C flushed from the caches before each call, as a
// step finds them a micro-batch after the last one; the median of eight calls).
double cold_accumulate_ms(dml::host_gemm_library lib, std::int64_t out, std::int64_t in, std::int64_t rows) {
  std::vector<float> dy(static_cast<std::size_t>(rows * out), 0.5f), x(static_cast<std::size_t>(rows * in), 0.25f),
      dw(static_cast<std::size_t>(out * in));
  const dml::gemm_args g{.ta = dml::trans::t, .m = out, .n = in, .k = rows, .a = dy.data(), .lda = out, .b = x.data(),
                         .ldb = in, .c = dw.data(), .ldc = in, .beta = 1.f};
  return dml::detail::host_gemm_time({lib, false}, g) * 1e3;
}

// Seconds of the optimizer's update as a roofline counts it: AdamW's streams over n parameters (the parameter,
// gradient and two moments read; the parameter and moments written: cost::update_bytes_per_param's 28 bytes) with
// none of its arithmetic, on fresh arrays out of the caches, the median of 7 passes on this thread.
double update_floor_seconds(std::int64_t n) {
  const auto size = static_cast<std::size_t>(n);
  std::vector<float> w(size, 0.5f), g(size, 0.25f), m(size, 0.f), v(size, 0.f);
  std::vector<double> seconds;
  for (int r = 0; r < 7; ++r) {
    const auto t0 = clock_type::now();
    dml::for_each_index<dml::host>(n, [w = w.data(), g = g.data(), m = m.data(), v = v.data()](std::int64_t i) {
      const float gi = g[i];
      m[i] += gi;
      v[i] += gi * gi;
      w[i] -= m[i];
    });
    seconds.push_back(seconds_since(t0));
  }
  std::nth_element(seconds.begin(), seconds.begin() + 3, seconds.end());
  return seconds[3];
}

template <class... L>
double samples_per_second(const dml::nn::sequential<L...>& model, const options& o, step_trace& trace) {
  dml::nn::network<dml::host, L...> net(model, 1);
  const dml::optim::adamw opt;
  dml::optim::state<dml::optim::adamw> state(net.layout().total);
  dml::nn::softmax_cross_entropy loss_fn;
  const std::int64_t in = 784;
  std::vector<float> x;
  std::vector<std::int32_t> y;
  synthetic_batch(o.batch, 0, x, y);
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
  trace = trace_step([&] { step(o.warmup + 1); });
  const auto t0 = clock_type::now();
  for (std::int64_t s = 2; s <= o.steps + 1; ++s) step(o.warmup + s);
  return double(o.steps * o.batch) / seconds_since(t0);
}

struct parallel_result {
  double samples_per_s = 0;
  dml::train::memory_report memory;
  double hidden_fraction = -1;  // share of gradient communication overlapped with backward
  step_trace trace;             // rank 0's GEMMs in one step
};

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
  step_trace trace = trace_step([&] { t.step(xv, y.data(), global); });
  if (comm.rank() != 0) trace.calls.clear();
  comm.barrier();
  const auto t0 = clock_type::now();
  for (std::int64_t s = 0; s < o.steps; ++s) t.step(xv, y.data(), global);
  comm.barrier();
  const double secs = seconds_since(t0);
  parallel_result r{.samples_per_s = double(o.steps * global) / secs, .memory = t.memory(), .trace = trace};
  r.hidden_fraction = dml::train::hidden_communication(t.events(), o.warmup + 1);
  return r;
}

// The command line (dml/train/flags.hpp).
dml::flags command_line(options& o) {
  dml::flags f("train_throughput", "Samples/s of an MLP, bare and through the trainer, beside the GEMM roofline.");
  f.add("--hidden", o.hidden, "W,W", "hidden layer widths").min(1);
  f.add("--batch", o.batch, "N", "rows per rank per step").min(1);
  f.add("--steps", o.steps, "N", "timed steps").min(1);
  f.add("--warmup", o.warmup, "N", "untimed steps first").min(0);
  f.add("--ranks", o.ranks, "N", "comm::local ranks, with --parallel").min(1);
  f.add("--threads", o.threads, "N", "threads per rank").min(1);
  f.add("--parallel", o.parallel, "P", "none: the bare network; else the trainer with this sharding")
      .choices({"none", "ddp", "zero1", "zero2", "zero3"});
  f.add("--precision", o.precision, "P",
        "arithmetic; bf16 and fp16 with --parallel; auto: fp32 or bf16, whichever runs a forward and backward of the "
        "model faster here (dml::cost::probe_precisions, as fashion_mnist --precision auto)")
      .choices({"fp32", "bf16", "fp16", "auto"});
  f.add("--bucket-mb", o.bucket_mb, "X", "gradient bucket size in MB")
      .check([](double mb) { return mb > 0 ? std::string() : "a size > 0"; }, "> 0");
  f.add_switch("--json", o.json, "print one JSON object per result too");
  return f;
}

void check_across(const options& o) {
  if (o.parallel == "none" && o.precision != "fp32")
    dml::fail<dml::invalid_argument>("--precision ", o.precision, " runs through the trainer: add --parallel ddp");
  if (o.parallel == "none" && o.ranks != 1)
    dml::fail<dml::invalid_argument>("--ranks ", o.ranks, " needs --parallel ddp|zero1|zero2|zero3");
}

}  // namespace

int main(int argc, char** argv) try {
  options o;
  auto cli = command_line(o);
  if (const auto status = dml_bench::parse_for_main(cli, argc, argv, [&] { check_across(o); })) return *status;
  // 2 FLOPs per multiply-add forward, 4 backward (input and weight gradients): 6 per weight per sample.
  double weights = 0, biases = 10;
  std::int64_t width = 784;
  for (auto h : o.hidden) {
    weights += double(width) * double(h);
    biases += double(h);
    width = h;
  }
  weights += double(width) * 10.0;
  const double params = weights + biases;
  const double flop_per_sample = 6.0 * weights;
  if (o.precision == "auto") {
    const auto p = dml::nn::with_mlp(784, o.hidden, 10, [&](auto model) {
      return dml::cost::probe_precisions(model, o.batch, o.threads);
    });
    o.precision = dml::cost::to_string(p.faster);
    if (!o.json)
      std::printf("# precision auto: %s (a forward and backward of %lld rows: fp32 %.3g ms, bf16 %.3g ms; bf16's "
                  "products %s here)\n", o.precision.c_str(), static_cast<long long>(o.batch), 1e3 * p.fp32_seconds,
                  1e3 * p.bf16_seconds, dml::host_gemm_native(dml::dtype::bf16) ? "on native kernels" : "widened to f32");
  }
  double rate = 0;
  parallel_result pr;
  if (o.parallel == "none") {
    dml::set_thread_budget(o.threads);
    rate = dml::nn::with_mlp(784, o.hidden, 10, [&](auto model) { return samples_per_second(model, o, pr.trace); });
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
  if (!o.json) {
    std::printf("# %s; MLP 784-", dml::host_cpu_model().c_str());
    for (auto h : o.hidden) std::printf("%lld-", static_cast<long long>(h));
    std::printf("10, AdamW, batch %lld per rank, %lld steps after %lld warm-up, %d rank(s) x %d thread(s)\n",
                static_cast<long long>(o.batch), static_cast<long long>(o.steps), static_cast<long long>(o.warmup),
                o.ranks, o.threads);
  }
  // The roofline is measured per core after the run, then counts every core the run uses.
  dml::set_thread_budget(1);
  const double roofline_step = gemm_roofline(pr.trace, !o.json);
  if (!o.json && o.precision == "fp32" && o.batch >= 2) {
    // What gradient accumulation over two micro-batches asks of the widest hidden layer's weight gradient.
    const std::int64_t h = *std::max_element(o.hidden.begin(), o.hidden.end()), rows = o.batch / 2;
    std::printf("# weight gradient accumulated (beta = 1) with C out of cache, %lldx%lld over %lld rows, one core:",
                static_cast<long long>(h), static_cast<long long>(h), static_cast<long long>(rows));
    for (const auto& [l, name] : dml::host_gemm_libraries())
      std::printf(" %s %.3f ms;", std::string(dml::to_string(l)).c_str(), cold_accumulate_ms(l, h, h, rows));
    std::printf("\n");
  }
  // One rank's update streams its parameters once a step: no schedule of its GEMMs hides that on its core.
  const double update_floor = o.ranks == 1 && o.threads == 1 ? update_floor_seconds(static_cast<std::int64_t>(params)) : 0;
  const double gflops = flop_per_sample * double(o.batch) / roofline_step / 1e9;  // the step's effective rate
  const double roofline = double(o.batch) / roofline_step * o.ranks * o.threads;
  const std::string isa = dml::host_gemm_impl(o.batch, width, width, o.precision == "fp32" ? dml::dtype::f32
                                                                     : o.precision == "bf16" ? dml::dtype::bf16
                                                                                             : dml::dtype::f16);
  if (o.json) {
    std::printf("{\"impl\":\"dml\",\"cpu\":\"%s\",\"ranks\":%d,\"parallel\":\"%s\",\"precision\":\"%s\",\"threads\":%d,"
                "\"batch_per_rank\":%lld,\"samples_per_s\":%.1f,\"gemm_gflops\":%.1f,\"gemm_impl\":\"%s\","
                "\"mflop_per_sample\":%.2f,\"roofline_samples_per_s\":%.1f,\"roofline_fraction\":%.3f,"
                "\"model_state_bytes_per_rank\":%lld,\"hidden_comm_fraction\":%.3f,\"update_floor_ms\":%.3f}\n",
                dml::host_cpu_model().c_str(), o.ranks, o.parallel.c_str(), o.precision.c_str(), o.threads,
                static_cast<long long>(o.batch), rate, gflops, isa.c_str(), flop_per_sample / 1e6, roofline,
                rate / roofline, static_cast<long long>(pr.memory.total()), pr.hidden_fraction, update_floor * 1e3);
  } else {
    std::printf("# %.2f MFLOP per sample at %.1f GFLOP/s (the step's GEMMs at their best library, one core; oneDNN "
                "kernel %s) -> roofline %.0f samples/s on the cores this run uses\n",
                flop_per_sample / 1e6, gflops, isa.c_str(), roofline);
    if (update_floor > 0)
      std::printf("# the update's streams (%.3gM parameters x 28 bytes, none of AdamW's arithmetic, out of cache) take "
                  "%.2f ms on this core (%.1f GB/s): GEMMs at their best and the update at that rate -> roofline %.0f "
                  "samples/s, which dml reaches %.1f%% of; the update alone caps the GEMM-only fraction at %.1f%%\n",
                  params / 1e6, update_floor * 1e3, 28 * params / update_floor / 1e9,
                  double(o.batch) / (roofline_step + update_floor), 100.0 * rate * (roofline_step + update_floor) / double(o.batch),
                  100.0 * roofline_step / (roofline_step + update_floor));
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
