#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# benchmarks/large_batch.sh — the large-batch claim of LAMB (You et al. 2019) at Fashion-MNIST scale: after the same
# number of epochs, AdamW at batch 256 (the baseline), and AdamW and LAMB at batches 4096 and 8192; prints every run,
# then a table of each optimizer and batch at its best learning rate (test accuracy after the last epoch).
#
#   benchmarks/large_batch.sh BUILD/examples/fashion_mnist/fashion_mnist [EPOCHS] [WARMUP_FRACTION] [flags...]
#
# The paper's recipe for every run: the same epochs (default 20), linear warmup over a fixed fraction of the run
# (default 0.25, --warmup-fraction) then cosine decay to 0, weight decay 0.01, and an lr grid of 4 points for each
# optimizer at each large batch, the same effort for AdamW and LAMB. AdamW's grid at batch B runs from the
# square-root rule (1e-3 · √(B/256)) to 8x it; LAMB's step is lr·‖w‖ per tensor, so its grid is its own (the
# paper's 1e-2 range; 8e-2 diverges at both batches). The baseline at 256 gets 3 points. Runs are deterministic
# (seed 1); one seed only, so differences under a few tenths of a point are not significant.
set -euo pipefail
exe=${1:?usage: large_batch.sh FASHION_MNIST_BINARY [EPOCHS] [WARMUP_FRACTION] [flags...]}
epochs=${2:-20}
warmup=${3:-0.25}
shift $(( $# >= 3 ? 3 : $# ))
train=60000
results=$(mktemp)
trap 'rm -f "$results"' EXIT

run() {  # optimizer batch lr
  local opt=$1 batch=$2 lr=$3
  shift 3
  local steps=$(( (train + batch - 1) / batch * epochs ))
  local out acc secs
  out=$("$exe" --optimizer "$opt" --batch "$batch" --lr "$lr" --epochs "$epochs" --warmup-fraction "$warmup" \
        --lr-schedule cosine --weight-decay 0.01 --threads 1 "$@")
  acc=$(grep -o 'test_accuracy=[0-9.]*' <<<"$out" | tail -1 | cut -d= -f2)
  secs=$(grep -o 'seconds=[0-9.]*' <<<"$out" | tail -1 | cut -d= -f2)
  printf '%-8s %6s %9s %7s %9s %9s\n' "$opt" "$batch" "$lr" "$steps" "$acc" "$secs" | tee -a "$results"
}

echo "# Fashion-MNIST MLP, ${epochs} epochs each, warmup ${warmup} of the run then cosine, weight decay 0.01;"
echo "# accuracy on the 10k test images after the last epoch"
printf '%-8s %6s %9s %7s %9s %9s\n' optimizer batch lr steps accuracy seconds
for lr in 0.001 0.002 0.004; do run adamw 256 "$lr" "$@"; done
for lr in 0.004 0.008 0.016 0.032; do run adamw 4096 "$lr" "$@"; done
for lr in 0.01 0.02 0.03 0.04; do run lamb 4096 "$lr" "$@"; done
for lr in 0.006 0.012 0.024 0.048; do run adamw 8192 "$lr" "$@"; done
for lr in 0.02 0.03 0.04 0.06; do run lamb 8192 "$lr" "$@"; done

echo
echo "# best lr of each optimizer and batch (${epochs} epochs each); gap: points below AdamW at 256"
base=$(awk '$2 == 256 && $5 > b { b = $5 } END { print b }' "$results")
printf '%-8s %6s %9s %9s %7s\n' optimizer batch best_lr accuracy gap
sort -k2,2n -k1,1 -k5,5gr "$results" | awk -v base="$base" '
  { key = $1 " " $2 } !(key in seen) { seen[key] = 1; printf "%-8s %6s %9s %9s %+7.2f\n", $1, $2, $3, $5, 100 * ($5 - base) }'
