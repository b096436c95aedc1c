#!/usr/bin/python3
"""Heterogeneous pool on an emulated cluster: profile, plan, train, and compare.

Every figure is measured side by side in one invocation on the same emulated pool
(`alloy launch --emulate`: one network namespace per host, tc-limited links, a CPU quota per
device):
  1. efficiency: tokens/s of the pool under Alloy's plan / the sum of each device's tokens/s training
     on its own, (a) all devices at once side by side (the machine's memory bandwidth shared as in
     the pool) and (b) each alone on an idle machine; pool and (a) alternate over --rounds (3):
     the median round and the worst are reported, each round's pool against its own (a)
  2. plans: Alloy's plan vs `uniform` vs `proportional` vs PyTorch DDP with equal per-rank batches
  3. predictions: predicted vs measured step time (and per-stage compute) for each Alloy-run plan;
     Alloy's prediction is the one made from the last calibration of its run (the re-plan that
     measured every device's speed), said as such, with the profile's own beside it; every round
     is such a run (--plan auto), so each round's step is set against its own calibration
Writes bench/results/hetero.json, hetero.png (throughput) and hetero-predictions.png (gnuplot).

  --demo   the README's main job: profile, plan (diagram), each device alone, train the plan with
           a progress display, and a short report. No baselines.

  --set KEY=VALUE  a config override for every Alloy plan and run (repeatable), e.g.
           --set grad_sync.compression=dgc --set grad_sync.scope=slow-links: compression across the
           slow links, which the planner then prices (bench/README: the two-region pool). A lossy
           run syncs its first grad_sync.dense_steps exactly: time it past them with --timed-after
           (e.g. --steps 40 --timed-after 22 --set grad_sync.warmup_steps=0)

usage: /usr/bin/python3 bench/hetero_bench.py [--build build] [--cluster examples/cluster-3dev.yaml]
           [--config examples/demo-gpt2.yaml] [--steps N] [--timed-after N] [--rounds N] [--out NAME] [--demo]
           [--set K=V ...]
"""
import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import plot  # noqa: E402

# These runs read Alloy's info lines; a log level the caller exported would hide them.
os.environ.pop("ALLOY_LOG_LEVEL", None)


_START = time.time()


def log(msg):
    # The minutes so far: the demo must stay under 10, and a user watching it wants to know where it is.
    t = int(time.time() - _START)
    print(f"[hetero {t // 60}:{t % 60:02d}] {msg}", flush=True)


