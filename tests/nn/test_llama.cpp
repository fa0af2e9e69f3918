// SPDX-License-Identifier: Apache-2.0
// tests/nn/test_llama.cpp — the Llama layers: gradients against central finite differences (a block alone, the
// whole model through the cross-entropy, multi-head, grouped-query and multi-query attention, tied and untied heads),
// names, shapes, errors, the fused q/k/v parameter's tensor-parallel parts; through the trainer, tensor (and sequence)
// parallelism and context parallelism (ring attention, zig-zag and contiguous) against one rank, checkpoints across
// tensor-parallel degrees, the collectives a block makes, and dml::cost's exact bytes.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dml/dml.hpp"
#include "dml/nn/gradcheck.hpp"
#include "dml/nn/llama.hpp"
#include "dml/nn/loss.hpp"
#include "dml/nn/network.hpp"
#include "dml/plan/exact.hpp"
#include "support.hpp"

namespace test_llama {

namespace {

using namespace dml;
using llama_net = nn::network<host, nn::llama_embedding, nn::stack<nn::llama_block>, nn::llama_head>;

// Tiny: head_dim 4, two RoPE pairs a head.
nn::llama_config tiny(std::int64_t kv_heads, bool tied = false) {
  return {.vocab = 11, .seq = 6, .d_model = 16, .layers = 2, .heads = 4, .kv_heads = kv_heads, .ffn_hidden = 12,
          .tie_embeddings = tied};
}

std::vector<float> random_ids(std::size_t n, int vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng() % static_cast<unsigned>(vocab));
  return v;
}

std::string attention_name(std::int64_t kv_heads) { return kv_heads == 4 ? "MHA" : kv_heads == 1 ? "MQA" : "GQA"; }

// Every parameter of the whole model (sampled) against central differences of the mean cross-entropy. A tied LM
// head is one weight held twice: both copies move at once, and its gradient is the sum of the two.
nn::gradcheck_result whole_model(const nn::llama_config& g) {
  llama_net net(nn::llama(g), 3);
  // Norm weights away from 1, so that a gradient a weight of 1 hides shows.
  for (const auto& slot : net.layout().slots)
    if (slot.name.ends_with("norm.weight"))
      for (std::int64_t i = 0; i < slot.shape.numel(); ++i)
        net.params()[static_cast<std::size_t>(slot.offset + i)] += rng_stream{5, slot.init_id}.uniform(i, -0.3f, 0.3f);
  const shape xs{2, 5};
  const auto ids = random_ids(10, static_cast<int>(g.vocab), 8);
  std::vector<std::int32_t> labels(10);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>((i * 7 + 3) % g.vocab);
  std::vector<float> dlogits(static_cast<std::size_t>(10 * g.vocab)), row(10);
  auto loss = [&](bool grad) {
    auto y = net.forward(tensor_view<const float>(ids.data(), xs));
    REQUIRE(y.shape == shape{2, 5, g.vocab});
    return nn::softmax_cross_entropy{}.forward_backward<host>(
        y, labels.data(), tensor_view<float>(grad ? dlogits.data() : nullptr, y.shape), row.data());
  };
  const float l0 = loss(true);
  CHECK(std::abs(l0 - std::log(static_cast<float>(g.vocab))) < 0.5f);
  net.backward(tensor_view<const float>(dlogits.data(), {2, 5, g.vocab}));
  const std::vector<float> grads(net.grads().begin(), net.grads().end());
  const auto& head = net.layout().find("lm_head.weight");
  float* w = net.params().data();
  nn::gradcheck_result rep;
  // The residual stream starts at the embedding's scale (σ 0.02), where RMSNorm is far from linear: a small step,
  // and a floor that sits above float rounding of the loss.
  const float h = 2e-3f;
  for (const auto& slot : net.layout().slots) {
    if (g.tie_embeddings && slot.name == "lm_head.weight") continue;  // checked with the embedding, its other copy
    const bool shared = g.tie_embeddings && slot.name == "model.embed_tokens.weight";
    for (std::int64_t i = 0; i < slot.shape.numel(); i += std::max<std::int64_t>(1, slot.shape.numel() / 13)) {
      const auto at = static_cast<std::size_t>(slot.offset + i);
      double ana = grads[at], num = 0;
      if (shared) {
        const auto other = static_cast<std::size_t>(head.offset + i);
        ana += grads[other];
        num = nn::central_difference({&w[at], &w[other]}, h, [&] { return loss(false); });
      } else {
        num = nn::central_difference(w[at], h, [&] { return loss(false); });
      }
      const double rel = nn::gradient_difference(ana, num, 2e-2);
      if (rel > 1e-2) MESSAGE(slot.name << "[" << i << "] analytic " << ana << " numeric " << num);
      if (rep.checked++ == 0 || rel > rep.max_rel) rep.max_rel = rel, rep.worst = slot.name + "[" + std::to_string(i) + "]";
    }
  }
  return rep;
}

}  // namespace

TEST_CASE("llama_block: every parameter and the input match finite differences, MHA, GQA and MQA") {
  for (std::int64_t kv : {4, 2, 1}) {
    const nn::llama_block block(tiny(kv));
    const auto rep = nn::check_gradients(block, {2, 5, 16}, {.h = 1e-2f, .perturb = 0.3f, .per_tensor = 40});
    MESSAGE("llama_block " << attention_name(kv) << " max_rel_diff=" << rep.max_rel << " (" << rep.worst << ") over "
                           << rep.checked);
    CHECK(rep.checked > 240);
    CHECK(rep.max_rel < 5e-3);  // seen: 2.9e-3 (MHA), 1.3e-3 (GQA), 1.6e-3 (MQA)
  }
}

TEST_CASE("llama: whole-model gradients through the cross-entropy, MHA, GQA and MQA, tied and untied heads") {
  for (std::int64_t kv : {4, 2, 1})
    for (bool tied : {false, true}) {
      const auto g = tiny(kv, tied);
      CHECK(nn::llama(g).depth() == 4);
      const auto rep = whole_model(g);
      MESSAGE("llama " << attention_name(kv) << std::string(tied ? " tied" : " untied") << " max_rel_diff=" << rep.max_rel << " ("
                       << rep.worst << ") over " << rep.checked);
      CHECK(rep.checked > 200);
      CHECK(rep.max_rel < 1e-2);  // seen: 2.9e-3 to 4.4e-3
    }
}

