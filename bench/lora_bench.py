#!/usr/bin/python3
"""LoRA fine-tuning: full fine-tuning vs LoRA vs LoRA on an int8 / NF4 base, side by side in one invocation.

A GPT-2 whose weights dominate its memory (default 2 x 1024, seq_len 64, batch 4, byte vocabulary:
25M parameters, one intra-op thread) is pretrained briefly on the fortunes corpus less a held-out
domain (computers, linux, perl); every case then fine-tunes that base (--init-from) on the held-out
domain for --steps steps:
  full FT        every weight trains (AdamW)
  LoRA fp32      adapters of rank --rank on every projection (--lora-targets all, as QLoRA), base frozen
  LoRA int8      the same over a base whose projections are int8 (per-channel absmax)
  LoRA nf4       ... 4-bit NormalFloat (blocks of 64)
  LoRA nf4+dq    ... NF4 with double quantization (lora.double_quant=true)
Rounds alternate between the cases so machine noise hits all. Per case (median of the rounds and
the worst): step time (median of the steps after the first --skip) and tokens/s; model memory
(ranks.json's model_memory_bytes: the heap's peak during the steps above what the process held
before building its model) and peak RSS (VmHWM, which also holds the fp32 weights read before
quantizing); training loss of the last step (one batch: noisy), its mean over the last 5 steps, and
the validation loss after the last step (--eval-batches batches of the held-out domain's validation split).
Untrained: one step at learning rate 0 per base dtype gives the base's loss before training (the
step's training loss and the validation loss after it; LoRA's B starts at zero, so the adapters add
nothing), the quantized bases against fp32.

Goals (issue): LoRA on NF4 model memory at most 0.35x of full fine-tuning's; LoRA step time at most
full fine-tuning's.

Prints a table and writes bench/results/lora.json and lora.png (ratios vs full FT; lora.dat beside it).
usage: /usr/bin/python3 bench/lora_bench.py [--build build | --alloy PATH] [--rounds 3] [--steps 20] [--skip 3]
                                            [--hidden 1024] [--layers 2] [--heads 16] [--seq-len 64] [--batch 4]
                                            [--rank 16] [--alpha 32] [--pretrain-steps 40] [--threads 1]
"""
import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import plot  # noqa: E402

# These runs read Alloy's info lines; a log level the caller exported would hide them.
os.environ.pop("ALLOY_LOG_LEVEL", None)

FORTUNES = "/usr/share/games/fortunes"
FINETUNE_DOMAIN = ["computers", "linux", "perl"]  # held out of pretraining; the fine-tuning data
BASE_DTYPES = [("fp32", "fp32", []), ("int8", "int8", []), ("nf4", "nf4", []), ("nf4+dq", "nf4", ["lora.double_quant=true"])]


def log(msg):
    print(f"[lora] {msg}", flush=True)


