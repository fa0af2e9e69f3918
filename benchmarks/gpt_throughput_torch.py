# SPDX-License-Identifier: Apache-2.0
# benchmarks/gpt_throughput_torch.py — the PyTorch baseline of gpt_throughput: the nanoGPT-style model of
# tests/nn/gpt_reference.py (no biases, untied head), or with --arch llama the Llama of tests/nn/llama_reference.py
# (RMSNorm, RoPE, grouped-query attention, SwiGLU; untied head), AdamW, fp32, on one process with the given threads
# and batch; prints one JSON line with its tokens/s. gpt_throughput runs it in the same run, once per thread count.
# Usage: /usr/bin/python3 benchmarks/gpt_throughput_torch.py [--arch gpt|llama --layers 6 --d-model 384 --heads 6
#        --kv-heads 2 --ffn-hidden 1024 --seq 256 --batch 8 --steps 5 --warmup 2 --threads 1]
import argparse
import json
import os
import sys
import time


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", choices=("gpt", "llama"), default="gpt")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2, help="llama: key/value heads")
    p.add_argument("--ffn-hidden", type=int, default=0,
                   help="llama: SwiGLU's width (0: 8/3 d_model rounded up to a multiple of 256)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-4)
    return p.parse_args()


ARGS = parse()
# OpenBLAS and OpenMP size their thread pools when they load: set them before torch is imported.
os.environ["OPENBLAS_NUM_THREADS"] = str(ARGS.threads)
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "nn"))
from bench_torch_common import blas_library  # noqa: E402
from gpt_reference import Gpt  # noqa: E402


def build_model(a):
    if a.arch == "gpt":
        return Gpt({"vocab": a.vocab, "seq": a.seq, "layers": a.layers, "d_model": a.d_model, "heads": a.heads,
                    "bias": False, "tie": False, "eps": 1e-5})
    from llama_reference import Llama  # noqa: E402
    ffn = a.ffn_hidden or (8 * a.d_model // 3 + 255) // 256 * 256
    return Llama({"vocab": a.vocab, "seq": a.seq, "layers": a.layers, "d_model": a.d_model, "heads": a.heads,
                  "kv_heads": a.kv_heads, "ffn_hidden": ffn, "norm_eps": 1e-5, "rope_theta": 10000.0,
                  "rope_scaling": None, "tie": False})


def main():
    a = ARGS
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = build_model(a)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    g = torch.Generator().manual_seed(42)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(idx).view(-1, a.vocab), targets.view(-1))
        loss.backward()
        opt.step()
        return loss

    for _ in range(a.warmup):
        step()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(a.steps):
        loss = step()
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"impl": "pytorch", "version": torch.__version__, "blas": blas_library(), "arch": a.arch,
                      "threads": a.threads, "batch": a.batch, "seq": a.seq, "layers": a.layers,
                      "d_model": a.d_model, "heads": a.heads, "params": params, "steps": a.steps,
                      "seconds": round(secs, 4), "cpu_seconds": round(cpu, 4), "loss": round(float(loss), 4),
                      "tokens_per_s": round(a.batch * a.seq * a.steps / secs, 1)}))


if __name__ == "__main__":
    main()
