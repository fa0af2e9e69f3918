// SPDX-License-Identifier: Apache-2.0
// dml/nn/tensor_group.hpp — the tensor-parallel group a layer talks to inside forward and backward.
// Sits on core/cast.hpp: a communicator's group behind a small type-erased interface, so nn/ stays below
// comm/; parallel/tensor.hpp adapts any communicator to it. Every call is counted, so tests can prove
// how many collectives a layer makes in each pass.
#pragma once

#include <array>
#include <cstdint>

#include "dml/core/cast.hpp"

namespace dml::nn {

enum class group_op : std::uint8_t { all_reduce, all_reduce_max, all_gather, reduce_scatter };
enum class pass : std::uint8_t { forward, backward };

class tensor_group {
 public:
  virtual ~tensor_group() = default;
  int rank() const { return rank_; }
  int size() const { return size_; }

  // Sums x[0, n) over the group, in place.
  void all_reduce(typed_ptr x, std::int64_t n) {
    note(group_op::all_reduce, n, x.type);
    do_all_reduce(x, n);
  }
  // Elementwise maximum of x[0, n) over the group, in place.
  void all_reduce_max(float* x, std::int64_t n) {
    note(group_op::all_reduce_max, n, dtype::f32);
    do_all_reduce_max(x, n);
  }
  // out[r·n, (r+1)·n) = rank r's in[0, n).
  void all_gather(const_typed_ptr in, typed_ptr out, std::int64_t n) {
    note(group_op::all_gather, n * size_, in.type);
    do_all_gather(in, out, n);
  }
  // out[0, n) = Σ over ranks of their in[rank()·n, (rank()+1)·n).
  void reduce_scatter(const_typed_ptr in, typed_ptr out, std::int64_t n) {
    note(group_op::reduce_scatter, n * size_, in.type);
    do_reduce_scatter(in, out, n);
  }

  // What the network is running: calls are counted per pass.
  void set_pass(pass p) { pass_ = p; }
  std::int64_t calls(pass p, group_op op) const { return calls_[index(p)][static_cast<std::size_t>(op)]; }
  std::int64_t calls(pass p) const {
    std::int64_t n = 0;
    for (auto c : calls_[index(p)]) n += c;
    return n;
  }
  std::int64_t bytes() const { return bytes_; }  // payload of every call so far
  void reset_counts() {
    calls_ = {};
    bytes_ = 0;
  }

 protected:
  tensor_group(int rank, int size) : rank_(rank), size_(size) {}
  virtual void do_all_reduce(typed_ptr x, std::int64_t n) = 0;
  virtual void do_all_reduce_max(float* x, std::int64_t n) = 0;
  virtual void do_all_gather(const_typed_ptr in, typed_ptr out, std::int64_t n) = 0;
  virtual void do_reduce_scatter(const_typed_ptr in, typed_ptr out, std::int64_t n) = 0;

 private:
  static std::size_t index(pass p) { return static_cast<std::size_t>(p); }
  void note(group_op op, std::int64_t n, dtype t) {
    ++calls_[index(pass_)][static_cast<std::size_t>(op)];
    bytes_ += n * static_cast<std::int64_t>(dtype_size(t));
  }
  int rank_ = 0, size_ = 1;
  pass pass_ = pass::forward;
  std::array<std::array<std::int64_t, 4>, 2> calls_{};
  std::int64_t bytes_ = 0;
};

}  // namespace dml::nn
