// SPDX-License-Identifier: Apache-2.0
// dml/nn/rank_group.hpp — a group of ranks a layer talks to inside forward and backward: the tensor-parallel
// group, the expert-parallel group (all_to_allv), the context-parallel ring (isend/irecv) and the data group
// over which batch statistics are summed (all_reduce_sum).
// Sits on core/cast.hpp: a communicator's group behind a small type-erased interface, so nn/ stays below
// comm/; parallel/tensor.hpp adapts any communicator to it. Every call is counted, so tests can prove
// how many collectives a layer makes in each pass.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "dml/core/cast.hpp"

namespace dml::nn {

enum class group_op : std::uint8_t { all_reduce, all_reduce_max, all_gather, reduce_scatter, all_to_allv, send, recv };
inline constexpr int group_ops = 7;
enum class pass : std::uint8_t { forward, backward };

constexpr const char* name(group_op op) {
  constexpr const char* names[group_ops] = {"all_reduce", "all_reduce_max", "all_gather", "reduce_scatter",
                                            "all_to_allv", "send", "recv"};
  return names[static_cast<std::size_t>(op)];
}

// Told of every call of a group it watches (a trace): began before the call with its payload bytes, ended when the
// call returns (a non-blocking one: when it is posted).
class group_observer {
 public:
  virtual void began(const char* group, group_op op, std::int64_t bytes) = 0;
  virtual void ended() = 0;

 protected:
  ~group_observer() = default;
};

// A point-to-point transfer in flight; wait() completes it (and rethrows its failure). Destroying one
// that was never waited on waits for it.
class group_request {
 public:
  group_request() = default;
  explicit group_request(std::function<void()> wait) : wait_(std::move(wait)) {}
  group_request(group_request&& o) noexcept : wait_(std::exchange(o.wait_, nullptr)) {}
  group_request& operator=(group_request&& o) noexcept {
    if (this != &o) {
      finish_quietly();
      wait_ = std::exchange(o.wait_, nullptr);
    }
    return *this;
  }
  ~group_request() { finish_quietly(); }
  void wait() {
    if (auto w = std::exchange(wait_, nullptr)) w();
  }

 private:
  void finish_quietly() noexcept {
    try {
      wait();
    } catch (...) {
    }
  }
  std::function<void()> wait_;
};

class rank_group {
 public:
  virtual ~rank_group() = default;
  int rank() const { return rank_; }
  int size() const { return size_; }

  // Sums x[0, n) over the group, in place.
  void all_reduce(typed_ptr x, std::int64_t n) {
    note(group_op::all_reduce, n, x.type);
    do_all_reduce(x, n);
    noted();
  }
  // Elementwise maximum of x[0, n) over the group, in place.
  void all_reduce_max(float* x, std::int64_t n) {
    note(group_op::all_reduce_max, n, dtype::f32);
    do_all_reduce_max(x, n);
    noted();
  }
  // out[r·n, (r+1)·n) = rank r's in[0, n).
  void all_gather(const_typed_ptr in, typed_ptr out, std::int64_t n) {
    note(group_op::all_gather, n * size_, in.type);
    do_all_gather(in, out, n);
    noted();
  }
  // out[0, n) = Σ over ranks of their in[rank()·n, (rank()+1)·n).
  void reduce_scatter(const_typed_ptr in, typed_ptr out, std::int64_t n) {
    note(group_op::reduce_scatter, n * size_, in.type);
    do_reduce_scatter(in, out, n);
    noted();
  }

