#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# benchmarks/elastic_overhead.sh — the steady-state cost of training through deaths: the same binary under dml-run
# on 2 ranks over comm::gloo, without (--comm gloo: plain DDP) and with --elastic (a vote per step with the
# coordinator, a configuration and a trainer built at the start), no fault injected. For each model width, the
# time per step of each and the overhead, as a curve against the step time (the goal: <= 5% at steps >= 50 ms).
#
#   benchmarks/elastic_overhead.sh BUILD_DIR [WIDTHS...]
#   ARGS="--parallel zero2" benchmarks/elastic_overhead.sh BUILD_DIR ...   (both sides take ARGS: under --elastic,
#   zero1-3 and --pp restart at each configuration's size and copy each member's state to the next every step)
#
# Each pair runs twice, alternating, and keeps each side's faster run (the machine is shared and noisy). Both sides
# print the seconds of their training loops only (not the scoring of the test set, nor the final state's gathering).
set -euo pipefail
build=${1:?usage: elastic_overhead.sh BUILD_DIR [WIDTHS...]}
shift
widths=("$@")
[[ ${#widths[@]} -gt 0 ]] || widths=(64 512 1536 3072)
run=$build/tools/dml-run
exe=$build/examples/fashion_mnist/fashion_mnist
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')${ARGS:+; args: $ARGS}"
printf '%8s %6s %12s %12s %10s\n' width steps off_ms/step on_ms/step overhead
for w in "${widths[@]}"; do
  steps=$(( w >= 1536 ? 80 : (w >= 512 ? 200 : 600) ))
  best_off=1e9 best_on=1e9
  for rep in 1 2; do
    # shellcheck disable=SC2086
    off=$("$run" --nproc 2 "$exe" ${ARGS:-} --comm gloo --steps "$steps" --epochs 1 --hidden "$w" --threads 1 2>/dev/null |
          sed -n 's/.*seconds=\([0-9.]*\).*/\1/p' | head -1)
    # shellcheck disable=SC2086
    on=$("$run" --nproc 2 "$exe" ${ARGS:-} --elastic --steps "$steps" --epochs 1 --hidden "$w" --threads 1 2>/dev/null |
         sed -n 's/.* seconds=\([0-9.]*\).*/\1/p' | head -1)
    best_off=$(awk -v a="$best_off" -v b="$off" 'BEGIN{print (b < a ? b : a)}')
    best_on=$(awk -v a="$best_on" -v b="$on" 'BEGIN{print (b < a ? b : a)}')
  done
  awk -v w="$w" -v s="$steps" -v off="$best_off" -v on="$best_on" \
    'BEGIN{printf "%8d %6d %12.2f %12.2f %9.1f%%\n", w, s, 1000*off/s, 1000*on/s, 100*(on/off-1)}'
done
