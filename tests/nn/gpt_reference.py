# SPDX-License-Identifier: Apache-2.0
# tests/nn/gpt_reference.py — the PyTorch half of dml's GPT parity test: a nanoGPT-style model built from
# the same initial weights, trained with torch.optim.AdamW on the same batches; writes the per-step losses
# and the final weights.
# Usage: gpt_reference.py CONFIG.json INIT.safetensors BATCHES.bin LOSSES_OUT WEIGHTS_OUT
#   CONFIG.json: {"vocab", "seq", "layers", "d_model", "heads", "bias", "tie", "eps", "steps", "batch",
#                 "lr", "beta1", "beta2", "adam_eps", "weight_decay"}
#   BATCHES.bin: little-endian int32, steps x batch x (seq+1) tokens; step s uses rows [batch, seq+1],
#                inputs row[:, :seq] and targets row[:, 1:].
# Names follow nanoGPT's state dict without its "transformer." prefix (wte.weight, h.0.attn.c_attn.weight,
# ..., lm_head.weight); with "tie" the head shares wte.weight and lm_head.weight is in neither file.
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train"))
from safetensors_roundtrip import read_safetensors, write_safetensors  # noqa: E402

CONFIG_KEYS = {"vocab": int, "seq": int, "layers": int, "d_model": int, "heads": int, "bias": bool, "tie": bool,
               "eps": float, "steps": int, "batch": int, "lr": float, "beta1": float, "beta2": float,
               "adam_eps": float, "weight_decay": float}


def fail(message):
    raise SystemExit(f"gpt_reference.py: {message}")


def read_config(path):
    with open(path) as f:
        raw = json.load(f)
    cfg = {}
    for key, kind in CONFIG_KEYS.items():
        if key not in raw:
            fail(f"{path}: expected key '{key}', found keys {sorted(raw)}")
        value = raw[key]
        if kind is bool and not isinstance(value, bool):
            fail(f"{path}: expected '{key}' to be true or false, found {value!r}")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            fail(f"{path}: expected '{key}' to be a positive integer, found {value!r}")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            fail(f"{path}: expected '{key}' to be a number, found {value!r}")
        cfg[key] = float(value) if kind is float else value
    if cfg["d_model"] % cfg["heads"]:
        fail(f"{path}: expected d_model divisible by heads, found d_model={cfg['d_model']} heads={cfg['heads']}")
    return cfg


class LayerNorm(torch.nn.Module):
    # torch.nn.LayerNorm cannot leave out the bias in 1.13; F.layer_norm takes None for it.
    def __init__(self, c, bias, eps):
        super().__init__()
        self.c, self.eps = c, eps
        self.weight = torch.nn.Parameter(torch.ones(c))
        self.bias = torch.nn.Parameter(torch.zeros(c)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, (self.c,), self.weight, self.bias, self.eps)


class Attention(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c, t = cfg["d_model"], cfg["seq"]
        self.heads = cfg["heads"]
        self.c_attn = torch.nn.Linear(c, 3 * c, bias=cfg["bias"])
        self.c_proj = torch.nn.Linear(c, c, bias=cfg["bias"])
        self.register_buffer("mask", torch.tril(torch.ones(t, t, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        hs = c // self.heads
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, hs).transpose(1, 2) for z in (q, k, v))  # [B, H, T, hs]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class Mlp(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c = cfg["d_model"]
        self.c_fc = torch.nn.Linear(c, 4 * c, bias=cfg["bias"])
        self.c_proj = torch.nn.Linear(4 * c, c, bias=cfg["bias"])

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = LayerNorm(cfg["d_model"], cfg["bias"], cfg["eps"])
        self.attn = Attention(cfg)
        self.ln_2 = LayerNorm(cfg["d_model"], cfg["bias"], cfg["eps"])
        self.mlp = Mlp(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        v, t, c = cfg["vocab"], cfg["seq"], cfg["d_model"]
        self.wte = torch.nn.Embedding(v, c)
        self.wpe = torch.nn.Embedding(t, c)
        self.h = torch.nn.ModuleList(Block(cfg) for _ in range(cfg["layers"]))
        self.ln_f = LayerNorm(c, cfg["bias"], cfg["eps"])
        self.lm_head = torch.nn.Linear(c, v, bias=False)
        if cfg["tie"]:
            # One Parameter in two places: named_parameters() lists it once, as wte.weight, and its
            # gradient is the sum of both uses.
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, dtype=torch.long))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def load_weights(model, path):
    # Strict: the file must hold exactly the model's parameters (shared ones once), float32, in shape.
    state, _ = read_safetensors(path)
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in state]
    extra = sorted(n for n in state if n not in params)
    if missing:
        fail(f"{path}: expected tensor '{missing[0]}' (missing: {missing}), found none of that name")
    if extra:
        fail(f"{path}: expected only the model's parameters, found extra tensor '{extra[0]}' (extra: {extra})")
    with torch.no_grad():
        for name, p in params.items():
            w = state[name]
            if w.dtype != torch.float32:
                fail(f"{path}: tensor '{name}': expected dtype float32, found {w.dtype}")
            if tuple(w.shape) != tuple(p.shape):
                fail(f"{path}: tensor '{name}': expected shape {list(p.shape)}, found {list(w.shape)}")
            p.copy_(w)


def read_batches(path, cfg):
    b, t, steps, v = cfg["batch"], cfg["seq"], cfg["steps"], cfg["vocab"]
    tokens = np.fromfile(path, dtype="<i4")
    want = steps * b * (t + 1)
    if tokens.size != want:
        fail(f"{path}: expected {want} int32 tokens (steps={steps} x batch={b} x seq+1={t + 1}), "
             f"found {tokens.size} ({os.path.getsize(path)} bytes)")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= v):
        fail(f"{path}: expected tokens in [0, {v}), found values from {tokens.min()} to {tokens.max()}")
    return torch.from_numpy(tokens.astype(np.int64)).view(steps, b, t + 1)


def train(model, batches, cfg):
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(cfg["beta1"], cfg["beta2"]),
                            eps=cfg["adam_eps"], weight_decay=cfg["weight_decay"])
    t, v = cfg["seq"], cfg["vocab"]
    losses = []
    for rows in batches:
        idx, targets = rows[:, :t], rows[:, 1:]
        opt.zero_grad()
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, v), targets.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    if len(sys.argv) != 6:
        fail("usage: gpt_reference.py CONFIG.json INIT.safetensors BATCHES.bin LOSSES_OUT WEIGHTS_OUT")
    config, init, batches_path, losses_out, weights_out = sys.argv[1:6]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = read_config(config)
    model = Gpt(cfg)
    load_weights(model, init)
    batches = read_batches(batches_path, cfg)
    losses = train(model, batches, cfg)
    with open(losses_out, "w") as f:
        f.write("\n".join(repr(v) for v in losses) + "\n")
    write_safetensors(weights_out, {n: p.detach() for n, p in model.named_parameters()}, {})


if __name__ == "__main__":
    main()
