#!/usr/bin/env python3
"""GPU training throughput: Alloy against PyTorch eager and torch.compile, side by side.

The same model (PyTorch's is tests/parity/reference.py, the functional model the parity checks hold
Alloy to, with the fused kernels a PyTorch user would call: scaled_dot_product_attention, tanh GELU),
the same batch of random GPT-2-vocabulary tokens, the same precision (bf16 autocast, fp32 master
weights and AdamW state) and the same optimizer (AdamW, fused on CUDA, decay on matrices, gradient
clipping at 1.0). Each case runs in its own process, one after another, on the same GPU.

Reports tokens/s and model FLOPs utilisation (MFU: 6 N + 12 L H T FLOPs per token, N the parameters
without the position table, against the GPU's dense bf16 peak), the median step after warm-up, and
the peak of the CUDA allocator (Alloy: ranks.json's model_memory_bytes, read from the same allocator).

usage: bench/gpu_bench.py ALLOY [--out DIR] [--archs gpt2,llama] [--batch 16] [--steps 20]
"""

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {
    # GPT-2 124M: 12 layers, 768 hidden, 12 heads, GPT-2's vocabulary.
    "gpt2": dict(arch="gpt2", layers=12, hidden=768, heads=12, kv_heads=None, ffn=3072, vocab=50257),
    # LLaMA-style, the same width and depth, grouped-query attention (4 key/value heads), SwiGLU.
    "llama": dict(arch="llama", layers=12, hidden=768, heads=12, kv_heads=4, ffn=2048, vocab=50257),
    # Checks of this script on a CPU (--device cpu --archs tiny-gpt2,tiny-llama).
    "tiny-gpt2": dict(arch="gpt2", layers=2, hidden=64, heads=4, kv_heads=None, ffn=256, vocab=50257),
    "tiny-llama": dict(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=50257),
}
# Dense bf16 tensor-core peaks (FLOP/s) by the name CUDA reports.
PEAKS = [("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10", 125e12), ("T4", 65e12)]


def flops_per_token(m, seq):
    h, L = m["hidden"], m["layers"]
    hd = h // m["heads"]
    kv = (m["kv_heads"] or m["heads"]) * hd
    if m["arch"] == "gpt2":
        block = h * 3 * h + 3 * h + h * h + h + 2 * h * m["ffn"] + m["ffn"] + h + 4 * h
        n = L * block + m["vocab"] * h + 2 * h  # the tied head counted once; no position table
    else:
        block = h * h + 2 * h * kv + h * h + 3 * h * m["ffn"] + 2 * h
        n = L * block + 2 * m["vocab"] * h + h
    return 6 * n + 12 * L * h * seq, n


def write_tokens(prefix, vocab, n_tokens, seed=0):
    """A Megatron MMIDIDX dataset (uint16) of random tokens: throughput does not depend on text."""
    import torch
    seqs = 64
    per = n_tokens // seqs
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (seqs * per,), generator=g, dtype=torch.int32)
    with open(prefix + ".bin", "wb") as f:
        f.write(tokens.numpy().astype("<u2").tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8))
        f.write(struct.pack("<QQ", seqs, seqs + 1))
        f.write(struct.pack(f"<{seqs}i", *([per] * seqs)))
        f.write(struct.pack(f"<{seqs}q", *[i * per * 2 for i in range(seqs)]))
        f.write(struct.pack(f"<{seqs + 1}q", *range(seqs + 1)))


