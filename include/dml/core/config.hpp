// SPDX-License-Identifier: Apache-2.0
// dml/core/config.hpp — version, host/device annotation macros and error-check macros.
// The bottom of the stack: every other dml header includes this one. See DESIGN.md §3.
#pragma once

#define DML_VERSION_MAJOR 0
#define DML_VERSION_MINOR 1
#define DML_VERSION_PATCH 0

#if defined(__CUDACC__)
#  define DML_HOST_DEVICE __host__ __device__ __forceinline__
#  define DML_DEVICE __device__ __forceinline__
#  define DML_HAS_CUDA 1
#elif defined(__GNUC__)
// Forced inline on the host too: a functor's body must be inlined into its loop for `omp simd` to
// vectorise it (GCC otherwise keeps larger ones, such as the bf16 conversions, out of line).
#  define DML_HOST_DEVICE inline __attribute__((always_inline))
#  define DML_DEVICE inline __attribute__((always_inline))
#  define DML_HAS_CUDA 0
#else
#  define DML_HOST_DEVICE inline
#  define DML_DEVICE inline
#  define DML_HAS_CUDA 0
#endif

// An inner loop of a row functor that vectorises on the host as a sum (or max) reduction: float sums
// only vectorise when the reassociation is allowed. Nothing on the device, where a thread runs the row.
#if defined(__CUDA_ARCH__) || !defined(_OPENMP)
#  define DML_SIMD_SUM(var)
#  define DML_SIMD_MAX(var)
#  define DML_SIMD
#else
#  define DML_SIMD_SUM(var) _Pragma(DML_STRINGIFY(omp simd reduction(+ : var)))
#  define DML_SIMD_MAX(var) _Pragma(DML_STRINGIFY(omp simd reduction(max : var)))
#  define DML_SIMD _Pragma("omp simd")
#endif
#define DML_STRINGIFY(x) #x

// A program may link translation units of nvcc and of a host compiler. A function whose body differs between
// the two (a host/device copy, the host GEMM stack, which nvcc reaches through oneDNN's C API) is declared in
// this inline namespace, named for the compiler: each kind of unit then has its own function, with its own
// symbol, instead of two definitions of one that the linker would pick between. Callers name it as before.
#if defined(__CUDACC__)
#  define DML_TU_NAMESPACE nvcc_unit
#else
#  define DML_TU_NAMESPACE host_unit
#endif

// Pull Thrust's host back ends without CUB's CUDA headers when g++ compiles.
#if !defined(__CUDACC__) && !defined(THRUST_DEVICE_SYSTEM)
#  define THRUST_DEVICE_SYSTEM THRUST_DEVICE_SYSTEM_CPP
#endif