def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return r


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Bench:
    def __init__(self, a):
        self.a = a
        self.alloy = os.path.abspath(a.alloy or os.path.join(a.build, "alloy"))
        self.work = os.path.abspath(a.work) if a.work else tempfile.mkdtemp(prefix="alloy-lora-bench-")
        os.makedirs(self.work, exist_ok=True)
        self.env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS=str(a.threads),
                        MKL_NUM_THREADS=str(a.threads))
        self.model = dict(arch="gpt2", layers=a.layers, hidden=a.hidden, heads=a.heads, seq_len=a.seq_len, vocab_size=257)
        self.config = os.path.join(self.work, "lora.yaml")
        m = self.model
        with open(self.config, "w") as f:
            f.write(f"""model: {{arch: gpt2, layers: {m['layers']}, hidden: {m['hidden']}, heads: {m['heads']}, seq_len: {m['seq_len']},
         vocab_size: {m['vocab_size']}}}
data: {{prefix: {self.work}/data/finetune, tokenizer: byte}}
train: {{steps: {a.steps}, global_batch: {a.batch}, lr: 1e-3, min_lr: 1e-4, warmup: 2, eval_interval: 0,
        eval_batches: {a.eval_batches}, checkpoint_interval: 0, threads: {a.threads}, seed: 1234}}
output: {{dir: {self.work}/runs/default, tensorboard: false}}
""")

    def prepare(self):
        files = sorted(f for f in os.listdir(FORTUNES)
                       if not f.endswith((".dat", ".u8")) and os.path.isfile(os.path.join(FORTUNES, f)))
        held = [f for f in files if f in FINETUNE_DOMAIN]
        rest = [f for f in files if f not in FINETUNE_DOMAIN]
        if not held or not rest:
            sys.exit(f"{FORTUNES}: expected the fortune files {FINETUNE_DOMAIN} and others (apt-get install fortunes)")
        for prefix, names in (("pretrain", rest), ("finetune", held)):
            run([self.alloy, "data", "prepare", "--input"] + [os.path.join(FORTUNES, f) for f in names]
                + ["--output", os.path.join(self.work, "data", prefix)])
        return held

    def train(self, name, sets, flags=()):
        out = os.path.join(self.work, "runs", name)
        shutil.rmtree(out, ignore_errors=True)
        cmd = [self.alloy, "train", "--config", self.config, "--set", f"output.dir={out}"]
        for s in sets:
            cmd += ["--set", s]
        t0 = time.time()
        r = run(cmd + list(flags), env=self.env)
        wall = time.time() - t0
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(l) for l in f if l.strip()]
        path = os.path.join(out, "ranks.json")
        if not os.path.exists(path):
            sys.exit(f"{path} missing: the single-process run wrote no ranks.json")
        with open(path) as f:
            ranks = json.load(f)
        ranks = ranks["ranks"] if isinstance(ranks, dict) else ranks
        # As the run logs them: the adapters with LoRA, else every parameter.
        trainable = re.search(r"([0-9.]+[kMG]?) trainable parameters", r.stderr) or re.search(r"([0-9.]+[kMG]?) parameters;", r.stderr)
        return dict(rows=rows, rank=ranks[0], wall_s=wall, trainable=trainable.group(1) if trainable else None, out=out)

    def pretrain(self):
        a = self.a
        sets = [f"data.prefix={self.work}/data/pretrain", f"train.steps={a.pretrain_steps}", f"train.lr={a.pretrain_lr}",
                f"train.min_lr={a.pretrain_lr / 10}", "train.warmup=5"]
        r = self.train("base", sets)
        last = r["rows"][-1]
        log(f"pretrained the base: {a.pretrain_steps} steps, loss {r['rows'][0]['loss']:.3f} -> {last['loss']:.3f}, "
            f"validation {last.get('val_loss', float('nan')):.3f} ({r['wall_s']:.0f} s)")
        return r["out"]

    def lora_flags(self, dtype):
        return ["--lora-rank", str(self.a.rank), "--lora-alpha", str(self.a.alpha), "--lora-targets", "all", "--base-dtype", dtype]

    def cases(self):
        a = self.a
        c = [("full FT", [f"train.lr={a.ft_lr}", f"train.min_lr={a.ft_lr / 10}"], [])]
        for label, dtype, extra in BASE_DTYPES:
            c.append((f"LoRA {label}", [f"train.lr={a.lora_lr}", f"train.min_lr={a.lora_lr / 10}"] + extra, self.lora_flags(dtype)))
        return c

    def untrained(self, base):
        """One step at learning rate 0 per base dtype: the base's losses before training."""
        res = {}
        for label, dtype, extra in BASE_DTYPES:
            r = self.train(f"untrained-{label}", ["train.steps=1", "train.lr=0", "train.min_lr=0", "train.warmup=0"] + extra,
                           ["--init-from", base] + self.lora_flags(dtype))
            row = r["rows"][-1]
            res[label] = dict(train_loss=row["loss"], val_loss=row.get("val_loss"))
        for label, v in res.items():
            v["train_loss_vs_fp32"] = v["train_loss"] - res["fp32"]["train_loss"]
            v["val_loss_vs_fp32"] = v["val_loss"] - res["fp32"]["val_loss"]
            log(f"untrained base {label:<7} loss {v['train_loss']:.4f} (step 1, lr 0), validation {v['val_loss']:.4f} "
                f"({v['val_loss_vs_fp32']:+.4f} vs fp32)")
        return res

    def case(self, label, sets, flags, base, rnd):
        r = self.train(f"{label.replace(' ', '_')}-r{rnd}", sets, ["--init-from", base] + flags)
        rows, rk = r["rows"], r["rank"]
        timed = rows[self.a.skip:] or rows
        step_s = statistics.median(x["step_s"] for x in timed)
        out = dict(step_s=step_s, tokens_per_s=statistics.median(x["tokens_per_s"] for x in timed),
                   loss=rows[-1]["loss"], loss_last5=statistics.mean(x["loss"] for x in rows[-5:]),
                   val_loss=rows[-1].get("val_loss"), wall_s=r["wall_s"], trainable=r["trainable"])
        for k in ("model_memory_bytes", "peak_rss_bytes", "param_bytes", "grad_bytes", "optimizer_state_bytes",
                  "peak_activation_bytes", "step_s_median"):
            out[k] = rk.get(k)
        shutil.rmtree(r["out"], ignore_errors=True)  # its checkpoint (a full model for full FT)
        return out


