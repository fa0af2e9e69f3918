#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# benchmarks/compare_revisions.sh — throughput of two revisions side by side, from the same run on the same machine:
#   1. exports each revision (git archive) to $DML_COMPARE_DIR/<commit> (default /tmp/dml-compare), configures
#      it with the cpu-release preset (tests, examples, install rules and CUDA off) and builds just the
#      benchmark targets; an export that built before is reused
#   2. runs the benchmarks alternating, before then after, N rounds (the order flips every other round, so a
#      load that drifts during the run weighs on both alike), with the same flags and OPENBLAS_NUM_THREADS=1
#   3. prints, per benchmark and per configuration it reports (pipeline schedule, GPT layout, ...), the median
#      figure of each revision, the ratio after/before, each revision's min-max spread, the machine's load
#      average and the share of CPU time other processes took during the runs, and a verdict against ±TOL%
# Usage: benchmarks/compare_revisions.sh [-n ROUNDS] [-t TOL%] [--build-only] [BEFORE [AFTER [TARGET...]]]
#   BEFORE, AFTER: any revisions git names (default 6a692e0 and HEAD); TARGET: a benchmark target, optionally
#   with its flags as 'name:flags' (e.g. 'train_throughput:--json --parallel ddp --ranks 1'). Without targets:
#   train_throughput (the bare network and the trainer, ddp on one rank), pipeline_throughput and
#   gpt_throughput. A run must print JSON (one object per line, or to the file '{json}' in its flags stands for).
# The figures and every run's output stay under $DML_COMPARE_DIR/results-<before>-<after>-<time>/.
# JOBS sets build parallelism (default 2).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
jobs=${JOBS:-2}
root=${DML_COMPARE_DIR:-/tmp/dml-compare}
rounds=5
tolerance=3
build_only=0
positional=()
while (($#)); do
  case $1 in
    -n) rounds=$2; shift 2 ;;
    -t) tolerance=$2; shift 2 ;;
    --build-only) build_only=1; shift ;;
    -h|--help) sed -n '3,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) positional+=("$1"); shift ;;
  esac
