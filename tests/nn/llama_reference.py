# SPDX-License-Identifier: Apache-2.0
# tests/nn/llama_reference.py — the PyTorch half of dml's Llama model parity test: a Llama written out in plain torch
# as Hugging Face's LlamaForCausalLM computes it (RMSNorm, rotate-half RoPE with Llama 3.1's frequency scaling,
# grouped-query attention by repeat_interleave of the key/value heads, SwiGLU), built from dml's initial weights and
# trained with torch.optim.AdamW on the same batches; writes the per-step losses and the final weights. With "latent"
# its attention is DeepSeek-V3's multi-head latent attention (as Hugging Face's DeepseekV3Attention, but RoPE turning
# the rotated columns' halves, rotate-half, as dml does, where DeepSeek's weights pair them interleaved).
# Usage: llama_reference.py CONFIG.json INIT.safetensors BATCHES.bin LOSSES_OUT WEIGHTS_OUT
#   CONFIG.json: {"vocab", "seq", "layers", "d_model", "heads", "kv_heads", "ffn_hidden", "norm_eps", "rope_theta",
#                 "rope_scaling" (null, or {"factor", "low_freq_factor", "high_freq_factor",
#                 "original_max_position_embeddings"}), "tie", "steps", "batch", "lr", "beta1", "beta2", "adam_eps",
#                 "weight_decay", optionally "latent": null or {"q_lora_rank", "kv_lora_rank", "qk_nope_dim",
#                 "qk_rope_dim", "v_head_dim"}}
#   BATCHES.bin: little-endian int32, steps x batch x (seq+1) tokens; step s uses rows [batch, seq+1],
#                inputs row[:, :seq] and targets row[:, 1:].
# The model's parameters carry Hugging Face's names (model.layers.0.self_attn.q_proj.weight, ...). The weight files
# carry dml's: model.layers.N.self_attn.qkv_proj.weight holds q_proj's rows, then k_proj's, then v_proj's, and
# model.layers.N.mlp.gate_up_proj.weight holds gate_proj's rows, then up_proj's; both are split on reading and joined
# on writing. With "tie" lm_head shares model.embed_tokens.weight; the files hold lm_head.weight too (dml's copy),
# which must equal the embedding on reading and is written as it.
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train"))
from safetensors_roundtrip import read_safetensors, write_safetensors  # noqa: E402

CONFIG_KEYS = {"vocab": int, "seq": int, "layers": int, "d_model": int, "heads": int, "kv_heads": int,
               "ffn_hidden": int, "norm_eps": float, "rope_theta": float, "tie": bool, "steps": int, "batch": int,
               "lr": float, "beta1": float, "beta2": float, "adam_eps": float, "weight_decay": float}
SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
LATENT_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim")


def fail(message):
    raise SystemExit(f"llama_reference.py: {message}")


