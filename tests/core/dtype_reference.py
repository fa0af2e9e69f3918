# SPDX-License-Identifier: Apache-2.0
# tests/core/dtype_reference.py — PyTorch's float32 -> bfloat16 / float16 rounding, the reference
# for test_dtype. Usage: dtype_reference.py IN OUT. IN holds little-endian float32 bit patterns;
# OUT receives the bfloat16 bit patterns of all of them, then the float16 bit patterns.
import sys

import numpy as np
import torch


def main(src, dst):
    x = torch.from_numpy(np.fromfile(src, dtype="<u4").view("<f4").copy())
    b = x.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2")
    h = x.to(torch.float16).view(torch.int16).numpy().astype("<i2")
    np.concatenate([b, h]).tofile(dst)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: dtype_reference.py IN OUT")
    main(sys.argv[1], sys.argv[2])