done
before=${positional[0]:-6a692e0}
after=${positional[1]:-HEAD}
specs=("${positional[@]:2}")
if ((${#specs[@]} == 0)); then
  # Each run takes about 15-45 s on a quiet 2-core machine. train_throughput's trainer row is the path
  # dml::trainer adds over the bare network; pipeline_throughput runs every schedule (best of 3 each):
  # at 20 steps its per-process spread was 15-23% and medians wandered by ±7%, at 60 steps 12-17%.
  specs=("train_throughput:--json --steps 200"
         "train_throughput:--json --steps 200 --parallel ddp --ranks 1"
         "pipeline_throughput:--json --steps 60"
         "gpt_throughput:--json {json} --no-torch --layers 2 --warmup 1")
fi

say() { printf 'compare: %s\n' "$*" >&2; }

sha_before=$(git -C "$repo" rev-parse --verify --short=7 "$before^{commit}")
sha_after=$(git -C "$repo" rev-parse --verify --short=7 "$after^{commit}")
[[ $sha_before != "$sha_after" ]] || say "warning: $before and $after are the same commit ($sha_before)"

targets=()
for spec in "${specs[@]}"; do
  t=${spec%%:*}
  [[ " ${targets[*]} " == *" $t "* ]] || targets+=("$t")
done

# Exports, configures and builds revision $1 (a short commit); the binaries land in $root/$1/build/cpu-release/benchmarks.
build_revision() {
  local sha=$1 dir=$root/$1
  if [[ ! -f $dir/.exported ]]; then
    rm -rf "$dir"
    mkdir -p "$dir"
    git -C "$repo" archive "$sha" | tar -x -C "$dir"
    touch "$dir/.exported"
  fi
  if [[ ! -f $dir/build/cpu-release/CMakeCache.txt ]]; then
    (cd "$dir" && cmake --preset cpu-release -DDML_BUILD_TESTS=OFF -DDML_BUILD_EXAMPLES=OFF -DDML_INSTALL=OFF \
       -DDML_ENABLE_CUDA=OFF >"$dir/configure.log" 2>&1) || { say "configure of $sha failed: $dir/configure.log"; tail -20 "$dir/configure.log" >&2; exit 1; }
  fi
  say "building ${targets[*]} at $sha (-j $jobs)"
  cmake --build "$dir/build/cpu-release" --target "${targets[@]}" -j "$jobs" >"$dir/build.log" 2>&1 \
    || { say "build of $sha failed: $dir/build.log"; tail -30 "$dir/build.log" >&2; exit 1; }
}

mkdir -p "$root"
build_revision "$sha_before"
build_revision "$sha_after"
((build_only)) && { say "built: $root/$sha_before $root/$sha_after"; exit 0; }

results=$root/results-$sha_before-$sha_after-$(date +%Y%m%d-%H%M%S)
mkdir -p "$results/runs"
table=$results/figures.tsv   # round, job, revision, config, value, unit, load1, others
: >"$table"

# Runs one benchmark and appends its figures to the table. $1 job index, $2 revision, $3 round.
# A small Python wrapper times the run and measures the share of the machine's CPU time that other
# processes took meanwhile (/proc/stat less the run's own CPU time).
run_one() {
  local job=$1 sha=$2 round=$3
  local spec=${specs[$job]} target=${specs[$job]%%:*} flags=""
  [[ $spec == *:* ]] && flags=${spec#*:}
  local base=$results/runs/job$job-$sha-r$round
  flags=${flags//\{json\}/$base.json}
  local exe=$root/$sha/build/cpu-release/benchmarks/$target
  # shellcheck disable=SC2086  # flags are words
  OPENBLAS_NUM_THREADS=1 python3 - "$base" "$exe" $flags <<'PY' || { say "run failed: $base.out"; tail -5 "$base.out" >&2; exit 1; }
import os, resource, subprocess, sys, time
base, cmd = sys.argv[1], sys.argv[2:]
def stat():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v), sum(v) - v[3] - v[4]
load1 = open("/proc/loadavg").read().split()[0]
total0, busy0 = stat()
ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
t0 = time.monotonic()
with open(base + ".out", "w") as out:
    rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT)
wall = time.monotonic() - t0
ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
total1, busy1 = stat()
tick = os.sysconf("SC_CLK_TCK")
own = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
others = max(0.0, (busy1 - busy0) / tick - own) / max((total1 - total0) / tick, 1e-9)
with open(base + ".meta", "w") as f:
    f.write(f"{load1}\t{others:.3f}\t{wall:.1f}\n")
sys.exit(rc)
PY
  python3 - "$base" "$job" "$sha" "$round" >>"$table" <<'PY'
import json, os, sys
base, job, sha, rnd = sys.argv[1:5]
load1, others, wall = open(base + ".meta").read().split()
objects = []
for path in (base + ".out", base + ".json"):
    if os.path.exists(path):
        for line in open(path):
            line = line.strip()
            if line.startswith("{"):
                try:
                    objects.append(json.loads(line))
                except ValueError:
                    pass
def label(o):
    if "layout" in o:  # gpt_throughput, moe_throughput
        return o["layout"]
    if "schedule" in o:  # pipeline_throughput
        s = o["schedule"]
        return f"{s} pp{o.get('pp', 1)} M{o.get('microbatches', 1)}"
    if "parallel" in o:  # train_throughput
        return f"{o['parallel']} x{o.get('ranks', 1)} {o.get('precision', '')}".strip()
    keys = [k for k in ("comm", "op", "ranks", "bytes") if k in o]
    return " ".join(f"{k}={o[k]}" for k in keys) or "-"
n = 0
for o in objects:
    for key, unit in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s"), ("busbw_gbs", "GB/s")):
        if key in o and not o.get("skipped"):
            print(f"{rnd}\t{job}\t{sha}\t{label(o)}\t{o[key]}\t{unit}\t{load1}\t{others}")
            n += 1
            break
if n == 0:
    sys.exit(f"compare: no figures in {base}.out")
PY
  printf '  round %d  job %d  %-20s %s  %5.1f s  load %s  others %s\n' "$round" "$job" "$target" "$sha" \
    "$(cut -f3 "$base.meta")" "$(cut -f1 "$base.meta")" "$(cut -f2 "$base.meta")" >&2
}

cpu=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
{
  echo "# CPU: $cpu ($(nproc) cores); $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "# before = $before ($sha_before), after = $after ($sha_after); $rounds rounds, alternating; OPENBLAS_NUM_THREADS=1"
  echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$results/header.txt"
for job in "${!specs[@]}"; do echo "# job $job: ${specs[$job]}"; done | tee -a "$results/header.txt"

for ((round = 1; round <= rounds; ++round)); do
  for job in "${!specs[@]}"; do
    if ((round % 2)); then order=("$sha_before" "$sha_after"); else order=("$sha_after" "$sha_before"); fi
    for sha in "${order[@]}"; do run_one "$job" "$sha" "$round"; done
  done
done

python3 - "$table" "$sha_before" "$sha_after" "$tolerance" "${specs[@]}" <<'PY' | tee "$results/summary.txt"
import statistics, sys
table, before, after, tol = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
specs = sys.argv[5:]
rows = [line.rstrip("\n").split("\t") for line in open(table) if line.strip()]
groups = {}  # (job, config) -> {sha: [values]}
loads, others, units = [], [], {}
for rnd, job, sha, config, value, unit, load1, other in rows:
    groups.setdefault((int(job), config), {}).setdefault(sha, []).append(float(value))
    units[(int(job), config)] = unit
    loads.append(float(load1))
    others.append(float(other))
print(f"# load average (1 min) at each run's start: median {statistics.median(loads):.2f}, "
      f"range {min(loads):.2f}-{max(loads):.2f}; other processes' share of the CPU during the runs: median "
      f"{100 * statistics.median(others):.0f}%, range {100 * min(others):.0f}-{100 * max(others):.0f}%")
head = (f"{'benchmark':<20} {'config':<22} {'unit':<10} {'before med':>11} {'after med':>11} {'after/before':>12} "
        f"{'before min-max':>19} {'after min-max':>19} {'noise':>6}  verdict (±{tol:g}%)")
print(head)
print("-" * len(head))
for (job, config), by in sorted(groups.items(), key=lambda g: g[0][0]):  # per job, in printed order
    b, a = by.get(before, []), by.get(after, [])
    if not b or not a:
        continue
    mb, ma = statistics.median(b), statistics.median(a)
    ratio = ma / mb
    # noise: the larger relative spread (max-min over median) of the two revisions
    noise = max((max(b) - min(b)) / mb, (max(a) - min(a)) / ma)
    if abs(ratio - 1) * 100 <= tol:
        verdict = "within"
    elif min(a) <= max(b) and min(b) <= max(a):
        verdict = "outside, ranges overlap (noise?)"
    else:
        verdict = "SLOWER" if ratio < 1 else "faster"
    name = specs[job].split(":", 1)[0]
    print(f"{name:<20} {config:<22} {units[(job, config)]:<10} {mb:>11.1f} {ma:>11.1f} {ratio:>12.3f} "
          f"{min(b):>9.1f}-{max(b):<9.1f} {min(a):>9.1f}-{max(a):<9.1f} {100 * noise:>5.1f}%  {verdict}")
PY
echo "# load average at the end: $(cut -d' ' -f1-3 /proc/loadavg); raw figures: $table"
