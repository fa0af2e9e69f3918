# SPDX-License-Identifier: Apache-2.0
# benchmarks/train_throughput_torch.py — PyTorch baselines for train_throughput: the same MLP, per-rank batch
# and AdamW, on one process (threads as given) or as DDP over gloo with --ranks N processes. With --dml PATH
# it runs dml's binary with the same settings and prints the ratio.
# Usage: /usr/bin/python3 benchmarks/train_throughput_torch.py [--ranks 2] [--dml build/cpu-release/benchmarks/train_throughput]
import argparse
import json
import os
import subprocess
import sys
import time


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", default="1024,1024,1024")
    p.add_argument("--batch", type=int, default=256, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    p.add_argument("--ranks", type=int, default=1, help="1: one process; more: DDP over gloo")
    p.add_argument("--dml", help="path of dml's train_throughput binary, run with the same settings")
    p.add_argument("--parallel", default="ddp", help="dml's sharding for --ranks > 1")
    return p.parse_args()


ARGS = parse()
# OpenBLAS sizes its thread pool when it loads: give it the same threads per rank as torch and dml.
os.environ.setdefault("OPENBLAS_NUM_THREADS", str(ARGS.threads))
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_torch_common import blas_library  # noqa: E402


def make_model(hidden):
    widths = [784] + hidden + [10]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def measure(model, batch, steps, warmup, rank=0, barrier=lambda: None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(42 + rank)
    x = torch.rand(batch, 784, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    barrier()
    return time.perf_counter() - t0


def ddp_worker(rank, ranks, a, port, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    model = torch.nn.parallel.DistributedDataParallel(make_model(a.hidden_list))
    secs = measure(model, a.batch, a.steps, a.warmup, rank, dist.barrier)
    if rank == 0:
        out.put(secs)
    dist.destroy_process_group()


def main():
    a = ARGS
    a.hidden_list = [int(h) for h in a.hidden.split(",") if h]
    torch.set_num_threads(a.threads)
    if a.ranks == 1:
        secs = measure(make_model(a.hidden_list), a.batch, a.steps, a.warmup)
        parallel = "none"
    else:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port = 29500 + os.getpid() % 1000
        procs = [ctx.Process(target=ddp_worker, args=(r, a.ranks, a, port, out)) for r in range(a.ranks)]
        for proc in procs:
            proc.start()
        secs = out.get()
        for proc in procs:
            proc.join()
        parallel = "ddp"
    rate = a.steps * a.batch * a.ranks / secs
    print(json.dumps({"impl": "pytorch", "version": torch.__version__, "blas": blas_library(), "ranks": a.ranks,
                      "parallel": parallel, "threads": a.threads, "batch_per_rank": a.batch,
                      "samples_per_s": round(rate, 1)}))
    if a.dml:
        cmd = [a.dml, "--hidden", a.hidden, "--batch", str(a.batch), "--steps", str(a.steps * 2),
               "--threads", str(a.threads), "--ranks", str(a.ranks), "--json"]
        if a.ranks > 1:
            cmd += ["--parallel", a.parallel]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        ours = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(ours))
        print(f"dml/pytorch = {ours['samples_per_s'] / rate:.2f}x ({ours['parallel']} vs {parallel}, {a.ranks} rank(s)); "
              f"dml reaches {100 * ours['roofline_fraction']:.0f}% of its GEMM roofline "
              f"({ours['roofline_samples_per_s']:.0f} samples/s at {ours['gemm_gflops']:.0f} GFLOP/s per core, "
              f"{ours['gemm_impl']})")


if __name__ == "__main__":
    main()
