# SPDX-License-Identifier: Apache-2.0
# tests/train/hf_llama_check.py — the Python half of dml's Hugging Face checkpoint test (test_hf_llama.cpp): reads a
# checkpoint that dml::train::save_hf_llama wrote as transformers' loader reads one, with a reader of its own (json,
# struct, numpy, torch; neither the safetensors nor the transformers package), checks it against Hugging Face's
# conventions, then runs LlamaForCausalLM's forward in plain torch from the Hugging Face-named tensors and compares its
# logits with dml's.
# Usage: hf_llama_check.py CASE_DIR...
#   CASE_DIR/checkpoint/  config.json, model.safetensors or model.safetensors.index.json and its shards
#   CASE_DIR/case.json    {"tied", "dtype" ("F32" or "BF16"), "max_shard_bytes", "batch", "seq"}
#   CASE_DIR/tokens.bin   little-endian int32, batch x seq token ids
#   CASE_DIR/logits.bin   little-endian float32, batch x seq x vocab: dml's logits for those tokens
# Checks, per case: config.json is LlamaConfig's keys as transformers writes them (sorted, indent 2); each file is
# safetensors with {"format": "pt"} metadata, its tensors sorted by name and covering the data section; the names,
# shapes and dtypes are LlamaForCausalLM's state dict (lm_head.weight left out when tied); the index is
# save_pretrained's (file names, total_size, weight_map) and the split into files is huggingface_hub's for
# max_shard_bytes; and max |logits - dml| <= 1e-5 * max |logits|.
import json
import math
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "nn"))
from llama_reference import Llama  # noqa: E402  (the model in plain torch, Hugging Face's parameter names)

TOLERANCE = 1e-5
NUMPY = {"F32": np.float32, "BF16": np.int16, "F16": np.float16}


def fail(message):
    raise SystemExit(f"hf_llama_check.py: {message}")


def expect(cond, message):
    if not cond:
        fail(message)


def hf_json(obj):
    # transformers' to_json_string and save_pretrained's index: sorted keys, indent 2, a final newline.
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def read_safetensors(path):
    # As the safetensors library reads a file: an 8-byte little-endian header length, a JSON header, data offsets
    # from the end of the header.
    with open(path, "rb") as f:
        blob = f.read()
    expect(len(blob) >= 8, f"{path}: expected at least 8 bytes, found {len(blob)}")
    (n,) = struct.unpack("<Q", blob[:8])
    expect(8 + n <= len(blob), f"{path}: header length {n} exceeds the file's {len(blob)} bytes")
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", None)
    expect(meta == {"format": "pt"}, f"{path}: expected __metadata__ {{'format': 'pt'}}, found {meta!r}")
    tensors, order, pos = {}, [], 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        expect(begin == pos, f"{path}: tensor '{name}' starts at {begin}, expected {pos} (contiguous data)")
        dtype = info["dtype"]
        expect(dtype in NUMPY, f"{path}: tensor '{name}': expected dtype F32, BF16 or F16, found {dtype}")
        arr = np.frombuffer(data[begin:end], dtype=np.dtype(NUMPY[dtype]).newbyteorder("<")).copy()
        t = torch.from_numpy(arr)
        if dtype == "BF16":
            t = t.view(torch.bfloat16)
        expect(t.numel() == math.prod(info["shape"]), f"{path}: tensor '{name}': {end - begin} bytes for shape "
                                                      f"{info['shape']} of {dtype}")
        tensors[name] = (dtype, t.reshape(info["shape"]))
        order.append(name)
        pos = end
    expect(pos == len(data), f"{path}: the tensors cover {pos} of the data section's {len(data)} bytes")
    expect(order == sorted(order), f"{path}: expected the tensors in name order (as safetensors stores them), "
                                   f"found {order}")
    return tensors


def hf_state_dict_shapes(cfg):
    # LlamaForCausalLM's state dict, in its order: names and shapes, written out from Hugging Face's modules.
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, inter, vocab = hidden // heads, cfg["intermediate_size"], cfg["vocab_size"]
    out = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", [heads * hd, hidden]),
                (p + "self_attn.k_proj.weight", [kv * hd, hidden]),
                (p + "self_attn.v_proj.weight", [kv * hd, hidden]),
                (p + "self_attn.o_proj.weight", [hidden, heads * hd]),
                (p + "mlp.gate_proj.weight", [inter, hidden]),
                (p + "mlp.up_proj.weight", [inter, hidden]),
                (p + "mlp.down_proj.weight", [hidden, inter]),
                (p + "input_layernorm.weight", [hidden]),
                (p + "post_attention_layernorm.weight", [hidden])]
    out.append(("model.norm.weight", [hidden]))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", [vocab, hidden]))
    return out


