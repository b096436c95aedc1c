#!/usr/bin/python3
"""PyTorch DDP (Gloo) baseline: one rank of a data-parallel training job on the same model as
Alloy's benchmarks (tests/parity/reference.py), equal per-rank batches, AdamW + clipping.

Start WORLD_SIZE copies with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (Debian's torchrun
crashes on Python 3.11; bench/dp_vs_ddp.py starts them). Rank 0 prints one JSON line with the
median step time.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parity"))
import reference  # noqa: E402


class Model(torch.nn.Module):
    """Wraps the reference's functional model so DDP sees an nn.Module with parameters."""

    def __init__(self, cfg, params):
        super().__init__()
        self.cfg = cfg
        self.names = list(params)
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(params[n]) for n in self.names])

    def forward(self, tokens):
        return reference.loss_fn(self.cfg, dict(zip(self.names, self.ps)), tokens)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k in ("layers", "hidden", "heads", "seq-len", "vocab", "batch", "steps"):
        ap.add_argument("--" + k, type=int, required=True)
    ap.add_argument("--arch", default="gpt2")
    ap.add_argument("--ffn", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--fsdp", action="store_true", help="wrap the model in FullyShardedDataParallel instead of DDP")
    ap.add_argument("--powersgd-rank", type=int, default=0,
                    help="register PyTorch's PowerSGD communication hook with this rank (0: plain all-reduce)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hf = reference.make_hf_config(a.arch, layers=a.layers, hidden=a.hidden, heads=a.heads, vocab=a.vocab,
                                  max_pos=a.seq_len, ffn=a.ffn or 4 * a.hidden)
    cfg = reference.parse_config(hf)
    model = Model(cfg, reference.init_params(cfg, seed=0))
    if a.fsdp:
        from torch.distributed.fsdp import FullyShardedDataParallel
        ddp = FullyShardedDataParallel(model)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    if a.powersgd_rank > 0:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        # Error feedback and warm start as in the paper and Alloy's powersgd; compression from the
        # second step on (PyTorch needs a step of plain all-reduce first; the benchmark's warm-up
        # steps cover it).
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=a.powersgd_rank,
                                            start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(1 + rank)
    batches = torch.randint(0, a.vocab, (a.warmup + a.steps, a.batch, a.seq_len + 1), generator=g)
    times = []
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        loss = ddp(batches[i])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if i >= a.warmup:
            times.append(dt)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the job is as fast as its slowest rank
    if rank == 0:
        print(json.dumps({"impl": "pytorch-fsdp" if a.fsdp else "pytorch-ddp", "powersgd_rank": a.powersgd_rank,
                          "step_s_median": t.item(), "steps": a.steps, "world": dist.get_world_size(), "batch_per_rank": a.batch,
                          "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    else:
        print(json.dumps({"rank": rank, "step_s_median": t.item(),
                          "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
