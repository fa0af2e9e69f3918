#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
# tests/train/checkpoint_crash.py — kill a training process with SIGKILL at random moments inside
# save_checkpoint (it checkpoints after every step), 20 times; every restart must resume from the last
# complete checkpoint and reproduce the per-step losses of an uninterrupted run, and what the killed
# saves left behind must not break the next save or resume. --async saves in the background (the kill lands
# while training goes on and the files are written behind it).
# Usage: checkpoint_crash.py BINARY [--async] [--kills N] [--seed S] [--keep DIR]
import argparse
import glob
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

STEPS = 200  # at most 3 attempts per kill, 3 steps each, then 5 more


def run_reference(binary, steps):
    out = subprocess.run([binary, "-", str(steps)], check=True, capture_output=True, text=True).stdout
    return {int(s): float.fromhex(v) for s, v in re.findall(r"^loss (\d+) (\S+)$", out, re.M)}


def latest_step(ckpt):
    """Steps done in the checkpoint that ckpt/latest names (0 when there is none)."""
    try:
        with open(os.path.join(ckpt, "latest")) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return 0
    m = re.fullmatch(r"step-(\d+)(?:\.\d+)?", name)
    if not m:
        raise AssertionError(f"latest names '{name}', expected a step directory")
    return int(m.group(1))


