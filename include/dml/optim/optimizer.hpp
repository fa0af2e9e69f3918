// SPDX-License-Identifier: Apache-2.0
// dml/optim/optimizer.hpp — what an optimizer is: a fused update over a flat range with K state slots.
// Sits on core/; the state slots mirror the flat parameter buffer, so a ZeRO shard is a sub-range.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>

#include "dml/core/algorithm.hpp"
#include "dml/core/buffer.hpp"
#include "dml/core/cast.hpp"

namespace dml::optim {

struct optimizer_family {};

// One optimizer step's view of a range of the flat buffers. `grad_scale` multiplies every gradient
// inside the fused pass (global-norm clipping, loss-scale removal, averaging over ranks).
// For mixed precision, w is the f32 master copy and `working` (when set) the bf16 or fp16 copy that
// forward and backward read: the same pass writes working[i] = T(updated w[i]), rounded to nearest
// even, so unscale, clip, update and cast cost one read and one write of each array.
struct step_args {
  std::int64_t n = 0;
  float* w = nullptr;
  const_typed_ptr g{};  // n gradients: float, or bf16/fp16 under mixed precision (read as float)
  float* const* state = nullptr;  // state_slots pointers, each to n floats
  std::int64_t step = 1;          // 1 on the first update, as PyTorch counts
  float lr = 0.f;
  float grad_scale = 1.f;
  typed_ptr working{};  // n elements of float, bf16 or fp16, or null
};

namespace detail {
// Calls f(W* working) with the working copy's element type, or with a null void* when there is
// none, so that a kernel can be instantiated with its optional store compiled out.
template <class F>
void visit_working(const step_args& a, const char* who, F&& f) {
  if (!a.working) {
    f(static_cast<void*>(nullptr));
    return;
  }
  dml::detail::visit_float_like(a.working.type, who, [&](auto t) { f(a.working.as<decltype(t)>()); });
}
// Calls f(const G* g) with the gradients' element type.
template <class F>
void visit_grad(const step_args& a, const char* who, F&& f) {
  dml::detail::visit_float_like(a.g.type, who, [&](auto t) { f(a.g.as<decltype(t)>()); });
}
}  // namespace detail

template <class O>
concept optimizer = requires(const O& o, step_args a) {
  { O::state_slots } -> std::convertible_to<int>;
  { O::name } -> std::convertible_to<const char*>;
  { o.default_lr() } -> std::convertible_to<float>;
  o.template update<host>(a);
};

// The state an optimizer keeps for a range of n parameters: state_slots buffers of n floats, zeroed.
template <optimizer O, execution_space Space = host>
class state {
 public:
  state() = default;
  explicit state(std::int64_t n) { resize(n); }
  void resize(std::int64_t n) {
    n_ = n;
    for (int s = 0; s < O::state_slots; ++s) {
      slots_[s].resize(static_cast<std::size_t>(n));
      fill_n<Space>(slots_[s].data(), n, 0.f);
      ptrs_[s] = slots_[s].data();
    }
  }
  std::int64_t size() const { return n_; }
  float* const* pointers() { return ptrs_; }
  std::span<float> slot(int s) { return slots_[s].span(); }
  std::span<const float> slot(int s) const { return slots_[s].span(); }
  std::int64_t bytes() const { return n_ * O::state_slots * static_cast<std::int64_t>(sizeof(float)); }

 private:
  static constexpr int slot_count = O::state_slots > 0 ? O::state_slots : 1;
  buffer<float, Space> slots_[slot_count];
  float* ptrs_[slot_count] = {};
  std::int64_t n_ = 0;
};

}  // namespace dml::optim
