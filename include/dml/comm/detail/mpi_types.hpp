// SPDX-License-Identifier: Apache-2.0
// dml/comm/detail/mpi_types.hpp — comm::mpi's mapping onto MPI: errors into comm_error (DML_CHECK_MPI), element
// types into MPI datatypes and counts, reduce_ops into MPI ops (user-defined ones for bf16/fp16), avg's division.
// Sits on comm/communicator.hpp and comm/detail/reduce.hpp; used by comm/mpi.hpp and its other detail parts.
#pragma once

#include <mpi.h>

#include <array>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include "dml/comm/communicator.hpp"
#include "dml/comm/detail/reduce.hpp"

namespace dml::comm::detail::mpi_impl {

[[noreturn]] inline void fail_call(int rc, const char* call, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  throw comm_error(dml::detail::cat(file, ":", line, ": ", call, " failed: ",
                                    len ? std::string(text, len) : std::string("MPI error ") + std::to_string(rc)));
}

}  // namespace dml::comm::detail::mpi_impl

// Turns an MPI error code (the communicator returns errors, MPI_ERRORS_RETURN) into comm_error.
#define DML_CHECK_MPI(expr)                                                            \
  do {                                                                                 \
    const int dml_mpi_rc_ = (expr);                                                    \
    if (dml_mpi_rc_ != MPI_SUCCESS)                                                    \
      ::dml::comm::detail::mpi_impl::fail_call(dml_mpi_rc_, #expr, __FILE__, __LINE__); \
  } while (0)

namespace dml::comm {

namespace detail::mpi_impl {

// Native MPI types where MPI has them; bf16/fp16 travel as 16-bit words and reduce through
// user-defined ops; any other trivially copyable type travels as bytes.
template <class T>
MPI_Datatype datatype() {
  if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, std::int32_t>) return MPI_INT32_T;
  else if constexpr (std::is_same_v<T, std::int64_t>) return MPI_INT64_T;
  else if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, fp16>) return MPI_UINT16_T;
  else return MPI_BYTE;
}
template <class T>
constexpr std::size_t units() {  // MPI elements per T
  return reducible<T> ? 1 : sizeof(T);
}
template <class T>
int count(std::size_t n, const char* op) {
  const std::size_t c = n * units<T>();
  if (c > std::size_t(INT_MAX))
    fail<invalid_argument>("dml::comm::mpi::", op, ": expected at most ", INT_MAX / units<T>(),
                           " elements (MPI counts are int), found ", n);
  return int(c);
}

template <reducible T, reduce_op Op>
void user_op(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_pair<T>(static_cast<const T*>(in), static_cast<T*>(inout), std::size_t(*len), Op);
}

// Created on first use, after MPI_Init; freed by MPI_Finalize.
template <reducible T>
MPI_Op user_ops(reduce_op op) {
  static const std::array<MPI_Op, 4> ops = [] {
    std::array<MPI_Op, 4> o{};
    DML_CHECK_MPI(MPI_Op_create(&user_op<T, reduce_op::sum>, 1, &o[0]));
    DML_CHECK_MPI(MPI_Op_create(&user_op<T, reduce_op::max>, 1, &o[1]));
    DML_CHECK_MPI(MPI_Op_create(&user_op<T, reduce_op::min>, 1, &o[2]));
    DML_CHECK_MPI(MPI_Op_create(&user_op<T, reduce_op::prod>, 1, &o[3]));
    return o;
  }();
  switch (op) {
    case reduce_op::max: return ops[1];
    case reduce_op::min: return ops[2];
    case reduce_op::prod: return ops[3];
    default: return ops[0];
  }
}

// MPI has no average: reduce as sum, divide on completion.
template <reducible T>
MPI_Op mpi_op(reduce_op op) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, fp16>) {
    return user_ops<T>(op);
  } else {
    switch (op) {
      case reduce_op::max: return MPI_MAX;
      case reduce_op::min: return MPI_MIN;
      case reduce_op::prod: return MPI_PROD;
      default: return MPI_SUM;
    }
  }
}

using comm::detail::divide;

}  // namespace detail::mpi_impl

}  // namespace dml::comm
