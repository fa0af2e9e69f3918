// SPDX-License-Identifier: Apache-2.0
// dml/nn/gradcheck.hpp — checks a layer's (or a whole model's) backward against central finite differences.
// Sits on nn/network.hpp; runs on the host (it moves one input or parameter at a time and runs forward again),
// and parses under nvcc, so dml.hpp includes it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "dml/core/rng.hpp"
#include "dml/core/tensor.hpp"
#include "dml/nn/layer.hpp"
#include "dml/nn/network.hpp"
#include "dml/nn/sequential.hpp"

namespace dml::nn {

struct gradcheck_options {
  float h = 1e-2f;         // the step: ∂L/∂v ≈ (L(v + h) − L(v − h)) / 2h
  std::uint64_t seed = 1;  // the initial parameters (those of a network with this seed), the input and the projection
  // Adds U(−perturb, perturb) to every parameter after initialisation: initial values such as ones or zeros can
  // hide a wrong gradient (a term that β multiplies vanishes from a check at β = 0 and goes unseen at β = 1).
  float perturb = 0.f;
  bool check_input = true;       // false: the parameters only (an input of ids has no gradient)
  std::int64_t per_tensor = 32;  // entries checked of each parameter and of the input, evenly spaced; 0: all
  context ctx{};                 // what forward and backward are told (training, dropout seed, row offset)
};

struct gradcheck_result {
  double max_abs = 0;  // the worst |analytic − numeric|
  // The worst |analytic − numeric| / max(0.01, |analytic| + |numeric|): relative, but not for gradients near 0,
  // where float rounding in the difference quotient dominates.
  double max_rel = 0;
  std::int64_t checked = 0;
  std::string worst;  // the entry with the worst relative difference: "0.weight[12]" or "input[3]"
};

// What a central difference divides by: 2h, or the step float made, (v + h) − (v − h) in double, which is not
// quite 2h when v + h or v − h rounds (so that rounding does not count as gradient error).
enum class difference_step { nominal, stored };

// ∂loss/∂v by a central difference: loss() with every one of `tied` at v + h, then at v − h (v: the first one's
// value), divided by the step; they all get v back. Tied values are one parameter held twice (a tied LM head).
template <class Loss>
double central_difference(std::initializer_list<float*> tied, float h, Loss&& loss,
                          difference_step step = difference_step::nominal) {
  const float keep = **tied.begin();
  for (float* p : tied) *p = keep + h;
  const double up = loss();
  for (float* p : tied) *p = keep - h;
  const double down = loss();
  for (float* p : tied) *p = keep;
  return (up - down) / (step == difference_step::nominal ? 2.0 * double(h) : double(keep + h) - double(keep - h));
}

// The same for one value.
template <class Loss>
double central_difference(float& v, float h, Loss&& loss, difference_step step = difference_step::nominal) {
  return central_difference({&v}, h, loss, step);
}

// Σ y·r summed in double: a scalar loss whose gradient with respect to y is r, so that one backward with dy = r
// exercises every output, and whose difference quotient sees only the layer's own rounding.
inline double projected_loss(std::span<const float> y, std::span<const float> r) {
  double s = 0;
  for (std::size_t i = 0; i < y.size(); ++i) s += double(y[i]) * double(r[i]);
  return s;
}

// |analytic − numeric| / max(floor, |analytic| + |numeric|): relative, but not for gradients near 0, where
// float rounding in the difference quotient dominates. The measure of gradcheck_result::max_rel.
inline double gradient_difference(double analytic, double numeric, double floor = 1e-2) {
  return std::abs(analytic - numeric) / std::max(floor, std::abs(analytic) + std::abs(numeric));
}

namespace detail {
template <class M>
struct as_sequential {
  static sequential<M> make(const M& layer) { return sequential<M>(layer); }
};
template <class... L>
struct as_sequential<sequential<L...>> {
  static const sequential<L...>& make(const sequential<L...>& model) { return model; }
};
}  // namespace detail

// Compares backward's gradients (of the input, and of every parameter) with central differences of
// L = Σ y·r, where y is the output at `input` and r a fixed random projection (so ∂L/∂y = r exercises every
// output). L is summed in double, so the difference quotient sees only the layer's own rounding.
// layer_or_model: a layer (run as a one-layer sequential) or a sequential.
template <class M>
gradcheck_result check_gradients(const M& layer_or_model, shape input_shape, std::span<const float> input,
                                 gradcheck_options opt = {}) {
  const auto& model = detail::as_sequential<M>::make(layer_or_model);
  if (static_cast<std::int64_t>(input.size()) != input_shape.numel())
    fail<shape_error>("dml::nn::check_gradients: input has ", input.size(), " values, expected ", input_shape.numel(),
                      " for shape ", input_shape);
  auto net = make_network(model, opt.seed);
  const auto& slots = net.layout().slots;
  if (opt.perturb != 0.f)
    for (const auto& s : slots)  // by init_id: tied parameters stay equal
      for (std::int64_t i = 0; i < s.shape.numel(); ++i)
        net.params()[std::size_t(s.offset + i)] +=
            rng_stream{opt.seed + 1, s.init_id}.uniform(std::uint64_t(i), -opt.perturb, opt.perturb);

  std::vector<float> x(input.begin(), input.end());  // moved in place; forward reads it where it is
  const tensor_view<const float> xv(x.data(), input_shape);
  const shape ys = model.output_shape(input_shape);
  std::vector<float> r(std::size_t(ys.numel()));
  for (std::size_t i = 0; i < r.size(); ++i) r[i] = rng_stream{opt.seed, 1}.uniform(i, -1.f, 1.f);
  const auto loss = [&] {
    const auto y = net.forward(xv, opt.ctx);
    return projected_loss({y.data, std::size_t(y.numel())}, r);
  };

  net.forward(xv, opt.ctx);
  const auto dx = net.backward(tensor_view<const float>(r.data(), ys), opt.ctx, opt.check_input);
  const std::vector<float> grad_x(dx.data, dx.data + (opt.check_input ? dx.numel() : 0));
  const std::vector<float> grads(net.grads().begin(), net.grads().end());

  gradcheck_result out;
  const auto check = [&](float* v, std::int64_t n, const float* analytic, const std::string& name) {
    const std::int64_t stride = opt.per_tensor > 0 ? std::max<std::int64_t>(1, n / opt.per_tensor) : 1;
    for (std::int64_t i = 0; i < n; i += stride) {
      const double numeric = central_difference(v[i], opt.h, loss), a = analytic[i], diff = std::abs(a - numeric);
      const double rel = gradient_difference(a, numeric);
      out.max_abs = std::max(out.max_abs, diff);
      if (out.checked++ == 0 || rel > out.max_rel) out.max_rel = rel, out.worst = name + "[" + std::to_string(i) + "]";
    }
  };
  for (const auto& s : slots)
    check(net.params().data() + s.offset, s.shape.numel(), grads.data() + s.offset, s.name);
  if (opt.check_input) check(x.data(), input_shape.numel(), grad_x.data(), "input");
  return out;
}

// The same at a random input of the given shape, uniform in [−1, 1).
template <class M>
gradcheck_result check_gradients(const M& layer_or_model, shape input_shape, gradcheck_options opt = {}) {
  std::vector<float> x(std::size_t(input_shape.numel()));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = rng_stream{opt.seed, 0}.uniform(i, -1.f, 1.f);
  return check_gradients(layer_or_model, input_shape, x, opt);
}

}  // namespace dml::nn
