#!/usr/bin/python3
"""Mixed precision (train.precision, --bf16/--fp16) and dynamic loss scaling, on the CPU.

- bf16: one device and a 2-rank pipeline (stage boundaries carry fp32 activations) both end within
  1% of the fp32 run's validation loss.
- loss scaling in fp32 (train.loss_scaling dynamic): losses identical to the unscaled run's (the
  scales are powers of two); from a scale that overflows, steps are skipped and the scale halves
  until they fit, and the run trains on; a resumed run continues the scale where it stopped,
  with losses identical to the uninterrupted run's.
- fp16 on a LibTorch that cannot autocast the CPU to fp16 (1.13) is refused naming
  train.precision; bad values are refused naming the key.

usage: test_precision.py ALLOY WORKDIR
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from distlib import fresh_workdir_with_corpus, metrics_rows, plan, sh  # noqa: E402

STEPS = 40


def config(work, out, extra=""):
    path = out + ".yaml"
    with open(path, "w") as f:
        f.write(f"""model: {{arch: gpt2, layers: 4, hidden: 128, heads: 4, seq_len: 64, vocab_size: 257}}
data: {{prefix: {work}/data/corpus}}
train: {{steps: {STEPS}, global_batch: 16, lr: 1e-3, warmup: 4, eval_interval: 0, eval_batches: 4, threads: 1{extra}}}
output: {{dir: {out}, tensorboard: false}}
""")
    return path


def val_loss(out):
    rows = [r for r in metrics_rows(out) if "val_loss" in r]
    return rows[-1]["val_loss"]


def main():
    alloy, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    fresh_workdir_with_corpus(alloy, work)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    failures = 0

    def report(name, ok, detail):
        nonlocal failures
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:<12} {detail}", flush=True)

    def train(name, extra="", args=(), launch=None):
        out = os.path.join(work, name)
        cmd = [alloy, "train", "--config", config(work, out, extra), *args]
        sh((launch or []) + cmd, env=env)
        return out

    fp32 = train("fp32")
    bf16 = train("bf16", args=["--bf16"])
    plan_path = os.path.join(work, "pp2.json")
    with open(plan_path, "w") as f:
        json.dump(plan(16, [(4, 4, [(0, 0, 2), (1, 2, 4)])]), f)
    bf16_pp = train("bf16-pp", args=["--bf16", "--plan", plan_path],
                    launch=[alloy, "launch", "--nproc", "2", "--threads-per-rank", "1", "--"])
    ref = val_loss(fp32)
    for name, out in (("bf16", bf16), ("bf16 2-stage", bf16_pp)):
        v = val_loss(out)
        report(name, abs(v - ref) / ref <= 0.01, f"validation loss {v:.4f} vs fp32 {ref:.4f} ({100 * (v - ref) / ref:+.2f}%, within 1%)")
    differs = [a["loss"] for a in metrics_rows(bf16)] != [a["loss"] for a in metrics_rows(fp32)]
    report("bf16 active", differs, "the bf16 run's losses are not the fp32 run's bits (autocast ran)")

    scaled = train("scaled", extra=", loss_scaling: dynamic, loss_scale_window: 10")
    a, b = metrics_rows(fp32), metrics_rows(scaled)
    same = [r["loss"] for r in a] == [r["loss"] for r in b]
    scales = [r["loss_scale"] for r in b]
    report("scaling exact", same and scales[0] == 65536 and scales[-1] == 65536 * 2 ** 3,
           f"losses identical to unscaled: {same}; scale {scales[0]:g} -> {scales[-1]:g} (doubling every 10 steps)")

    over = train("overflow", extra=", loss_scaling: dynamic, loss_scale_init: 18446744073709551616")
    rows = metrics_rows(over)
    skipped = [r["step"] for r in rows if r.get("skipped")]
    halved = all(rows[k]["loss_scale"] == rows[k - 1]["loss_scale"] / 2 for k in range(1, len(rows)) if rows[k - 1].get("skipped"))
    last_skip = max(skipped, default=0)
    trained = last_skip < STEPS // 2 and rows[-1]["loss"] < rows[last_skip]["loss"]
    report("overflow", bool(skipped) and halved and trained,
           f"steps {skipped} skipped, the scale halving each time from 2^64 (to 2^{64 - len(skipped)}); "
           f"loss then fell {rows[last_skip]['loss']:.3f} -> {rows[-1]['loss']:.3f}")

    # Resume mid-run: the scale and its count of finite steps come back from state.json.
    extra = ", loss_scaling: dynamic, loss_scale_window: 10, checkpoint_interval: 15"
    whole = train("whole", extra=extra)
    part = os.path.join(work, "part")
    ckpt = os.path.join(whole, "checkpoints", "step_00000015")
    sh([alloy, "train", "--config", config(work, part, extra), "--resume-from", ckpt], env=env)
    with open(os.path.join(ckpt, "state.json")) as f:
        st = json.load(f)
    after = [(r["loss"], r["loss_scale"]) for r in metrics_rows(whole) if r["step"] > 15]
    same = [(r["loss"], r["loss_scale"]) for r in metrics_rows(part)] == after
    report("resume", same and st.get("loss_scale") == 131072 and st.get("loss_scale_good_steps") == 5,
           f"state.json loss_scale {st.get('loss_scale')}, good steps {st.get('loss_scale_good_steps')}; "
           f"steps 16-{STEPS} after resuming: losses and scales identical to the uninterrupted run's: {same}")

    r = subprocess.run([alloy, "train", "--config", config(work, os.path.join(work, "fp16")), "--fp16", "--set", "train.steps=2"],
                       env=env, capture_output=True, text=True)
    ok = (r.returncode != 0 and "train.precision" in r.stderr and "bf16" in r.stderr) or r.returncode == 0
    report("fp16 on cpu", ok, "refused naming train.precision and the way out" if r.returncode else "this LibTorch autocasts the CPU to fp16")
    r = subprocess.run([alloy, "train", "--config", config(work, os.path.join(work, "bad")), "--set", "train.precision=fp8"],
                       env=env, capture_output=True, text=True)
    report("bad value", r.returncode != 0 and "train.precision" in r.stderr and "fp32, bf16, fp16" in r.stderr,
           "train.precision fp8 is refused naming the key and the allowed values")
    print(f"{8 - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
