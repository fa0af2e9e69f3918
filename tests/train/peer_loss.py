#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
# tests/train/peer_loss.py — kill one rank of an MPI training job with SIGKILL at a random moment; every
# other rank must end within 10 s with an error naming the operation and the lost peer, and no process
# of the job may be left. Repeated with random victims, delays and shardings.
# Usage: peer_loss.py MPIRUN BINARY [--iterations N] [--seed S] [--np N]
import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

OPS = r"(?:all_reduce|reduce_scatter|all_gather|all_gatherv|broadcast|reduce|all_to_allv?|send|recv|barrier|split)"


def state(pid):
    """'gone' when the process has ended (no /proc entry or a zombie), else its state letter."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return "gone"
    st = s[s.rindex(")") + 2]
    return "gone" if st in "ZX" else st


def procs_of(binary):
    """Pids of live processes running `binary`."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if argv0 == binary and state(d) != "gone":
            out.append(int(d))
    return out


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def one_run(args, it, rng, work):
    np_ = args.np
    sharding = rng.choice(["ddp", "zero1", "zero2", "zero3"])
    # Mostly Open MPI's default (mpirun terminates the others with SIGTERM); every third run with
    # recovery on, where nothing terminates them and the ranks must notice the loss on their own.
    recovery = it % 3 == 2
    out_path, err_path = os.path.join(work, f"out{it}"), os.path.join(work, f"err{it}")
    cmd = [args.mpirun, "--allow-run-as-root", "--oversubscribe", "--tag-output", "-np", str(np_)]
    if recovery:
        cmd += ["--mca", "orte_enable_recovery", "1"]
    cmd += [args.binary, sharding, "60"]
    with open(out_path, "w") as out, open(err_path, "w") as err:
        job = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        pids = {}
        started = time.monotonic()
        while True:  # every rank's pid, then training under way (rank 0 through its first step)
            text = read(out_path)
            for r, p in re.findall(r"^\[\d+,(\d+)\]<stdout>:rank \d+ pid (\d+)$", text, re.M):
                pids[int(r)] = int(p)
            if len(pids) == np_ and re.search(r"<stdout>:step \d+ ", text):
                break
            if job.poll() is not None or time.monotonic() - started > 60:
                raise AssertionError(f"run {it}: the job did not start training (rc {job.poll()}):\n{text}\n"
                                     f"{read(err_path)}")
            time.sleep(0.02)
        up = time.monotonic() - started
        delay = rng.uniform(0.0, 1.5)
        victim = rng.randrange(np_)
        time.sleep(delay)
        if job.poll() is not None:
            raise AssertionError(f"run {it}: the job ended before the kill (rc {job.returncode})")
        os.kill(pids[victim], signal.SIGKILL)
        killed = time.monotonic()
        ended = {}
        while len(ended) < np_ and time.monotonic() - killed < 20:
            for r, p in pids.items():
                if r not in ended and state(p) == "gone":
                    ended[r] = time.monotonic() - killed
            time.sleep(0.01)
        try:
            rc = job.wait(timeout=20)
        except subprocess.TimeoutExpired:
            rc = None
        time.sleep(0.2)
        left = procs_of(args.binary)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        for p in procs_of(args.binary):
            os.kill(p, signal.SIGKILL)

    err, out = read(err_path), read(out_path)
    problems = []
    worst = max(ended.values()) if ended else float("inf")
    for r in range(np_):
        if r == victim:
            continue
        if r not in ended:
            problems.append(f"rank {r} (pid {pids[r]}) still runs 20 s after the kill")
        elif ended[r] > 10:
            problems.append(f"rank {r} took {ended[r]:.1f} s to end, expected under 10 s")
        if re.search(rf"^\[\d+,{r}\]<stdout>:rank {r} done", out, re.M):
            problems.append(f"rank {r} finished training as if nothing had happened")
        lines = [l for l in err.splitlines() if re.match(rf"^\[\d+,{r}\]<stderr>:", l)]
        want = re.compile(rf"dml::comm::mpi: rank {r} of {np_}: (?:the next operation after )?({OPS}) "
                          rf"(?:cannot (?:complete|start)|waited [\d.]+ s and cannot complete): "
                          rf"peer ranks? (?:[^;]*\b)?{victim} \(pid {pids[victim]}\)")
        if not any(want.search(l) for l in lines):
            problems.append(f"rank {r} printed no error naming the operation and peer rank {victim}; its stderr:\n  " +
                            "\n  ".join(lines[-8:]))
    if recovery:
        # With recovery on, mpirun exits 0 whatever its ranks did; the ranks' own MPI_Abort(125) shows in
        # mpirun's report. That report goes through Open MPI's show_help, which can itself fail under recovery
        # ("ORTE_ERROR_LOG: ... show_help.c"); then the survivors' own line of the 125 path must show instead.
        abort_125 = re.compile(rf"^\[\d+,\d+\]<stderr>:dml::comm::mpi: rank \d+ of {np_}: {OPS} waited [\d.]+ s and "
                               rf"cannot complete: .*; aborting the job$", re.M)
        if "with errorcode 125" not in err and not ("show_help.c" in err and abort_125.search(err)):
            problems.append("no rank ended through MPI_Abort with status 125")
    elif rc in (0, None):
        problems.append(f"mpirun exited with {rc}, expected a non-zero status")
    if left:
        problems.append(f"processes of the job left behind: {left}")
    ops = sorted({m for m in re.findall(rf"dml::comm::mpi: rank \d+ of {np_}: (?:the next operation after )?({OPS})", err)})
    print(f"run {it}: {sharding:5s} {'recovery' if recovery else 'default ':8s} started in {up:.1f} s; victim rank "
          f"{victim} after {delay:.2f} s; all ranks ended {worst:.2f} s after the kill; mpirun rc {rc}; operations named: "
          f"{', '.join(ops) or 'none'}", flush=True)
    if args.verbose:
        print(err, flush=True)
    if problems:
        print(f"run {it} FAILED:\n- " + "\n- ".join(problems) + f"\n--- stderr ---\n{err}", flush=True)
    return not problems, worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mpirun")
    ap.add_argument("binary")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--verbose", action="store_true", help="print every run's stderr")
    args = ap.parse_args()
    args.binary = os.path.realpath(args.binary)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"peer_loss: seed {seed} (rerun with --seed {seed})", flush=True)
    rng = random.Random(seed)
    work = tempfile.mkdtemp(prefix="dml-peer-loss-")
    failed, times = 0, []
    try:
        for it in range(args.iterations):
            ok, worst = one_run(args, it, rng, work)
            failed += not ok
            times.append(worst)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"peer_loss: {args.iterations - failed}/{args.iterations} runs passed; time from the kill to the last "
          f"rank's end: max {max(times):.2f} s, mean {sum(times) / len(times):.2f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
