#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# benchmarks/large_batch.sh — the large-batch claim of LAMB (You et al. 2019) at Fashion-MNIST scale: after the same
# number of epochs, AdamW at batch 256 (the baseline), AdamW at batch 8192 and LAMB at batch 8192, each with linear
# warmup then cosine decay; prints one table row per run (test accuracy after the last epoch, seconds).
#
#   benchmarks/large_batch.sh BUILD/examples/fashion_mnist/fashion_mnist [EPOCHS] [extra fashion_mnist flags...]
#
# Learning rates: AdamW's default 1e-3 at 256; at 8192 a small grid for each, the same size for both: AdamW from
# the square-root rule (1e-3 · √32 = 5.7e-3) to the linear one (3.2e-2), LAMB 2e-2 to 1e-1 (its step is lr·‖w‖ per
# tensor). Warmup: a tenth of each run (the example's cap). Compare the best row of each.
set -euo pipefail
exe=${1:?usage: large_batch.sh FASHION_MNIST_BINARY [EPOCHS] [flags...]}
epochs=${2:-10}
shift $(( $# >= 2 ? 2 : 1 ))
train=60000

run() {  # optimizer batch lr
  local opt=$1 batch=$2 lr=$3
  shift 3
  local steps=$(( train / batch * epochs ))
  local warmup=$(( steps / 10 ))
  local out
  out=$("$exe" --optimizer "$opt" --batch "$batch" --lr "$lr" --epochs "$epochs" --warmup "$warmup" \
        --lr-schedule cosine "$@")
  local acc secs
  acc=$(grep -o 'test_accuracy=[0-9.]*' <<<"$out" | tail -1 | cut -d= -f2)
  secs=$(grep -o 'seconds=[0-9.]*' <<<"$out" | tail -1 | cut -d= -f2)
  printf '%-8s %6s %9s %7s %7s %9s %9s\n' "$opt" "$batch" "$lr" "$steps" "$warmup" "$acc" "$secs"
}

echo "# Fashion-MNIST MLP, ${epochs} epochs each; accuracy on the 10k test images after the last epoch"
printf '%-8s %6s %9s %7s %7s %9s %9s\n' optimizer batch lr steps warmup accuracy seconds
run adamw 256 0.001 "$@"
for lr in 0.0057 0.01 0.016 0.032; do run adamw 8192 "$lr" "$@"; done
for lr in 0.02 0.05 0.1; do run lamb 8192 "$lr" "$@"; done
