#!/usr/bin/python3
"""Every parallel layout must reproduce the one-device loss trajectory.

Runs `alloy train` on one device, then each layout through `alloy launch` (real processes, Gloo
over loopback), and compares the per-step training loss (and validation loss) from
metrics.jsonl within a relative tolerance. usage: test_parity.py ALLOY WORKDIR [LAYOUT...]

With --devices (a CUDA build on a GPU machine, scripts/gpu-check.sh), the layouts run with ranks
placed on CUDA, or on CUDA and the CPU together (`alloy launch --devices`), against the one-device
CPU run: float32 on the GPU sums in another order, hence a looser tolerance there.
"""
import concurrent.futures
import contextlib
import io
import json
import os
import re
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distlib import fresh_workdir_with_corpus, full, plan, sh  # noqa: E402

RTOL = 1e-5
STEPS = 20





# name: (arch, global batch, plan or SynerFuse flags, world size)
LAYOUTS = {
    "dp2-equal": ("gpt2", 24, plan(24, [(12, 1, full(0)), (12, 1, full(1))]), 2),
    "dp2-6x2-2x6": ("gpt2", 24, plan(24, [(6, 2, full(0)), (2, 6, full(1))]), 2),
    "dp3-4x3-3x2-1x6": ("gpt2", 24, plan(24, [(4, 3, full(0)), (3, 2, full(1)), (1, 6, full(2))]), 3),
    "pp2-6+2-1f1b": ("gpt2", 24, plan(24, [(4, 6, [(0, 0, 6), (1, 6, 8)])]), 2),
    "pp2-6+2-gpipe": ("gpt2", 24, plan(24, [(4, 6, [(0, 0, 6), (1, 6, 8)])], "gpipe"), 2),
    "pp3-1+5+2-1f1b": ("gpt2", 24, plan(24, [(3, 8, [(0, 0, 1), (1, 1, 6), (2, 6, 8)])]), 3),
    "pp3-1+5+2-gpipe": ("gpt2", 24, plan(24, [(3, 8, [(0, 0, 1), (1, 1, 6), (2, 6, 8)])], "gpipe"), 3),
    "mixed-5+3_and_8": ("gpt2", 24, plan(24, [(4, 4, [(0, 0, 5), (1, 5, 8)]), (2, 4, full(2))]), 3),
    "mixed-llama": ("llama", 24, plan(24, [(4, 4, [(0, 0, 5), (1, 5, 8)]), (2, 4, full(2))]), 3),
    "synerfuse-pp": ("gpt2", 24, ["--num-layers", "8", "--pipeline-model-parallel-size", "2",
                                  "--hetero-pipeline-stages", "1", "6", "1", "2", "--micro-batch-size", "4"], 2),
    "synerfuse-dp": ("gpt2", 32, ["--global-batch-size", "32", "--use-tp-pp-dp-mapping",
                                  "--micro-batch-size-per-dp", "1", "6", "1", "2",
                                  "--num-micro-batches-per-dp", "1", "4", "1", "4"], 2),
}
# ZeRO (sharded optimizer state, and gradients at stage 2), even and uneven shards: (layout above,
# flags). The pipeline cases shard each stage's replicas and GPT-2's tied embedding, which the
# first and last stages hold together.
ZERO = {
    "zero1-dp2-even": ("dp2-6x2-2x6", ["--zero-stage", "1"]),
    "zero2-dp2-3:1": ("dp2-6x2-2x6", ["--zero-stage", "2", "--shard-ratio", "3", "1"]),
    "zero1-dp3-3:2:1": ("dp3-4x3-3x2-1x6", ["--zero-stage", "1", "--shard-ratio", "3", "2", "1"]),
    "zero2-dp3-even": ("dp3-4x3-3x2-1x6", ["--zero-stage", "2"]),
    "zero2-mixed-pp-uneven": ("mixed-5+3_and_8", ["--zero-stage", "2", "--shard-ratio", "3", "1", "2"]),
    "distopt-synerfuse-pp": ("synerfuse-pp", ["--use-distributed-optimizer"]),
}
for _name, (_base, _flags) in ZERO.items():
    _arch, _gb, _layout, _world = LAYOUTS[_base]
    LAYOUTS[_name] = (_arch, _gb, _layout, _world, _flags)
# Per group, from the plan file: blocks 0-4 (ranks 0 and 2) ZeRO-2 at 3:1, the tied embedding
# (all three) ZeRO-1 even, blocks 5-7 (ranks 1 and 2) unsharded.
_per_group = dict(LAYOUTS["mixed-5+3_and_8"][2], version=2,
                  sharding=[{"ranks": [0, 2], "stage": 2, "shares": [3, 1]}, {"ranks": [0, 1, 2], "stage": 1}])
LAYOUTS["zero-plan-per-group"] = ("gpt2", 24, _per_group, 3)
# Recomputation: every stage (--recompute), and one stage of a plan beside ZeRO-2.
LAYOUTS["recompute-pp2"] = LAYOUTS["pp2-6+2-1f1b"][:4] + (["--recompute"],)
_rec = json.loads(json.dumps(LAYOUTS["mixed-5+3_and_8"][2]))
_rec["version"] = 2
_rec["pipelines"][0]["stages"][0]["recompute"] = True
LAYOUTS["recompute-stage-zero2"] = ("gpt2", 24, _rec, 3, ["--zero-stage", "2"])
# ZeRO-3: the members of a sharded group gather every layer in their own schedules, so they run
# the same number of micro-batches (of unlike sizes: heterogeneous replicas, 3:1 and 2:1:1 of the
# batch). In the pipelines the tied embedding, held by first and last stages, falls back to ZeRO-2.
LAYOUTS["dp2-9x2-3x2"] = ("gpt2", 24, plan(24, [(9, 2, full(0)), (3, 2, full(1))]), 2)
LAYOUTS["dp3-4x3-2x3-2x3"] = ("gpt2", 24, plan(24, [(4, 3, full(0)), (2, 3, full(1)), (2, 3, full(2))]), 3)
LAYOUTS["pp2x2-4x4-2x4"] = ("gpt2", 24, plan(24, [(4, 4, [(0, 0, 5), (1, 5, 8)]), (2, 4, [(2, 0, 5), (3, 5, 8)])]), 4)
for _name, _base, _flags in (
        ("zero3-dp2-even", "dp2-equal", ["--zero-stage", "3"]),
        ("zero3-dp2-3:1", "dp2-9x2-3x2", ["--zero-stage", "3", "--shard-ratio", "3", "1"]),
        ("zero3-dp3-even", "dp3-4x3-2x3-2x3", ["--zero-stage", "3"]),
        ("zero3-dp3-3:2:1", "dp3-4x3-2x3-2x3", ["--zero-stage", "3", "--shard-ratio", "3", "2", "1"]),
        ("zero3-recompute-dp2", "dp2-9x2-3x2", ["--zero-stage", "3", "--recompute"]),
        ("zero3-pp2-hetero", "pp2x2-4x4-2x4", ["--zero-stage", "3", "--shard-ratio", "3", "1", "1", "2"])):
    LAYOUTS[_name] = LAYOUTS[_base][:4] + (_flags,)

