// SPDX-License-Identifier: Apache-2.0
// tests/train/test_offload.cpp — optimizer state on disk (trainer_options::offload): the same training as in
// memory, bytes reported off-device, checkpoints across offload and memory, and clear errors for bad settings
// and damaged or unwritable state files.
#include <doctest/doctest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#include "dml/dml.hpp"
#include "support.hpp"
#include "trainer_fixture.hpp"

namespace test_offload {

using namespace dml;
namespace fs = std::filesystem;
using trainer_fixture::on_ranks;
using trainer_fixture::run_result;
using trainer_fixture::train_ranks;

namespace {

constexpr std::int64_t bucket_floats = 64;  // per slot: AdamW's two slots make a bucket 512 bytes
constexpr int K = optim::adamw::state_slots;

train::trainer_options offloaded(const fs::path& dir) {
  auto o = trainer_fixture::options();
  o.offload = "optimizer:disk:" + dir.string();
  o.offload_bucket_mb = double(bucket_floats * K * sizeof(float)) / (1024.0 * 1024.0);
  return o;
}

template <class Sharding>
void check_offload(int ranks) {
  constexpr int steps = 8;
  const auto ref = on_ranks<run_result>(ranks, [&](comm::local& c) {
    return train_ranks<Sharding>(c, trainer_fixture::options(), trainer_fixture::make_model(), steps);
  });
  dml_test::temp_dir dir("dml-offload");
  const auto got = on_ranks<run_result>(ranks, [&](comm::local& c) {
    return train_ranks<Sharding>(c, offloaded(dir.path), trainer_fixture::make_model(), steps);
  });
  // The update is element-wise, so streaming it in buckets changes no number.
  CHECK(got.losses == ref.losses);
  CHECK(got.params == ref.params);
  // fp32: the optimizer bytes in memory are the state alone; on disk all of them, in memory two buckets.
  const std::int64_t n = ref.memory.optimizer / (K * std::int64_t{sizeof(float)});
  CHECK(ref.memory.offloaded == 0);
  CHECK(got.memory.offloaded == ref.memory.optimizer);
  CHECK(got.memory.optimizer == 2 * K * bucket_floats * std::int64_t{sizeof(float)});
  CHECK(n > 2 * bucket_floats);  // several buckets per step
  CHECK(got.memory.params == ref.memory.params);
  CHECK(got.memory.total() == ref.memory.total() - ref.memory.optimizer + got.memory.optimizer);
  // The state files are scratch: gone with the trainer.
  CHECK(fs::is_empty(dir.path));
}

template <class T, class C>
std::vector<float> train_steps(T& t, C& comm, std::int64_t first, std::int64_t count) {
  const auto& d = trainer_fixture::data();
  using trainer_fixture::features;
  train::sampler sampler(trainer_fixture::samples, trainer_fixture::global_batch, 11);
  std::vector<float> losses, xb;
  std::vector<std::int32_t> yb;
  for (std::int64_t s = first; s < first + count; ++s) {
    const std::int64_t rows = sampler.gather(s, comm.rank(), comm.size(), d.x.data(), features, d.y.data(), xb, yb);
    losses.push_back(t.step(tensor_view<const float>(xb.data(), {rows, features}), yb.data(),
                            trainer_fixture::global_batch).loss);
  }
  return losses;
}

// 4 steps with `first`, a checkpoint, 4 more with `second`: the losses of 8 steps in memory.
template <class Sharding>
void check_resume(bool offload_first) {
  dml_test::temp_dir state("dml-offload"), ckpt("dml-offload-ckpt");
  const auto ref = on_ranks<std::vector<float>>(2, [&](comm::local& c) {
    trainer<Sharding> t(c, trainer_fixture::make_model(), trainer_fixture::options());
    return train_steps(t, c, 0, 8);
  });
  auto opts = [&](bool off) { return off ? offloaded(state.path) : trainer_fixture::options(); };
  const auto got = on_ranks<std::vector<float>>(2, [&](comm::local& c) {
    std::vector<float> losses;
    {
      trainer<Sharding> t(c, trainer_fixture::make_model(), opts(offload_first));
      losses = train_steps(t, c, 0, 4);
      t.save_checkpoint(ckpt.path, {});
      // Training on after a save writes the state read for it back to the files.
      if (offload_first) CHECK(train_steps(t, c, 4, 1)[0] == ref[4]);
    }
    trainer<Sharding> t(c, trainer_fixture::make_model(), opts(!offload_first));
    t.load_checkpoint(ckpt.path);
    const auto rest = train_steps(t, c, 4, 4);
    losses.insert(losses.end(), rest.begin(), rest.end());
    return losses;
  });
  CHECK(got == ref);
}

// Every state file in dir, cut to `bytes` bytes or with its first bytes overwritten.
void damage(const fs::path& dir, bool truncate) {
  int seen = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    ++seen;
    if (truncate) {
      fs::resize_file(e.path(), 100);
    } else {
      std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
      f.write("XXXXXXXX", 8);
    }
  }
  REQUIRE(seen == 2);
}

template <class E>
void check_step_fails(bool truncate, const std::string& needle) {
  dml_test::temp_dir dir("dml-offload");
  comm::local::run(1, [&](comm::local& c) {
    trainer<parallel::zero<1>> t(c, trainer_fixture::make_model(), offloaded(dir.path));
    train_steps(t, c, 0, 2);
    damage(dir.path, truncate);
    try {
      train_steps(t, c, 2, 1);
      FAIL("a damaged state file was read");
    } catch (const E& e) {
      const std::string what = e.what();
      MESSAGE(what);
      CHECK(what.find(dir.path.string()) != std::string::npos);
      CHECK(what.find(needle) != std::string::npos);
    }
  });
}

// A state file's header sequence and the bytes after its header.
struct state_copy {
  std::int64_t sequence = 0;
  std::vector<char> data;
};
// The state files in dir, the current one (highest sequence) first.
std::vector<state_copy> read_state_files(const fs::path& dir) {
  std::vector<state_copy> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::ifstream f(e.path(), std::ios::binary);
    std::array<std::int64_t, 4> h{};
    f.read(reinterpret_cast<char*>(h.data()), sizeof h);
    REQUIRE(std::memcmp(h.data(), "DMLOPTST", 8) == 0);
    out.push_back({h[3], std::vector<char>(std::istreambuf_iterator<char>(f), {})});
  }
  std::ranges::sort(out, std::greater{}, &state_copy::sequence);
  return out;
}