def summarize(runs):
    """Median of the rounds per figure, and the worst (slowest, largest) of them."""
    s = {}
    for k in ("step_s", "tokens_per_s", "model_memory_bytes", "peak_rss_bytes", "param_bytes", "grad_bytes",
              "optimizer_state_bytes", "peak_activation_bytes", "loss", "loss_last5", "val_loss"):
        xs = [r[k] for r in runs if r.get(k) is not None]
        if not xs:
            continue
        s[k] = statistics.median(xs)
        s[f"{k}_worst"] = min(xs) if k == "tokens_per_s" else max(xs)
    s["rounds"] = runs
    s["trainable"] = runs[-1]["trainable"]
    return s


def mib(x):
    return f"{x / 2**20:.1f}" if x is not None else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--alloy", default="", help="the alloy binary (default BUILD/alloy)")
    ap.add_argument("--work", default="", help="work directory (default: a temporary one, removed at the end)")
    ap.add_argument("--results", default=os.path.join(REPO, "bench", "results"), help="where lora.json and lora.png go")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="fine-tuning steps per case")
    ap.add_argument("--skip", type=int, default=3, help="first steps not timed")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="global batch (one micro-batch)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank")
    ap.add_argument("--alpha", type=float, default=32, help="LoRA alpha")
    ap.add_argument("--ft-lr", type=float, default=3e-4, help="full fine-tuning's peak learning rate")
    ap.add_argument("--lora-lr", type=float, default=1e-3, help="LoRA's peak learning rate")
    ap.add_argument("--pretrain-steps", type=int, default=40)
    ap.add_argument("--pretrain-lr", type=float, default=1e-3)
    ap.add_argument("--eval-batches", type=int, default=8, help="validation batches (train.eval_batches)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (train.threads, OMP/OpenBLAS)")
    a = ap.parse_args()
    if a.skip >= a.steps:
        sys.exit("--skip must be below --steps")
    B = Bench(a)
    if not os.path.exists(B.alloy):
        sys.exit(f"{B.alloy} not found (build first, or --alloy PATH)")
    t0, load = time.time(), os.getloadavg()
    held = B.prepare()
    log(f"model gpt2 {a.layers} x {a.hidden}, {a.heads} heads, seq_len {a.seq_len}, batch {a.batch}, {a.threads} thread(s); "
        f"pretraining on the fortunes less {', '.join(held)}, fine-tuning on those; work {B.work}")
    base = B.pretrain()
    untrained = B.untrained(base)
    cases = B.cases()
    runs = {label: [] for label, _, _ in cases}
    for rnd in range(a.rounds):
        for label, sets, flags in cases:
            r = B.case(label, sets, flags, base, rnd)
            runs[label].append(r)
            log(f"round {rnd + 1}/{a.rounds}: {label:<12} {r['step_s'] * 1e3:8.1f} ms/step, model memory "
                f"{mib(r['model_memory_bytes'])} MiB, peak RSS {mib(r['peak_rss_bytes'])} MiB, loss {r['loss']:.4f}, "
                f"validation {r['val_loss']:.4f} ({r['wall_s']:.0f} s)")
    res_cases = {label: summarize(rs) for label, rs in runs.items()}
    full = res_cases["full FT"]
    for label, c in res_cases.items():
        c["step_vs_full"] = c["step_s"] / full["step_s"]
        c["step_vs_full_worst"] = c["step_s_worst"] / full["step_s"]
        c["model_memory_vs_full"] = c["model_memory_bytes"] / full["model_memory_bytes"]
        c["peak_rss_vs_full"] = c["peak_rss_bytes"] / full["peak_rss_bytes"]
        if label.startswith("LoRA") and label != "LoRA fp32":
            c["val_loss_vs_lora_fp32"] = c["val_loss"] - res_cases["LoRA fp32"]["val_loss"]
    nf4, lora = res_cases["LoRA nf4"], res_cases["LoRA fp32"]
    goals = {"lora_nf4_model_memory_vs_full<=0.35": dict(value=nf4["model_memory_vs_full"], met=nf4["model_memory_vs_full"] <= 0.35),
             "lora_step_vs_full<=1": dict(value=lora["step_vs_full"], met=lora["step_vs_full"] <= 1.0)}

    # The table.
    print()
    print(f"gpt2 {a.layers} x {a.hidden}, seq_len {a.seq_len}, batch {a.batch}, {a.threads} thread(s); LoRA rank {a.rank} "
          f"alpha {a.alpha:g} on all projections; {a.steps} steps (timed after {a.skip}), median of {a.rounds} round(s) [worst]")
    hdr = (f"{'case':<12} {'trainable':>9} {'ms/step':>16} {'vs full':>6} {'tok/s':>7} {'model MiB':>16} {'vs full':>7} "
           f"{'peak RSS MiB':>16} {'vs full':>7} {'loss':>7} {'last 5':>7} {'val loss':>8} {'untrained val':>13}")
    print(hdr)
    print("-" * len(hdr))
    for label, c in res_cases.items():
        dt = label.split(" ", 1)[1] if label != "full FT" else "fp32"
        u = untrained[dt]["val_loss"]
        print(f"{label:<12} {c['trainable'] or '-':>9} {c['step_s'] * 1e3:7.1f} [{c['step_s_worst'] * 1e3:6.1f}] "
              f"{c['step_vs_full']:6.2f} {c['tokens_per_s']:7.0f} {mib(c['model_memory_bytes']):>7} [{mib(c['model_memory_bytes_worst']):>6}] "
              f"{c['model_memory_vs_full']:7.3f} {mib(c['peak_rss_bytes']):>7} [{mib(c['peak_rss_bytes_worst']):>6}] "
              f"{c['peak_rss_vs_full']:7.3f} {c['loss']:7.4f} {c['loss_last5']:7.4f} {c['val_loss']:8.4f} {u:13.4f}")
    print()
    print("model memory parts (MiB): " + "; ".join(
        f"{label} params {mib(c['param_bytes'])} grads {mib(c['grad_bytes'])} AdamW {mib(c['optimizer_state_bytes'])} "
        f"activations {mib(c['peak_activation_bytes'])}" for label, c in res_cases.items()))
    print("untrained base (1 step at lr 0), validation loss vs fp32: " + ", ".join(
        f"{k} {v['val_loss']:.4f} ({v['val_loss_vs_fp32']:+.4f})" for k, v in untrained.items()))
    print("after LoRA training, validation loss vs LoRA over the fp32 base: " + ", ".join(
        f"{label[5:]} {c['val_loss']:.4f} ({c['val_loss_vs_lora_fp32']:+.4f})" for label, c in res_cases.items()
        if "val_loss_vs_lora_fp32" in c))
    g1, g2 = goals["lora_nf4_model_memory_vs_full<=0.35"], goals["lora_step_vs_full<=1"]
    print(f"goal: LoRA nf4 model memory <= 0.35x full FT: {g1['value']:.3f}x ({'met' if g1['met'] else 'NOT met'}; "
          f"peak RSS {nf4['peak_rss_vs_full']:.3f}x, nf4+dq {res_cases['LoRA nf4+dq']['model_memory_vs_full']:.3f}x)")
    print(f"goal: LoRA step time <= full FT: {g2['value']:.3f}x ({'met' if g2['met'] else 'NOT met'}; worst round "
          f"{lora['step_vs_full_worst']:.3f}x; int8 {res_cases['LoRA int8']['step_vs_full']:.3f}x, nf4 {nf4['step_vs_full']:.3f}x, "
          f"nf4+dq {res_cases['LoRA nf4+dq']['step_vs_full']:.3f}x)")
    print()

    res = dict(machine=dict(cpu=cpu_model(), cores=os.cpu_count(), node=platform.node(), date=time.strftime("%Y-%m-%d %H:%M:%S"),
                            load_at_start=load, load_at_end=os.getloadavg()),
               model=B.model, global_batch=a.batch, steps=a.steps, timed_after=a.skip, rounds=a.rounds, threads=a.threads,
               lora=dict(rank=a.rank, alpha=a.alpha, targets="all"), lr=dict(full=a.ft_lr, lora=a.lora_lr),
               pretrain=dict(steps=a.pretrain_steps, lr=a.pretrain_lr, data=f"{FORTUNES} less {', '.join(held)}"),
               finetune_data=[os.path.join(FORTUNES, f) for f in held], eval_batches=a.eval_batches,
               untrained=untrained, cases=res_cases, goals=goals, seconds=time.time() - t0)
    os.makedirs(a.results, exist_ok=True)
    cats = list(res_cases)
    plot.bars(os.path.join(a.results, "lora.png"),
              f"gpt2 {a.layers} x {a.hidden}: LoRA vs full fine-tuning (ratio to full FT, median of {a.rounds})", "x full FT",
              cats, {"step time": [res_cases[c]["step_vs_full"] for c in cats],
                     "model memory": [res_cases[c]["model_memory_vs_full"] for c in cats],
                     "peak RSS": [res_cases[c]["peak_rss_vs_full"] for c in cats]}, fmt="%.2f")
    path = os.path.join(a.results, "lora.json")
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(path + ".tmp", path)
    log(f"wrote {path} and lora.png ({res['seconds']:.0f} s)")
    if not a.work:
        shutil.rmtree(B.work, ignore_errors=True)


if __name__ == "__main__":
    main()