def hub_split(sizes, max_bytes):
    # huggingface_hub's split_state_dict_into_shards_factory: names in state-dict order with their byte sizes.
    shards, current, current_size = [], [], 0
    for name, size in sizes:
        if size > max_bytes:
            shards.append([name])
            continue
        if current_size + size > max_bytes:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    return shards


def read_checkpoint(ckpt):
    files = sorted(os.listdir(ckpt))
    single = os.path.join(ckpt, "model.safetensors")
    state, file_of = {}, {}
    if os.path.exists(single):
        expect(files == ["config.json", "model.safetensors"], f"{ckpt}: expected config.json and model.safetensors "
                                                               f"alone, found {files}")
        for name, v in read_safetensors(single).items():
            state[name], file_of[name] = v, "model.safetensors"
        return state, file_of, None
    index_path = os.path.join(ckpt, "model.safetensors.index.json")
    with open(index_path) as f:
        text = f.read()
    index = json.loads(text)
    expect(text == hf_json(index), f"{index_path}: expected save_pretrained's text (sorted, indent 2)")
    expect(sorted(index) == ["metadata", "weight_map"], f"{index_path}: expected keys metadata and weight_map, found "
                                                       f"{sorted(index)}")
    shard_files = sorted(set(index["weight_map"].values()))
    n = len(shard_files)
    expect(shard_files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)],
           f"{index_path}: expected files model-00001-of-{n:05d}.safetensors ..., found {shard_files}")
    expect(files == sorted(shard_files + ["config.json", "model.safetensors.index.json"]),
           f"{ckpt}: expected the config, the index and its {n} files, found {files}")
    for file in shard_files:
        for name, v in read_safetensors(os.path.join(ckpt, file)).items():
            expect(name not in state, f"{file}: tensor '{name}' also in {file_of.get(name)}")
            expect(index["weight_map"].get(name) == file, f"{file}: tensor '{name}' is mapped to "
                                                          f"{index['weight_map'].get(name)!r} in the index")
            state[name], file_of[name] = v, file
    expect(sorted(state) == sorted(index["weight_map"]), f"{index_path}: weight_map lists tensors the files lack")
    total = sum(t.numel() * t.element_size() for _, t in state.values())
    expect(index["metadata"] == {"total_size": total}, f"{index_path}: expected metadata {{'total_size': {total}}}, "
                                                       f"found {index['metadata']}")
    return state, file_of, n


def read_config(ckpt, case):
    path = os.path.join(ckpt, "config.json")
    with open(path) as f:
        text = f.read()
    cfg = json.loads(text)
    expect(text == hf_json(cfg), f"{path}: expected transformers' text (sorted keys, indent 2)")
    want = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
            "hidden_act": "silu", "tie_word_embeddings": case["tied"],
            "torch_dtype": {"F32": "float32", "BF16": "bfloat16"}[case["dtype"]]}
    for key, value in want.items():
        expect(cfg.get(key) == value, f"{path}: expected '{key}' {value!r}, found {cfg.get(key)!r}")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings"):
        expect(isinstance(cfg.get(key), int) and cfg[key] > 0, f"{path}: expected '{key}' a positive integer, "
                                                               f"found {cfg.get(key)!r}")
    for key in ("rms_norm_eps", "rope_theta"):
        expect(isinstance(cfg.get(key), float), f"{path}: expected '{key}' a float, found {cfg.get(key)!r}")
    expect(cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) ==
           cfg["hidden_size"] // cfg["num_attention_heads"], f"{path}: head_dim {cfg.get('head_dim')}")
    s = cfg.get("rope_scaling")
    expect(s is None or (s.get("rope_type") == "llama3" and sorted(s) == sorted(
        ["rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"])),
        f"{path}: expected rope_scaling null or llama3's, found {s!r}")
    return cfg