TEST_CASE("llama parameter names follow Hugging Face's LlamaForCausalLM, q/k/v and gate/up fused") {
  auto g = tiny(2);
  g.layers = 1;
  std::vector<std::string> names;
  std::vector<shape> shapes;
  for (const auto& [l, spec] : nn::llama(g).parameters()) names.push_back(spec.name), shapes.push_back(spec.shape);
  CHECK(names == std::vector<std::string>{"model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                                          "model.layers.0.self_attn.qkv_proj.weight",
                                          "model.layers.0.self_attn.o_proj.weight",
                                          "model.layers.0.post_attention_layernorm.weight",
                                          "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
                                          "model.norm.weight", "lm_head.weight"});
  // head_dim 4: q 4 heads, k and v 2 heads each.
  CHECK(shapes == std::vector<shape>{{11, 16}, {16}, {(4 + 2 * 2) * 4, 16}, {16, 16}, {16}, {24, 16}, {16, 12}, {16}, {11, 16}});
  g.tie_embeddings = true;
  const auto tied = nn::llama(g).parameters();
  CHECK(tied.back().second.tied_to == "model.embed_tokens.weight");
  CHECK(tied.front().second.tied_to.empty());
  // A tied head starts as the embedding.
  llama_net net(nn::llama(g), 4);
  const auto& embed = net.layout().find("model.embed_tokens.weight");
  const auto& head = net.layout().find("lm_head.weight");
  CHECK(head.init_id == embed.id);
  for (std::int64_t i = 0; i < embed.shape.numel(); ++i)
    REQUIRE(net.params()[static_cast<std::size_t>(embed.offset + i)] == net.params()[static_cast<std::size_t>(head.offset + i)]);
}

TEST_CASE("llama: output shapes, with and without tensor and sequence parallelism") {
  const auto g = tiny(2);
  auto model = nn::llama(g);
  CHECK(model.output_shape({3, 6}) == shape{3, 6, 11});
  CHECK(model.output_shape({1, 1}) == shape{1, 1, 11});
  CHECK_THROWS_WITH_AS(model.output_shape({2, 7}), doctest::Contains("1 <= T <= 6"), shape_error);
  CHECK_THROWS_WITH_AS(model.output_shape({2, 3, 16}), doctest::Contains("token ids [batch, T]"), shape_error);
  nn::llama_block b(g);
  CHECK_THROWS_WITH_AS(b.output_shape({2, 5, 12}), doctest::Contains("expected [batch, T, 16], found shape"), shape_error);
  CHECK_THROWS_WITH_AS(b.output_shape({2, 7, 16}), doctest::Contains("expected T <= seq = 6, found T = 7"), shape_error);
  auto wide = g;
  wide.vocab = 12;
  auto split = nn::llama(wide);
  nn::set_tensor_split(split, {.ranks = 2, .rank = 1});
  CHECK(split.output_shape({3, 5}) == shape{3, 5, 6});
  nn::set_tensor_split(split, {.ranks = 2, .rank = 1, .sequence = true});
  CHECK(split.output_shape({3, 6}) == shape{3, 6, 6});
  CHECK(std::get<0>(split.layers).output_shape({3, 6}) == shape{3, 3, 16});
  CHECK_THROWS_WITH_AS(split.output_shape({3, 5}), doctest::Contains("needs T divisible by 2, found 5"), shape_error);
  // The block's local parameters under tp 2: 2 query heads and 1 key/value head of 4 columns, half of ffn_hidden.
  nn::llama_block half(g);
  half.set_split({.ranks = 2, .rank = 0});
  const auto specs = half.parameters();
  CHECK(specs[1].shape == shape{(2 + 2 * 1) * 4, 16});
  CHECK(specs[2].shape == shape{16, 8});
  CHECK(specs[4].shape == shape{12, 16});
  CHECK(specs[5].shape == shape{16, 6});
}

TEST_CASE("llama: configuration and split errors name what was expected and what was found") {
  auto bad = [](auto change) {
    auto g = tiny(2);
    change(g);
    return g;
  };
  const auto throws = [](const nn::llama_config& g, const char* text) {
    CHECK_THROWS_WITH_AS(g.validate(), doctest::Contains(text), invalid_argument);
    CHECK_THROWS_WITH_AS(nn::llama(g), doctest::Contains(text), invalid_argument);
  };
  throws(bad([](auto& g) { g.kv_heads = 3; }), "expected kv_heads dividing heads = 4, found kv_heads = 3");
  throws(bad([](auto& g) { g.d_model = 18; }), "expected d_model divisible by heads = 4, found d_model = 18");
  throws(bad([](auto& g) { g.d_model = 12; }), "expected an even head_dim = d_model / heads (RoPE rotates pairs), found head_dim = 3");
  throws(bad([](auto& g) { g.ffn_hidden = 0; }), "expected ffn_hidden > 0, found ffn_hidden = 0");
  throws(bad([](auto& g) { g.vocab = -1; }), "expected vocab > 0, found vocab = -1");
  throws(bad([](auto& g) { g.layers = 0; }), "expected layers > 0, found layers = 0");
  throws(bad([](auto& g) { g.kv_heads = 0; }), "expected kv_heads > 0, found kv_heads = 0");
  throws(bad([](auto& g) { g.norm_eps = 0.f; }), "expected norm_eps > 0");
  throws(bad([](auto& g) { g.rope.theta = 0; }), "expected rope.theta > 0");
  CHECK_NOTHROW(tiny(1).validate());

  // Tensor parallelism splits key/value heads, or where there are fewer than ranks, shares each among
  // ranks / kv_heads ranks that hold a slice of its columns each.
  nn::llama_block mqa(tiny(1));
  CHECK_NOTHROW(mqa.set_split({.ranks = 2}));
  CHECK_NOTHROW(mqa.set_split({.ranks = 4}));
  auto narrow = tiny(1);
  narrow.heads = 8;  // head_dim 2
  nn::llama_block mqa8(narrow);
  CHECK_THROWS_WITH_AS(mqa8.set_split({.ranks = 4}),
                       doctest::Contains("llama_block: tensor parallelism over 4 ranks needs the key/value heads' "
                                         "columns kv_heads·head_dim divisible by 4, found 2"),
                       invalid_argument);
  auto six = tiny(2);
  six.heads = 6;
  six.d_model = 24;
  nn::llama_block gqa(six);
  CHECK_THROWS_WITH_AS(gqa.set_split({.ranks = 3}),
                       doctest::Contains("tensor parallelism over 3 ranks needs the key/value heads divisible by 3 or "
                                         "dividing it, found 2"),
                       invalid_argument);
  auto odd_ffn = tiny(2);
  odd_ffn.ffn_hidden = 9;
  nn::llama_block ffn(odd_ffn);
  CHECK_THROWS_WITH_AS(ffn.set_split({.ranks = 2}), doctest::Contains("needs ffn_hidden divisible by 2, found 9"),
                       invalid_argument);
  nn::llama_embedding e(tiny(2));
  CHECK_THROWS_WITH_AS(e.set_split({.ranks = 2}), doctest::Contains("the vocabulary divisible by 2, found 11"),
                       invalid_argument);
  // Context parallelism: a rank's chunks of each sequence, which must cut into 2·cp chunks (zig-zag) or cp.
  auto model = nn::llama(tiny(2));
  nn::set_context_split(model, {.ranks = 2, .rank = 1});
  CHECK(std::get<0>(model.layers).output_shape({3, 4}) == shape{3, 2, 16});
  CHECK(model.output_shape({3, 4}) == shape{3, 2, 11});
  CHECK_THROWS_WITH_AS(model.output_shape({3, 6}),
                       doctest::Contains("context parallelism over 2 ranks (zig-zag) needs T divisible by 4, found T = 6"),
                       shape_error);
  nn::set_context_split(model, {.ranks = 2, .rank = 1, .zigzag = false});
  CHECK(model.output_shape({3, 6}) == shape{3, 3, 11});
  // Token ids outside the vocabulary.
  llama_net net(nn::llama(tiny(2)), 1);
  const std::vector<float> ids{1, 2, 11, 0};
  CHECK_THROWS_WITH_AS(net.forward(tensor_view<const float>(ids.data(), {1, 4})),
                       doctest::Contains("expected integer token ids in [0, 11), found 11 at position 2"), invalid_argument);
}