def run_alloy(alloy, work, arch, a, attention):
    m = MODELS[arch]
    name = f"alloy-{arch}-{attention}"
    out = os.path.join(work, name)
    cfg = os.path.join(work, name + ".yaml")
    kv = f", kv_heads: {m['kv_heads']}" if m["kv_heads"] else ""
    with open(cfg, "w") as f:
        f.write(f"""model: {{arch: {m['arch']}, layers: {m['layers']}, hidden: {m['hidden']}, heads: {m['heads']}{kv}, ffn: {m['ffn']},
         seq_len: {a.seq}, vocab_size: {m['vocab']}}}
data: {{prefix: {work}/tokens}}
train: {{steps: {a.warmup + a.steps}, global_batch: {a.batch}, lr: 3e-4, min_lr: 3e-5, warmup: 2, eval_interval: 0,
         device: {a.device}, precision: {a.precision}, threads: {a.threads}, seed: 1}}
output: {{dir: {out}, tensorboard: false}}
""")
    env = dict(os.environ)
    if attention == "math":
        env["ALLOY_ATTENTION"] = "math"
    t0 = time.time()
    r = subprocess.run([alloy, "train", "-c", cfg], env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if r.returncode != 0:
        return {"case": name, "error": (r.stderr or r.stdout)[-1500:]}
    steps = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"step_s"' in l]
    times = [s["step_s"] for s in steps if s.get("step", 0) > a.warmup]
    losses = [s["loss"] for s in steps if "loss" in s]
    mem = max(rk.get("model_memory_bytes", 0) for rk in json.load(open(os.path.join(out, "ranks.json"))))
    return {"case": name, "step_s": statistics.median(times), "steps_timed": len(times), "first_loss": losses[0], "last_loss": losses[-1],
            "peak_bytes": mem, "wall_s": wall}


def pytorch_worker(a):
    """One PyTorch case in this process (eager or compiled); prints one JSON line."""
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "parity"))
    import reference
    if hasattr(F, "scaled_dot_product_attention"):  # PyTorch 2.x
        reference._causal_attention = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    reference._gelu_new = lambda x: F.gelu(x, approximate="tanh")
    if hasattr(F, "rms_norm"):
        reference._rms_norm = lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps)
    m = MODELS[a.arch]
    torch.set_num_threads(a.threads)
    hf = reference.make_hf_config(m["arch"], layers=m["layers"], hidden=m["hidden"], heads=m["heads"], vocab=m["vocab"], max_pos=a.seq,
                                  kv_heads=m["kv_heads"], ffn=m["ffn"])
    cfg = reference.parse_config(hf)
    torch.manual_seed(1)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    params = {n: t.to(dev).requires_grad_(True) for n, t in reference.init_params(cfg, torch.float32, seed=1).items()}
    decay = [p for p in params.values() if p.dim() >= 2]
    rest = [p for p in params.values() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-4, betas=(0.9, 0.95),
                            eps=1e-8, **({"fused": True} if dev.type == "cuda" else {}))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[a.precision]

    def loss_of(tokens):
        with torch.autocast(dev.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            return reference.loss_fn(cfg, params, tokens)

    step_fn = torch.compile(loss_of) if a.mode == "compile" else loss_of
    g = torch.Generator().manual_seed(2)
    n = a.warmup + a.steps
    batches = torch.randint(0, m["vocab"], (n, a.batch, a.seq + 1), generator=g).to(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    t_first = time.time()
    for i in range(n):
        sync()
        t0 = time.perf_counter()
        loss = step_fn(batches[i])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        sync()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    print(json.dumps({"case": f"pytorch-{a.mode}-{a.arch}", "step_s": statistics.median(times), "steps_timed": len(times),
                      "first_loss": losses[0], "last_loss": losses[-1], "peak_bytes": torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0,
                      "wall_s": time.time() - t_first, "torch": torch.__version__}))


def run_pytorch(work, arch, mode, a):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--arch", arch, "--batch", str(a.batch), "--seq", str(a.seq),
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--precision", a.precision, "--device", a.device, "--threads", str(a.threads), "--out", work, "unused"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"case": f"pytorch-{mode}-{arch}", "error": (r.stderr or r.stdout)[-1500:]}
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("alloy")
    ap.add_argument("--out", default="gpu-bench")
    ap.add_argument("--archs", default="gpt2,llama")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to check this script without a GPU")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--cases", default="alloy,alloy-math,eager,compile", help="which of alloy, alloy-math, eager, compile")
    ap.add_argument("--worker", choices=("eager", "compile"), help=argparse.SUPPRESS)
    ap.add_argument("--arch", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.mode = a.worker
        return pytorch_worker(a)

    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_bench: no CUDA device")
    gpu = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    peak = next((p for k, p in PEAKS if k in gpu), None)
    os.makedirs(a.out, exist_ok=True)
    work = os.path.abspath(a.out)
    write_tokens(os.path.join(work, "tokens"), 50257, max(4 << 20, 2 * (a.warmup + a.steps) * a.batch * (a.seq + 1)))
    cases = a.cases.split(",")
    rows = []
    print(f"GPU: {gpu}; torch {torch.__version__}; batch {a.batch} x {a.seq} tokens, {a.precision}, median of {a.steps} steps after {a.warmup}",
          flush=True)
    for arch in a.archs.split(","):
        m = MODELS[arch]
        fpt, n_params = flops_per_token(m, a.seq)
        for case in cases:
            if case == "alloy":
                r = run_alloy(a.alloy, work, arch, a, "fused")
            elif case == "alloy-math":
                r = run_alloy(a.alloy, work, arch, a, "math")
            else:
                r = run_pytorch(work, arch, case, a)
            r.update(arch=arch, params=n_params)
            if "step_s" in r:
                r["tokens_per_s"] = a.batch * a.seq / r["step_s"]
                r["mfu"] = r["tokens_per_s"] * fpt / peak if peak else None
                mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "?"
                print(f"{r['case']:<24} {1000 * r['step_s']:8.1f} ms/step {r['tokens_per_s']:10.0f} tokens/s  MFU {mfu:>6}  "
                      f"peak {r['peak_bytes'] / 2**30:6.2f} GiB  loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}  ({r['wall_s']:.0f} s)",
                      flush=True)
            else:
                print(f"{r['case']:<24} FAILED: {r['error']}", flush=True)
            rows.append(r)
        by_case = {r["case"]: r for r in rows if r.get("arch") == arch and "step_s" in r}
        al = by_case.get(f"alloy-{arch}-fused")
        for ref in ("alloy-" + arch + "-math", "pytorch-eager-" + arch, "pytorch-compile-" + arch):
            if al and ref in by_case:
                print(f"  {arch}: Alloy's tokens/s / {ref}'s: {by_case[ref]['step_s'] / al['step_s']:.3f}", flush=True)
    with open(os.path.join(work, "gpu_bench.json"), "w") as f:
        json.dump({"gpu": gpu, "torch": torch.__version__, "peak_flops": peak, "batch": a.batch, "seq": a.seq, "precision": a.precision,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
