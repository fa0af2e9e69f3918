// SPDX-License-Identifier: Apache-2.0
// tests/train/test_checkpoint.cpp — sharded checkpoints: exact resume per sharding, re-sharding across group
// sizes, clear errors for damaged or mismatched checkpoints, and saves that fail without harming the last one.
#include <doctest/doctest.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "dml/dml.hpp"
#include "dml/train/checkpoint.hpp"
#include "support.hpp"
#include "trainer_fixture.hpp"

namespace test_checkpoint {

using namespace dml;
namespace fs = std::filesystem;

namespace {

using trainer_fixture::classes;
using trainer_fixture::features;
using trainer_fixture::global_batch;
using trainer_fixture::on_ranks;
using trainer_fixture::samples;

auto make_model(std::int64_t hidden = 40) {
  return nn::sequential{nn::linear{features, hidden}, nn::relu{}, nn::layernorm{hidden}, nn::linear{hidden, 24},
                        nn::gelu{}, nn::linear{24, classes}};
}
// Dropout draws its masks from (seed, step): resuming is exact only if both come back.
auto make_dropout_model() {
  return nn::sequential{nn::linear{features, 40}, nn::relu{}, nn::dropout{0.25f}, nn::linear{40, 24}, nn::gelu{},
                        nn::linear{24, classes}};
}

using trainer_fixture::data;  // the synthetic data set the trainer tests use

train::trainer_options options(std::uint64_t seed = 5) {
  train::trainer_options o;
  o.seed = seed;
  o.bucket_mb = 100.0 * sizeof(float) / (1024.0 * 1024.0);  // ~100 floats: several buckets
  o.lr = [](std::int64_t step) { return step <= 4 ? 3e-3f * float(step) : 1e-2f; };
  o.clip_norm = 1.0f;
  return o;
}

// Global steps [first, first + count) of the shuffled sampler, this rank's slice of each batch.
template <class T, class C>
std::vector<float> train_steps(T& t, C& comm, std::int64_t first, std::int64_t count) {
  const auto& d = data();
  train::sampler sampler(samples, global_batch, 11);
  std::vector<float> losses, xb;
  std::vector<std::int32_t> yb;
  for (std::int64_t s = first; s < first + count; ++s) {
    const std::int64_t rows = sampler.gather(s, comm.rank(), comm.size(), d.x.data(), features, d.y.data(), xb, yb);
    losses.push_back(t.step(tensor_view<const float>(xb.data(), {rows, features}), yb.data(), global_batch).loss);
  }
  return losses;
}

// Parameters without the per-layout padding, so layouts of different group sizes compare.
template <class T>
std::vector<float> packed_parameters(T& t) {
  const auto full = t.full_parameters();
  std::vector<float> out;
  for (const auto& s : t.layout().slots)
    out.insert(out.end(), full.begin() + s.offset, full.begin() + s.offset + s.shape.numel());
  return out;
}

struct temp_dir : dml_test::temp_dir {
  temp_dir() : dml_test::temp_dir("dml-checkpoint-test") {}
};

// Every file under dir with its size and contents: a failed load or save must leave this as it was.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const auto rel = fs::relative(e.path(), dir).string();
    if (e.is_directory()) {
      out[rel + "/"] = "";
      continue;
    }
    std::ifstream in(e.path(), std::ios::binary);
    out[rel] = std::to_string(e.file_size()) + ":" +
               std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return out;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void check_equal_bitwise(const std::vector<float>& ref, const std::vector<float>& got) {
  REQUIRE(ref.size() == got.size());
  int differ = 0;
  double max_diff = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (std::memcmp(&ref[i], &got[i], sizeof(float)) != 0) ++differ;
    max_diff = std::max(max_diff, std::abs(double(ref[i]) - got[i]));
  }
  MESSAGE("steps_differing=" << differ << " max_abs_loss_diff=" << max_diff);
  CHECK(differ == 0);
}

double max_relative(const std::vector<float>& ref, const std::vector<float>& got) {
  REQUIRE(ref.size() == got.size());
  return dml_test::max_rel_difference(ref, got, 1e-12).value;
}

std::vector<float> concat(std::vector<float> a, const std::vector<float>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A valid checkpoint: `steps` steps of 2-rank zero<2> with AdamW on make_model(hidden).
template <class Optimizer = optim::adamw>
void write_checkpoint(const fs::path& dir, std::int64_t hidden = 40, std::int64_t steps = 3) {
  comm::local::run(2, [&](comm::local& c) {
    trainer<parallel::zero<2>, Optimizer> t(c, make_model(hidden), options());
    train_steps(t, c, 0, steps);
    t.save_checkpoint(dir, {{"batch", std::to_string(steps)}});
  });
}

// What each rank saw when loading a damaged checkpoint into a fresh 2-rank zero<3> trainer.
struct failed_load {
  std::exception_ptr error[2];
  bool unchanged[2] = {false, false};
};
failed_load try_load(const fs::path& dir) {
  failed_load out;
  comm::local::run(2, [&](comm::local& c) {
    trainer<parallel::zero<3>, optim::adamw> t(c, make_model(), options());
    const auto before = t.full_parameters();
    try {
      t.load_checkpoint(dir);
    } catch (...) {
      out.error[c.rank()] = std::current_exception();
    }
    out.unchanged[c.rank()] = t.full_parameters() == before && t.steps() == 0;
  });
  return out;
}

// Every rank failed with E, and the message names the problem.
template <class E>
void check_failed(const failed_load& f, const std::string& needle) {
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    REQUIRE(f.error[r]);
    std::string what;
    bool right_type = false;
    try {
      std::rethrow_exception(f.error[r]);
    } catch (const E& e) {
      right_type = true;
      what = e.what();
    } catch (const std::exception& e) {
      what = e.what();
    }
    MESSAGE("rank " << r << ": " << what);
    CHECK(right_type);
    CHECK(what.find(needle) != std::string::npos);
    CHECK(f.unchanged[r]);
  }
}

struct fault_guard {
  explicit fault_guard(std::function<void(int)> f) { train::detail::checkpoint_write_fault = std::move(f); }
  ~fault_guard() { train::detail::checkpoint_write_fault = nullptr; }
};

// Both ranks threw the simulated full disk of rank 1's save of step 8; latest still names step 5, and the half-written
// step 8 is gone.
void check_failed_save(const std::exception_ptr (&errors)[2], const fs::path& dir) {
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    REQUIRE(errors[r]);
    CHECK_THROWS_AS(std::rethrow_exception(errors[r]), io_error);
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      CHECK(std::string(e.what()).find("no space left on device (simulated)") != std::string::npos);
    }
  }
  CHECK(read_file(dir / "latest") == "step-00000005\n");
  for (const auto& e : fs::directory_iterator(dir))
    CHECK(e.path().filename().string().find("step-00000008") == std::string::npos);
}

