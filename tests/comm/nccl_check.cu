// SPDX-License-Identifier: Apache-2.0
// tests/comm/nccl_check.cu — comm::nccl: every operation instantiated under nvcc, and checked on GPUs.
// Built wherever nvcc is (compile check); run by mpirun only where GPUs exist (label gpu).
#include <cstdio>
#include <string>
#include <vector>

#include "dml/comm/nccl.hpp"

using dml::comm::reduce_op;

namespace {

int failures = 0;
void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  }
}

template <class T>
struct device_vector {
  T* p = nullptr;
  std::size_t n = 0;
  explicit device_vector(std::size_t count) : n(count) { DML_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&p), count * sizeof(T) + 1)); }
  device_vector(const std::vector<T>& h) : device_vector(h.size()) { DML_CHECK_CUDA(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice)); }
  ~device_vector() { cudaFree(p); }
  std::span<T> span() { return {p, n}; }
  std::span<const T> cspan() const { return {p, n}; }
  std::vector<T> host() const {
    std::vector<T> h(n);
    DML_CHECK_CUDA(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

template <class T>
double as_double(T x) {
  if constexpr (std::is_same_v<T, dml::bf16> || std::is_same_v<T, dml::fp16>) return double(float(x));
  else return double(x);
}
template <class T>
T from_float(float x) {
  return T(x);
}

template <class T>
void check_type(dml::comm::nccl& c, std::size_t m, const char* name) {
  const int n = c.size(), r = c.rank();
  const auto tag = [&](const char* op) { return std::string(op) + "<" + name + "> rank " + std::to_string(r); };
  std::vector<T> h(m * n);
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = from_float<T>(float((i + r) % 5));
  device_vector<T> in(h), out(m * n), small(m);

  c.all_reduce(in.cspan(), out.span(), reduce_op::sum);
  auto got = out.host();
  for (std::size_t i = 0; i < got.size(); ++i) {
    double want = 0;
    for (int p = 0; p < n; ++p) want += (i + p) % 5;
    if (as_double(got[i]) != want) { expect(false, tag("all_reduce")); break; }
  }
  c.all_reduce(in.span(), reduce_op::max);
  c.reduce_scatter(in.cspan(), small.span(), reduce_op::min);
  c.reduce_scatter(in.span(), reduce_op::sum);
  c.reduce(in.cspan(), out.span(), reduce_op::prod, 0);
  c.reduce(in.span(), reduce_op::sum, n - 1);
  c.all_gather(small.cspan(), out.span());
  c.all_gather(out.span());
  std::vector<std::size_t> counts(n, m);
  c.all_gatherv(small.cspan(), out.span(), counts);
  c.broadcast(out.span(), 0);
  device_vector<T> other(m * n);
  c.all_to_all(in.cspan(), other.span());
  c.all_to_allv(in.cspan(), counts, other.span(), counts);
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  auto s = c.isend(small.cspan(), next, 0);
  c.recv(out.span().first(m), prev, 0);
  s.wait();
  auto q1 = c.iall_reduce(in.cspan(), out.span(), reduce_op::sum);
  auto q2 = c.ireduce_scatter(in.cspan(), small.span(), reduce_op::sum);
  auto q3 = c.iall_gather(small.cspan(), out.span());
  auto q4 = c.ibroadcast(in.span(), 0);
  auto q5 = c.ireduce(in.cspan(), out.span(), reduce_op::sum, 0);
  auto q6 = c.iall_to_all(in.cspan(), other.span());
  while (!q1.test()) {
  }
  q2.wait(); q3.wait(); q4.wait(); q5.wait(); q6.wait();
  if constexpr (std::is_floating_point_v<T>) c.all_reduce(in.span(), reduce_op::avg);
  c.barrier();
}

}  // namespace

static_assert(dml::comm::communicator<dml::comm::nccl>);

int main(int argc, char** argv) {
  dml::comm::mpi::environment env(&argc, &argv);
  dml::comm::mpi world;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("comm::nccl check: no GPU, nothing to run\n");
    return 0;
  }
  DML_CHECK_CUDA(cudaSetDevice(world.rank() % devices));
  dml::comm::nccl c(world);
  expect(c.rank() == world.rank() && c.size() == world.size(), "topology");
  for (std::size_t m : {std::size_t(1), std::size_t(1001), std::size_t(1) << 20}) {
    check_type<float>(c, m, "float");
    check_type<double>(c, m, "double");
    check_type<dml::bf16>(c, m, "bf16");
    check_type<dml::fp16>(c, m, "half");
    check_type<std::int32_t>(c, m, "int32");
    check_type<std::int64_t>(c, m, "int64");
  }
  dml::comm::nccl half = c.split(c.rank() % 2, c.rank());
  std::vector<float> one(8, 1.0f);
  device_vector<float> d(one);
  half.all_reduce(d.span(), reduce_op::sum);
  expect(d.host()[7] == float(half.size()), "split all_reduce");
  std::printf("comm::nccl check: %d failures on rank %d\n", failures, world.rank());
  return failures ? 1 : 0;
}
