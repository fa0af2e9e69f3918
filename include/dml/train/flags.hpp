// SPDX-License-Identifier: Apache-2.0
// dml/train/flags.hpp — command-line flags from one table: each declared once, bound to a variable, checked, and
// described by the --help text the same table generates. Host-only; sits on core/error.hpp. Used by every example
// and benchmark.
//
// The rules (one of each kind of mistake, one line each, naming the flag, what it expects and what it found):
//  - numbers are parsed whole by std::from_chars: an integer flag refuses 1e99, 0x10 and anything out of its
//    variable's range (no wrapping: 4294967298 is no int); a floating flag takes finite numbers only;
//  - min/max bound numbers (inclusive), choices bound strings, check() runs any other test on the value; a list
//    (a std::vector) is comma-separated, each element checked, and an empty text is an empty list;
//  - `--flag value` and `--flag=value`; the word after a value flag is its value even when it starts with '-'
//    (so `--warmup -1` works); a value flag at the end of argv is missing its value;
//  - a flag given twice takes the last value, as getopt does: scripts put common flags first and override some
//    after them (tests/examples/gpt_example.cmake does); each value is still checked;
//  - words that are not flags fill the declared positional arguments in order (each optional); a word that
//    starts with '-' and is not a number is a flag, and an unknown one is refused with a pointer to --help;
//  - --help (or -h) makes parse() return flags::status::help: the program prints usage() and exits 0. The
//    library never exits; parse_for_main() does the printing and returns the status for main() to return.
#pragma once

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "dml/core/error.hpp"

