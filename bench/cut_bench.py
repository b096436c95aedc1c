#!/usr/bin/python3
"""Pipeline boundaries inside an MLP (StagePlan::mlp_cut) measured against whole half blocks, side
by side in one invocation on an emulated pool.

On one profile of the pool (`alloy profile` under `alloy launch --emulate`), a pipeline over the
cluster's first two devices in cluster order (the first holding the embedding), --global-batch in
micro-batches of --micro-batch, each plan predicted with `alloy plan --evaluate`:
  halves   the boundary at the whole half block the model predicts fastest
  cut      that boundary, or the one a half block either side, inside the MLP half next to it, the
           first stage computing the columns of k heads (k = 1..heads-1), the fastest predicted
each under every schedule of --schedules (default 1f1b and eager-1f1b: under 1F1B two balanced
stages wait for messages in every other slot, which eager 1F1B's extra forward in flight hides),
and what `alloy plan` itself chooses for the pool is printed beside them. Every plan is trained
--steps with the plan fixed (no re-planning), median step after --timed-after, all alternating
for --rounds rounds. Reports per plan the measured and predicted step, the per-device idle share
(ranks.json: not computing), and per round the cut's gain against half blocks under each
schedule and each later schedule's gain against the first, measured against predicted.
Writes bench/results/cut-<cluster stem>.json (-mb<N> added for a --micro-batch other than 4).

usage: /usr/bin/python3 bench/cut_bench.py [--cluster examples/cluster-2dev-pipeline.yaml]
           [--config examples/demo-gpt2.yaml] [--global-batch 48] [--micro-batch 4] [--steps 12] [--rounds 3]
           [--schedules 1f1b,eager-1f1b]
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import hetero_bench as hb  # noqa: E402
from tp_bench import layout  # noqa: E402


def log(msg):
    print(f"[cut] {msg}", flush=True)


def pipeline_plan(path, devices, gb, mbs, units, cut=0, schedule="1f1b"):
    """A raw plan: one pipeline over DEVICES' first two, stage 0 holding UNITS[0] (half blocks), stage
    1 UNITS[1], stage 0 cutting its last MLP at CUT heads (0: none)."""
    stages = []
    for r, (u0, u1) in enumerate(units):
        st = {"ranks": [r], "units": [u0, u1], "device": devices[r]["name"]}
        if r == 0 and cut:
            st["mlp_cut"] = cut
        stages.append(st)
    plan = {"format": "alloy-plan", "version": 8 if cut else 3, "global_batch": gb, "schedule": schedule,
            "pipelines": [{"micro_batch_size": mbs, "num_micro_batches": gb // mbs, "stages": stages}]}
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hb.add_fixed_plan_args(ap, "cluster-2dev-pipeline.yaml", "cut", steps=12, timed_after=3)
    ap.add_argument("--schedules", default="1f1b,eager-1f1b", help="comma-separated pipeline schedules to train each plan under")
    a = ap.parse_args()
    schedules = [x for x in a.schedules.split(",") if x]
    R = hb.fixed_plan_runner(a)
    model = hb.model_of(R.config)
    heads, U = int(model["heads"]), 2 * int(model["layers"])
    devices = hb.cluster_devices(R.alloy, R.cluster)[:2]
    prof = os.path.abspath(a.profile) if a.profile else R.profile()
    base = [R.alloy, "plan", "--cluster", R.cluster, "--config", R.config, "--profile", prof, "--no-compare"] + R.sets
    auto = os.path.join(R.work, "plan-auto.json")
    R.run(base + ["-o", auto])
    log(f"alloy plan's own choice for the pool: {layout(auto)}, predicted {hb.predicted_of(auto).get('step_s', float('nan')) * 1e3:.0f} ms")

    def evaluate(name, units, cut=0, schedule="1f1b"):
        raw = pipeline_plan(os.path.join(R.work, f"plan-{name}-raw.json"), devices, a.global_batch, a.micro_batch, units, cut,
                            schedule)
        out = os.path.join(R.work, f"plan-{name}.json")
        R.run(base + ["--evaluate", raw, "-o", out])
        return hb.predicted_of(out).get("step_s", float("inf")), out

    # The boundary and the cut are chosen under the first schedule and kept under the others, so
    # the schedules are compared on the same layouts.
    plans, predicted = {}, {}
    first = schedules[0]
    best = min((evaluate(f"halves-{u}", [(0, u), (u, U)], 0, first) + (u,) for u in range(1, U)), key=lambda x: x[0])
    predicted[("halves", first)], plans[("halves", first)], boundary = best
    cands = []
    for u in (boundary - 1, boundary, boundary + 1):
        shared = u - 1 if u % 2 == 0 else u  # the MLP half next to the boundary
        if shared % 2 != 1 or shared < 1 or shared + 1 >= U:
            continue
        for k in range(1, heads):
            cands.append(evaluate(f"cut-{shared}-{k}", [(0, shared + 1), (shared, U)], k, first) + ((shared, k),))
    if not cands:
        sys.exit("no MLP half next to the boundary to cut")
    predicted[("cut", first)], plans[("cut", first)], (shared, k) = min(cands, key=lambda x: x[0])
    for sched in schedules[1:]:
        predicted[("halves", sched)], plans[("halves", sched)] = evaluate(f"halves-{sched}", [(0, boundary), (boundary, U)], 0, sched)
        predicted[("cut", sched)], plans[("cut", sched)] = evaluate(f"cut-{sched}", [(0, shared + 1), (shared, U)], k, sched)
    keys = [(kind, sched) for sched in schedules for kind in ("halves", "cut")]
    name_of = {key: f"{key[0]}-{key[1]}" for key in keys}
    for key in keys:
        log(f"{name_of[key]}: {layout(plans[key])}, predicted {predicted[key] * 1e3:.0f} ms")
    runs = hb.train_in_rounds(R, a, keys, plans, name_of.get, "cut", log)
    results = {}
    for key in keys:
        results[name_of[key]], text = hb.fixed_plan_result(runs[key], layout(plans[key]), predicted[key])
        results[name_of[key]]["schedule"] = key[1]
        log(f"{name_of[key]}: {text}")

    # Per round, the plans measured back to back: the gain of one over another in that round.
    def gain(a_key, b_key, what):
        g = hb.paired_gain(runs[a_key], runs[b_key], predicted[a_key], predicted[b_key])
        log(f"{what}: {hb.gain_text(g)}")
        return g

    gains = {}
    for sched in schedules:
        gains[f"cut-vs-halves-{sched}"] = gain(("cut", sched), ("halves", sched), f"the cut against half blocks under {sched}")
    for sched in schedules[1:]:
        for kind in ("halves", "cut"):
            gains[f"{sched}-vs-{first}-{kind}"] = gain((kind, sched), (kind, first), f"{sched} against {first} on {kind}")
    stem = os.path.splitext(os.path.basename(a.cluster))[0].replace("cluster-", "")
    # Another micro-batch size is another record, not a replacement of the default's.
    name = f"cut-{stem}" + (f"-mb{a.micro_batch}" if a.micro_batch != 4 else "")
    path = hb.write_fixed_plan_results(a, name, schedules=schedules, planner_choice=layout(auto), results=results,
                                       gains=gains)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