// 20 steps straight through, against 10 + save + a new trainer (another seed) + load + 10.
template <class S>
void check_exact_resume() {
  temp_dir dir;
  const auto ref = on_ranks<std::vector<float>>(2, [](comm::local& c) {
    trainer<S, optim::adamw> t(c, make_dropout_model(), options());
    return train_steps(t, c, 0, 20);
  });
  const auto first = on_ranks<std::vector<float>>(2, [&](comm::local& c) {
    trainer<S, optim::adamw> t(c, make_dropout_model(), options());
    auto l = train_steps(t, c, 0, 10);
    t.save_checkpoint(dir.path, {{"batch", "10"}, {"epoch", "0"}, {"note", "a \"quoted\" / value"}});
    return l;
  });
  const auto second = on_ranks<std::vector<float>>(2, [&](comm::local& c) {
    trainer<S, optim::adamw> t(c, make_dropout_model(), options(1234));
    const auto meta = t.load_checkpoint(dir.path);
    CHECK(meta.size() == 3);
    CHECK(meta.at("epoch") == "0");
    CHECK(meta.at("note") == "a \"quoted\" / value");
    CHECK(t.steps() == 10);
    return train_steps(t, c, std::stoll(meta.at("batch")), 10);
  });
  check_equal_bitwise(ref, concat(first, second));
  // Without the checkpoint the second half differs: the comparison above can fail.
  const auto fresh = on_ranks<std::vector<float>>(2, [&](comm::local& c) {
    trainer<S, optim::adamw> t(c, make_dropout_model(), options());
    return train_steps(t, c, 10, 10);
  });
  CHECK(fresh != second);
}

}  // namespace