template <class E>
std::string construction_error(const train::trainer_options& o) {
  std::string what;
  comm::local::run(1, [&](comm::local& c) {
    try {
      trainer<parallel::replicate> t(c, trainer_fixture::make_model(), o);
    } catch (const E& e) {
      what = e.what();
    }
  });
  return what;
}

}  // namespace

TEST_CASE("offload: optimizer state on disk trains as in memory (replicate, zero 1-3; 1 and 2 ranks)") {
  for (int ranks : {1, 2}) {
    CAPTURE(ranks);
    check_offload<parallel::replicate>(ranks);
    check_offload<parallel::zero<1>>(ranks);
    check_offload<parallel::zero<2>>(ranks);
    check_offload<parallel::zero<3>>(ranks);
  }
}

TEST_CASE("offload: bf16 under ZeRO-2 keeps the master weights in memory and the state on disk") {
  dml_test::temp_dir dir("dml-offload");
  const auto ref = on_ranks<run_result>(2, [&](comm::local& c) {
    return train_ranks<parallel::zero<2>, precision::bf16>(c, trainer_fixture::options(), trainer_fixture::make_model(), 6);
  });
  const auto got = on_ranks<run_result>(2, [&](comm::local& c) {
    return train_ranks<parallel::zero<2>, precision::bf16>(c, offloaded(dir.path), trainer_fixture::make_model(), 6);
  });
  CHECK(got.losses == ref.losses);
  CHECK(got.params == ref.params);
  // In memory: the float master shard (ref's optimizer bytes less the state) and two buckets of state.
  const std::int64_t state = got.memory.offloaded, master = ref.memory.optimizer - state;
  CHECK(master == state / K);
  CHECK(got.memory.optimizer == master + 2 * K * bucket_floats * std::int64_t{sizeof(float)});
}

