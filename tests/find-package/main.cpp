// SPDX-License-Identifier: Apache-2.0
// A program that uses dml as a consumer would, through dml::dml only; built by the packaging
// tests against an installed dml (find-package/) and a source tree (add-subdirectory/).
#include <dml/dml.hpp>
#include <dml/core/algorithm.hpp>
#include <dml/core/tensor.hpp>

#include <cstdint>
#include <cstdio>

int main() {
  // Large enough to take the OpenMP path of for_each_index, so OpenMP linkage is exercised too.
  constexpr std::int64_t n = std::int64_t{1} << 16;
  dml::tensor<std::int64_t> t(dml::shape{256, n / 256});
  std::int64_t* p = t.data();
  dml::for_each_index<dml::host>(t.numel(), [p](std::int64_t i) { p[i] = 3 * i + 1; });
  const std::int64_t sum = dml::transform_reduce_index<dml::host>(
      t.numel(), [p](std::int64_t i) { return p[i]; }, std::int64_t{0});

  const std::int64_t expected = 3 * (n * (n - 1) / 2) + n;
  if (t.shape() != dml::shape{256, 256} || sum != expected) {
    std::fprintf(stderr, "dml consumer: sum=%lld, expected %lld\n", static_cast<long long>(sum),
                 static_cast<long long>(expected));
    return 1;
  }
  std::printf("dml consumer ok: dml %d.%d.%d, sum=%lld\n", DML_VERSION_MAJOR, DML_VERSION_MINOR,
              DML_VERSION_PATCH, static_cast<long long>(sum));
  return 0;
}