TEST_CASE_TEMPLATE("resume on the same layout reproduces the uninterrupted losses bitwise", S, parallel::replicate,
                   parallel::zero<1>, parallel::zero<2>, parallel::zero<3>) {
  check_exact_resume<S>();
}

TEST_CASE("a checkpoint re-shards: 4-rank zero<3> -> 2-rank replicate -> 1 rank") {
  temp_dir dir;
  struct run {
    std::vector<float> losses, params;
  };
  const auto ref = on_ranks<run>(1, [](comm::local& c) {
    trainer<parallel::replicate, optim::adamw> t(c, make_model(), options());
    auto l = train_steps(t, c, 0, 20);
    return run{l, packed_parameters(t)};
  });
  const auto a = on_ranks<std::vector<float>>(4, [&](comm::local& c) {
    trainer<parallel::zero<3>, optim::adamw> t(c, make_model(), options());
    auto l = train_steps(t, c, 0, 10);
    t.save_checkpoint(dir.path, {{"batch", "10"}});
    return l;
  });
  const auto index = train::read_checkpoint_index(dir.path);
  CHECK(index.dir.filename() == "step-00000010");
  CHECK(index.info.world_size == 4);
  CHECK(index.info.sharding == "zero3");
  CHECK(index.info.step == 10);
  CHECK(index.info.optimizer == "adamw");
  CHECK(index.files.size() == 4);
  CHECK(index.info.user.at("batch") == "10");
  CHECK(fs::is_regular_file(index.dir / "rank-3-of-4.safetensors"));

  const auto b = on_ranks<std::vector<float>>(2, [&](comm::local& c) {
    trainer<parallel::replicate, optim::adamw> t(c, make_model(), options());
    const auto meta = t.load_checkpoint(dir.path);
    auto l = train_steps(t, c, std::stoll(meta.at("batch")), 5);
    t.save_checkpoint(dir.path, {{"batch", "15"}});
    return l;
  });
  CHECK(read_file(dir.path / "latest") == "step-00000015\n");
  CHECK(fs::is_regular_file(dir.path / "step-00000010" / "index.json"));  // the older one stays
  const auto c = on_ranks<run>(1, [&](comm::local& comm) {
    trainer<parallel::replicate, optim::adamw> t(comm, make_model(), options());
    const auto meta = t.load_checkpoint(dir.path);
    CHECK(t.steps() == 15);
    auto l = train_steps(t, comm, std::stoll(meta.at("batch")), 5);
    return run{l, packed_parameters(t)};
  });
  const auto got = concat(concat(a, b), c.losses);
  const double rel = max_relative(ref.losses, got);
  REQUIRE(ref.params.size() == c.params.size());
  const auto max_w = dml_test::max_abs_difference(ref.params, c.params);
  MESSAGE("max_rel_loss_diff=" << rel << " max_abs_param_diff=" << max_w);
  CHECK(rel <= 1e-5);
  CHECK(max_w.value <= 1e-4);
  CHECK(ref.losses.back() < 0.8 * ref.losses.front());  // it learns, so the comparison means something
}

TEST_CASE("zero<1> saved by 3 ranks loads into 2-rank zero<3> and 1-rank zero<2>: the same state") {
  temp_dir dir;
  const auto saved = on_ranks<std::vector<float>>(3, [&](comm::local& c) {
    trainer<parallel::zero<1>, optim::sgd> t(c, make_model(), options());
    train_steps(t, c, 0, 4);
    t.save_checkpoint(dir.path);
    // What the next steps give with the state as saved.
    return train_steps(t, c, 4, 3);
  });
  const auto z3 = on_ranks<std::vector<float>>(2, [&](comm::local& c) {
    trainer<parallel::zero<3>, optim::sgd> t(c, make_model(), options());
    CHECK(t.load_checkpoint(dir.path).empty());
    return train_steps(t, c, 4, 3);
  });
  const auto z2 = on_ranks<std::vector<float>>(1, [&](comm::local& c) {
    trainer<parallel::zero<2>, optim::sgd> t(c, make_model(), options());
    t.load_checkpoint(dir.path);
    return train_steps(t, c, 4, 3);
  });
  CHECK(max_relative(saved, z3) <= 1e-5);
  CHECK(max_relative(saved, z2) <= 1e-5);
}

