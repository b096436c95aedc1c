#!/usr/bin/python3
"""A link of an emulated 2-host pool is cut mid-run (`alloy emu cut`): rank 0's stall report names
rank 1 before the collective's timeout, the job fails on the timeout and restarts
(`--max-restarts 1`); once the link is restored (`alloy emu restore`) the restarted job resumes its
last checkpoint and finishes every step. Needs root (network namespaces, tc).

usage: test_link_cut.py ALLOY WORKDIR
"""
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distlib import fresh_workdir_with_corpus, metrics_rows, paused, plan, popen_collect  # noqa: E402

# `alloy emu cut` starts a LibTorch-linked binary and runs several tc commands, which took over 1.8 s
# (18 steps of this model) on a busy CI machine: the ranks are paused while it runs (see below), and
# the run is long enough besides that a late cut still lands mid-run.
STEPS = 100


def rows(out):
    return metrics_rows(out)


def main():
    alloy, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    fresh_workdir_with_corpus(alloy, work)
    cluster = os.path.join(work, "two-hosts.yaml")
    with open(cluster, "w") as f:
        f.write("""name: two-hosts
devices:
  - {name: a, host: h0, kind: cpu, type: cpu, speed: 1.0}
  - {name: b, host: h1, kind: cpu, type: cpu, speed: 1.0}
default_link: {bandwidth_gbps: 1, latency_ms: 0.1}
""")
    out = os.path.join(work, "run")
    cfg = out + ".yaml"
    with open(cfg, "w") as f:
        f.write(f"""model: {{arch: gpt2, layers: 4, hidden: 128, heads: 4, seq_len: 64, vocab_size: 257}}
data: {{prefix: {work}/data/corpus}}
train: {{steps: {STEPS}, global_batch: 16, lr: 2e-3, warmup: 2, eval_interval: 0, eval_batches: 1,
        checkpoint_interval: 10, threads: 1}}
output: {{dir: {out}, tensorboard: false}}
""")
    plan_path = os.path.join(work, "dp2.json")
    with open(plan_path, "w") as f:
        json.dump(plan(16, [(4, 2, [(0, 0, 4)]), (4, 2, [(1, 0, 4)])]), f)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = [alloy, "launch", "--emulate", cluster, "--no-cpu-limit", "--max-restarts", "1", "--", alloy, "train", "--config", cfg,
           "--plan", plan_path, "--timeout", "12", "--stall-seconds", "3"]
    p, lines = popen_collect(cmd, env)
    cut = restored = False
    deadline = time.time() + 240
    while p.poll() is None and time.time() < deadline:
        if not cut and len(rows(out)) >= 11:
            with paused(cfg, (0, 1)):
                subprocess.run([alloy, "emu", "cut", "h0", "h1"], check=True, capture_output=True)
            cut = True
        if cut and not restored and any("restart 1 of 1" in l for l in lines):
            subprocess.run([alloy, "emu", "restore", "h0", "h1"], check=True, capture_output=True)
            restored = True
        time.sleep(0.05)
    if p.poll() is None:
        p.kill()
    p.wait()
    time.sleep(0.2)
    log = "".join(lines)
    checks = []

    def check(name, ok, detail=""):
        checks.append(ok)
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)

    stall = next((l.strip() for l in lines if "stall: rank 0" in l), "")
    named = [l.strip() for l in lines if "rank 1 (step" in l]
    check("the link was cut and restored", cut and restored)
    check("rank 0's stall report names rank 1 before the timeout", bool(stall) and bool(named), (stall[:120] + " / " + (named[0][:100] if named else "")))
    check("the job restarted and resumed its last checkpoint", "restart 1 of 1" in log and "resuming from" in log)
    got = rows(out)
    check("the job finished every step", p.returncode == 0 and [r["step"] for r in got] == list(range(1, STEPS + 1)),
          f"exit {p.returncode}, {len(got)} steps")
    if not all(checks):
        print(log[-4000:])
    failed = checks.count(False)
    print(f"{len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
