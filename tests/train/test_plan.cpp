// SPDX-License-Identifier: Apache-2.0
// tests/train/test_plan.cpp — kinds of parallelism as types (parallel/plan.hpp) and parallelize()
// (parallel/parallelize.hpp): a trainer given a plan trains exactly as the sharding-and-options façade does;
// one binary sweeps degrees; a degree above 1 for a kind the plan lacks, or options that contradict it, fail
// in one line naming the fix; parallelize() places a model by itself (its part, chunks, groups and program
// are the trainer's); and ZeRO-2/3's per-micro-batch residency on pipelines trains to one rank's losses and
// holds less than per-step residency.
#include <doctest/doctest.h>

#include <string>

#include "gpt_fixture.hpp"

namespace test_plan {

using namespace gpt_fixture;
namespace pl = dml::parallel;

namespace {

template <class... P>
result run(const layout& l, const nn::gpt_config& g, std::int64_t micro = 2) {
  result out;
  comm::local::run(l.size(), [&](comm::local& c) {
    auto r = train_gpt<P...>(c, l, g, 3, micro);
    if (c.rank() == 0) out = std::move(r);
  });
  return out;
}

void check_equal(const result& a, const result& b) {
  REQUIRE(a.losses.size() == b.losses.size());
  for (std::size_t i = 0; i < a.losses.size(); ++i) CHECK(a.losses[i] == b.losses[i]);
  CHECK(a.params == b.params);
}

std::string error_of(const layout& l, auto make) {
  std::string what;
  try {
    comm::local::run(l.size(), [&](comm::local& c) { make(c); });
  } catch (const dml::error& e) {
    what = e.what();
  }
  return what;
}

}  // namespace

TEST_CASE("a plan trains exactly as the façade with the same sharding, schedule and degrees") {
  const auto g = compose_config(true, true);
  using full = pl::plan<pl::data<pl::hybrid<pl::zero<3>>>, pl::pipe<schedule::zero_bubble>,
                        pl::tensor<pl::sequence_parallel>, pl::experts, pl::context<>>;
  // One binary, several degrees: the plan's kinds are open, their degrees come from the options.
  for (const layout& l : {layout{.pp = 2, .dp = 2}, layout{.tp = 2, .dp = 2, .sp = true},
                          layout{.dp = 4, .ep = 2, .replicas = 2}, layout{.dp = 4, .cp = 2}}) {
    INFO(l.name());
    check_equal(run<full, optim::adamw>(l, g), run<pl::hybrid<pl::zero<3>>, schedule::zero_bubble, optim::adamw>(l, g));
  }
  using pipe_only = pl::plan<pl::pipe<schedule::one_f_one_b>, pl::data<pl::zero<1>>>;  // any order
  const layout l{.pp = 2, .dp = 2};
  check_equal(run<pipe_only, optim::adamw>(l, g), run<pl::zero<1>, schedule::one_f_one_b, optim::adamw>(l, g));
}

TEST_CASE("a degree above 1 for a kind the plan lacks fails, naming the kind and the fix") {
  const auto model = nn::gpt(compose_config(false, true));
  auto with = [&]<class P>(P, train::trainer_options o, int ranks) {
    return error_of(layout{.dp = ranks}, [&](comm::local& c) { trainer<P> t(c, model, o); });
  };
  using dp_only = pl::plan<pl::data<pl::zero<2>>>;
  auto e = with(dp_only{}, {.pipeline_stages = 2}, 2);
  CHECK(e.find("the mesh has pp 2") != std::string::npos);
  CHECK(e.find("no parallel::pipe<Schedule>; add it to the plan or make pp 1") != std::string::npos);
  CHECK(with(dp_only{}, {.tensor_parallel = 2}, 2).find("no parallel::tensor<>") != std::string::npos);
  CHECK(with(dp_only{}, {.expert_parallel = 2}, 2).find("no parallel::experts") != std::string::npos);
  CHECK(with(dp_only{}, {.context_parallel = 2}, 2).find("no parallel::context<>") != std::string::npos);
  CHECK(with(pl::plan<pl::pipe<>>{}, {.pipeline_stages = 2}, 4).find("the mesh has dp 2") != std::string::npos);
  CHECK(with(dp_only{}, {.replicas = 2}, 2).find("replicas 2 needs hybrid sharding") != std::string::npos);
  using tp = pl::plan<pl::data<>, pl::tensor<>>;
  CHECK(with(tp{}, {.tensor_parallel = 2, .sequence_parallel = true}, 2)
            .find("name parallel::tensor<parallel::sequence_parallel> in the plan") != std::string::npos);
  using cp = pl::plan<pl::data<>, pl::context<pl::zigzag>>;
  CHECK(with(cp{}, {.context_parallel = 2, .cp_zigzag = false}, 2)
            .find("name parallel::context<parallel::contiguous> in the plan") != std::string::npos);
  CHECK(with(cp{}, {.context_parallel = 2, .cp_all_gather = true}, 2)
            .find("name parallel::context<Order, parallel::all_gather> in the plan") != std::string::npos);
  CHECK(with(pl::plan<pl::data<>, pl::context<pl::zigzag, pl::all_gather>>{}, {.context_parallel = 2}, 2) == "");
  // The kinds a plan names may still run at degree 1.
  CHECK(with(pl::plan<pl::data<>, pl::pipe<>, pl::tensor<>, pl::experts, pl::context<>>{}, {}, 2) == "");
}

TEST_CASE("parallelize places a model by itself: the trainer's part, chunks, groups and program") {
  const auto model = nn::gpt(compose_config(true, false));
  using P = pl::plan<pl::data<pl::zero<3>>, pl::pipe<schedule::interleaved<2>>, pl::tensor<>>;
  comm::local::run(8, [&](comm::local& c) {
    auto placed = pl::parallelize(pl::mesh<comm::local>(c, {.tp = 2, .dp = 2, .pp = 2}), model, P{},
                                  {.micro_batches = 4, .streams_gradients = true});
    CHECK(placed.shape() == pl::mesh_shape{.tp = 2, .dp = 2, .pp = 2});
    CHECK(placed.chunks().size() == 2);  // interleaved:2: two chunks per rank
    CHECK(placed.per_step());            // a pipeline reduces per step unless asked otherwise
    REQUIRE(placed.tensor() != nullptr);
    CHECK(placed.tensor()->size() == 2);
    CHECK(placed.pipe() != nullptr);
    CHECK(placed.shards().dense.size() == 2);
    train::trainer_options o{.micro_batches = 4, .pipeline_stages = 2, .tensor_parallel = 2};
    trainer<P> t(c, model, o);
    CHECK(t.program(4) == placed.program(4, true));  // the model ties its head to the embedding
    CHECK(t.layout().total == nn::make_layout(model, t.layout().padding_unit).total);
  });
  // Without a mesh, the world is one data-parallel group and nothing is split off.
  comm::local::run(2, [&](comm::local& c) {
    auto placed = pl::parallelize(c, model, pl::plan<pl::data<pl::zero<2>>>{}, {.streams_gradients = true});
    CHECK(placed.mesh() == nullptr);
    CHECK(placed.data().size() == 2);
    CHECK(!placed.per_step());  // one stage, backward whole: ZeRO-2 streams per micro-batch
    CHECK(placed.tensor() == nullptr);
  });
}

TEST_CASE("ZeRO-2/3 with per-micro-batch residency on a pipeline: one rank's losses, less memory") {
  const auto g = compose_config(false, false);
  const auto ref = run<pl::replicate, optim::adamw>(layout{}, g, 4);
  for (const std::string s : {"gpipe", "1f1b", "interleaved:2"}) {
    const layout l{.pp = 2, .dp = 2, .schedule = s, .micro_batch_residency = true};
    INFO(s);
    check_same(ref, run<pl::zero<3>, optim::adamw>(l, g, 4), "zero3 per micro-batch " + s);
    check_same(ref, run<pl::zero<2>, optim::adamw>(l, g, 4), "zero2 per micro-batch " + s);
  }
  // The model state each holds on rank 0 of pp2·dp2 (16 blocks, buckets of one block), next to ZeRO-1's.
  // Per step, ZeRO-3 holds its stage's whole parameters while resident beside its shard: ZeRO-1's bytes and
  // the shard. Per micro-batch it holds two staging and two gathered buckets instead of whole gradients and
  // parameters.
  const auto deep = config(16, 0.f);
  auto memory = [&]<class S>(S, bool micro) {
    train::memory_report m;
    comm::local::run(4, [&](comm::local& c) {
      trainer<S> t(c, nn::gpt(deep), {.bucket_mb = 0.01, .micro_batches = 4, .pipeline_stages = 2,
                                      .micro_batch_residency = micro});
      const auto r = t.memory();
      if (c.rank() == 0) m = r;
    });
    return m;
  };
  const auto z1 = memory(pl::zero<1>{}, false), z3_step = memory(pl::zero<3>{}, false), z3_micro = memory(pl::zero<3>{}, true);
  MESSAGE("pp2·dp2 rank 0 model state bytes: zero1 ", z1.total(), ", zero3 per step ", z3_step.total(),
          ", zero3 per micro-batch ", z3_micro.total());
  CHECK(z3_step.buffers == z1.params);  // the resident chunk: the stage's whole parameters
  CHECK(z3_step.total() == z1.total() + z3_step.params);
  CHECK(z3_micro.grads * 3 == z1.grads);  // the shard, against ZeRO-1's whole gradients and their shard
  CHECK(z3_micro.total() < z1.total());
}

namespace {
// comm::local seen as a communicator without tags, as comm::nccl is: messages between two ranks match in the
// order they are sent.
struct tagless : comm::local {
  static constexpr bool has_tags = false;
  explicit tagless(comm::local c) : comm::local(std::move(c)) {}
  tagless split(int color, int key) { return tagless(comm::local::split(color, key)); }
};
static_assert(comm::communicator<tagless> && !comm::matches_tags<tagless> && comm::matches_tags<comm::local>);
}  // namespace

TEST_CASE("a communicator without tags refuses a schedule that reorders the messages between two ranks") {
  const auto model = nn::gpt(compose_config(true, false));
  using P = pl::plan<pl::data<pl::replicate>, pl::pipe<schedule::interleaved<2>>>;
  const auto place = [&](std::int64_t micro) {
    std::string what;
    comm::local::run(2, [&](comm::local& c) {
      tagless world(std::move(c));
      auto placed = pl::parallelize(pl::mesh<tagless>(world, {.pp = 2}), model, P{}, {.micro_batches = micro});
      try {
        (void)placed.program(micro, false);
      } catch (const dml::invalid_argument& e) {
        if (world.rank() == 0) what = e.what();
      }
    });
    return what;
  };
  // Interleaving on 2 ranks keeps the order for 4 micro-batches, not for 5 (tests/parallel/test_schedule.cpp).
  CHECK(place(4).empty());
  CHECK(place(5).find("this communicator matches the messages between two ranks in the order they are sent (it has "
                      "no tags), and the schedule for 5 micro-batches reorders them: rank 0 sends RG0.0's message as "
                      "its 7th to rank 1") != std::string::npos);
}

}  // namespace test_plan
