// SPDX-License-Identifier: Apache-2.0
// dml/core/stream.hpp — the compute stream: the CUDA stream a thread's kernels, copies and temporaries are
// issued on, which communicators over device memory order their work against (comm/communicator.hpp).
// Sits on the CUDA runtime alone, so g++ and nvcc translation units see one definition.
#pragma once

#include <cuda_runtime.h>

namespace dml {

namespace detail {
inline cudaStream_t& current_stream_slot() {
  thread_local cudaStream_t s = nullptr;
  return s;
}
}  // namespace detail

// The stream this thread's CUDA kernels are issued on (default: the legacy stream).
inline cudaStream_t current_stream() { return detail::current_stream_slot(); }
inline void set_current_stream(cudaStream_t s) { detail::current_stream_slot() = s; }

// Sets the thread's compute stream for a scope, then restores the one before.
class stream_scope {
 public:
  explicit stream_scope(cudaStream_t s) : before_(current_stream()) { set_current_stream(s); }
  ~stream_scope() { set_current_stream(before_); }
  stream_scope(const stream_scope&) = delete;
  stream_scope& operator=(const stream_scope&) = delete;

 private:
  cudaStream_t before_;
};

}  // namespace dml