def read_metrics(out, timed_after=2):
    """A run's metrics.jsonl rows, and the rows after the first TIMED_AFTER (warm-up; the exact steps
    of a lossy run) when there are enough. After a re-plan (a row marked "replanned"), only the steps
    of the final plan after its first (and after TIMED_AFTER)."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    switch = [i for i, r in enumerate(rows) if r.get("replanned")]
    if switch and len(rows) - max(switch[-1] + 2, timed_after) > 1:
        return rows, rows[max(switch[-1] + 2, timed_after):]
    return rows, (rows[timed_after:] if len(rows) > timed_after + 2 else rows)


class Runner:
    def __init__(self, a):
        self.alloy = os.path.abspath(os.path.join(a.build, "alloy"))
        self.cluster = os.path.abspath(a.cluster)
        self.config = os.path.abspath(a.config)
        self.work = os.path.abspath(a.work)
        self.steps = a.steps
        # The side-by-side runs and the rounds after the first (each --plan auto, calibrating after
        # train.replan_step): timed steps enough for a median, fewer than the first round's in the demo
        # (10 minutes).
        # Never shorter than the untimed steps plus eight timed ones: a lossy run's first
        # grad_sync.dense_steps are exact (--timed-after passes them), and a round that ended before
        # its timed window was timed over those exact steps (a demo of 40 steps with --timed-after 22
        # ran its later rounds for 20 and reported them 70% slower than predicted).
        self.round_steps = a.round_steps or (max(20, a.steps // 2, a.timed_after + 8) if a.demo else a.steps)
        if self.round_steps < a.timed_after + 3:
            raise SystemExit(f"--round-steps {self.round_steps}: a round must run past --timed-after {a.timed_after} "
                             "to have steps to time")
        self.alone_steps = 6 if a.demo else max(6, a.steps // 4)
        self.timed_after = a.timed_after
        # Runs of one device on its own train batches of at most 48: a device's tokens/s does not depend
        # on the global batch beyond its optimizer step (0.2-0.3% of a 48-sample step here), and a larger batch
        # would make the slow devices' runs minutes longer.
        self.single_batch = min(48, model_of(self.config).get("global_batch", 48))
        self.micro_batch = model_of(self.config).get("micro_batch", 0) or self.single_batch
        self.sets = [x for kv in (a.set or []) for x in ("--set", kv)]
        os.makedirs(self.work, exist_ok=True)

    def run(self, cmd, show=False, check=True):
        if show:
            r = subprocess.run(cmd, cwd=REPO)
        else:
            r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if check and r.returncode != 0:
            sys.exit(f"command failed ({r.returncode}): {' '.join(cmd)}\n{'' if show else r.stdout[-2000:] + r.stderr[-4000:]}")
        return r

    def launch(self, cluster, cmd, show=False):
        return self.run([self.alloy, "launch", "--emulate", cluster, "--"] + cmd, show=show)

    def profile(self):
        out = os.path.join(self.work, "profile.json")
        log("profiling every device and link of the emulated pool")
        self.launch(self.cluster, [self.alloy, "profile", "--cluster", self.cluster, "--config", self.config, "-o", out])
        return out

    def plan(self, strategy, profile, diagram=None, show=False):
        out = os.path.join(self.work, f"plan-{strategy}.json")
        cmd = [self.alloy, "plan", "--cluster", self.cluster, "--config", self.config, "--profile", profile,
               "--strategy", strategy, "-o", out] + self.sets
        if diagram:
            cmd += ["--diagram", diagram]
        if not show:
            cmd.append("--no-compare")
        self.run(cmd, show=show)
        return out

    def train(self, name, plan, steps, show=False, cluster=None, extra=()):
        out = os.path.join(self.work, "runs", name)
        shutil.rmtree(out, ignore_errors=True)
        cmd = [self.alloy, "train", "--config", self.config, "--set", f"output.dir={out}",
               "--set", f"train.steps={steps}", "--set", "train.checkpoint_interval=0"] + self.sets + list(extra)
        if plan:
            cmd += ["--plan", plan]
        self.launch(cluster or self.cluster, cmd, show=show)
        rows, warm = read_metrics(out, self.timed_after)
        if any(r.get("loss") is None for r in warm):
            raise SystemExit(f"{name}: the loss became NaN (see {out}/metrics.jsonl); its step times would not count")
        ranks = json.load(open(os.path.join(out, "ranks.json"))) if os.path.exists(os.path.join(out, "ranks.json")) else []
        step = statistics.median(r["step_s"] for r in warm if "val_loss" not in r) if warm else float("nan")
        replan = os.path.join(out, "replan.json")
        return dict(rows=rows, ranks=ranks, step_s=step, timed_after=self.timed_after,
                    timed_steps=[r["step"] for r in warm if "val_loss" not in r], tokens_per_s=statistics.median(r["tokens_per_s"] for r in warm),
                    out=out, replan=json.load(open(replan)) if os.path.exists(replan) else None)

    def train_auto(self, name, profile, steps, show=False):
        """Alloy as a user runs it: --plan auto on the profile (the same plan `alloy plan` printed), which
        re-plans after train.replan_step from the compute each rank measured."""
        return self.train(name, "auto", steps, show=show, extra=["--profile", profile])


    def batch_of(self, device, devices):
        """A device's global batch when it trains on its own: the fastest's single_batch, the others' in
        proportion to their speed (whole micro-batches, at least one), so every device's step takes about
        as long and each run times as many steps. A step's optimizer update is 0.2-0.3% of a 48-sample step
        here, about 1% of a 12-sample one: the slow devices' rates come out that much lower, not higher."""
        maxs = max(float(d["speed"]) for d in devices)
        mbs = min(self.micro_batch, self.single_batch)
        return max(mbs, mbs * round(self.single_batch * float(device["speed"]) / maxs / mbs))

    def alone(self, devices):
        res = {}
        for i, d in enumerate(devices):
            path = os.path.join(self.work, f"alone-{d['name']}.yaml")
            with open(path, "w") as f:
                f.write(f"name: alone-{d['name']}\ndevices:\n  - {{name: {d['name']}, host: {d['host']}, kind: {d['kind']}, "
                        f"type: {d['type']}, memory_gb: {d['memory_gb']}, speed: {d['speed']}}}\n")
            r = self.train(f"alone-{d['name']}", None, self.alone_steps, cluster=path,
                           extra=["--set", f"train.global_batch={self.batch_of(d, devices)}"])
            res[d["name"]] = r["tokens_per_s"]
            log(f"{d['name']} alone (speed {d['speed']}): {r['tokens_per_s']:.0f} tokens/s")
        return res

    def side_by_side(self, devices):
        """Every device trains the model on its own (no communication, its own output) at the same time, on
        the pool's emulated devices: what the pool's hardware gives when nothing is shared but the
        machine. Batches are proportional to speed (batch_of), so all run as many steps in about the same time."""
        cases, outs = [], {}
        for d in devices:
            out = os.path.join(self.work, "runs", f"side-{d['name']}")
            shutil.rmtree(out, ignore_errors=True)
            outs[d["name"]] = out
            cases.append(f"{shlex.quote(d['name'])}) batch={self.batch_of(d, devices)}; out={shlex.quote(out)};;")
        script = ("unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT; "
                  f"case \"$ALLOY_EMU_DEVICE\" in {' '.join(cases)} *) exit 3;; esac; "
                  f"exec {shlex.quote(self.alloy)} train --config {shlex.quote(self.config)} --set \"output.dir=$out\" "
                  f"--set train.steps={self.round_steps} --set \"train.global_batch=$batch\" --set train.checkpoint_interval=0")
        log("every device training on its own, all at the same time")
        self.launch(self.cluster, ["/bin/sh", "-c", script])
        res = {}
        for name, out in outs.items():
            _, warm = read_metrics(out)
            res[name] = statistics.median(r["tokens_per_s"] for r in warm)
            log(f"{name} on its own beside the others: {res[name]:.0f} tokens/s")
        return res

    def ddp(self, ndev, model, gb):
        per = gb // ndev
        log(f"PyTorch DDP, equal batches of {per} per rank")
        cmd = ["/usr/bin/python3", os.path.join(HERE, "ddp_train_step.py"), "--layers", str(model["layers"]),
               "--hidden", str(model["hidden"]), "--heads", str(model["heads"]), "--seq-len", str(model["seq_len"]),
               "--vocab", str(model["vocab_size"]), "--batch", str(per), "--steps", str(max(6, self.steps // 3)),
               "--warmup", "2", "--threads", "1"]
        r = self.launch(self.cluster, cmd)
        line = [l for l in (r.stdout + r.stderr).splitlines() if '"pytorch-ddp"' in l][-1]
        j = json.loads(line[line.index("{"):])
        return dict(step_s=j["step_s_median"], tokens_per_s=per * ndev * model["seq_len"] / j["step_s_median"])


def cluster_devices(alloy, cluster):
    """Device list via the planner's own reader (alloy plan prints nothing machine-readable, so parse minimal YAML)."""
    devs = []
    for line in open(cluster):
        s = line.strip()
        if s.startswith("- {") and "name:" in s:
            body = s[3:s.rindex("}")]
            d = {}
            for part in body.split(","):
                k, v = part.split(":", 1)
                d[k.strip()] = v.strip()
            devs.append(d)
    return devs


def add_fixed_plan_args(ap, cluster, work, steps, timed_after):
    """The arguments of a bench that trains fixed plans on one emulated pool in rounds (tp_bench,
    cut_bench)."""
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--cluster", default=os.path.join(REPO, "examples", cluster))
    ap.add_argument("--config", default=os.path.join(REPO, "examples", "demo-gpt2.yaml"))
    ap.add_argument("--work", default=os.path.join(REPO, "runs", work))
    ap.add_argument("--global-batch", type=int, default=48)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--timed-after", type=int, default=timed_after)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every plan in turn; the median is reported")
    ap.add_argument("--profile", help="an `alloy profile` of this pool and model to use instead of profiling again "
                    "(for a second invocation at another global batch)")


def fixed_plan_runner(a):
    """A Runner for add_fixed_plan_args' A: the global and micro-batch set, no re-planning; the
    fortunes corpus prepared when the config reads it and it is missing."""
    sets = [f"train.global_batch={a.global_batch}", f"train.micro_batch={a.micro_batch}", "train.replan_step=0"]
    R = Runner(argparse.Namespace(build=a.build, cluster=a.cluster, config=a.config, work=a.work, steps=a.steps,
                                  round_steps=None, demo=False, timed_after=a.timed_after, set=sets))
    if "data/fortunes" in open(R.config).read() and not os.path.exists(os.path.join(REPO, "data", "fortunes_train.idx")):
        R.run([R.alloy, "data", "prepare", "--input", "/usr/share/games/fortunes", "--output", "data/fortunes"])
    return R


def write_fixed_plan_results(a, name, **fields):
    """Writes bench/results/NAME.json for a bench of add_fixed_plan_args' A: the machine, the pool,
    the model and the run's shape, then FIELDS. Returns the path."""
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
    path = os.path.join(HERE, "results", name + ".json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(machine=dict(cpu=cpu, cores=os.cpu_count()), cluster=os.path.relpath(a.cluster, REPO),
                       config=os.path.relpath(a.config, REPO), global_batch=a.global_batch, steps=a.steps, rounds=a.rounds,
                       **fields), f, indent=2)
    return path


