// SPDX-License-Identifier: Apache-2.0
// Conan test package: fills a dml tensor through for_each_index and checks its sum.
#include <dml/core/algorithm.hpp>
#include <dml/core/tensor.hpp>

#include <cstdint>
#include <cstdio>

int main() {
  dml::tensor<std::int64_t> t(dml::shape{4, 250});
  std::int64_t* p = t.data();
  dml::for_each_index<dml::host>(t.numel(), [p](std::int64_t i) { p[i] = i; });
  const auto sum = dml::transform_reduce_index<dml::host>(
      t.numel(), [p](std::int64_t i) { return p[i]; }, std::int64_t{0});
  std::printf("dml %d.%d.%d: sum=%lld\n", DML_VERSION_MAJOR, DML_VERSION_MINOR, DML_VERSION_PATCH,
              static_cast<long long>(sum));
  return sum == 999 * 1000 / 2 ? 0 : 1;
}
