// SPDX-License-Identifier: Apache-2.0
// tests/train/checkpoint_crash.cpp — trains two comm::local ranks and saves a checkpoint after every step;
// checkpoint_crash.py kills it with SIGKILL while a checkpoint is being written and checks that the next
// run resumes from the last complete one with the losses of an uninterrupted run.
// Usage: train_checkpoint_crash DIR STEPS [async]   (DIR "-": no checkpoints, the reference run)
// Prints "resumed S" (steps already done), "loss S <hex float>", "save S begin" / "save S end" (async: the save
// runs behind the next steps, and "end" comes once latest names it).
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "dml/dml.hpp"

namespace {

constexpr std::int64_t features = 256, classes = 10, samples = 2048, global_batch = 32;

void say(const char* fmt, long long s, double v = 0) {
  std::printf(fmt, s, v);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace dml;
  if (argc != 3 && !(argc == 4 && std::string(argv[3]) == "async")) {
    std::fprintf(stderr, "usage: %s DIR|- STEPS [async]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const long long steps = std::atoll(argv[2]);
  const auto mode = argc == 4 ? train::save_mode::async : train::save_mode::sync;
  const bool save = dir != "-";
  std::vector<float> x(samples * features);
  std::vector<std::int32_t> y(samples);
  const rng_stream rng{11, 3};
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = rng.normal(i);
  for (std::int64_t s = 0; s < samples; ++s)
    y[static_cast<std::size_t>(s)] = static_cast<std::int32_t>((x[static_cast<std::size_t>(s * features)] > 0) + 2 * (s % 5));
  int status = 0;
  comm::local::run(2, [&](comm::local& comm) {
    // About 0.5 M parameters: with AdamW's two state slots a checkpoint is about 6 MB, so a save
    // takes long enough to be interrupted at many different points.
    auto model = nn::sequential{nn::linear{features, 768}, nn::relu{}, nn::layernorm{768}, nn::linear{768, 384},
                                nn::gelu{}, nn::linear{384, classes}};
    train::trainer_options opt;
    opt.seed = 17;
    opt.lr = [](std::int64_t step) { return step < 10 ? 1e-4f * float(step + 1) : 1e-3f; };
    opt.clip_norm = 1.0f;
    trainer<parallel::zero<1>, optim::adamw> t(comm, model, opt);
    long long done = 0;
    if (save && std::filesystem::exists(std::filesystem::path(dir) / "latest")) {
      const auto meta = t.load_checkpoint(dir);
      done = std::stoll(meta.at("step"));
      if (done != t.steps()) {
        std::fprintf(stderr, "the checkpoint's user step %lld differs from the trainer's %lld\n", done,
                     static_cast<long long>(t.steps()));
        status = 1;
        return;
      }
    }
    if (comm.rank() == 0) say("resumed %lld\n", done);
    train::sampler sampler(samples, global_batch, 23);
    std::vector<float> xb;
    std::vector<std::int32_t> yb;
    long long unseen = 0;  // a save whose end is not yet printed
    const auto ended = [&](bool done_now) {
      if (comm.rank() == 0 && unseen != 0 && (done_now || !t.checkpoint_pending())) {
        say("save %lld end\n", unseen);
        unseen = 0;
      }
    };
    for (long long s = done; s < steps; ++s) {
      const std::int64_t rows = sampler.gather(s, comm.rank(), comm.size(), x.data(), features, y.data(), xb, yb);
      const auto r = t.step(tensor_view<const float>(xb.data(), {rows, features}), yb.data(), global_batch);
      if (comm.rank() == 0) say("loss %lld %a\n", s, static_cast<double>(r.loss));
      if (!save) continue;
      ended(false);
      if (comm.rank() == 0) say("save %lld begin\n", s + 1);
      t.save_checkpoint(dir, {{"step", std::to_string(s + 1)}}, mode);
      ended(true);  // the save before has finished
      unseen = s + 1;
      ended(mode == train::save_mode::sync);
    }
    t.wait_checkpoint();
    ended(true);
  });
  return status;
}