def train_in_rounds(R, a, keys, plans, name_of, prefix, log):
    """Trains PLANS[key] for every key of KEYS in turn, A.rounds times (A: add_fixed_plan_args'),
    each run --steps; returns each key's runs (Runner.train's results) in round order. Runs are
    named PREFIX-NAME_OF(key)-ROUND."""
    runs = {}
    for r in range(a.rounds):
        for key in keys:
            log(f"round {r + 1} of {a.rounds}: training {a.steps} steps of {name_of(key)}")
            runs.setdefault(key, []).append(R.train(f"{prefix}-{name_of(key)}-{r + 1}", plans[key], a.steps))
    return runs


def fixed_plan_result(runs, plan_text, predicted):
    """The figures of one plan trained in rounds (RUNS: Runner.train's results): median and per-round
    step, prediction and its error, idle shares per round; and the line that reports them."""
    steps = [x["step_s"] for x in runs]
    step = statistics.median(steps)
    idle = [idle_shares(x) for x in runs]
    text = (f"measured {step * 1e3:.0f} ms/step (rounds {', '.join(f'{x * 1e3:.0f}' for x in steps)}), predicted "
            f"{predicted * 1e3:.0f} ms ({100 * (step - predicted) / predicted:+.1f}%); idle " +
            "; ".join(", ".join(f"{d} {100 * v:.0f}%" for d, v in x.items()) for x in idle))
    return dict(plan=plan_text, measured_step_s=step, rounds_step_s=steps, predicted_step_s=predicted,
                relative_error=(step - predicted) / predicted, idle_share=idle), text