  // Sums x[0, n) of doubles over the group, in place: batch statistics (token counts, router means).
  void all_reduce_sum(double* x, std::int64_t n) {
    note(group_op::all_reduce, n, dtype::f64);
    do_all_reduce_sum(x, n);
    noted();
  }
  // Exchanges one block per rank: send_counts[r] elements of send (blocks in rank order) go to rank r, and
  // recv_counts[r] elements arrive from rank r, in rank order. Counts may be 0; every rank must call it.
  void all_to_allv(const_typed_ptr send, const std::int64_t* send_counts, typed_ptr recv, const std::int64_t* recv_counts) {
    std::int64_t n = 0;
    for (int r = 0; r < size_; ++r) n += send_counts[r];
    note(group_op::all_to_allv, n, send.type);
    do_all_to_allv(send, send_counts, recv, recv_counts);
    noted();
  }
  // n integers to each rank: recv[r·n, (r+1)·n) = rank r's send[rank()·n, (rank()+1)·n) (counts before all_to_allv).
  void all_to_all(const std::int64_t* send, std::int64_t* recv, std::int64_t n) {
    note(group_op::all_to_allv, n * size_, dtype::i64);
    do_all_to_all(send, recv, n);
    noted();
  }
  // Non-blocking point-to-point with a peer of the group (the context-parallel ring).
  [[nodiscard]] group_request isend(const_typed_ptr x, std::int64_t n, int peer, int tag) {
    note(group_op::send, n, x.type);
    auto r = do_isend(x, n, peer, tag);
    noted();
    return r;
  }
  [[nodiscard]] group_request irecv(typed_ptr x, std::int64_t n, int peer, int tag) {
    note(group_op::recv, n, x.type);
    auto r = do_irecv(x, n, peer, tag);
    noted();
    return r;
  }
  // n elements of send to rank `to` and n from rank `from` into recv, started together (a ring step: every
  // rank sends and receives at once, which a GPU communicator must issue as one group).
  [[nodiscard]] group_request isendrecv(const_typed_ptr send, int to, typed_ptr recv, int from, std::int64_t n, int tag) {
    note(group_op::send, n, send.type);
    note(group_op::recv, n, recv.type, false);
    auto r = do_isendrecv(send, to, recv, from, n, tag);
    noted();
    return r;
  }

  // A trace's observer of this group's calls, and the group's name in it ("tp", "ep"); null: none.
  void observe(group_observer* o, const char* group_name) {
    observer_ = o;
    name_ = group_name;
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
  rank_group(int rank, int size) : rank_(rank), size_(size) {}
  virtual void do_all_reduce(typed_ptr x, std::int64_t n) = 0;
  virtual void do_all_reduce_max(float* x, std::int64_t n) = 0;
  virtual void do_all_gather(const_typed_ptr in, typed_ptr out, std::int64_t n) = 0;
  virtual void do_reduce_scatter(const_typed_ptr in, typed_ptr out, std::int64_t n) = 0;
  virtual void do_all_reduce_sum(double* x, std::int64_t n) = 0;
  virtual void do_all_to_allv(const_typed_ptr send, const std::int64_t* send_counts, typed_ptr recv,
                              const std::int64_t* recv_counts) = 0;
  virtual void do_all_to_all(const std::int64_t* send, std::int64_t* recv, std::int64_t n) = 0;
  virtual group_request do_isend(const_typed_ptr x, std::int64_t n, int peer, int tag) = 0;
  virtual group_request do_irecv(typed_ptr x, std::int64_t n, int peer, int tag) = 0;
  // A group whose communicator has no paired form: the receive, then the send.
  virtual group_request do_isendrecv(const_typed_ptr send, int to, typed_ptr recv, int from, std::int64_t n, int tag) {
    auto r = std::make_shared<group_request>(do_irecv(recv, n, from, tag));
    auto s = std::make_shared<group_request>(do_isend(send, n, to, tag));
    return group_request([r, s] {
      r->wait();
      s->wait();
    });
  }

 private:
  static std::size_t index(pass p) { return static_cast<std::size_t>(p); }
  void note(group_op op, std::int64_t n, dtype t, bool observed = true) {
    ++calls_[index(pass_)][static_cast<std::size_t>(op)];
    const auto b = n * static_cast<std::int64_t>(dtype_size(t));
    bytes_ += b;
    if (observer_ && observed) observer_->began(name_, op, b);
  }
  void noted() {
    if (observer_) observer_->ended();
  }
  int rank_ = 0, size_ = 1;
  pass pass_ = pass::forward;
  std::array<std::array<std::int64_t, group_ops>, 2> calls_{};
  std::int64_t bytes_ = 0;
  group_observer* observer_ = nullptr;
  const char* name_ = "";
};

}  // namespace dml::nn