def read_config(path):
    with open(path) as f:
        raw = json.load(f)
    cfg = {}
    for key, kind in list(CONFIG_KEYS.items()) + [("rope_scaling", dict)]:
        if key not in raw:
            fail(f"{path}: expected key '{key}', found keys {sorted(raw)}")
        value = raw[key]
        if kind is bool and not isinstance(value, bool):
            fail(f"{path}: expected '{key}' to be true or false, found {value!r}")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            fail(f"{path}: expected '{key}' to be a positive integer, found {value!r}")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            fail(f"{path}: expected '{key}' to be a number, found {value!r}")
        if kind is dict and value is not None and sorted(value) != sorted(SCALING_KEYS):
            fail(f"{path}: expected 'rope_scaling' null or with keys {sorted(SCALING_KEYS)}, found {value!r}")
        cfg[key] = float(value) if kind is float else value
    latent = raw.get("latent")
    if latent is not None and (sorted(latent) != sorted(LATENT_KEYS) or
                               any(not isinstance(latent[k], int) or latent[k] < 0 for k in LATENT_KEYS)):
        fail(f"{path}: expected 'latent' null or with non-negative integers {sorted(LATENT_KEYS)}, found {latent!r}")
    cfg["latent"] = latent
    if cfg["d_model"] % cfg["heads"] or cfg["heads"] % cfg["kv_heads"] or (cfg["d_model"] // cfg["heads"]) % 2:
        fail(f"{path}: expected heads dividing d_model into an even head_dim and kv_heads dividing heads, found "
             f"d_model={cfg['d_model']} heads={cfg['heads']} kv_heads={cfg['kv_heads']}")
    return cfg


def rope_tables(cfg):
    # The inverse frequencies with Llama 3.1's scaling (Hugging Face's rope_type "llama3"), the angles p * f and their
    # cos and sin in double, rounded once to float32 (as dml's table is; Hugging Face rounds the frequencies to
    # float32 first, which moves the angles by a few ulp).
    hd = cfg["latent"]["qk_rope_dim"] if cfg.get("latent") else cfg["d_model"] // cfg["heads"]
    freqs = [1.0 / cfg["rope_theta"] ** (2 * i / hd) for i in range(hd // 2)]
    s = cfg["rope_scaling"]
    if s is not None:
        old, low, high, factor = (s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"],
                                  s["factor"])
        for i, f in enumerate(freqs):
            wavelength = 2 * math.pi / f
            if wavelength > old / low:
                freqs[i] = f / factor
            elif wavelength >= old / high:
                smooth = (old / wavelength - low) / (high - low)
                freqs[i] = (1 - smooth) * f / factor + smooth * f
    angles = torch.arange(cfg["seq"], dtype=torch.float64)[:, None] * torch.tensor(freqs, dtype=torch.float64)
    emb = torch.cat((angles, angles), dim=-1)  # [seq, head_dim]
    return emb.cos().float(), emb.sin().float()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(torch.nn.Module):
    # Hugging Face's LlamaRMSNorm in float32.
    def __init__(self, c, eps):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(c))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c, self.heads, self.kv_heads = cfg["d_model"], cfg["heads"], cfg["kv_heads"]
        self.hd = c // self.heads
        self.q_proj = torch.nn.Linear(c, self.heads * self.hd, bias=False)
        self.k_proj = torch.nn.Linear(c, self.kv_heads * self.hd, bias=False)
        self.v_proj = torch.nn.Linear(c, self.kv_heads * self.hd, bias=False)
        self.o_proj = torch.nn.Linear(self.heads * self.hd, c, bias=False)
        t = cfg["seq"]
        self.register_buffer("mask", torch.tril(torch.ones(t, t, dtype=torch.bool)), persistent=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.hd).transpose(1, 2)  # [B, H, T, hd]
        k = self.k_proj(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        cos, sin = cos[:t], sin[:t]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # Query head h reads key/value head h // (heads / kv_heads), as Hugging Face's repeat_kv.
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.hd))


class LatentAttention(torch.nn.Module):
    # Queries from a latent of q_lora_rank (or straight from x), keys and values from one of kv_lora_rank; each head's
    # query and key: qk_nope_dim columns without position, then qk_rope_dim turned by RoPE (the key's one per token,
    # shared by every head); values v_head_dim wide.
    def __init__(self, cfg):
        super().__init__()
        lat, c, eps = cfg["latent"], cfg["d_model"], cfg["norm_eps"]
        self.heads, self.nope, self.rope, self.v = cfg["heads"], lat["qk_nope_dim"], lat["qk_rope_dim"], lat["v_head_dim"]
        self.q_rank, self.kv_rank = lat["q_lora_rank"], lat["kv_lora_rank"]
        qd = self.nope + self.rope
        if self.q_rank:
            self.q_a_proj = torch.nn.Linear(c, self.q_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_rank, eps)
            self.q_b_proj = torch.nn.Linear(self.q_rank, self.heads * qd, bias=False)
        else:
            self.q_proj = torch.nn.Linear(c, self.heads * qd, bias=False)
        self.kv_a_proj_with_mqa = torch.nn.Linear(c, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, eps)
        self.kv_b_proj = torch.nn.Linear(self.kv_rank, self.heads * (self.nope + self.v), bias=False)
        self.o_proj = torch.nn.Linear(self.heads * self.v, c, bias=False)
        t = cfg["seq"]
        self.register_buffer("mask", torch.tril(torch.ones(t, t, dtype=torch.bool)), persistent=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h, qd = self.heads, self.nope + self.rope
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_rank else self.q_proj(x)
        q_nope, q_pe = q.view(b, t, h, qd).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, h, self.nope + self.v).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v], dim=-1)
        cos, sin = cos[:t], sin[:t]
        q_pe = q_pe * cos + rotate_half(q_pe) * sin
        k_pe = k_pe.view(b, 1, t, self.rope)
        k_pe = k_pe * cos + rotate_half(k_pe) * sin
        q = torch.cat((q_nope, q_pe), dim=-1)
        k = torch.cat((k_nope, k_pe.expand(b, h, t, self.rope)), dim=-1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(qd)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, h * self.v))


