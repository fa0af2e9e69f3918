// SPDX-License-Identifier: Apache-2.0
// tests/train/test_flags.cpp — dml::flags (train/flags.hpp): a table of good command lines and the values they set,
// a table of bad ones and their exact one-line messages, positional arguments, --help and the generated usage.
#include <doctest/doctest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dml/train/flags.hpp"

namespace test_flags {

namespace {

// Every kind of flag the examples use, bound to one struct.
struct bound {
  std::int64_t steps = 10;
  int ranks = 1;
  std::uint64_t seed = 1;
  float lr = 0.5f;
  double holdout = 0.1;
  std::string precision = "fp32";
  std::string text;
  std::optional<float> temperature;
  std::optional<std::int64_t> every;
  std::vector<std::int64_t> hidden{256, 256};
  std::int64_t heads = 4;
  bool bias = false, shuffle = true;
  int count = 200;

  dml::flags table() {
    dml::flags f("prog", "Trains something.", "See the README.");
    f.add("--steps", steps, "N", "optimizer steps").min(0);
    f.add("--ranks", ranks, "N", "ranks").min(1);
    f.add("--seed", seed, "N", "seed");
    f.add("--lr", lr, "X", "learning rate").min(0.f);
    f.add("--holdout", holdout, "X", "held-out fraction").min(0.0).max(0.5);
    f.add("--precision", precision, "P", "precision").choices({"fp32", "bf16", "fp16"});
    f.add("--text", text, "FILE", "a text file");
    f.add("--temperature", temperature, "X", "sampling temperature").min(0.f);
    f.add("--every", every, "N", "save every N steps").min(1);
    f.add("--hidden", hidden, "W,W", "hidden widths").min(1);
    f.add("--heads", heads, "N", "heads").check([](std::int64_t h) { return h % 2 ? "an even number" : ""; },
                                                 "even");
    f.add_switch("--bias", bias, "biases");
    f.add_switch("--no-shuffle", shuffle, "keep the order", false);
    return f;
  }
};

dml::flags::status parse(dml::flags& f, std::vector<std::string> words) {
  std::vector<const char*> argv{"prog"};
  for (const auto& w : words) argv.push_back(w.c_str());
  return f.parse(static_cast<int>(argv.size()), argv.data());
}

std::string error_of(std::vector<std::string> words) {
  bound b;
  auto f = b.table();
  try {
    parse(f, std::move(words));
  } catch (const dml::invalid_argument& e) {
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST_CASE("flags: good command lines set their variables") {
  bound b;
  auto f = b.table();
  CHECK(parse(f, {"--steps", "0", "--ranks=4", "--seed", "18446744073709551615", "--lr", "1e-3", "--holdout", "0.5",
                  "--precision", "bf16", "--text", "-", "--temperature", "0", "--every", "3", "--hidden", "1,2,3",
                  "--heads", "-2", "--bias", "--no-shuffle"}) == dml::flags::status::run);
  CHECK(b.steps == 0);
  CHECK(b.ranks == 4);
  CHECK(b.seed == 18446744073709551615ull);
  CHECK(b.lr == doctest::Approx(1e-3));
  CHECK(b.holdout == 0.5);
  CHECK(b.precision == "bf16");
  CHECK(b.text == "-");
  CHECK(b.temperature == 0.f);
  CHECK(b.every == 3);
  CHECK(b.hidden == std::vector<std::int64_t>{1, 2, 3});
  CHECK(b.heads == -2);
  CHECK(b.bias);
  CHECK(!b.shuffle);
  CHECK(f.given("--steps"));
  CHECK(!f.given("--precisionx"));

  bound d;  // nothing given: the defaults stay
  auto g = d.table();
  CHECK(parse(g, {}) == dml::flags::status::run);
  CHECK(d.steps == 10);
  CHECK(!d.temperature);
  CHECK(!g.given("--steps"));
  // A value may start with '-' (the word after a value flag is its value).
  CHECK(error_of({"--text", "--steps"}) == "(accepted)");
  CHECK(error_of({"--lr=0"}) == "(accepted)");
  // Given twice, the last value wins (a script's common flags, then its overrides).
  bound t;
  auto k = t.table();
  parse(k, {"--steps", "1", "--precision", "fp16", "--steps", "2", "--bias", "--bias"});
  CHECK(t.steps == 2);
  CHECK(t.bias);
  bound e;  // an empty list
  auto h = e.table();
  parse(h, {"--hidden", ""});
  CHECK(e.hidden.empty());
}

TEST_CASE("flags: bad command lines fail with one line naming the flag, what it expects and what it found") {
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad{
      {{"--lr", "nan"}, "--lr: expected a finite number, found 'nan'"},
      {{"--lr", "-inf"}, "--lr: expected a finite number, found '-inf'"},
      {{"--lr", "inf"}, "--lr: expected a finite number, found 'inf'"},
      {{"--lr", "1e99"}, "--lr: expected a finite number, found '1e99'"},
      {{"--lr", "-1"}, "--lr: expected a number >= 0, found '-1'"},
      {{"--lr", "fast"}, "--lr: expected a number, found 'fast'"},
      {{"--lr", "1.5x"}, "--lr: expected a number, found '1.5x'"},
      {{"--lr", ""}, "--lr: expected a number, found ''"},
      {{"--holdout", "0.6"}, "--holdout: expected a number from 0 to 0.5, found '0.6'"},
      {{"--ranks", "4294967298"}, "--ranks: expected an integer from 1 to 2147483647, found '4294967298'"},
      {{"--ranks", "0"}, "--ranks: expected an integer >= 1, found '0'"},
      {{"--ranks", "-4294967298"}, "--ranks: expected an integer >= 1, found '-4294967298'"},
      {{"--steps", "-1"}, "--steps: expected an integer >= 0, found '-1'"},
      {{"--steps", "1e99"}, "--steps: expected an integer, found '1e99'"},
      {{"--steps", "1.0"}, "--steps: expected an integer, found '1.0'"},
      {{"--steps", "0x10"}, "--steps: expected an integer, found '0x10'"},
      {{"--steps", "+5"}, "--steps: expected an integer, found '+5'"},
      {{"--steps", " 5"}, "--steps: expected an integer, found ' 5'"},
      {{"--steps", "99999999999999999999"}, "--steps: expected an integer from 0 to 9223372036854775807, found "
                                            "'99999999999999999999'"},
      {{"--seed", "-1"}, "--seed: expected an integer >= 0, found '-1'"},
      {{"--seed", "18446744073709551616"}, "--seed: expected an integer <= 18446744073709551615, found "
                                           "'18446744073709551616'"},
      {{"--precision", "fp8"}, "--precision: expected fp32, bf16 or fp16, found 'fp8'"},
      {{"--temperature", "nan"}, "--temperature: expected a finite number, found 'nan'"},
      {{"--every", "0"}, "--every: expected an integer >= 1, found '0'"},
      {{"--hidden", "12,x"}, "--hidden: expected an integer, found 'x'"},
      {{"--hidden", "12,,3"}, "--hidden: expected an integer, found ''"},
      {{"--hidden", "12,0"}, "--hidden: expected an integer >= 1, found '0'"},
      {{"--heads", "3"}, "--heads: expected an even number, found '3'"},
      {{"--no-such-flag"}, "unknown flag '--no-such-flag'; see --help"},
      {{"--no-such-flag=3"}, "unknown flag '--no-such-flag'; see --help"},
      {{"-x"}, "unknown flag '-x'; see --help"},
      {{"stray"}, "unexpected argument 'stray'; see --help"},
      {{"--steps"}, "--steps: expected a value after it, found the end of the line"},
      {{"--bias", "--lr"}, "--lr: expected a value after it, found the end of the line"},
      {{"--bias=1"}, "--bias: expected no value (a switch), found '1'"},
      {{"--steps", "1", "--steps", "-2"}, "--steps: expected an integer >= 0, found '-2'"},
  };
  for (const auto& [words, message] : bad) {
    CAPTURE(words.front());
    CHECK(error_of(words) == message);
    CHECK(message.find('\n') == std::string::npos);
  }
}

TEST_CASE("flags: positional arguments fill in order, numbers with their checks") {
  int steps = 200;
  std::string dir = "ckpt";
  dml::flags f("learn");
  f.positional("STEPS", steps, "optimizer steps").min(0);
  f.positional("DIR", dir, "checkpoint directory");
  CHECK(parse(f, {"7", "/tmp/x"}) == dml::flags::status::run);
  CHECK(steps == 7);
  CHECK(dir == "/tmp/x");
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad{
      {{"-1"}, "STEPS: expected an integer >= 0, found '-1'"},
      {{"4294967298"}, "STEPS: expected an integer from 0 to 2147483647, found '4294967298'"},
      {{"1e99"}, "STEPS: expected an integer, found '1e99'"},
      {{"1", "d", "extra"}, "unexpected argument 'extra' after the last positional one; see --help"},
      {{"--steps", "1"}, "unknown flag '--steps'; see --help"},
  };
  for (const auto& [words, message] : bad) {
    dml::flags g("learn");
    int s = 0;
    std::string d;
    g.positional("STEPS", s, "optimizer steps").min(0);
    g.positional("DIR", d, "checkpoint directory");
    CAPTURE(words.front());
    std::string what = "(accepted)";
    try {
      parse(g, words);
    } catch (const dml::invalid_argument& e) {
      what = e.what();
    }
    CHECK(what == message);
  }
}

TEST_CASE("flags: a value flag with a bare value stands alone or takes one of its choices") {
  auto run = [](std::vector<std::string> words) {
    std::string mode = "none";
    int steps = 0;
    std::string text;
    dml::flags f("prog");
    f.add("--recompute", mode, "R", "recompute").choices({"none", "full", "selective"}).bare("full");
    f.add("--steps", steps, "N", "steps");
    f.positional("TEXT", text, "a text");
    parse(f, std::move(words));
    return mode + "|" + std::to_string(steps) + "|" + text;
  };
  CHECK(run({}) == "none|0|");
  CHECK(run({"--recompute"}) == "full|0|");                      // alone at the end
  CHECK(run({"--recompute", "--steps", "3"}) == "full|3|");      // before another flag
  CHECK(run({"--recompute", "corpus.txt"}) == "full|0|corpus.txt");  // a word that is not a choice stays positional
  CHECK(run({"--recompute", "selective"}) == "selective|0|");
  CHECK(run({"--recompute=none", "--steps", "1"}) == "none|1|");
  std::string what;
  try {
    run({"--recompute=some"});
  } catch (const dml::invalid_argument& e) {
    what = e.what();
  }
  CHECK(what == "--recompute: expected none, full or selective, found 'some'");
  std::string m;
  dml::flags g("prog");
  CHECK_THROWS_WITH_AS(g.add("--mode", m, "M", "mode").choices({"a", "b"}).bare("c"),
                       "dml::flags: --mode: expected a bare value among its choices, found 'c'", dml::invalid_argument);
  CHECK(g.usage().find("one of a or b") != std::string::npos);
  dml::flags h("prog");
  h.add("--mode", m, "M", "mode").choices({"a", "b"}).bare("b");
  CHECK(h.usage().find("alone: b") != std::string::npos);
}

TEST_CASE("flags: --help stops parsing; the usage comes from the table") {
  bound b;
  auto f = b.table();
  CHECK(parse(f, {"--steps", "3", "--help", "--no-such-flag"}) == dml::flags::status::help);
  CHECK(parse(f, {"-h"}) == dml::flags::status::help);
  const std::string u = f.usage();
  CHECK(u.rfind("usage: prog [flags]\nTrains something.\nflags:\n", 0) == 0);
  CHECK(u.find("  --steps N        optimizer steps (default: 10; an integer >= 0)\n") != std::string::npos);
  CHECK(u.find("  --precision P    precision (default: fp32; one of fp32, bf16 or fp16)\n") != std::string::npos);
  CHECK(u.find("  --holdout X      held-out fraction (default: 0.1; a number from 0 to 0.5)\n") != std::string::npos);
  CHECK(u.find("  --hidden W,W     hidden widths (default: 256,256; an integer >= 1)\n") != std::string::npos);
  CHECK(u.find("  --heads N        heads (default: 4; even)\n") != std::string::npos);
  CHECK(u.find("  --temperature X  sampling temperature (a number >= 0)\n") != std::string::npos);
  CHECK(u.find("  --bias           biases\n") != std::string::npos);
  CHECK(u.find("  -h, --help       print this help and exit\nSee the README.\n") != std::string::npos);
}

TEST_CASE("flags: parse_for_main returns what main returns") {
  bound b;
  auto f = b.table();
  const char* help[] = {"prog", "--help"};
  const char* bad[] = {"prog", "--steps", "-1"};
  const char* good[] = {"prog", "--steps", "5"};
  bool validated = false;
  CHECK(f.parse_for_main(2, help) == 0);
  auto g = b.table();
  CHECK(g.parse_for_main(3, bad) == dml::flags::usage_error);
  auto h = b.table();
  CHECK(h.parse_for_main(3, good, [&] { validated = true; }) == std::nullopt);
  CHECK(validated);
  auto k = b.table();
  CHECK(k.parse_for_main(3, good, [] { dml::fail<dml::invalid_argument>("--steps: expected more"); }) ==
        dml::flags::usage_error);
}

TEST_CASE("parse_number: the shared reader of numbers stored as text") {
  CHECK(dml::parse_number<std::int64_t>("step", "12") == 12);
  CHECK(dml::parse_number<double>("x", "-0.25") == -0.25);
  CHECK_THROWS_WITH_AS(dml::parse_number<std::int64_t>("--resume d: 'step'", "12a"),
                       "--resume d: 'step': expected an integer, found '12a'", dml::invalid_argument);
  CHECK_THROWS_WITH_AS(dml::parse_number<int>("n", "2147483648"), "n: expected an integer <= 2147483647, found "
                                                                   "'2147483648'", dml::invalid_argument);
  CHECK_THROWS_WITH_AS(dml::parse_number<float>("x", "nan"), "x: expected a finite number, found 'nan'",
                       dml::invalid_argument);
}

}  // namespace test_flags
