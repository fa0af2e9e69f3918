// SPDX-License-Identifier: Apache-2.0
// tests/core/test_buffer.cpp — memory_account: a buffer charges the account current when it allocates and credits
// that account when it frees, on any thread; the high-water mark; moves, copies and resizes.
#include <doctest/doctest.h>

#include <thread>
#include <vector>

#include "dml/core/buffer.hpp"

namespace test_buffer {

using dml::buffer;
using dml::memory_account;

TEST_CASE("a buffer allocated under an account charges it and credits it when freed; the peak stays") {
  memory_account a;
  {
    const memory_account::charging c(&a);
    buffer<float> x(100);
    CHECK(a.live() == 400);
    buffer<double> y(10);
    CHECK(a.live() == 480);
    y.resize(30);  // freed and allocated again: 80 credited, 240 charged
    CHECK(a.live() == 640);
    CHECK(a.peak() == 640);
    x.resize(0);
    CHECK(a.live() == 240);
    CHECK(a.peak() == 640);
  }
  CHECK(a.live() == 0);
  CHECK(a.peak() == 640);
  a.reset_peak();
  CHECK(a.peak() == 0);
}

TEST_CASE("no account current: nothing is charged; a buffer credits the account it charged, not the current one") {
  memory_account a, b;
  buffer<float> outside(8);
  std::vector<buffer<float>> kept;
  {
    const memory_account::charging c(&a);
    kept.emplace_back(16);
    {
      const memory_account::charging inner(&b);  // the innermost scope is charged
      kept.emplace_back(4);
      outside.resize(2);  // freed: charged to none, so credits none; allocated again: charged to b
    }
    kept.emplace_back(1);  // a again, after the inner scope ends
  }
  CHECK(a.live() == 68);
  CHECK(b.live() == 24);
  kept.clear();  // credits each buffer's own account, though none is current
  CHECK(a.live() == 0);
  CHECK(b.live() == 8);
  outside = buffer<float>();
  CHECK(b.live() == 0);
}

TEST_CASE("moves carry the charge; a copy is charged to the account current where it is made") {
  memory_account a, b;
  buffer<float> moved;
  {
    const memory_account::charging c(&a);
    buffer<float> x(10);
    moved = std::move(x);
  }
  CHECK(a.live() == 40);
  {
    const memory_account::charging c(&b);
    const buffer<float> copy(moved);
    CHECK(b.live() == 40);
    buffer<float> y(std::move(moved));
    CHECK(a.live() == 40);
  }
  CHECK(a.live() == 0);
  CHECK(b.live() == 0);
  CHECK(a.peak() == 40);
}

TEST_CASE("charging::end restores the account before it; threads have accounts of their own") {
  memory_account a, b;
  memory_account::charging c(&a);
  CHECK(memory_account::current() == &a);
  std::vector<buffer<char>> from_threads(4);
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < from_threads.size(); ++i)
    threads.emplace_back([&, i] {
      CHECK(memory_account::current() == nullptr);
      const memory_account::charging t(&b);
      for (int k = 0; k < 1000; ++k) from_threads[i].resize(static_cast<std::size_t>(1 + k % 7));
    });
  for (auto& t : threads) t.join();
  CHECK(b.live() == 4 * (1 + 999 % 7));
  CHECK(b.peak() <= 4 * 7);
  c.end();
  CHECK(memory_account::current() == nullptr);
  from_threads.clear();  // freed on this thread, credited to b
  CHECK(b.live() == 0);
  CHECK(a.live() == 0);
}

}  // namespace test_buffer
