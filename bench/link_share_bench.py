#!/usr/bin/python3
"""Pipelines sharing a thin link, side by side in one invocation on an emulated pool.

On examples/cluster-2x2-thin.yaml (two hosts of two devices, 0.05 Gbit/s between them), one
profile (`alloy profile` under `alloy launch --emulate`), then these plans trained in turn for
--rounds rounds with the plan fixed (no re-planning), the median round per plan reported:
  crossing   two pipelines a0 -> b0 and a1 -> b1, blocks 2 + 2, GPipe in micro-batches of 2: what
             the planner chose while it let every pipeline have a link to itself (each crosses the
             thin link, both at once)
  planner    `alloy plan` on the same profile (the cost model shares a link among the pipelines
             crossing it)
Each plan's step is predicted by `alloy plan --evaluate` on the profile; reported per plan:
measured, predicted, error, and whether the planner's choice is the faster measured.
Writes bench/results/link-share.json.

usage: /usr/bin/python3 bench/link_share_bench.py [--build build] [--cluster examples/cluster-2x2-thin.yaml]
           [--config examples/demo-gpt2.yaml] [--steps 14] [--timed-after 3] [--rounds 2]
"""
import argparse
import json
import os
import platform
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import hetero_bench as hb  # noqa: E402
import tp_bench  # noqa: E402


def log(msg):
    print(f"[link-share] {msg}", flush=True)


def crossing_plan(path, gb):
    half = gb // 2
    pipes = []
    for k in range(2):
        pipes.append({"micro_batch_size": 2, "num_micro_batches": half // 2,
                      "stages": [{"ranks": [k], "layers": [0, 2], "device": f"a{k}"},
                                 {"ranks": [2 + k], "layers": [2, 4], "device": f"b{k}"}]})
    with open(path, "w") as f:
        json.dump({"format": "alloy-plan", "version": 4, "global_batch": gb, "schedule": "gpipe", "pipelines": pipes}, f,
                  indent=2)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--cluster", default=os.path.join(REPO, "examples", "cluster-2x2-thin.yaml"))
    ap.add_argument("--config", default=os.path.join(REPO, "examples", "demo-gpt2.yaml"))
    ap.add_argument("--work", default=os.path.join(REPO, "runs", "link-share"))
    ap.add_argument("--global-batch", type=int, default=96)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--timed-after", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    sets = [f"train.global_batch={a.global_batch}", "train.replan_step=0", "train.eval_interval=1000"]
    R = hb.Runner(argparse.Namespace(build=a.build, cluster=a.cluster, config=a.config, work=a.work, steps=a.steps,
                                     round_steps=None, demo=False, timed_after=a.timed_after, set=sets))
    if not os.path.exists(os.path.join(REPO, "data", "fortunes_train.idx")):
        R.run([R.alloy, "data", "prepare", "--input", "/usr/share/games/fortunes", "--output", "data/fortunes"])
    prof = R.profile()
    base = [R.alloy, "plan", "--cluster", R.cluster, "--config", R.config, "--profile", prof, "--no-compare"] + R.sets
    plans = {"planner": os.path.join(R.work, "plan-planner.json"), "crossing": os.path.join(R.work, "plan-crossing.json")}
    R.run(base + ["-o", plans["planner"]])
    raw = crossing_plan(os.path.join(R.work, "plan-crossing-raw.json"), a.global_batch)
    R.run(base + ["--evaluate", raw, "-o", plans["crossing"]])
    for name, p in plans.items():
        log(f"{name}: {tp_bench.layout(p)}")
    runs = {}
    for k in range(a.rounds):
        for name in ("crossing", "planner"):
            log(f"round {k + 1} of {a.rounds}: training {a.steps} steps of {name}")
            runs.setdefault(name, []).append(R.train(f"share-{name}-{k + 1}", plans[name], a.steps))
    results = []
    for name in ("crossing", "planner"):
        pred = hb.predicted_of(plans[name]).get("step_s", float("nan"))
        steps = sorted(r["step_s"] for r in runs[name])
        step = statistics.median(steps)
        results.append(dict(name=name, plan=tp_bench.layout(plans[name]), measured_step_s=step, rounds_step_s=steps,
                            predicted_step_s=pred, relative_error=(step - pred) / pred))
    log("plan        measured    predicted    error   layout")
    for x in results:
        log(f"{x['name']:<10} {x['measured_step_s'] * 1e3:8.0f} ms {x['predicted_step_s'] * 1e3:8.0f} ms "
            f"{100 * x['relative_error']:+6.1f}%   {x['plan']}")
    crossing, planner = results
    faster = planner["measured_step_s"] <= crossing["measured_step_s"]
    log(f"the planner's choice measured {crossing['measured_step_s'] / planner['measured_step_s']:.2f}x the crossing "
        f"plan's speed: {'faster' if faster else 'NOT faster'}")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
    path = os.path.join(HERE, "results", "link-share.json")
    with open(path, "w") as f:
        json.dump(dict(machine=dict(cpu=cpu, cores=os.cpu_count()), cluster=os.path.relpath(a.cluster, REPO),
                       config=os.path.relpath(a.config, REPO), global_batch=a.global_batch, steps=a.steps, rounds=a.rounds,
                       results=results, planner_faster=faster), f, indent=2)
    log(f"wrote {path}")
    return 0 if faster else 1


if __name__ == "__main__":
    sys.exit(main())
