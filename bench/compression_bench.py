#!/usr/bin/python3
"""Gradient compression on thin links, every case side by side in one invocation (rounds alternate).

Two emulated pools (`alloy launch --emulate`, root):
  2host       examples/cluster-2host-100mbit.yaml: two 0.8-core devices joined by 100 Mbit/s;
              examples/small-gpt2.yaml (6 x 384, 10.8M parameters, 43 MB of fp32 gradient),
              data parallel, 8 samples per rank
  two-region  examples/cluster-2region.yaml: four devices in two regions, 1 Gbit/s inside,
              0.1 Gbit/s between; examples/demo-gpt2.yaml, data parallel with batches by speed,
              compression between the regions only (grad_sync.scope slow-links)
For each: dense exact sync; every compressor at density 0.01 and 0.001 (SAF-(Inter+Intra), i.e.
fusion saf-adaptive); every fusion strategy with DGC at 0.01; PyTorch DDP (python3-torch, same
model, batch, optimizer and threads) plain and with its PowerSGD hook (ranks 1 and 4; one DDP
bucket, since with several buckets its PowerSGD hook over Gloo issues collectives in different
orders on different ranks and aborts). Reports the median step time of every case and the ratios
the issue asks for.

  --convergence   also train examples/small-gpt2.yaml for 300 steps on the fortunes corpus with
                  every compressor (2 ranks on loopback) and plot the validation curves; "METHOD+mc"
                  is a sparsifier with DGC's momentum correction (grad_sync.momentum_correction=on).
                  With --cases, only the labels named exactly train (and dense exact); with
                  --reuse-runs finished runs stand. Convergence alone: --pools "" --convergence

Writes bench/results/compression.json and PNGs (compression-2host.png, compression-two-region.png,
compression-convergence.png).
Each run trains --steps steps and times those after the first --skip (--dense-steps exact steps
first, then the target density at once; saf-adaptive tries its cuts over the first 10 compressed
steps, so by default steps 21-28 are timed); PyTorch DDP warms up as many steps. A run whose loss
overflows is reported as diverged: its timing does not count.
usage: /usr/bin/python3 bench/compression_bench.py [--rounds 2] [--steps 28] [--skip 20] [--dense-steps 10]
                                                   [--pools 2host,two-region] [--cases SUBSTRING,...]
                                                   [--convergence] [--convergence-steps 300]
                                                   [--link-gbps G] [--latency-ms L]  (2host's link replaced)
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
sys.path.insert(0, HERE)
import plot  # noqa: E402

SPARSE = ["topk", "randomk", "dgc", "gaussiank", "redsync", "sidco", "oktopk"]
FUSIONS = ["tensor", "bucket", "omgs", "cupcake", "saf", "saf-inter", "saf-adaptive"]


def log(msg):
    print(f"[compression] {msg}", flush=True)


def model_of(config):
    m, sec = {}, None
    for line in open(config):
        s = line.split("#")[0].rstrip()
        if not s.strip():
            continue
        if not line.startswith(" "):
            sec = s.split(":")[0].strip()
            continue
        k, v = s.strip().split(":", 1)
        if sec == "model" or (sec == "train" and k.strip() == "global_batch"):
            v = v.strip()
            m[k.strip()] = int(v) if v.isdigit() else v
    return m


def dp_plan(path, batches, mbs, layers):
    plan = {"format": "alloy-plan", "version": 1, "global_batch": sum(batches), "schedule": "1f1b",
            "pipelines": [{"micro_batch_size": mbs, "num_micro_batches": b // mbs,
                           "stages": [{"ranks": [r], "layers": [0, layers]}]} for r, b in enumerate(batches)]}
    with open(path, "w") as f:
        json.dump(plan, f)
    return path


class Pool:
    def __init__(self, name, cluster, config, batches, mbs, scope, a):
        self.name, self.cluster, self.config = name, os.path.join(REPO, cluster), os.path.join(REPO, config)
        self.batches, self.mbs, self.scope = batches, mbs, scope
        self.alloy = os.path.abspath(os.path.join(a.build, "alloy"))
        self.work = os.path.join(os.path.abspath(a.work), name)
        os.makedirs(self.work, exist_ok=True)
        self.model = model_of(self.config)
        self.plan = dp_plan(os.path.join(self.work, "dp.json"), batches, mbs, self.model["layers"])
        self.a = a
        self.steps, self.skip, self.dense_steps = a.steps, a.skip, a.dense_steps
        self.only = [c for c in a.cases.split(",") if c]
        self.key = name + ("-only-" + "-".join(o.replace(" ", "_").replace("=", "") for o in self.only) if self.only else "")
        self.env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

    def cases(self):
        c = [("dense exact", {"compression": "none"})]
        for d in (0.01, 0.001):
            for m in SPARSE:
                c.append((f"{m} {d}", {"compression": m, "density": d}))
        c += [("fp16", {"compression": "fp16"}), ("bf16", {"compression": "bf16"}),
              ("powersgd r1", {"compression": "powersgd", "powersgd_rank": 1}),
              ("powersgd r4", {"compression": "powersgd", "powersgd_rank": 4})]
        for f in FUSIONS:
            if f != "saf-adaptive":
                c.append((f"dgc 0.01 {f}", {"compression": "dgc", "density": 0.01, "fusion": f}))
        c += [("pytorch ddp", {"ddp": 0}), ("pytorch powersgd r1", {"ddp": 1}), ("pytorch powersgd r4", {"ddp": 4})]
        if self.only:
            c = [x for x in c if any(x[0] == o[1:] if o.startswith("=") else o in x[0] for o in self.only)]
        return c

    def run(self, label, case, rnd):
        out = os.path.join(self.work, "runs", f"{label.replace(' ', '_')}-r{rnd}")
        if "ddp" in case:
            per = self.batches[0]
            cmd = ["/usr/bin/python3", os.path.join(HERE, "ddp_train_step.py"), "--layers", str(self.model["layers"]),
                   "--hidden", str(self.model["hidden"]), "--heads", str(self.model["heads"]),
                   "--seq-len", str(self.model["seq_len"]), "--vocab", str(self.model["vocab_size"]), "--batch", str(per),
                   "--steps", str(self.steps - self.skip), "--warmup", str(self.skip), "--threads", "1", "--bucket-mb", "1000",
                   "--powersgd-rank", str(case["ddp"])]
            # A baseline that crashes is recorded as such; the other cases still count.
            r = self.launch(cmd, may_fail=True)
            if r.returncode != 0:
                return dict(step_s=float("nan"), error=(r.stdout + r.stderr).strip().splitlines()[-1][:300])
            line = [l for l in (r.stdout + r.stderr).splitlines() if '"pytorch-ddp"' in l][-1]
            return dict(step_s=json.loads(line[line.index("{"):])["step_s_median"])
        sets = [f"output.dir={out}", f"train.steps={self.steps}", "train.eval_interval=0", "train.eval_batches=0",
                "train.threads=1", "train.checkpoint_interval=0", f"train.global_batch={sum(self.batches)}",
                # Ten exact steps first (with one, most sparsifiers diverged to NaN by step 6-11 and
                # their timings meant nothing), then the target density at once; steps past --skip timed.
                f"grad_sync.scope={self.scope}", f"grad_sync.dense_steps={self.dense_steps}", "grad_sync.warmup_steps=0"]
        for k, v in case.items():
            sets.append(f"grad_sync.{k}={v}")
        sets += self.a.set or []
        cmd = [self.alloy, "train", "--config", self.config, "--plan", self.plan]
        for s in sets:
            cmd += ["--set", s]
        self.launch(cmd)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(l) for l in f if l.strip()][self.skip:]
        res = dict(step_s=statistics.median(r["step_s"] for r in rows),
                   grad_bytes=statistics.median(r["grad_bytes"] for r in rows))
        # A run whose loss overflowed times NaN arithmetic and empty selections, not the method.
        bad = [r["step"] for r in rows if r.get("loss") is None or not abs(r["loss"]) < 1e4]
        if bad:
            res["diverged_at"] = bad[0]
        if "grad_density" in rows[-1]:
            res["density"] = statistics.median(r["grad_density"] for r in rows)
            res["compress_s"] = statistics.median(r["compress_s"] for r in rows)
        return res

    def launch(self, cmd, may_fail=False):
        full = [self.alloy, "launch", "--emulate", self.cluster] + (["--no-pin"] if self.a.no_pin else []) + ["--"] + cmd
        r = subprocess.run(full, capture_output=True, text=True, env=self.env, cwd=REPO)
        if r.returncode != 0 and may_fail:
            log(f"{self.name}: failed ({r.returncode}): {' '.join(cmd[:3])} ...: {(r.stdout + r.stderr).strip()[-300:]}")
        elif r.returncode != 0:
            sys.stderr.write(r.stdout[-3000:] + r.stderr[-4000:])
            raise SystemExit(f"failed: {' '.join(full)}")
        return r


def bench_pool(pool, rounds):
    cases = pool.cases()
    runs = {label: [] for label, _ in cases}
    for rnd in range(rounds):
        for label, case in cases:
            t0 = time.time()
            r = pool.run(label, case, rnd)
            runs[label].append(r)
            log(f"{pool.name} round {rnd + 1}/{rounds}: {label:<22} {r['step_s'] * 1e3:8.1f} ms/step"
                + (f", {r['grad_bytes'] / 1e6:.2f} MB/step" if "grad_bytes" in r else "")
                + (f", density {r['density']:.4f}" if "density" in r else "")
                + (f", DIVERGED at step {r['diverged_at']} (timing void)" if "diverged_at" in r else "") + f" ({time.time() - t0:.0f} s)")

    def median(xs):  # of the rounds that ran (a crashed baseline: nan)
        xs = [x for x in xs if x == x]
        return statistics.median(xs) if xs else float("nan")

    med = {label: dict(step_s=median(x["step_s"] for x in rs), rounds=[x["step_s"] for x in rs],
                       **({"errors": [x["error"] for x in rs if "error" in x]} if any("error" in x for x in rs) else {}),
                       **({"diverged_at": [x.get("diverged_at") for x in rs]} if any("diverged_at" in x for x in rs) else {}),
                       **{k: statistics.median(x[k] for x in rs) for k in ("grad_bytes", "density", "compress_s") if k in rs[0]})
           for label, rs in runs.items()}
    # The ratios whose cases ran (--cases may leave some out).
    t = {label: m["step_s"] for label, m in med.items()}
    best = t.get("dgc 0.01", float("nan"))
    ratios = {}
    if "dense exact" in t:
        ratios["saf_adaptive_dgc_vs_dense"] = t["dense exact"] / best
    for f in FUSIONS:
        if f != "saf-adaptive" and f"dgc 0.01 {f}" in t:
            ratios[f"saf_adaptive_vs_{f}"] = t[f"dgc 0.01 {f}"] / best
    for r in (1, 4):
        if f"pytorch powersgd r{r}" in t:
            ratios[f"saf_adaptive_vs_pytorch_powersgd_r{r}"] = t[f"pytorch powersgd r{r}"] / best
    if "pytorch ddp" in t and "dense exact" in t:
        ratios["dense_vs_pytorch_ddp"] = t["pytorch ddp"] / t["dense exact"]
    log(f"{pool.name}: SAF-(Inter+Intra) DGC 0.01 vs dense exact {ratios.get('saf_adaptive_dgc_vs_dense', float('nan')):.2f}x "
        "(goal >= 4); " + ", ".join(f"{k.replace('saf_adaptive_vs_', '')} {v:.2f}x" for k, v in ratios.items() if k.startswith("saf_adaptive_vs")))
    cats = [label for label, _ in cases]
    diverged = [c for c in cats if "diverged_at" in med[c]]
    if diverged:
        log(f"{pool.name}: diverged (timings void): {', '.join(diverged)}")
    plot.bars(os.path.join(REPO, "bench", "results", f"compression-{pool.key}.png"),
              f"{pool.name}: step time by gradient sync (ms, median of {rounds} rounds)", "ms per step",
              [c + (" (diverged)" if c in diverged else "") for c in cats],
              {"step": [1e3 * med[c]["step_s"] for c in cats]})
    return dict(cluster=os.path.relpath(pool.cluster, REPO), config=os.path.relpath(pool.config, REPO), batches=pool.batches,
                scope=pool.scope, steps=pool.steps, timed_after=pool.skip, dense_steps=pool.dense_steps, rounds=rounds,
                pinned=not pool.a.no_pin, cases=med, ratios=ratios)


def convergence(a):
    """small-gpt2, 300 steps, 2 ranks on loopback, every compressor at density 0.01: validation curves."""
    alloy = os.path.abspath(os.path.join(a.build, "alloy"))
    work = os.path.join(os.path.abspath(a.work), "convergence")
    os.makedirs(work, exist_ok=True)
    plan = dp_plan(os.path.join(work, "dp.json"), [8, 8], 8, 6)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    curves, results = {}, {}
    # "+mc": the sparsifier with DGC's momentum correction (grad_sync.momentum_correction=on).
    labels = ["none", "fp16", "bf16"] + SPARSE + ["powersgd"] + [f"{m}+mc" for m in SPARSE if m != "dgc"]
    only = [c for c in a.cases.split(",") if c]
    for method in labels:
        out = os.path.join(work, method)
        metrics = os.path.join(out, "metrics.jsonl")
        done = a.reuse_runs and os.path.exists(metrics) and sum(1 for l in open(metrics) if l.strip()) >= a.convergence_steps
        if only and method != "none" and not any(c == method for c in only) and not done:
            continue  # --cases: the exact labels to train (dense exact always, as the reference)
        name, mc = (method[:-3], True) if method.endswith("+mc") else (method, False)
        cmd = [alloy, "launch", "--nproc", "2", "--threads-per-rank", "1", "--", alloy, "train", "--config",
               os.path.join(REPO, "examples", "small-gpt2.yaml"), "--plan", plan, "--set", f"output.dir={out}",
               "--set", f"train.steps={a.convergence_steps}", "--set", "train.eval_interval=25", "--set", "train.eval_batches=8",
               "--set", f"grad_sync.compression={name}", "--set", "grad_sync.density=0.01"]
        if mc:
            cmd += ["--set", "grad_sync.momentum_correction=on"]
        t0 = time.time()
        if not done:  # --reuse-runs: a finished run of the same settings stands (a crashed invocation)
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
            if r.returncode != 0:
                sys.stderr.write(r.stderr[-3000:])
                raise SystemExit(f"convergence run {method} failed")
        rows = [json.loads(l) for l in open(metrics) if l.strip()]
        # A diverged run has NaN losses (null in metrics.jsonl): kept as NaN, drawn up to there.
        curves[method] = [(x["step"], float("nan") if x["val_loss"] is None else x["val_loss"]) for x in rows if "val_loss" in x]
        final = curves[method][-1][1]
        results[method] = dict(final_val_loss=final, curve=curves[method], diverged=final != final or final > 10)
        log(f"convergence {method:<10} validation loss {final:.4f} after {a.convergence_steps} steps "
            f"({'reused' if done else f'{time.time() - t0:.0f} s'})")
    base = results["none"]["final_val_loss"]
    for m, v in results.items():
        v["vs_dense"] = v["final_val_loss"] / base - 1
    log(f"DGC at 0.01: validation loss {results['dgc']['final_val_loss']:.4f} vs dense {base:.4f} "
        f"({100 * results['dgc']['vs_dense']:+.2f}%, goal within 2%)")
    plot.lines(os.path.join(REPO, "bench", "results", "compression-convergence.png"),
               f"small-gpt2, 2 ranks, density 0.01: validation loss", "step", "validation loss", curves,
               yrange=(2.2, 4.5))  # a diverged run leaves the top
    return results


def no_nan(x):
    """NaN (a crashed baseline) as null: strict JSON has no NaN."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [no_nan(v) for v in x]
    return x


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--work", default=os.path.join(REPO, "runs", "compression"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--skip", type=int, default=20, help="steps not timed (the exact ones and saf-adaptive's trials)")
    ap.add_argument("--dense-steps", type=int, default=10, help="exact steps before compressing (grad_sync.dense_steps)")
    ap.add_argument("--cases", default="", help="only the cases whose label contains one of these (comma-separated; =LABEL: that label exactly)")
    ap.add_argument("--pools", default="2host,two-region")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="config override for every Alloy run, baselines and compressors alike, e.g. train.rebalance=true")
    ap.add_argument("--no-pin", action="store_true",
                    help="leave the emulated devices' ranks unpinned (`alloy launch --no-pin`): on a host whose CPUs "
                         "run at unlike speeds for minutes, pinning gives one device the slow CPU for the whole run")
    ap.add_argument("--convergence", action="store_true")
    ap.add_argument("--convergence-steps", type=int, default=300)
    ap.add_argument("--reuse-runs", action="store_true", help="convergence: keep finished runs in --work instead of training again")
    ap.add_argument("--link-gbps", type=float, default=0,
                    help="2host: the link's bandwidth instead of the example's 0.1 Gbit/s (where the exchange cannot hide, fusion shows)")
    ap.add_argument("--latency-ms", type=float, default=0,
                    help="2host: the link's latency (one way) instead of the example's 0.1 ms; the emulator adds 1 ms "
                         "or more (a delay line), where each message's start costs what fusing saves")
    a = ap.parse_args()
    if not os.path.exists(os.path.join(REPO, "data", "fortunes_train.idx")):
        log("preparing the fortunes corpus (data/fortunes)")
        subprocess.run([os.path.join(a.build, "alloy"), "data", "prepare", "--input", "/usr/share/games/fortunes",
                        "--output", os.path.join(REPO, "data", "fortunes")], check=True, cwd=REPO)
    t0 = time.time()
    res = dict(machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                            date=time.strftime("%Y-%m-%d")), pools={})
    pools = {"2host": ("examples/cluster-2host-100mbit.yaml", "examples/small-gpt2.yaml", [8, 8], 8, "all"),
             "two-region": ("examples/cluster-2region.yaml", "examples/demo-gpt2.yaml", [28, 28, 28, 12], 4, "slow-links")}
    derived = ""
    if a.link_gbps > 0 or a.latency_ms > 0:
        # The same two hosts over another link (a copy of the example with its bandwidth or latency replaced).
        derived = "2host" + (f"-{a.link_gbps:g}gbps" if a.link_gbps > 0 else "") + (f"-{a.latency_ms:g}ms" if a.latency_ms > 0 else "")
        os.makedirs(os.path.abspath(a.work), exist_ok=True)
        path = os.path.join(os.path.abspath(a.work), f"cluster-{derived}.yaml")
        with open(os.path.join(REPO, pools["2host"][0])) as f:
            text = f.read()
        if a.link_gbps > 0:
            text = text.replace("bandwidth_gbps: 0.1,", f"bandwidth_gbps: {a.link_gbps:g},")
        if a.latency_ms > 0:
            text = text.replace("latency_ms: 0.1}", f"latency_ms: {a.latency_ms:g}}}")
        with open(path, "w") as f:
            f.write(text)
        pools[derived] = (path,) + pools["2host"][1:]
    for name in a.pools.split(","):
        if name:
            if name == "2host" and derived:
                name = derived
            pool = Pool(name, *pools[name], a)
            res["pools"][pool.key] = bench_pool(pool, a.rounds)
    if a.convergence:
        res["convergence"] = convergence(a)
    res["seconds"] = time.time() - t0
    # Parts run separately (--pools, --convergence) keep what an earlier invocation recorded.
    path = os.path.join(REPO, "bench", "results", "compression.json")
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        old["pools"].update(res["pools"])
        if "convergence" in res:
            old["convergence"] = res["convergence"]
        old["machine"], old["seconds"] = res["machine"], res["seconds"]
        res = old
    with open(path + ".tmp", "w") as f:
        json.dump(no_nan(res), f, indent=1)
    os.replace(path + ".tmp", path)
    log(f"wrote {path} ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