def hf_rope(cfg, seq):
    # transformers' LlamaRotaryEmbedding: the inverse frequencies in float32 (llama3 scaling as
    # _compute_llama3_parameters), angles position x frequency in float32, cos and sin of [angles, angles].
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = cfg["rope_scaling"]
    if s is not None:
        factor, low, high, old = (s["factor"], s["low_freq_factor"], s["high_freq_factor"],
                                  s["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, inv_freq_llama)
    positions = torch.arange(seq, dtype=torch.int64)[None, None, :].float()
    freqs = (inv_freq[None, :, None].float() @ positions).transpose(1, 2)[0]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def check_case(case_dir):
    with open(os.path.join(case_dir, "case.json")) as f:
        case = json.load(f)
    ckpt = os.path.join(case_dir, "checkpoint")
    cfg = read_config(ckpt, case)
    state, file_of, shards = read_checkpoint(ckpt)

    expected = hf_state_dict_shapes(cfg)
    names = [n for n, _ in expected]
    expect(sorted(state) == sorted(names), f"{ckpt}: expected tensors {sorted(names)}, found {sorted(state)}")
    for name, shape in expected:
        dtype, t = state[name]
        expect(list(t.shape) == shape, f"{ckpt}: tensor '{name}': expected shape {shape}, found {list(t.shape)}")
        expect(dtype == case["dtype"], f"{ckpt}: tensor '{name}': expected dtype {case['dtype']}, found {dtype}")
    sizes = [(n, state[n][1].numel() * state[n][1].element_size()) for n in names]
    split = hub_split(sizes, case["max_shard_bytes"])
    if len(split) == 1:
        expect(shards is None, f"{ckpt}: expected one model.safetensors, found {shards} shards")
    else:
        want = {n: f"model-{k + 1:05d}-of-{len(split):05d}.safetensors" for k, s in enumerate(split) for n in s}
        got = {n: file_of[n] for n in names}
        expect(got == want, f"{ckpt}: expected huggingface_hub's split into {len(split)} files {want}, found {got}")

    # The forward: the reference model takes Hugging Face's names as they are; a tied head is the embedding.
    seq = cfg["max_position_embeddings"]
    ref_cfg = {"vocab": cfg["vocab_size"], "seq": seq, "layers": cfg["num_hidden_layers"],
               "d_model": cfg["hidden_size"], "heads": cfg["num_attention_heads"],
               "kv_heads": cfg["num_key_value_heads"], "ffn_hidden": cfg["intermediate_size"],
               "norm_eps": cfg["rms_norm_eps"], "rope_theta": cfg["rope_theta"],
               "rope_scaling": None if cfg["rope_scaling"] is None else
               {k: v for k, v in cfg["rope_scaling"].items() if k != "rope_type"},
               "tie": cfg["tie_word_embeddings"]}
    model = Llama(ref_cfg)
    weights = {n: t.float() for n, (_, t) in state.items()}
    if cfg["tie_word_embeddings"]:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(weights, strict=True)
    model.cos, model.sin = hf_rope(cfg, seq)

    b, t = case["batch"], case["seq"]
    tokens = np.fromfile(os.path.join(case_dir, "tokens.bin"), dtype="<i4")
    expect(tokens.size == b * t, f"{case_dir}/tokens.bin: expected {b * t} int32, found {tokens.size}")
    ours = np.fromfile(os.path.join(case_dir, "logits.bin"), dtype="<f4")
    expect(ours.size == b * t * cfg["vocab_size"], f"{case_dir}/logits.bin: expected {b * t * cfg['vocab_size']} "
                                                    f"float32, found {ours.size}")
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens.astype(np.int64)).view(b, t))
    ours = torch.from_numpy(ours).view(b, t, cfg["vocab_size"])
    diff = (logits - ours).abs().max().item()
    scale = logits.abs().max().item()
    rel = diff / scale
    where = f"{len(split)} files" if shards else "one file"
    print(f"{os.path.basename(case_dir)}: {len(names)} tensors ({case['dtype']}, {where}), logits max |x| {scale:.3g}: "
          f"max_abs_diff={diff:.3g} max_rel_diff={rel:.3g}")
    expect(rel <= TOLERANCE, f"{case_dir}: logits differ from dml's by {rel:.3g} of their scale, expected "
                             f"<= {TOLERANCE}")


def main():
    if len(sys.argv) < 2:
        fail("usage: hf_llama_check.py CASE_DIR...")
    torch.set_num_threads(1)
    for case_dir in sys.argv[1:]:
        check_case(case_dir)


if __name__ == "__main__":
    main()