# Pipeline boundaries inside blocks (plan version 3, "units" in half blocks of 16): 5.5 + 2.5 blocks
# beside a full replica (GPT-2, its tied embedding split between the pipeline's ends); LLaMA (GQA)
# on 1.5 + 3.5 + 3; the first with ZeRO-2 at 3:1:2 and recomputation on top.


def _units(layout, cuts):
    """LAYOUT (a plan dict) with pipeline 0's stages cut at the half-block units CUTS."""
    out = json.loads(json.dumps(layout))
    out["version"] = 3
    bounds = [0] + list(cuts) + [16]
    for st, b, e in zip(out["pipelines"][0]["stages"], bounds, bounds[1:]):
        st["units"] = [b, e]
        st.pop("layers", None)
    return out


LAYOUTS["halves-mixed-11+5_and_16"] = ("gpt2", 24, _units(LAYOUTS["mixed-5+3_and_8"][2], [11]), 3)
LAYOUTS["halves-llama-pp3-3+7+6"] = ("llama", 24, _units(plan(24, [(3, 8, [(0, 0, 1), (1, 1, 5), (2, 5, 8)])]), [3, 10]), 3)
LAYOUTS["halves-zero2-recompute"] = LAYOUTS["halves-mixed-11+5_and_16"][:4] + (
    ["--zero-stage", "2", "--shard-ratio", "3", "1", "2", "--recompute"],)

# Floating boundaries (plan version 5): two neighbouring stages share the half block where they
# meet and the first runs it in float_share of the micro-batches (the shared unit's gradients sum
# over its two holders). 6 / 5.5 blocks beside a full replica (2 of 4 micro-batches), the first
# again under ZeRO-2 at 3:1:2 with recomputation; LLaMA on three stages whose middle one shares
# both its ends, on GPipe.


def _floating(layout, units, shares, schedule=None):
    """LAYOUT with pipeline 0's stages holding UNITS (half blocks) and the float_shares SHARES."""
    out = json.loads(json.dumps(layout))
    out["version"] = 5
    if schedule:
        out["schedule"] = schedule
    for st, (b, e), share in zip(out["pipelines"][0]["stages"], units, shares + [0]):
        st["units"] = [b, e]
        st.pop("layers", None)
        if share:
            st["float_share"] = share
    return out


LAYOUTS["float-mixed-12x11_and_16"] = ("gpt2", 24, _floating(LAYOUTS["mixed-5+3_and_8"][2], [(0, 12), (11, 16)], [0.5]), 3)
LAYOUTS["float-zero2-recompute"] = LAYOUTS["float-mixed-12x11_and_16"][:4] + (
    ["--zero-stage", "2", "--shard-ratio", "3", "1", "2", "--recompute"],)
LAYOUTS["float-llama-pp3-gpipe"] = ("llama", 24, _floating(plan(24, [(3, 8, [(0, 0, 1), (1, 1, 5), (2, 5, 8)])]),
                                                           [(0, 4), (3, 11), (10, 16)], [0.375, 0.5], "gpipe"), 3)

# Boundaries inside an MLP (plan version 8): the two stages share the MLP half where they meet, the
# first computing the columns of mlp_cut of the 4 heads, the second the rest, in every micro-batch;
# the message across is the residual and the first's partial output side by side. GPT-2 cut in
# block 5's MLP beside a full replica (which holds that MLP as the same two pieces), again under
# ZeRO-2 at 3:1:2 with recomputation; LLaMA on three stages whose middle one starts and ends inside
# an MLP, on ZB-H1.


def _cut(layout, units, cuts, schedule=None):
    """LAYOUT with pipeline 0's stages holding UNITS (half blocks) and the mlp_cuts CUTS."""
    out = json.loads(json.dumps(layout))
    out["version"] = 8
    if schedule:
        out["schedule"] = schedule
    for st, (b, e), k in zip(out["pipelines"][0]["stages"], units, cuts + [0]):
        st["units"] = [b, e]
        st.pop("layers", None)
        if k:
            st["mlp_cut"] = k
    return out


LAYOUTS["cut-mixed-12x11_and_16"] = ("gpt2", 24, _cut(LAYOUTS["mixed-5+3_and_8"][2], [(0, 12), (11, 16)], [1]), 3)
LAYOUTS["cut-zero2-recompute"] = LAYOUTS["cut-mixed-12x11_and_16"][:4] + (
    ["--zero-stage", "2", "--shard-ratio", "3", "1", "2", "--recompute"],)
LAYOUTS["cut-llama-pp3-zb"] = ("llama", 24, _cut(plan(24, [(3, 8, [(0, 0, 1), (1, 1, 5), (2, 5, 8)])]),
                                                 [(0, 4), (3, 12), (11, 16)], [3, 2], "zb-h1"), 3)

# Zero-bubble ZB-H1 (pipeline/schedule.h): the blocks' weight gradients in weight passes held back
# by each stage's position; the last pass's through the reducer. GPT-2 on three stages, LLaMA (GQA)
# in a pipeline beside a replica, and the floating plan under ZeRO-2 at 3:1:2 with recomputation.


def _schedule(layout, schedule):
    out = json.loads(json.dumps(layout))
    out["schedule"] = schedule
    return out


def _per_pipeline(layout, schedules):
    """LAYOUT with pipeline i on SCHEDULES[i] (plan version 6), the plan's own schedule 1f1b."""
    out = json.loads(json.dumps(layout))
    out["version"] = 6
    for pl, sched in zip(out["pipelines"], schedules):
        pl["schedule"] = sched
    return out