namespace {
// tests/train/data/make_checkpoint_fixture.cpp's data: 8 rows of 6 features per step, labels row % 4.
void fixture_batch(int step, int first, int rows, std::vector<float>& x, std::vector<std::int32_t>& y) {
  x.resize(static_cast<std::size_t>(rows) * 6);
  y.resize(static_cast<std::size_t>(rows));
  for (int r = 0; r < rows; ++r) {
    for (int f = 0; f < 6; ++f)
      x[static_cast<std::size_t>(r * 6 + f)] = std::sin(0.37f * float((first + r) * 6 + f) + float(step));
    y[static_cast<std::size_t>(r)] = (first + r) % 4;
  }
}
}  // namespace

// checkpoint-6a692e0 was written by dml before the composition work (zero<2>, 2 ranks, step 3): it loads into
// today's shardings on 1, 2 and 4 ranks with the same parameters, bit for bit, and steps 4 to 6 repeat the
// losses of the run that wrote it.
TEST_CASE_TEMPLATE("a checkpoint of an earlier release loads, whatever the layout", S, parallel::replicate,
                   parallel::zero<1>, parallel::zero<3>) {
  const fs::path dir = fs::path(DML_TEST_SOURCE_DIR) / "data" / "checkpoint-6a692e0";
  std::ifstream in(dir / "expected.txt");
  REQUIRE(in);
  auto read_floats = [&](const char* tag) {
    std::string word;
    std::size_t n = 0;
    in >> word >> n;
    REQUIRE(word == tag);
    std::vector<float> v(n);
    for (auto& x : v) {
      std::string hex;
      in >> hex;
      x = std::strtof(hex.c_str(), nullptr);
    }
    return v;
  };
  const auto params = read_floats("params"), losses = read_floats("losses");
  const auto model = nn::sequential{nn::linear{6, 16}, nn::gelu{}, nn::linear{16, 4}};
  for (int ranks : {1, 2, 4}) {
    INFO(ranks, " ranks");
    comm::local::run(ranks, [&](comm::local& c) {
      trainer<S, optim::adamw> t(c, model, {.seed = 77}, optim::adamw({.lr = 1e-2f}));
      t.load_checkpoint(dir);
      CHECK(t.steps() == 3);
      const auto p = t.full_parameters();
      std::vector<float> got;
      for (const auto& slot : t.layout().slots)
        got.insert(got.end(), p.begin() + slot.offset, p.begin() + slot.offset + slot.shape.numel());
      CHECK(got == params);
      std::vector<float> x;
      std::vector<std::int32_t> y;
      for (int s = 4; s <= 6; ++s) {
        const int first = 8 * c.rank() / ranks, rows = 8 * (c.rank() + 1) / ranks - first;
        fixture_batch(s, first, rows, x, y);
        const auto r = t.step(tensor_view<const float>(x.data(), {rows, 6}), y.data(), 8);
        CHECK(std::abs(r.loss - losses[static_cast<std::size_t>(s - 4)]) <= 1e-5f * losses[static_cast<std::size_t>(s - 4)]);
      }
    });
  }
}

