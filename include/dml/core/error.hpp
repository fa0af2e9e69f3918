// SPDX-License-Identifier: Apache-2.0
// dml/core/error.hpp — the exception hierarchy and a small message builder.
// Sits on core/config.hpp; every layer throws these. See DESIGN.md §7.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "dml/core/config.hpp"

namespace dml {

// Base of everything dml throws: the message says what was expected and what was found.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// A file or stream whose contents are not what its format promises.
class format_error : public error {
 public:
  using error::error;
};
// Shapes that do not chain or do not match what was declared.
class shape_error : public error {
 public:
  using error::error;
};
// Opening, reading or writing a file failed.
class io_error : public error {
 public:
  using error::error;
};
// An argument outside its documented range.
class invalid_argument : public error {
 public:
  using error::error;
};
// An allocation that would pass a memory limit set on purpose (trainer_options::memory_limit).
class memory_limit_error : public error {
 public:
  using error::error;
};

namespace detail {
// g++ 12 lacks <format>; a stream-based concatenation keeps messages readable.
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

template <class E = error, class... Args>
[[noreturn]] void fail(const Args&... args) {
  throw E(detail::cat(args...));
}

}  // namespace dml

#define DML_EXPECT(cond, ...)                                                      \
  do {                                                                             \
    if (!(cond)) ::dml::fail<::dml::error>(__VA_ARGS__);                           \
  } while (0)

#if defined(__CUDACC__)
#  include <cuda_runtime.h>
#  define DML_CHECK_CUDA(expr)                                                     \
    do {                                                                           \
      cudaError_t dml_status_ = (expr);                                            \
      if (dml_status_ != cudaSuccess)                                              \
        ::dml::fail(__FILE__, ":", __LINE__, ": ", #expr, " failed: ",             \
                    cudaGetErrorString(dml_status_));                              \
    } while (0)
#endif
