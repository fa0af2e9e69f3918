// SPDX-License-Identifier: Apache-2.0
// tests/fuzz/fuzz_safetensors.cpp — libFuzzer harness for dml::train::safetensors_file on a
// file's bytes in memory, then every accessor on what it accepted. dml::error is the expected
// answer to bad input; any other exception, crash or sanitizer report is a finding.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "dml/core/error.hpp"
#include "dml/train/safetensors.hpp"
#include "fuzz_check.hpp"

namespace dt = dml::train;

namespace {

template <class T>
void read_typed(const dt::safetensors_file& f, const dt::tensor_info& t) {
  std::vector<T> out(t.bytes / sizeof(T));
  f.read<T>(t.name, std::span<T>(out), std::span<const std::int64_t>(t.shape));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::byte> bytes(size);
  if (size) std::memcpy(bytes.data(), data, size);
  try {
    const auto f = dt::safetensors_file::from_bytes(std::move(bytes), "fuzz.safetensors");
    // What a reader may rely on: tensors in file order, each inside the data section, of the
    // size its shape and dtype give, readable by name.
    std::size_t end = 0;
    for (const auto& t : f.tensors()) {
      DML_FUZZ_CHECK(f.contains(t.name));
      DML_FUZZ_CHECK(t.offset == end);
      std::uint64_t expected = dml::dtype_size(t.dtype);
      for (auto d : t.shape) {
        DML_FUZZ_CHECK(d >= 0);
        expected *= static_cast<std::uint64_t>(d);
      }
      DML_FUZZ_CHECK(expected == t.bytes);
      const auto b = f.bytes(t.name);
      DML_FUZZ_CHECK(b.size() == t.bytes);
      end = t.offset + t.bytes;
      switch (t.dtype) {
        case dml::dtype::f32: read_typed<float>(f, t); break;
        case dml::dtype::f64: read_typed<double>(f, t); break;
        case dml::dtype::i32: read_typed<std::int32_t>(f, t); break;
        case dml::dtype::i64: read_typed<std::int64_t>(f, t); break;
        case dml::dtype::u8: read_typed<std::uint8_t>(f, t); break;
        default: break;
      }
    }
    try {
      (void)f.at("\x01 a name no tensor has");
      DML_FUZZ_CHECK(f.contains("\x01 a name no tensor has"));
    } catch (const dml::invalid_argument&) {
    }
  } catch (const dml::error&) {
  }
  return 0;
}
