// SPDX-License-Identifier: Apache-2.0
// examples/fashion_mnist/main_elastic.cpp — the --elastic path: ranks started by dml-run train data parallel over
// comm::gloo and go on when a rank dies, is frozen or restarts (include/dml/ft/elastic.hpp). The global batch is
// kept: the members of a configuration split each step's samples among themselves.
#include <cstdio>
#include <iostream>

#include "dml/comm/gloo.hpp"
#include "dml/ft/elastic.hpp"
#include "dml/ft/store.hpp"
#include "fashion_mnist.hpp"

#include <gloo/rendezvous/prefix_store.h>

namespace fashion_mnist {

int run_elastic(const options& o, const dml::train::dataset& train_set, const dml::train::dataset& test_set) {
  if (o.parallel != "ddp" || o.precision != "fp32" || o.pp != 1 || o.compress != "none" || !o.offload.empty() ||
      !o.resume.empty() || !o.checkpoint.empty())
    dml::fail<dml::invalid_argument>("--elastic trains ddp in fp32 on one stage, without --compress, --offload, "
                                     "--checkpoint or --resume (found --parallel ", o.parallel, " --precision ",
                                     o.precision, " --pp ", o.pp, ")");
  if (!dml::ft::session_options::in_environment())
    dml::fail<dml::invalid_argument>("--elastic: start the ranks with dml-run (DML_RUN_COORDINATOR is not set)");
  dml::set_thread_budget(o.threads);
  const auto so = dml::ft::session_options::from_environment();
  const auto timeout = std::chrono::milliseconds(o.comm_timeout_ms);
  auto base = std::make_shared<dml::ft::tcp_store>(so.address, so.token, std::chrono::milliseconds(30000));
  dml::ft::session session(so);
  const any_optimizer opt = make_optimizer(o);
  dml::train::sampler sampler(train_set.size(), o.batch, o.seed, o.shuffle);
  const std::int64_t planned = planned_steps(o, sampler.batches_per_epoch());

  return dml::nn::with_mlp<max_hidden>(train_set.features(), o.hidden, 10, [&](auto model) {
    using trainer_t = dml::trainer<dml::parallel::replicate, any_optimizer>;
    batch_loader<dml::host> loader;
    std::vector<std::int64_t> order;  // of the epoch order_epoch
    std::int64_t order_epoch = -1;
    auto make_comm = [&](const dml::ft::quorum& q) {
      auto store = std::make_shared<::gloo::rendezvous::PrefixStore>("epoch-" + std::to_string(q.epoch), *base);
      return std::make_unique<dml::comm::gloo>(store, q.rank, q.size(), dml::comm::gloo_options{.timeout = timeout});
    };
    auto make_trainer = [&](dml::comm::gloo& c, std::function<bool()> commit) {
      dml::train::trainer_options to;
      to.seed = o.seed;
      to.bucket_mb = o.bucket_mb;
      to.commit = std::move(commit);
      to.lr = [&o, base_lr = opt.default_lr(), planned](std::int64_t s) { return learning_rate(o, base_lr, s, planned); };
      return std::make_unique<trainer_t>(c, model, to, opt);
    };
    auto run_step = [&](trainer_t& t, dml::comm::gloo&, std::int64_t step, const dml::ft::quorum& q) {
      // Step `step` of the whole run: its samples depend on the step alone; this member takes its share.
      const std::int64_t per = sampler.batches_per_epoch(), b = step % per;
      if (step / per != order_epoch) {
        order_epoch = step / per;
        order = sampler.order(static_cast<std::uint64_t>(order_epoch));
      }
      const std::int64_t global = std::min(o.batch, train_set.size() - b * o.batch);
      loader.load(train_set, dml::train::sampler::slice(order, b, o.batch, q.rank, q.size()));
      return t.step(loader.x.cview(), loader.y.data(), global);
    };
    // "{slot}" in --commit-log names this rank's own file.
    std::string commit_log = o.commit_log;
    if (const auto at = commit_log.find("{slot}"); at != std::string::npos)
      commit_log.replace(at, 6, std::to_string(so.slot));
    const auto r = dml::ft::train_elastic(session, make_comm, make_trainer, run_step,
                                          {.steps = planned, .commit_log = commit_log, .log = &std::cerr});
    if (r.steps < planned) {
      std::printf("slot %d: the job finished at step %lld without this start\n", so.slot, static_cast<long long>(r.steps));
      return 0;
    }
    // Every member holds the whole model: the first of the last configuration scores the test set alone.
    if (r.rank == 0 && r.state) {
      dml::comm::local::run(1, [&](dml::comm::local& c) {
        dml::trainer<dml::parallel::replicate, any_optimizer> t(c, model, {}, opt);
        t.restore(*r.state);
        std::int64_t correct = 0;
        std::vector<std::int64_t> all(static_cast<std::size_t>(test_set.size()));
        std::iota(all.begin(), all.end(), std::int64_t{0});
        for (std::int64_t c0 = 0; c0 * 1000 < test_set.size(); ++c0) {
          loader.load(test_set, dml::train::sampler::slice(all, c0, 1000));
          correct += t.correct(loader.x.cview(), loader.y.data());
        }
        std::printf("test_accuracy=%.4f\n", double(correct) / double(test_set.size()));
      });
    }
    std::printf("slot=%d steps=%lld configurations=%lld healed=%lld failed_steps=%lld seconds=%.3f final_loss=%.6f state_hash=%016llx\n",
                so.slot, static_cast<long long>(r.steps), static_cast<long long>(r.configurations),
                static_cast<long long>(r.healed), static_cast<long long>(r.failed_steps), r.seconds,
                static_cast<double>(r.losses.empty() ? 0.f : r.losses.back()), static_cast<unsigned long long>(r.hash));
    std::fflush(stdout);
    return 0;
  });
}

}  // namespace fashion_mnist
