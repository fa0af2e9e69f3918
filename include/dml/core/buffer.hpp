// SPDX-License-Identifier: Apache-2.0
// dml/core/buffer.hpp — buffer<T, Space>: an owning, aligned, uninitialised array in one space.
// Sits on core/space.hpp; tensors, flat parameter storage and workspaces are buffers.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <span>
#include <utility>

#include "dml/core/error.hpp"
#include "dml/core/space.hpp"
#if DML_HAS_CUDA
#  include "dml/core/stream.hpp"
#endif

namespace dml {

// 64 bytes: one cache line and one AVX-512 register; also cudaMalloc's minimum guarantee.
inline constexpr std::size_t buffer_alignment = 64;

namespace detail {
template <class Space>
struct allocator;

template <>
struct allocator<host> {
  static void* allocate(std::size_t bytes) {
    return ::operator new(bytes, std::align_val_t{buffer_alignment});
  }
  static void deallocate(void* p) noexcept { ::operator delete(p, std::align_val_t{buffer_alignment}); }
  static void copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes) std::memcpy(dst, src, bytes);
  }
};

#if DML_HAS_CUDA
// Device memory from the device's stream-ordered pool, on the compute stream: a buffer freed and another
// allocated reuse the pool's memory without a device-wide synchronisation (cudaFree has one), and the
// release threshold keeps freed memory in the pool rather than handing it back to the driver.
template <>
struct allocator<cuda> {
  static void* allocate(std::size_t bytes) {
    static const bool pool_ready = keep_pool_memory();
    (void)pool_ready;
    void* p = nullptr;
    DML_CHECK_CUDA(cudaMallocAsync(&p, bytes, current_stream()));
    return p;
  }
  static void deallocate(void* p) noexcept { cudaFreeAsync(p, current_stream()); }
  // Ordered on the compute stream after the kernels that produced src; complete on return when the host
  // reads or wrote either side.
  static void copy(void* dst, const void* src, std::size_t bytes) {
    if (!bytes) return;
    DML_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, current_stream()));
    if (!on_device(dst) || !on_device(src)) DML_CHECK_CUDA(cudaStreamSynchronize(current_stream()));
  }
  static bool on_device(const void* p) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();  // an unregistered host pointer on older runtimes
      return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }
  static bool keep_pool_memory() {
    int device = 0;
    cudaMemPool_t pool = nullptr;
    DML_CHECK_CUDA(cudaGetDevice(&device));
    DML_CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool, device));
    std::uint64_t keep = UINT64_MAX;
    DML_CHECK_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    return true;
  }
};
#endif
}  // namespace detail

// The bytes a set of buffers holds: now and at the most (the high-water mark). A buffer is charged to the calling
// thread's account when it allocates (the innermost memory_account::charging scope; none: to no account) and
// credits that same account when it frees, on whatever thread. A trainer charges what it allocates, constructing
// and stepping, to its own account: its memory() reports what it actually holds.
class memory_account {
 public:
  // limit: the most bytes the account may hold at once (0: no limit); an allocation past it throws (check).
  explicit memory_account(std::int64_t limit = 0) noexcept : limit_(limit) {}
  memory_account(const memory_account&) = delete;
  memory_account& operator=(const memory_account&) = delete;

  std::int64_t live() const noexcept { return live_.load(std::memory_order_relaxed); }
  std::int64_t peak() const noexcept { return peak_.load(std::memory_order_relaxed); }
  void reset_peak() noexcept { peak_.store(live(), std::memory_order_relaxed); }
  void charge(std::int64_t bytes) noexcept {
    const std::int64_t now = live_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    std::int64_t high = peak_.load(std::memory_order_relaxed);
    while (now > high && !peak_.compare_exchange_weak(high, now, std::memory_order_relaxed)) {}
  }
  void credit(std::int64_t bytes) noexcept { live_.fetch_sub(bytes, std::memory_order_relaxed); }
  std::int64_t limit() const noexcept { return limit_; }
  // Throws memory_limit_error where `bytes` more would pass the limit, naming it, the allocation and what is held.
  void check(std::int64_t bytes) const {
    if (limit_ <= 0 || live() + bytes <= limit_) return;
    const auto mib = [](std::int64_t b) { return detail::cat(b, " bytes (", (b * 100 + 524288) / 1048576 / 100.0, " MiB)"); };
    fail<memory_limit_error>("dml: expected at most the memory limit of ", mib(limit_), " in dml buffers, found an "
                             "allocation of ", mib(bytes), " on top of the ", mib(live()), " held (the peak so far: ",
                             mib(peak()), ")");
  }