TEST_CASE("fused q/k/v under tensor parallelism: each rank holds its query heads and the key/value heads they read") {
  // heads 8, kv_heads 2, head_dim 2, C 4: whole rows q 0..15, k 16..19, v 20..23.
  constexpr std::int64_t hd = 2, q = 8 * hd, kv = 2 * hd, rows = q + 2 * kv, cols = 4;
  for (int ranks : {1, 2}) {
    std::set<std::int64_t> seen;
    for (int rank = 0; rank < ranks; ++rank) {
      const nn::param_shard s{.rows = rows, .cols = cols, .axis = 0, .blocks = 3, .rank = rank, .ranks = ranks, .lead = q};
      const std::int64_t local_q = q / ranks, local_kv = kv / ranks;
      for (std::int64_t r = 0; r < rows / ranks; ++r) {
        const std::int64_t whole = s.whole_index(r * cols) / cols;
        CHECK(s.whole_index(r * cols + 3) == whole * cols + 3);
        if (r < local_q) CHECK(whole == rank * local_q + r);                                  // query heads of rank
        else if (r < local_q + local_kv) CHECK(whole == q + rank * local_kv + r - local_q);   // its key heads
        else CHECK(whole == q + kv + rank * local_kv + r - local_q - local_kv);               // its value heads
        for (std::int64_t c = 0; c < cols; ++c) seen.insert(s.whole_index(r * cols + c));
      }
    }
    CHECK(seen.size() == static_cast<std::size_t>(rows * cols));  // the parts make the whole, once each
  }
  // Along columns too (a row-parallel weight cut in unequal blocks).
  const nn::param_shard s{.rows = 2, .cols = 12, .axis = 1, .blocks = 3, .rank = 1, .ranks = 2, .lead = 8};
  std::vector<std::int64_t> got;
  for (std::int64_t i = 0; i < 2 * 6; ++i) got.push_back(s.whole_index(i));
  CHECK(got == std::vector<std::int64_t>{4, 5, 6, 7, 9, 11, 16, 17, 18, 19, 21, 23});
}

namespace {

// Training through the trainer on comm::local: random token batches, every rank passing the whole batch (one
// data-parallel rank), 20 AdamW steps with clipping; what rank 0 saw.
struct run_result {
  std::vector<float> losses;
  std::vector<double> grad_norms;
  std::vector<float> params;  // the whole model, padding stripped
  std::int64_t forward_all_reduces = 0, backward_all_reduces = 0;  // of the tensor-parallel group
};
struct run_layout {
  int tp = 1, pp = 1;
  bool sp = false;
  std::string schedule{};
  bool documents = false;  // packed rows: each row cut into documents (document_starts)
  int cp = 1;              // context parallel: cp ranks (the whole data-parallel group) hold chunks of every row
  bool zigzag = true;
  bool all_gather = false;  // context parallel: K/V all-gathered, not passed round the ring
  int dp = 0;               // data-parallel ranks (0: cp); cp and ep divide it
  int ep = 1;               // expert parallel
  int size() const { return tp * pp * (dp > 0 ? dp : cp); }
};
constexpr std::int64_t train_batch = 4, train_seq = 16;
constexpr int train_steps = 20;

// Row r of `rows` cut into documents at (3 + r) mod 5 + 2 and 11: for each token the position its document starts at.
std::vector<std::int64_t> document_starts(std::int64_t rows, std::int64_t seq) {
  std::vector<std::int64_t> doc(static_cast<std::size_t>(rows * seq));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t t = 0, start = 0; t < seq; ++t) {
      if (t == (3 + r) % 5 + 2 || t == 11) start = t;
      doc[static_cast<std::size_t>(r * seq + t)] = start;
    }
  return doc;
}

nn::llama_config train_config(bool tied = false) {
  return {.vocab = 32, .seq = train_seq, .d_model = 32, .layers = 2, .heads = 8, .kv_heads = 2, .ffn_hidden = 48,
          .rope = {.theta = 500000, .scaling = nn::rope_scaling{}}, .tie_embeddings = tied};
}

