#!/usr/bin/python3
"""One-device training step: Alloy (C++/LibTorch) vs PyTorch eager from Python, side by side.

Same model, batch, optimizer rule and thread count; the two run alternately, several rounds, so
machine noise hits both alike. Prints a table with the ratio alloy/pytorch of median step times
(<= 1.0 means Alloy is not slower) and writes the figures to bench/results/train_step.json.

usage: /usr/bin/python3 bench/train_step_vs_pytorch.py [--build build] [--rounds 3] [--quick]
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

CASES = [
    # name, model args, batch
    ("gpt2-tiny", dict(arch="gpt2", layers=4, hidden=256, heads=4, ffn=1024, seq_len=128, vocab=257), 8),
    ("llama-tiny", dict(arch="llama", layers=4, hidden=256, heads=8, kv_heads=4, ffn=704, seq_len=128, vocab=257), 8),
    ("gpt2-small", dict(arch="gpt2", layers=6, hidden=384, heads=6, ffn=1536, seq_len=128, vocab=257), 16),
]


def args_for(model, batch, steps, warmup, threads):
    out = []
    for k, v in model.items():
        out += ["--" + k.replace("_", "-"), str(v)]
    out += ["--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads)]
    return out


def run(cmd, threads):
    # Both sides sleep idle OpenMP workers: Alloy sets this itself (see core/process.h); PyTorch is given
    # it too, since without it two threads made its Llama step 3x slower here (0.45 vs 0.16 s).
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OMP_WAIT_POLICY="PASSIVE")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--quick", action="store_true", help="one round, tiny cases only")
    a = ap.parse_args()
    cases = CASES[:2] if a.quick else CASES
    rounds = 1 if a.quick else a.rounds
    alloy_bin = os.path.join(a.build, "bench", "bench_train_step")
    py = [sys.executable, os.path.join(HERE, "pytorch_train_step.py")]

    results = []
    print(f"{'case':<12} {'threads':>7} {'alloy s/step':>13} {'pytorch s/step':>15} {'ratio':>7}")
    for name, model, batch in cases:
        for threads in a.threads:
            al, pt = [], []
            for _ in range(rounds):
                argv = args_for(model, batch, a.steps, 2, threads)
                al.append(run([alloy_bin] + argv, threads)["step_s_median"])
                pt.append(run(py + argv, threads)["step_s_median"])
            am, pm = statistics.median(al), statistics.median(pt)
            ratio = am / pm
            results.append(dict(case=name, threads=threads, batch=batch, model=model, alloy_step_s=am,
                                pytorch_step_s=pm, ratio=ratio, alloy_rounds=al, pytorch_rounds=pt))
            print(f"{name:<12} {threads:>7} {am:>13.4f} {pm:>15.4f} {ratio:>7.3f}")
    worst = max(r["ratio"] for r in results)
    print(f"worst ratio alloy/pytorch: {worst:.3f} ({'Alloy not slower' if worst <= 1.0 else 'Alloy SLOWER'})")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    out = os.path.join(HERE, "results", "train_step.json")
    with open(out + ".tmp", "w") as f:
        json.dump(dict(benchmark="train_step_vs_pytorch", when=time.strftime("%Y-%m-%d %H:%M:%S"),
                       machine=f"{platform.node()} {platform.processor() or platform.machine()} {os.cpu_count()} cores",
                       results=results, worst_ratio=worst), f, indent=2)
    os.replace(out + ".tmp", out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