class Mlp(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c, f = cfg["d_model"], cfg["ffn_hidden"]
        self.gate_proj = torch.nn.Linear(c, f, bias=False)
        self.up_proj = torch.nn.Linear(c, f, bias=False)
        self.down_proj = torch.nn.Linear(f, c, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["d_model"], cfg["norm_eps"])
        self.self_attn = LatentAttention(cfg) if cfg.get("latent") else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["d_model"], cfg["norm_eps"])
        self.mlp = Mlp(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(cfg["vocab"], cfg["d_model"])
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg["layers"]))
        self.norm = RMSNorm(cfg["d_model"], cfg["norm_eps"])


class Llama(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = Decoder(cfg)
        self.lm_head = torch.nn.Linear(cfg["d_model"], cfg["vocab"], bias=False)
        if cfg["tie"]:
            # One Parameter in two places: named_parameters() lists it once, as model.embed_tokens.weight, and its
            # gradient is the sum of both uses.
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx):
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, self.cos, self.sin)
        return self.lm_head(self.model.norm(x))


def fused_parts(cfg):
    # dml's fused tensors: name suffix -> (Hugging Face's suffixes, their row counts).
    hd = cfg["d_model"] // cfg["heads"]
    q, kv, f = cfg["heads"] * hd, cfg["kv_heads"] * hd, cfg["ffn_hidden"]
    parts = {"mlp.gate_up_proj.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), (f, f))}
    if not cfg.get("latent"):  # latent attention's tensors are Hugging Face's own
        parts["self_attn.qkv_proj.weight"] = (("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                               "self_attn.v_proj.weight"), (q, kv, kv))
    return parts


def to_hugging_face(state, cfg, path):
    # dml's names -> the model's: fused tensors split by rows; a tied lm_head.weight checked and dropped.
    out = {}
    for name, w in state.items():
        if w.dtype != torch.float32:
            fail(f"{path}: tensor '{name}': expected dtype float32, found {w.dtype}")
        for fused, (parts, rows) in fused_parts(cfg).items():
            if name.endswith(fused):
                if w.shape[0] != sum(rows):
                    fail(f"{path}: tensor '{name}': expected {sum(rows)} rows {rows}, found shape {list(w.shape)}")
                for part, piece in zip(parts, torch.split(w, rows, dim=0)):
                    out[name[: -len(fused)] + part] = piece
                break
        else:
            out[name] = w
    if cfg["tie"]:
        head = out.pop("lm_head.weight", None)
        if head is None or not torch.equal(head, out["model.embed_tokens.weight"]):
            fail(f"{path}: expected lm_head.weight equal to model.embed_tokens.weight (tied), found "
                 f"{'none' if head is None else 'other values'}")
    return out


def to_dml(params, cfg):
    out = dict(params)
    for fused, (parts, _) in fused_parts(cfg).items():
        for name in [n for n in out if n.endswith(parts[0])]:
            stem = name[: -len(parts[0])]
            out[stem + fused] = torch.cat([out.pop(stem + p) for p in parts], dim=0)
    if cfg["tie"]:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def load_weights(model, path, cfg):
    # Strict: the file must hold exactly the model's parameters (fused as dml holds them), float32, in shape.
    state = to_hugging_face(read_safetensors(path)[0], cfg, path)
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
        fail("usage: llama_reference.py CONFIG.json INIT.safetensors BATCHES.bin LOSSES_OUT WEIGHTS_OUT")
    config, init, batches_path, losses_out, weights_out = sys.argv[1:6]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = read_config(config)
    model = Llama(cfg)
    load_weights(model, init, cfg)
    batches = read_batches(batches_path, cfg)
    losses = train(model, batches, cfg)
    with open(losses_out, "w") as f:
        f.write("\n".join(repr(v) for v in losses) + "\n")
    final = to_dml({n: p.detach().contiguous() for n, p in model.named_parameters()}, cfg)
    write_safetensors(weights_out, {n: w.contiguous() for n, w in final.items()}, {})


if __name__ == "__main__":
    main()
