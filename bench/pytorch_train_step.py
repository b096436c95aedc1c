#!/usr/bin/env python3
"""Eager-PyTorch training-step baseline for Alloy's benchmark.

Builds the same GPT-2 / Llama model as the parity reference
(tests/parity/reference.py, imported so there is one definition), trains on
random token batches with AdamW + grad-norm clipping, and times each step
(forward + backward + clip + optimizer step + zero_grad) after warmup.

Prints one JSON line:
  {"impl":"pytorch","step_s_median":..,"step_s_mean":..,"steps":N,"tokens_per_s":.., ...}
tokens_per_s = batch * seq_len / step_s_median.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parity"))
import reference  # noqa: E402

# The reference spells GELU out term by term so the parity check stays independent; a PyTorch user
# training for speed calls the fused kernel, so the baseline does too.
reference._gelu_new = lambda x: torch.nn.functional.gelu(x, approximate="tanh")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=("gpt2", "llama"), required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--kv-heads", type=int, default=None, help="llama only; default = heads")
    ap.add_argument("--ffn", type=int, default=None, help="MLP width; default 4*hidden")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if args.arch == "gpt2" and args.kv_heads not in (None, args.heads):
        ap.error("gpt2 has no grouped-query attention; omit --kv-heads")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    hf = reference.make_hf_config(args.arch, layers=args.layers, hidden=args.hidden,
                                  heads=args.heads, vocab=args.vocab, max_pos=args.seq_len,
                                  kv_heads=args.kv_heads, ffn=args.ffn or 4 * args.hidden)
    cfg = reference.parse_config(hf)
    params = {n: t.requires_grad_(True)
              for n, t in reference.init_params(cfg, torch.float32, seed=args.seed).items()}
    plist = list(params.values())
    # Decay applied to every parameter (one param group), as specified for the
    # baseline; Alloy must use the same rule for the comparison to be like-for-like.
    opt = torch.optim.AdamW(plist, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    # All batches drawn up front (fixed seed) so generation is not timed.
    g = torch.Generator().manual_seed(args.seed + 1)
    n_total = args.warmup + args.steps
    batches = torch.randint(0, args.vocab, (n_total, args.batch, args.seq_len + 1), generator=g)

    times, losses, tf, tb, to = [], [], [], [], []
    for i in range(n_total):
        t0 = time.perf_counter()
        loss = reference.loss_fn(cfg, params, batches[i])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(plist, 1.0)
        opt.step()
        # set_to_none: the cheaper variant (and torch 2.x's default).
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        dt = t3 - t0
        if i >= args.warmup:
            tf.append(t1 - t0), tb.append(t2 - t1), to.append(t3 - t2)
        losses.append(loss.item())  # outside the timed region: .item() is not part of a step
        if i >= args.warmup:
            times.append(dt)

    if not all(map(lambda x: x == x and abs(x) != float("inf"), losses)):
        print(f"non-finite loss during training: {losses}", file=sys.stderr)
        return 1
    med = statistics.median(times)
    print(json.dumps({
        "impl": "pytorch",
        "step_s_median": med,
        "step_s_mean": statistics.mean(times),
        "steps": args.steps,
        "tokens_per_s": args.batch * args.seq_len / med,
        "arch": args.arch, "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
        "kv_heads": cfg.kv_heads, "ffn": cfg.ffn, "seq_len": args.seq_len,
        "vocab": args.vocab, "batch": args.batch, "threads": args.threads,
        "torch": torch.__version__, "forward_s": statistics.median(tf), "backward_s": statistics.median(tb),
        "optimizer_s": statistics.median(to), "loss_first": losses[0], "loss_last": losses[-1],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
