// SPDX-License-Identifier: Apache-2.0
// dml/optim/loss_scaler.hpp — dynamic loss scaling for fp16/bf16 training, as torch.amp.GradScaler.
// Sits on core/; the trainer scales the loss, checks gradients, reduces the flag over ranks, then updates.
#pragma once

#include <cmath>
#include <cstdint>

#include "dml/core/algorithm.hpp"
#include "dml/core/cast.hpp"
#include "dml/core/error.hpp"

namespace dml::optim {

namespace kernels {
// 1 where x is inf or NaN. The exponent bits decide, not std::isfinite, so that -ffast-math (which
// lets the compiler assume finite values) cannot fold the check away.
struct nonfinite {
  DML_HOST_DEVICE static int test(float x) { return (dml::detail::float_bits(x) & 0x7f800000u) == 0x7f800000u; }
  DML_HOST_DEVICE static int test(bf16 x) { return (x.bits & 0x7f80u) == 0x7f80u; }
  DML_HOST_DEVICE static int test(fp16 x) { return (x.bits & 0x7c00u) == 0x7c00u; }
};
template <float_like T>
struct count_nonfinite {
  const T* p;
  DML_HOST_DEVICE int operator()(std::int64_t i) const { return nonfinite::test(p[i]); }
};
}  // namespace kernels

// Whether any of p[0..n) is inf or NaN: the "found_inf" of one rank's gradients. Sharded trainers
// combine the flags of all ranks (an all_reduce of max) before loss_scaler::update, so that every
// rank skips or applies the same step. Where gradients are clipped anyway, the squared norm already
// tells: it is finite exactly when every gradient is (see optim/clip.hpp).
template <execution_space S, float_like T>
bool has_nonfinite(const T* p, std::int64_t n) {
  return transform_reduce_index<S>(n, kernels::count_nonfinite<T>{p}, 0, dml::max_op{}) != 0;
}

// The scale multiplies the loss before backward so that small gradients survive in 16 bits; the
// optimizer divides it out again (step_args::grad_scale = inv_scale()). An overflow means the
// scale is too large: that step is skipped and the scale backs off. After growth_interval clean
// steps in a row it grows again. The defaults are GradScaler's.
class loss_scaler {
 public:
  struct options {
    float init_scale = 65536.f;  // 2^16
    float growth_factor = 2.f;
    float backoff_factor = 0.5f;
    std::int64_t growth_interval = 2000;
  };

  loss_scaler() : loss_scaler(options{}) {}
  explicit loss_scaler(options o) : opt_(o), scale_(o.init_scale) {
    if (!(o.init_scale > 0.f) || !std::isfinite(o.init_scale))
      fail<invalid_argument>("dml::optim::loss_scaler: expected a finite init_scale > 0, found ", o.init_scale);
    if (!(o.growth_factor > 1.f))
      fail<invalid_argument>("dml::optim::loss_scaler: expected growth_factor > 1, found ", o.growth_factor);
    if (!(o.backoff_factor > 0.f && o.backoff_factor < 1.f))
      fail<invalid_argument>("dml::optim::loss_scaler: expected backoff_factor in (0, 1), found ", o.backoff_factor);
    if (o.growth_interval < 1)
      fail<invalid_argument>("dml::optim::loss_scaler: expected growth_interval >= 1, found ", o.growth_interval);
  }

  float scale() const { return scale_; }
  // The factor that removes the scale from the gradients. Powers of two make it exact; the reciprocal
  // is taken in double and rounded once, as GradScaler does.
  float inv_scale() const { return static_cast<float>(1.0 / static_cast<double>(scale_)); }
  // Clean steps since the last overflow or growth.
  std::int64_t growth_tracker() const { return growth_tracker_; }
  const options& opts() const { return opt_; }

  // Call once per step with the flag of all ranks together. Returns whether the optimizer step
  // should be applied, which is false exactly when found_inf is true.
  bool update(bool found_inf) {
    if (found_inf) {
      scale_ *= opt_.backoff_factor;
      growth_tracker_ = 0;
      return false;
    }
    if (++growth_tracker_ == opt_.growth_interval) {
      // A scale that would overflow float stays where it is, as in GradScaler.
      const float grown = scale_ * opt_.growth_factor;
      if (std::isfinite(grown)) scale_ = grown;
      growth_tracker_ = 0;
    }
    return true;
  }

  // For checkpoints: the state that update() carries between steps.
  void restore(float scale, std::int64_t growth_tracker) {
    if (!(scale > 0.f) || !std::isfinite(scale) || growth_tracker < 0 || growth_tracker >= opt_.growth_interval)
      fail<invalid_argument>("dml::optim::loss_scaler::restore: expected a finite scale > 0 and a tracker in [0, ",
                             opt_.growth_interval, "), found scale=", scale, " tracker=", growth_tracker);
    scale_ = scale;
    growth_tracker_ = growth_tracker;
  }

 private:
  options opt_;
  float scale_;
  std::int64_t growth_tracker_ = 0;
};

}  // namespace dml::optim
