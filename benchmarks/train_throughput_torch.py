# SPDX-License-Identifier: Apache-2.0
# benchmarks/train_throughput_torch.py — the same MLP, batch and optimizer as train_throughput in PyTorch,
# on the same number of threads; with --dml PATH it also runs dml's binary and prints the ratio.
# Usage: /usr/bin/python3 benchmarks/train_throughput_torch.py [--dml build/cpu-release/benchmarks/train_throughput]
import argparse
import json
import subprocess
import time

import torch


def torch_rate(hidden, batch, steps, warmup, threads):
    torch.set_num_threads(threads)
    widths = [784] + hidden + [10]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(42)
    x = torch.rand(batch, 784, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch / (time.perf_counter() - t0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", default="1024,1024,1024")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dml", help="path of dml's train_throughput binary, run with the same settings")
    a = p.parse_args()
    hidden = [int(h) for h in a.hidden.split(",") if h]
    rate = torch_rate(hidden, a.batch, a.steps, a.warmup, a.threads)
    print(json.dumps({"impl": "pytorch", "version": torch.__version__, "ranks": 1, "parallel": "none",
                      "threads": a.threads, "batch": a.batch, "samples_per_s": round(rate, 1)}))
    if a.dml:
        out = subprocess.run([a.dml, "--hidden", a.hidden, "--batch", str(a.batch), "--steps", str(a.steps * 2),
                              "--threads", str(a.threads), "--json"], check=True, capture_output=True, text=True)
        ours = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(ours))
        print(f"dml/pytorch = {ours['samples_per_s'] / rate:.2f}x; dml reaches {100 * ours['roofline_fraction']:.0f}% "
              f"of its GEMM roofline ({ours['roofline_samples_per_s']:.0f} samples/s at {ours['gemm_gflops']:.0f} GFLOP/s, "
              f"{ours['gemm_impl']})")


if __name__ == "__main__":
    main()
