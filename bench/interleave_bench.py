#!/usr/bin/python3
"""Interleaved virtual stages (schedule interleaved-1f1b) measured against one chunk a rank, side by
side in one invocation on an emulated pool.

On one profile of the pool (`alloy profile` under `alloy launch --emulate`), a pipeline over the
cluster's first --ranks devices in cluster order, --global-batch in micro-batches of --micro-batch,
each plan predicted with `alloy plan --evaluate`:
  1f1b         the whole half-block boundaries the model predicts fastest, one chunk a rank
  eager-1f1b-2 the same boundaries with two more forwards in flight (what the planner picks on
               the two-device pool: it hides the messages, not the fill and drain)
  interleaved  --virtual chunks a rank, every split of the model's half blocks into them tried
               (each chunk at least one), the fastest predicted
Every plan is trained --steps with the plan fixed (no re-planning), median step after
--timed-after, all alternating for --rounds rounds. Reports per plan the measured and predicted
step and the per-device idle share (ranks.json: not computing), and per round interleaved's gain
against each other plan, measured against predicted: whether the cost model that makes the
planner choose (or not choose) interleaving prices it as it runs.
Writes bench/results/interleave-<cluster stem>.json.

usage: /usr/bin/python3 bench/interleave_bench.py [--cluster examples/cluster-2dev-pipeline.yaml]
           [--config examples/demo-gpt2.yaml] [--global-batch 48] [--micro-batch 6] [--virtual 2]
           [--steps 12] [--rounds 3]
"""
import argparse
import itertools
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import hetero_bench as hb  # noqa: E402
from tp_bench import layout  # noqa: E402


def log(msg):
    print(f"[interleave] {msg}", flush=True)


def pipeline_plan(path, devices, gb, mbs, bounds, schedule, virtual=1):
    """A raw plan: one pipeline, chunk c of len(BOUNDS) - 1 holding units [BOUNDS[c], BOUNDS[c + 1])
    on device c mod len(DEVICES)."""
    stages = []
    for c in range(len(bounds) - 1):
        d = devices[c % len(devices)]
        stages.append({"ranks": [c % len(devices)], "units": [bounds[c], bounds[c + 1]], "device": d["name"]})
    pl = {"micro_batch_size": mbs, "num_micro_batches": gb // mbs, "stages": stages}
    if virtual > 1:
        pl["virtual_stages"] = virtual
    plan = {"format": "alloy-plan", "version": 10 if virtual > 1 else 3, "global_batch": gb, "schedule": schedule,
            "pipelines": [pl]}
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hb.add_fixed_plan_args(ap, "cluster-2dev-pipeline.yaml", "interleave", steps=12, timed_after=3)
    ap.set_defaults(micro_batch=6)
    ap.add_argument("--ranks", type=int, default=2, help="devices in the pipeline (the cluster's first, in its order)")
    ap.add_argument("--virtual", type=int, default=2, help="chunks a rank in the interleaved plan")
    a = ap.parse_args()
    R = hb.fixed_plan_runner(a)
    model = hb.model_of(R.config)
    U = 2 * int(model["layers"])
    devices = hb.cluster_devices(R.alloy, R.cluster)[:a.ranks]
    D, V = len(devices), a.virtual
    M = a.global_batch // a.micro_batch
    if M > D and M % D:
        sys.exit(f"{M} micro-batches on {D} ranks: interleaving needs a multiple of the ranks")
    if D * V > U:
        sys.exit(f"{D} ranks x {V} chunks need {D * V} half blocks, the model has {U}")
    prof = os.path.abspath(a.profile) if a.profile else R.profile()
    base = [R.alloy, "plan", "--cluster", R.cluster, "--config", R.config, "--profile", prof, "--no-compare"] + R.sets
    auto = os.path.join(R.work, "plan-auto.json")
    R.run(base + ["-o", auto])
    log(f"alloy plan's own choice for the pool: {layout(auto)}, predicted {hb.predicted_of(auto).get('step_s', float('nan')) * 1e3:.0f} ms")

    def evaluate(name, bounds, schedule, virtual=1):
        raw = pipeline_plan(os.path.join(R.work, f"plan-{name}-raw.json"), devices, a.global_batch, a.micro_batch, bounds,
                            schedule, virtual)
        out = os.path.join(R.work, f"plan-{name}.json")
        R.run(base + ["--evaluate", raw, "-o", out])
        return hb.predicted_of(out).get("step_s", float("inf")), out

    plans, predicted = {}, {}
    one = [evaluate("1f1b-" + "-".join(map(str, b)), [0] + list(b) + [U], "1f1b") + (b,)
           for b in itertools.combinations(range(1, U), D - 1)]
    predicted["1f1b"], plans["1f1b"], inner = min(one, key=lambda x: x[0])
    predicted["eager-1f1b-2"], plans["eager-1f1b-2"] = evaluate("eager-1f1b-2", [0] + list(inner) + [U], "eager-1f1b-2")
    splits = list(itertools.combinations(range(1, U), D * V - 1))
    log(f"pricing {len(splits)} splits of {U} half blocks into {D * V} chunks")
    il = [evaluate("il", [0] + list(b) + [U], "interleaved-1f1b", V) + (b,) for b in splits]
    best = min(il, key=lambda x: x[0])
    predicted["interleaved"], _, chunks = best
    predicted["interleaved"], plans["interleaved"] = evaluate("interleaved", [0] + list(chunks) + [U], "interleaved-1f1b", V)
    keys = ["1f1b", "eager-1f1b-2", "interleaved"]
    for key in keys:
        log(f"{key}: {layout(plans[key])}, predicted {predicted[key] * 1e3:.0f} ms")
    runs = hb.train_in_rounds(R, a, keys, plans, str, "il", log)
    results = {}
    for key in keys:
        results[key], text = hb.fixed_plan_result(runs[key], layout(plans[key]), predicted[key])
        log(f"{key}: {text}")
    gains = {}
    for other in keys[:-1]:
        g = hb.paired_gain(runs["interleaved"], runs[other], predicted["interleaved"], predicted[other])
        log(f"interleaved against {other}: {hb.gain_text(g)}")
        gains[f"interleaved-vs-{other}"] = g
    stem = os.path.splitext(os.path.basename(a.cluster))[0].replace("cluster-", "")
    path = hb.write_fixed_plan_results(a, f"interleave-{stem}", virtual=V, planner_choice=layout(auto), results=results,
                                       gains=gains)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