// Steps [first, first + n) of one run: step s's batch depends on s alone, so a run resumed from a checkpoint sees
// what the uninterrupted one saw. load: a checkpoint to start from; save: where to leave one at the end.
run_result train_layout(const run_layout& l, const nn::llama_config& g, int first = 0, int n = train_steps,
                        const std::string& load = {}, const std::string& save = {}) {
  run_result out;
  comm::local::run(l.size(), [&](comm::local& c) {
    train::trainer_options o;
    o.seed = 9;
    o.tensor_parallel = l.tp;
    o.sequence_parallel = l.sp;
    o.pipeline_stages = l.pp;
    o.context_parallel = l.cp;
    o.cp_zigzag = l.zigzag;
    o.cp_all_gather = l.all_gather;
    o.expert_parallel = l.ep;
    o.schedule = l.schedule;
    o.micro_batches = l.pp > 1 ? 2 : 1;
    o.clip_norm = 0.5f;
    trainer<parallel::replicate, optim::adamw> t(c, nn::llama(g), o, optim::adamw({.lr = 3e-3f}));
    if (!load.empty()) t.load_checkpoint(load);
    std::vector<float> x(static_cast<std::size_t>(train_batch * train_seq));
    std::vector<std::int32_t> y(x.size());
    const auto doc = document_starts(train_batch, train_seq);
    run_result r;
    for (int s = first; s < first + n; ++s) {
      // Mostly t → (3t + 1) mod vocab, a random token a quarter of the time: something to learn.
      std::mt19937 gen(static_cast<unsigned>(77 + s));
      std::int32_t prev = static_cast<std::int32_t>(gen() % g.vocab);
      for (std::size_t i = 0; i < x.size(); ++i) {
        const std::int32_t next = gen() % 4 == 0 ? static_cast<std::int32_t>(gen() % g.vocab)
                                                 : static_cast<std::int32_t>((3 * prev + 1) % g.vocab);
        x[i] = static_cast<float>(prev);
        y[i] = next;
        prev = next;
      }
      // Data-parallel ranks beyond the context group take their rows of the batch (ranks: tp fastest, then dp).
      const std::int64_t parts = l.dp > l.cp ? l.dp : 1, rows = train_batch / parts,
                         first_row = (c.rank() / l.tp) % parts * rows, at = first_row * train_seq;
      const auto step = t.step(tensor_view<const float>(x.data() + at, {rows, train_seq}), y.data() + at, train_batch,
                               l.documents ? doc.data() + at : nullptr);
      r.losses.push_back(step.loss);
      r.grad_norms.push_back(step.grad_norm);
    }
    if (!save.empty()) t.save_checkpoint(save);
    const auto params = t.full_parameters();
    for (const auto& slot : t.layout().slots)
      r.params.insert(r.params.end(), params.begin() + slot.offset, params.begin() + slot.offset + slot.shape.numel());
    if (const auto* group = t.tensor_parallel_group()) {
      r.forward_all_reduces = group->calls(nn::pass::forward, nn::group_op::all_reduce);
      r.backward_all_reduces = group->calls(nn::pass::backward, nn::group_op::all_reduce);
    }
    if (c.rank() == 0) out = std::move(r);
  });
  return out;
}

// A layout against one rank: losses to 1.5e-6 relative (gpt_fixture's bound; seen: 1.0e-7), gradient norms to 1e-6
// relative (seen: 1.25e-7) and parameters to 2e-5 absolute (seen: 2.8e-7 untied, 1.7e-6 tied), gpt_fixture's 1e-5
// and 2e-4 tightened to about 10x what this model shows. A layout sums in other orders (each rank's GEMMs have other
// shapes), and Adam's normalised step turns rounding-level differences of a near-zero gradient into larger steps.
void check_same(const run_result& one, const run_result& got, const std::string& what) {
  REQUIRE(!one.losses.empty());
  REQUIRE(got.losses.size() == one.losses.size());
  REQUIRE(got.params.size() == one.params.size());
  const auto loss = dml_test::max_rel_difference(one.losses, got.losses);
  const auto norm = dml_test::max_rel_difference(one.grad_norms, got.grad_norms);
  const auto param = dml_test::max_abs_difference(one.params, got.params);
  MESSAGE(what << ": max_rel_loss_diff=" << loss << " max_rel_grad_norm_diff=" << norm << " max_abs_param_diff=" << param);
  CHECK(loss.value <= 1.5e-6);
  CHECK(norm.value <= 1e-6);
  CHECK(param.value <= 2e-5);
}

}  // namespace

TEST_CASE("llama under tensor parallelism (and sequence parallelism, and a split-backward pipeline) gives one rank's training") {
  const auto g = train_config();
  const auto one = train_layout({}, g);
  CHECK(one.losses.back() < one.losses.front() - 0.3f);  // it learns
  check_same(one, train_layout({.tp = 2}, g), "tp 2");
  check_same(one, train_layout({.tp = 2, .sp = true}, g), "tp 2 sp");
  // zb splits each block's backward: its input pass stashes what the weight pass multiplies.
  check_same(one, train_layout({.tp = 2, .pp = 2, .sp = true, .schedule = "zb"}, g), "tp 2 pp 2 sp zb");
  const auto tied = train_layout({}, train_config(true));
  check_same(tied, train_layout({.tp = 2}, train_config(true)), "tied, tp 2");
}

TEST_CASE("llama under tp, sp and cp: the trainer's model states and peak activations equal dml::cost's exact bytes") {
  const auto g = train_config();
  for (const run_layout& l : {run_layout{}, run_layout{.tp = 2}, run_layout{.tp = 2, .sp = true}, run_layout{.cp = 2},
                              run_layout{.tp = 2, .sp = true, .cp = 2}}) {
    CAPTURE(l.tp);
    CAPTURE(l.sp);
    CAPTURE(l.cp);
    auto part = nn::llama(g);
    if (l.tp > 1) nn::set_tensor_split(part, {.ranks = l.tp, .rank = 0, .sequence = l.sp});
    if (l.cp > 1) nn::set_context_split(part, {.ranks = l.cp, .rank = 0});
    const auto want = cost::model_states(part, {.zero = 0, .shards = {1, 1}});
    train::memory_report got;
    std::int64_t activations = 0;
    comm::local::run(l.size(), [&](comm::local& c) {
      train::trainer_options o;
      o.tensor_parallel = l.tp;
      o.sequence_parallel = l.sp;
      o.context_parallel = l.cp;
      trainer<parallel::replicate, optim::adamw> t(c, nn::llama(g), o);
      std::vector<float> x(static_cast<std::size_t>(train_batch * train_seq));
      std::vector<std::int32_t> y(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7), y[i] = static_cast<std::int32_t>(i % 5);
      t.step(tensor_view<const float>(x.data(), {train_batch, train_seq}), y.data(), train_batch);
      if (c.rank() == 0) got = t.memory(), activations = t.peak_activation_bytes();
    });
    CHECK(got.numel == want.numel);
    CHECK(got.padded == want.padded);
    CHECK(got.params + got.grads + got.optimizer == want.params + want.grads + want.optimizer);
    CHECK(activations == cost::activation_set_bytes(part, {train_batch, train_seq}, 4));
  }
}

