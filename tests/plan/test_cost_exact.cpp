// SPDX-License-Identifier: Apache-2.0
// tests/plan/test_cost_exact.cpp — dml::cost's bytes for layouts dml runs here equal the trainer's, on every rank:
// model states (memory(), from allocated sizes; ZeRO's staging, gather and resident buffers included) and peak
// activation bytes, for MLPs and the GPT under replicate and ZeRO-1/2/3, fp32 and bf16, AdamW and SGD, dp × tp × sp,
// pipelines (every schedule, recompute), experts (ep, tied or not) and context parallelism; nn::llama (grouped-query
// heads, SwiGLU, RMSNorm, tied or not) under tp, sp, pipelines and ZeRO-3, its counts and the Llama 3 presets.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <utility>

#include "../train/gpt_fixture.hpp"
#include "dml/plan/exact.hpp"

namespace test_cost_exact {

namespace {

using namespace dml;

struct observed {
  train::memory_report memory;
  std::int64_t activations = 0;
  train::memory_report built;  // right after construction
};

// memory().allocated, counted as buffers are allocated and freed (core/buffer.hpp's memory_account): after
// construction, the model states but what the first step allocates; after the steps, the model states but ZeRO-3's
// resident chunks, the activation storage kept and the step's buffers; at the most, all of them at once.
// transient: what a step holds for a while beyond that (pipelines: cost::pipeline_transient_peak), or the float sum
// of a tied parameter's gradient pieces (want.tie_sum, after the backward passes), whichever is larger.
void check_allocated(const observed& got, const cost::state_bytes& want, std::int64_t held, std::int64_t step,
                     std::int64_t transient = 0) {
  CHECK(got.built.allocated == want.total() - want.aside - want.resident);
  CHECK(got.memory.allocated == want.total() - want.resident + held + step);
  CHECK(got.memory.allocated_peak == want.total() + held + step + std::max(transient, want.tie_sum));
}

// Every rank's memory() and activation peak after `steps` steps on rows of rows_shape (a GPT takes token ids and
// a label per token); global: the global batch.
template <class... P, class Model>
std::vector<observed> run_ranks(const Model& model, int ranks, train::trainer_options o, dml::shape rows_shape,
                                std::int64_t global, int steps = 1) {
  std::vector<observed> out(static_cast<std::size_t>(ranks));
  comm::local::run(ranks, [&](comm::local& c) {
    trainer<P...> t(c, model, o);
    const auto built = t.memory();
    std::vector<float> x(static_cast<std::size_t>(rows_shape.numel()));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7);
    constexpr bool per_token = std::is_same_v<Model, nn::gpt_model> || std::is_same_v<Model, nn::llama_model>;
    const std::int64_t labels = per_token ? rows_shape.numel() : rows_shape[0];
    std::vector<std::int32_t> y(static_cast<std::size_t>(labels));
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(i % 5);
    for (int s = 0; s < steps; ++s) t.step(tensor_view<const float>(x.data(), rows_shape), y.data(), global);
    out[static_cast<std::size_t>(c.rank())] = {t.memory(), t.peak_activation_bytes(), built};
  });
  return out;
}

template <class... P, class Model>
observed run(const Model& model, int ranks, train::trainer_options o, dml::shape rows_shape, int steps = 1) {
  return run_ranks<P...>(model, ranks, o, rows_shape, rows_shape[0] * (ranks / o.tensor_parallel), steps)[0];
}

template <class Sharding>
constexpr int zero_stage = std::is_same_v<Sharding, parallel::replicate> ? 0
                         : std::is_same_v<Sharding, parallel::zero<1>>   ? 1
                         : std::is_same_v<Sharding, parallel::zero<2>>   ? 2 : 3;

void check_states(const train::memory_report& got, const cost::state_bytes& want) {
  CHECK(got.numel == want.numel);
  CHECK(got.padded == want.padded);
  CHECK(got.params == want.params);
  CHECK(got.grads == want.grads);
  CHECK(got.optimizer == want.optimizer);
  CHECK(got.buffers == want.buffers);
}

template <class Sharding, class Precision, class Opt>
void check_mlp(int ranks) {
  constexpr int zero = zero_stage<Sharding>;
  const auto model = nn::sequential{nn::linear{24, 40}, nn::relu{}, nn::layernorm{40}, nn::linear{40, 24}, nn::gelu{},
                                    nn::linear{24, 5}};
  const std::int64_t w = std::is_same_v<Precision, precision::fp32> ? 4 : 2;
  const int slots = Opt::state_slots;
  const auto got = run<Sharding, Precision, Opt>(model, ranks, {}, {8, 24});
  const auto want = cost::model_states(model, {.zero = zero, .shards = {ranks, ranks}, .working_bytes = w, .slots = slots,
                                                .per_step = zero < 2});
  CAPTURE(zero);
  CAPTURE(ranks);
  CAPTURE(w);
  CAPTURE(slots);
  check_states(got.memory, want);
  CHECK(got.activations == cost::activation_set_bytes(model, {8, 24}, w));
  const std::vector<nn::layer_range> whole{{0, model.depth()}};
  check_allocated(got, want, got.activations,
                  cost::step_buffers(model, schedule::make("gpipe", 1, 1), 0, whole, {8, 24}, w));
  CHECK(got.memory.activations == got.activations);
}

}  // namespace

