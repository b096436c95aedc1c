#!/usr/bin/python3
"""Mixed precision on this machine: bf16 (and fp16 where the LibTorch can) against fp32.

Quality: examples/small-gpt2.yaml trained --steps steps (300) in each precision from the same seed;
the validation loss at the end, and its difference to fp32's (goal: within 1%).
Speed: --rounds rounds of --speed-steps steps per precision, alternating, one process each; the
median tokens/s per precision and its ratio to fp32 (bf16 is fast where the CPU has bf16 matrix
units, AMX or AVX512-BF16, and slow where it has to emulate them).

  /usr/bin/python3 bench/precision_bench.py [--steps 300] [--rounds 3] [--threads 2] [--device cuda]

On a GPU (--device cuda) the results go to bench/results/precision-cuda.json (or --results), and fp16
runs with dynamic loss scaling, which CUDA autocast supports.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "dist"))
from distlib import metrics_rows, write_json_atomic  # noqa: E402


def run(alloy, work, name, precision, steps, threads, eval_interval, device):
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [alloy, "train", "--config", os.path.join(REPO, "examples", "small-gpt2.yaml"),
           "--set", f"data.prefix={os.path.join(work, 'data', 'fortunes')}", "--set", f"output.dir={out}",
           "--set", f"train.steps={steps}", "--set", f"train.eval_interval={eval_interval}", "--set", f"train.threads={threads}",
           "--set", f"train.precision={precision}", "--set", "output.tensorboard=false", "--set", f"train.device={device}"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return None, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
    rows = metrics_rows(out)
    val = [x["val_loss"] for x in rows if "val_loss" in x]
    tps = statistics.median(x["tokens_per_s"] for x in rows[2:]) if len(rows) > 2 else rows[-1]["tokens_per_s"]
    return {"val_loss": val[-1] if val else None, "tokens_per_s": tps}, None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--speed-steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--results", help="the JSON to write (default bench/results/precision.json, precision-cuda.json on a GPU)")
    a = ap.parse_args()
    alloy = os.path.join(a.build, "alloy")
    work = tempfile.mkdtemp(prefix="alloy-precision-")
    precisions = ["fp32", "bf16", "fp16"]
    summary = {"model": "examples/small-gpt2.yaml", "steps": a.steps, "threads": a.threads, "device": a.device,
               "machine": {"cores": os.cpu_count()}}
    if a.device != "cpu":
        try:
            import torch  # the GPU's name, for the record; Alloy itself does not need Python
            summary["machine"]["gpu"] = torch.cuda.get_device_name()
            summary["machine"]["torch"] = torch.__version__
        except Exception as e:  # noqa: BLE001
            summary["machine"]["gpu"] = f"unknown ({e})"
    try:
        subprocess.run([alloy, "data", "prepare", "--input", "/usr/share/games/fortunes", "--output",
                        os.path.join(work, "data", "fortunes")], check=True, capture_output=True)
        with open("/proc/cpuinfo") as f:
            flags = next((l for l in f if l.startswith("flags")), "")
        summary["machine"]["bf16_units"] = [x for x in ("amx_bf16", "avx512_bf16") if x in flags.split()]
        quality = {}
        path = a.results or os.path.join(REPO, "bench", "results", "precision.json" if a.device == "cpu" else "precision-cuda.json")
        if a.skip_quality and os.path.exists(path):
            with open(path) as f:
                quality = json.load(f).get("quality", {})  # kept from the last full run
        if not a.skip_quality:
            for p in precisions:
                res, why = run(alloy, work, f"quality-{p}", p, a.steps, a.threads, 50, a.device)
                quality[p] = res if res else {"refused": why}
                print(f"[precision] {p}: " + (f"validation loss {res['val_loss']:.4f} after {a.steps} steps" if res else f"not run: {why}"),
                      flush=True)
            ref = quality["fp32"]["val_loss"]
            for p in precisions[1:]:
                if "val_loss" in quality[p]:
                    quality[p]["vs_fp32"] = (quality[p]["val_loss"] - ref) / ref
        summary["quality"] = quality
        speed = {p: [] for p in precisions}
        for k in range(a.rounds):
            for p in precisions:
                res, _ = run(alloy, work, f"speed-{p}", p, a.speed_steps, a.threads, 0, a.device)
                if res:
                    speed[p].append(res["tokens_per_s"])
        med = {p: statistics.median(v) for p, v in speed.items() if v}
        summary["speed"] = {p: {"rounds": speed[p], "median_tokens_per_s": med[p], "vs_fp32": med[p] / med["fp32"]} for p in med}
        where = summary["machine"].get("gpu") or f"bf16 units: {summary['machine']['bf16_units'] or 'none'}"
        print(f"\nsmall-gpt2 on {a.device}, {a.threads} threads, {where}")
        print(f"{'precision':<10} {'val loss':>9} {'vs fp32':>8} {'tokens/s':>9} {'vs fp32':>8}")
        for p in precisions:
            q = quality.get(p, {})
            s = summary["speed"].get(p)
            vl = f"{q['val_loss']:.4f}" if q.get("val_loss") is not None else "-"
            dq = f"{100 * q['vs_fp32']:+.2f}%" if "vs_fp32" in q else ""
            tps = "%.0f" % s["median_tokens_per_s"] if s else "refused"
            ratio = "%.2fx" % s["vs_fp32"] if s else ""
            print(f"{p:<10} {vl:>9} {dq:>8} {tps:>9} {ratio:>8}")
        write_json_atomic(path, summary)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