TEST_CASE("damaged or mismatched checkpoints get clear errors, and loading writes nothing") {
  temp_dir root;
  const auto good = root.path / "good";
  write_checkpoint(good);
  const auto step = read_file(good / "latest").substr(0, 13);
  REQUIRE(step == "step-00000003");

  // Each case damages a fresh copy; the copy must look the same after the failed load.
  auto damaged = [&](const std::string& name, const std::function<void(const fs::path& step_dir)>& damage) {
    const auto dir = root.path / name;
    fs::copy(good, dir, fs::copy_options::recursive);
    damage(dir / step);
    const auto before = snapshot(dir);
    auto f = try_load(dir);
    CHECK(snapshot(dir) == before);
    return f;
  };

  SUBCASE("truncated rank file") {
    auto f = damaged("truncated", [](const fs::path& d) {
      const auto p = d / "rank-1-of-2.safetensors";
      fs::resize_file(p, fs::file_size(p) - 10);
    });
    check_failed<format_error>(f, "truncated");
    check_failed<format_error>(f, "rank-1-of-2.safetensors");
  }
  SUBCASE("corrupted data in a rank file that only rank 1 reads") {
    auto f = damaged("flipped", [](const fs::path& d) {
      const auto p = d / "rank-1-of-2.safetensors";
      std::fstream io(p, std::ios::in | std::ios::out | std::ios::binary);
      io.seekp(-6, std::ios::end);
      io.put('\x7f');
    });
    check_failed<format_error>(f, "corrupted");
    check_failed<format_error>(f, "rank-1-of-2.safetensors");
  }
  SUBCASE("corrupted header of a rank file") {
    auto f = damaged("header", [](const fs::path& d) {
      const auto p = d / "rank-0-of-2.safetensors";
      std::fstream io(p, std::ios::in | std::ios::out | std::ios::binary);
      io.seekp(9);
      io.write("####", 4);
    });
    check_failed<format_error>(f, "not a valid safetensors file");
  }
  SUBCASE("corrupted index") {
    auto f = damaged("index", [](const fs::path& d) {
      std::ofstream(d / "index.json", std::ios::binary | std::ios::trunc) << "{\"format\": \"dml-checkpoint\", \"ver";
    });
    check_failed<format_error>(f, "not a valid checkpoint index");
    check_failed<format_error>(f, "index.json");
  }
  SUBCASE("missing rank file") {
    auto f = damaged("missing", [](const fs::path& d) { fs::remove(d / "rank-1-of-2.safetensors"); });
    check_failed<io_error>(f, "rank-1-of-2.safetensors: the shard of rank 1 is missing");
  }
  SUBCASE("a shard missing from the index") {
    auto f = damaged("unlisted", [](const fs::path& d) {
      auto text = read_file(d / "index.json");
      auto j = nlohmann::json::parse(text);
      j["files"].erase(1);
      j["world_size"] = 1;
      std::ofstream(d / "index.json", std::ios::binary | std::ios::trunc) << j.dump();
    });
    check_failed<format_error>(f, "are in no file");
  }
  SUBCASE("no checkpoint at all") {
    auto f = damaged("empty", [](const fs::path& d) { fs::remove_all(d.parent_path() / "latest"); });
    check_failed<io_error>(f, "no checkpoint here");
  }
  SUBCASE("latest names a directory that is gone") {
    auto f = damaged("gone", [](const fs::path& d) { fs::remove_all(d); });
    check_failed<io_error>(f, "index.json");
  }
  SUBCASE("another model") {
    const auto other = root.path / "other-model";
    write_checkpoint(other, 48);
    const auto before = snapshot(other);
    auto f = try_load(other);
    CHECK(snapshot(other) == before);
    check_failed<shape_error>(f, "parameter '0.weight' has shape [48, 24] in the checkpoint, [40, 24] in this trainer");
  }
  SUBCASE("another optimizer") {
    const auto other = root.path / "other-optimizer";
    write_checkpoint<optim::sgd>(other);
    const auto before = snapshot(other);
    auto f = try_load(other);
    CHECK(snapshot(other) == before);
    check_failed<invalid_argument>(f, "optimizer 'sgd'");
  }
}

TEST_CASE("a save that fails on one rank fails on all and leaves the previous checkpoint in place") {
  temp_dir dir;
  const auto ref = on_ranks<std::vector<float>>(2, [](comm::local& c) {
    trainer<parallel::zero<3>, optim::adamw> t(c, make_model(), options());
    return train_steps(t, c, 0, 10);
  });
  std::exception_ptr errors[2];
  // The hook is installed before the ranks start (it is a plain global); an atomic arms it for the second save.
  std::atomic<bool> armed{false};
  fault_guard fault([&armed](int rank) {
    if (armed.load() && rank == 1) throw io_error("rank-1-of-2.safetensors: no space left on device (simulated)");
  });
  comm::local::run(2, [&](comm::local& c) {
    trainer<parallel::zero<3>, optim::adamw> t(c, make_model(), options());
    train_steps(t, c, 0, 5);
    t.save_checkpoint(dir.path, {{"batch", "5"}});
    train_steps(t, c, 5, 3);
    c.barrier();
    if (c.rank() == 0) armed = true;
    c.barrier();
    try {
      t.save_checkpoint(dir.path, {{"batch", "8"}});
    } catch (...) {
      errors[c.rank()] = std::current_exception();
    }
  });
  check_failed_save(errors, dir.path);

  const auto resumed = on_ranks<std::vector<float>>(2, [&](comm::local& c) {
    trainer<parallel::zero<3>, optim::adamw> t(c, make_model(), options());
    const auto meta = t.load_checkpoint(dir.path);
    CHECK(meta.at("batch") == "5");
    CHECK(t.steps() == 5);
    return train_steps(t, c, 5, 5);
  });
  check_equal_bitwise(std::vector<float>(ref.begin() + 5, ref.end()), resumed);
}

