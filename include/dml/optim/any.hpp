// SPDX-License-Identifier: Apache-2.0
// dml/optim/any.hpp — any_of<O...>: one optimizer policy whose alternative is chosen at run time.
// Sits on optim/optimizer.hpp; programs that take the optimizer from a flag compile the trainer once.
#pragma once

#include <algorithm>
#include <array>
#include <string_view>
#include <variant>

#include "dml/optim/layerwise.hpp"
#include "dml/optim/optimizer.hpp"

namespace dml::optim {

template <optimizer... O>
struct any_of {
  static_assert(sizeof...(O) > 0, "dml::optim::any_of: give at least one optimizer");
  using policy_family = optimizer_family;
  // When some alternative can: the chosen one checks again at run time (adagrad refuses a working copy).
  static constexpr bool writes_working_copy = (writes_working_copy_v<O> || ...);
  static constexpr const char* name = "any_of";
  static constexpr int state_slots = std::max({O::state_slots...});  // enough for every alternative
  // When some alternative is layer-wise (optim/layerwise.hpp): uses_layerwise() says whether the chosen one is.
  static constexpr bool layerwise = (layerwise_v<O> || ...);

  std::variant<O...> chosen{};

  any_of() = default;
  template <class X>
    requires(std::same_as<X, O> || ...)
  any_of(X x) : chosen(std::move(x)) { validate(); }

  // The alternative whose name is `n` ("sgd", "adamw", ...), with its default options.
  static any_of by_name(std::string_view n) {
    any_of out;
    bool found = false;
    ((n == O::name ? (out.chosen = O{}, found = true) : false) || ...);
    if (!found) {
      std::string names;
      ((names += names.empty() ? O::name : std::string(", ") + O::name), ...);
      fail<invalid_argument>("dml::optim::any_of: expected one of ", names, ", found '", n, "'");
    }
    out.validate();
    return out;
  }

  // The chosen alternative's checks of its settings (optim::validate): its message names it.
  void validate() const {
    std::visit([](const auto& o) { optim::validate(o); }, chosen);
  }

  const char* chosen_name() const {
    return std::visit([](const auto& o) { return std::remove_cvref_t<decltype(o)>::name; }, chosen);
  }
  float default_lr() const {
    return std::visit([](const auto& o) { return o.default_lr(); }, chosen);
  }
  template <execution_space S>
  void update(const step_args& a) const {
    std::visit([&](const auto& o) { o.template update<S>(a); }, chosen);
  }
  // 1-bit Adam: freezes the chosen one's second moment after step `after` and gives its β1, β2 and eps; fails
  // on one without a second moment to freeze.
  std::array<float, 3> freeze_variance(std::int64_t after) {
    return std::visit([&](auto& o) -> std::array<float, 3> {
      if constexpr (requires { o.freeze_variance(after); }) return o.freeze_variance(after);
      else fail<invalid_argument>("dml::trainer: compress onebit-adam: expected adam or adamw, found ", chosen_name());
    }, chosen);
  }
  bool uses_layerwise() const {
    return std::visit([](const auto& o) { return layerwise_v<std::remove_cvref_t<decltype(o)>>; }, chosen);
  }
  template <execution_space S>
  void prepare(const step_args& a, std::span<const tensor_piece> pieces, double* sums) const {
    std::visit([&](const auto& o) {
      if constexpr (layerwise_v<std::remove_cvref_t<decltype(o)>>) o.template prepare<S>(a, pieces, sums);
      else fail<invalid_argument>("dml::optim::any_of: ", chosen_name(), " is not layer-wise (call update)");
    }, chosen);
  }
  template <execution_space S>
  void apply(const step_args& a, std::span<const tensor_piece> pieces, const double* sums) const {
    std::visit([&](const auto& o) {
      if constexpr (layerwise_v<std::remove_cvref_t<decltype(o)>>) o.template apply<S>(a, pieces, sums);
      else fail<invalid_argument>("dml::optim::any_of: ", chosen_name(), " is not layer-wise (call update)");
    }, chosen);
  }
};

}  // namespace dml::optim
