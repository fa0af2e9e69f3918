# SPDX-License-Identifier: Apache-2.0
# tests/train/llama2c_check.py — the Python half of dml's llama2.c export test (test_llama2c.cpp): reads a file that
# dml::train::export_llama2c wrote as llama2.c's run.c reads one (a 7-int32 header, a negative vocab_size for an
# untied classifier, the float32 tensors in run.c's order, the two legacy RoPE tables it skips), then runs run.c's
# forward in numpy float32 — RMSNorm with eps 1e-5, q and k rotated in interleaved pairs with theta 10000,
# grouped-query attention, SwiGLU — and compares its logits with dml's.
# Usage: llama2c_check.py CASE_DIR...
#   CASE_DIR/model.bin    the exported file
#   CASE_DIR/case.json    {"tied", "batch", "seq"}
#   CASE_DIR/tokens.bin   little-endian int32, batch x seq token ids
#   CASE_DIR/logits.bin   little-endian float32, batch x seq x vocab: dml's logits for those tokens
# Checks, per case: the file's size is what the header implies, the classifier is shared exactly when the case is
# tied, the RoPE tables hold cos and sin of run.c's angles, and max |logits - dml| <= TOLERANCE * max |logits|. As a
# control, the same forward with q's and k's rows put back in rotate-half order must miss dml's logits by far more.
# Exits 77 (skipped) when numpy is missing.
import json
import os
import struct
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
try:
    import numpy as np
except ImportError:
    print("SKIPPED: llama2c_check.py needs numpy")
    sys.exit(77)

TOLERANCE = 2e-6  # measured: 3.5e-7 (untied), 2.9e-7 (tied)
CONTROL = 1e-2  # the least error with q and k in the wrong order
EPS = np.float32(1e-5)


def fail(message):
    raise SystemExit(f"llama2c_check.py: {message}")


def expect(cond, message):
    if not cond:
        fail(message)