def paired_gain(runs_a, runs_b, predicted_a, predicted_b):
    """How much faster plan A ran than plan B in each round (both trained back to back), their
    median, and the gain predicted."""
    g = [b["step_s"] / x["step_s"] - 1 for x, b in zip(runs_a, runs_b)]
    return dict(per_round=g, median=statistics.median(g), predicted=predicted_b / predicted_a - 1)


def gain_text(g):
    return (f"{', '.join(f'{100 * x:+.1f}%' for x in g['per_round'])} faster per round (median {100 * g['median']:+.1f}%), "
            f"predicted {100 * g['predicted']:+.1f}%")


def model_of(config):
    m = {}
    sec = None
    for line in open(config):
        if not line.strip() or line.strip().startswith("#"):
            continue
        if not line.startswith(" "):
            sec = line.split(":")[0].strip()
            continue
        if sec == "model":
            k, v = line.strip().split(":", 1)
            m[k.strip()] = int(v.strip()) if v.strip().isdigit() else v.strip()
        for key in ("global_batch", "micro_batch"):
            if sec == "train" and line.strip().startswith(key + ":"):
                m[key] = int(line.split(":")[1])
    return m


def predicted_of(plan_path):
    return json.load(open(plan_path)).get("predicted", {})


def latest_prediction(plan_path, run):
    """The step predicted for the plan that ran the measured steps, from the latest figures the run
    had: the last re-plan's calibration when there was one (it measured every device type's speed;
    a switched plan or split was predicted with those speeds, a kept plan re-predicted with them),
    else the profile's. Returns (seconds, what it is from, the profile's own prediction)."""
    events = (run.get("replan") or {}).get("replans", [])
    profile_s = predicted_of(plan_path).get("step_s", float("nan"))
    if not events:
        return profile_s, "the profile", profile_s
    e = events[-1]
    if "reverted_to" in e:  # went back to a plan measured faster: its own calibration predicted it
        b = e["reverted_to"]
        return b["calibrated_s"], f"the calibration after step {b['calibrated_after_step']}, the plan gone back to", \
            predicted_of(plan_path).get("step_s", float("nan"))
    if any(x["switched"] or x.get("rebalance", {}).get("switched") for x in events):
        first = predicted_of(plan_path).get("step_s", float("nan"))
        if not (e["switched"] or e.get("rebalance", {}).get("switched")):
            return e["running_plan_calibrated_s"], f"the last calibration (step {e['step']})", first
        return predicted_of(os.path.join(run["out"], "plan.json")).get("step_s", float("nan")), \
            f"the re-plan at step {e['step']} (calibrated)", first
    return e["running_plan_calibrated_s"], f"the last calibration (step {e['step']})", profile_s