TEST_CASE("offload: bf16 with the master weights on disk too (optimizer,master) trains as in memory") {
  struct result {
    std::vector<float> losses, params;
    train::memory_report memory;
  };
  auto check = [](auto tag, int ranks) {
    using Sharding = typename decltype(tag)::type;
    auto run = [&](const train::trainer_options& o) {
      return on_ranks<result>(ranks, [&](comm::local& c) {
        trainer<Sharding, precision::bf16> t(c, trainer_fixture::make_model(), o);
        result r;
        r.losses = train_steps(t, c, 0, 6);
        r.memory = t.memory();  // before full_parameters() reads the master weights in
        r.params = t.full_parameters();
        return r;
      });
    };
    dml_test::temp_dir dir("dml-offload");
    const auto ref = run(trainer_fixture::options());
    auto o = offloaded(dir.path);
    o.offload = "optimizer,master:disk:" + dir.path.string();
    const auto got = run(o);
    CHECK(got.losses == ref.losses);
    CHECK(got.params == ref.params);
    // Off-device: the state and the float master, all of ref's optimizer bytes ((K + 1) floats per element of
    // the shard). In memory: two buckets of K + 1 slots, the bucket's (K·64 floats) split over K + 1 slots.
    CHECK(got.memory.offloaded == ref.memory.optimizer);
    const std::int64_t per_slot = (K * bucket_floats) / (K + 1);
    CHECK(got.memory.optimizer == 2 * (K + 1) * per_slot * std::int64_t{sizeof(float)});
    CHECK(got.memory.params == ref.memory.params);
  };
  check(std::type_identity<parallel::replicate>{}, 1);
  check(std::type_identity<parallel::zero<1>>{}, 2);
  check(std::type_identity<parallel::zero<2>>{}, 2);
  check(std::type_identity<parallel::zero<3>>{}, 2);
  // fp32 has no master weights to move.
  comm::local::run(1, [&](comm::local& c) {
    dml_test::temp_dir dir("dml-offload");
    auto o = offloaded(dir.path);
    o.offload = "optimizer,master:disk:" + dir.path.string();
    CHECK_THROWS_WITH_AS(trainer<parallel::replicate>(c, trainer_fixture::make_model(), o),
                         doctest::Contains("expected mixed precision (bf16, fp16) for the master weights on disk"),
                         invalid_argument);
  });
}

TEST_CASE("offload: composes with pipeline stages and hybrid sharding (4 ranks)") {
  auto compare = [](auto tag, train::trainer_options o) {
    using Sharding = typename decltype(tag)::type;
    const auto ref = on_ranks<run_result>(4, [&](comm::local& c) {
      return train_ranks<Sharding>(c, o, trainer_fixture::make_model(), 6);
    });
    dml_test::temp_dir dir("dml-offload");
    auto off = offloaded(dir.path);
    o.offload = off.offload;
    o.offload_bucket_mb = off.offload_bucket_mb;
    const auto got = on_ranks<run_result>(4, [&](comm::local& c) {
      return train_ranks<Sharding>(c, o, trainer_fixture::make_model(), 6);
    });
    CHECK(got.losses == ref.losses);
    CHECK(got.params == ref.params);
    CHECK(got.memory.offloaded == ref.memory.optimizer);
  };
  auto pipe = trainer_fixture::options();
  pipe.pipeline_stages = 2;
  pipe.micro_batches = 2;
  compare(std::type_identity<parallel::zero<1>>{}, pipe);
  compare(std::type_identity<parallel::zero<3>>{}, pipe);
  auto hybrid = trainer_fixture::options();
  hybrid.replicas = 2;
  compare(std::type_identity<parallel::hybrid<parallel::zero<2>>>{}, hybrid);
}

TEST_CASE("offload: a state smaller than two buckets keeps no more than itself in memory") {
  dml_test::temp_dir dir("dml-offload");
  auto o = offloaded(dir.path);
  o.offload_bucket_mb = 1.0;  // 131,072 elements per slot: more than this model's 2,240
  const auto got = on_ranks<run_result>(1, [&](comm::local& c) {
    return train_ranks<parallel::replicate>(c, o, trainer_fixture::make_model(), 2);
  });
  CHECK(got.memory.offloaded > 0);
  CHECK(got.memory.optimizer == got.memory.offloaded);
}

TEST_CASE("offload: checkpoints resume across offload and memory") {
  check_resume<parallel::zero<2>>(true);
  check_resume<parallel::zero<2>>(false);
  check_resume<parallel::replicate>(true);
  check_resume<parallel::zero<3>>(false);
}

TEST_CASE("offload: bad settings fail at construction naming them") {
  auto o = trainer_fixture::options();
  o.offload = "optimizer:ram:/tmp";
  CHECK(construction_error<invalid_argument>(o).find("optimizer:disk:DIR") != std::string::npos);
  o.offload = "/no/such/dml/dir";
  CHECK(construction_error<invalid_argument>(o).find("found \"/no/such/dml/dir\"") != std::string::npos);
  o.offload = "optimizer:disk:/no/such/dml/dir";
  const auto missing = construction_error<invalid_argument>(o);
  CHECK(missing.find("/no/such/dml/dir") != std::string::npos);
  CHECK(missing.find("expected an existing directory") != std::string::npos);
  dml_test::temp_dir dir("dml-offload");
  {
    std::ofstream(dir / "file") << "x";
    o.offload = "optimizer:disk:" + (dir / "file").string();
    CHECK(construction_error<invalid_argument>(o).find("found something else") != std::string::npos);
  }
  // Not writable: a read-only directory (permissions do not bind root, so root tries /sys, read-only in containers).
  fs::path readonly = dir / "ro";
  fs::create_directory(readonly);
  fs::permissions(readonly, fs::perms::owner_read | fs::perms::owner_exec);
  if (::access(readonly.c_str(), W_OK) == 0) readonly = "/sys";
  if (::access(readonly.c_str(), W_OK) != 0) {
    o.offload = "optimizer:disk:" + readonly.string();
    const auto what = construction_error<invalid_argument>(o);
    CHECK(what.find("expected a writable directory") != std::string::npos);
    CHECK(what.find(readonly.string()) != std::string::npos);
  } else {
    MESSAGE("no read-only directory to try");
  }
  fs::permissions(dir / "ro", fs::perms::owner_all);
  o = offloaded(dir.path);
  o.offload_bucket_mb = 0;
  CHECK(construction_error<invalid_argument>(o).find("offload_bucket_mb") != std::string::npos);
}

