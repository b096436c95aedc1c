#!/usr/bin/python3
"""Pipeline boundaries inside an MLP (StagePlan::mlp_cut) measured against whole half blocks, side
by side in one invocation on an emulated pool.

On one profile of the pool (`alloy profile` under `alloy launch --emulate`):
  halves   `alloy plan --mlp-cuts off --float-boundaries off`: boundaries at whole half blocks
  cut      `alloy plan --mlp-cuts on --float-boundaries off`; where the planner keeps no cut, the
           halves plan with the one boundary cut at the k (1..heads-1) the model predicts fastest
           (`alloy plan --evaluate`), so the cut is measured either way (reported as forced)
each trained --steps with the plan fixed (no re-planning), median step after --timed-after, the two
alternating for --rounds rounds. Reports per plan the measured and predicted step, the per-device
idle share (ranks.json: not computing), and the cut's gain measured against predicted.
Writes bench/results/cut-<cluster stem>.json.

usage: /usr/bin/python3 bench/cut_bench.py [--cluster examples/cluster-2dev-pipeline.yaml]
           [--config examples/demo-gpt2.yaml] [--global-batch 48] [--micro-batch 4] [--steps 12] [--rounds 3]
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
from tp_bench import layout  # noqa: E402


def log(msg):
    print(f"[cut] {msg}", flush=True)


def cut_stage(plan):
    """(pipeline, stage) of PLAN's first cut MLP, or None."""
    for p, pl in enumerate(plan["pipelines"]):
        for s, st in enumerate(pl["stages"]):
            if st.get("mlp_cut"):
                return p, s
    return None


