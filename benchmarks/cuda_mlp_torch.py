# SPDX-License-Identifier: Apache-2.0
# benchmarks/cuda_mlp_torch.py — dml on one GPU against PyTorch on the same GPU: the Fashion-MNIST MLP of
# examples/fashion_mnist (784-W-...-10, ReLU, AdamW, cross-entropy) trained for two epochs by dml's
# fashion_mnist_cuda and by PyTorch (AdamW's default and fused forms). Each side's second epoch is timed (the
# first warms up: cuBLAS handles, kernel loading, the memory pools), its training loop only; PyTorch keeps the
# data set on the GPU, dml copies each batch from the host. One row per width, and the ratio.
# Needs a GPU and a PyTorch with CUDA:
#   python3 benchmarks/cuda_mlp_torch.py --dml build/cuda/examples/fashion_mnist/fashion_mnist_cuda \
#       [--data /usr/share/datasets/fashion-mnist] [--sizes 256,256:128 1024,1024,1024:512 4096,4096:1024]
import argparse
import gzip
import re
import subprocess
import sys
import time

import numpy as np
import torch


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--dml", required=True, help="path of dml's fashion_mnist_cuda")
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--sizes", nargs="+", default=["256,256:128", "1024,1024,1024:512", "4096,4096:1024"],
                   help="HIDDEN:BATCH, e.g. 256,256:128")
    return p.parse_args()


def load(d):
    def idx(name, off):
        with gzip.open(f"{d}/{name}", "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8, offset=off)
    x = torch.tensor(idx("train-images-idx3-ubyte.gz", 16).reshape(-1, 784), dtype=torch.float32).div_(255)
    y = torch.tensor(idx("train-labels-idx1-ubyte.gz", 8).astype(np.int64))
    return x.cuda(), y.cuda()


def torch_epoch_seconds(x, y, hidden, batch, fused):
    torch.manual_seed(1)
    widths = [784] + hidden
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    m = torch.nn.Sequential(*layers, torch.nn.Linear(widths[-1], 10)).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused)
    loss_fn = torch.nn.CrossEntropyLoss()
    steps = x.shape[0] // batch

    def epoch():
        perm = torch.randperm(x.shape[0], device="cuda")
        for i in range(steps):
            b = perm[i * batch:(i + 1) * batch]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(m(x[b]), y[b])
            loss.backward()
            opt.step()
            loss.item()  # as dml, which returns each step's loss to the host
    epoch()
    torch.cuda.synchronize()
    t = time.perf_counter()
    epoch()
    torch.cuda.synchronize()
    return time.perf_counter() - t, steps


def dml_epoch_seconds(exe, data, hidden, batch):
    out = subprocess.run([exe, "--data", data, "--hidden", ",".join(map(str, hidden)), "--batch", str(batch),
                          "--epochs", "2", "--lr-schedule", "constant"], capture_output=True, text=True, check=True).stdout
    found = [(int(s), float(t)) for s, t in re.findall(r"epoch=\d+ steps=(\d+) seconds=([0-9.]+)", out)]
    if len(found) != 2:
        sys.exit(f"cuda_mlp_torch: expected two epoch lines from {exe}, found:\n{out}")
    return found[1][1] - found[0][1], found[1][0] - found[0][0]


def main():
    a = parse()
    x, y = load(a.data)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(f"{'hidden':>16} {'batch':>5} {'dml_ms':>8} {'torch_ms':>9} {'fused_ms':>9} {'torch/dml':>9} {'fused/dml':>9}")
    for size in a.sizes:
        h, b = size.split(":")
        hidden, batch = [int(w) for w in h.split(",")], int(b)
        d, ds = dml_epoch_seconds(a.dml, a.data, hidden, batch)
        t, ts = torch_epoch_seconds(x, y, hidden, batch, fused=False)
        f, _ = torch_epoch_seconds(x, y, hidden, batch, fused=True)
        dm, tm, fm = 1e3 * d / ds, 1e3 * t / ts, 1e3 * f / ts
        print(f"{h:>16} {batch:>5} {dm:8.3f} {tm:9.3f} {fm:9.3f} {tm / dm:9.2f} {fm / dm:9.2f}")


if __name__ == "__main__":
    main()
