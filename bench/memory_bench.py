#!/usr/bin/python3
"""Sharded data parallelism (ZeRO): per-rank memory and step time, side by side in one invocation.

For 2 and 4 ranks on loopback (one intra-op thread each, equal batches): full replicas, ZeRO-1,
ZeRO-2, ZeRO-2 with uneven shares, ZeRO-3 even and uneven, and PyTorch DDP (python3-torch, same model, batch, AdamW and
clipping); PyTorch FSDP is tried too and recorded with its error where it cannot run here. Rounds
alternate between the cases so machine noise hits all. Per rank: parameter, gradient and AdamW
state bytes as allocated (Alloy's ranks.json) and peak RSS (VmHWM; ru_maxrss for PyTorch).

Prints and writes bench/results/memory.json:
  - model state (params + grads + optimizer) per rank against full replicas;
  - optimizer state per rank against the share asked (uneven shards: goal within 5%);
  - step time against full replicas (ZeRO-2 goal: within 10%);
  - ZeRO-3 model state per rank (between steps) against 1/N of a replica's (goal: within 10%), and
    the most parameter bytes it held gathered at once (a layer and the prefetched next one).

usage: /usr/bin/python3 bench/memory_bench.py [--build build] [--rounds 2] [--nprocs 2,4]
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
MODEL = dict(layers=4, hidden=384, heads=6, seq_len=128, vocab=257)
UNEVEN = {2: [3, 1], 4: [4, 2, 1, 1]}


def log(msg):
    print(f"[memory] {msg}", flush=True)


def run(cmd, env=None, may_fail=False):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0 and not may_fail:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return r


def alloy_case(alloy, work, nproc, gb, steps, warmup, flags):
    out = os.path.join(work, "alloy-run")
    shutil.rmtree(out, ignore_errors=True)
    cfg = os.path.join(work, "mem.yaml")
    with open(cfg, "w") as f:
        f.write(f"""model: {{arch: gpt2, layers: {MODEL['layers']}, hidden: {MODEL['hidden']}, heads: {MODEL['heads']},
         seq_len: {MODEL['seq_len']}, vocab_size: {MODEL['vocab']}}}