def report_predictions(name, plan_path, run):
    """Predicted vs measured for the plan that ran the measured steps, the prediction taken from the
    latest calibration the run made (latest_prediction); the profile's prediction of the first
    plan and every calibration are kept beside it."""
    events = (run.get("replan") or {}).get("replans", [])
    own = os.path.join(run["out"], "plan.json")  # the plan the measured steps ran, per stage
    pred = predicted_of(own if os.path.exists(own) else plan_path)
    ps, source, profile_s = latest_prediction(plan_path, run)
    err = (run["step_s"] - ps) / ps if ps else float("nan")
    log(f"{name}: predicted {ps * 1e3:.0f} ms/step (from {source}), measured {run['step_s'] * 1e3:.0f} ms/step ({100 * err:+.1f}%)")
    extra = dict(prediction_from=source, profile_predicted_step_s=profile_s,
                 profile_relative_error=(run["step_s"] - profile_s) / profile_s if profile_s else float("nan"))
    if events:
        extra.update(replans=[dict(step=e["step"], switched=e["switched"], factors=e["factors"],
                                   **({"reverted_to": e["reverted_to"]} if "reverted_to" in e else {}),
                                   running_plan_predicted_s=e["running_plan_predicted_s"],
                                   running_plan_calibrated_s=e["running_plan_calibrated_s"],
                                   best_calibrated_s=e["best_calibrated_s"],
                                   **({"rebalance": e["rebalance"]} if "rebalance" in e else {})) for e in events])
        for e in events:
            log(f"{name}: after step {e['step']} measured/predicted compute per device type: " +
                ", ".join(f"{t} x{f:.2f}" for t, f in e["factors"].items()) +
                (f"; measured {e['measured_step_s'] * 1e3:.0f} ms per step, slower than the "
                 f"{e['reverted_to']['measured_step_s'] * 1e3:.0f} ms of the plan run up to step "
                 f"{e['reverted_to']['calibrated_after_step']}: went back to it" if "reverted_to" in e else
                 f"; switched plans (the running plan {e['running_plan_calibrated_s'] * 1e3:.0f} ms calibrated, "
                 f"{e['running_plan_predicted_s'] * 1e3:.0f} ms predicted before; the new one "
                 f"{e['best_calibrated_s'] * 1e3:.0f} ms)" if e["switched"] else "; kept the plan"))
            if "rebalance" in e:
                b = e["rebalance"]
                log(f"{name}: batch split after step {e['step']}: pipelines measured/predicted " +
                    ", ".join(f"x{f:.2f}" for f in b["pipeline_factors"]) +
                    f"; running split {b['running_split_s'] * 1e3:.0f} ms, best {b['best_split_s'] * 1e3:.0f} ms" +
                    ("; rebalanced" if b["switched"] else ""))
    stages = []
    by_rank = {r["rank"]: r for r in run["ranks"]}
    for s in pred.get("per_stage", []):
        m = by_rank.get(s["rank"], {})
        compute, wait = m.get("compute_s_median"), m.get("sync_wait_s_median")
        steps = timed_rank_steps(run, m)
        if steps:  # the timed steps only (a lossy run's exact steps left out)
            compute = statistics.median(x[1] for x in steps)
            wait = statistics.median(x[2] for x in steps)
        stages.append(dict(rank=s["rank"], device=s["device"], predicted_compute_s=s["forward_s"] + s["backward_s"],
                           measured_compute_s=compute, predicted_sync_exposed_s=s["sync_exposed_s"],
                           measured_sync_wait_s=wait))
    return dict(predicted_step_s=ps, measured_step_s=run["step_s"], relative_error=err, stages=stages, **extra)


def timed_rank_steps(run, rank):
    """RANK's (ranks.json entry of RUN) per-step (step, compute, sync wait) seconds over RUN's timed
    steps, or [] when they cannot be told. ranks.json lists the steps of the run's last plan, up to
    its last step; the timed ones are those the step time is taken over (Runner.train)."""
    steps = rank.get("steps_step_compute_syncwait_s") or []
    timed = set(run.get("timed_steps", []))
    if not steps or not timed or not run.get("rows"):
        return []
    first = run["rows"][-1]["step"] - len(steps) + 1  # the step of steps[0]
    picked = [x for i, x in enumerate(steps) if first + i in timed]
    return picked if len(picked) >= 3 else []


def idle_shares(run):
    """Per device of RUN's plan: the share of its median step it did not compute (bubbles, waits
    for messages and for the gradient sync), over the timed steps (ranks.json's medians, which
    take every step after the first, when those cannot be told). A lossy run's exact first steps
    wait on dense sums: counted, they made the later rounds of a DGC demo read 43-46% idle."""
    try:
        plan = json.load(open(os.path.join(run["out"], "plan.json")))
    except (OSError, ValueError):
        return {}
    device = {r: st.get("device", f"rank {r}") for pl in plan["pipelines"] for st in pl["stages"] for r in st["ranks"]}
    out = {}
    for x in run.get("ranks", []):
        steps = timed_rank_steps(run, x)
        step = statistics.median(s[0] for s in steps) if steps else x.get("step_s_median")
        compute = statistics.median(s[1] for s in steps) if steps else x.get("compute_s_median")
        if step:
            out[device.get(x["rank"], f"rank {x['rank']}")] = 1 - compute / step
    return out


def round_figures(runs, sides, predicted):
    """Per round (the pool's run and the devices side by side right before it): the pool's share of
    the side-by-side sum, the plan its measured steps ran, and its step against that run's own
    prediction (PREDICTED: (seconds, where from) per run, latest_prediction's); the median round and
    the worst."""
    rounds = []
    for r, sd, (p, source) in zip(runs, sides, predicted):
        total = sum(sd.values())
        ran = os.path.join(r["out"], "plan.json")
        rounds.append(dict(tokens_per_s=r["tokens_per_s"], side_by_side_sum=total, efficiency=r["tokens_per_s"] / total,
                           plan=plan_layout(ran) if os.path.exists(ran) else None,
                           step_s=r["step_s"], predicted_s=p, prediction_from=source, relative_error=(r["step_s"] - p) / p,
                           idle_share=idle_shares(r)))
    eff = [x["efficiency"] for x in rounds]
    err = [x["relative_error"] for x in rounds]
    return dict(rounds=rounds, efficiency_median=statistics.median(eff), efficiency_worst=min(eff),
                relative_error_median=statistics.median(err), relative_error_worst=max(err, key=abs))


