// SPDX-License-Identifier: Apache-2.0
// dml/train/sampler.hpp — the order of samples in an epoch, and each rank's slice of a global batch.
// Sits on core/rng.hpp; the global order depends on (seed, epoch) only, never on the rank count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include "dml/core/error.hpp"
#include "dml/core/rng.hpp"

namespace dml::train {

struct sampler {
  std::int64_t size = 0;         // samples in the dataset
  std::int64_t batch = 1;        // global batch
  std::uint64_t seed = 0;
  bool shuffle = true;
  bool drop_last = false;        // a short last batch is kept unless asked otherwise

  sampler(std::int64_t n, std::int64_t global_batch, std::uint64_t s = 0, bool shuffled = true, bool drop = false)
      : size(n), batch(global_batch), seed(s), shuffle(shuffled), drop_last(drop) {
    if (n < 0 || global_batch <= 0)
      fail<invalid_argument>("dml::train::sampler: expected size >= 0 and batch > 0, found size=", n,
                             " batch=", global_batch);
  }

  std::int64_t batches_per_epoch() const { return drop_last ? size / batch : (size + batch - 1) / batch; }

  // Fisher–Yates driven by Philox at (seed, epoch): the permutation is a function of those two alone.
  std::vector<std::int64_t> order(std::uint64_t epoch) const {
    std::vector<std::int64_t> idx(static_cast<std::size_t>(size));
    std::iota(idx.begin(), idx.end(), std::int64_t{0});
    if (!shuffle) return idx;
    const rng_stream rng{seed, 0x5a3d1e00ull + epoch};
    for (std::int64_t i = size - 1; i > 0; --i) {
      const auto w = rng.block(static_cast<std::uint64_t>(i));
      const std::uint64_t r = (std::uint64_t(w[0]) << 32) | w[1];
      std::swap(idx[static_cast<std::size_t>(i)], idx[static_cast<std::size_t>(r % std::uint64_t(i + 1))]);
    }
    return idx;
  }

  // Rank `rank`'s rows of training step `step` (counted across epochs) from a row-major data set with
  // `width` values and one label per sample, copied into xb and yb (resized to fit). Returns the
  // number of rows.
  template <class X, class Y>
  std::int64_t gather(std::int64_t step, int rank, int ranks, const X* x, std::int64_t width, const Y* y,
                      std::vector<X>& xb, std::vector<Y>& yb) const {
    const std::int64_t per = batches_per_epoch();
    if (per == 0) fail<invalid_argument>("dml::train::sampler::gather: the data set has no full batch");
    const auto all = order(static_cast<std::uint64_t>(step / per));
    const auto idx = slice(all, step % per, batch, rank, ranks);
    xb.resize(idx.size() * static_cast<std::size_t>(width));
    yb.resize(idx.size());
    for (std::size_t i = 0; i < idx.size(); ++i) {
      const auto row = static_cast<std::size_t>(idx[i]);
      std::copy_n(x + row * static_cast<std::size_t>(width), width, xb.data() + i * static_cast<std::size_t>(width));
      yb[i] = y[row];
    }
    return static_cast<std::int64_t>(idx.size());
  }

  // Rank `rank` of `ranks` gets a contiguous, disjoint slice of batch b; the slices cover the batch.
  static std::span<const std::int64_t> slice(std::span<const std::int64_t> order, std::int64_t b, std::int64_t batch,
                                            int rank = 0, int ranks = 1) {
    const std::int64_t begin = b * batch;
    const std::int64_t n = std::min<std::int64_t>(batch, static_cast<std::int64_t>(order.size()) - begin);
    const std::int64_t lo = n * rank / ranks, hi = n * (rank + 1) / ranks;
    return order.subspan(static_cast<std::size_t>(begin + lo), static_cast<std::size_t>(hi - lo));
  }
};

}  // namespace dml::train