class Run:
    """One training process; reads its lines as they come."""

    def __init__(self, binary, ckpt, steps, mode=()):
        self.p = subprocess.Popen([binary, ckpt, str(steps), *mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL, bufsize=0)
        self.buf = b""
        self.losses = {}
        self.resumed = None
        self.begun, self.ended = {}, {}  # save step -> time seen

    def line(self):
        while b"\n" not in self.buf:
            chunk = self.p.stdout.read1(65536) if hasattr(self.p.stdout, "read1") else os.read(self.p.stdout.fileno(), 65536)
            if not chunk:
                if self.buf:
                    rest, self.buf = self.buf, b""
                    return self.parse(rest.decode())
                return None
            self.buf += chunk
        head, self.buf = self.buf.split(b"\n", 1)
        return self.parse(head.decode())

    def parse(self, text):
        now = time.monotonic()
        if m := re.fullmatch(r"loss (\d+) (\S+)", text):
            self.losses[int(m.group(1))] = float.fromhex(m.group(2))
        elif m := re.fullmatch(r"resumed (\d+)", text):
            self.resumed = int(m.group(1))
        elif m := re.fullmatch(r"save (\d+) (begin|end)", text):
            (self.begun if m.group(2) == "begin" else self.ended)[int(m.group(1))] = now
        return text

    def drain(self):
        while self.line() is not None:
            pass
        err = self.p.stderr.read().decode(errors="replace")
        return self.p.wait(), err


def compare(ref, losses, where):
    worst, exact = 0.0, 0
    for s, v in losses.items():
        if s not in ref:
            raise AssertionError(f"{where}: step {s} beyond the reference run")
        rel = abs(v - ref[s]) / abs(ref[s])
        exact += v == ref[s]
        # README claims a resumed run is bit-identical to an uninterrupted one (the binary prints each loss as
        # a hex float, every bit), so any difference fails.
        if v != ref[s]:
            raise AssertionError(f"{where}: step {s} loss {v!r}, the uninterrupted run has {ref[s]!r} "
                                 f"(relative difference {rel:.2e}; expected bit-identical)")
        worst = max(worst, rel)
    return worst, exact


def leftovers(ckpt):
    staging = glob.glob(os.path.join(ckpt, "*.partial-*"))
    temps = glob.glob(os.path.join(ckpt, "**", "*.tmp-*"), recursive=True)
    return staging, temps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--async", dest="background", action="store_true", help="asynchronous saves")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--keep", help="leave the checkpoints in this directory")
    args = ap.parse_args()
    # The host GEMM library per shape is chosen by timing once and recorded in a file that every later
    # process follows, so a restarted process computes the reference's bits. A fresh file per run
    # makes the first process here measure, as on a new machine.
    cache_dir = tempfile.mkdtemp(prefix="dml-gemm-choices-")
    os.environ["DML_HOST_GEMM_CACHE"] = os.path.join(cache_dir, "host-gemm.txt")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"checkpoint_crash: seed {seed} (rerun with --seed {seed})", flush=True)
    rng = random.Random(seed)
    started = time.monotonic()
    ref = run_reference(args.binary, STEPS)
    if len(ref) != STEPS:
        raise AssertionError(f"the reference run printed {len(ref)} losses, expected {STEPS}")
    mode = ("async",) if args.background else ()
    work = args.keep or tempfile.mkdtemp(prefix="dml-checkpoint-crash-")
    os.makedirs(work, exist_ok=True)
    ckpt = os.path.join(work, "ckpt")
    kills = attempts = 0
    worst, exact, compared = 0.0, 0, 0
    durations = []  # seconds from "save begin" to "save end", for the kill delay
    resumed_at = []
    try:
        while kills < args.kills:
            attempts += 1
            if attempts > 3 * args.kills:
                raise AssertionError(f"only {kills} of {attempts - 1} kills landed inside a save")
            before = latest_step(ckpt)
            run = Run(args.binary, ckpt, STEPS, mode)
            saves_first = rng.randrange(3)  # complete saves before the one to interrupt
            estimate = sorted(durations)[len(durations) // 2] if durations else 0.02
            victim = None
            while (text := run.line()) is not None:
                m = re.fullmatch(r"save (\d+) begin", text)
                if m and int(m.group(1)) >= (run.resumed or 0) + 1 + saves_first:
                    victim = int(m.group(1))
                    delay = rng.uniform(0.0, estimate)
                    time.sleep(delay)
                    os.kill(run.p.pid, signal.SIGKILL)
                    break
            rc, err = run.drain()
            if victim is None:
                raise AssertionError(f"attempt {attempts}: the run ended (rc {rc}) before the save to interrupt:\n{err}")
            if rc != -signal.SIGKILL:
                raise AssertionError(f"attempt {attempts}: expected death by SIGKILL, found rc {rc}:\n{err}")
            if run.resumed != before:
                raise AssertionError(f"attempt {attempts}: resumed at step {run.resumed}, but latest named step {before}")
            resumed_at.append(run.resumed)
            durations += [run.ended[s] - run.begun[s] for s in run.ended if s in run.begun]
            w, e = compare(ref, run.losses, f"attempt {attempts} (resumed at {run.resumed})")
            worst, exact, compared = max(worst, w), exact + e, compared + len(run.losses)
            after = latest_step(ckpt)
            inside = victim not in run.ended
            # No data lost: latest names the newest save that ended, or a later one that had begun (a synchronous
            # save: the one it was writing or the one before it; in the background, later saves may begin before
            # the kill lands).
            newest = max(run.ended, default=before)
            begun = max(run.begun, default=before)
            if not newest <= after <= begun:
                raise AssertionError(f"attempt {attempts}: killed after the save of step {newest} ended and that of "
                                     f"{begun} began, latest names step {after}")
            staging, temps = leftovers(ckpt)
            # Each save clears what earlier interrupted saves left: at most the last one's remains.
            if len(staging) > 1 or len(temps) > 3:
                raise AssertionError(f"attempt {attempts}: leftovers pile up: {staging} {temps}")
            if inside:
                kills += 1
            print(f"kill {kills if inside else '-':>2}: resumed at {run.resumed:3d}, killed {delay * 1e3:5.1f} ms into "
                  f"the save of step {victim:3d} ({'inside the save' if inside else 'after it ended'}); latest now "
                  f"{after}; leftovers: {len(staging)} staging, {len(temps)} temporary", flush=True)
        # One more run, uninterrupted, from what the last kill left: it must resume and finish.
        final_steps = latest_step(ckpt) + 5
        run = Run(args.binary, ckpt, final_steps, mode)
        rc, err = run.drain()
        if rc != 0:
            raise AssertionError(f"the final run failed (rc {rc}):\n{err}")
        w, e = compare(ref, run.losses, "the final run")
        worst, exact, compared = max(worst, w), exact + e, compared + len(run.losses)
        if latest_step(ckpt) != final_steps or leftovers(ckpt) != ([], []):
            raise AssertionError(f"the final run left latest at {latest_step(ckpt)} and {leftovers(ckpt)}")
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    median = sorted(durations)[len(durations) // 2] * 1e3 if durations else float("nan")
    print(f"checkpoint_crash{' --async' if args.background else ''}: {kills} kills inside save_checkpoint ({attempts} attempts), median save "
          f"{median:.1f} ms; {compared} losses after resumes, {exact} bit-identical, max relative difference "
          f"{worst:.1e}; {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AssertionError as e:
        print(f"checkpoint_crash FAILED: {e}", flush=True)
        sys.exit(1)