TEST_CASE("offload: a full disk fails at construction, naming the file, and leaves nothing behind") {
  dml_test::temp_dir dir("dml-offload");
  // A file size limit stands in for a full disk: allocating the state files fails with EFBIG.
  rlimit old{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
  auto* previous = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 4096;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
  const auto what = construction_error<io_error>(offloaded(dir.path));
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, previous);
  MESSAGE(what);
  CHECK(what.find(dir.path.string()) != std::string::npos);
  CHECK(what.find("cannot allocate") != std::string::npos);
  CHECK(fs::is_empty(dir.path));
}

TEST_CASE("offload: a truncated or corrupted state file is a clear error") {
  check_step_fails<io_error>(true, "truncated");
  check_step_fails<io_error>(false, "corrupted");
}

TEST_CASE("offload: a write that fails mid-step loses nothing: the current file keeps the last step, and it runs again") {
  constexpr int before = 4, after = 4;
  // Uninterrupted: 8 steps, and the state files after 4.
  dml_test::temp_dir ref_dir("dml-offload"), dir("dml-offload");
  std::vector<float> ref;
  std::vector<state_copy> ref_files;
  comm::local::run(1, [&](comm::local& c) {
    trainer<parallel::replicate> t(c, trainer_fixture::make_model(), offloaded(ref_dir.path));
    ref = train_steps(t, c, 0, before);
    ref_files = read_state_files(ref_dir.path);
    const auto rest = train_steps(t, c, before, after);
    ref.insert(ref.end(), rest.begin(), rest.end());
  });
  REQUIRE(ref_files.size() == 2);
  comm::local::run(1, [&](comm::local& c) {
    trainer<parallel::replicate> t(c, trainer_fixture::make_model(), offloaded(dir.path));
    auto losses = train_steps(t, c, 0, before);
    const auto params = t.full_parameters();
    const auto files = read_state_files(dir.path);
    const auto n = static_cast<std::int64_t>(files[0].data.size() / (K * sizeof(float)));
    REQUIRE(n > 4 * bucket_floats);
    // A file size limit two buckets into the second slot: the step's writes fail part-way (EFBIG), after the
    // first slot and two buckets of the second are written to the other file.
    rlimit old{};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
    auto* previous = std::signal(SIGXFSZ, SIG_IGN);
    rlimit small = old;
    small.rlim_cur = static_cast<rlim_t>(32 + (n + 2 * bucket_floats) * std::int64_t{sizeof(float)});
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    std::string what;
    try {
      train_steps(t, c, before, 1);
    } catch (const io_error& e) {
      what = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &old);
    std::signal(SIGXFSZ, previous);
    MESSAGE(what);
    CHECK(what.find(dir.path.string()) != std::string::npos);
    CHECK(what.find("writing optimizer state") != std::string::npos);
    CHECK(what.find(std::strerror(EFBIG)) != std::string::npos);
    CHECK(t.steps() == before);
    // On disk: the current file is the uninterrupted run's after 4 steps, byte for byte; the other one holds a
    // mix of steps 3 and 5 under its old header, which no step reads.
    const auto now = read_state_files(dir.path);
    REQUIRE(now.size() == 2);
    CHECK(now[0].sequence == ref_files[0].sequence);
    CHECK(now[0].data == ref_files[0].data);
    CHECK(now[1].sequence == ref_files[1].sequence);
    CHECK(now[1].data != ref_files[1].data);
    CHECK(now[1].data != ref_files[0].data);
    // The parameters of step 4 back, the trainer reads its state from the files and trains on as if nothing
    // had failed.
    t.load_full_parameters(params);
    const auto rest = train_steps(t, c, before, after);
    losses.insert(losses.end(), rest.begin(), rest.end());
    CHECK(losses == ref);
  });
}

}  // namespace test_offload
