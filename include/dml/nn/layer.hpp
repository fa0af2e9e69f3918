// SPDX-License-Identifier: Apache-2.0
// dml/nn/layer.hpp — what a layer is: parameter specs, shape rule, forward and backward on views.
// Sits on core/; every file in nn/ models this concept. See DESIGN.md §1 and §2.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dml/core/tensor.hpp"
#include "dml/nn/rank_group.hpp"

namespace dml::nn {

class kv_cache;  // nn/kv_cache.hpp

// A width that is only known at run time.
inline constexpr std::int64_t dynamic = -1;

// How a parameter starts; the numbers follow PyTorch's defaults for each layer type.
enum class init_kind : std::uint8_t { zeros, ones, uniform, normal };

// Where a tensor-parallel rank's part of a parameter sits in the whole one. The whole, seen as a matrix
// [rows, cols] (cols: the product of every dimension after the first), is cut along `axis` (0: rows, 1:
// cols) into `blocks` equal blocks (3 for fused q, k, v), and each block into `ranks` equal parts; this
// rank holds part `rank` of every block, in block order. A parameter with ranks == 1 is whole on
// every rank of the group. With `lead` > 0 the first block is `lead` long along the axis and the others share
// what remains equally (fused q, k, v of grouped-query attention: q's block holds heads/kv_heads times k's rows).
//
// The same description serves expert parallelism: a stack of experts' weights cut over the expert group
// (group == expert), where rank and ranks are the expert-parallel rank and degree.
enum class shard_group : std::uint8_t { tensor, expert };
struct param_shard {
  std::int64_t rows = 0, cols = 0;  // of the whole parameter
  int axis = 0, blocks = 1, rank = 0, ranks = 1;
  shard_group group = shard_group::tensor;
  std::int64_t lead = 0;  // the first block's length along axis (blocks > 1); 0: every block is equally long
  bool tensor_sharded() const { return ranks > 1 && group == shard_group::tensor; }
  bool expert_sharded() const { return ranks > 1 && group == shard_group::expert; }
  bool sharded() const { return ranks > 1; }
  // The element of the whole parameter that local element i is.
  DML_HOST_DEVICE std::int64_t whole_index(std::int64_t i) const {
    if (ranks == 1) return i;
    if (lead > 0 && blocks > 1) {
      if (axis == 0) return lead_along(i / cols, rows) * cols + i % cols;
      const std::int64_t local = cols / ranks;
      return (i / local) * cols + lead_along(i % local, cols);
    }
    if (axis == 0) {
      const std::int64_t part = rows / blocks / ranks, r = i / cols;
      return ((r / part) * (rows / blocks) + rank * part + r % part) * cols + i % cols;
    }
    const std::int64_t part = cols / blocks / ranks, local = cols / ranks, c = i % local;
    return (i / local) * cols + (c / part) * (cols / blocks) + rank * part + c % part;
  }
  // With a lead block: the whole index along the axis (of length `along`) of local index k there.
  DML_HOST_DEVICE std::int64_t lead_along(std::int64_t k, std::int64_t along) const {
    const std::int64_t first = lead / ranks, rest = (along - lead) / (blocks - 1), part = rest / ranks;
    if (k < first) return rank * first + k;
    k -= first;
    return lead + (k / part) * rest + rank * part + k % part;
  }
};

struct param_spec {
  std::string name;  // PyTorch's name within the layer: "weight", "bias"
  dml::shape shape;  // of this rank's part under tensor parallelism
  init_kind init = init_kind::zeros;
  float a = 0.f, b = 0.f;  // uniform(a, b) or normal(mean a, std b)
  param_shard shard{};
  // The gradient is this rank's part of a sum over the tensor group (a parameter that sees a slice of
  // the sequence under sequence parallelism): the network sums it over the group once it is complete.
  bool partial_over_tensor_group = false;
  // Tied to another parameter of the model (its full name, e.g. "wte.weight"): this one starts from the same
  // values and a trainer sums the two gradients, so both stay equal (GPT's LM head and token embedding).
  std::string tied_to{};
};

// What a layer that routes tokens (a mixture of experts) records in one forward. The counts and losses are
// of the whole micro-batch (summed over the data group), so every rank of the group records the same.
struct routing_record {
  std::vector<std::int64_t> tokens, dropped;  // per expert: top-k assignments routed to it, and those dropped
  std::int64_t a2a_bytes = 0;                 // this rank's all-to-all payload sent (dispatch and combine)
  double aux_loss = 0, z_loss = 0;            // unweighted: the load-balancing loss and the router z-loss
  double share = 1;                           // the micro-batch's share of the step's batch
  float bias_rate = 0;                        // the layer's balancing rate (moe_config::bias_rate; 0: none)
};
// Records by (layer, first global row of the micro-batch): a recomputed forward overwrites its own record.
// router_bias: each balancing layer's selection bias by layer, kept across steps (the records are the step's
// own); parallel::update_router_bias moves it once a step is done.
struct routing_log {
  std::map<std::pair<std::uint64_t, std::int64_t>, routing_record> records;
  std::map<std::uint64_t, std::vector<float>> router_bias;
};

// What every layer call sees besides its tensors.
struct context {
  bool training = true;
  std::uint64_t seed = 0;    // dropout masks depend on (seed, step, layer, global row, column) only
  std::uint64_t step = 0;
  std::uint64_t layer = 0;   // index of the layer in its sequential
  // Index within the global batch of the input's first row (dimension 0): a rank or micro-batch that
  // holds rows [row_offset, row_offset + n) sets it, so per-row randomness matches one rank's.
  std::int64_t row_offset = 0;
  bool accumulate = false;   // add parameter gradients to what is there (micro-batches)
  // Packed sequences: for every token (row, t) of the input, the position its document starts at; attention sees
  // only its own document's keys (nn/tile_attention.hpp). In the layer's space; null: one document per row.
  const std::int64_t* doc_start = nullptr;
  // false: a layer that declares `splits_backward` computes only its input gradient (split backward;
  // the weight pass calls it again with dx.data null and this true).
  bool weight_grads = true;
  // Split backward of a layer that declares stash_bytes: its own bytes, kept from the input pass (which fills
  // them; weight_grads false) to the weight pass (which reads them; weight_grads true, dx.data null). Else null.
  std::byte* stash = nullptr;
  const void* ones = nullptr;    // at least rows() ones of the working type in the layer's space (bias gradients)
  float* workspace = nullptr;    // scratch of the size the layer's workspace_size(x) asked for
  // What forward leaves for backward beyond x and y, kept per activation set: saved_bytes(x) bytes,
  // 64-byte aligned, for layers that declare saved_bytes.
  std::byte* saved = nullptr;
  // The tensor-parallel group (null or size 1: no tensor parallelism).
  rank_group* tp = nullptr;
  // This backward completes the gradients of the step (the last micro-batch, or each one where they are
  // reduced every backward): partial sums over the tensor group are summed now.
  bool gradients_complete = true;
  // The rest serve mixture-of-experts and context-parallel layers; the defaults mean neither is in use.
  // Expert parallelism: the group that shares out a layer's experts (null or size 1: every expert here).
  rank_group* ep = nullptr;
  // Context parallelism: the ring of ranks holding the chunks of each sequence (null or size 1: whole ones),
  // zig-zag: rank r holds chunks r and 2·cp−1−r of 2·cp, else chunk r of cp.
  rank_group* cp = nullptr;
  bool cp_zigzag = true;
  // The data-parallel group: the ranks whose rows together make the global batch (null: this rank alone).
  // Layers with batch statistics (a router's load) sum them over it.
  rank_group* data = nullptr;
  std::int64_t global_batch = 0;  // rows of the step's global batch (0: this call's rows are all of it)
  float loss_scale = 1.f;         // gradients of auxiliary losses are scaled as the main loss's are
  routing_log* routing = nullptr; // where routing layers record their accounting (null: nowhere)
  // Incremental decoding (nn/kv_cache.hpp): attention layers read the keys and values of earlier positions from it
  // and add this call's; the input is the tokens after them. Null: every call is whole sequences.
  kv_cache* kv = nullptr;
};

// This rank's part of a tensor-parallel group of `ranks`; `sequence`: sequence parallelism too. Layers
// with a tensor-parallel form take it in `void set_split(tensor_split)` (see nn/gpt.hpp).
struct tensor_split {
  int ranks = 1, rank = 0;
  bool sequence = false;
  friend bool operator==(const tensor_split&, const tensor_split&) = default;
};

// This rank's chunk of every sequence under context parallelism: rank of a ring of `ranks`; zig-zag: chunks
// rank and 2·ranks−1−rank of 2·ranks, else chunk rank of ranks. all_gather: attention gathers every rank's K/V at
// once (and reduce-scatters their gradients) instead of passing them round the ring (nn/ring_attention.hpp). Layers
// that need it take it in `void set_context_split(context_split)` (the GPT's and Llama's embedding, blocks and head).
struct context_split {
  int ranks = 1, rank = 0;
  bool zigzag = true;
  bool all_gather = false;
  friend bool operator==(const context_split&, const context_split&) = default;
};
// The position in a sequence of `seq` tokens of this rank's local token i (0 <= i < seq / ranks).
DML_HOST_DEVICE std::int64_t cp_position(const context_split& s, std::int64_t seq, std::int64_t i) {
  if (s.ranks <= 1) return i;
  if (!s.zigzag) return s.rank * (seq / s.ranks) + i;
  const std::int64_t chunk = seq / (2 * s.ranks);
  return i < chunk ? s.rank * chunk + i : (2 * s.ranks - 1 - s.rank) * chunk + (i - chunk);
}
// The inverse: the local index of position pos, or −1 where another rank of the ring holds it.
DML_HOST_DEVICE std::int64_t cp_local_index(const context_split& s, std::int64_t seq, std::int64_t pos) {
  if (s.ranks <= 1) return pos;
  if (!s.zigzag) {
    const std::int64_t c = seq / s.ranks;
    return pos / c == s.rank ? pos % c : -1;
  }
  const std::int64_t c = seq / (2 * s.ranks), k = pos / c;
  return k == s.rank ? pos % c : k == 2 * s.ranks - 1 - s.rank ? c + pos % c : -1;
}

// A layer's parameters and their gradients: pointers into the flat buffers, in spec order, of the
// network's working type (float, or bf16/fp16 under mixed precision).
template <class T = float>
struct layer_params {
  T* const* w = nullptr;
  T* const* g = nullptr;
};

template <class L>
concept has_shape_rule = requires(const L& l, dml::shape s) {
  { l.output_shape(s) } -> std::same_as<dml::shape>;
};
template <class L>
concept has_parameters = requires(const L& l) {
  { l.parameters() } -> std::same_as<std::vector<param_spec>>;
};
template <class L>
concept has_host_forward = requires(const L& l, const context& c, layer_params<float> p, tensor_view<const float> x,
                                    tensor_view<float> y) { l.template forward<host>(c, p, x, y); };
template <class L>
concept has_host_backward = requires(const L& l, const context& c, layer_params<float> p, tensor_view<const float> x,
                                     tensor_view<const float> y, tensor_view<const float> dy,
                                     tensor_view<float> dx) { l.template backward<host>(c, p, x, y, dy, dx); };
template <class L>
concept has_static_widths = requires {
  { L::static_in } -> std::convertible_to<std::int64_t>;
  { L::static_out } -> std::convertible_to<std::int64_t>;
  { L::kind } -> std::convertible_to<const char*>;
};

// Layers that read context::row_offset say so (`static constexpr bool uses_row_index = true`); a
// trainer computes the offset, which costs a collective, only for models that have one.
template <class L>
inline constexpr bool uses_row_index_v = requires { requires L::uses_row_index; };

template <class L>
concept has_workspace = requires(const L& l, dml::shape s) {
  { l.workspace_size(s) } -> std::convertible_to<std::int64_t>;
};
// Floats of scratch a layer's backward needs for input shape x (0 unless it says otherwise).
template <class L>
std::int64_t workspace_size(const L& l, const dml::shape& x) {
  if constexpr (has_workspace<L>) return l.workspace_size(x);
  else return 0;
}

template <class L>
concept has_saved = requires(const L& l, dml::shape s) {
  { l.saved_bytes(s, std::size_t{4}) } -> std::convertible_to<std::int64_t>;
};
// Bytes a layer keeps from forward for backward, for input shape x and working type of value_bytes.
template <class L>
std::int64_t saved_bytes(const L& l, const dml::shape& x, std::size_t value_bytes) {
  if constexpr (has_saved<L>) return l.saved_bytes(x, value_bytes);
  else return 0;
}

template <class L>
concept has_flops = requires(const L& l, dml::shape s) {
  { l.forward_flops(s) } -> std::convertible_to<double>;
};
// Floating-point operations of this rank's forward pass for input shape x: 2 per multiply-add of the layer's
// products (a layer with products says so, `double forward_flops(dml::shape) const`), else one per output element.
template <class L>
double forward_flops(const L& l, const dml::shape& x) {
  if constexpr (has_flops<L>) return l.forward_flops(x);
  else return static_cast<double>(l.output_shape(x).numel());
}
// A layer: a shape rule, named parameters, and forward/backward in any execution space.
// backward writes dx (skipped when dx.data is null) and writes or accumulates parameter gradients.
template <class L>
concept layer = std::copy_constructible<L> && has_shape_rule<L> && has_parameters<L> && has_host_forward<L> &&
                has_host_backward<L> && has_static_widths<L>;

template <class L>
consteval bool diagnose_layer() {
  static_assert(has_static_widths<L>,
                "dml::nn::layer needs `static constexpr std::int64_t static_in, static_out` (or nn::dynamic) "
                "and `static constexpr const char* kind`");
  static_assert(has_shape_rule<L>, "dml::nn::layer needs `dml::shape output_shape(dml::shape) const`");
  static_assert(has_parameters<L>, "dml::nn::layer needs `std::vector<param_spec> parameters() const`");
  static_assert(has_host_forward<L>,
                "dml::nn::layer needs `template <execution_space S> void forward(const context&, layer_params, "
                "tensor_view<const float, S> x, tensor_view<float, S> y) const`");
  static_assert(has_host_backward<L>,
                "dml::nn::layer needs `template <execution_space S> void backward(const context&, layer_params, "
                "tensor_view<const float, S> x, y, dy, tensor_view<float, S> dx) const`");
  return true;
}

namespace detail {
inline void expect_cols(const char* kind, std::int64_t expected, const dml::shape& x) {
  if (x.rank == 0 || x.cols() != expected)
    fail<shape_error>("dml::nn::", kind, ": expected input with last dimension ", expected, ", found shape ", x);
}
}  // namespace detail

}  // namespace dml::nn
