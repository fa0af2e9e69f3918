// SPDX-License-Identifier: Apache-2.0
// dml/optim/learning_rate.hpp — the learning rate as a function of the step: constant, and linear warmup then
// cosine decay. (In dml, "schedule" names only the pipeline schedule: parallel/schedule.hpp.)
// Sits on nothing but the standard library; the trainer asks for lr(step) before each update.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>

namespace dml::optim {

struct constant_lr {
  float lr = 1e-3f;
  float operator()(std::int64_t) const { return lr; }
};

// lr rises linearly over `warmup` steps (step 1 gets lr/warmup), then follows a half cosine from lr
// down to min_lr at `total` steps, and stays there.
struct warmup_cosine {
  float lr = 1e-3f;
  std::int64_t warmup = 0;
  std::int64_t total = 1;
  float min_lr = 0.f;
  float operator()(std::int64_t step) const {
    if (warmup > 0 && step <= warmup) return lr * static_cast<float>(step) / static_cast<float>(warmup);
    if (step >= total) return min_lr;
    const double progress = static_cast<double>(step - warmup) / static_cast<double>(total - warmup);
    return static_cast<float>(min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(std::numbers::pi * progress)));
  }
};

}  // namespace dml::optim