// A Llama whose second block's MLP is a mixture of 4 SwiGLU experts of width 24 (fine-grained), top-2 of sigmoid
// scores renormalised, one shared expert, loss-free balancing in place of the auxiliary loss (as DeepSeek-V3);
// dropless, so that every layout routes alike. (The auxiliary loss is a product of batch means: micro-batches, as a
// pipeline runs, sum it per micro-batch, which one rank's whole batch does not.)
nn::llama_config moe_config() {
  auto g = train_config();
  g.experts = 4;
  g.moe_every = 2;
  g.top_k = 2;
  g.capacity_factor = 0.f;
  g.expert_ffn = 24;
  g.shared_experts = 1;
  g.sigmoid_router = true;
  g.router_bias_rate = 1e-3f;
  g.aux_loss_weight = 0.f;
  return g;
}

TEST_CASE("llama with experts: a block's every parameter and its input match finite differences") {
  auto g = tiny(2);
  g.experts = 4;
  g.top_k = 4;  // every expert chosen: no choice for a difference quotient to flip
  g.capacity_factor = 0.f;
  g.aux_loss_weight = g.z_loss_weight = 0.f;  // the check's objective is the output's alone (test_moe checks them)
  g.expert_ffn = 6;
  g.shared_experts = 1;
  for (const bool sigmoid : {false, true}) {
    g.sigmoid_router = sigmoid;
    const nn::llama_block block(g, {}, true);
    const auto names = block.parameters();
    REQUIRE(names.size() == 9);
    CHECK(names[4].name == "mlp.router.weight");
    CHECK(names[5].name == "mlp.experts.c_fc.weight");
    CHECK(names[5].shape == shape{4 * 2 * 6, 16});  // each expert's gate and up
    CHECK(names[7].name == "mlp.shared.c_fc.weight");
    const auto rep = nn::check_gradients(block, {2, 5, 16}, {.h = 1e-2f, .perturb = 0.3f, .per_tensor = 40});
    MESSAGE("llama_block with experts, " << (sigmoid ? "sigmoid" : "softmax") << " max_rel_diff=" << rep.max_rel << " ("
                                         << rep.worst << ") over " << rep.checked);
    CHECK(rep.checked > 240);
    CHECK(rep.max_rel < 1e-2);
  }
}

TEST_CASE("llama with experts gives one rank's training under ep, tp with sp, a split-backward pipeline and cp") {
  const auto g = moe_config();
  const auto one = train_layout({}, g);
  CHECK(one.losses.back() < one.losses.front() - 0.3f);  // it learns
  check_same(one, train_layout({.dp = 2, .ep = 2}, g), "dp 2 ep 2");
  check_same(one, train_layout({.tp = 2, .sp = true, .dp = 2, .ep = 2}, g), "tp 2 sp dp 2 ep 2");
  check_same(one, train_layout({.pp = 2, .schedule = "zb", .dp = 2, .ep = 2}, g), "pp 2 zb dp 2 ep 2");
  check_same(one, train_layout({.cp = 2, .ep = 2}, g), "cp 2 ep 2");
}

TEST_CASE("llama with experts: the trainer's bytes equal dml::cost's exact bytes, and its parameters the planner's count") {
  const auto g = moe_config();
  auto part = nn::llama(g);
  nn::set_expert_split(part, 2, 0, 2);
  const auto want = cost::model_states(part, {.zero = 0, .shards = {2, 2}});
  const cost::model m{.layers = g.layers, .d_model = g.d_model, .heads = g.heads, .seq = g.seq, .vocab = g.vocab,
                      .experts = g.experts, .top_k = g.top_k, .moe_every = g.moe_every, .capacity_factor = 0.f,
                      .expert_ffn = g.expert_ffn, .shared_experts = g.shared_experts, .arch = cost::architecture::llama,
                      .kv_heads = g.kv_heads, .ffn_hidden = g.ffn_hidden};
  comm::local::run(2, [&](comm::local& c) {
    train::trainer_options o;
    o.expert_parallel = 2;
    trainer<parallel::replicate, optim::adamw> t(c, nn::llama(g), o);
    std::vector<float> x(static_cast<std::size_t>(train_batch * train_seq));
    std::vector<std::int32_t> y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7), y[i] = static_cast<std::int32_t>(i % 5);
    const std::int64_t rows = train_batch / 2, at = c.rank() * rows * train_seq;  // each rank its half of the batch
    t.step(tensor_view<const float>(x.data() + at, {rows, train_seq}), y.data() + at, train_batch);
    if (c.rank() != 0) return;
    const auto got = t.memory();
    CHECK(got.numel == want.numel);
    CHECK(got.params + got.grads + got.optimizer == want.params + want.grads + want.optimizer);
    CHECK(t.peak_activation_bytes() == cost::activation_set_bytes(part, {rows, train_seq}, 4));
    CHECK(cost::count_layers(m).total(m) == static_cast<double>(t.layout().numel));
  });
}

TEST_CASE("llama with experts: the balancing bias rides in checkpoints, so a resumed run routes as the whole one") {
  auto g = moe_config();
  g.router_bias_rate = 0.05f;  // large enough to change choices within a few steps
  const run_layout l{.dp = 2, .ep = 2};
  const auto whole = train_layout(l, g, 0, 12);
  const dml_test::temp_dir dir("dml-llama-moe-checkpoint");
  train_layout(l, g, 0, 5, {}, dir.path.string());  // an odd count: the bias's ±rate steps cannot cancel
  const auto info = train::read_checkpoint_index(dir.path).info;
  std::size_t biases = 0;
  for (const auto& [key, value] : info.user) {
    if (!key.starts_with("dml.router_bias.")) continue;
    ++biases;
    INFO(key << " = " << value);
    CHECK(value.find_first_of("123456789") != std::string::npos);  // moved from zero
  }
  CHECK(biases == 1);  // the one block with experts
  auto resumed = train_layout(l, g, 5, 7, dir.path.string());
  auto tail = whole;
  tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 5);
  tail.grad_norms.erase(tail.grad_norms.begin(), tail.grad_norms.begin() + 5);
  check_same(tail, resumed, "dp 2 ep 2 resumed at step 5");
}