data: {{prefix: {work}/data/corpus}}
train: {{steps: {steps + warmup}, global_batch: {gb}, lr: 3e-4, eval_interval: 0, eval_batches: 0, threads: 1}}
output: {{dir: {out}, tensorboard: false}}
""")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    run([alloy, "launch", "--nproc", str(nproc), "--threads-per-rank", "1", "--", alloy, "train", "--config", cfg] + flags, env=env)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    with open(os.path.join(out, "ranks.json")) as f:
        ranks = sorted(json.load(f), key=lambda r: r["rank"])
    per_rank = [{k: r.get(k, 0) for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes", "peak_rss_bytes",
                                          "peak_gathered_param_bytes")} for r in ranks]
    return dict(step_s=statistics.median(r["step_s"] for r in rows[warmup:]), ranks=per_rank)


def torch_case(nproc, gb, steps, warmup, fsdp):
    port = str(random.randint(20000, 40000))
    procs = []
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
        cmd = [sys.executable, os.path.join(HERE, "ddp_train_step.py"), "--layers", str(MODEL["layers"]),
               "--hidden", str(MODEL["hidden"]), "--heads", str(MODEL["heads"]), "--seq-len", str(MODEL["seq_len"]),
               "--vocab", str(MODEL["vocab"]), "--batch", str(gb // nproc), "--steps", str(steps), "--warmup", str(warmup)]
        if fsdp:
            cmd.append("--fsdp")
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode for p in procs):
        err = [l for o in outs for l in o[1].strip().splitlines() if "Error" in l or "error" in l]
        return dict(step_s=None, error=(err[-1] if err else f"exit codes {[p.returncode for p in procs]}")[:300])
    rows = [json.loads([l for l in o[0].strip().splitlines() if l.startswith("{")][-1]) for o in outs]
    return dict(step_s=rows[0]["step_s_median"], ranks=[{"peak_rss_bytes": r["peak_rss_bytes"]} for r in rows])


def model_state(rank):
    return rank["param_bytes"] + rank["grad_bytes"] + rank["optimizer_state_bytes"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nprocs", default="2,4")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    alloy = os.path.abspath(os.path.join(a.build, "alloy"))
    work = tempfile.mkdtemp(prefix="alloy-memory-bench-")
    with open("/usr/share/games/fortunes/fortunes", "rb") as f, open(os.path.join(work, "c.txt"), "wb") as g:
        g.write(f.read(400000))
    run([alloy, "data", "prepare", "--input", os.path.join(work, "c.txt"), "--output", os.path.join(work, "data/corpus")])
    t0 = time.time()
    res = dict(machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(), date=time.strftime("%Y-%m-%d")),
               model=MODEL, global_batch=a.global_batch, steps=a.steps, warmup=a.warmup, rounds=a.rounds, pools={})
    for nproc in [int(x) for x in a.nprocs.split(",") if x]:
        uneven = UNEVEN[nproc]
        cases = [("full replicas", ["--zero-stage", "0"]), ("zero-1", ["--zero-stage", "1"]), ("zero-2", ["--zero-stage", "2"]),
                 ("zero-2 " + ":".join(map(str, uneven)), ["--zero-stage", "2", "--shard-ratio"] + [str(x) for x in uneven]),
                 ("zero-3", ["--zero-stage", "3"]),
                 ("zero-3 " + ":".join(map(str, uneven)), ["--zero-stage", "3", "--shard-ratio"] + [str(x) for x in uneven]),
                 ("pytorch ddp", None), ("pytorch fsdp", "fsdp")]
        runs = {label: [] for label, _ in cases}
        for rnd in range(a.rounds):
            for label, flags in cases:
                if label == "pytorch fsdp" and runs[label] and runs[label][0].get("error"):
                    continue  # it failed once: the reason is recorded
                if isinstance(flags, list):
                    r = alloy_case(alloy, work, nproc, a.global_batch, a.steps, a.warmup, flags)
                else:
                    r = torch_case(nproc, a.global_batch, a.steps, a.warmup, fsdp=flags == "fsdp")
                runs[label].append(r)
                if r.get("error"):
                    log(f"{nproc} ranks round {rnd + 1}: {label:<16} failed: {r['error']}")
                else:
                    log(f"{nproc} ranks round {rnd + 1}: {label:<16} {r['step_s'] * 1e3:8.1f} ms/step, peak RSS "
                        + " ".join(f"{x['peak_rss_bytes'] / 2**20:.0f}" for x in r["ranks"]) + " MiB")
        pool = {}
        for label, rs in runs.items():
            ok = [r for r in rs if not r.get("error")]
            if not ok:
                pool[label] = dict(step_s=None, error=rs[0]["error"])
                continue
            pool[label] = dict(step_s=statistics.median(r["step_s"] for r in ok), rounds=[r["step_s"] for r in ok], ranks=ok[-1]["ranks"])
        full = pool["full replicas"]
        full_state = [model_state(r) for r in full["ranks"]]
        ratios = {}
        for label in pool:
            c = pool[label]
            if c.get("step_s") is None:
                continue
            ratios[f"{label} step vs full"] = c["step_s"] / full["step_s"]
            if "optimizer_state_bytes" in c["ranks"][0]:
                ratios[f"{label} model state per rank vs full"] = [model_state(r) / f for r, f in zip(c["ranks"], full_state)]
                ratios[f"{label} optimizer state per rank vs full"] = [
                    r["optimizer_state_bytes"] / f["optimizer_state_bytes"] for r, f in zip(c["ranks"], full["ranks"])]
        lab = "zero-2 " + ":".join(map(str, uneven))
        lab3 = "zero-3 " + ":".join(map(str, uneven))
        ratios["zero-3 model state per rank vs 1/N of full"] = [x * nproc for x in ratios["zero-3 model state per rank vs full"]]
        ratios["zero-3 peak gathered params vs full params"] = [
            r["peak_gathered_param_bytes"] / f["param_bytes"] for r, f in zip(pool["zero-3"]["ranks"], full["ranks"])]
        ratios["uneven shares asked"] = [x / sum(uneven) for x in uneven]
        pool["ratios"] = ratios
        res["pools"][f"{nproc} ranks"] = pool
        log(f"{nproc} ranks: step vs full replicas: zero-1 {ratios['zero-1 step vs full']:.3f}, zero-2 "
            f"{ratios['zero-2 step vs full']:.3f}, {lab} {ratios[lab + ' step vs full']:.3f}, zero-3 "
            f"{ratios['zero-3 step vs full']:.3f}, {lab3} {ratios[lab3 + ' step vs full']:.3f}, pytorch ddp "
            f"{ratios.get('pytorch ddp step vs full', float('nan')):.3f}")
        log(f"{nproc} ranks: model state per rank vs full replicas: zero-1 "
            + " ".join(f"{x:.3f}" for x in ratios["zero-1 model state per rank vs full"]) + "; zero-2 "
            + " ".join(f"{x:.3f}" for x in ratios["zero-2 model state per rank vs full"]) + "; zero-3 "
            + " ".join(f"{x:.3f}" for x in ratios["zero-3 model state per rank vs full"])
            + " (vs 1/N: " + " ".join(f"{x:.3f}" for x in ratios["zero-3 model state per rank vs 1/N of full"]) + ")")
        log(f"{nproc} ranks: zero-3 peak gathered parameters vs a replica's: "
            + " ".join(f"{x:.3f}" for x in ratios["zero-3 peak gathered params vs full params"]))
        log(f"{nproc} ranks: {lab3} model state per rank vs full: "
            + " ".join(f"{x:.3f}" for x in ratios[lab3 + " model state per rank vs full"]))
        log(f"{nproc} ranks: {lab} optimizer state per rank vs full: "
            + " ".join(f"{x:.3f}" for x in ratios[lab + " optimizer state per rank vs full"])
            + " (asked " + " ".join(f"{x:.3f}" for x in ratios["uneven shares asked"]) + ")")
    res["seconds"] = time.time() - t0
    path = os.path.join(REPO, "bench", "results", "memory.json")
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(path + ".tmp", path)
    log(f"wrote {path} ({res['seconds']:.0f} s)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
