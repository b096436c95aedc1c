#!/usr/bin/python3
"""Pipeline schedules measured: bubble fraction and activation memory.

1. Bubble: a balanced 2-stage pipeline (4 + 4 blocks, one core per stage) with m micro-batches.
   Per rank (medians over the run's steps, from ranks.json): bubble = 1 - compute / pipeline
   phase, where the phase is the slowest rank's time from the step's start to its last schedule
   action; compared with (p-1)/(m+p-1).
2. Memory: the same pipeline with 8 micro-batches under GPipe and 1F1B; peak activation memory
   per stage (heap bytes in use above the step's start, measured) and peak micro-batches in flight.
Writes bench/results/pipeline.json. usage: /usr/bin/python3 bench/pipeline_bench.py [--build build]
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-4000:]}")
    return r


def train(alloy, work, name, schedule, m, mbs=2, trace=True, steps=4):
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    plan = {"global_batch": m * mbs, "schedule": schedule,
            "pipelines": [{"micro_batch_size": mbs, "num_micro_batches": m,
                           "stages": [{"ranks": [0], "layers": [0, 4]}, {"ranks": [1], "layers": [4, 8]}]}]}
    pp = os.path.join(work, name + ".plan.json")
    with open(pp, "w") as f:
        json.dump(plan, f)
    cfg = os.path.join(work, name + ".yaml")
    with open(cfg, "w") as f:
        f.write(f"""model: {{arch: gpt2, layers: 8, hidden: 256, heads: 4, seq_len: 128, vocab_size: 257}}
data: {{prefix: {work}/data/corpus}}
train: {{steps: {steps}, global_batch: {m * mbs}, eval_interval: 0, eval_batches: 0, threads: 1}}
output: {{dir: {out}, tensorboard: false}}
""")
    cmd = [alloy, "launch", "--nproc", "2", "--threads-per-rank", "1", "--", alloy, "train", "--config", cfg, "--plan", pp]
    if trace:
        cmd += ["--trace", os.path.join(out, "trace.json")]
    run(cmd)
    return out


def bubble(trace_path):
    with open(trace_path) as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e["tid"] == "compute"]
    start = min(e["ts"] for e in ev)
    end = max(e["ts"] + e["dur"] for e in ev)
    per_rank = {}
    for e in ev:
        per_rank[e["pid"]] = per_rank.get(e["pid"], 0.0) + e["dur"]
    return {r: 1 - busy / (end - start) for r, busy in per_rank.items()}


def bubble_from_ranks(path):
    with open(path) as f:
        ranks = json.load(f)
    span = max(r["phase_s_median"] for r in ranks)
    return {r["rank"]: 1 - r["compute_s_median"] / span for r in ranks}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    alloy = os.path.join(a.build, "alloy")
    work = tempfile.mkdtemp(prefix="alloy-pp-bench-")
    with open("/usr/share/games/fortunes/fortunes", "rb") as f, open(os.path.join(work, "c.txt"), "wb") as g:
        g.write(f.read(400000))
    run([alloy, "data", "prepare", "--input", os.path.join(work, "c.txt"), "--output", os.path.join(work, "data/corpus")])
    results = {"bubble": [], "memory": {}}
    p = 2
    for m in (4, 8):
        measured = []
        for _ in range(a.rounds):
            out = train(alloy, work, f"bubble-m{m}", "1f1b", m, trace=False, steps=10)
            b = bubble_from_ranks(os.path.join(out, "ranks.json"))
            measured.append(statistics.mean(b.values()))
            print(f"  per stage: " + ", ".join(f"rank {r}: {v:.3f}" for r, v in sorted(b.items())), flush=True)
        got, want = statistics.median(measured), (p - 1) / (m + p - 1)
        results["bubble"].append(dict(stages=p, micro_batches=m, measured=got, ideal=want, rounds=measured,
                                      relative_error=abs(got - want) / want))
        print(f"bubble, p={p} m={m}: measured {got:.3f}, ideal (p-1)/(m+p-1) = {want:.3f} "
              f"({100 * abs(got - want) / want:.1f}% off)", flush=True)
    for sched in ("gpipe", "1f1b"):
        out = train(alloy, work, f"mem-{sched}", sched, 8, trace=False)
        with open(os.path.join(out, "ranks.json")) as f:
            ranks = json.load(f)
        results["memory"][sched] = ranks
        for r in ranks:
            print(f"memory, {sched:5s} stage {r['stage']}: peak activations {r['peak_activation_bytes'] / 2**20:7.1f} MiB, "
                  f"{r['peak_in_flight_micro_batches']} micro-batches in flight", flush=True)
    g0 = results["memory"]["gpipe"][0]["peak_activation_bytes"]
    f0 = results["memory"]["1f1b"][0]["peak_activation_bytes"]
    print(f"stage 0 peak activation memory, 1F1B / GPipe = {f0 / g0:.2f}")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", "pipeline.json")
    with open(path + ".tmp", "w") as f:
        json.dump(dict(benchmark="pipeline", when=time.strftime("%Y-%m-%d %H:%M:%S"),
                       machine=f"{platform.node()} {os.cpu_count()} cores", **results), f, indent=2)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
