#!/usr/bin/python3
"""The planner's plan for a pool with one set of pipeline schedules allowed against another, side by
side in one invocation on an emulated pool.

On one profile of the pool (`alloy profile` under `alloy launch --emulate`), `alloy plan` is run
once per --sets entry with `--schedules` set to it (default: `1f1b` alone against 1f1b with
eager-1f1b); each resulting plan (layout, batch split, micro-batches and schedules, as the planner
chose them under that set) is trained --steps with the plan fixed (no re-planning), median step
after --timed-after, the plans alternating for --rounds rounds. Reports per plan the measured and
predicted step and the per-device idle share (ranks.json: not computing), and per round each later
plan's gain against the first, measured against predicted.
Writes bench/results/schedules-<cluster stem>.json.

usage: /usr/bin/python3 bench/schedule_bench.py [--cluster examples/cluster-3dev.yaml]
           [--config examples/demo-gpt2.yaml] [--global-batch 96] [--steps 24] [--rounds 4]
           [--sets 1f1b 1f1b,eager-1f1b] [--profile P]
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import hetero_bench as hb  # noqa: E402
from tp_bench import layout  # noqa: E402


def log(msg):
    print(f"[schedules] {msg}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hb.add_fixed_plan_args(ap, "cluster-3dev.yaml", "schedules", steps=24, timed_after=3)
    ap.set_defaults(global_batch=96, rounds=4)
    ap.add_argument("--sets", nargs="+", default=["1f1b", "1f1b,eager-1f1b"],
                    help="the schedule sets to plan under (each as `alloy plan --schedules` takes it); the first is the baseline")
    a = ap.parse_args()
    if len(a.sets) < 2:
        sys.exit("--sets: give at least two schedule sets to compare")
    R = hb.fixed_plan_runner(a)
    prof = os.path.abspath(a.profile) if a.profile else R.profile()
    base = [R.alloy, "plan", "--cluster", R.cluster, "--config", R.config, "--profile", prof, "--no-compare"] + R.sets
    plans, predicted = {}, {}
    for sched in a.sets:
        out = os.path.join(R.work, f"plan-{sched.replace(',', '+')}.json")
        R.run(base + ["--schedules", sched, "-o", out])
        plans[sched] = out
        predicted[sched] = hb.predicted_of(out).get("step_s", float("nan"))
        log(f"--schedules {sched}: {layout(out)}, predicted {predicted[sched] * 1e3:.0f} ms")
    runs = {}
    for r in range(a.rounds):
        for sched in a.sets:
            log(f"round {r + 1} of {a.rounds}: training {a.steps} steps of the plan for --schedules {sched}")
            runs.setdefault(sched, []).append(R.train(f"sched-{sched.replace(',', '+')}-{r + 1}", plans[sched], a.steps))
    results = {}
    for sched in a.sets:
        results[sched], text = hb.fixed_plan_result(runs[sched], layout(plans[sched]), predicted[sched])
        log(f"--schedules {sched}: {text}")
    first = a.sets[0]
    gains = {}
    for sched in a.sets[1:]:
        gains[sched] = hb.paired_gain(runs[sched], runs[first], predicted[sched], predicted[first])
        log(f"--schedules {sched} against {first}: {hb.gain_text(gains[sched])}")
    stem = os.path.splitext(os.path.basename(a.cluster))[0].replace("cluster-", "")
    path = hb.write_fixed_plan_results(a, f"schedules-{stem}", sets=a.sets, results=results, gains=gains)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
