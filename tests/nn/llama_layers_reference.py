# SPDX-License-Identifier: Apache-2.0
# tests/nn/llama_layers_reference.py — the PyTorch half of dml's Llama-layer parity test: RMSNorm as Hugging Face's
# LlamaRMSNorm (alone, and after a residual add), RoPE as its apply_rotary_pos_emb (rotate-half) with Llama 3.1's
# frequency scaling, and SwiGLU as silu(gate) * up, forward and backward through torch autograd in float32.
# Usage: llama_layers_reference.py DIR
#   DIR/config.json: {"rows", "n", "eps", "batch", "seq", "heads", "kv_heads", "head_dim", "theta", "factor",
#                     "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "ff"}
#   Reads DIR/<name>.bin (little-endian float32; rope_positions: int64) and writes DIR/torch_<name>.bin (float32):
#     norm_x, norm_w, norm_dy        -> torch_norm_y, torch_norm_dx, torch_norm_dw
#     norm_r, norm_x, norm_w, norm_dy, norm_dr
#                                    -> torch_fused_r (r + x), torch_fused_y, torch_fused_dr (of r), torch_fused_dx
#                                       (of x), torch_fused_dw; the loss is y·dy + (r + x)·dr
#     rope_qkv, rope_positions, rope_dy -> torch_rope_y, torch_rope_dqkv
#     swiglu_gu, swiglu_dh           -> torch_swiglu_h, torch_swiglu_dgu
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F


def main():
    folder = sys.argv[1]
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)

    def read(name, dtype=np.float32, shape=None):
        a = np.fromfile(os.path.join(folder, name + ".bin"), dtype=dtype)
        return torch.from_numpy(a.reshape(shape) if shape else a)

    def write(name, t):
        t.detach().numpy().astype(np.float32).tofile(os.path.join(folder, "torch_" + name + ".bin"))

    def leaf(t):
        return t.clone().requires_grad_(True)

    # RMSNorm: Hugging Face's LlamaRMSNorm in float32, weight times x / sqrt(mean(x^2) + eps).
    rows, n, eps = cfg["rows"], cfg["n"], cfg["eps"]

    def rmsnorm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    x, w = leaf(read("norm_x", shape=(rows, n))), leaf(read("norm_w"))
    dy, dr = read("norm_dy", shape=(rows, n)), read("norm_dr", shape=(rows, n))
    y = rmsnorm(x, w)
    (y * dy).sum().backward()
    write("norm_y", y)
    write("norm_dx", x.grad)
    write("norm_dw", w.grad)

    r, x, w = leaf(read("norm_r", shape=(rows, n))), leaf(read("norm_x", shape=(rows, n))), leaf(read("norm_w"))
    stream = r + x
    y = rmsnorm(stream, w)
    ((y * dy).sum() + (stream * dr).sum()).backward()
    write("fused_r", stream)
    write("fused_y", y)
    write("fused_dr", r.grad)
    write("fused_dx", x.grad)
    write("fused_dw", w.grad)

    # RoPE. The inverse frequencies with Llama 3.1's scaling, one at a time in double: a wavelength below
    # original/high keeps its frequency, one above original/low has it divided by factor, and between the two the
    # frequency is the blend (1 - s) * f / factor + s * f, s = (original / wavelength - low) / (high - low).
    batch, seq, heads, kv, hd = cfg["batch"], cfg["seq"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    factor, low, high = cfg["factor"], cfg["low_freq_factor"], cfg["high_freq_factor"]
    old = cfg["original_max_position_embeddings"]
    freqs = []
    for i in range(hd // 2):
        f = 1.0 / cfg["theta"] ** (2 * i / hd)
        wavelength = 2 * math.pi / f
        if wavelength > old / low:
            f = f / factor
        elif wavelength >= old / high:
            s = (old / wavelength - low) / (high - low)
            f = (1 - s) * f / factor + s * f
        freqs.append(f)
    inv_freq = torch.tensor(freqs, dtype=torch.float64)
    positions = read("rope_positions", dtype=np.int64, shape=(batch, seq))
    angles = positions.to(torch.float64)[..., None] * inv_freq  # [batch, seq, hd/2], in double as dml's table
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().float()[:, None], emb.sin().float()[:, None]  # [batch, 1, seq, hd]

    def rotate_half(t):
        return torch.cat((-t[..., hd // 2:], t[..., : hd // 2]), dim=-1)

    qkv = leaf(read("rope_qkv", shape=(batch, seq, (heads + 2 * kv) * hd)))
    q = qkv[..., : heads * hd].view(batch, seq, heads, hd).transpose(1, 2)
    k = qkv[..., heads * hd: (heads + kv) * hd].view(batch, seq, kv, hd).transpose(1, 2)
    v = qkv[..., (heads + kv) * hd:]
    q_embed = q * cos + rotate_half(q) * sin
    k_embed = k * cos + rotate_half(k) * sin
    out = torch.cat((q_embed.transpose(1, 2).reshape(batch, seq, heads * hd),
                     k_embed.transpose(1, 2).reshape(batch, seq, kv * hd), v), dim=-1)
    (out * read("rope_dy", shape=out.shape)).sum().backward()
    write("rope_y", out)
    write("rope_dqkv", qkv.grad)

    # SwiGLU on [gate | up].
    ff = cfg["ff"]
    gu = leaf(read("swiglu_gu", shape=(rows, 2 * ff)))
    gate, up = gu.chunk(2, dim=-1)
    h = F.silu(gate) * up
    (h * read("swiglu_dh", shape=(rows, ff))).sum().backward()
    write("swiglu_h", h)
    write("swiglu_dgu", gu.grad)


if __name__ == "__main__":
    main()
