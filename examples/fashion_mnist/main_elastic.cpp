// SPDX-License-Identifier: Apache-2.0
// examples/fashion_mnist/main_elastic.cpp — the --elastic path: ranks started by dml-run train over comm::gloo and
// go on when a rank dies, is frozen or restarts (include/dml/ft/elastic.hpp). The global batch is kept: the
// members of a configuration split each step's samples among themselves.
//   --parallel ddp on one stage: every member is a replica, and one behind heals from a peer (train_elastic).
//   --parallel zero1-3 or --pp K: members hold parts of the model; each configuration restarts at its own size
//   from the pieces the members and their buddies hold (train_restarting), with the largest number of stages
//   up to K that divides it.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <numeric>

#include "dml/comm/gloo.hpp"
#include "dml/ft/elastic.hpp"
#include "dml/ft/store.hpp"
#include "fashion_mnist.hpp"

namespace fashion_mnist {

namespace {

// What both paths share: the rank's job (session, store, communicators) and each step's samples.
struct elastic_job {
  elastic_job(const options& opts, const dml::train::dataset& train, const dml::train::dataset& test)
      : o(opts), train_set(train), test_set(test) {}
  const options& o;
  const dml::train::dataset& train_set;
  const dml::train::dataset& test_set;
  dml::ft::gloo_job job{std::chrono::milliseconds(o.comm_timeout_ms)};
  any_optimizer opt = make_optimizer(o);
  dml::train::sampler sampler{train_set.size(), o.batch, o.seed, o.shuffle};
  std::int64_t planned = planned_steps(o, sampler.batches_per_epoch());
  batch_loader<dml::host> loader;
  std::vector<std::int64_t> order;  // of the epoch order_epoch
  std::int64_t order_epoch = -1;

