#!/usr/bin/python3
"""Failures lose at most the work since the last checkpoint.

- kill: a rank is killed (SIGKILL) mid-run under `alloy launch --max-restarts 1`; the job restarts,
  resumes from its last complete checkpoint and finishes with final weights byte-identical to an
  uninterrupted run's, and one metrics row per step.
- corrupt: bytes flipped in the newest checkpoint's shard are caught by its CRC32C; resuming the
  run directory reports it and continues from the previous checkpoint, on the uninterrupted losses.
- stall: a rank frozen mid-run is named by the others' stall report before the timeout; the job
  goes on when it thaws.
- keep: train.keep_checkpoints keeps the newest K step directories.

usage: test_restart.py ALLOY WORKDIR [CASE...]
"""
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "parity"))
from distlib import fresh_workdir_with_corpus, metrics_rows, plan, rank_pid, sh  # noqa: E402
import st  # noqa: E402

STEPS = 30


def config(work, out, steps=STEPS, extra=""):
    path = out + ".yaml"
    with open(path, "w") as f:
        f.write(f"""model: {{arch: gpt2, layers: 4, hidden: 128, heads: 4, seq_len: 64, vocab_size: 257}}
data: {{prefix: {work}/data/corpus}}
train: {{steps: {steps}, global_batch: 16, lr: 2e-3, warmup: 2, eval_interval: 0, eval_batches: 1,
        checkpoint_interval: 10, threads: 1{extra}}}
output: {{dir: {out}, tensorboard: false}}
""")
    return path


def rows(out):
    return metrics_rows(out)


def weights(ckpt):
    out = {}
    for fn in sorted(os.listdir(ckpt)):
        if fn.startswith("model") and fn.endswith(".safetensors"):
            tensors, _ = st.load(os.path.join(ckpt, fn))
            for name, t in tensors.items():
                out[name] = t.contiguous().view(-1).numpy().tobytes()
    return out


