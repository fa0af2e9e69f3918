#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# benchmarks/checkpoint_stall.sh — what a checkpoint save costs training: the gpt example saving every N steps
# synchronously and in the background (--checkpoint-async), in turns, ROUNDS times. Within each run (so that the
# machine's drift between runs cancels), per save:
#   call     the time save_checkpoint held training (sync: the whole save; async: starting it, and finishing the
#            save before if it had not finished);
#   behind   what the steps run while a save was written behind them took beyond the run's median step;
#   stall    call + behind: the training time a save costs.
# The last save of a run is waited for at the end (reported, not a stall: the run is over). Medians over rounds;
# the goal: async's stall at most 10% of sync's.
#
#   benchmarks/checkpoint_stall.sh BUILD/examples/gpt/gpt [ROUNDS]
set -euo pipefail
exe=${1:?usage: checkpoint_stall.sh GPT_BINARY [ROUNDS]}
rounds=${2:-3}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
model=(--layers 4 --d-model 512 --heads 8 --seq 128 --batch 8 --steps 40 --holdout 0 --print-every 1000)
every=10

echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); ${model[*]}, a save every $every steps"
field() { sed "s/.*$1=\\(-\\{0,1\\}[0-9.]*\\).*/\\1/" <<<"$2"; }
declare -A call behind stall wait
for r in $(seq "$rounds"); do
  for mode in sync async; do
    rm -rf "$dir/ckpt"
    flags=(--checkpoint "$dir/ckpt" --checkpoint-every "$every")
    [[ $mode == async ]] && flags+=(--checkpoint-async)
    out=$("$exe" "${model[@]}" "${flags[@]}")
    line=$(grep '^checkpoint_saves=' <<<"$out")
    n=$(field checkpoint_saves "$line")
    c=$(awk -v x="$(field checkpoint_call_seconds "$line")" -v n="$n" 'BEGIN { printf "%.1f", 1000 * x / n }')
    b=$(awk -v x="$(field checkpoint_steps_excess_seconds "$line")" -v n="$n" 'BEGIN { printf "%.1f", 1000 * x / n }')
    w=$(awk -v x="$(field checkpoint_final_wait_seconds "$line")" 'BEGIN { printf "%.1f", 1000 * x }')
    call[$mode]+="$c "
    behind[$mode]+="$b "
    stall[$mode]+="$(awk -v c="$c" -v b="$b" 'BEGIN { printf "%.1f", c + b }') "
    wait[$mode]+="$w "
    echo "round $r $mode: $n saves; per save ${c} ms in the call, ${b} ms of steps behind it; ${w} ms waiting at the end"
  done
done
bytes=$(du -sb "$dir/ckpt/$(cat "$dir/ckpt/latest")" | cut -f1)
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
printf '%-6s %12s %12s %12s %16s\n' mode "call ms" "behind ms" "stall ms" "end wait ms"
for mode in sync async; do
  printf '%-6s %12s %12s %12s %16s\n' "$mode" "$(median <<<"${call[$mode]}")" "$(median <<<"${behind[$mode]}")" \
    "$(median <<<"${stall[$mode]}")" "$(median <<<"${wait[$mode]}")"
done
s=$(median <<<"${stall[sync]}")
a=$(median <<<"${stall[async]}")
echo "checkpoint $((bytes / 1048576)) MiB; async stall / sync stall = $(awk -v a="$a" -v s="$s" 'BEGIN { printf "%.3f", a / s }') (goal <= 0.1)"