  // The calling thread's account, or null.
  static memory_account* current() noexcept { return current_slot(); }
  // Makes `a` the calling thread's account until the scope ends (or end() is called), then restores the one before.
  class charging {
   public:
    explicit charging(memory_account* a) noexcept : prev_(std::exchange(current_slot(), a)) {}
    charging(const charging&) = delete;
    charging& operator=(const charging&) = delete;
    ~charging() { end(); }
    void end() noexcept {
      if (active_) current_slot() = prev_;
      active_ = false;
    }

   private:
    memory_account* prev_;
    bool active_ = true;
  };

 private:
  static memory_account*& current_slot() noexcept {
    thread_local memory_account* a = nullptr;
    return a;
  }
  std::atomic<std::int64_t> live_{0}, peak_{0};
  std::int64_t limit_ = 0;
};

template <class T, execution_space Space = host>
class buffer {
 public:
  using value_type = T;
  using space = Space;

  buffer() = default;
  explicit buffer(std::size_t n) { resize(n); }
  buffer(const buffer& o) : buffer(o.size_) { detail::allocator<Space>::copy(data_, o.data_, bytes()); }
  buffer(buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)),
        account_(std::exchange(o.account_, nullptr)) {}
  buffer& operator=(buffer o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(account_, o.account_);
    return *this;
  }
  ~buffer() { release(); }

  // Contents are not kept: a buffer is storage, not a vector.
  void resize(std::size_t n) {
    if (n == size_) return;
    release();
    if (n) {
      memory_account* const a = memory_account::current();
      if (a) a->check(static_cast<std::int64_t>(n * sizeof(T)));  // empty, as released, if it throws
      data_ = static_cast<T*>(detail::allocator<Space>::allocate(n * sizeof(T)));
      account_ = a;
      if (account_) account_->charge(static_cast<std::int64_t>(n * sizeof(T)));
    }
    size_ = n;
  }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return size_ * sizeof(T); }
  bool empty() const noexcept { return size_ == 0; }
  // The whole buffer as a view in its space: std::span on the host, device_span on the GPU.
  span_in<T, Space> span() noexcept { return {data_, size_}; }
  span_in<const T, Space> span() const noexcept { return {data_, size_}; }

  T& operator[](std::size_t i) noexcept
    requires std::same_as<Space, host>
  {
    return data_[i];
  }
  const T& operator[](std::size_t i) const noexcept
    requires std::same_as<Space, host>
  {
    return data_[i];
  }

 private:
  void release() noexcept {
    if (data_) detail::allocator<Space>::deallocate(data_);
    if (account_) account_->credit(static_cast<std::int64_t>(bytes()));
    data_ = nullptr;
    size_ = 0;
    account_ = nullptr;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
  memory_account* account_ = nullptr;  // charged for this storage (null: none)
};

// Copies between spaces (host<->host, host<->cuda, cuda<->cuda); sizes in elements. A host compiler's
// translation unit knows host memory only: its copy_n is another function (config.hpp, DML_TU_NAMESPACE).
inline namespace DML_TU_NAMESPACE {
template <class T>
void copy_n(const T* src, std::size_t n, T* dst) {
#if DML_HAS_CUDA
  detail::allocator<cuda>::copy(dst, src, n * sizeof(T));
#else
  detail::allocator<host>::copy(dst, src, n * sizeof(T));
#endif
}
}  // namespace DML_TU_NAMESPACE

}  // namespace dml