  dml::train::trainer_options trainer_options() const {
    dml::train::trainer_options to;
    to.seed = o.seed;
    to.bucket_mb = o.bucket_mb;
    to.lr = [&o = o, base_lr = opt.default_lr(), p = planned](std::int64_t s) { return learning_rate(o, base_lr, s, p); };
    return to;
  }
  // Step `step` of the whole run: its samples depend on the step alone; data rank `rank` of `ranks` takes its share.
  template <class Trainer>
  dml::train::step_result step(Trainer& t, std::int64_t step, int rank, int ranks) {
    const std::int64_t per = sampler.batches_per_epoch(), b = step % per;
    if (step / per != order_epoch) {
      order_epoch = step / per;
      order = sampler.order(static_cast<std::uint64_t>(order_epoch));
    }
    const std::int64_t global = std::min(o.batch, train_set.size() - b * o.batch);
    loader.load(train_set, dml::train::sampler::slice(order, b, o.batch, rank, ranks));
    return t.step(loader.x.cview(), loader.y.data(), global);
  }
  // One member scores the test set alone, on one rank holding the final state: the one the coordinator chose (the
  // first to say it finished holding that state, or another holder if that one dies first).
  template <class Model>
  dml::ft::elastic_options elastic_options(Model model) {
    return {.steps = planned, .commit_log = job.slot_path(o.commit_log), .log = &std::cerr, .copies = o.copies,
            .commit_every = o.commit_every, .report = [this, model](const dml::ft::elastic_result& r) {
              dml::comm::local::run(1, [&](dml::comm::local& c) {
                dml::trainer<dml::parallel::replicate, any_optimizer> t(c, model, {}, opt);
                if (!r.parameters.empty()) t.load_full_parameters(dml::nn::unpack(t.layout(), r.parameters));
                else t.import_pieces(r.pieces);
                std::int64_t correct = 0;
                std::vector<std::int64_t> all(static_cast<std::size_t>(test_set.size()));
                std::iota(all.begin(), all.end(), std::int64_t{0});
                for (std::int64_t c0 = 0; c0 * 1000 < test_set.size(); ++c0) {
                  loader.load(test_set, dml::train::sampler::slice(all, c0, 1000));
                  correct += t.correct(loader.x.cview(), loader.y.data());
                }
                std::printf("test_accuracy=%.4f\n", double(correct) / double(test_set.size()));
                std::fflush(stdout);
              });
            }};
  }
  void finish(const dml::ft::elastic_result& r) {
    if (r.steps < planned)
      std::printf("slot %d: the job finished at step %lld without this start\n", job.slot(), static_cast<long long>(r.steps));
    else
      std::printf("%s\n", dml::ft::summary_line(r, job.slot()).c_str());
    std::fflush(stdout);
  }
};

// Replicas: a member behind the others heals from one at the quorum's step. Under dml-run --groups each group
// is a replica that ZeRO shards inside (hybrid sharding), and a member heals from its place in another group.
template <class Sharding, class Model>
void run_replicas(elastic_job& j, Model model) {
  using trainer_t = dml::trainer<Sharding, any_optimizer>;
  auto make_trainer = [&](dml::comm::gloo& c, const dml::ft::quorum& q, std::function<bool()> commit) {
    auto to = j.trainer_options();
    to.commit = std::move(commit);
    if constexpr (!std::same_as<Sharding, dml::parallel::replicate>) to.replicas = q.size() / q.group;
    return std::make_unique<trainer_t>(c, model, to, j.opt);
  };
  auto run_step = [&](trainer_t& t, dml::comm::gloo&, std::int64_t step, const dml::ft::quorum& q) {
    return j.step(t, step, q.rank, q.size());
  };
  auto make_comm = [&](const dml::ft::quorum& q) { return j.job.make_comm(q); };
  j.finish(dml::ft::train_elastic(j.job.session(), make_comm, make_trainer, run_step, j.elastic_options(model)));
}

// Parts of the model: every configuration restarts at its size, with the most stages up to --pp that divide it.
template <class Sharding, class Model>
void run_parts(elastic_job& j, Model model) {
  using trainer_t = dml::trainer<Sharding, any_optimizer>;
  auto stages = [&](int n) {
    int k = std::min(j.o.pp, n);
    while (n % k != 0) --k;
    return k;
  };
  auto make_trainer = [&](dml::comm::gloo& c, const dml::ft::quorum& q) {
    auto to = j.trainer_options();
    to.pipeline_stages = stages(q.size());
    to.micro_batches = j.o.microbatches;
    to.schedule = j.o.schedule;
    to.recompute = j.o.recompute;
    if (q.rank == 0)
      std::cerr << "slot " << j.job.slot() << ": epoch " << q.epoch << " trains " << j.o.parallel << " on "
                << to.pipeline_stages << " stage(s) x " << q.size() / to.pipeline_stages << " data-parallel rank(s)"
                << std::endl;
    return std::make_unique<trainer_t>(c, model, to, j.opt);
  };
  auto run_step = [&](trainer_t& t, dml::comm::gloo&, std::int64_t step, const dml::ft::quorum& q) {
    const int dp = q.size() / stages(q.size());  // the stages of one data rank take the same rows
    return j.step(t, step, q.rank % dp, dp);
  };
  auto make_comm = [&](const dml::ft::quorum& q) { return j.job.make_comm(q); };
  j.finish(dml::ft::train_restarting(j.job.session(), make_comm, make_trainer, run_step, j.elastic_options(model)));
}

}  // namespace

int run_elastic(const options& o, const dml::train::dataset& train_set, const dml::train::dataset& test_set) {
  if (o.precision != "fp32" || o.compress != "none" || !o.offload.empty() || !o.resume.empty() ||
      !o.checkpoint.empty() || o.replicas != 1 || o.dp != 0 || !o.cuts.empty())
    dml::fail<dml::invalid_argument>("--elastic trains in fp32, without --compress, --offload, --checkpoint, "
                                     "--resume, --replicas, --dp or --cuts (the layout follows the world's size; "
                                     "found --precision ", o.precision, ")");
  const bool launched = dml::ft::session_options::in_environment();
  const int group = launched ? dml::ft::session_options::from_environment().group : 1;
  if (group > 1 && o.pp > 1)
    dml::fail<dml::invalid_argument>("--pp under dml-run --groups: expected one stage (each group holds the whole "
                                     "model), found --pp ", o.pp);
  // A step commits before its update, and nothing after the vote may wait for a peer. Under ZeRO, layer-wise
  // optimizers sum their norms over the shards after it: a failure there would leave a committed step that no
  // member of the group finished. (ZeRO-1/2 gather the updated parts before the next step; ddp needs no sums.)
  if (group > 1 && o.parallel != "ddp" && (o.optimizer == "lamb" || o.optimizer == "lars"))
    dml::fail<dml::invalid_argument>("dml-run --groups trains lamb and lars under ddp only (under ZeRO their norms "
                                     "are summed after the vote, which would split a committed step); found "
                                     "--parallel ", o.parallel, " --optimizer ", o.optimizer);
  if (((o.parallel == "ddp" && o.pp == 1) || group > 1) && (o.commit_every != 1 || o.copies != 1))
    dml::fail<dml::invalid_argument>("--commit-every and --copies apply where members hold parts of the model "
                                     "(--parallel zero1-3 or --pp); under ddp, or in groups that each hold it, every "
                                     "member heals from a peer (found --commit-every ", o.commit_every, " --copies ",
                                     o.copies, ")");
  if (!launched)
    dml::fail<dml::invalid_argument>("--elastic: start the ranks with dml-run (DML_RUN_COORDINATOR is not set)");
  dml::set_thread_budget(o.threads);
  elastic_job j{o, train_set, test_set};
  return dml::nn::with_mlp<max_hidden>(train_set.features(), o.hidden, 10, [&](auto model) {
    // zeroN is hybrid<zero<N>> (plain ZeRO with one replica), as in the other launchers.
    using dml::parallel::hybrid, dml::parallel::zero;
    if (group > 1 && o.parallel == "zero1") run_replicas<hybrid<zero<1>>>(j, model);
    else if (group > 1 && o.parallel == "zero2") run_replicas<hybrid<zero<2>>>(j, model);
    else if (group > 1 && o.parallel == "zero3") run_replicas<hybrid<zero<3>>>(j, model);
    else if (o.parallel == "zero1") run_parts<hybrid<zero<1>>>(j, model);
    else if (o.parallel == "zero2") run_parts<hybrid<zero<2>>>(j, model);
    else if (o.parallel == "zero3") run_parts<hybrid<zero<3>>>(j, model);
    else if (o.pp > 1) run_parts<dml::parallel::replicate>(j, model);
    else run_replicas<dml::parallel::replicate>(j, model);
    return 0;
  });
}

}  // namespace fashion_mnist