def forced_cuts(plan_path, heads, work):
    """Raw plans: PLAN_PATH's first multi-stage boundary moved inside the MLP half next to it, cut at
    each k = 1..HEADS-1 (as `alloy plan`'s search would try it)."""
    base = json.load(open(plan_path))
    base.pop("predicted", None)
    out = []
    for p, pl in enumerate(base["pipelines"]):
        if len(pl["stages"]) < 2:
            continue
        a, b = pl["stages"][0], pl["stages"][1]
        a_end = a["units"][1] if "units" in a else 2 * a["layers"][1]
        shared = a_end - 1 if a_end % 2 == 0 else a_end
        for k in range(1, heads):
            q = json.loads(json.dumps(base))
            qa, qb = q["pipelines"][p]["stages"][0], q["pipelines"][p]["stages"][1]
            a_begin = qa["units"][0] if "units" in qa else 2 * qa["layers"][0]
            b_end = qb["units"][1] if "units" in qb else 2 * qb["layers"][1]
            for st, (u0, u1) in ((qa, (a_begin, shared + 1)), (qb, (shared, b_end))):
                st["units"] = [u0, u1]
                st.pop("layers", None)
            qa["mlp_cut"] = k
            q["version"] = 8
            path = os.path.join(work, f"plan-cut-k{k}-raw.json")
            with open(path, "w") as f:
                json.dump(q, f, indent=1)
            out.append(path)
        break
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--cluster", default=os.path.join(REPO, "examples", "cluster-2dev-pipeline.yaml"))
    ap.add_argument("--config", default=os.path.join(REPO, "examples", "demo-gpt2.yaml"))
    ap.add_argument("--work", default=os.path.join(REPO, "runs", "cut"))
    ap.add_argument("--global-batch", type=int, default=48)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--timed-after", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both plans in turn; the median is reported")
    ap.add_argument("--profile", help="an `alloy profile` of this pool and model to use instead of profiling again")
    a = ap.parse_args()
    sets = [f"train.global_batch={a.global_batch}", f"train.micro_batch={a.micro_batch}", "train.replan_step=0"]
    R = hb.Runner(argparse.Namespace(build=a.build, cluster=a.cluster, config=a.config, work=a.work, steps=a.steps,
                                     round_steps=None, demo=False, timed_after=a.timed_after, set=sets))
    if "data/fortunes" in open(R.config).read() and not os.path.exists(os.path.join(REPO, "data", "fortunes_train.idx")):
        R.run([R.alloy, "data", "prepare", "--input", "/usr/share/games/fortunes", "--output", "data/fortunes"])
    heads = int(hb.model_of(R.config)["heads"])
    prof = os.path.abspath(a.profile) if a.profile else R.profile()
    base = [R.alloy, "plan", "--cluster", R.cluster, "--config", R.config, "--profile", prof, "--no-compare",
            "--float-boundaries", "off"] + R.sets
    plans = {}
    for name, cuts in (("halves", "off"), ("cut", "on")):
        out = os.path.join(R.work, f"plan-{name}.json")
        R.run(base + ["--mlp-cuts", cuts, "-o", out])
        plans[name] = out
    forced = cut_stage(json.load(open(plans["cut"]))) is None
    if forced:
        best = None
        for raw in forced_cuts(plans["halves"], heads, R.work):
            out = raw.replace("-raw.json", ".json")
            R.run(base + ["--evaluate", raw, "-o", out])
            pred = hb.predicted_of(out).get("step_s", float("inf"))
            if best is None or pred < best[0]:
                best = (pred, out)
        if best is None:
            sys.exit("the halves plan has no pipeline to cut")
        plans["cut"] = best[1]
    for name in ("halves", "cut"):
        log(f"{name}{' (forced: the planner keeps no cut)' if name == 'cut' and forced else ''}: {layout(plans[name])}, "
            f"predicted {hb.predicted_of(plans[name]).get('step_s', float('nan')) * 1e3:.0f} ms")
    runs = {}
    for k in range(a.rounds):
        for name in ("halves", "cut"):
            log(f"round {k + 1} of {a.rounds}: training {a.steps} steps of {name}")
            runs.setdefault(name, []).append(R.train(f"cut-{name}-{k + 1}", plans[name], a.steps))
    results = {}
    for name in ("halves", "cut"):
        rs = runs[name]
        pred = hb.predicted_of(plans[name]).get("step_s", float("nan"))
        steps = [r["step_s"] for r in rs]
        step = statistics.median(steps)
        idle = [hb.idle_shares(r) for r in rs]
        results[name] = dict(plan=layout(plans[name]), measured_step_s=step, rounds_step_s=steps, predicted_step_s=pred,
                             relative_error=(step - pred) / pred, idle_share=idle)
        log(f"{name}: measured {step * 1e3:.0f} ms/step (rounds {', '.join(f'{x * 1e3:.0f}' for x in steps)}), predicted "
            f"{pred * 1e3:.0f} ms ({100 * (step - pred) / pred:+.1f}%); idle " +
            "; ".join(", ".join(f"{d} {100 * v:.0f}%" for d, v in x.items()) for x in idle))
    # Per round, both plans measured back to back: the cut's gain in that round.
    gains = [h["step_s"] / c["step_s"] - 1 for h, c in zip(runs["halves"], runs["cut"])]
    predicted_gain = results["halves"]["predicted_step_s"] / results["cut"]["predicted_step_s"] - 1
    log(f"the cut against half blocks: {', '.join(f'{100 * g:+.1f}%' for g in gains)} faster per round (median "
        f"{100 * statistics.median(gains):+.1f}%), predicted {100 * predicted_gain:+.1f}%")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
    stem = os.path.splitext(os.path.basename(a.cluster))[0].replace("cluster-", "")
    path = os.path.join(HERE, "results", f"cut-{stem}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(machine=dict(cpu=cpu, cores=os.cpu_count()), cluster=os.path.relpath(a.cluster, REPO),
                       config=os.path.relpath(a.config, REPO), global_batch=a.global_batch, steps=a.steps, rounds=a.rounds,
                       forced=forced, results=results, gain_per_round=gains, gain_median=statistics.median(gains),
                       gain_predicted=predicted_gain), f, indent=2)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
