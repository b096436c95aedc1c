#!/usr/bin/python3
"""The fine-tuning demo: pretrain examples/small-gpt2.yaml on the fortunes corpus without its
technical files, then LoRA fine-tune it on those held-out files (another style: computers, linux,
perl, debian) on a pool of unlike devices, and report what LoRA is for.

  scripts/finetune_demo.py [--build build] [--emulate examples/cluster-3dev.yaml | --nproc 3]
                           [--pretrain-steps 150] [--steps 80] [--work runs/finetune]

Reports: the held-out validation loss of the base and of the fine-tuned model (alloy eval on the
held-out validation text), the adapters' bytes against the model's, and the gradient bytes per step
of the LoRA run against full fine-tuning under the same plan (metrics.jsonl's grad_bytes).
"""
import argparse
import glob
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELD_OUT = ["computers", "linux", "perl", "debian", "linuxcookie"]


def run(cmd, **kw):
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, text=True, capture_output=True, **kw)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-6000:])
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}")
    return r


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f if l.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--emulate", default=None, help="ClusterSpec to fine-tune on (root); default examples/cluster-3dev.yaml")
    ap.add_argument("--nproc", type=int, default=0, help="local ranks instead of an emulated pool")
    ap.add_argument("--pretrain-steps", type=int, default=150)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--work", default=os.path.join(REPO, "runs", "finetune"))
    a = ap.parse_args()
    alloy = os.path.join(a.build, "alloy")
    pool = [] if a.nproc else ["--emulate", a.emulate or os.path.join(REPO, "examples", "cluster-3dev.yaml")]
    if a.nproc:
        pool = ["--nproc", str(a.nproc)]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    os.makedirs(a.work, exist_ok=True)
    w = lambda *p: os.path.join(a.work, *p)  # noqa: E731

    # The corpus split by file: pretraining never sees the held-out style.
    src = "/usr/share/games/fortunes"
    files = sorted(f for f in glob.glob(os.path.join(src, "*")) if os.path.isfile(f) and not f.endswith((".dat", ".u8")))
    held = [f for f in files if os.path.basename(f) in HELD_OUT]
    rest = [f for f in files if os.path.basename(f) not in HELD_OUT]
    if not os.path.exists(w("data", "pretrain_train.idx")):
        run([alloy, "data", "prepare", "--input", *rest, "--output", w("data", "pretrain")], env=env)
        run([alloy, "data", "prepare", "--input", *held, "--output", w("data", "tech")], env=env)
    # The held-out validation text for alloy eval: the tail of each technical file.
    valid_txt = w("tech-valid.txt")
    with open(valid_txt, "w", errors="replace") as out:
        for f in held:
            with open(f, errors="replace") as fh:
                text = fh.read()
            out.write(text[int(len(text) * 0.9):])

    cfg = os.path.join(REPO, "examples", "small-gpt2.yaml")
    common = ["--set", "train.threads=1", "--set", "output.tensorboard=false"]
    base_dir = w("pretrain")
    if not os.path.exists(os.path.join(base_dir, "checkpoints", "latest")):
        run([alloy, "train", "--config", cfg, "--set", f"data.prefix={w('data', 'pretrain')}", "--set",
             f"train.steps={a.pretrain_steps}", "--set", "train.checkpoint_interval=0", "--set", f"output.dir={base_dir}",
             *common], env=env)
    run([alloy, "export", "--checkpoint", base_dir, "-o", w("base", "model.safetensors")], env=env)

    tune = ["--set", f"data.prefix={w('data', 'tech')}", "--set", "train.lr=2e-3", "--set", "train.min_lr=2e-4",
            "--set", "train.warmup=5", "--set", "train.eval_interval=20", "--set", "train.checkpoint_interval=0",
            "--set", "train.replan_step=0", "--init-from", w("base", "model.safetensors")]
    lora = ["--lora-rank", str(a.rank), "--lora-alpha", str(2 * a.rank), "--lora-targets", "all"]
    lora_dir = w("lora")
    cluster = pool[1] if pool[0] == "--emulate" else None
    plan_args = ["--plan", "auto", "--cluster", cluster] if cluster else []
    run([alloy, "launch", *pool, "--", alloy, "train", "--config", cfg, *tune, *lora, *plan_args, "--set",
         f"train.steps={a.steps}", "--set", f"output.dir={lora_dir}", *common], env=env)
    # Full fine-tuning under the very plan the LoRA run used, a few steps: its gradient traffic.
    full_dir = w("full")
    run([alloy, "launch", *pool, "--", alloy, "train", "--config", cfg, *tune, "--plan", os.path.join(lora_dir, "plan.json"),
         "--set", "train.steps=6", "--set", "train.eval_batches=0", "--set", f"output.dir={full_dir}", *common], env=env)

    def eval_loss(weights):
        r = run([alloy, "eval", "--config", cfg, "--weights", weights, "--text", valid_txt], env=env)
        return json.loads(r.stdout.strip().splitlines()[-1])["loss"]

    before, after = eval_loss(w("base", "model.safetensors")), eval_loss(lora_dir)
    adapter = os.path.getsize(os.path.join(lora_dir, "adapter", "adapter_model.safetensors"))
    model = os.path.getsize(w("base", "model.safetensors"))
    lora_bytes = metrics(lora_dir)[-1]["grad_bytes"]
    full_bytes = metrics(full_dir)[-1]["grad_bytes"]
    vals = [(r["step"], r["val_loss"]) for r in metrics(lora_dir) if "val_loss" in r]
    report = {
        "pool": pool, "pretrain_steps": a.pretrain_steps, "lora_steps": a.steps, "lora_rank": a.rank,
        "held_out_files": HELD_OUT,
        "held_out_eval_loss": {"base": before, "lora": after, "relative_change": after / before - 1},
        "lora_validation_curve": vals,
        "adapter_bytes": adapter, "model_bytes": model, "adapter_fraction": adapter / model,
        "grad_bytes_per_step": {"lora": lora_bytes, "full": full_bytes, "ratio": lora_bytes / full_bytes},
    }
    with open(w("report.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nheld-out validation loss (alloy eval on {len(HELD_OUT)} technical files): base {before:.4f} -> "
          f"LoRA {after:.4f} ({100 * (after / before - 1):+.1f}%)")
    print("LoRA run's validation loss on the held-out set: " + ", ".join(f"step {s}: {v:.4f}" for s, v in vals))
    print(f"adapters: {adapter / 1e6:.2f} MB against the model's {model / 1e6:.2f} MB = {100 * adapter / model:.2f}% "
          f"({'under' if adapter / model < 0.05 else 'NOT under'} 5%)")
    print(f"gradient bytes per step: LoRA {lora_bytes / 1e6:.3f} MB vs full fine-tuning {full_bytes / 1e6:.3f} MB under "
          f"the same plan = {100 * lora_bytes / full_bytes:.2f}%")
    print(f"wrote {w('report.json')}")
    ok = after < before and adapter / model < 0.05 and lora_bytes < full_bytes
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