namespace dml {

// "80GiB", "40GB", "1.5e9", "512MiB": bytes (powers of 1024 for KiB..TiB, of 1000 for KB..TB).
inline double parse_bytes(std::string_view text) {
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(std::string(text), &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string_view unit = used ? text.substr(used) : std::string_view{};
  const std::pair<std::string_view, double> units[] = {{"", 1},        {"B", 1},          {"KB", 1e3},  {"MB", 1e6},
                                                       {"GB", 1e9},    {"TB", 1e12},      {"KiB", 1024.0}, {"MiB", 1048576.0},
                                                       {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  for (const auto& [name, scale] : units)
    if (used && unit == name && std::isfinite(v) && v > 0) return v * scale;
  fail<invalid_argument>("expected a positive size such as 80GiB, 40GB or 1e9 (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), found '",
                         text, "'");
}


template <class T>
concept flag_number = (std::integral<T> && !std::same_as<T, bool>) || std::same_as<T, float> ||
                      std::same_as<T, double>;

namespace detail {

// NaN and infinities have every exponent bit set. Read from the bits so that -ffinite-math-only in a user's
// build cannot fold the test away.
template <class T>
bool finite_bits(T v) {
  if constexpr (std::same_as<T, float>) return (std::bit_cast<std::uint32_t>(v) & 0x7f800000u) != 0x7f800000u;
  else return (std::bit_cast<std::uint64_t>(v) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

// +v: a char-sized integer prints as a number, not as a character.
template <class T>
auto printable(T v) {
  if constexpr (std::integral<T>) return +v;
  else return v;
}

// What a bound number must be, as a message says it: "an integer >= 0", "a number from 0 to 1".
template <flag_number T>
std::string number_range(std::optional<T> lo, std::optional<T> hi) {
  const char* kind = std::integral<T> ? "an integer" : "a number";
  if (lo && hi) return cat(kind, " from ", printable(*lo), " to ", printable(*hi));
  if (lo) return cat(kind, " >= ", printable(*lo));
  if (hi) return cat(kind, " <= ", printable(*hi));
  return kind;
}

// `text` as a T within [lo, hi] (both optional; T's own range always applies), or invalid_argument naming `what`.
template <flag_number T>
T parse_number_in(std::string_view what, std::string_view text, std::optional<T> lo, std::optional<T> hi) {
  T v{};
  const char* const last = text.data() + text.size();
  const auto [end, ec] = std::from_chars(text.data(), last, v);
  const bool whole = !text.empty() && end == last;
  if constexpr (std::integral<T>) {
    // from_chars reads no '-' into an unsigned type; "-5" for one is out of its range, not "no integer".
    bool negative_unsigned = false;
    if constexpr (std::is_unsigned_v<T>)
      if (text.size() > 1 && text[0] == '-') {
        T magnitude{};
        const auto r = std::from_chars(text.data() + 1, last, magnitude);
        negative_unsigned = r.ptr == last && r.ec != std::errc::invalid_argument;
      }
    if (negative_unsigned || (whole && ec == std::errc::result_out_of_range)) {
      // Out of T's range: name the end it passed, with the declared bound where there is one.
      if (text[0] == '-') fail<invalid_argument>(what, ": expected ", number_range<T>(lo ? lo : std::numeric_limits<T>::min(), hi), ", found '", text, "'");
      fail<invalid_argument>(what, ": expected ", number_range<T>(lo, hi ? hi : std::numeric_limits<T>::max()), ", found '", text, "'");
    }
    if (!whole || ec != std::errc{}) fail<invalid_argument>(what, ": expected an integer, found '", text, "'");
  } else {
    if (!whole || ec == std::errc::invalid_argument)
      fail<invalid_argument>(what, ": expected a number, found '", text, "'");
    if (ec != std::errc{} || !finite_bits(v))
      fail<invalid_argument>(what, ": expected a finite number, found '", text, "'");
  }
  if ((lo && v < *lo) || (hi && v > *hi))
    fail<invalid_argument>(what, ": expected ", number_range<T>(lo, hi), ", found '", text, "'");
  return v;
}

}  // namespace detail

// `text`, all of it, as a T: an integer within T's range or a finite floating number. `what` opens the message:
// "--seed: expected an integer, found '1e99'". Shared by the flags and by readers of numbers stored as text
// (the examples' checkpoint metadata).
template <flag_number T>
T parse_number(std::string_view what, std::string_view text) {
  return detail::parse_number_in<T>(what, text, std::nullopt, std::nullopt);
}

namespace detail {

template <class T>
struct flag_value_type {
  using type = T;
};
template <class T>
struct flag_value_type<std::optional<T>> {
  using type = T;
};
template <class T>
struct flag_value_type<std::vector<T>> {
  using type = T;
};

template <class T>
inline constexpr bool is_optional = false;
template <class T>
inline constexpr bool is_optional<std::optional<T>> = true;
template <class T>
inline constexpr bool is_vector = false;
template <class T>
inline constexpr bool is_vector<std::vector<T>> = true;

template <class T>
concept flag_bindable = flag_number<typename flag_value_type<T>::type> ||
                        std::same_as<typename flag_value_type<T>::type, std::string>;

// "a", "a or b", "a, b or c".
inline std::string or_list(const std::vector<std::string>& words) {
  std::string out;
  for (std::size_t i = 0; i < words.size(); ++i) {
    out += i == 0 ? "" : i + 1 == words.size() ? " or " : ", ";
    out += words[i];
  }
  return out;
}

// What every flag has, whatever it binds: the table's row.
class flag_base {
 public:
  flag_base(std::string name, std::string value_name, std::string help)
      : name_(std::move(name)), value_name_(std::move(value_name)), help_(std::move(help)) {}
  flag_base(const flag_base&) = delete;
  flag_base& operator=(const flag_base&) = delete;
  virtual ~flag_base() = default;

  const std::string& name() const { return name_; }
  const std::string& value_name() const { return value_name_; }
  const std::string& help() const { return help_; }
  bool is_switch() const { return value_name_.empty(); }
  // Takes the value (empty for a switch); throws invalid_argument naming the flag.
  virtual void set(std::string_view text) = 0;
  // A value flag that may stand alone (flag::bare): the value it takes then, and whether `word` is one it takes.
  const std::optional<std::string>& bare_value() const { return bare_; }
  virtual bool takes(std::string_view word) const = 0;
  // "default: 2; an integer >= 1": the help line's tail; empty when there is nothing to say.
  virtual std::string notes() const = 0;

  bool seen = false;

 protected:
  std::string name_, value_name_, help_;
  std::optional<std::string> bare_;
};

template <class T>
std::string show_value(const T& v) {
  if constexpr (std::same_as<T, std::string>) return v;
  else {
    std::ostringstream os;
    os << printable(v);
    return os.str();
  }
}

}  // namespace detail

// A value flag or positional argument bound to a variable of type T: a number, std::string, std::optional of one
// (left empty unless given) or std::vector of one (a comma-separated list). Its setters return it for chaining.
template <class T>
class flag final : public detail::flag_base {
 public:
  using value_type = typename detail::flag_value_type<T>::type;

  flag(std::string name, T& target, std::string value_name, std::string help)
      : flag_base(std::move(name), std::move(value_name), std::move(help)), target_(&target) {
    default_ = describe(target);
  }

  // Inclusive bounds of a number (each element of a list).
  flag& min(value_type v)
    requires flag_number<value_type>
  {
    min_ = v;
    return *this;
  }
  flag& max(value_type v)
    requires flag_number<value_type>
  {
    max_ = v;
    return *this;
  }
  // The strings a string flag takes.
  flag& choices(std::vector<std::string> words)
    requires std::same_as<value_type, std::string>
  {
    choices_ = std::move(words);
    return *this;
  }
  // Given alone, the flag takes `value` ("--recompute" is "--recompute full"): a string flag with choices, which
  // reads the next word as its value only when it is one of them.
  flag& bare(std::string value)
    requires std::same_as<value_type, std::string>
  {
    if (choices_.empty() || std::find(choices_.begin(), choices_.end(), value) == choices_.end())
      fail<invalid_argument>("dml::flags: ", name_, ": expected a bare value among its choices, found '", value, "'");
    bare_ = std::move(value);
    return *this;
  }
  bool takes(std::string_view word) const override {
    return choices_.empty() || std::find(choices_.begin(), choices_.end(), word) != choices_.end();
  }
  // Any other test of a value: `test` returns what was expected ("a multiple of 8") when the value fails it,
  // and an empty string when it passes. `note` describes the rule in --help.
  flag& check(std::function<std::string(const value_type&)> test, std::string note = {}) {
    checks_.push_back({std::move(test), std::move(note)});
    return *this;
  }
  // The default as --help shows it, where the variable's value does not say it ("steps / 10").
  flag& default_text(std::string text) {
    default_ = std::move(text);
    return *this;
  }

  void set(std::string_view text) override {
    if constexpr (detail::is_vector<T>) {
      std::vector<value_type> values;  // an empty text is an empty list ("--hidden ''": no hidden layer)
      for (std::size_t pos = 0; !text.empty();) {
        const std::size_t comma = std::min(text.find(',', pos), text.size());
        values.push_back(one(text.substr(pos, comma - pos)));
        if (comma == text.size()) break;
        pos = comma + 1;
      }
      *target_ = std::move(values);
    } else {
      *target_ = one(text);
    }
  }

  std::string notes() const override {
    std::vector<std::string> parts;
    if (!default_.empty()) parts.push_back("default: " + default_);
    if constexpr (flag_number<value_type>) {
      if (min_ || max_) parts.push_back(detail::number_range<value_type>(min_, max_));
    } else if (!choices_.empty()) {
      parts.push_back("one of " + detail::or_list(choices_));
    }
    if (bare_) parts.push_back("alone: " + *bare_);
    for (const auto& c : checks_)
      if (!c.note.empty()) parts.push_back(c.note);
    std::string out;
    for (const auto& p : parts) {
      if (!out.empty()) out += "; ";
      out += p;
    }
    return out;
  }

 private:
  struct custom_check {
    std::function<std::string(const value_type&)> test;
    std::string note;
  };

  // One value (one element of a list), checked.
  value_type one(std::string_view text) const {
    value_type v{};
    if constexpr (flag_number<value_type>) {
      v = detail::parse_number_in<value_type>(name_, text, min_, max_);
    } else {
      v = std::string(text);
      if (!choices_.empty() && std::find(choices_.begin(), choices_.end(), v) == choices_.end())
        fail<invalid_argument>(name_, ": expected ", detail::or_list(choices_), ", found '", text, "'");
    }
    for (const auto& c : checks_)
      if (const std::string expected = c.test(v); !expected.empty())
        fail<invalid_argument>(name_, ": expected ", expected, ", found '", text, "'");
    return v;
  }

  static std::string describe(const T& v) {
    if constexpr (detail::is_optional<T>) {
      return v ? detail::show_value(*v) : std::string();
    } else if constexpr (detail::is_vector<T>) {
      std::string out;
      for (const auto& x : v) {
        if (!out.empty()) out += ',';
        out += detail::show_value(x);
      }
      return out;
    } else {
      return detail::show_value(v);
    }
  }

  T* target_;
  std::optional<value_type> min_, max_;
  std::vector<std::string> choices_;
  std::vector<custom_check> checks_;
  std::string default_;
};

// The table of a program's flags, and the parser and help text built from it.
class flags {
 public:
  enum class status { run, help };
  // Exit status of a program whose command line was refused, as most command-line tools use.
  static constexpr int usage_error = 2;

  // `program` opens usage and error lines; `preamble` follows the usage line, `epilogue` ends the help.
  explicit flags(std::string program, std::string preamble = {}, std::string epilogue = {})
      : program_(std::move(program)), preamble_(std::move(preamble)), epilogue_(std::move(epilogue)) {}

  // A value flag, "--name", bound to `target`; `value_name` stands for its value in --help ("N", "FILE").
  template <class T>
    requires detail::flag_bindable<T>
  flag<T>& add(std::string name, T& target, std::string value_name, std::string help) {
    if (value_name.empty())
      fail<invalid_argument>("dml::flags: ", name, ": expected a value name (\"N\", \"FILE\"), found none");
    return put(std::make_unique<flag<T>>(check_name(std::move(name)), target, std::move(value_name),
                                         std::move(help)));
  }
  // A switch: given, it sets `target` to `value`.
  void add_switch(std::string name, bool& target, std::string help, bool value = true) {
    put(std::make_unique<switch_flag>(check_name(std::move(name)), target, std::move(help), value));
  }
  // The next positional argument (optional, like every one): the first word that is not a flag fills the first.
  template <class T>
    requires detail::flag_bindable<T>
  flag<T>& positional(std::string value_name, T& target, std::string help) {
    auto f = std::make_unique<flag<T>>(value_name, target, value_name, std::move(help));
    auto& ref = *f;
    positionals_.push_back(std::move(f));
    return ref;
  }

  // Sets the bound variables from argv[1..argc); throws invalid_argument with a one-line message at the first
  // mistake. status::help: --help was asked for, and nothing after it was read.
  status parse(int argc, const char* const* argv) {
    std::size_t next_positional = 0;
    for (int i = 1; i < argc; ++i) {
      const std::string_view word = argv[i] ? argv[i] : "";
      if (word == "--help" || word == "-h") return status::help;
      if (!is_flag_word(word)) {
        if (next_positional == positionals_.size())
          fail<invalid_argument>("unexpected argument '", word, "'",
                                 positionals_.empty() ? "" : " after the last positional one", "; see --help");
        positionals_[next_positional]->seen = true;
        positionals_[next_positional++]->set(word);
        continue;
      }
      const std::size_t eq = word.find('=');
      const std::string_view name = word.substr(0, eq);
      detail::flag_base* f = find(name);
      if (!f) fail<invalid_argument>("unknown flag '", name, "'; see --help");
      f->seen = true;
      if (f->is_switch()) {
        if (eq != std::string_view::npos)
          fail<invalid_argument>(name, ": expected no value (a switch), found '", word.substr(eq + 1), "'");
        f->set({});
      } else if (eq != std::string_view::npos) {
        f->set(word.substr(eq + 1));
      } else if (f->bare_value() && (i + 1 >= argc || !argv[i + 1] || !f->takes(argv[i + 1]))) {
        f->set(*f->bare_value());
      } else {
        if (i + 1 >= argc) fail<invalid_argument>(name, ": expected a value after it, found the end of the line");
        ++i;
        f->set(argv[i] ? argv[i] : "");
      }
    }
    return status::run;
  }

  // Whether a flag (or positional argument) was given: for checks across flags that depend on it.
  bool given(std::string_view name) const {
    for (const auto& f : positionals_)
      if (f->name() == name) return f->seen;
    const auto* f = find(name);
    return f && f->seen;
  }

  // The help text: the usage line, the preamble, one line per flag (value name, help, default and rules), the
  // epilogue.
  std::string usage() const {
    std::string out = "usage: " + program_ + (table_.empty() ? " [-h]" : " [flags]");
    for (const auto& p : positionals_) out += " [" + p->value_name() + "]";
    out += "\n";
    if (!preamble_.empty()) out += preamble_ + (preamble_.back() == '\n' ? "" : "\n");
    // Help texts start in one column, after the longest "  --name VALUE".
    std::size_t width = std::string_view(help_head).size();
    for (const auto* group : {&positionals_, &table_})
      for (const auto& f : *group) width = std::max(width, head(*f, group == &positionals_).size());
    auto row = [&](std::string head_text, const std::string& help, const std::string& notes) {
      head_text.resize(width + 2, ' ');
      out += head_text + help + (notes.empty() ? "" : " (" + notes + ")") + "\n";
    };
    if (!positionals_.empty()) out += "arguments:\n";
    for (const auto& f : positionals_) row(head(*f, true), f->help(), f->notes());
    out += "flags:\n";
    for (const auto& f : table_) row(head(*f, false), f->help(), f->notes());
    row(help_head, "print this help and exit", {});
    if (!epilogue_.empty()) out += epilogue_ + (epilogue_.back() == '\n' ? "" : "\n");
    return out;
  }

  // parse() and the program's checks across flags (`validate`, which throws invalid_argument), for main():
  // std::nullopt to go on; 0 after --help printed the usage to stdout; usage_error after printing
  // "<program>: error: <message>" to stderr.
  template <class Validate>
  std::optional<int> parse_for_main(int argc, const char* const* argv, Validate&& validate) {
    try {
      if (parse(argc, argv) == status::help) {
        std::fputs(usage().c_str(), stdout);
        std::fflush(stdout);
        return 0;
      }
      validate();
      return std::nullopt;
    } catch (const invalid_argument& e) {
      std::fflush(stdout);
      std::fprintf(stderr, "%s: error: %s\n", program_.c_str(), e.what());
      return usage_error;
    }
  }
  std::optional<int> parse_for_main(int argc, const char* const* argv) {
    return parse_for_main(argc, argv, [] {});
  }

  const std::string& program() const { return program_; }

 private:
  class switch_flag final : public detail::flag_base {
   public:
    switch_flag(std::string name, bool& target, std::string help, bool value)
        : flag_base(std::move(name), {}, std::move(help)), target_(&target), value_(value) {}
    void set(std::string_view) override { *target_ = value_; }
    std::string notes() const override { return {}; }
    bool takes(std::string_view) const override { return false; }

   private:
    bool* target_;
    bool value_;
  };

  // A flag is a word opening with '-' that is not a number (a negative positional argument is a number).
  static bool is_flag_word(std::string_view w) {
    return w.size() > 1 && w[0] == '-' && !(w[1] >= '0' && w[1] <= '9') && w[1] != '.';
  }

  std::string check_name(std::string name) const {
    if (name.size() < 3 || name.substr(0, 2) != "--" || name.find('=') != std::string::npos)
      fail<invalid_argument>("dml::flags: expected a flag name like --steps, found '", name, "'");
    if (name == "--help" || find(name))
      fail<invalid_argument>("dml::flags: ", name, " declared twice");
    return name;
  }

  template <class F>
  F& put(std::unique_ptr<F> f) {
    auto& ref = *f;
    table_.push_back(std::move(f));
    return ref;
  }

  detail::flag_base* find(std::string_view name) const {
    for (const auto& f : table_)
      if (f->name() == name) return f.get();
    return nullptr;
  }

  static constexpr const char* help_head = "  -h, --help";

  static std::string head(const detail::flag_base& f, bool positional) {
    if (positional) return "  " + f.value_name();
    return "  " + f.name() + (f.is_switch() ? "" : " " + f.value_name());
  }

  std::string program_, preamble_, epilogue_;
  std::vector<std::unique_ptr<detail::flag_base>> table_, positionals_;
};

}  // namespace dml