def flip(path):
    """Inverts 4 bytes near the end of PATH (tensor data, not the header)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        b = f.read(4)
        f.seek(os.path.getsize(path) - 100)
        f.write(bytes(x ^ 0xFF for x in b))


def main():
    alloy, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    wanted = sys.argv[3:] or ["kill", "corrupt", "stall", "keep"]
    fresh_workdir_with_corpus(alloy, work)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    plan_path = os.path.join(work, "dp2.json")
    with open(plan_path, "w") as f:
        json.dump(plan(16, [(4, 2, [(0, 0, 4)]), (4, 2, [(1, 0, 4)])]), f)
    launch = [alloy, "launch", "--nproc", "2", "--threads-per-rank", "1"]

    ref = os.path.join(work, "uninterrupted")
    sh(launch + ["--", alloy, "train", "--config", config(work, ref), "--plan", plan_path, "--timeout", "60"], env=env)
    ref_rows = rows(ref)
    failures = 0

    def report(name, ok, detail):
        nonlocal failures
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:<8} {detail}", flush=True)

    if "kill" in wanted:
        out = os.path.join(work, "killed")
        # Slow steps down a little so that the kill lands mid-run, between two checkpoints.
        cmd = launch + ["--max-restarts", "1", "--", alloy, "train", "--config", config(work, out), "--plan", plan_path,
                        "--timeout", "60"]
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        killed_at = None
        deadline = time.time() + 120
        while p.poll() is None and time.time() < deadline and killed_at is None:
            try:
                n = len(rows(out))
            except FileNotFoundError:
                n = 0
            if n >= 15:
                pid = rank_pid(out + ".yaml", 1)
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = n
            time.sleep(0.02)
        log, _ = p.communicate(timeout=300)
        got = rows(out)
        same = weights(os.path.join(out, "checkpoints", "step_00000030")) == weights(os.path.join(ref, "checkpoints", "step_00000030"))
        steps_ok = [r["step"] for r in got] == list(range(1, STEPS + 1))
        losses_ok = all(a["loss"] == b["loss"] for a, b in zip(got, ref_rows))
        restarted = "restart 1 of 1" in log and "resuming from" in log and "finished after 1 restart" in log
        ok = p.returncode == 0 and killed_at is not None and same and steps_ok and losses_ok and restarted
        report("kill", ok, f"rank 1 killed after step {killed_at}, job exit {p.returncode}, restarted: {restarted}, "
                           f"steps 1..{STEPS} once: {steps_ok}, losses identical: {losses_ok}, final weights byte-identical: {same}")
        if not ok:
            print(log[-3000:])

    if "corrupt" in wanted:
        out = os.path.join(work, "corrupt")
        sh(launch + ["--", alloy, "train", "--config", config(work, out), "--plan", plan_path, "--timeout", "60"], env=env)
        # The newest checkpoint goes bad; rank 0 holds (and writes) every weight of two replicas.
        shard = os.path.join(out, "checkpoints", "step_00000030", "model-rank00000.safetensors")
        flip(shard)
        r = sh(launch + ["--", alloy, "train", "--config", config(work, out), "--plan", plan_path, "--timeout", "60",
                         "--resume"], env=env)
        log = r.stdout + r.stderr
        got = rows(out)
        detected = "model-rank00000.safetensors: CRC32C" in log and "using the previous complete one" in log and "step_00000020" in log
        resumed = "resumed from" in log and "at step 20" in log
        losses_ok = [r["step"] for r in got] == list(range(1, STEPS + 1)) and all(a["loss"] == b["loss"] for a, b in zip(got, ref_rows))
        report("corrupt", detected and resumed and losses_ok,
               f"corruption named: {detected}, resumed at step 20: {resumed}, losses = uninterrupted: {losses_ok}")
        if not (detected and resumed):
            print(log[-2000:])
        # An explicitly named corrupt checkpoint is refused, naming the file (the resumed run wrote
        # step 30 anew: spoil it again).
        flip(shard)
        r = sh([alloy, "train", "--config", config(work, os.path.join(work, "corrupt2")), "--resume-from",
                os.path.join(out, "checkpoints", "step_00000030")], expect_fail=True, env=env)
        refused = "cannot be used" in r.stderr and "model-rank00000.safetensors" in r.stderr
        report("refuse", refused, "an explicitly named corrupt checkpoint is refused naming its shard")

    if "stall" in wanted:
        # Rank 1 freezes (SIGSTOP) for 6 s mid-run: rank 0's stall inspector names it long before
        # the 60 s timeout, and the job goes on once it thaws.
        out = os.path.join(work, "stall")
        cmd = launch + ["--", alloy, "train", "--config", config(work, out), "--plan", plan_path, "--timeout", "60",
                        "--stall-seconds", "2"]
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        frozen = False
        deadline = time.time() + 120
        while p.poll() is None and time.time() < deadline and not frozen:
            try:
                n = len(rows(out))
            except FileNotFoundError:
                n = 0
            pid = rank_pid(out + ".yaml", 1) if n >= 8 else None
            if pid:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(6)
                os.kill(pid, signal.SIGCONT)
                frozen = True
            time.sleep(0.02)
        log, _ = p.communicate(timeout=300)
        named = "stall: rank 0" in log and "rank 1 (step" in log and "no heartbeat" in log
        ok = p.returncode == 0 and frozen and named and len(rows(out)) == STEPS
        line = next((l for l in log.splitlines() if "stall:" in l), "")
        report("stall", ok, f"rank 1 frozen for 6 s: stall report names it: {named}; job exit {p.returncode}; {line.strip()[:160]}")
        if not ok:
            print(log[-3000:])

    if "keep" in wanted:
        out = os.path.join(work, "keep")
        sh(launch + ["--", alloy, "train", "--config", config(work, out, extra=", keep_checkpoints: 2"), "--plan", plan_path,
                     "--timeout", "60"], env=env)
        left = sorted(d for d in os.listdir(os.path.join(out, "checkpoints")) if d.startswith("step_"))
        report("keep", left == ["step_00000020", "step_00000030"], f"left {left}")

    total = len([w for w in wanted]) + ("corrupt" in wanted)
    print(f"{total - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
