#!/usr/bin/python3
"""Data parallelism: Alloy vs PyTorch DDP (Gloo), side by side in one invocation.

Same model (GPT-2, tests/parity/reference.py's definition on the PyTorch side), same global batch
split equally over the same number of processes, one intra-op thread per process, AdamW +
clipping on both. Rounds alternate between the two so machine noise hits both. Prints the median
step time of each and the ratio alloy/ddp (<= 1.0: Alloy not slower); writes
bench/results/dp_vs_ddp.json. Also runs bench_overlap (backward + sync vs backward alone + sync
alone) and records it.

usage: /usr/bin/python3 bench/dp_vs_ddp.py [--build build] [--rounds 3] [--nproc 2]
"""
import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL = dict(layers=4, hidden=256, heads=4, seq_len=128, vocab=257)


def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return r


def alloy_round(alloy, work, nproc, gb, steps, warmup):
    out = os.path.join(work, "alloy-run")
    shutil.rmtree(out, ignore_errors=True)
    cfg = os.path.join(work, "dp.yaml")
    with open(cfg, "w") as f:
        f.write(f"""model: {{arch: gpt2, layers: {MODEL['layers']}, hidden: {MODEL['hidden']}, heads: {MODEL['heads']},
         seq_len: {MODEL['seq_len']}, vocab_size: {MODEL['vocab']}}}
data: {{prefix: {work}/data/corpus}}
train: {{steps: {steps + warmup}, global_batch: {gb}, lr: 3e-4, eval_interval: 0, eval_batches: 0, threads: 1}}
output: {{dir: {out}, tensorboard: false}}
""")
    run([alloy, "launch", "--nproc", str(nproc), "--threads-per-rank", "1", "--", alloy, "train", "--config", cfg])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    return statistics.median(r["step_s"] for r in rows[warmup:])


def ddp_round(nproc, gb, steps, warmup):
    port = str(random.randint(20000, 40000))
    procs = []
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        cmd = [sys.executable, os.path.join(HERE, "ddp_train_step.py"), "--layers", str(MODEL["layers"]),
               "--hidden", str(MODEL["hidden"]), "--heads", str(MODEL["heads"]), "--seq-len", str(MODEL["seq_len"]),
               "--vocab", str(MODEL["vocab"]), "--batch", str(gb // nproc), "--steps", str(steps), "--warmup", str(warmup)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate() for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("DDP baseline failed:\n" + "\n".join(o[1][-3000:] for o in outs))
    return json.loads(outs[0][0].strip().splitlines()[-1])["step_s_median"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    alloy = os.path.join(a.build, "alloy")
    work = tempfile.mkdtemp(prefix="alloy-dp-bench-")
    with open("/usr/share/games/fortunes/fortunes", "rb") as f, open(os.path.join(work, "c.txt"), "wb") as g:
        g.write(f.read(400000))
    run([alloy, "data", "prepare", "--input", os.path.join(work, "c.txt"), "--output", os.path.join(work, "data/corpus")])

    al, dd = [], []
    for i in range(a.rounds):
        al.append(alloy_round(alloy, work, a.nproc, a.global_batch, a.steps, 2))
        dd.append(ddp_round(a.nproc, a.global_batch, a.steps, 2))
        print(f"round {i + 1}: alloy {al[-1]:.4f} s/step, ddp {dd[-1]:.4f} s/step", flush=True)
    am, dm = statistics.median(al), statistics.median(dd)
    print(f"data parallel, {a.nproc} processes, global batch {a.global_batch}: alloy {am:.4f} s/step, "
          f"pytorch DDP {dm:.4f} s/step, ratio alloy/ddp {am / dm:.3f}")

    def overlap_run(prefix, label):
        ov = run([alloy, "launch"] + prefix + ["--", os.path.join(a.build, "bench", "bench_overlap")])
        o = json.loads([l for l in (ov.stdout + ov.stderr).splitlines() if '"benchmark":"overlap"' in l][0].split("] ", 1)[-1])
        print(f"overlap ({label}): backward {o['backward_s']:.4f} s + sync {o['sync_s']:.4f} s = {o['serial_s']:.4f} s "
              f"serial; backward with sync {o['backward_with_sync_s']:.4f} s "
              f"({100 * o['hidden_fraction_of_sync']:.0f}% of the sync hidden)", flush=True)
        return o

    overlap = {"loopback": overlap_run(["--nproc", str(a.nproc), "--threads-per-rank", "1"], "loopback")}
    if os.geteuid() == 0:  # the emulated 500 Mbit/s link needs root (namespaces, tc)
        overlap["emulated_500mbit"] = overlap_run(
            ["--emulate", os.path.join(REPO, "examples", "cluster-2host.yaml"), "--no-cpu-limit"], "emulated 500 Mbit/s link")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    out = os.path.join(HERE, "results", "dp_vs_ddp.json")
    with open(out + ".tmp", "w") as f:
        json.dump(dict(benchmark="dp_vs_ddp", when=time.strftime("%Y-%m-%d %H:%M:%S"),
                       machine=f"{platform.node()} {os.cpu_count()} cores", model=MODEL, nproc=a.nproc,
                       global_batch=a.global_batch, alloy_rounds=al, ddp_rounds=dd, alloy_step_s=am, ddp_step_s=dm,
                       ratio=am / dm, overlap=overlap), f, indent=2)
    os.replace(out + ".tmp", out)
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
