# SPDX-License-Identifier: Apache-2.0
# benchmarks/bench_torch_common.py — what the PyTorch baseline scripts share: the BLAS library torch loaded.
# Imported by gpt_throughput_torch.py and train_throughput_torch.py, which put this directory on sys.path.


def blas_library():
    with open("/proc/self/maps") as f:
        for line in f:
            if "blas" in line and ".so" in line:
                return line.split()[-1]
    return "unknown"