LAYOUTS["zb-pp3-1+5+2"] = ("gpt2", 24, _schedule(LAYOUTS["pp3-1+5+2-1f1b"][2], "zb-h1"), 3)
LAYOUTS["zb-mixed-llama"] = ("llama", 24, _schedule(LAYOUTS["mixed-llama"][2], "zb-h1"), 3)
# Schedules per pipeline: two 2-stage pipelines of unlike micro-batch sizes, one on zb-h1 and
# one on GPipe; their gradients meet in the same holder-set syncs.
LAYOUTS["zb-per-pipeline"] = ("gpt2", 24, _per_pipeline(LAYOUTS["pp2x2-4x4-2x4"][2], ["zb-h1", "gpipe"]), 4)
# Eager 1F1B (one more forward in flight per stage): GPT-2 on three stages; and with three more
# (eager-1f1b-3, for distant links) on the cut inside an MLP beside a replica under ZeRO-1.
LAYOUTS["eager-pp3-1+5+2"] = ("gpt2", 24, _schedule(LAYOUTS["pp3-1+5+2-1f1b"][2], "eager-1f1b"), 3)
LAYOUTS["eager-cut-zero1"] = ("gpt2", 24, _schedule(LAYOUTS["cut-mixed-12x11_and_16"][2], "eager-1f1b-3"), 3, ["--zero-stage", "1"])
LAYOUTS["zb-float-zero2-recompute"] = ("gpt2", 24, _schedule(LAYOUTS["float-mixed-12x11_and_16"][2], "zb-h1"), 3,
                                       ["--zero-stage", "2", "--shard-ratio", "3", "1", "2", "--recompute"])

# Interleaved virtual stages (plan version 10, schedule interleaved-1f1b): the pipeline's stages list
# its S x V chunks in layer order, chunk c on the rank of chunk c mod S. GPT-2 on two ranks with
# uneven chunks (3 + 1 + 3 + 1 blocks; the tied embedding and head on unlike ranks); LLaMA on
# three ranks whose chunks meet inside blocks (half-block units), beside a replica.


