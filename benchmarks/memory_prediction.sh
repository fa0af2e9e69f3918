#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# benchmarks/memory_prediction.sh — the plan's bytes against the process's peak: the gpt example over a matrix of
# model sizes and layouts (one rank; 2 ranks of data parallelism, ZeRO-3, a 2-stage pipeline, tensor parallelism),
# each run through training, val_loss and sampling. For every run: the plan's bytes for the largest rank
# (cost::rank_bytes, which the example's own count equals), the process's ranks times that, the peak resident set
# (getrusage), how far over the prediction it went, and the two goals: peak <= predicted + the allowance (64 MiB and
# 16 MiB a rank, as example_gpt_memory holds it) and predicted <= 1.1 x peak.
#
#   benchmarks/memory_prediction.sh BUILD/examples/gpt/gpt [STEPS]
set -euo pipefail
exe=${1:?usage: memory_prediction.sh GPT_BINARY [STEPS]}
steps=${2:-2}

echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); $steps steps, val_loss and 50 sampled bytes each"
printf '%-36s %-36s %10s %5s %11s %10s %8s %6s %6s\n' model layout "rank MiB" ranks "plan MiB" "peak MiB" over "goal1" "goal2"
for model in "--layers 2 --d-model 256 --heads 4 --seq 256 --batch 16" \
             "--layers 4 --d-model 512 --heads 8 --seq 256 --batch 16" \
             "--layers 2 --d-model 256 --heads 4 --seq 1024 --batch 8"; do
  for layout in "--ranks 1" "--ranks 2" "--ranks 2 --parallel zero3" "--ranks 2 --pp 2 --microbatches 4" "--ranks 2 --tp 2"; do
    # shellcheck disable=SC2086
    out=$("$exe" $model $layout --steps "$steps" --sample 50 --print-every 1000)
    rank=$(grep -o '^predicted (largest rank): .*total=[0-9.]*' <<<"$out" | sed 's/.*total=//')
    line=$(grep '^process peak resident' <<<"$out")
    peak=$(sed 's/^process peak resident: \([0-9.]*\) MiB.*/\1/' <<<"$line")
    ranks=$(sed 's/.*(all \([0-9]*\) ranks.*/\1/' <<<"$line")
    plan=$(sed 's/.*; predicted \([0-9.]*\) MiB for its ranks.*/\1/' <<<"$line")
    over=$(sed 's/.*, \(-\{0,1\}[0-9.]*\) MiB over$/\1/' <<<"$line")
    goal1=$(awk -v o="$over" -v r="$ranks" 'BEGIN { print (o <= 64 + 16 * r) ? "yes" : "NO" }')
    goal2=$(awk -v p="$plan" -v m="$peak" 'BEGIN { print (p <= 1.1 * m) ? "yes" : "NO" }')
    printf '%-36s %-36s %10s %5s %11s %10s %8s %6s %6s\n' "${model// --/ }" "$layout" "$rank" "$ranks" "$plan" "$peak" "$over" "$goal1" "$goal2"
  done
done