def read_bin(path):
    with open(path, "rb") as f:
        blob = f.read()
    expect(len(blob) >= 28, f"{path}: expected a 28-byte header, found {len(blob)} bytes")
    dim, hidden, layers, heads, kv_heads, vocab, seq = struct.unpack("<7i", blob[:28])
    shared = vocab > 0
    vocab = abs(vocab)
    hs = dim // heads
    kv_dim = kv_heads * hs
    data = np.frombuffer(blob[28:], dtype="<f4")
    shapes = [("embed", (vocab, dim)), ("rms_att", (layers, dim)), ("wq", (layers, dim, dim)),
              ("wk", (layers, kv_dim, dim)), ("wv", (layers, kv_dim, dim)), ("wo", (layers, dim, dim)),
              ("rms_ffn", (layers, dim)), ("w1", (layers, hidden, dim)), ("w2", (layers, dim, hidden)),
              ("w3", (layers, hidden, dim)), ("rms_final", (dim,)), ("freq_real", (seq, hs // 2)),
              ("freq_imag", (seq, hs // 2))]
    if not shared:
        shapes.append(("wcls", (vocab, dim)))
    w, pos = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        expect(pos + n <= data.size, f"{path}: the file ends inside '{name}'")
        w[name] = data[pos:pos + n].reshape(shape)
        pos += n
    expect(pos == data.size, f"{path}: {4 * (data.size - pos)} bytes after the last tensor")
    if shared:
        w["wcls"] = w["embed"]
    cfg = {"dim": dim, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads, "vocab": vocab,
           "seq": seq, "shared": shared}
    return cfg, w


def rope_angles(seq, hs):
    # run.c: freq = 1 / powf(10000, (i % head_size) / head_size) for even i, angle = pos * freq, all in float32.
    i = np.arange(0, hs, 2, dtype=np.float32)
    freq = np.float32(1) / np.power(np.float32(10000), i / np.float32(hs))
    return np.arange(seq, dtype=np.float32)[:, None] * freq[None, :]  # [seq, hs/2]


def rmsnorm(x, weight):
    ss = (x * x).mean(axis=-1, keepdims=True, dtype=np.float32) + EPS
    return weight * (x / np.sqrt(ss))


def rotate(x, cos, sin):
    # x [T, n·hs]: each head's pairs (2i, 2i+1) turned by the angle of pair i at each position.
    t = x.shape[0]
    p = x.reshape(t, -1, cos.shape[1], 2)
    c, s = cos[:t, None, :], sin[:t, None, :]
    out = np.stack([p[..., 0] * c - p[..., 1] * s, p[..., 0] * s + p[..., 1] * c], axis=-1)
    return out.reshape(x.shape)


def forward(cfg, w, tokens):
    dim, heads, kv_heads = cfg["dim"], cfg["heads"], cfg["kv_heads"]
    hs = dim // heads
    t = len(tokens)
    angles = rope_angles(cfg["seq"], hs)
    cos, sin = np.cos(angles), np.sin(angles)
    mask = np.triu(np.full((t, t), -np.inf, dtype=np.float32), 1)
    x = w["embed"][tokens].astype(np.float32)
    for l in range(cfg["layers"]):
        xb = rmsnorm(x, w["rms_att"][l])
        q = rotate(xb @ w["wq"][l].T, cos, sin).reshape(t, heads, hs)
        k = rotate(xb @ w["wk"][l].T, cos, sin).reshape(t, kv_heads, hs)
        v = (xb @ w["wv"][l].T).reshape(t, kv_heads, hs)
        att = np.empty((t, heads, hs), dtype=np.float32)
        for h in range(heads):
            g = h // (heads // kv_heads)
            score = q[:, h] @ k[:, g].T / np.sqrt(np.float32(hs)) + mask
            score = np.exp(score - score.max(axis=-1, keepdims=True))
            att[:, h] = (score / score.sum(axis=-1, keepdims=True)) @ v[:, g]
        x = x + att.reshape(t, dim) @ w["wo"][l].T
        xb = rmsnorm(x, w["rms_ffn"][l])
        h1, h3 = xb @ w["w1"][l].T, xb @ w["w3"][l].T
        x = x + (h1 / (np.float32(1) + np.exp(-h1)) * h3) @ w["w2"][l].T
    return rmsnorm(x, w["rms_final"]) @ w["wcls"].T


def rotate_half_order(m, hs):
    # The inverse of the export's permutation: each head's rows (2i + s) back to rotate-half's (s·hs/2 + i).
    n = m.shape[0] // hs
    return m.reshape(n, hs // 2, 2, -1).transpose(0, 2, 1, 3).reshape(m.shape)


def logits_error(cfg, w, tokens, ours):
    got = np.stack([forward(cfg, w, seq) for seq in tokens])
    return np.abs(got - ours).max() / np.abs(got).max(), np.abs(got).max()


def check_case(case_dir):
    with open(os.path.join(case_dir, "case.json")) as f:
        case = json.load(f)
    path = os.path.join(case_dir, "model.bin")
    cfg, w = read_bin(path)
    expect(cfg["shared"] == case["tied"], f"{path}: the classifier is {'' if cfg['shared'] else 'not '}shared, "
                                          f"expected {'shared' if case['tied'] else 'separate'}")
    expect(cfg["seq"] == case["seq"], f"{path}: seq_len {cfg['seq']}, expected {case['seq']}")
    angles = rope_angles(cfg["seq"], cfg["dim"] // cfg["heads"]).astype(np.float64)
    table = max(np.abs(w["freq_real"] - np.cos(angles)).max(), np.abs(w["freq_imag"] - np.sin(angles)).max())
    expect(table <= 1e-5, f"{path}: the RoPE tables differ from cos and sin of run.c's angles by {table:.3g}")

    b, t, vocab = case["batch"], case["seq"], cfg["vocab"]
    tokens = np.fromfile(os.path.join(case_dir, "tokens.bin"), dtype="<i4")
    expect(tokens.size == b * t, f"{case_dir}/tokens.bin: expected {b * t} int32, found {tokens.size}")
    ours = np.fromfile(os.path.join(case_dir, "logits.bin"), dtype="<f4")
    expect(ours.size == b * t * vocab, f"{case_dir}/logits.bin: expected {b * t * vocab} float32, found {ours.size}")
    tokens, ours = tokens.reshape(b, t), ours.reshape(b, t, vocab)
    rel, scale = logits_error(cfg, w, tokens, ours)

    hs = cfg["dim"] // cfg["heads"]
    wrong = dict(w)
    wrong["wq"] = np.stack([rotate_half_order(m, hs) for m in w["wq"]])
    wrong["wk"] = np.stack([rotate_half_order(m, hs) for m in w["wk"]])
    control, _ = logits_error(cfg, wrong, tokens, ours)
    print(f"{os.path.basename(case_dir)}: {b} sequences of {t}, logits max |x| {scale:.3g}: max_rel_diff={rel:.3g}; "
          f"q and k in rotate-half order: max_rel_diff={control:.3g}")
    expect(rel <= TOLERANCE, f"{case_dir}: logits differ from dml's by {rel:.3g} of their scale, expected "
                             f"<= {TOLERANCE}")
    expect(control >= CONTROL, f"{case_dir}: with q and k in rotate-half order the logits differ from dml's by only "
                               f"{control:.3g}, expected >= {CONTROL}: the check cannot see the row order")


def main():
    if len(sys.argv) < 2:
        fail("usage: llama2c_check.py CASE_DIR...")
    for case_dir in sys.argv[1:]:
        check_case(case_dir)


if __name__ == "__main__":
    main()