TEST_CASE_TEMPLATE("an asynchronous save writes the state of its step while training goes on", S, parallel::zero<1>,
                   parallel::zero<3>) {
  temp_dir sync_dir, async_dir;
  const auto ref = on_ranks<std::vector<float>>(2, [&](comm::local& c) {
    trainer<S, optim::adamw> t(c, make_dropout_model(), options());
    auto l = train_steps(t, c, 0, 10);
    t.save_checkpoint(sync_dir.path, {{"batch", "10"}});
    CHECK(t.memory().checkpoint_staging == 0);
    CHECK(!t.checkpoint_pending());
    return concat(l, train_steps(t, c, 10, 10));
  });
  std::int64_t staged[2] = {-1, -1};
  std::int64_t steps_before_latest = -1;
  // The writers start late: the step after the save reaches its update while they have read nothing, so an update
  // that did not wait for them would put its parameters in the files.
  fault_guard slow([](int) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); });
  const auto background = on_ranks<std::vector<float>>(2, [&](comm::local& c) {
    trainer<S, optim::adamw> t(c, make_dropout_model(), options());
    auto l = train_steps(t, c, 0, 10);
    t.save_checkpoint(async_dir.path, {{"batch", "10"}}, train::save_mode::async);
    staged[c.rank()] = t.memory().checkpoint_staging;
    // Training goes on (changing every parameter) until rank 0 sees latest name the new checkpoint: the start of
    // a step publishes it once both ranks' files are written.
    std::int64_t s = 10;
    for (;; ++s) {
      std::array<std::int32_t, 1> pending{c.rank() == 0 && t.checkpoint_pending()};
      comm::all_reduce_host(c, std::span<std::int32_t>(pending), comm::reduce_op::max);
      if (!pending[0] || s == 100000) break;
      l.push_back(train_steps(t, c, s, 1).front());
    }
    if (c.rank() == 0) steps_before_latest = s - 10;
    l = concat(l, train_steps(t, c, s, 20 - s > 0 ? 20 - s : 0));
    CHECK(t.wait_checkpoint());
    CHECK(!t.wait_checkpoint());
    CHECK(t.memory().checkpoint_staging == 0);
    return std::vector<float>(l.begin(), l.begin() + 20);
  });
  MESSAGE("steps until latest named the asynchronous save: " << steps_before_latest);
  CHECK(steps_before_latest >= 0);
  CHECK(steps_before_latest < 100000);
  check_equal_bitwise(ref, background);  // saving in the background does not change training
  // A host trainer's writers read its memory in place: no copy.
  CHECK(staged[0] == 0);
  CHECK(staged[1] == 0);
  // The same files as the synchronous save of the same step, byte for byte.
  CHECK(read_file(async_dir.path / "latest") == "step-00000010\n");
  CHECK(snapshot(async_dir.path / "step-00000010") == snapshot(sync_dir.path / "step-00000010"));
  const auto resumed = on_ranks<std::vector<float>>(2, [&](comm::local& c) {
    trainer<S, optim::adamw> t(c, make_dropout_model(), options(1234));
    t.load_checkpoint(async_dir.path);
    return train_steps(t, c, 10, 10);
  });
  check_equal_bitwise(std::vector<float>(ref.begin() + 10, ref.end()), resumed);
}

TEST_CASE("an asynchronous save that fails on one rank: training goes on, the wait throws on all, latest stays") {
  temp_dir dir;
  std::exception_ptr errors[2];
  std::atomic<bool> armed{false};
  fault_guard fault([&armed](int rank) {
    if (armed.load() && rank == 1) throw io_error("rank-1-of-2.safetensors: no space left on device (simulated)");
  });
  comm::local::run(2, [&](comm::local& c) {
    trainer<parallel::zero<3>, optim::adamw> t(c, make_model(), options());
    train_steps(t, c, 0, 5);
    t.save_checkpoint(dir.path, {{"batch", "5"}}, train::save_mode::async);
    train_steps(t, c, 5, 3);
    c.barrier();
    if (c.rank() == 0) armed = true;
    c.barrier();
    t.save_checkpoint(dir.path, {{"batch", "8"}}, train::save_mode::async);  // finishes step 5's first
    CHECK(read_file(dir.path / "latest") == "step-00000005\n");
    CHECK_NOTHROW(train_steps(t, c, 8, 3));  // the failure waits for the save's collective end
    try {
      t.wait_checkpoint();
    } catch (...) {
      errors[c.rank()] = std::current_exception();
    }
    CHECK(!t.wait_checkpoint());  // the failed save is gone
  });
  check_failed_save(errors, dir.path);
}

