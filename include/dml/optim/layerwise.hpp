// SPDX-License-Identifier: Apache-2.0
// dml/optim/layerwise.hpp — what layer-wise optimizers (LAMB, LARS) add to optimizer.hpp: per-tensor pieces of a
// flat range and the two passes around one reduction of per-tensor sums. Sits on optim/optimizer.hpp;
// optim/lamb.hpp and optim/lars.hpp model it, parallel/replicate.hpp and parallel/zero.hpp drive it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <variant>
#include <vector>

#include "dml/optim/optimizer.hpp"

namespace dml::optim {

// Elements [begin, end) of a step_args range that belong to parameter tensor `tensor` (a layout slot).
// adapt: the tensor takes weight decay and a trust ratio. dml adapts tensors of rank 2 and more (weight
// matrices, embeddings) and leaves 1-D tensors (biases, layer-norm gains and shifts) to the plain update,
// as You et al. do.
struct tensor_piece {
  std::int64_t begin = 0, end = 0;
  std::int64_t tensor = 0;
  bool adapt = true;
};

// A layer-wise optimizer O says `static constexpr bool layerwise = true` and has, beside update (which treats
// its whole range as one tensor):
//   o.prepare<S>(a, pieces, sums)  first pass: advances the state where the update needs it first, and adds
//                                  each piece's Σw² into sums[2·tensor] and Σu² into sums[2·tensor + 1]
//   o.apply<S>(a, pieces, sums)    second pass, once sums hold whole tensors' sums: the update
// A sharding sums `sums` over the ranks that share the tensors between prepare and apply: one reduction.
template <class O>
inline constexpr bool layerwise_v = requires { requires O::layerwise; };

// Whether o, as chosen now, is layer-wise (any_of answers for its chosen alternative).
template <class O>
bool uses_layerwise(const O& o) {
  if constexpr (requires { o.uses_layerwise(); }) return o.uses_layerwise();
  else return layerwise_v<O>;
}

// A layout's slots as pieces of its whole flat range (L is an nn::param_layout).
template <class L>
std::vector<tensor_piece> whole_tensors(const L& layout) {
  std::vector<tensor_piece> out;
  for (std::size_t s = 0; s < layout.slots.size(); ++s) {
    const auto& sl = layout.slots[s];
    out.push_back({sl.offset, sl.offset + sl.shape.numel(), static_cast<std::int64_t>(s), sl.shape.rank > 1});
  }
  return out;
}

// Both passes with no reduction between them: the pieces cover whole tensors (one rank, or DDP).
template <execution_space S, class O>
void update_tensors(const O& o, const step_args& a, std::span<const tensor_piece> pieces) {
  std::int64_t tensors = 0;
  for (const auto& p : pieces) tensors = std::max(tensors, p.tensor + 1);
  std::vector<double> sums(static_cast<std::size_t>(2 * tensors), 0.0);
  o.template prepare<S>(a, pieces, sums.data());
  o.template apply<S>(a, pieces, sums.data());
}

// The optimizer's whole update over a layout's flat range: layer-wise optimizers per tensor, the others in
// one pass (what a one-rank training loop calls).
template <execution_space S, class O, class L>
void update_layout(const O& o, const step_args& a, const L& layout) {
  if constexpr (layerwise_v<O>) {
    if (uses_layerwise(o)) {
      const auto pieces = whole_tensors(layout);
      return update_tensors<S>(o, a, pieces);
    }
  }
  o.template update<S>(a);
}

namespace detail {
// Two sums reduced together in one pass.
struct sum2 {
  double w = 0, u = 0;
  DML_HOST_DEVICE friend sum2 operator+(sum2 a, sum2 b) { return {a.w + b.w, a.u + b.u}; }
};
// The trust ratio from reduced sums: ‖w‖/‖u‖ (LAMB) or η‖w‖/(‖g‖ + λ‖w‖) (LARS), 1 when either norm is 0,
// then at most `clip` when clip > 0.
inline float trust_ratio(double sw, double su, double eta, double wd, float clip) {
  const double nw = std::sqrt(sw), nu = std::sqrt(su);
  double r = nw > 0 && nu > 0 ? eta * nw / (nu + wd * nw) : 1.0;
  if (clip > 0 && r > clip) r = clip;
  return static_cast<float>(r);
}
// Pieces whole: the range as one adapted tensor.
template <execution_space S, class O>
void update_as_one_tensor(const O& o, const step_args& a) {
  const tensor_piece one{0, a.n, 0, true};
  update_tensors<S>(o, a, std::span<const tensor_piece>(&one, 1));
}
}  // namespace detail

}  // namespace dml::optim
