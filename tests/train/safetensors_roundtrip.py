# SPDX-License-Identifier: Apache-2.0
# tests/train/safetensors_roundtrip.py — the Python half of dml's safetensors round trip.
# Reads a dml-written file with a reader of its own (json + numpy + torch) and checks every
# value against the formulas test_safetensors.cpp used; then writes a file from torch tensors
# that the C++ test reads back. Usage: safetensors_roundtrip.py DML_FILE OUT_FILE
import json
import struct
import sys

import numpy as np
import torch

NUMPY = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I32": np.int32,
         "I64": np.int64, "U8": np.uint8, "BF16": np.int16}
TORCH_NAME = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8"}


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    assert n % 8 == 0, f"header length {n} is not a multiple of 8"
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", {})
    out, spans = {}, []
    for name, info in header.items():
        begin, end = info["data_offsets"]
        spans.append((begin, end))
        arr = np.frombuffer(data[begin:end], dtype=NUMPY[info["dtype"]]).copy()
        t = torch.from_numpy(arr)
        if info["dtype"] == "BF16":
            t = t.view(torch.bfloat16)
        out[name] = t.reshape(info["shape"])
    spans.sort()
    pos = 0
    for begin, end in spans:
        assert begin == pos, f"data section not contiguous at {begin}, expected {pos}"
        pos = end
    assert pos == len(data), f"tensors cover {pos} bytes of a {len(data)}-byte data section"
    return out, meta


def write_safetensors(path, tensors, meta):
    # Header in name order, data in reverse name order: a reader must follow the offsets.
    names = sorted(tensors)
    header, chunks, pos = {"__metadata__": meta}, [], 0
    for name in reversed(names):
        t = tensors[name].contiguous()
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        header[name] = {"dtype": TORCH_NAME[t.dtype], "shape": list(t.shape),
                        "data_offsets": [pos, pos + len(raw)]}
        chunks.append(raw)
        pos += len(raw)
    ordered = {"__metadata__": meta}
    ordered.update({name: header[name] for name in names})
    text = json.dumps(ordered).encode("utf-8")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for c in chunks:
            f.write(c)


def check(name, got, want):
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype}, expected {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs().max().item()
        raise AssertionError(f"{name}: values differ, max_abs_diff={diff}")


def main():
    dml_file, out_file = sys.argv[1], sys.argv[2]
    got, meta = read_safetensors(dml_file)
    # The formulas below are the ones test_safetensors.cpp writes with.
    want = {
        "0.weight": (torch.arange(12, dtype=torch.float32) * 0.25 - 1.0).reshape(3, 4),
        "0.bias": torch.tensor([0.5, -0.5, 1.0 / 3.0], dtype=torch.float32),
        "d": (torch.arange(6, dtype=torch.float64) / 7.0).reshape(2, 3),
        # 1/3 rounds in both 16-bit formats; the others are exact.
        "h": torch.tensor([-0.75, -0.375, 0.0, 1.0 / 3.0, 65504.0], dtype=torch.float32).to(torch.float16),
        "bf": torch.tensor([-0.75, -0.375, 0.0, 1.0 / 3.0, 2.0 ** 100], dtype=torch.float32).to(torch.bfloat16),
        "i32": torch.tensor([-7, 0, 2147483647], dtype=torch.int32),
        "i64": torch.tensor([[-(1 << 40), 1], [2, 1 << 50]], dtype=torch.int64),
        "u8": torch.arange(0, 250, 50, dtype=torch.uint8),
        "empty": torch.zeros(0, 3, dtype=torch.float32),
        "scalar": torch.tensor(42.0, dtype=torch.float32),
    }
    assert sorted(got) == sorted(want), f"tensor names {sorted(got)}, expected {sorted(want)}"
    for name, w in want.items():
        check(name, got[name], w)
    assert meta == {"step": "17", "model": "mlp"}, f"metadata {meta}"
    # The weights drop into the PyTorch module whose state dict they follow.
    layer = torch.nn.Linear(4, 3)
    layer.load_state_dict({"weight": got["0.weight"], "bias": got["0.bias"]})
    y = layer(torch.ones(1, 4))
    ref = got["0.weight"].sum(dim=1) + got["0.bias"]
    assert torch.allclose(y[0], ref), f"linear forward {y[0].tolist()}, expected {ref.tolist()}"

    # Values the C++ side recomputes on its own: see "safetensors written by Python" there.
    out = {
        "w": torch.sin(torch.arange(15, dtype=torch.float32)).reshape(5, 3),
        "b": torch.arange(7, dtype=torch.float64) / 3.0,
        "h": torch.tensor([0.5, -1.5, 2.0, 65504.0, 1e-3], dtype=torch.float16),
        "bf": torch.tensor([1.0, -2.5, 3.140625, 1e30], dtype=torch.bfloat16),
        "i": torch.tensor([1, -2, 3], dtype=torch.int32),
        "l": torch.tensor([[0, -1], [1 << 40, -(1 << 40)]], dtype=torch.int64),
        "u": torch.arange(5, dtype=torch.uint8) * 50,
        "e": torch.zeros(2, 0, dtype=torch.float32),
        # a transposed tensor: the writer must store it row-major, as .contiguous() does
        "t": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),
    }
    write_safetensors(out_file, out, {"format": "pt", "writer": "python"})
    print("python side ok:", len(got), "tensors read,", len(out), "written")


if __name__ == "__main__":
    main()