TEST_CASE("selective recompute trains bit for bit as keeping everything, in every layout, and keeps what dml::cost says") {
  // What backward computes again is what forward computed, by the same kernels on the same inputs: equal, not close.
  auto exact = [](const run_result& a, const run_result& b, const std::string& what) {
    INFO(what);
    CHECK(a.losses == b.losses);
    CHECK(a.grad_norms == b.grad_norms);
    CHECK(a.params == b.params);
  };
  for (const bool with_experts : {false, true}) {
    auto g = with_experts ? moe_config() : train_config();
    auto sel = g;
    sel.selective_recompute = true;
    const std::string tag = with_experts ? "experts, " : "";
    exact(train_layout({}, g, 0, 6), train_layout({}, sel, 0, 6), tag + "one rank");
    exact(train_layout({.tp = 2, .sp = true}, g, 0, 6), train_layout({.tp = 2, .sp = true}, sel, 0, 6), tag + "tp 2 sp");
    // zb's weight pass computes them again too.
    exact(train_layout({.pp = 2, .schedule = "zb"}, g, 0, 6), train_layout({.pp = 2, .schedule = "zb"}, sel, 0, 6),
          tag + "pp 2 zb");
    exact(train_layout({.cp = 2}, g, 0, 6), train_layout({.cp = 2}, sel, 0, 6), tag + "cp 2");
  }
  // Bytes: the trainer's peak is dml::cost's exact figure; the RMSNorm and SwiGLU outputs are gone from it.
  auto sel = train_config();
  sel.selective_recompute = true;
  std::int64_t peaks[2] = {};
  for (const bool selective : {false, true}) {
    auto g = selective ? sel : train_config();
    comm::local::run(1, [&](comm::local& c) {
      trainer<parallel::replicate, optim::adamw> t(c, nn::llama(g), train::trainer_options{});
      std::vector<float> x(static_cast<std::size_t>(train_batch * train_seq));
      std::vector<std::int32_t> y(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7), y[i] = static_cast<std::int32_t>(i % 5);
      t.step(tensor_view<const float>(x.data(), {train_batch, train_seq}), y.data(), train_batch);
      peaks[selective] = t.peak_activation_bytes();
      CHECK(peaks[selective] == cost::activation_set_bytes(nn::llama(g), {train_batch, train_seq}, 4));
    });
  }
  MESSAGE("activation bytes: none " << peaks[0] << ", selective " << peaks[1] << " ("
                                    << 100.0 * double(peaks[0] - peaks[1]) / double(peaks[0]) << "% less)");
  CHECK(peaks[1] < peaks[0]);
}

TEST_CASE("each half-block makes one all-reduce in forward and one in backward") {
  auto g = train_config();
  g.layers = 1;
  const auto one_layer = train_layout({.tp = 2}, g, 0, 1);
  g.layers = 2;
  const auto two_layers = train_layout({.tp = 2}, g, 0, 1);
  CHECK(two_layers.forward_all_reduces - one_layer.forward_all_reduces == 2);
  CHECK(two_layers.backward_all_reduces - one_layer.backward_all_reduces == 2);
  // The rest: the embedding's sum and the vocabulary-parallel loss's sum (forward), the head's input gradient (backward).
  CHECK(two_layers.forward_all_reduces == 2 * 2 + 1 + 1);
  CHECK(two_layers.backward_all_reduces == 2 * 2 + 1);
}

TEST_CASE("llama checkpoints written under tensor parallelism resume on one rank, and back") {
  // The fused q/k/v parameter's parts (unequal blocks) go to their places in the whole tensor and back.
  const auto g = train_config();
  const auto whole = train_layout({}, g, 0, 12);
  for (const auto& [from, to] : {std::pair{run_layout{.tp = 2}, run_layout{}}, std::pair{run_layout{}, run_layout{.tp = 2}}}) {
    const dml_test::temp_dir dir("dml-llama-checkpoint");
    train_layout(from, g, 0, 6, {}, dir.path.string());
    auto resumed = train_layout(to, g, 6, 6, dir.path.string());
    auto tail = whole;
    tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 6);
    tail.grad_norms.erase(tail.grad_norms.begin(), tail.grad_norms.begin() + 6);
    check_same(tail, resumed, "tp " + std::to_string(from.tp) + " -> tp " + std::to_string(to.tp));
  }
}

TEST_CASE("llama: a trainer refuses a tensor-parallel degree that cannot share out the key/value heads") {
  const auto build = [](int ranks, train::trainer_options o, const nn::llama_config& g) {
    comm::local::run(ranks, [&](comm::local& c) { trainer<parallel::replicate, optim::adamw> t(c, nn::llama(g), o); });
  };
  train::trainer_options tp;
  tp.tensor_parallel = 8;
  auto mqa = train_config();
  mqa.kv_heads = 1;  // one head of 4 columns over 8 ranks
  CHECK_THROWS_WITH_AS(build(8, tp, mqa), doctest::Contains("kv_heads·head_dim divisible by 8, found 4"), invalid_argument);
}

TEST_CASE("llama with more tensor ranks than key/value heads (each shared by tp / kv_heads ranks) gives one rank's training") {
  // tp 4 over 2 key/value heads, and multi-query attention over tp 2 and 4: a rank holds a slice of its head's k and
  // v rows; forward all-gathers the slices and backward reduce-scatters their gradients, each once a block.
  const auto g = train_config();
  const auto one = train_layout({}, g);
  check_same(one, train_layout({.tp = 4}, g), "kv 2, tp 4");
  check_same(one, train_layout({.tp = 4, .sp = true}, g), "kv 2, tp 4 sp");
  check_same(one, train_layout({.tp = 4, .pp = 2, .schedule = "zb"}, g), "kv 2, tp 4 pp 2 zb");
  auto mqa = train_config();
  mqa.kv_heads = 1;
  const auto one_mqa = train_layout({}, mqa);
  check_same(one_mqa, train_layout({.tp = 2}, mqa), "kv 1, tp 2");
  check_same(one_mqa, train_layout({.tp = 4, .cp = 2}, mqa), "kv 1, tp 4 cp 2");
  check_same(one_mqa, train_layout({.tp = 4, .sp = true}, mqa), "kv 1, tp 4 sp");
  // A checkpoint written with shared heads resumes on one rank: every slice goes to its place in the whole tensor.
  const auto whole = train_layout({}, g, 0, 12);
  const dml_test::temp_dir dir("dml-llama-shared-kv");
  train_layout({.tp = 4}, g, 0, 6, {}, dir.path.string());
  auto resumed = train_layout({}, g, 6, 6, dir.path.string());
  auto tail = whole;
  tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 6);
  tail.grad_norms.erase(tail.grad_norms.begin(), tail.grad_norms.begin() + 6);
  check_same(tail, resumed, "tp 4 -> tp 1");
}

