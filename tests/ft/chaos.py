#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# tests/ft/chaos.py — the seeded harness of training through deaths: dml-run starts the Fashion-MNIST example with
# --elastic and kills or freezes random ranks at random moments (--chaos-*); each run must reach its last step,
# the ranks' commit logs must form one history (one parameter hash per step, every step committed), and no process
# may be left behind. Prints p50/p99 of the recovery times (a chaos event to the next commit) and steps lost.
import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile


def fail(msg):
    print("chaos: FAILED: " + msg, flush=True)
    sys.exit(1)


def leftover(log_path):
    """The ranks dml-run started (its log names each pid) that still run."""
    alive = []
    for pid in re.findall(r"start \d+ is pid (\d+)", open(log_path).read()):
        try:
            os.kill(int(pid), 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def one_run(a, seed, workdir):
    logs = os.path.join(workdir, f"run-{seed}")
    os.makedirs(logs)
    signals = ["kill", "stop", "kill,stop"][seed % 3] if a.signals == "mixed" else a.signals
    cmd = [a.dml_run, "--nproc", str(a.nproc), "--min", str(a.min), "--chaos-events", str(a.events),
           "--chaos-every-ms", str(a.every_ms), "--chaos-seed", str(seed), "--chaos-signals", signals,
           "--chaos-double", str(a.double), "--chaos-keep", str(a.keep_holders), "--heartbeat-deadline-ms", str(a.heartbeat_ms),
           "--groups", str(a.groups), "--chaos-coordinator", str(a.coordinator),
           "--log", os.path.join(logs, "dml-run.log"), "--stall-seconds", "60",
           a.program, "--elastic", "--steps", str(a.steps), "--comm-timeout-ms", str(a.comm_timeout_ms),
           "--commit-log", os.path.join(logs, "commits-{slot}.log")]
    # The Fashion-MNIST example's data and model; another program (--gpt) takes its own in --args.
    cmd += [] if a.gpt else ["--data", a.data, "--batch", str(a.batch), "--hidden", a.hidden]
    cmd += shlex.split(a.args) + ["--commit-every", str(a.commit_every)] * (a.commit_every > 1)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    intruder = try_intruder(os.path.join(logs, "dml-run.log")) if seed == a.seed else None
    out, err = proc.communicate(timeout=a.timeout)
    p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if intruder is not None:
        if intruder != "REFUSED":
            fail(f"seed {seed}: a process without the job token got '{intruder}' from the coordinator")
        if "refused a connection" not in open(os.path.join(logs, "dml-run.log")).read():
            fail(f"seed {seed}: the intruder was not logged")
    tail = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    if p.returncode != 0:
        fail(f"seed {seed}: dml-run exited {p.returncode}\n{p.stdout}\n{p.stderr}\n" +
             open(os.path.join(logs, "dml-run.log")).read())
    m = re.search(r"recoveries=(\d+) steps_lost=(\d+) restarts=(\d+) last_step=(\d+) "
                  r"recovery_seconds=([0-9.]+)/([0-9.]+)/([0-9.]+)", tail)
    if not m:
        fail(f"seed {seed}: no summary line in:\n{p.stdout}")
    # A recovery loses at most the steps since the last vote: the step in flight, or the tentative ones.
    if int(m.group(2)) > int(m.group(1)) * a.commit_every:
        fail(f"seed {seed}: {m.group(2)} steps lost in {m.group(1)} recoveries (at most {a.commit_every} each)")
    # One history: every step 1..steps committed, one hash per step across all ranks and starts.
    history = {}
    for name in os.listdir(logs):
        if not name.startswith("commits-"):
            continue
        last = 0
        lines = open(os.path.join(logs, name)).read().split("\n")
        for i, line in enumerate(lines):
            if len(line.split()) != 4:
                if line and i != len(lines) - 1:  # only a line cut by a SIGKILL may be partial: the last one
                    fail(f"seed {seed}: {name}: malformed line '{line}'")
                continue
            step, epoch, size, h = line.split()
            step = int(step)
            if step <= last:
                fail(f"seed {seed}: {name}: step {step} committed after step {last}")
            last = step
            if history.setdefault(step, h) != h:
                fail(f"seed {seed}: step {step} has two parameter hashes ({history[step]} and {h}): two histories")
    # With --commit-every K only every K-th step (and the last) is voted on and logged.
    missing = [s for s in range(1, a.steps + 1) if (s % a.commit_every == 0 or s == a.steps) and s not in history]
    if missing:
        fail(f"seed {seed}: steps never committed: {missing[:10]}")
    if not a.gpt and "test_accuracy=" not in p.stdout:
        fail(f"seed {seed}: no member reported the final state (the first DONE holding it scores it)\n{p.stderr}")
    finals = re.findall(r"state_hash=([0-9a-f]+)", p.stdout)
    if len(set(finals)) != 1:
        fail(f"seed {seed}: the members that finished hold different states: {finals}")
    left = leftover(os.path.join(logs, "dml-run.log"))
    if left:
        fail(f"seed {seed}: processes left behind: {left}")
    log_text = open(os.path.join(logs, "dml-run.log")).read()
    events = log_text.count("chaos: ")
    coordinator_kills = log_text.count("chaos: SIGKILL the coordinator")
    starts = re.search(r"coordinator_starts=(\d+)", tail)
    if starts and int(starts.group(1)) != coordinator_kills + 1:
        fail(f"seed {seed}: the coordinator was killed {coordinator_kills} times but started {starts.group(1)} times")
    loss = float(re.findall(r"final_loss=([0-9.]+)", p.stdout)[0])
    return {"recoveries": int(m.group(1)), "lost": int(m.group(2)), "events": events, "loss": loss,
            "coordinator_kills": coordinator_kills,
            "recovery": [float(x) for x in re.findall(r"recovery=([0-9.]+)", open(os.path.join(logs, "dml-run.log")).read())]}


def try_intruder(log_path):
    """Connects to the job's coordinator with a wrong token; returns the first word of its answer."""
    import socket
    import struct
    import time
    deadline = time.time() + 30
    while time.time() < deadline:
        if os.path.exists(log_path):
            m = re.search(r"coordinator and store at ([0-9.]+):(\d+)", open(log_path).read())
            if m:
                break
        time.sleep(0.05)
    else:
        fail("dml-run never logged its address")
    s = socket.create_connection((m.group(1), int(m.group(2))), timeout=10)
    body = b"HELLO not-the-token -1 0 store\n"
    s.sendall(struct.pack("<I", len(body)) + body)
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    s.close()
    return data[4:].split(b" ")[0].split(b"\n")[0].decode() if len(data) > 4 else "nothing"


def percentile(v, p):
    if not v:
        return 0.0
    v = sorted(v)
    return v[min(len(v) - 1, max(0, int(-(-p * len(v) // 1)) - 1))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dml-run", required=True)
    ap.add_argument("--program", required=True)
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--min", type=int, default=2)
    ap.add_argument("--events", type=int, default=3)
    ap.add_argument("--every-ms", type=int, default=1500)
    ap.add_argument("--signals", default="mixed")
    ap.add_argument("--double", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--hidden", default="64")
    ap.add_argument("--heartbeat-ms", type=int, default=1000)
    ap.add_argument("--comm-timeout-ms", type=int, default=1000)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--loss-bound", type=float, default=1e-3)
    ap.add_argument("--commit-every", type=int, default=1, help="the program's --commit-every (restarting layouts)")
    ap.add_argument("--gpt", action="store_true", help="the program is the GPT example (no --data, --batch, --hidden)")
    ap.add_argument("--keep-holders", type=int, default=1,
                    help="dml-run --chaos-keep: live holders of the last step a SIGKILL must leave")
    ap.add_argument("--groups", type=int, default=0,
                    help="dml-run --groups: failure domains of nproc / G ranks (0: every rank its own)")
    ap.add_argument("--coordinator", type=float, default=0.0,
                    help="dml-run --chaos-coordinator: chance that an event kills the coordinator instead of ranks")
    ap.add_argument("--args", default="", help="more arguments of the program, e.g. '--parallel zero2 --pp 2'")
    a = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="dml-chaos-")
    rec, lost, recoveries, events, drift, coordinator_kills = [], 0, 0, 0, 0.0, 0
    try:
        # The fault-free run: what the final loss would be (members differ only in the order of float sums).
        quiet = argparse.Namespace(**{**vars(a), "events": 0})
        ref = one_run(quiet, 0, workdir)["loss"]
        for i in range(a.runs):
            r = one_run(a, a.seed + i, workdir)
            drift = max(drift, abs(r["loss"] - ref))
            if abs(r["loss"] - ref) > a.loss_bound:
                fail(f"seed {a.seed + i}: final loss {r['loss']} is {abs(r['loss'] - ref):.2e} from the fault-free "
                     f"run's {ref} (bound {a.loss_bound})")
            rec += r["recovery"]
            lost += r["lost"]
            recoveries += r["recoveries"]
            events += r["events"]
            coordinator_kills += r["coordinator_kills"]
            print(f"chaos: seed {a.seed + i}: ok, {r['events']} events ({r['coordinator_kills']} of the coordinator), "
                  f"{r['recoveries']} recoveries, recovery seconds {r['recovery']}", flush=True)
        if a.coordinator > 0 and a.events > 0 and coordinator_kills == 0:
            fail("--coordinator was given but no event of these seeds killed the coordinator: choose other seeds")
    finally:
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"chaos: runs={a.runs} events={events} coordinator_kills={coordinator_kills} recoveries={recoveries} "
          f"steps_lost={lost} "
          f"final_loss_fault_free={ref:.6f} max_final_loss_drift={drift:.2e} "
          f"recovery_p50={percentile(rec, 0.5):.3f} recovery_p99={percentile(rec, 0.99):.3f} "
          f"recovery_max={max(rec) if rec else 0:.3f}")


if __name__ == "__main__":
    main()