def plan_layout(path):
    """One line per pipeline of a plan file: its stages (device, blocks) and samples, for the JSON."""
    plan = json.load(open(path))
    return [" -> ".join(f"{st.get('device', 'rank %d' % st['ranks'][0])} [{st['layers'][0]},{st['layers'][1]})"
                        for st in pl["stages"]) + f": {pl['micro_batch_size']} x {pl['num_micro_batches']}" + (f" (the last of {pl['last_micro_batch_size']})" if pl.get('last_micro_batch_size') else "")
            for pl in plan["pipelines"]]


def plot_throughput(results, path):
    plot.bars(path, "Emulated heterogeneous pool: training throughput", "tokens/s", [r["name"] for r in results],
              {"tokens/s": [r["tokens_per_s"] for r in results]})


def plot_predictions(results, path):
    """Predicted vs measured: whole step per plan, then each rank's compute per plan."""
    cats, pred, meas = [], [], []
    for r in results:
        p = r.get("prediction")
        if not p:
            continue
        cats.append(f"{r['name']} step")
        pred.append(1e3 * p["predicted_step_s"])
        meas.append(1e3 * p["measured_step_s"])
        for s in p["stages"]:
            if s["measured_compute_s"] is None:
                continue
            cats.append(f"{r['name']} {s['device']}")
            pred.append(1e3 * s["predicted_compute_s"])
            meas.append(1e3 * s["measured_compute_s"])
    plot.bars(path, "Predicted vs measured: step time per plan, compute per rank (ms)", "ms", cats,
              {"predicted": pred, "measured": meas})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--cluster", default=os.path.join(REPO, "examples", "cluster-3dev.yaml"))
    ap.add_argument("--config", default=os.path.join(REPO, "examples", "demo-gpt2.yaml"))
    ap.add_argument("--work", default=os.path.join(REPO, "runs", "hetero"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--timed-after", type=int, default=2,
                    help="time the steps after this one (a lossy run: past grad_sync.dense_steps, whose steps sync exactly)")
    ap.add_argument("--demo", action="store_true")
    ap.add_argument("--round-steps", type=int, default=None,
                    help="steps of the rounds after the first and of the side-by-side runs (default --steps; "
                         "with --demo half of it, at least 20)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds of the devices side by side, then Alloy's plan on the pool; the median round and the "
                         "worst are reported (default 3)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="config override for every Alloy plan and run, e.g. grad_sync.compression=dgc (repeatable)")
    ap.add_argument("--out", default=None,
                    help="name of the result files in bench/results (default: hetero for the 3-device pool, "
                         "hetero-<cluster file's stem> for another cluster)")
    a = ap.parse_args()
    if a.rounds is None:
        a.rounds = 3
    if a.out is None:
        stem = os.path.splitext(os.path.basename(a.cluster))[0]
        a.out = "hetero" if stem == "cluster-3dev" else "hetero-" + stem
    R = Runner(a)
    if os.path.abspath(a.config) == os.path.join(REPO, "examples", "demo-gpt2.yaml") and not os.path.exists(
            os.path.join(REPO, "data", "fortunes_train.idx")):
        log("preparing the fortunes corpus (data/fortunes), as scripts/demo.sh does")
        R.run([R.alloy, "data", "prepare", "--input", "/usr/share/games/fortunes", "--output", "data/fortunes"])
    devices = cluster_devices(R.alloy, R.cluster)
    model = model_of(R.config)
    subprocess.run([R.alloy, "emu", "clean"], capture_output=True)
    t0 = time.time()
    prof = R.profile()
    diagram = os.path.join(R.work, "plan.svg")
    log("planning (Alloy's plan, with the baselines' predictions for comparison)")
    R.plan("alloy", prof, diagram=diagram, show=True)
    R.run([R.alloy, "plan", "--cluster", R.cluster, "--config", R.config, "--profile", prof, "--no-compare",
           "-o", os.path.join(R.work, "plan-alloy-copy.json"), "--diagram", os.path.join(R.work, "plan.png")] + R.sets)
    log(f"diagram: {diagram} and {os.path.join(R.work, 'plan.png')}")
    alone = R.alone(devices)
    side = R.side_by_side(devices)
    extra_rounds = []  # (alloy run, side-by-side) pairs after the first, to average out the VM's slow spells
    log(f"training {a.steps} steps with Alloy's plan on the emulated pool")
    main_run = R.train_auto("alloy", prof, a.steps, show=a.demo)
    final_plan = os.path.join(R.work, "plan-alloy-final.json")  # the plan the measured steps ran
    shutil.copyfile(os.path.join(main_run["out"], "plan.json"), final_plan)
    if any(e["switched"] for e in (main_run["replan"] or {}).get("replans", [])):
        R.run([R.alloy, "plan", "--cluster", R.cluster, "--config", R.config, "--profile", prof, "--no-compare",
               "--evaluate", final_plan, "--diagram", os.path.join(R.work, "plan-final.svg")] + R.sets)
        R.run([R.alloy, "plan", "--cluster", R.cluster, "--config", R.config, "--profile", prof, "--no-compare",
               "--evaluate", final_plan, "--diagram", os.path.join(R.work, "plan-final.png")] + R.sets)
        log(f"the plan after re-planning: {os.path.join(R.work, 'plan-final.svg')} and .png")
    for k in range(1, a.rounds):
        # Each round is a run as a user starts it (--plan auto on the same profile, calibrating after
        # train.replan_step), so each round's step is set against its own calibration: the VM's speed
        # moves by 5-10% between rounds (the side-by-side sums show it), and a prediction calibrated in
        # round 1 measured that drift, not the cost model (fresh clones: -10.3% and -11.2% in later rounds
        # whose side-by-side runs were 8% faster than round 1's).
        log(f"round {k + 1} of {a.rounds}: the pool (--plan auto again) and the devices side by side again")
        extra_rounds.append((R.train_auto(f"alloy-{k + 1}", prof, R.round_steps), R.side_by_side(devices)))
    round_tps = [main_run["tokens_per_s"]] + [r["tokens_per_s"] for r, _ in extra_rounds]
    runs = [main_run] + [r for r, _ in extra_rounds]
    sides = [side] + [sd for _, sd in extra_rounds]
    first_run = main_run
    predicted = [latest_prediction(os.path.join(R.work, "plan-alloy.json"), r)[:2] for r in runs]
    by_round = round_figures(runs, sides, predicted)
    if extra_rounds:
        main_run = dict(main_run, tokens_per_s=statistics.median(r["tokens_per_s"] for r in runs),
                        step_s=statistics.median(r["step_s"] for r in runs))
        side = {n: statistics.median(sd[n] for sd in sides) for n in side}
        if len({json.dumps(x["plan"]) for x in by_round["rounds"]}) > 1:
            log("the rounds' re-plans ran different plans (each round's is in the JSON's by_round)")
        log("per round: " + "; ".join(f"pool {x['tokens_per_s']:.0f} tokens/s of {x['side_by_side_sum']:.0f} side by side "
                                      f"({x['efficiency']:.2f}), step {x['step_s'] * 1e3:.0f} ms ({100 * x['relative_error']:+.1f}%)"
                                      for x in by_round["rounds"]))
    results = [dict(name="alloy", tokens_per_s=main_run["tokens_per_s"], step_s=main_run["step_s"],
                    plan=plan_layout(final_plan),  # round 1's; every round's in by_round
                    rounds_tokens_per_s=round_tps, by_round=by_round,
                    prediction=report_predictions("alloy plan", os.path.join(R.work, "plan-alloy.json"),
                                                  dict(first_run, step_s=by_round["rounds"][0]["step_s"])))]
    if not a.demo:
        calibrated = os.path.join(runs[-1]["out"], "profile-calibrated.json")  # the round nearest in time
        for strategy in ("uniform", "proportional"):
            p = R.plan(strategy, prof)
            run = R.train(strategy, p, a.steps)
            pred = report_predictions(f"{strategy} plan", p, run)
            if os.path.exists(calibrated):
                # The same plan predicted with the speeds Alloy's run measured (under another layout):
                # the cost model's error once the profile's own error is taken out.
                ev = os.path.join(R.work, f"plan-{strategy}-calibrated.json")
                R.run([R.alloy, "plan", "--cluster", R.cluster, "--config", R.config, "--profile", calibrated,
                       "--no-compare", "--evaluate", p, "-o", ev] + R.sets)
                cs = predicted_of(ev)["step_s"]
                pred.update(calibrated_predicted_step_s=cs, calibrated_relative_error=(run["step_s"] - cs) / cs)
                log(f"{strategy} plan with the speeds measured in Alloy's run: predicted {cs * 1e3:.0f} ms/step "
                    f"({100 * pred['calibrated_relative_error']:+.1f}%)")
            results.append(dict(name=strategy, tokens_per_s=run["tokens_per_s"], step_s=run["step_s"], prediction=pred))
        d = R.ddp(len(devices), model, model.get("global_batch", 16))
        results.append(dict(name="pytorch-ddp-equal", tokens_per_s=d["tokens_per_s"], step_s=d["step_s"]))
    total_alone = sum(alone.values())
    total_side = sum(side.values())
    eff = main_run["tokens_per_s"] / total_alone
    # The median round's ratio (each round's pool against the side-by-side run beside it in time).
    eff_side = results[0]["by_round"]["efficiency_median"]
    print()
    print("=" * 72)
    rows = main_run["rows"]
    vals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    print(f"loss: {rows[0]['loss']:.3f} at step 1 -> {rows[-1]['loss']:.3f} at step {rows[-1]['step']}"
          + (f"; validation {vals[0][1]:.3f} (step {vals[0][0]}) -> {vals[-1][1]:.3f} (step {vals[-1][0]})" if vals else ""))
    print("throughput (tokens/s):")
    for name, tps in alone.items():
        print(f"  {name:<18} alone {tps:9.0f}   beside the others {side[name]:9.0f}")
    print(f"  {'sum of the devices':<18}       {total_alone:9.0f}                     {total_side:9.0f}")
    for r in results:
        print(f"  pool, {r['name']:<12} {r['tokens_per_s']:9.0f}   ({100 * r['tokens_per_s'] / total_side:.0f}% of the sum beside, "
              f"{100 * r['tokens_per_s'] / total_alone:.0f}% of the sum alone"
              + (f", {r['tokens_per_s'] / results[-1]['tokens_per_s']:.2f}x DDP" if not a.demo and r is not results[-1] else "") + ")")
    print(f"heterogeneous efficiency, pool / sum of the devices each training on its own beside the others: {eff_side:.2f}"
          + (" (median round)" if len(results[0]["by_round"]["rounds"]) > 1 else ""))
    print(f"                          pool / sum of the devices each alone on an idle machine:           {eff:.2f}")
    print("  (the first is what a scheduler can reach here: the pool's devices share this machine's memory")
    print("   bandwidth as separate machines would not; the second counts that against Alloy too)")
    br = results[0]["by_round"]
    if len(br["rounds"]) > 1:
        print(f"rounds ({len(br['rounds'])}, the pool's run and the devices side by side alternating): pool / side-by-side sum "
              + ", ".join(f"{x['efficiency']:.2f}" for x in br["rounds"])
              + f"; median {br['efficiency_median']:.2f}, worst {br['efficiency_worst']:.2f}")
        print("  each device's idle share of its step (not computing), per round: "
              + "; ".join(", ".join(f"{d} {100 * v:.0f}%" for d, v in x["idle_share"].items()) for x in br["rounds"]))
        sources = sorted({x["prediction_from"] for x in br["rounds"]})
        print(f"  step against each round's own prediction (from {' / '.join(sources)}): "
              + ", ".join(f"{100 * x['relative_error']:+.1f}%" for x in br["rounds"])
              + f"; median {100 * br['relative_error_median']:+.1f}%, worst {100 * br['relative_error_worst']:+.1f}%")
    for r in results:
        if "prediction" in r:
            p = r["prediction"]
            print(f"predicted vs measured step, {r['name']}"
                  + (" (first round)" if r is results[0] and len(br["rounds"]) > 1 else "")
                  + f": {p['predicted_step_s'] * 1e3:.0f} ms (from {p['prediction_from']}) vs "
                  f"{p['measured_step_s'] * 1e3:.0f} ms ({100 * p['relative_error']:+.1f}%)"
                  + (f"; the profile's own prediction {p['profile_predicted_step_s'] * 1e3:.0f} ms "
                     f"({100 * p['profile_relative_error']:+.1f}%)" if p.get("prediction_from") != "the profile" else "")
                  + (f"; with the speeds Alloy's run measured: {p['calibrated_predicted_step_s'] * 1e3:.0f} ms "
                     f"({100 * p['calibrated_relative_error']:+.1f}%)" if "calibrated_predicted_step_s" in p else ""))
    print(f"(all measured in this run, {time.time() - t0:.0f} s, on {platform.node()}, {os.cpu_count()} cores)")
    out = dict(benchmark="hetero", when=time.strftime("%Y-%m-%d %H:%M:%S"), cluster=os.path.relpath(R.cluster, REPO),
               config_overrides=a.set or [],
               config=os.path.relpath(R.config, REPO), machine=f"{platform.node()} {os.cpu_count()} cores",
               alone_tokens_per_s=alone, side_by_side_tokens_per_s=side, single_device_global_batch={d["name"]: R.batch_of(d, devices) for d in devices}, efficiency=eff_side, efficiency_vs_idle_alone=eff,
               efficiency_median_round=br["efficiency_median"], efficiency_worst_round=br["efficiency_worst"],
               prediction_error_median_round=br["relative_error_median"], prediction_error_worst_round=br["relative_error_worst"],
               results=results)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    # hetero-demo.json for the 3-device pool; another cluster's demo beside its benchmark's file,
    # not over the 3-device one.
    name = a.out + "-demo.json" if a.demo else a.out + ".json"
    path = os.path.join(HERE, "results", name)
    with open(path + ".tmp", "w") as f:
        json.dump(out, f, indent=2)
    os.replace(path + ".tmp", path)
    if not a.demo:
        plot_throughput(results + [dict(name="sum beside", tokens_per_s=total_side), dict(name="sum alone", tokens_per_s=total_alone)], os.path.join(HERE, "results", a.out + ".png"))
        plot_predictions(results, os.path.join(HERE, "results", a.out + "-predictions.png"))
        print(f"plots: bench/results/{a.out}.png, bench/results/{a.out}-predictions.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
