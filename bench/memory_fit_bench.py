#!/usr/bin/env python3
"""A pool whose slow device has too little memory for a replica of its layers
(examples/cluster-3dev-small-memory.yaml, emulated; needs root): `alloy plan` must shard or
recompute to fit, `--plan auto` trains it, and the planner's per-rank memory and step time are
compared with what the ranks measured (ranks.json: model_memory_bytes, the heap's peak above what
the rank held before building its model; step_s_median).

  /usr/bin/python3 bench/memory_fit_bench.py [--build build] [--steps 24] [--profile P]

Writes bench/results/memory-fit.json. Goals (issue 17): memory within 15%, step within 10%.
"""
import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, log):
    print("[memory-fit] " + " ".join(cmd), flush=True)
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        sys.exit(f"[memory-fit] failed ({r.returncode}); see {log}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--cluster", default="examples/cluster-3dev-small-memory.yaml")
    ap.add_argument("--config", default="examples/demo-gpt2.yaml")
    ap.add_argument("--profile", default="", help="reuse a profile of the pool (default: profile it first)")
    ap.add_argument("--out", default="runs/memory-fit")
    a = ap.parse_args()
    alloy = os.path.join(REPO, a.build, "alloy")
    out = os.path.join(REPO, a.out)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    profile = a.profile or os.path.join(out, "profile.json")
    if not a.profile:
        run([alloy, "launch", "--emulate", a.cluster, "--", "alloy", "profile", "--cluster", a.cluster, "--config", a.config,
             "-o", profile], os.path.join(out, "profile.log"))
    run([alloy, "plan", "--cluster", a.cluster, "--config", a.config, "--profile", profile, "-o", os.path.join(out, "plan.json")],
        os.path.join(out, "plan.log"))
    print(open(os.path.join(out, "plan.log")).read(), flush=True)
    run_dir = os.path.join(out, "run")
    run([alloy, "launch", "--emulate", a.cluster, "--", "alloy", "train", "--config", a.config, "--plan", "auto", "--cluster", a.cluster,
         "--profile", profile, "--set", f"train.steps={a.steps}", "--set", f"output.dir={run_dir}"], os.path.join(out, "train.log"))
    plan = json.load(open(os.path.join(run_dir, "plan.json")))
    ranks = json.load(open(os.path.join(run_dir, "ranks.json")))
    ranks = ranks["ranks"] if isinstance(ranks, dict) and "ranks" in ranks else ranks
    predicted = {s["rank"]: s for s in plan["predicted"]["per_stage"]}
    calibrated = None
    replan = os.path.join(run_dir, "replan.json")
    if os.path.exists(replan):
        rp = json.load(open(replan)).get("replans", [])
        if rp:
            calibrated = rp[-1].get("running_plan_calibrated_s")
    step_measured = max(r["step_s_median"] for r in ranks)
    rows = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        p = predicted[r["rank"]]
        rows.append({"rank": r["rank"], "device": p["device"], "zero_stage": p.get("zero_stage", 0), "shard": p.get("shard", 1),
                     "recompute": p.get("recompute", False), "capacity_bytes": p["memory_capacity_bytes"],
                     "predicted_bytes": p["memory_bytes"], "measured_bytes": r["model_memory_bytes"],
                     "measured_vs_predicted": r["model_memory_bytes"] / p["memory_bytes"], "predicted_parts": p.get("memory")})
        print(f"[memory-fit] rank {r['rank']} ({p['device']}): memory measured {r['model_memory_bytes'] / 1e6:.2f} MB, predicted "
              f"{p['memory_bytes'] / 1e6:.2f} MB (x{rows[-1]['measured_vs_predicted']:.3f}), capacity {p['memory_capacity_bytes'] / 1e6:.1f} MB")
    res = {"cluster": a.cluster, "config": a.config, "steps": a.steps, "sharding": plan.get("sharding", []),
           "recompute": [st.get("recompute", False) for pl in plan["pipelines"] for st in pl["stages"]],
           "ranks": rows, "step_measured_s": step_measured, "step_predicted_s": plan["predicted"]["step_s"],
           "step_calibrated_s": calibrated, "seconds": time.time() - t0}
    print(f"[memory-fit] step measured {step_measured * 1e3:.0f} ms, predicted {res['step_predicted_s'] * 1e3:.0f} ms "
          f"(x{step_measured / res['step_predicted_s']:.3f})" +
          (f", calibrated after step 6 {calibrated * 1e3:.0f} ms (x{step_measured / calibrated:.3f})" if calibrated else ""))
    os.makedirs(os.path.join(REPO, "bench", "results"), exist_ok=True)
    path = os.path.join(REPO, "bench", "results", "memory-fit.json")
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    print(f"[memory-fit] wrote {path}")


if __name__ == "__main__":
    main()
