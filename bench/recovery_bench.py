#!/usr/bin/python3
"""Seconds from a failure to training again, on the demo model.

A job runs under `alloy launch --max-restarts 1` (the emulated 3-device pool with --emulate, else 3
local ranks) with a checkpoint every few steps; once it is past a checkpoint, one rank is killed
(SIGKILL). Measured from the kill: when the launcher has stopped the others, when the restarted
ranks resumed (the "resumed from" line), and when the first step after the restart is written to
metrics.jsonl ("training again"). Repeated --rounds times; median and worst. Goal: under 15 s.

Two kinds of failure, each measured --rounds times in one invocation:
  restart  the killed rank's device is still there: every rank starts again (--max-restarts 1).
  replan   the device is gone for good (--emulate: `alloy emu down` its host; else --device-check
           reports it missing): after --rejoin-timeout the two survivors re-plan (--plan auto on
           examples/cluster-3dev.yaml) and resume without it.

  /usr/bin/python3 bench/recovery_bench.py [--emulate examples/cluster-3dev.yaml] [--rounds 3] [--modes restart replan]
"""
import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "dist"))
from distlib import metrics_rows, rank_pid, write_json_atomic  # noqa: E402

# These runs read Alloy's info lines; a log level the caller exported would hide them.
os.environ.pop("ALLOY_LOG_LEVEL", None)


def rows(out):
    return metrics_rows(out)


