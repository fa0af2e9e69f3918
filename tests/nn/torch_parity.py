# SPDX-License-Identifier: Apache-2.0
# tests/nn/torch_parity.py — the PyTorch half of dml's parity test: the same MLP, initial weights and
# batches (file order), trained with torch.optim; writes the per-step losses and the final weights.
# Usage: torch_parity.py INIT.safetensors DATA_DIR OPTIMIZER STEPS BATCH HIDDEN(a,b,..) LOSSES_OUT WEIGHTS_OUT
import gzip
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train"))
from safetensors_roundtrip import read_safetensors, write_safetensors  # noqa: E402


def read_idx(path, offset):
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=offset)


def main():
    init, data, optimizer, steps, batch, hidden, losses_out, weights_out = sys.argv[1:9]
    steps, batch = int(steps), int(batch)
    hidden = [int(h) for h in hidden.split(",") if h]
    images = read_idx(os.path.join(data, "train-images-idx3-ubyte.gz"), 16).reshape(-1, 784)
    labels = read_idx(os.path.join(data, "train-labels-idx1-ubyte.gz"), 8).astype(np.int64)

    widths = [784] + hidden + [10]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    state, _ = read_safetensors(init)
    model.load_state_dict(state, strict=True)

    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=2e-3, weight_decay=1e-3)
    elif optimizer == "adagrad":
        opt = torch.optim.Adagrad(model.parameters(), lr=0.02, lr_decay=0.01, weight_decay=1e-3)
    else:
        raise SystemExit(f"unknown optimizer {optimizer}")
    loss_fn = torch.nn.CrossEntropyLoss()
    losses = []
    for s in range(steps):
        x = torch.from_numpy(images[s * batch:(s + 1) * batch].astype(np.float32) / np.float32(255))
        y = torch.from_numpy(labels[s * batch:(s + 1) * batch])
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with open(losses_out, "w") as f:
        f.write("\n".join(repr(v) for v in losses) + "\n")
    write_safetensors(weights_out, {k: v.detach() for k, v in model.state_dict().items()}, {})


if __name__ == "__main__":
    main()
