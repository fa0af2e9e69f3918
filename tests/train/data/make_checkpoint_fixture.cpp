// SPDX-License-Identifier: Apache-2.0
// tests/train/data/make_checkpoint_fixture.cpp — writes checkpoint-6a692e0/: a checkpoint saved by dml as it
// was at 6a692e0 (before the composition work moved sharding, ownership and checkpoint I/O), for
// test_checkpoint's "a checkpoint of an earlier release loads". Not built by the project; to write it again:
//   git worktree add /tmp/dml-6a692e0 6a692e0
//   g++ -std=gnu++20 -O2 -fopenmp -I/tmp/dml-6a692e0/include -isystem /usr/local/cuda/include/cccl \
//       make_checkpoint_fixture.cpp -o make_fixture -ldnnl && ./make_fixture checkpoint-6a692e0
// It trains the MLP below for 3 steps under zero<2> on 2 comm::local ranks, saves, and writes expected.txt:
// the whole parameters after step 3 (slot by slot, padding left out) and the losses of steps 4 to 6 of the uninterrupted run.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "dml/comm/local.hpp"
#include "dml/dml.hpp"

using namespace dml;

// The same in the test: 8 rows of 6 features, step-dependent, labels row % 4.
static void batch(int step, int first, int rows, std::vector<float>& x, std::vector<std::int32_t>& y) {
  x.resize(static_cast<std::size_t>(rows) * 6);
  y.resize(static_cast<std::size_t>(rows));
  for (int r = 0; r < rows; ++r) {
    for (int f = 0; f < 6; ++f) x[static_cast<std::size_t>(r * 6 + f)] = std::sin(0.37f * float((first + r) * 6 + f) + float(step));
    y[static_cast<std::size_t>(r)] = (first + r) % 4;
  }
}

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : "checkpoint-6a692e0";
  const auto model = nn::sequential{nn::linear{6, 16}, nn::gelu{}, nn::linear{16, 4}};
  std::vector<float> params;
  std::vector<float> losses;
  comm::local::run(2, [&](comm::local& c) {
    trainer<parallel::zero<2>, optim::adamw> t(c, model, {.seed = 3}, optim::adamw({.lr = 1e-2f}));
    std::vector<float> x;
    std::vector<std::int32_t> y;
    for (int s = 1; s <= 6; ++s) {
      batch(s, 4 * c.rank(), 4, x, y);
      const auto r = t.step(tensor_view<const float>(x.data(), {4, 6}), y.data(), 8);
      if (s == 3) {
        t.save_checkpoint(dir);
        const auto p = t.full_parameters();  // padded: keep each slot's elements, in slot order
        if (c.rank() == 0)
          for (const auto& slot : t.layout().slots)
            params.insert(params.end(), p.begin() + slot.offset, p.begin() + slot.offset + slot.shape.numel());
      }
      if (s > 3 && c.rank() == 0) losses.push_back(r.loss);
    }
  });
  std::ofstream out(dir + "/expected.txt");
  out << "params " << params.size() << "\n";
  char buf[32];
  for (float v : params) {
    std::snprintf(buf, sizeof buf, "%a\n", double(v));
    out << buf;
  }
  out << "losses " << losses.size() << "\n";
  for (float v : losses) {
    std::snprintf(buf, sizeof buf, "%a\n", double(v));
    out << buf;
  }
  std::printf("wrote %s: %zu parameters, losses %g %g %g\n", dir.c_str(), params.size(), losses[0], losses[1], losses[2]);
}
