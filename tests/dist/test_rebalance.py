#!/usr/bin/python3
"""train.rebalance: replicas' shares of the global batch follow their speeds, and the run stays exact.

Two replicas start with 8 samples each. Once the balancer has its reference speeds (the log says
so), rank 1 is slowed from outside: SIGSTOP and SIGCONT in turn, half the time stopped, as a device
whose CPU another job takes. Checks:
- samples move to rank 0 (metrics.jsonl's samples_per_replica), and the log says why;
- every step's loss equals a one-device run's on the same global batches (relative 1e-5): moving
  samples changes only the order of the gradient's sums;
- without train.rebalance the same plan keeps its cut (no samples_per_replica row).

usage: test_rebalance.py ALLOY WORKDIR
"""
import os
import signal
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from distlib import Checks, fresh_workdir_with_corpus, metrics_rows, plan, popen_collect, rank_pid, sh, write_json_atomic  # noqa: E402

STEPS = 30


def config(work, out, rebalance):
    path = out + ".yaml"
    with open(path, "w") as f:
        f.write(f"""model: {{arch: gpt2, layers: 2, hidden: 128, heads: 4, seq_len: 64, vocab_size: 257}}
data: {{prefix: {work}/data/corpus}}
train: {{steps: {STEPS}, global_batch: 16, micro_batch: 2, lr: 2e-3, warmup: 2, eval_interval: 0, eval_batches: 1,
        threads: 1, rebalance: {'true' if rebalance else 'false'}}}
output: {{dir: {out}, tensorboard: false}}
""")
    return path


def slow_down(config_path, rank, stop):
    """Keeps RANK stopped half the time, in 15 ms slices, until STOP is set or it is gone."""
    pid = None
    while not stop.is_set() and pid is None:
        pid = rank_pid(config_path, rank)
        time.sleep(0.01)
    while not stop.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.015)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.015)
        except ProcessLookupError:
            return
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def main():
    alloy, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    fresh_workdir_with_corpus(alloy, work)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    plan_path = os.path.join(work, "dp.json")
    write_json_atomic(plan_path, plan(16, [(2, 4, [(0, 0, 2)]), (2, 4, [(1, 0, 2)])]))
    check = Checks()

    ref = os.path.join(work, "one-device")
    sh([alloy, "train", "--config", config(work, ref, False)], env=env)
    ref_loss = [r["loss"] for r in metrics_rows(ref)]

    launch = [alloy, "launch", "--nproc", "2", "--threads-per-rank", "1", "--"]
    out = os.path.join(work, "rebalanced")
    cfg = config(work, out, True)
    p, lines = popen_collect(launch + [alloy, "train", "--config", cfg, "--plan", plan_path, "--timeout", "60"], env)
    stop = threading.Event()
    slower = None
    deadline = time.time() + 300
    while p.poll() is None and time.time() < deadline:
        if slower is None and any("follows the replicas' speeds" in l for l in lines):
            slower = threading.Thread(target=slow_down, args=(cfg, 1, stop), daemon=True)
            slower.start()
        time.sleep(0.02)
    stop.set()
    if p.poll() is None:
        p.kill()
    p.wait()
    if slower:
        slower.join()
    check(p.returncode == 0, f"the rebalanced run finished (exit {p.returncode})")
    check(slower is not None, "the balancer armed and said so")
    rows = metrics_rows(out)
    moved = [r for r in rows if "samples_per_replica" in r]
    check(any(r["samples_per_replica"][0] > 8 and sum(r["samples_per_replica"]) == 16 for r in moved),
          f"samples moved to the replica not slowed: {[(r['step'], r['samples_per_replica']) for r in moved]}")
    check(any("samples per replica 8/8 -> " in l for l in lines), "the log names the change and why")
    loss = [r["loss"] for r in rows]
    worst = max((abs(a - b) / abs(b) for a, b in zip(loss, ref_loss)), default=float("inf"))
    check(len(loss) == STEPS and worst < 1e-5, f"losses equal one device's over {len(loss)} steps (worst relative {worst:.2e})")

    out = os.path.join(work, "fixed")
    sh(launch + [alloy, "train", "--config", config(work, out, False), "--plan", plan_path, "--timeout", "60"], env=env)
    check(not any("samples_per_replica" in r for r in metrics_rows(out)), "without train.rebalance the plan's cut stays")
    if not any(l for l in lines if "samples per replica" in l):
        sys.stdout.write("".join(lines[-40:]))
    check.finish()


if __name__ == "__main__":
    main()