def _interleaved(gb, mbs, nmb, ranks, units, virtual, extra=()):
    chunks = [{"ranks": [ranks[c % len(ranks)]], "units": list(u),
               "layers": [u[0] // 2, (u[1] + 1) // 2]} for c, u in enumerate(units)]
    pipelines = [{"micro_batch_size": mbs, "num_micro_batches": nmb, "virtual_stages": virtual, "stages": chunks}]
    pipelines += [{"micro_batch_size": m, "num_micro_batches": n, "schedule": "1f1b",
                   "stages": [{"ranks": [r], "layers": [b, e]} for r, b, e in st]} for m, n, st in extra]
    return {"format": "alloy-plan", "version": 10, "global_batch": gb, "schedule": "interleaved-1f1b",
            "pipelines": pipelines}


LAYOUTS["interleaved-pp2-v2"] = ("gpt2", 24, _interleaved(24, 3, 8, [0, 1], [(0, 6), (6, 8), (8, 14), (14, 16)], 2), 2)
# Megatron's flag for the same: 8 layers on 2 stages in chunks of 2 (two chunks a rank).
LAYOUTS["synerfuse-interleaved"] = ("gpt2", 24, ["--num-layers", "8", "--pipeline-model-parallel-size", "2",
                                                 "--num-layers-per-virtual-pipeline-stage", "2", "--micro-batch-size", "4"], 2)
LAYOUTS["interleaved-llama-pp3-v2-dp"] = (
    "llama", 24, _interleaved(24, 2, 6, [0, 1, 2], [(0, 3), (3, 6), (6, 8), (8, 11), (11, 14), (14, 16)], 2,
                              extra=[(2, 6, full(3))]), 4)

# Tensor parallelism (plan version 4): a stage's ranks split the heads (tp_split, MLP columns in
# the same ratio), evenly and unevenly; GQA (8 heads, 4 key/value heads: whole groups per rank);
# inside a pipeline, with a pipeline of two TP stages, and beside a replica without TP (whose
# gradients sum with the pieces'), that one with ZeRO-1 across the pieces' holders too.


def _tp(gb, pipelines, schedule="1f1b"):
    """pipelines: [(mbs, nmb, [(ranks, begin, end, tp_split or None), ...]), ...]"""
    p = {"format": "alloy-plan", "version": 4, "global_batch": gb, "schedule": schedule, "pipelines": []}
    for m, n, stages in pipelines:
        sts = []
        for ranks, b, e, split in stages:
            st = {"ranks": ranks, "layers": [b, e]}
            if split:
                st["tp_split"] = split
            sts.append(st)
        p["pipelines"].append({"micro_batch_size": m, "num_micro_batches": n, "stages": sts})
    return p


LAYOUTS["tp2-even"] = ("gpt2", 24, _tp(24, [(4, 6, [([0, 1], 0, 8, None)])]), 2)
LAYOUTS["tp2-3:1"] = ("gpt2", 24, _tp(24, [(4, 6, [([0, 1], 0, 8, [3, 1])])]), 2)
LAYOUTS["tp3-2:1:1"] = ("gpt2", 24, _tp(24, [(4, 6, [([0, 1, 2], 0, 8, [2, 1, 1])])]), 3)
LAYOUTS["tp2-llama-gqa-6:2"] = ("llama-gqa", 24, _tp(24, [(4, 6, [([0, 1], 0, 8, [6, 2])])]), 2)
# Qwen2's block (biases on q, k and v): each member holds its heads' pieces of the biases too.
LAYOUTS["tp2-qwen2-gqa-6:2"] = ("qwen2-gqa", 24, _tp(24, [(4, 6, [([0, 1], 0, 8, [6, 2])])]), 2)
LAYOUTS["tp3-llama-gqa-even"] = ("llama-gqa", 24, _tp(24, [(4, 6, [([0, 1, 2], 0, 8, [4, 2, 2])])]), 3)
LAYOUTS["tp2-in-pp2"] = ("gpt2", 24, _tp(24, [(4, 6, [([0, 1], 0, 5, [3, 1]), ([2], 5, 8, None)])]), 3)
LAYOUTS["tp-pp-tp-llama"] = ("llama-gqa", 24, _tp(24, [(4, 6, [([0, 1], 0, 3, [2, 6]), ([2, 3], 3, 8, [4, 4])])]), 4)
LAYOUTS["tp2-beside-replica"] = ("gpt2", 24, _tp(24, [(4, 4, [([0, 1], 0, 8, [3, 1])]), (2, 4, [([2], 0, 8, None)])]), 3)
LAYOUTS["synerfuse-tp2-pp2"] = ("gpt2", 24, ["--num-layers", "8", "--pipeline-model-parallel-size", "2",
                                             "--tensor-model-parallel-size", "2", "--tp-split", "3", "1",
                                             "--hetero-pipeline-stages", "1", "5", "1", "3", "--micro-batch-size", "4"], 4)
LAYOUTS["tp2-beside-replica-zero1"] = LAYOUTS["tp2-beside-replica"] + (["--zero-stage", "1"],)
# Sequence parallelism: the whole model as a 3:1 group (positions 24:8), a pipeline of two LLaMA
# groups (the stage edges gather and cut), a group beside a replica with recomputation.
LAYOUTS["tp2-3:1-sp"] = LAYOUTS["tp2-3:1"] + (["--sequence-parallel"],)
LAYOUTS["tp-pp-tp-llama-sp"] = LAYOUTS["tp-pp-tp-llama"] + (["--sequence-parallel"],)
LAYOUTS["tp2-beside-replica-zero3"] = LAYOUTS["tp2-beside-replica"] + (["--zero-stage", "3", "--shard-ratio", "2", "1", "1"],)
LAYOUTS["tp2-3:1-zero3-sp"] = LAYOUTS["tp2-3:1"] + (["--zero-stage", "3", "--sequence-parallel"],)
LAYOUTS["tp2-beside-replica-sp-recompute"] = LAYOUTS["tp2-beside-replica"] + (["--sequence-parallel", "--recompute"],)


def _sp_in_plan(layout):
    """LAYOUT with sequence_parallel on its tensor-parallel stages in the plan itself (version 7),
    as the planner writes it where a group fits memory only with it."""
    p = json.loads(json.dumps(layout))
    p["version"] = 7
    for pl in p["pipelines"]:
        for st in pl["stages"]:
            if len(st["ranks"]) > 1:
                st["sequence_parallel"] = True
    return p


LAYOUTS["tp2-in-pp2-sp-plan"] = ("gpt2", 24, _sp_in_plan(LAYOUTS["tp2-in-pp2"][2]), 3)
# zb-h1 with tensor-parallel stages: a group's members defer their pieces' weight gradients to the
# same weight passes (no sum in them), the input gradients' sums stay in the backward.
LAYOUTS["zb-pp2-tp2-3:1"] = ("gpt2", 24, _schedule(_tp(24, [(4, 6, [([0], 0, 3, None), ([1, 2], 3, 8, [3, 1])])]), "zb-h1"), 3)
LAYOUTS["zb-tp-pp-tp-llama-sp"] = ("llama-gqa", 24, _schedule(LAYOUTS["tp-pp-tp-llama"][2], "zb-h1"), 4, ["--sequence-parallel"])

# name: (layout above, or None for one rank training alone; device of each rank). Compared with
# the one-device run on the CPU.
DEVICE_LAYOUTS = {
    "cuda": (None, ["cuda"]),
    "cuda-dp2": ("dp2-6x2-2x6", ["cuda", "cuda"]),
    "cuda-pp2": ("pp2-6+2-1f1b", ["cuda", "cuda"]),
    "cuda+cpu-dp2": ("dp2-6x2-2x6", ["cuda", "cpu"]),
    "cuda+cpu-pp2": ("pp2-6+2-1f1b", ["cpu", "cuda"]),
    "cuda+cpu-mixed": ("mixed-5+3_and_8", ["cuda", "cpu", "cpu"]),
    # One rank alone of another model ("@arch"): grouped key/value heads through the fused
    # attention (LibTorch 2.5's enable_gqa) against the CPU's written-out attention.
    "cuda-llama-gqa": ("@llama-gqa", ["cuda"]),
    # Two CUDA ranks with their messages on channels (ALLOY_PIPE_CHANNELS=gloo: staged through the
    # host, as one GPU cannot hold two NCCL ranks; on two GPUs cuda-pp2 takes NCCL channels).
    "cuda-pp2-ch": ("pp2-6+2-1f1b", ["cuda", "cuda"]),
}
RTOL_GPU = 1e-4


def config(work, arch, gb, out):
    path = os.path.join(work, os.path.basename(out) + ".yaml")  # one per run: runs go side by side
    # llama-gqa: 8 heads reading 4 key/value heads (tensor-parallel splits keep whole groups)
    heads = "heads: 8, kv_heads: 4" if arch.endswith("-gqa") else "heads: 4"
    # qwen2: the llama with biases on q, k and v
    model = arch.replace("-gqa", "").replace("qwen2", "llama") + (", qkv_bias: true" if arch.startswith("qwen2") else "")
    with open(path, "w") as f:
        f.write(f"""model: {{arch: {model}, layers: 8, hidden: 32, {heads}, seq_len: 32, vocab_size: 257}}
data: {{prefix: {work}/data/corpus}}
train: {{steps: {STEPS}, global_batch: {gb}, lr: 2e-3, warmup: 3, eval_interval: 10, eval_batches: 1, threads: 1}}
output: {{dir: {out}, tensorboard: false}}
""")
    return path


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    return [(r["step"], r["loss"], r.get("val_loss")) for r in rows]


def shares_followed(out, flags):
    """Data parallel with ZeRO: each rank keeps AdamW's two moments for its share of the model, and
    under ZeRO-3 that share of the parameters too (between steps)."""
    ratio = [1.0] * 8
    if "--shard-ratio" in flags:
        ratio = [float(x) for x in flags[flags.index("--shard-ratio") + 1:] if not x.startswith("--")]
    zero3 = flags[flags.index("--zero-stage") + 1] == "3"
    with open(os.path.join(out, "ranks.json")) as f:
        ranks = sorted(json.load(f), key=lambda r: r["rank"])
    ratio = ratio[:len(ranks)]
    # A replica's parameter bytes: each rank's own under ZeRO-1/2, all shards together under ZeRO-3.
    whole = sum(r["param_bytes"] for r in ranks) if zero3 else None
    ok = True
    for r, share in zip(ranks, ratio):
        replica = whole or r["param_bytes"]
        want = share / sum(ratio)
        for what, got in (("optimizer state", r["optimizer_state_bytes"] / (2 * replica)),
                          ("parameters", r["param_bytes"] / replica if zero3 else None),
                          ("gradients", r["grad_bytes"] / replica if zero3 else None)):
            if got is None:
                continue
            good = abs(got - want) <= 0.05 * want
            ok = ok and good
            print(f"     rank {r['rank']}: {what} {got:.4f} of a replica's, share asked {want:.4f}"
                  f"{'' if good else '  <- off by more than 5%'}")
    return ok


def tp_split_held(out, single, layout):
    """Each rank of a tensor-parallel stage holding the whole model keeps only its heads' pieces:
    less than the one-device model, and more where it has more heads."""
    def bytes_of(d):
        with open(os.path.join(d, "ranks.json")) as f:
            return {r["rank"]: r["param_bytes"] for r in json.load(f)}
    whole, held = bytes_of(single)[0], bytes_of(out)
    ok = True
    for pl in layout["pipelines"]:
        for st in pl["stages"]:
            if len(st["ranks"]) < 2 or st["layers"] != [0, 8]:
                continue
            split = st.get("tp_split") or [1] * len(st["ranks"])
            got = [held[r] for r in st["ranks"]]
            # More heads, more bytes; equal heads, equal bytes but for a vocabulary row or so.
            good = all(b < whole for b in got) and all(
                got[i] > got[j] if split[i] > split[j] else abs(got[i] - got[j]) <= 0.02 * got[j] if split[i] == split[j] else True
                for i in range(len(got)) for j in range(len(got)) if i != j)
            ok = ok and good
            print(f"     ranks {st['ranks']} heads {split}: parameter bytes {got} (one device: {whole})"
                  f"{'' if good else '  <- not split as asked'}")
    return ok


def tp_sums_reported(out, layout):
    """ranks.json: every member of a tensor-parallel stage reports the time its group's exchanges
    took per step, more than nothing and less than its step; ranks outside such stages report none."""
    tp_ranks = {r for pl in layout["pipelines"] for st in pl["stages"] if len(st["ranks"]) > 1 for r in st["ranks"]}
    with open(os.path.join(out, "ranks.json")) as f:
        ranks = json.load(f)
    ok = True
    for r in ranks:
        got = r.get("tp_comm_s_median")
        good = (got is not None and 0 < got < r["step_s_median"]
                and len(r.get("steps_tp_comm_s", [])) == len(r["steps_step_compute_syncwait_s"])
                if r["rank"] in tp_ranks else got is None)
        ok = ok and good
        if not good:
            print(f"     rank {r['rank']}: tp_comm_s_median {got} (step {r['step_s_median']:.4f} s)  <- "
                  f"{'tensor-parallel sums not reported' if r['rank'] in tp_ranks else 'sums reported outside a group'}")
    return ok


# What a layout is for, against the layout it extends (when that ran in the same invocation): the
# figure of ranks.json that must fall on each of the ranks listed.
# {rank: the most this layout may have, as a fraction of the other's}. Parameter bytes are counted
# exactly; peak activations are the process heap's high-water mark, which other threads' buffers
# move by a few tens of KB (about 1%), so the bounds leave room: measured 0.966 and 0.776 for the
# 3:1 group, 0.747, 0.956, 0.878 and 0.877 for the two LLaMA groups.
SHRINKS = {
    "tp2-3:1-sp": ("tp2-3:1", "peak_activation_bytes", {0: 1.0, 1: 0.9}),
    "tp2-in-pp2-sp-plan": ("tp2-in-pp2", "peak_activation_bytes", {0: 1.0, 1: 0.9, 2: 1.02}),
    "tp-pp-tp-llama-sp": ("tp-pp-tp-llama", "peak_activation_bytes", {0: 0.9, 1: 1.0, 2: 0.95, 3: 0.95}),
    "tp2-beside-replica-zero3": ("tp2-beside-replica", "param_bytes", {0: 0.99, 1: 0.99, 2: 0.99}),
    "tp2-3:1-zero3-sp": ("tp2-3:1", "param_bytes", {0: 0.99, 1: 0.99}),
}


def shrank(base_dir, out, key, at_most):
    def figure(d):
        with open(os.path.join(d, "ranks.json")) as f:
            return {r["rank"]: r[key] for r in json.load(f)}
    a, b = figure(base_dir), figure(out)
    ok = all(b[r] <= f * a[r] for r, f in at_most.items())
    print(f"     {key} per rank, {os.path.basename(base_dir)} -> this: " +
          ", ".join(f"{a[r]} -> {b[r]} ({b[r] / a[r]:.3f}, at most {f})" for r, f in at_most.items()) +
          ("" if ok else "  <- did not fall"))
    return ok


def activations_shrank(plain, recomputed):
    """Recomputation keeps each block's input only: every rank's peak activation memory falls."""
    def peaks(d):
        with open(os.path.join(d, "ranks.json")) as f:
            return [r["peak_activation_bytes"] for r in sorted(json.load(f), key=lambda r: r["rank"])]
    a, b = peaks(plain), peaks(recomputed)
    print("     peak activation MiB per rank, plain -> recomputed: "
          + ", ".join(f"{x / 2**20:.2f} -> {y / 2**20:.2f}" for x, y in zip(a, b)))
    return all(y < x for x, y in zip(a, b))


# Exact sums along a tree around slow links (grad_sync.allreduce auto, core/sync_tree.h): the plan
# names the slow pairs as `alloy plan` writes them from a cluster. Three replicas with the 3-device
# pool's slow pair (a chain through rank 1), the same under ZeRO-1 at 3:2:1 (the gather stays on
# Gloo), a pipeline beside a replica whose tied embedding's three holders go around the slow pair
# 1-2 (the pairs keep their rings), and four replicas in two regions (one slow edge).
LAYOUTS["tree-dp3"] = ("gpt2", 24, plan(24, [(4, 3, full(0)), (3, 2, full(1)), (1, 6, full(2))], slow_links=[[0, 2]]), 3)
LAYOUTS["tree-dp3-zero1"] = LAYOUTS["tree-dp3"] + (["--zero-stage", "1", "--shard-ratio", "3", "2", "1"],)
LAYOUTS["tree-mixed"] = ("gpt2", 24, plan(24, [(4, 4, [(0, 0, 5), (1, 5, 8)]), (2, 4, full(2))], slow_links=[[1, 2]]), 3)
LAYOUTS["tree-dp4-regions"] = ("gpt2", 24, plan(24, [(3, 2, full(0)), (3, 2, full(1)), (2, 3, full(2)), (1, 6, full(3))],
                                                slow_links=[[0, 2], [0, 3], [1, 2], [1, 3]]), 4)

# Short last micro-batches (PipelinePlan::last_micro_batch_size, plan version 9): three replicas
# of 13 (4 x 4, the last of 1), 7 (3 x 3, the last of 1) and 4 samples, summed along the tree; and
# a 2-stage pipeline of 5 x 5 (the last of 4), whose last messages between the stages are short.


def _short_last(p, lasts):
    p = json.loads(json.dumps(p))
    p["version"] = 9
    for pl, last in zip(p["pipelines"], lasts):
        if last:
            pl["last_micro_batch_size"] = last
    return p


LAYOUTS["short-dp3"] = ("gpt2", 24, _short_last(plan(24, [(4, 4, full(0)), (3, 3, full(1)), (4, 1, full(2))],
                                                     slow_links=[[0, 2]]), [1, 1, 0]), 3)
LAYOUTS["short-pp2"] = ("gpt2", 24, _short_last(plan(24, [(5, 5, [(0, 0, 6), (1, 6, 8)])]), [4]), 2)
# With tensor parallelism: a 3:1 group of 16 samples (5 x 4, the last of 1) beside a replica of 8
# under ZeRO-3 (the members gather per micro-batch, the same count of them); a 3:1 group under
# sequence parallelism (5 x 5, the last of 4: its positions cut, its rows short).
LAYOUTS["short-tp-beside-replica-zero3"] = (
    "gpt2", 24, _short_last(_tp(24, [(5, 4, [([0, 1], 0, 8, [3, 1])]), (2, 4, [([2], 0, 8, None)])]), [1, 0]), 3,
    ["--zero-stage", "3", "--shard-ratio", "2", "1", "1"])
LAYOUTS["short-tp2-3:1-sp"] = ("gpt2", 24, _short_last(_tp(24, [(5, 5, [([0, 1], 0, 8, [3, 1])])]), [4]), 2,
                               ["--sequence-parallel"])


# Pipeline messages on one-way channels (dist/pipe_channels.h), as between GPUs with NCCL, here on
# Gloo pairs (ALLOY_PIPE_CHANNELS=gloo): each channel a FIFO that matches by order, not by tag.
# 1F1B's crossing streams at a middle stage, a short last micro-batch, interleaved chunks between
# the same two ranks, and a tensor-parallel stage relaying to its members under zb-h1.
CHANNELS = {"ch-pp3-1+5+2-1f1b": "pp3-1+5+2-1f1b", "ch-short-pp2": "short-pp2",
            "ch-interleaved-pp2-v2": "interleaved-pp2-v2", "ch-zb-pp2-tp2-3:1": "zb-pp2-tp2-3:1"}
for _name, _base in CHANNELS.items():
    LAYOUTS[_name] = LAYOUTS[_base]
ON_CHANNELS = set(CHANNELS) | {"cuda-pp2-ch"}


# How many channels each rank of a ch-* layout opens (counted by hand from its links: one per
# one-way stream it sends or receives; a relaying TP member also sends what it received on).
CHANNEL_COUNTS = {"ch-pp3-1+5+2-1f1b": {0: 2, 1: 4, 2: 2}, "ch-short-pp2": {0: 2, 1: 2},
                  # two chunks a rank: activations and gradients each way between every chunk pair
                  "ch-interleaved-pp2-v2": {0: 6, 1: 6},
                  # rank 1 receives from 0, sends gradients back, relays activations to its TP peer 2
                  "ch-zb-pp2-tp2-3:1": {0: 2, 1: 3, 2: 1}}


def pipeline_ranks(layout):
    return {r for pl in layout["pipelines"] if len(pl["stages"]) > 1 for st in pl["stages"] for r in st["ranks"]}


def channels_used(output, name, layout):
    """Every rank of a pipeline carries its messages on as many Gloo channels as its links need
    (a stream without one is an error in the executor, so none fell back to tags)."""
    said = {}
    for l in output.splitlines():
        m = re.search(r"\[rank (\d+)\].*pipeline messages: (\d+) Gloo channel\(s\)", l)
        if m:
            said[int(m.group(1))] = int(m.group(2))
            print("     " + l.strip())
    expected = CHANNEL_COUNTS.get(name, {r: None for r in pipeline_ranks(layout)})
    ok = set(said) == set(expected) and len(said) > 0 and all(n is None or said[r] == n for r, n in expected.items())
    print(f"     channels per rank {dict(sorted(said.items()))}" + ("" if ok else f"  <- expected {expected}"))
    return ok


# Ranks started differently must all stop before the first step, naming the odd rank and how it
# differs, instead of waiting on a channel a neighbour never opens or training on another config:
# (rank 1's prefix, rank 1's extra flags, what the error must say).
MISMATCHES = {
    "mismatch-channels": ("ALLOY_PIPE_CHANNELS=off", [],
                          "rank(s) 1 hold a different ALLOY_PIPE_CHANNELS than rank 0 ('off' against 'gloo')"),
    "mismatch-config": ("", ["--set", "train.lr=1e-3"],
                        "rank(s) 1 hold a different config and plan than rank 0 (first difference at /train/lr: 0.001 against 0.002)"),
}


def mismatched_start(alloy, work, env, name):
    """Two pipeline ranks, rank 1 started differently (MISMATCHES): (ok, report)."""
    prefix, flags, expected = MISMATCHES[name]
    arch, gb, layout = LAYOUTS["ch-short-pp2"][:3]
    out = os.path.join(work, name)
    plan_path = os.path.join(work, name + ".json")
    with open(plan_path, "w") as f:
        json.dump(layout, f)
    odd = f'if [ "$RANK" = 1 ]; then exec env {prefix} "$@" {" ".join(flags)}; fi; exec "$@"'
    run = sh([alloy, "launch", "--nproc", "2", "--threads-per-rank", "1", "--", "sh", "-c", odd, "sh",
              alloy, "train", "--config", config(work, arch, gb, out), "--plan", plan_path, "--timeout", "60"],
             expect_fail=True, env=dict(env, ALLOY_PIPE_CHANNELS="gloo"))
    text = run.stdout + run.stderr
    said = sum(1 for l in text.splitlines() if expected in l)
    trained = os.path.exists(os.path.join(out, "metrics.jsonl")) and bool(losses(out))
    ok = said == 2 and not trained  # both ranks say it; neither trained a step
    head = f"{'ok  ' if ok else 'FAIL'} {name:<18} both ranks stopped before a step: {said} of 2 said it" + \
           (", but a step was trained" if trained else "")
    return ok, head + ("" if ok else f"\n     expected: {expected}\n" + "\n".join("     " + l for l in text.splitlines()[-12:]))


RESHARD_CHAINS = {
    # steps 1-10 under ZeRO-2 with 3:1:2 shards in a 2-stage pipeline with a floating boundary (its
    # two stages share block 5's MLP half) beside a full replica, then steps 11-20 on three full replicas, ZeRO-1, even shards
    "reshard": [("reshard-a", "float-mixed-12x11_and_16", ["--zero-stage", "2", "--shard-ratio", "3", "1", "2"], 10),
                ("reshard-b", "dp3-4x3-3x2-1x6", ["--zero-stage", "1"], 20)],
    # tensor parallelism in and out: a 3:1 TP stage in a pipeline (1-10), two replicas without TP
    # (11-15), a 2:1:1 TP group (16-20)
    "reshard-tp": [("reshard-tp-a", "tp2-in-pp2", [], 10), ("reshard-tp-b", "dp2-6x2-2x6", [], 15),
                   ("reshard-tp-c", "tp3-2:1:1", [], 20)],
    # the same under ZeRO-1, whose optimizer state is saved in slices of the pieces and of whole
    # tensors: a 3:1 TP group beside a replica (1-7), two replicas (8-14), a 2:1:1 group (15-20)
    "reshard-tp-zero": [("reshard-tp-zero-a", "tp2-beside-replica", ["--zero-stage", "1"], 7),
                        ("reshard-tp-zero-b", "dp2-6x2-2x6", ["--zero-stage", "1"], 14),
                        ("reshard-tp-zero-c", "tp3-2:1:1", ["--zero-stage", "1"], 20)],
    # a cut MLP in and out: two replicas (1-7), a 3:1 TP stage in a pipeline, whose pieces split
    # block 5 at heads 3 (8-14), block 5's MLP cut at head 1 beside a replica, ZeRO-1 (15-20)
    "reshard-cut": [("reshard-cut-a", "dp2-6x2-2x6", [], 7), ("reshard-cut-b", "tp2-in-pp2", [], 14),
                    ("reshard-cut-c", "cut-mixed-12x11_and_16", ["--zero-stage", "1"], 20)],
    # interleaved chunks in and out: a 1F1B pipeline (1-7), the same ranks in 3+1+3+1-block chunks
    # (8-14), two replicas (15-20)
    "reshard-interleaved": [("reshard-il-a", "pp2-6+2-1f1b", [], 7), ("reshard-il-b", "interleaved-pp2-v2", [], 14),
                            ("reshard-il-c", "dp2-6x2-2x6", [], 20)],
}


def exported_whole(alloy, work, run_dir, env, chain):
    """`alloy export` of a tensor-parallel run: every parameter under its own name, whole."""
    import struct
    out = os.path.join(work, chain + "-export", "model.safetensors")
    sh([alloy, "export", "--checkpoint", run_dir, "--output", out], env=env)
    with open(out, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    names = [k for k in header if k != "__metadata__"]
    ok = not any("#" in k for k in names) and header["wte.weight"]["shape"] == [257, 32] and \
        header["h.0.attn.c_attn.weight"]["shape"] == [32, 96]
    print(f"     export of {os.path.basename(run_dir)}: {len(names)} tensors, whole: {ok}")
    return ok


def reshard(alloy, work, env, baselines, chain):
    """A run resumed under other layouts, each from its predecessor's checkpoint: the losses follow
    the uninterrupted one-device run."""
    arch, gb = "gpt2", 24
    base = baselines[(arch, gb)]
    got, resume, begin, what = [], None, 0, []
    for name, layout, flags, end in RESHARD_CHAINS[chain]:
        out = os.path.join(work, name)
        _, _, layout_plan, world = LAYOUTS[layout][:4]
        plan_path = os.path.join(work, name + ".json")
        with open(plan_path, "w") as f:
            json.dump(layout_plan, f)
        cmd = [alloy, "launch", "--nproc", str(world), "--threads-per-rank", "1", "--", alloy, "train", "--config",
               config(work, arch, gb, out), "--timeout", "120", "--plan", plan_path, "--set", f"train.checkpoint_interval={end}"] + flags
        if resume:
            cmd += ["--resume-from", resume]
        sh(cmd, env=env)
        got += [r for r in losses(out) if begin < r[0] <= end]
        resume, begin = os.path.join(out, "checkpoints", f"step_{end:08d}"), end
        what.append(f"{layout} {' '.join(flags)}".strip())
    ok = [r[0] for r in got] == list(range(1, STEPS + 1))
    worst = max(abs(l - bl) / abs(bl) for (_, l, _), (_, bl, _) in zip(got, base))
    ok = ok and worst <= RTOL
    lines = []
    if chain in ("reshard-tp", "reshard-cut"):  # the last run's pieces export as whole HuggingFace tensors
        with captured(lines):
            ok = exported_whole(alloy, work, os.path.dirname(os.path.dirname(resume)), env, chain) and ok
    head = f"{'ok  ' if ok else 'FAIL'} {chain:<18} {' -> '.join(what)}: worst relative loss difference {worst:.2e}"
    return ok, "\n".join([head] + lines)


def run_layout(alloy, work, env, on_devices, name, baselines):
    """Runs layout NAME through `alloy launch` and checks it against its one-device run: (ok, report)."""
    lines = []
    devices, rtol, extra_flags = [], RTOL, []
    if on_devices:
        base_name, devices = DEVICE_LAYOUTS[name]
        alone = base_name is None or base_name.startswith("@")
        arch, gb, layout, world = LAYOUTS["dp2-equal" if alone else base_name][:4]
        if alone:
            arch = base_name[1:] if base_name else arch
            layout, world = plan(gb, [(gb // 2, 2, full(0))]), 1
        rtol = RTOL_GPU
    else:
        arch, gb, layout, world, *more = LAYOUTS[name]
        extra_flags = more[0] if more else []
    base = baselines[(arch, gb)]
    out = os.path.join(work, name)
    cfg = config(work, arch, gb, out)
    if isinstance(layout, dict):
        plan_path = os.path.join(work, name + ".json")
        with open(plan_path, "w") as f:
            json.dump(layout, f)
        extra = ["--plan", plan_path]
    else:
        extra = list(layout)
    extra += extra_flags
    placement = ["--devices", ",".join(devices)] if devices else []
    if name in ON_CHANNELS:
        env = dict(env, ALLOY_PIPE_CHANNELS="gloo")
    run = sh([alloy, "launch", "--nproc", str(world), "--threads-per-rank", "1"] + placement + ["--",
              alloy, "train", "--config", cfg, "--timeout", "120"] + extra, env=env)
    got = losses(out)
    worst = 0.0
    ok = len(got) == len(base) == STEPS
    with captured(lines):
        if devices:  # each rank must have run where it was placed, not quietly on the CPU
            with open(os.path.join(out, "ranks.json")) as f:
                ran_on = [r["device"] for r in sorted(json.load(f), key=lambda r: r["rank"])]
            # "cuda" is the local rank's GPU: cuda:0 on a machine with one, cuda:N on one with more.
            if len(ran_on) != len(devices) or any(d != r and not (d == "cuda" and r.startswith("cuda:"))
                                                   for d, r in zip(devices, ran_on)):
                print(f"     {name}: ranks ran on {ran_on}, placed on {devices}")
                ok = False
            # Pipeline neighbours on GPUs of their own pass messages device to device (NCCL channels).
            # (Not the layouts that ask for Gloo channels: they must report those instead.)
            gpus = [r for r in ran_on if r.startswith("cuda:")]
            piped = pipeline_ranks(layout) if isinstance(layout, dict) else set()
            if piped and len(set(gpus)) == len(gpus) > 1 and name not in ON_CHANNELS:
                nccl = [l for l in (run.stdout + run.stderr).splitlines() if "NCCL channel(s)" in l]
                print(f"     {name}: {len(nccl)} of {len(piped)} pipeline ranks on NCCL channels" +
                      "".join("\n     " + l.strip() for l in nccl))
                ok = ok and len(nccl) == len(piped)
        for (s, l, v), (bs, bl, bv) in zip(got, base):
            worst = max(worst, abs(l - bl) / abs(bl))
            if v is not None or bv is not None:
                if v is None or bv is None:
                    ok = False
                else:
                    worst = max(worst, abs(v - bv) / abs(bv))
        ok = ok and worst <= rtol
        if name.startswith("zero") and "-dp" in name and ("--shard-ratio" in extra_flags or name.startswith("zero3")):
            ok = shares_followed(out, extra_flags) and ok
        if name.startswith("tp") and isinstance(layout, dict):
            ok = tp_split_held(out, os.path.join(work, f"single-{arch}-{gb}"), layout) and ok
            ok = tp_sums_reported(out, layout) and ok
        if name in ON_CHANNELS:
            ok = channels_used(run.stdout + run.stderr, name, layout) and ok
        # Two regions of two: the sum striped over two trees crossing at pairs of their own.
        route = "sums along 2 trees" if name == "tree-dp4-regions" else "sums along a tree"
        if name.startswith("tree-") and route not in run.stdout + run.stderr:
            print(f"     {name}: no holder set {route.replace('sums', 'summed')}")
            ok = False
    head = (f"{'ok  ' if ok else 'FAIL'} {name:<18} world {world}: {len(got)} steps, worst relative loss difference {worst:.2e}"
            f" (first {got[0][1]:.4f}, last {got[-1][1]:.4f})")
    return ok, "\n".join([head] + lines)


def compared_to_base(work, name):
    """The checks of what layout NAME is for against the layout it extends, once both ran: ok."""
    lines, ok = [], True
    out = os.path.join(work, name)
    with captured(lines):
        if name in SHRINKS and os.path.exists(os.path.join(work, SHRINKS[name][0], "ranks.json")):
            base_name, key, at_most = SHRINKS[name]
            ok = shrank(os.path.join(work, base_name), out, key, at_most) and ok
        if name == "recompute-pp2" and os.path.exists(os.path.join(work, "pp2-6+2-1f1b", "ranks.json")):
            ok = activations_shrank(os.path.join(work, "pp2-6+2-1f1b"), out) and ok
    if lines:
        print(f"{'ok  ' if ok else 'FAIL'} {name:<18} against the layout it extends", flush=True)
        print("\n".join(lines), flush=True)
    return ok


class _PerThreadStdout:
    """sys.stdout while layouts run side by side: a thread inside captured() writes to its own
    buffer, every other write goes through."""

    def __init__(self, real):
        self.real, self.local = real, threading.local()

    def write(self, text):
        buf = getattr(self.local, "buf", None)
        return (buf or self.real).write(text)

    def flush(self):
        if getattr(self.local, "buf", None) is None:
            self.real.flush()


@contextlib.contextmanager
def captured(lines):
    """The checks' own prints, kept in LINES so that a layout's report prints whole beside others'."""
    out = sys.stdout
    buf = io.StringIO()
    if isinstance(out, _PerThreadStdout):
        out.local.buf = buf
    try:
        yield
    finally:
        if isinstance(out, _PerThreadStdout):
            out.local.buf = None
        lines.extend(l for l in buf.getvalue().splitlines() if l)


def main():
    alloy, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    args = sys.argv[3:]
    on_devices = "--devices" in args
    args = [a for a in args if a != "--devices"]
    # Layouts run side by side: each is a few processes of one thread that wait on each other
    # about half the time (measured: 1.1 cores busy on average), so two at a time keep two cores
    # busy. One GPU runs one layout at a time.
    jobs = int(os.environ.get("ALLOY_PARITY_JOBS", "1" if on_devices else str(min(4, os.cpu_count() or 1))))
    table = DEVICE_LAYOUTS if on_devices else LAYOUTS
    wanted = args or list(table)
    fresh_workdir_with_corpus(alloy, work)

    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    layouts = [w for w in wanted if w not in RESHARD_CHAINS and w not in MISMATCHES]
    chains = [] if on_devices else [c for c in RESHARD_CHAINS if not args or c in args]
    mismatches = [] if on_devices else [m for m in MISMATCHES if not args or m in args]
    # The one-device runs every layout is compared with, first.
    baselines = {}
    needed = {("gpt2", 24)} if chains else set()
    for name in layouts:
        if on_devices:
            base_name = DEVICE_LAYOUTS[name][0]
            alone = base_name is None or base_name.startswith("@")
            arch, gb = LAYOUTS["dp2-equal" if alone else base_name][:2]
            if alone and base_name:
                arch = base_name[1:]
        else:
            arch, gb = LAYOUTS[name][:2]
        needed.add((arch, gb))
    for arch, gb in sorted(needed):
        out = os.path.join(work, f"single-{arch}-{gb}")
        sh([alloy, "train", "--config", config(work, arch, gb, out)], env=env)
        baselines[(arch, gb)] = losses(out)
    print(f"{len(layouts)} layouts, {len(chains)} resharding chains and {len(mismatches)} mismatched starts, {jobs} at a time",
          flush=True)

    failures = 0
    sys.stdout = _PerThreadStdout(sys.stdout)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        runs = {pool.submit(run_layout, alloy, work, env, on_devices, name, baselines): name for name in layouts}
        runs.update({pool.submit(reshard, alloy, work, env, baselines, chain): chain for chain in chains})
        runs.update({pool.submit(mismatched_start, alloy, work, env, m): m for m in mismatches})
        for done in concurrent.futures.as_completed(runs):
            try:
                ok, report = done.result()
            except SystemExit:  # sh() wrote the failed command and its output to stderr
                ok, report = False, f"FAIL {runs[done]:<18} a command failed (above)"
            failures += not ok
            print(report, flush=True)
    for name in layouts:
        if not on_devices:
            failures += not compared_to_base(work, name)
    print(f"{len(layouts) + len(chains) + len(mismatches) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
