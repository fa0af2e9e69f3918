#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# tests/fuzz/make_corpus.py — writes the seed corpus of the libFuzzer harnesses into
# tests/fuzz/corpus/<harness>/: small valid files and edge cases of each format. Deterministic
# (gzip without a timestamp), so rerunning it changes nothing. Regression inputs that a fuzz run
# found are added to the same folders by hand and are not touched here.
import gzip
import json
import os
import struct

here = os.path.dirname(os.path.abspath(__file__))


def put(harness, name, data):
    d = os.path.join(here, "corpus", harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def gz(data):
    return gzip.compress(data, mtime=0)


# ---- IDX ------------------------------------------------------------------------------------
def idx(dims, payload, type_code=0x08):
    return bytes([0, 0, type_code, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + bytes(payload)


labels = idx([3], [1, 2, 3])
images = idx([2, 2, 2], range(8))
put("fuzz_idx", "labels-3", labels)
put("fuzz_idx", "images-2x2x2", images)
put("fuzz_idx", "labels-3.gz", gz(labels))
put("fuzz_idx", "images-2x2x2.gz", gz(images))
put("fuzz_idx", "two-members.gz", gz(images[:7]) + gz(images[7:]))
put("fuzz_idx", "empty-0x28x28", idx([0, 28, 28], []))
put("fuzz_idx", "float-type", idx([1], [0, 0, 0, 0], type_code=0x0D))
put("fuzz_idx", "truncated.gz", gz(images)[:-6])
put("fuzz_idx", "empty.gz", gz(b""))

# ---- safetensors ----------------------------------------------------------------------------
def safetensors(tensors, metadata=None, pad=True):
    """tensors: list of (name, dtype, shape, bytes); offsets follow the list's order."""
    header, blobs, off = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, blob in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


f32 = lambda *v: struct.pack("<%df" % len(v), *v)
put("fuzz_safetensors", "two-tensors",
    safetensors([("w", "F32", [2, 2], f32(1, 2, 3, 4)), ("step", "I64", [1], struct.pack("<q", 7))],
                metadata={"format": "pt"}))
put("fuzz_safetensors", "all-dtypes",
    safetensors([("a", "F64", [1], struct.pack("<d", 0.5)), ("b", "BF16", [2], b"\x80\x3f\x00\x40"),
                 ("c", "F16", [1], b"\x00\x3c"), ("d", "I32", [1], struct.pack("<i", -1)),
                 ("e", "U8", [3], b"\x01\x02\x03"), ("f", "F32", [], f32(9))]))
put("fuzz_safetensors", "zero-size", safetensors([("empty", "F32", [0, 4], b""), ("x", "U8", [1], b"\x05")]))
put("fuzz_safetensors", "no-tensors", safetensors([], metadata={}))
put("fuzz_safetensors", "unpadded", safetensors([("x", "F32", [1], f32(1))], pad=False))
put("fuzz_safetensors", "gap",
    struct.pack("<Q", 64) + json.dumps({"x": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}).encode().ljust(64)
    + b"\x00\x01")

# ---- checkpoint index -----------------------------------------------------------------------
def index(model, state_slots, files, world_size=None, **extra):
    j = {"format": "dml-checkpoint", "version": 1, "step": 100, "seed": 42,
         "world_size": len(files) if world_size is None else world_size, "sharding": "zero<1>",
         "optimizer": {"name": "adamw", "state_slots": state_slots},
         "model": [{"name": n, "shape": s} for n, s in model],
         "files": [{"name": "rank-%d-of-%d.safetensors" % (r, len(files)), "rank": r, "bytes": 1000 + r,
                    "checksum": "%016x" % (0x0123456789abcdef + r), "ranges": ranges}
                   for r, ranges in enumerate(files)],
         "user": {"epoch": "3", "batch": "17"}}
    j.update(extra)
    return json.dumps(j, indent=1).encode()


model = [("0.weight", [2, 3]), ("0.bias", [3])]
whole = [[t + "/" + n, 0, 6 if n == "0.weight" else 3] for t in ("param", "state0", "state1") for n, _ in model]
put("fuzz_checkpoint_index", "one-rank", index(model, 2, [whole]))
halves = [[], []]
for t in ("param", "state0"):
    halves[0] += [[t + "/0.weight", 0, 4]]
    halves[1] += [[t + "/0.weight", 4, 6], [t + "/0.bias", 0, 3]]
put("fuzz_checkpoint_index", "two-ranks", index(model, 1, halves))
put("fuzz_checkpoint_index", "empty-model", index([], 0, []))
put("fuzz_checkpoint_index", "missing-shard", index(model, 0, [[["param/0.weight", 0, 6]]]))
put("fuzz_checkpoint_index", "wrong-version", index(model, 0, [[]], version=2))

# ---- command-line flags ---------------------------------------------------------------------
# argv words separated by NUL bytes (fuzz_flags also splits at newlines).
def argv(*words):
    return "\0".join(words).encode()


put("fuzz_flags", "good", argv("--steps", "5", "--ranks=4", "--lr", "1e-3", "--precision", "bf16",
                                "--hidden", "8,16", "--bias", "--no-shuffle", "--temperature", "0.5", "--every", "2",
                                "--skew", "0.5,-1"))
put("fuzz_flags", "positional", argv("7", "/tmp/dir"))
put("fuzz_flags", "nan", argv("--lr", "nan"))
put("fuzz_flags", "wrap", argv("--ranks", "4294967298"))
put("fuzz_flags", "negative", argv("--steps", "-1", "--seed", "-1", "--small", "-0"))
put("fuzz_flags", "exponent-integer", argv("--steps", "1e99"))
put("fuzz_flags", "unknown", argv("--no-such-flag"))
put("fuzz_flags", "missing-value", argv("--bias", "--steps"))
put("fuzz_flags", "twice", argv("--steps", "1", "--steps", "2"))
put("fuzz_flags", "help", argv("--offset", "100", "--help"))
put("fuzz_flags", "check", argv("--heads", "3"))
