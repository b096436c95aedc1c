#!/usr/bin/python3
"""LoRA fine-tuning on every layout trains what one device trains.

A base model is pretrained for a few steps on one device; every case then fine-tunes it with LoRA
(--init-from, adapters only) on a layout through `alloy launch` (real processes, Gloo over
loopback) and must reproduce the one-device LoRA run's per-step loss (and validation loss) within
1e-5 relative over 20 steps. Beside the trajectories it checks what LoRA is for: only adapters
cross the wire (grad_bytes per step against the same layout training everything), the checkpoint
holds the adapters alone and resumes on another layout, the quantized bases (int8, nf4) train
the same on every layout as on one device, and so does dropout on the adapters' inputs.

usage: test_lora.py ALLOY WORKDIR [CASE...]
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distlib import fresh_workdir_with_corpus, full, plan, sh  # noqa: E402

RTOL = 1e-5
STEPS = 20

LAYOUTS = {
    "dp2-6x2-2x6": (plan(24, [(6, 2, full(0)), (2, 6, full(1))]), 2),
    "pp2-6+2": (plan(24, [(4, 6, [(0, 0, 6), (1, 6, 8)])]), 2),
    "mixed-5+3_and_8": (plan(24, [(4, 4, [(0, 0, 5), (1, 5, 8)]), (2, 4, full(2))]), 3),
    "dp2-9x2-3x2": (plan(24, [(9, 2, full(0)), (3, 2, full(1))]), 2),
    # Tensor parallelism: a 3:1 group in a pipeline; a 2:2 group (LLaMA's two key/value groups)
    # beside a replica without it, whose adapter gradients sum with the group's parts.
    "tp2-3:1-in-pp2": (plan(24, [(4, 6, [([0, 1], 0, 5, [3, 1]), (2, 5, 8)])]), 3),
    "tp2-2:2-beside-replica": (plan(24, [(4, 4, [([0, 1], 0, 8, [2, 2])]), (2, 4, full(2))]), 3),
}
# name: (arch, layout, LoRA flags (the one-device reference uses them too), other flags)
# LoRA takes a larger learning rate than pretraining (its updates start from B = 0).
GPT2 = ["--lora-rank", "4", "--lora-alpha", "8", "--set", "train.lr=1e-2"]
LLAMA = ["--lora-rank", "4", "--lora-targets", "all", "--set", "train.lr=1e-2"]
CASES = {
    "gpt2-dp2-hetero": ("gpt2", "dp2-6x2-2x6", GPT2, []),
    "gpt2-pp2": ("gpt2", "pp2-6+2", GPT2, []),
    "gpt2-mixed": ("gpt2", "mixed-5+3_and_8", GPT2 + ["--lora-targets", "c_attn", "mlp.*"], []),
    "llama-gqa-mixed": ("llama", "mixed-5+3_and_8", LLAMA, []),
    "gpt2-zero2-3:1": ("gpt2", "dp2-6x2-2x6", GPT2, ["--zero-stage", "2", "--shard-ratio", "3", "1"]),
    "gpt2-zero3-3:1": ("gpt2", "dp2-9x2-3x2", GPT2, ["--zero-stage", "3", "--shard-ratio", "3", "1"]),
    "gpt2-recompute-pp2": ("gpt2", "pp2-6+2", GPT2, ["--recompute"]),
    "gpt2-int8-mixed": ("gpt2", "mixed-5+3_and_8", GPT2 + ["--base-dtype", "int8"], []),
    "llama-nf4-pp2": ("llama", "pp2-6+2", LLAMA + ["--base-dtype", "nf4", "--set", "lora.double_quant=true"], []),
    "gpt2-tp2-in-pp2": ("gpt2", "tp2-3:1-in-pp2", GPT2 + ["--lora-targets", "all"], []),
    "llama-gqa-tp2-beside-replica": ("llama", "tp2-2:2-beside-replica", LLAMA, ["--zero-stage", "1"]),
    "gpt2-tp2-sp-zero3": ("gpt2", "tp2-2:2-beside-replica", GPT2 + ["--lora-targets", "all"],
                          ["--sequence-parallel", "--zero-stage", "3"]),
    # Dropout on the adapters' inputs: masks keyed by sample (model::DropoutKeys), so a 3:1 group's
    # members (one reading 3 heads' columns of a row-parallel input, one 1) and recomputed blocks
    # in unlike micro-batches draw the one-device run's masks.
    "gpt2-dropout-tp2-in-pp2": ("gpt2", "tp2-3:1-in-pp2", GPT2 + ["--lora-targets", "all", "--set", "lora.dropout=0.1"], []),
    "llama-dropout-recompute-mixed": ("llama", "mixed-5+3_and_8", LLAMA + ["--set", "lora.dropout=0.1"], ["--recompute"]),
    # A quantized base under tensor parallelism: the whole weight quantized once (as on one
    # device), each member keeping its piece's codes and its blocks' scales.
    "gpt2-nf4-tp2-in-pp2": ("gpt2", "tp2-3:1-in-pp2", GPT2 + ["--lora-targets", "all", "--base-dtype", "nf4"], []),
    "llama-int8-tp2-beside-replica": ("llama", "tp2-2:2-beside-replica", LLAMA + ["--base-dtype", "int8"], []),
}


def config(work, arch, out):
    path = out + ".yaml"
    kv = ", kv_heads: 2" if arch == "llama" else ""
    with open(path, "w") as f:
        f.write(f"""model: {{arch: {arch}, layers: 8, hidden: 32, heads: 4{kv}, seq_len: 32, vocab_size: 257}}
