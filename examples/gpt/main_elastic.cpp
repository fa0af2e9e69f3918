// SPDX-License-Identifier: Apache-2.0
// examples/gpt/main_elastic.cpp — the --elastic path: ranks started by dml-run train the GPT over comm::gloo and go
// on when a rank dies, is frozen or restarts. Tensor-parallel ranks hold parts of every layer, so each
// configuration restarts at its own size (ft::train_restarting): the most tensor-parallel ranks up to --tp that
// divide the members (and the heads), the rest data parallel, from the state copies the members hold for each
// other. Batches follow the step, and the global batch is kept.
#include <cstdio>
#include <iostream>

#include "dml/ft/elastic.hpp"
#include "dml/ft/store.hpp"
#include "train_gpt.hpp"

namespace gpt_example {

namespace {

template <class Sharding>
int run_restarting(const options& o, const corpus& text) {
  using trainer_t = dml::trainer<Sharding, dml::optim::adamw>;
  dml::ft::gloo_job job{std::chrono::milliseconds(o.comm_timeout_ms)};
  const auto model = dml::nn::gpt(model_config(o));
  // The tensor-parallel ranks of a configuration of n: the most up to --tp that split n, the heads and the MLP.
  auto tensor_ranks = [&](int n) {
    int t = std::min(o.tp, n);
    while (n % t != 0 || o.heads % t != 0 || (4 * o.d_model) % t != 0) --t;
    return t;
  };
  auto make_trainer = [&](dml::comm::gloo& c, const dml::ft::quorum& q) {
    dml::train::trainer_options to;
    to.seed = o.seed;
    to.clip_norm = o.clip;
    to.tensor_parallel = tensor_ranks(q.size());
    to.sequence_parallel = o.sp && to.tensor_parallel > 1;
    to.lr = [&o](std::int64_t s) { return learning_rate(o, s); };
    if (q.rank == 0)
      std::cerr << "slot " << job.slot() << ": epoch " << q.epoch << " trains " << o.parallel << " on tp "
                << to.tensor_parallel << " x dp " << q.size() / to.tensor_parallel << std::endl;
    return std::make_unique<trainer_t>(c, model, to, dml::optim::adamw({.lr = o.lr}));
  };
  std::vector<float> x;
  std::vector<std::int32_t> y;
  auto run_step = [&](trainer_t& t, dml::comm::gloo&, std::int64_t step, const dml::ft::quorum& q) {
    // World rank = tp rank + TP · dp rank: a tensor group passes one data rank's rows.
    const int tp = tensor_ranks(q.size()), dp = q.size() / tp, data_rank = q.rank / tp;
    const std::int64_t first = o.batch * data_rank / dp, rows = o.batch * (data_rank + 1) / dp - first;
    x.resize(static_cast<std::size_t>(rows * o.seq));
    y.resize(x.size());
    text.train.batch(o.seed, static_cast<std::uint64_t>(step + 1), first, rows, o.seq, x.data(), y.data());
    return t.step(dml::tensor_view<const float>(x.data(), {rows, o.seq}), y.data(), o.batch);
  };
  auto make_comm = [&](const dml::ft::quorum& q) { return job.make_comm(q); };
  const auto r = dml::ft::train_restarting(job.session(), make_comm, make_trainer, run_step,
                                           {.steps = o.steps, .commit_log = job.slot_path(o.commit_log),
                                            .log = &std::cerr, .copies = o.copies, .commit_every = o.commit_every});
  if (r.steps < o.steps)
    std::printf("slot %d: the job finished at step %lld without this start\n", job.slot(), static_cast<long long>(r.steps));
  else
    std::printf("%s\n", dml::ft::summary_line(r, job.slot()).c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace

int run_elastic(const options& o, const corpus& text) {
  if (o.precision != "fp32" || o.pp != 1 || o.ep != 1 || o.cp != 1 || o.dp != 0 || o.replicas != 1 ||
      o.experts != 0 || !o.offload.empty() || !o.resume.empty() || !o.checkpoint.empty() || o.plan != "manual")
    dml::fail<dml::invalid_argument>("--elastic trains in fp32 over tensor and data parallelism (--tp, --parallel), "
                                     "without --pp, --ep, --cp, --dp, --replicas, --experts, --offload, --checkpoint, "
                                     "--resume or --plan auto (found --precision ", o.precision, " --pp ", o.pp, ")");
  if (!dml::ft::session_options::in_environment())
    dml::fail<dml::invalid_argument>("--elastic: start the ranks with dml-run (DML_RUN_COORDINATOR is not set)");
  dml::set_thread_budget(o.threads);
  using dml::parallel::zero;
  if (o.parallel == "zero1") return run_restarting<zero<1>>(o, text);
  if (o.parallel == "zero2") return run_restarting<zero<2>>(o, text);
  if (o.parallel == "zero3") return run_restarting<zero<3>>(o, text);
  return run_restarting<dml::parallel::replicate>(o, text);
}

}  // namespace gpt_example