TEST_CASE("llama under context parallelism (ring attention, zig-zag and contiguous, and with tp) gives one rank's training") {
  // Grouped-query heads (8 query heads, 2 key/value heads): the ring passes K/V of the 2, RoPE turns each token by
  // its place in the whole sequence. Seen: losses to 1.0e-7 relative, gradient norms 1.1e-7, parameters 8.5e-7.
  const auto g = train_config();
  const auto one = train_layout({}, g);
  check_same(one, train_layout({.cp = 2}, g), "cp 2 zig-zag");
  check_same(one, train_layout({.cp = 2, .zigzag = false}, g), "cp 2 contiguous");
  check_same(one, train_layout({.tp = 2, .cp = 2}, g), "cp 2 tp 2 zig-zag");
  check_same(one, train_layout({.tp = 2, .sp = true, .cp = 2, .zigzag = false}, g), "cp 2 tp 2 sp contiguous");
  // K/V all-gathered over the context group (and their gradients reduce-scattered) instead of passed round it.
  check_same(one, train_layout({.cp = 2, .all_gather = true}, g), "cp 2 all-gather");
  check_same(one, train_layout({.tp = 2, .sp = true, .cp = 2, .all_gather = true}, g), "cp 2 all-gather tp 2 sp");
  const auto tied = train_layout({}, train_config(true));
  check_same(tied, train_layout({.cp = 2}, train_config(true)), "tied, cp 2");
}

TEST_CASE("llama with document masks: layouts give one rank's training, and masks change what is trained") {
  const auto g = train_config();
  const auto one = train_layout({.documents = true}, g);
  CHECK(one.losses.back() < one.losses.front() - 0.3f);
  check_same(one, train_layout({.tp = 2, .sp = true, .documents = true}, g), "documents, tp 2 sp");
  check_same(one, train_layout({.tp = 2, .pp = 2, .sp = true, .schedule = "zb", .documents = true}, g),
             "documents, tp 2 pp 2 sp zb");
  // Context parallelism: each rank's tokens carry their documents' starts in the whole sequence; the documents cross
  // the chunks (rows cut at 2..6 and 11 of 16).
  check_same(one, train_layout({.documents = true, .cp = 2}, g), "documents, cp 2 ring");
  check_same(one, train_layout({.documents = true, .cp = 2, .zigzag = false, .all_gather = true}, g),
             "documents, cp 2 all-gather contiguous");
  check_same(one, train_layout({.tp = 2, .documents = true, .cp = 2, .all_gather = true}, g), "documents, cp 2 all-gather tp 2");
  // The masks reach attention: the same batches without them train otherwise from the first step.
  const auto unmasked = train_layout({}, g, 0, 1);
  CHECK(std::abs(unmasked.losses[0] - one.losses[0]) > 1e-4f);
}

TEST_CASE("document masks with RoPE: two documents packed either way round give the same loss") {
  // Under a document mask a token sees only its own document, and RoPE's scores depend on relative positions only:
  // [A | B] and [B | A] (each token keeping its label) have the same per-token losses, up to the rotary table's
  // rounding at other absolute positions (seen: 6.9e-8 relative). Without the mask they differ.
  const auto g = train_config();
  constexpr std::int64_t half = train_seq / 2;
  std::mt19937 gen(5);
  std::vector<float> x(static_cast<std::size_t>(train_seq));
  std::vector<std::int32_t> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(gen() % g.vocab);
    y[i] = static_cast<std::int32_t>(gen() % g.vocab);
  }
  std::vector<float> xs(x.size());
  std::vector<std::int32_t> ys(y.size());
  std::rotate_copy(x.begin(), x.begin() + half, x.end(), xs.begin());
  std::rotate_copy(y.begin(), y.begin() + half, y.end(), ys.begin());
  std::vector<std::int64_t> doc(x.size());
  for (std::int64_t t = 0; t < train_seq; ++t) doc[static_cast<std::size_t>(t)] = t < half ? 0 : half;
  const auto first_loss = [&](const std::vector<float>& in, const std::vector<std::int32_t>& labels, bool masked) {
    float loss = 0;
    comm::local::run(1, [&](comm::local& c) {
      trainer<parallel::replicate, optim::adamw> t(c, nn::llama(g), {.seed = 3});
      loss = t.step(tensor_view<const float>(in.data(), {1, train_seq}), labels.data(), 1, masked ? doc.data() : nullptr).loss;
    });
    return loss;
  };
  const float ab = first_loss(x, y, true), ba = first_loss(xs, ys, true);
  MESSAGE("[A|B] " << ab << " [B|A] " << ba << ", relative difference " << std::abs(ab - ba) / std::abs(ab));
  CHECK(std::abs(ab - ba) <= 5e-7f * std::abs(ab));
  CHECK(std::abs(first_loss(x, y, false) - first_loss(xs, ys, false)) > 1e-4f);
}

TEST_CASE("document masks: a trainer refuses starts that are not runs of tokens, naming the token") {
  std::vector<float> x(8, 1.f);
  std::vector<std::int32_t> y(8, 1);
  std::vector<std::int64_t> doc{0, 0, 0, 1, 3, 3, 3, 3};  // token 3 neither starts a document (3) nor continues (0)
  comm::local::run(1, [&](comm::local& c) {
    trainer<parallel::replicate, optim::adamw> t(c, nn::llama(train_config()), {});
    CHECK_THROWS_WITH_AS(t.step(tensor_view<const float>(x.data(), {1, 8}), y.data(), 1, doc.data()),
                         doctest::Contains("expected token 3 of row 0 to start a document (3) or continue its "
                                           "predecessor's (0), found 1"),
                         invalid_argument);
  });
}


// Multi-head latent attention (DeepSeek-V2/V3): 4 heads of 6 + 4 query/key columns (nope, rope), values 8 wide,
// a query latent of 12 (or none) and a key/value latent of 10.
nn::llama_config latent_config(std::int64_t q_rank) {
  auto g = train_config();
  g.kv_heads = g.heads = 4;
  g.q_lora_rank = q_rank;
  g.kv_lora_rank = 10;
  g.qk_nope_dim = 6;
  g.qk_rope_dim = 4;
  g.v_head_dim = 8;
  return g;
}