TEST_CASE("model states and activations of the trainer tests' MLP equal the cost model, byte for byte") {
  for (int n : {1, 2, 4}) {
    check_mlp<parallel::replicate, precision::fp32, optim::adamw>(n);
    check_mlp<parallel::zero<1>, precision::fp32, optim::adamw>(n);
    check_mlp<parallel::zero<2>, precision::fp32, optim::adamw>(n);
    check_mlp<parallel::zero<3>, precision::fp32, optim::adamw>(n);
    check_mlp<parallel::replicate, precision::bf16, optim::adamw>(n);
    check_mlp<parallel::zero<1>, precision::bf16, optim::adamw>(n);
    check_mlp<parallel::zero<2>, precision::bf16, optim::sgd>(n);
    check_mlp<parallel::zero<3>, precision::bf16, optim::adamw>(n);
    check_mlp<parallel::zero<1>, precision::fp32, optim::sgd>(n);
  }
}

TEST_CASE("the GPT's activation bytes (tp 1, tp 2, tp 2 + sp) follow from the layers' shapes") {
  using gpt_fixture::batch;
  using gpt_fixture::seq;
  auto split = [](nn::gpt_config g, int tp, bool sp) {
    auto m = nn::gpt(g);
    if (tp > 1) nn::set_tensor_split(m, {.ranks = tp, .rank = 0, .sequence = sp});
    return m;
  };
  const auto g = gpt_fixture::config(2);
  CHECK(cost::activation_set_bytes(split(g, 1, false), {batch, seq}, 4) == 582'656);
  CHECK(cost::activation_set_bytes(split(g, 2, false), {batch, seq}, 4) == 375'808);
  CHECK(cost::activation_set_bytes(split(g, 2, true), {batch, seq}, 4) == 307'712);
}

TEST_CASE("the GPT under dp × tp × sp, ZeRO and bf16: the trainer's memory() and peak activations equal the cost model") {
  using gpt_fixture::batch;
  using gpt_fixture::seq;
  struct lay {
    int tp, dp;
    bool sp;
  };
  const auto g = gpt_fixture::config(2, 0.f);
  for (const lay l : {lay{1, 1, false}, lay{2, 1, false}, lay{2, 1, true}, lay{1, 2, false}, lay{2, 2, true}, lay{4, 1, true}}) {
    CAPTURE(l.tp);
    CAPTURE(l.dp);
    CAPTURE(l.sp);
    train::trainer_options o;
    o.tensor_parallel = l.tp;
    o.sequence_parallel = l.sp;
    auto part = nn::gpt(g);
    if (l.tp > 1) nn::set_tensor_split(part, {.ranks = l.tp, .rank = 0, .sequence = l.sp});
    const dml::shape rows{batch / l.dp, seq};
    const auto model = nn::gpt(g);
    const std::vector<nn::layer_range> whole{{0, part.depth()}};
    const auto one_stage = schedule::make("gpipe", 1, 1);
    {
      const auto got = run<parallel::replicate, optim::adamw>(model, l.tp * l.dp, o, rows);
      const auto want = cost::model_states(part, {.zero = 0, .shards = {l.dp, l.dp}});
      CHECK(got.memory.padded == want.padded);
      CHECK(got.memory.params + got.memory.grads + got.memory.optimizer == want.params + want.grads + want.optimizer);
      CHECK(got.activations == cost::activation_set_bytes(part, rows, 4));
      check_allocated(got, want, got.activations, cost::step_buffers(part, one_stage, 0, whole, rows, 4, l.tp));
    }
    {
      const auto got = run<parallel::zero<2>, precision::bf16, optim::adamw>(model, l.tp * l.dp, o, rows);
      const auto want = cost::model_states(part, {.zero = 2, .shards = {l.dp, l.dp}, .working_bytes = 2});
      check_states(got.memory, want);
      CHECK(got.activations == cost::activation_set_bytes(part, rows, 2));
      check_allocated(got, want, got.activations, cost::step_buffers(part, one_stage, 0, whole, rows, 2, l.tp));
    }
  }
}

namespace {

// Ten layers, eight of them places to cut (two relus are fused into the linears before them): enough chunks for
// four stages, or two stages of two interleaved chunks.
auto deep_mlp() {
  return nn::sequential{nn::linear{24, 40}, nn::relu{},      nn::layernorm{40}, nn::linear{40, 40}, nn::gelu{},
                        nn::linear{40, 32}, nn::relu{},      nn::linear{32, 24}, nn::gelu{},        nn::linear{24, 5}};
}

// One pipeline layout of pp stages × dp ranks (stage = rank / dp, data-parallel rank fastest), m micro-batches of
// 8 rows per data-parallel rank: every rank's memory() and activation peak against the cost model.
template <class Sharding, class Precision = precision::fp32>
void check_pipeline(const std::string& sched, int pp, int dp, bool recompute, bool residency = false, std::int64_t m = 4) {
  const auto model = deep_mlp();
  constexpr std::int64_t w = std::is_same_v<Precision, precision::fp32> ? 4 : 2, rows = 8;
  train::trainer_options o;
  o.pipeline_stages = pp;
  o.schedule = sched;
  o.micro_batches = m;
  o.recompute = recompute;
  o.micro_batch_residency = residency;
  // Two steps: the second starts with all a step keeps allocated, so its transients set the high-water mark.
  const auto got = run_ranks<Sharding, Precision, optim::adamw>(model, pp * dp, o, {rows, 24}, rows * dp, 2);
  const auto table = schedule::make(sched, pp, static_cast<int>(m));
  const bool per_step = zero_stage<Sharding> < 2 || !residency || schedule::splits_backward(table);
  for (int r = 0; r < pp * dp; ++r) {
    const int stage = r / dp;
    const auto chunks = cost::stage_chunks(model, pp, table.virtual_stages, stage);
    const auto want = cost::model_states(model, {.zero = zero_stage<Sharding>, .shards = {dp, dp}, .working_bytes = w,
                                                 .slots = 2, .per_step = per_step, .micro_batches = m, .chunks = chunks,
                                                 .table = &table, .pp_rank = stage});
    CAPTURE(sched);
    CAPTURE(pp);
    CAPTURE(dp);
    CAPTURE(recompute);
    CAPTURE(residency);
    CAPTURE(zero_stage<Sharding>);
    CAPTURE(w);
    CAPTURE(r);
    check_states(got[static_cast<std::size_t>(r)].memory, want);
    CHECK(got[static_cast<std::size_t>(r)].activations ==
          cost::pipeline_activation_peak(model, table, stage, chunks, {rows, 24}, w, recompute));
    const auto held = cost::pipeline_activation_storage(model, table, stage, chunks, {rows, 24}, w, recompute);
    CHECK(got[static_cast<std::size_t>(r)].memory.activations_held == held);
    check_allocated(got[static_cast<std::size_t>(r)], want, held, cost::step_buffers(model, table, stage, chunks, {rows, 24}, w),
                    cost::pipeline_transient_peak(model, table, stage, chunks, {rows, 24}, w, recompute));
  }
}

template <class Sharding, class Precision = precision::fp32>
void check_pipelines() {
  struct shape {
    std::string sched;
    int pp, dp;
  };
  for (const shape& l : {shape{"gpipe", 2, 2}, shape{"1f1b", 2, 2}, shape{"1f1b", 4, 1}, shape{"interleaved:2", 2, 1},
                         shape{"zb", 2, 2}})
    for (bool recompute : {false, true}) check_pipeline<Sharding, Precision>(l.sched, l.pp, l.dp, recompute);
}

}  // namespace

TEST_CASE("pipelines: every rank's model states, ZeRO buffers and activation peak equal the cost model") {
  check_pipelines<parallel::replicate>();
  check_pipelines<parallel::zero<1>>();
  check_pipelines<parallel::zero<2>>();
  check_pipelines<parallel::zero<3>>();
  check_pipelines<parallel::zero<3>, precision::bf16>();
  check_pipelines<parallel::replicate, precision::bf16>();
  // ZeRO-2/3 reducing (and gathering) per micro-batch on a pipeline: staging and gather buffers instead.
  for (std::string sched : {"1f1b", "interleaved:2", "zb"}) {
    check_pipeline<parallel::zero<2>>(sched, 2, 1, false, true);
    check_pipeline<parallel::zero<3>>(sched, 2, 1, false, true);
  }
}

TEST_CASE("ZeRO's staging, gather and aside buffers on one stage, over many buckets and micro-batches") {
  const auto model = deep_mlp();
  for (std::int64_t m : {1, 3})
    for (double bucket_mb : {25.0, 0.004}) {  // 0.004 MiB: 1,048 floats, so several buckets
      train::trainer_options o;
      o.micro_batches = m;
      o.bucket_mb = bucket_mb;
      CAPTURE(m);
      CAPTURE(bucket_mb);
      auto want = [&](int zero, std::int64_t w) {
        return cost::model_states(model, {.zero = zero, .shards = {2, 2}, .working_bytes = w, .per_step = zero < 2,
                                          .micro_batches = m, .bucket_mb = bucket_mb});
      };
      check_states(run<parallel::zero<2>, optim::adamw>(model, 2, o, {12, 24}).memory, want(2, 4));
      check_states(run<parallel::zero<3>, optim::adamw>(model, 2, o, {12, 24}).memory, want(3, 4));
      check_states(run<parallel::zero<3>, precision::bf16, optim::adamw>(model, 2, o, {12, 24}).memory, want(3, 2));
      check_states(run<parallel::zero<1>, optim::adamw>(model, 2, o, {12, 24}).memory, want(1, 4));
    }
}

namespace {

// A GPT of four blocks over dp data-parallel ranks, ep of them sharing out its experts or cp of them each holding
// a chunk of every sequence: every rank's memory() and activation peak against the cost model.
template <class Sharding, class Precision = precision::fp32>
void check_gpt(const nn::gpt_config& g, int dp, int ep, int cp) {
  using gpt_fixture::batch;
  using gpt_fixture::seq;
  constexpr std::int64_t w = std::is_same_v<Precision, precision::fp32> ? 4 : 2;
  train::trainer_options o;
  o.expert_parallel = ep;
  o.context_parallel = cp;
  const std::int64_t rows = batch / (dp / cp);
  const auto got = run_ranks<Sharding, Precision, optim::adamw>(nn::gpt(g), dp, o, {rows, seq}, batch);
  for (int r = 0; r < dp; ++r) {
    auto part = nn::gpt(g);
    nn::set_expert_split(part, ep, r % ep, dp);  // the capacity counts the data group's tokens
    if (cp > 1) nn::set_context_split(part, {.ranks = cp, .rank = r % cp, .zigzag = true});
    const auto want = cost::model_states(part, {.zero = zero_stage<Sharding>, .shards = {dp, dp / ep}, .working_bytes = w,
                                                .per_step = zero_stage<Sharding> < 2});
    CAPTURE(dp);
    CAPTURE(ep);
    CAPTURE(cp);
    CAPTURE(g.tie_weights);
    CAPTURE(zero_stage<Sharding>);
    CAPTURE(w);
    CAPTURE(r);
    check_states(got[static_cast<std::size_t>(r)].memory, want);
    CHECK(got[static_cast<std::size_t>(r)].activations == cost::activation_set_bytes(part, {rows, seq}, w));
    const std::vector<nn::layer_range> whole{{0, part.depth()}};
    check_allocated(got[static_cast<std::size_t>(r)], want, got[static_cast<std::size_t>(r)].activations,
                    cost::step_buffers(part, schedule::make("gpipe", 1, 1), 0, whole, {rows, seq}, w));
  }
}

template <class Sharding, class Precision = precision::fp32>
void check_experts(bool tied) {
  const auto g = gpt_fixture::compose_config(tied, true);
  check_gpt<Sharding, Precision>(g, 2, 2, 1);
  check_gpt<Sharding, Precision>(g, 4, 2, 1);
  check_gpt<Sharding, Precision>(g, 4, 4, 1);
}

}  // namespace

TEST_CASE("experts (ep 2 and 4, tied embeddings or not): every rank's bytes equal the cost model") {
  for (bool tied : {false, true}) {
    check_experts<parallel::replicate>(tied);
    check_experts<parallel::zero<1>>(tied);
    check_experts<parallel::zero<2>>(tied);
    check_experts<parallel::zero<3>>(tied);
    check_experts<parallel::zero<3>, precision::bf16>(tied);
  }
}

TEST_CASE("context parallelism (cp 2 and 4): every rank's bytes equal the cost model") {
  const auto g = gpt_fixture::compose_config(false, false);
  for (int cp : {2, 4}) {
    check_gpt<parallel::replicate>(g, 4, 1, cp);
    check_gpt<parallel::zero<2>>(g, 4, 1, cp);
    check_gpt<parallel::zero<3>, precision::bf16>(g, 4, 1, cp);
  }
}

namespace {

// The largest rank's bytes of a layout of `model` (nn::gpt or nn::llama, sequences of seq tokens) as the trainer
// holds them after a step, against cost::evaluate_dml's; limit: trainer_options::memory_limit.
template <class Sharding, class Precision, class Model>
cost::bytes held(const Model& model, std::int64_t seq, const cost::layout& l, std::int64_t batch, std::int64_t limit = 0) {
  train::trainer_options o;
  o.memory_limit = limit;
  o.tensor_parallel = l.tp;
  o.sequence_parallel = l.sp;
  o.pipeline_stages = l.pp;
  o.schedule = l.schedule;
  o.micro_batches = l.micro_batches;
  o.recompute = l.recomp == cost::recompute::full;
  o.expert_parallel = l.ep;
  o.context_parallel = l.cp;
  o.cp_all_gather = l.cp_all_gather;
  o.replicas = l.replicas;
  const auto got = run_ranks<Sharding, Precision, optim::adamw>(model, l.devices(), o, {batch / (l.dp / l.cp), seq}, batch);
  cost::bytes most;
  for (const auto& r : got) {
    const bool mixed = !std::is_same_v<Precision, precision::fp32>;
    const double master = mixed ? static_cast<double>(r.memory.optimizer) / 3 : 0;  // AdamW: 2 slots + master
    const cost::bytes b{.params = static_cast<double>(r.memory.params), .grads = static_cast<double>(r.memory.grads),
                        .optimizer = static_cast<double>(r.memory.optimizer) - master, .master = master,
                        .activations = static_cast<double>(r.activations), .buffers = static_cast<double>(r.memory.buffers),
                        .workspace = static_cast<double>(r.memory.allocated_peak - r.memory.total() - r.activations)};
    if (b.total() > most.total()) most = b;
  }
  return most;
}

template <class Precision>
cost::bytes held(const nn::gpt_config& g, const cost::layout& l, std::int64_t batch, std::int64_t limit = 0) {
  switch (l.zero) {
    case 0: return held<parallel::replicate, Precision>(nn::gpt(g), g.seq, l, batch, limit);
    case 1: return held<parallel::hybrid<parallel::zero<1>>, Precision>(nn::gpt(g), g.seq, l, batch, limit);
    case 2: return held<parallel::hybrid<parallel::zero<2>>, Precision>(nn::gpt(g), g.seq, l, batch, limit);
    default: return held<parallel::hybrid<parallel::zero<3>>, Precision>(nn::gpt(g), g.seq, l, batch, limit);
  }
}

void check_held(const cost::bytes& got, const cost::estimate& e) {
  CHECK(got.params == e.per_rank.params);
  CHECK(got.grads == e.per_rank.grads);
  CHECK(got.optimizer == e.per_rank.optimizer);
  CHECK(got.master == e.per_rank.master);
  CHECK(got.activations == e.per_rank.activations);
  CHECK(got.buffers == e.per_rank.buffers);
  CHECK(got.workspace == e.per_rank.workspace);
}

}  // namespace

TEST_CASE("cost::evaluate_dml: a GPT layout's largest rank holds what the cost model says, category by category") {
  constexpr std::int64_t batch = 8;
  const cost::model dense{.layers = 4, .d_model = 32, .heads = 4, .seq = 16, .vocab = 32};
  auto moe = dense;
  moe.experts = 4;
  moe.moe_every = 2;
  struct lay {
    const cost::model* m;
    const char* layout;
    cost::precision p;
    float dropout;
  };
  for (const lay& c : {lay{&dense, "dp=4", cost::precision::fp32, 0.1f},
                       lay{&dense, "dp=2,zero=2", cost::precision::bf16, 0.f},
                       lay{&dense, "dp=2,schedule=gpipe,mb=4", cost::precision::fp32, 0.f},  // 4 sets on one stage
                       lay{&dense, "dp=2,tp=2,sp=1,zero=3", cost::precision::fp32, 0.f},
                       lay{&dense, "dp=2,pp=2,zero=1,mb=4", cost::precision::fp32, 0.1f},
                       lay{&dense, "pp=2,schedule=gpipe,mb=4,recompute=full", cost::precision::bf16, 0.f},
                       lay{&dense, "dp=2,pp=2,zero=3,mb=2", cost::precision::fp32, 0.f},
                       lay{&dense, "dp=4,cp=2,zero=3", cost::precision::fp32, 0.f},
                       lay{&dense, "dp=4,replicas=2,zero=2,mb=2", cost::precision::fp32, 0.f},
                       lay{&moe, "dp=4,ep=2,zero=1", cost::precision::fp32, 0.f},
                       lay{&moe, "dp=4,ep=4,zero=3,mb=2", cost::precision::bf16, 0.f}}) {
    CAPTURE(c.layout);
    const auto l = cost::parse_layout(c.layout);
    const cost::training t{.global_batch = batch, .prec = c.p};
    const auto e = cost::evaluate_dml(*c.m, l, t, cost::cluster{}, l.devices());
    REQUIRE(e.why.empty());
    auto g = cost::gpt_config_of(*c.m);
    g.dropout = c.dropout;  // masks follow the seed: dropout keeps no byte
    check_held(c.p == cost::precision::fp32 ? held<precision::fp32>(g, l, batch) : held<precision::bf16>(g, l, batch), e);
  }
  // Selective recomputation is a Llama block's in dml, not a GPT's: refused with the reason.
  const auto sel = cost::evaluate_dml(dense, cost::parse_layout("dp=2,recompute=selective"), {.global_batch = batch},
                                      cost::cluster{}, 2);
  CHECK_FALSE(sel.fits);
  CHECK(sel.why.find("selective recompute is a Llama block's in dml") != std::string::npos);
}

TEST_CASE("trainer_options::memory_limit at the plan's total trains; a byte less is refused before it is allocated") {
  // The limit binds dml's buffers (memory().allocated), which the plan prices to the byte: the largest rank reaches
  // it exactly; a byte below, that rank's allocation throws and the other ranks stop with it (no hang).
  constexpr std::int64_t batch = 8;
  const cost::model dense{.layers = 4, .d_model = 32, .heads = 4, .seq = 16, .vocab = 32};
  for (const char* layout : {"dp=1", "dp=2,zero=3", "dp=2,pp=2,zero=1,mb=4", "dp=2,tp=2,sp=1"}) {
    CAPTURE(layout);
    const auto l = cost::parse_layout(layout);
    const auto e = cost::evaluate_dml(dense, l, {.global_batch = batch, .prec = cost::precision::fp32}, cost::cluster{},
                                      l.devices());
    REQUIRE(e.why.empty());
    const auto limit = static_cast<std::int64_t>(e.per_rank.total());
    const auto g = cost::gpt_config_of(dense);
    check_held(held<precision::fp32>(g, l, batch, limit), e);
    const std::string want = "expected at most the memory limit of " + std::to_string(limit - 1) + " bytes";
    CHECK_THROWS_WITH(held<precision::fp32>(g, l, batch, limit - 1), doctest::Contains(want.c_str()));
  }
}

namespace {

// Of a second step of `model` (token ids of gpt_fixture's batch × seq) under o's tensor × pipeline layout: each rank's
// tensor-parallel calls, forward and backward, and their bytes, as its group counts them.
template <class Model>
std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> tp_counted(const Model& model, const train::trainer_options& o) {
  using gpt_fixture::batch;
  using gpt_fixture::seq;
  const int ranks = o.tensor_parallel * o.pipeline_stages;
  std::vector<std::int64_t> calls(static_cast<std::size_t>(ranks)), bytes(calls.size());
  comm::local::run(ranks, [&](comm::local& c) {
    trainer<parallel::replicate, optim::adamw> t(c, model, o);
    std::vector<float> x(static_cast<std::size_t>(batch * seq));
    std::vector<std::int32_t> y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7), y[i] = static_cast<std::int32_t>(i % 5);
    const tensor_view<const float> xv(x.data(), {batch, seq});
    const nn::rank_group* group = t.tensor_parallel_group();
    REQUIRE(group != nullptr);
    const auto counted = [&] { return std::pair{group->calls(nn::pass::forward) + group->calls(nn::pass::backward), group->bytes()}; };
    t.step(xv, y.data(), batch);
    const auto before = counted();  // the second step's alone
    t.step(xv, y.data(), batch);
    const auto after = counted();
    calls[static_cast<std::size_t>(c.rank())] = after.first - before.first;
    bytes[static_cast<std::size_t>(c.rank())] = after.second - before.second;
  });
  return {calls, bytes};
}

// The priced rank: every rank of one stage, the last stage's (the head's end) of a pipeline.
void check_tp_collectives(const std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>& got,
                          const cost::collectives& want) {
  const auto& [calls, bytes] = got;
  const std::size_t last = calls.size() - 1;
  CHECK(static_cast<double>(calls[last]) == want.calls);
  CHECK(static_cast<double>(bytes[last]) == want.payload);
  for (std::size_t r = 0; r < calls.size(); ++r) CHECK(calls[r] <= calls[last]);
}

}  // namespace

TEST_CASE("the GPT's tensor-parallel collectives per step, counted by its group, equal cost::gpt_tp_collectives") {
  using gpt_fixture::batch;
  using gpt_fixture::seq;
  struct lay {
    int tp, pp;
    bool sp, bias;
    std::int64_t layers, micro;
  };
  int checked = 0;
  for (const lay l : {lay{2, 1, false, false, 1, 1}, lay{2, 1, false, true, 2, 2}, lay{2, 1, true, false, 1, 1},
                      lay{2, 1, true, false, 2, 2}, lay{2, 1, true, true, 1, 2}, lay{2, 1, true, true, 2, 1},
                      lay{4, 1, true, true, 2, 2}, lay{4, 1, false, false, 2, 1}, lay{2, 2, true, true, 2, 2},
                      lay{2, 2, false, false, 4, 2}}) {
    CAPTURE(l.tp);
    CAPTURE(l.pp);
    CAPTURE(l.sp);
    CAPTURE(l.bias);
    CAPTURE(l.layers);
    CAPTURE(l.micro);
    auto g = gpt_fixture::config(l.layers, 0.f);
    g.bias = l.bias;
    train::trainer_options o;
    o.tensor_parallel = l.tp;
    o.sequence_parallel = l.sp;
    o.pipeline_stages = l.pp;
    o.schedule = l.pp > 1 ? "1f1b" : "gpipe";
    o.micro_batches = l.micro;
    const cost::model m{.layers = l.layers, .d_model = g.d_model, .heads = g.heads, .seq = seq, .vocab = g.vocab,
                        .bias = l.bias};
    const cost::layout cl{.tp = l.tp, .pp = l.pp, .sp = l.sp, .micro_batches = l.micro};
    check_tp_collectives(tp_counted(nn::gpt(g), o), cost::gpt_tp_collectives(m, cl, static_cast<double>(batch / l.micro), 4));
    ++checked;
  }
  CHECK(checked == 10);
}

namespace {

// A small Llama: 4 query heads reading 2 key/value heads, a SwiGLU of 48, four blocks.
cost::model small_llama(bool tie, std::int64_t layers = 4) {
  return {.layers = layers, .d_model = 32, .heads = 4, .seq = gpt_fixture::seq, .vocab = 32, .tie = tie,
          .arch = cost::architecture::llama, .kv_heads = 2, .ffn_hidden = 48};
}

}  // namespace

TEST_CASE("cost::evaluate_dml: a Llama layout's largest rank holds what the cost model says, category by category") {
  constexpr std::int64_t batch = 8;
  for (bool tie : {false, true}) {
    CAPTURE(tie);
    const auto m = small_llama(tie);
    const auto model = nn::llama(cost::llama_config_of(m));
    auto priced = [&](const char* layout, cost::precision p) {
      const auto l = cost::parse_layout(layout);
      const auto e = cost::evaluate_dml(m, l, {.global_batch = batch, .prec = p}, cost::cluster{}, l.devices());
      REQUIRE(e.why.empty());
      return std::pair{l, e};
    };
    for (const char* layout : {"dp=1", "tp=2", "tp=2,sp=1", "tp=4", "tp=4,sp=1", "pp=2,mb=4", "pp=2,schedule=zb,mb=4",
                               "pp=2,schedule=gpipe,mb=4,recompute=full", "dp=2,cp=2", "dp=2,tp=2,sp=1,cp=2",
                               "dp=2,cp=2,cp_attention=allgather", "dp=4,cp=4,mb=2,cp_attention=allgather"}) {
      CAPTURE(layout);
      const auto [l, e] = priced(layout, cost::precision::fp32);
      check_held(held<parallel::replicate, precision::fp32>(model, m.seq, l, batch), e);
    }
    for (const char* layout : {"dp=2,zero=3", "dp=2,tp=2,sp=1,zero=3,mb=2"}) {
      CAPTURE(layout);
      const auto [l, e] = priced(layout, cost::precision::bf16);
      check_held(held<parallel::hybrid<parallel::zero<3>>, precision::bf16>(model, m.seq, l, batch), e);
    }
  }
  // What nn::llama cannot run is refused with its reason, in a search too.
  const auto m = small_llama(false);
  auto why = [&](const char* layout) {
    const auto l = cost::parse_layout(layout);
    return cost::evaluate_dml(m, l, {.global_batch = batch}, cost::cluster{}, l.devices()).why;
  };
  CHECK(why("tp=4").empty());  // two ranks share each key/value head
  auto odd = m;
  odd.heads = 6;
  odd.d_model = 36;
  odd.vocab = 48;
  CHECK(cost::evaluate_dml(odd, cost::parse_layout("tp=3"), {.global_batch = batch}, cost::cluster{}, 3).why ==
        "tp 3 neither divides the 2 key/value heads nor is a multiple of them");
  auto narrow = m;
  narrow.heads = 16;
  narrow.kv_heads = 1;
  CHECK(cost::evaluate_dml(narrow, cost::parse_layout("tp=4"), {.global_batch = batch}, cost::cluster{}, 4).why ==
        "tp 4 does not divide the key/value heads' 2 columns");
  CHECK(why("dp=2,cp=2").empty());  // ring attention with grouped-query heads
  // All-gathered K/V: priced as the ring in time (the same bytes in as many steps), with every rank's block held.
  {
    const auto ring = cost::evaluate_dml(m, cost::parse_layout("dp=4,cp=4"), {.global_batch = batch}, cost::cluster{}, 4);
    const auto gathered = cost::evaluate_dml(m, cost::parse_layout("dp=4,cp=4,cp_attention=allgather"),
                                             {.global_batch = batch}, cost::cluster{}, 4);
    CHECK(gathered.step_seconds == ring.step_seconds);
    CHECK(gathered.per_rank.workspace > ring.per_rank.workspace);
    CHECK(gathered.per_rank.activations == ring.per_rank.activations);
    CHECK(cost::to_string(gathered.lay).ends_with(",recompute=none,cp_attention=allgather"));
    CHECK(cost::to_string(ring.lay).ends_with(",recompute=none"));
    CHECK_THROWS_WITH_AS(cost::parse_layout("cp_attention=p2p"),
                         "dml::cost::parse_layout: expected cp_attention ring or allgather, found 'p2p'", invalid_argument);
  }
  CHECK(why("dp=2,ep=2") == "ep 2 does not divide the 0 experts");
  const auto all = cost::search_dml(m, {.global_batch = batch}, cost::cluster{}, 8, 1);
  CHECK(std::ranges::any_of(all, [](const cost::estimate& e) { return e.fits; }));
  for (const auto& e : all) CHECK((e.fits || !e.why.empty()));
}

TEST_CASE("the Llama's tensor-parallel collectives per step, counted by its group, equal cost::gpt_tp_collectives") {
  using gpt_fixture::batch;
  struct lay {
    int tp, pp;
    bool sp;
    std::int64_t micro;
  };
  // tp 4 over its 2 key/value heads: each block also all-gathers their k and v slices and reduce-scatters their
  // gradients.
  for (const lay l : {lay{2, 1, false, 1}, lay{2, 1, true, 2}, lay{2, 2, true, 2}, lay{2, 2, false, 2}, lay{4, 1, false, 1},
                      lay{4, 1, true, 2}}) {
    CAPTURE(l.tp);
    CAPTURE(l.pp);
    CAPTURE(l.sp);
    CAPTURE(l.micro);
    const auto m = small_llama(false);
    train::trainer_options o;
    o.tensor_parallel = l.tp;
    o.sequence_parallel = l.sp;
    o.pipeline_stages = l.pp;
    o.schedule = l.pp > 1 ? "1f1b" : "gpipe";
    o.micro_batches = l.micro;
    const cost::layout cl{.tp = l.tp, .pp = l.pp, .sp = l.sp, .micro_batches = l.micro};
    check_tp_collectives(tp_counted(nn::llama(cost::llama_config_of(m)), o),
                         cost::gpt_tp_collectives(m, cl, static_cast<double>(batch / l.micro), 4));
  }
}

TEST_CASE("a Llama's parameters, FLOPs, stage cut and block bytes in dml::cost are its layers'; the Llama 3 presets") {
  auto declared = [](const auto& model) {
    double n = 0;
    model.for_each_layer([&](std::size_t, const auto& l) {
      for (const auto& p : l.parameters()) n += static_cast<double>(p.shape.numel());
    });
    return n;
  };
  // The published counts of Llama 3's Hugging Face checkpoints (untied), from cost's arithmetic and nn::llama's shapes.
  const std::pair<const char*, double> published[] = {
      {"llama3-8b", 8'030'261'248.0}, {"llama3-70b", 70'553'706'496.0}, {"llama3-405b", 405'853'388'800.0}};
  for (const auto& [name, count] : published) {
    CAPTURE(name);
    const auto m = cost::preset(name);
    CHECK(cost::count_layers(m).total(m) == count);
    CHECK(declared(nn::llama(cost::llama_config_of(m))) == count);
  }
  CHECK_THROWS_WITH_AS(cost::preset("llama3-7b"),
                       "dml::cost::preset: expected llama3-8b, llama3-70b, llama3-405b or deepseek-v3, found 'llama3-7b'",
                       invalid_argument);
  // Tied, the LM head is a parameter of its own that the count takes once.
  const auto tied = small_llama(true);
  CHECK(cost::count_layers(tied).total(tied) ==
        declared(nn::llama(cost::llama_config_of(tied))) - static_cast<double>(tied.vocab * tied.d_model));

  // FLOPs per token: the blocks' and the head's products as they count them (the embedding is a lookup).
  const auto m = small_llama(false, 6);
  const auto model = nn::llama(cost::llama_config_of(m));
  double flops = 0;
  dml::shape x{2, m.seq};
  model.for_each_layer([&](std::size_t i, const auto& l) {
    if (i > 0) flops += nn::forward_flops(l, x);
    x = l.output_shape(x);
  });
  CHECK(cost::gpt_forward_flops_per_token(m) == doctest::Approx(flops / static_cast<double>(2 * m.seq)).epsilon(1e-12));

  // The busiest pipeline rank's share under the trainer's own cut.
  const auto cost_of = parallel::layer_training_flops(model, 64);
  double total = 0;
  for (const double f : cost_of) total += f;
  for (const char* sched : {"1f1b", "interleaved:2"}) {
    CAPTURE(sched);
    const cost::layout l{.pp = 2, .schedule = sched};
    double busiest = 0;
    for (int r = 0; r < 2; ++r) {
      double mine = 0;
      for (const auto& c : cost::stage_chunks(model, 2, std::max(1, cost::interleaved_chunks(sched)), r))
        for (std::size_t i = c.first; i < c.end; ++i) mine += cost_of[i];
      busiest = std::max(busiest, mine);
    }
    CHECK(cost::busiest_stage_share(m, l) == doctest::Approx(busiest / total).epsilon(1e-12));
  }

  // llama_layer_bytes: what a block keeps and its output, to the byte (sizes that leave no 64-byte padding).
  for (const int tp : {1, 2, 4})  // at 4 two ranks share each of the 2 key/value heads
    for (const bool sp : {false, true})
      for (const std::int64_t w : {4, 2}) {
        if (sp && tp != 2) continue;  // tp 4 sp: a rank's 1/rms floats would pad to 64 bytes
        CAPTURE(tp);
        CAPTURE(sp);
        CAPTURE(w);
        for (const bool selective : {false, true}) {
          CAPTURE(selective);
          nn::llama_block block(cost::llama_config_of(m, selective));
          if (tp > 1) block.set_split({.ranks = tp, .rank = 0, .sequence = sp});
          const dml::shape in{2, sp ? m.seq / tp : m.seq, m.d_model};
          const double kept = static_cast<double>(block.saved_bytes(in, static_cast<std::size_t>(w)) + in.numel() * w);
          CHECK(cost::llama_layer_bytes(static_cast<double>(m.seq), 2, 32, 4, 2, 48, tp, static_cast<double>(w), sp,
                                        selective ? cost::recompute::selective : cost::recompute::none) == kept);
        }
      }
}

}  // namespace test_cost_exact