def one_round(alloy, pool, work, k, kill_rank, steps, interval, mode="restart", rejoin_timeout=2, emulated=False):
    out = os.path.join(work, f"{mode}{k}")
    shutil.rmtree(out, ignore_errors=True)
    cfg = out + ".yaml"
    with open(os.path.join(REPO, "examples", "demo-gpt2.yaml")) as f:
        text = f.read()
    with open(cfg, "w") as f:
        f.write(text)
    sets = ["--set", f"output.dir={out}", "--set", f"train.steps={steps}", "--set", f"train.checkpoint_interval={interval}",
            "--set", "train.eval_interval=0", "--set", "train.eval_batches=0", "--set", "output.tensorboard=false",
            "--set", f"data.prefix={os.path.join(work, 'data', 'fortunes')}"]
    gone = os.path.join(work, f"gone-{kill_rank}")
    if os.path.exists(gone):
        os.unlink(gone)
    elastic = []
    if mode == "replan":
        elastic = ["--rejoin-timeout", str(rejoin_timeout)]
        if not emulated:
            elastic += ["--device-check", f"test ! -e {work}/gone-{{rank}}"]
        sets += ["--plan", "auto", "--cluster", os.path.join(REPO, "examples", "cluster-3dev.yaml"),
                 "--set", "train.replan_step=0"]
    cmd = [alloy, "launch", *pool, "--max-restarts", "1", *elastic, "--", alloy, "train", "--config", cfg, *sets]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    lines = []
    stamps = {}

    def reader():
        for line in p.stdout:
            now = time.time()
            lines.append(line)
            if "stopping the other ranks" in line and "stopped" not in stamps:
                stamps["stopped"] = now
            if "restart 1 of 1" in line:
                stamps["restarting"] = now
            if "continuing on" in line:
                stamps["without_device"] = now
            if "resuming from" in line or re.search(r"resumed from .* at step", line):
                stamps.setdefault("resumed", now)
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    killed_at, kill_step = None, None
    deadline = time.time() + 600
    while p.poll() is None and time.time() < deadline:
        n = len(rows(out))
        if killed_at is None and n >= interval + 2:
            if mode == "replan" and emulated:
                host = f"h{kill_rank}"  # examples/cluster-3dev.yaml: device i on host hi
                killed_at, kill_step = time.time(), n
                subprocess.run([alloy, "emu", "down", host], check=True, capture_output=True)
            else:
                pid = rank_pid(cfg, kill_rank)
                if pid:
                    if mode == "replan":
                        open(gone, "w").close()
                    os.kill(pid, signal.SIGKILL)
                    killed_at, kill_step = time.time(), n
        if killed_at is not None and "resumed" in stamps and "again" not in stamps:
            # The restarted job cuts metrics.jsonl back to the checkpoint's step, then appends:
            # training again once a row past that step appears after the cut.
            r = rows(out)
            resumed_step = (kill_step // interval) * interval
            if r and r[-1]["step"] <= resumed_step:
                stamps["cut"] = True
            elif stamps.get("cut") and r and r[-1]["step"] > resumed_step:
                stamps["again"] = time.time()
        time.sleep(0.02)
    p.wait()
    t.join(timeout=5)
    if mode == "replan" and emulated:
        subprocess.run([alloy, "emu", "up", f"h{kill_rank}"], capture_output=True)
    if p.returncode != 0 or killed_at is None or "again" not in stamps:
        sys.stderr.write("".join(lines[-40:]))
        raise SystemExit(f"round {k} ({mode}): the job did not recover (exit {p.returncode})")
    if mode == "replan" and "without_device" not in stamps:
        sys.stderr.write("".join(lines[-40:]))
        raise SystemExit(f"round {k} ({mode}): the job recovered but not without the device")
    return {"mode": mode, "killed_after_step": kill_step, "resumed_from_step": (kill_step // interval) * interval,
            **{f"{key}_s": stamps[key] - killed_at
               for key in ("stopped", "restarting", "without_device", "resumed", "again") if key in stamps}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--emulate", default=None, help="ClusterSpec to run on (root); default: 3 local ranks")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--interval", type=int, default=4, help="checkpoint every N steps")
    ap.add_argument("--kill-rank", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["restart", "replan"], choices=["restart", "replan"])
    ap.add_argument("--rejoin-timeout", type=float, default=2.0, help="replan: seconds the launcher waits for the device")
    a = ap.parse_args()
    alloy = os.path.join(a.build, "alloy")
    pool = ["--emulate", a.emulate] if a.emulate else ["--nproc", "3"]
    work = tempfile.mkdtemp(prefix="alloy-recovery-")
    try:
        subprocess.run([alloy, "data", "prepare", "--input", "/usr/share/games/fortunes", "--output",
                        os.path.join(work, "data", "fortunes")], check=True, capture_output=True)
        summary = {"pool": pool, "model": "examples/demo-gpt2.yaml", "rejoin_timeout_s": a.rejoin_timeout,
                   "machine": {"cores": os.cpu_count()}}
        for mode in a.modes:
            results = []
            for k in range(a.rounds):
                r = one_round(alloy, pool, work, k, a.kill_rank, a.steps, a.interval, mode, a.rejoin_timeout, bool(a.emulate))
                results.append(r)
                extra = (f", continuing without it +{r.get('without_device_s', float('nan')):.1f} s" if mode == "replan" else "")
                print(f"[recovery] {mode} round {k + 1}/{a.rounds}: killed rank {a.kill_rank} after step {r['killed_after_step']}; "
                      f"failure seen +{r.get('stopped_s', float('nan')):.1f} s, all stopped and restarting "
                      f"+{r.get('restarting_s', float('nan')):.1f} s{extra}, resumed from step {r['resumed_from_step']} "
                      f"+{r['resumed_s']:.1f} s, training again +{r['again_s']:.1f} s", flush=True)
            again = [r["again_s"] for r in results]
            summary[mode] = {"rounds": results, "again_s_median": statistics.median(again), "again_s_worst": max(again)}
        for mode in a.modes:
            m = summary[mode]
            print(f"\n{mode}: failure -> training again: median {m['again_s_median']:.1f} s, worst {m['again_s_worst']:.1f} s "
                  f"(goal < 15 s: {'met' if m['again_s_median'] < 15 else 'NOT met'})"
                  + (f"; {a.rejoin_timeout:g} s of it is --rejoin-timeout" if mode == "replan" else ""))
        write_json_atomic(os.path.join(REPO, "bench", "results", "recovery.json"), summary)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