TEST_CASE("latent attention: a block's every parameter and its input match finite differences, with and without a query latent") {
  for (const std::int64_t q_rank : {12, 0}) {
    auto g = latent_config(q_rank);
    g.d_model = 16;
    const nn::llama_block block(g);
    const auto names = block.parameters();
    REQUIRE(names.size() == (q_rank > 0 ? 11u : 9u));
    CHECK(names[1].name == (q_rank > 0 ? "self_attn.q_a_proj.weight" : "self_attn.q_proj.weight"));
    CHECK(names[q_rank > 0 ? 4 : 2].name == "self_attn.kv_a_proj_with_mqa.weight");
    CHECK(names[q_rank > 0 ? 4 : 2].shape == shape{10 + 4, 16});
    CHECK(names[q_rank > 0 ? 6 : 4].shape == shape{4 * (6 + 8), 10});  // kv_b_proj: each head's key and value
    CHECK(names[q_rank > 0 ? 7 : 5].shape == shape{16, 4 * 8});         // o_proj reads the values' columns
    const auto rep = nn::check_gradients(block, {2, 5, 16}, {.h = 1e-2f, .perturb = 0.3f, .per_tensor = 40});
    MESSAGE("latent llama_block q_lora_rank " << q_rank << " max_rel_diff=" << rep.max_rel << " (" << rep.worst
                                              << ") over " << rep.checked);
    CHECK(rep.checked > 240);
    // seen: 5.2e-3 to 9.6e-3; the worst grows as h shrinks (7.3e-3 at h 1e-2, 5.0e-2 at 2e-3): float rounding of the
    // loss through three RMSNorms in a row, not the step's truncation. A wrong term shows as O(1).
    CHECK(rep.max_rel < 2e-2);
  }
}

TEST_CASE("latent attention with dense first blocks and experts gives one rank's training under dp, ep, a pipeline and ZeRO-style splits") {
  auto g = moe_config();
  g.heads = g.kv_heads = 4;
  g.q_lora_rank = 12, g.kv_lora_rank = 10, g.qk_nope_dim = 6, g.qk_rope_dim = 4, g.v_head_dim = 8;
  g.layers = 3;
  g.moe_every = 1;
  g.first_dense = 1;  // block 0 dense, blocks 1 and 2 with experts (DeepSeek-V3's first_k_dense_replace)
  const auto whole = nn::llama(g);
  CHECK(!whole.get<1>().layers[0].experts);
  CHECK(whole.get<1>().layers[1].experts);
  CHECK(whole.get<1>().layers[2].experts);
  const auto one = train_layout({}, g);
  CHECK(one.losses.back() < one.losses.front() - 0.3f);  // it learns
  check_same(one, train_layout({.dp = 2, .ep = 2}, g), "dp 2 ep 2");
  check_same(one, train_layout({.pp = 2, .schedule = "1f1b"}, g), "pp 2 1f1b");
  check_same(one, train_layout({.pp = 2, .schedule = "zb", .dp = 2, .ep = 2}, g), "pp 2 zb dp 2 ep 2");
  // Selective recompute: the RMSNorm and SwiGLU outputs again in backward, the same bits.
  auto sel = g;
  sel.selective_recompute = true;
  const auto again = train_layout({}, sel);
  CHECK(again.losses == one.losses);
  CHECK(again.params == one.params);
}

TEST_CASE("latent attention: the trainer's bytes equal dml::cost's exact bytes and formula, its parameters the planner's count") {
  for (const std::int64_t q_rank : {12, 0})
    for (const bool selective : {false, true}) {
      auto g = latent_config(q_rank);
      g.selective_recompute = selective;
      const cost::model m{.layers = g.layers, .d_model = g.d_model, .heads = g.heads, .seq = g.seq, .vocab = g.vocab,
                          .arch = cost::architecture::llama, .kv_heads = g.kv_heads, .ffn_hidden = g.ffn_hidden,
                          .q_lora_rank = g.q_lora_rank, .kv_lora_rank = g.kv_lora_rank, .qk_nope_dim = g.qk_nope_dim,
                          .qk_rope_dim = g.qk_rope_dim, .v_head_dim = g.v_head_dim};
      CHECK(cost::llama_config_of(m, selective).head_dim() == g.head_dim());
      const auto part = nn::llama(g);
      comm::local::run(1, [&](comm::local& c) {
        trainer<parallel::replicate, optim::adamw> t(c, nn::llama(g), train::trainer_options{});
        std::vector<float> x(static_cast<std::size_t>(train_batch * train_seq));
        std::vector<std::int32_t> y(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7), y[i] = static_cast<std::int32_t>(i % 5);
        t.step(tensor_view<const float>(x.data(), {train_batch, train_seq}), y.data(), train_batch);
        CHECK(t.peak_activation_bytes() == cost::activation_set_bytes(part, {train_batch, train_seq}, 4));
        CHECK(cost::count_layers(m).total(m) == static_cast<double>(t.layout().numel));
      });
      // The formula's block bytes (what evaluate() prices) against the block's own: its saved set and its output.
      const auto& block = part.get<1>().layers[0];
      const dml::shape x{train_batch, train_seq, g.d_model};
      const double want = static_cast<double>(block.saved_bytes(x, 4) + x.numel() * 4);
      CHECK(cost::layer_activation_bytes(m, train_seq, train_batch, 1, 4, false,
                                         selective ? cost::recompute::selective : cost::recompute::none) == want);
    }
}

TEST_CASE("latent attention: configurations and layouts it does not serve are refused in one line") {
  auto g = latent_config(12);
  g.v_head_dim = 11;
  CHECK_THROWS_WITH_AS(g.validate(), doctest::Contains("expected v_head_dim <= qk_nope_dim + qk_rope_dim = 10"),
                       invalid_argument);
  g = latent_config(12);
  g.qk_rope_dim = 3;
  CHECK_THROWS_WITH_AS(g.validate(), doctest::Contains("expected an even qk_rope_dim"), invalid_argument);
  g = train_config();
  g.v_head_dim = 8;
  CHECK_THROWS_WITH_AS(g.validate(), doctest::Contains("needs kv_lora_rank > 0"), invalid_argument);
  nn::llama_block block(latent_config(12));
  CHECK_THROWS_WITH_AS(block.set_split({.ranks = 2, .rank = 0}), doctest::Contains("latent attention runs on one tensor rank"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(block.set_context_split({.ranks = 2, .rank = 0}),
                       doctest::Contains("latent attention runs on one context rank"), invalid_argument);
  auto moe = moe_config();
  moe.first_dense = 2;  // two layers, both dense: the experts have nowhere to go
  CHECK_THROWS_WITH_AS(nn::llama(moe), doctest::Contains("expected a block to hold the 4 experts"), invalid_argument);
}

}  // namespace test_llama