data: {{prefix: {work}/data/corpus}}
train: {{steps: {STEPS}, global_batch: 24, lr: 2e-3, warmup: 3, eval_interval: 10, eval_batches: 1, threads: 1}}
output: {{dir: {out}, tensorboard: false}}
""")
    return path


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f if l.strip()]


def worst_difference(got, base, rtol=RTOL):
    worst = 0.0
    ok = len(got) == len(base) == STEPS
    for g, b in zip(got, base):
        worst = max(worst, abs(g["loss"] - b["loss"]) / abs(b["loss"]))
        if ("val_loss" in g) != ("val_loss" in b):
            ok = False
        elif "val_loss" in g:
            worst = max(worst, abs(g["val_loss"] - b["val_loss"]) / abs(b["val_loss"]))
    return ok and worst <= rtol, worst


def safetensors_names(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return sorted(k for k in json.loads(f.read(n)) if k != "__metadata__")


def launch(alloy, work, name, arch, layout, flags, env, resume=None):
    out = os.path.join(work, name)
    layout_plan, world = LAYOUTS[layout]
    plan_path = os.path.join(work, name + ".json")
    with open(plan_path, "w") as f:
        json.dump(layout_plan, f)
    cmd = [alloy, "launch", "--nproc", str(world), "--threads-per-rank", "1", "--", alloy, "train", "--config",
           config(work, arch, out), "--timeout", "120", "--plan", plan_path] + flags
    if resume:
        cmd += ["--resume-from", resume]
    sh(cmd, env=env)
    return out


def main():
    alloy, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    wanted = sys.argv[3:] or list(CASES) + ["adapters-only", "resume", "resume-tp", "resume-dropout"]
    fresh_workdir_with_corpus(alloy, work)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

    bases = {}  # arch -> pretrained checkpoint directory
    def base(arch):
        if arch not in bases:
            out = os.path.join(work, f"pretrained-{arch}")
            sh([alloy, "train", "--config", config(work, arch, out), "--set", "train.steps=10"], env=env)
            bases[arch] = os.path.join(out, "checkpoints", "step_00000010")
        return bases[arch]

    references = {}
    def reference(arch, lora_flags):
        key = (arch, tuple(lora_flags))
        if key not in references:
            out = os.path.join(work, f"single-{len(references)}")
            sh([alloy, "train", "--config", config(work, arch, out), "--init-from", base(arch)] + lora_flags, env=env)
            references[key] = (out, metrics(out))
        return references[key]

    failures = 0
    for name in wanted:
        if name in CASES:
            arch, layout, lora_flags, other = CASES[name]
            _, ref = reference(arch, lora_flags)
            out = launch(alloy, work, name, arch, layout, ["--init-from", base(arch)] + lora_flags + other, env)
            ok, worst = worst_difference(metrics(out), ref)
            got = metrics(out)
            if "lora.dropout=0.1" in lora_flags:
                # Dropout is on: the reference itself departs from the same run without it.
                i = lora_flags.index("lora.dropout=0.1")
                _, plain = reference(arch, lora_flags[:i - 1] + lora_flags[i + 1:])
                same, _ = worst_difference(ref, plain, rtol=1e-4)
                ok = ok and not same
            # The adapters train: validation loss falls from step 10 to 20.
            vals = [r["val_loss"] for r in got if "val_loss" in r]
            ok = ok and vals[-1] < vals[0]
            print(f"{'ok  ' if ok else 'FAIL'} {name:<22} {layout}: worst relative loss difference {worst:.2e} "
                  f"(validation loss {vals[0]:.4f} -> {vals[-1]:.4f})", flush=True)
        elif name == "adapters-only":
            # The same layout training everything against LoRA: only the adapters are synced, and a
            # checkpoint holds them alone (the base is the --init-from it names).
            full_run = launch(alloy, work, "full-dp2", "gpt2", "dp2-6x2-2x6", ["--init-from", base("gpt2")], env)
            lora_run = os.path.join(work, "gpt2-dp2-hetero")
            if not os.path.exists(os.path.join(lora_run, "metrics.jsonl")):
                lora_run = launch(alloy, work, "gpt2-dp2-hetero", "gpt2", "dp2-6x2-2x6",
                                  ["--init-from", base("gpt2")] + GPT2, env)
            full_bytes = metrics(full_run)[-1]["grad_bytes"]
            lora_bytes = metrics(lora_run)[-1]["grad_bytes"]
            ckpt = os.path.join(lora_run, "checkpoints", "step_00000020")
            with open(os.path.join(ckpt, "state.json")) as f:
                state = json.load(f)
            names = set()
            for fn in os.listdir(ckpt):
                if fn.startswith("model"):
                    with open(os.path.join(ckpt, fn), "rb") as f:
                        n = int.from_bytes(f.read(8), "little")
                        names |= {k for k in json.loads(f.read(n)) if k != "__metadata__"}
            adapters_only = bool(names) and all(".lora_A." in n or ".lora_B." in n for n in names)
            # 8 blocks x 2 projections x 2 matrices
            ok = (lora_bytes < 0.1 * full_bytes and adapters_only and len(names) == 32
                  and os.path.samefile(state.get("base", ""), base("gpt2")))
            print(f"{'ok  ' if ok else 'FAIL'} adapters-only          gradient bytes per step LoRA/full "
                  f"{lora_bytes:.0f}/{full_bytes:.0f} = {lora_bytes / full_bytes:.4f}; checkpoint holds {len(names)} "
                  f"tensors, all adapters: {adapters_only}; base {state.get('base')}", flush=True)
        elif name in ("resume", "resume-tp", "resume-dropout"):
            # Steps 1-10 on a first layout, 11-20 on two unlike replicas: the trajectory of one
            # device, the base re-read from where the first run took it. "resume": a pipeline beside
            # a replica; "resume-tp": a 3:1 tensor-parallel group in a pipeline, whose checkpoint
            # holds the adapters' pieces and whose exported PEFT adapter holds every factor whole.
            # "resume-dropout": as "resume" with dropout 0.1: the masks after the resume are those of
            # the uninterrupted run (keyed by step and sample, not a generator's position).
            tp = name == "resume-tp"
            flags = GPT2 + (["--lora-targets", "all"] if tp else []) + (["--set", "lora.dropout=0.1"] if name == "resume-dropout" else [])
            ref_out, ref = reference("gpt2", flags)
            a = launch(alloy, work, name + "-a", "gpt2", "tp2-3:1-in-pp2" if tp else "mixed-5+3_and_8",
                       ["--init-from", base("gpt2"), "--set", "train.checkpoint_interval=10"] + flags, env)
            b = launch(alloy, work, name + "-b", "gpt2", "dp2-6x2-2x6", flags, env,
                       resume=os.path.join(a, "checkpoints", "step_00000010"))
            got = [r for r in metrics(a) if r["step"] <= 10] + metrics(b)
            ok, worst = worst_difference(got, ref)
            ok = ok and [r["step"] for r in got] == list(range(1, STEPS + 1))
            export = ""
            if tp:
                names = safetensors_names(os.path.join(a, "adapter", "adapter_model.safetensors"))
                ref_names = safetensors_names(os.path.join(ref_out, "adapter", "adapter_model.safetensors"))
                ok = ok and names == ref_names and len(names) == 8 * 4 * 2
                export = (f"; its PEFT adapter holds {len(names)} tensors, the one-device run's {len(ref_names)}, "
                          f"same names: {names == ref_names}")
            first = "tensor-parallel 3:1 in a pipeline" if tp else "pipeline+replica"
            print(f"{'ok  ' if ok else 'FAIL'} {name:<22} LoRA steps 1-10 {first}, 11-20 two replicas: worst relative "
                  f"loss difference {worst:.2e}{export}", flush=True)
        else:
            print(f"unknown case {name}")
            ok = False
        failures += not ok
    print(f"{len(wanted) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