TEST_CASE("saving the same step twice keeps the first directory as it was") {
  temp_dir dir;
  comm::local::run(2, [&](comm::local& c) {
    trainer<parallel::replicate, optim::adamw> t(c, make_model(), options());
    train_steps(t, c, 0, 2);
    t.save_checkpoint(dir.path, {{"who", "first"}});
  });
  const auto first = snapshot(dir.path / "step-00000002");
  comm::local::run(2, [&](comm::local& c) {
    trainer<parallel::replicate, optim::adamw> t(c, make_model(), options());
    t.load_checkpoint(dir.path);
    t.save_checkpoint(dir.path, {{"who", "second"}});
  });
  CHECK(snapshot(dir.path / "step-00000002") == first);
  CHECK(read_file(dir.path / "latest") == "step-00000002.1\n");
  CHECK(train::read_checkpoint_index(dir.path).info.user.at("who") == "second");
}

TEST_CASE("parse_checkpoint_index: integers must be JSON integers in range; sizes cannot overflow or stall") {
  // Each of these was found by fuzzing the index parser (tests/fuzz): a float outside an integer's
  // range converted with undefined behaviour, a shape whose element count overflowed, and a huge
  // state_slots that made the coverage check enumerate billions of tensors.
  train::checkpoint_index x;
  x.info.model = {{"w", {2, 3}}};
  x.info.optimizer = "sgd";
  x.info.state_slots = 1;
  x.info.world_size = 1;
  x.info.sharding = "replicate";
  x.files = {{"rank-0-of-1.safetensors", 0, 100, 0x0123456789abcdefull, {{"param/w", 0, 6}, {"state0/w", 0, 6}}}};
  const fs::path path = "/no/such/dir/step-00000001/index.json";
  const auto good = train::detail::to_json(x);
  CHECK(train::parse_checkpoint_index(good.dump(), path).files.size() == 1);

  auto fails = [&](auto edit, const std::string& needle) {
    auto j = good;
    edit(j);
    std::string msg;
    try {
      (void)train::parse_checkpoint_index(j.dump(), path);
    } catch (const format_error& e) {
      msg = e.what();
    }
    CAPTURE(j.dump());
    CHECK(msg.find(needle) != std::string::npos);
  };
  fails([](auto& j) { j["step"] = 1e300; }, "expected the step to be an integer");
  fails([](auto& j) { j["seed"] = -1; }, "expected the seed to be an integer from 0");
  fails([](auto& j) { j["version"] = 1.5; }, "format version");
  fails([](auto& j) { j["world_size"] = true; }, "expected the world size to be an integer");
  fails([](auto& j) { j["files"][0]["ranges"][0][2] = 6.0; }, "a range's end in file 'rank-0-of-1.safetensors'");
  fails([](auto& j) { j["model"][0]["shape"] = {4294967296, 4294967296}; }, "has 2^63 or more elements");
  fails([](auto& j) { j["model"][0]["shape"] = {-2, 3}; }, "a dimension of parameter 'w'");
  fails([](auto& j) { j["optimizer"]["state_slots"] = 2147483647; }, "'state1/w' are in no file");
  fails([](auto& j) { j["files"][0]["ranges"][1][0] = "state01/w"; }, "which is not a tensor of the checkpoint's model");
  fails([](auto& j) { j["files"][0]["ranges"][1][0] = "state1/w"; }, "which is not a tensor of the checkpoint's model");
  // Empty parameters need no file, however many state slots there are.
  auto empty = good;
  empty["model"][0]["shape"] = {0, 3};
  empty["files"][0]["ranges"] = nlohmann::json::array();
  empty["optimizer"]["state_slots"] = 2147483647;
  CHECK(train::parse_checkpoint_index(empty.dump(), path).info.state_slots == 2147483647);
}

}  // namespace test_checkpoint
