#!/usr/bin/env python3
"""Writes the initial seed inputs of every fuzz target into fuzz/corpus/<target>/seed-*.

Seeds come from the examples (examples/*.yaml), the inputs the unit tests spell out inline
(tests/test_*.cpp), PTAFM's published data-centre file (copied into the corpus, so the replay
tests do not need ../shared), and small generated files: Megatron .idx/.bin pairs, safetensors
files, checkpoint manifests, profiles and a tiny GPT-2 vocabulary. Re-running it rewrites the
seed-* files and leaves every other corpus file (inputs the fuzzer found, crash reproducers)
alone. Also writes fuzz/dict/<target>.dict, the libFuzzer dictionaries scripts/fuzz.sh passes.
"""
import glob
import hashlib
import json
import os
import re
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")
DICT = os.path.join(ROOT, "fuzz", "dict")
SEP = b"\n--alloy-fuzz-part--\n"

TARGETS = ["config", "cluster", "ptafm", "plan", "profile", "synerfuse", "hetero_config", "mmidx",
           "safetensors", "checkpoint_state", "gpt2_vocab"]
seeds = {t: {} for t in TARGETS}


def add(target, name, data):
    if isinstance(data, str):
        data = data.encode()
    if data in seeds[target].values():
        return
    seeds[target][name] = data


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def raw_strings(path):
    """The raw string literals R"(...)" of a C++ file, in order."""
    return re.findall(r'R"\((.*?)\)"', read(path), re.S)


def c_strings(text):
    """The ordinary string literals of a piece of C++ text, unescaped (ASCII only)."""
    out = []
    for m in re.finditer(r'"((?:[^"\\\n]|\\.)*)"', text):
        out.append(m.group(1).encode().decode("unicode_escape"))
    return out


# ---------------------------------------------------------------------------------------------
# config: examples, test_config.cpp's YAML snippets and --set values

for path in sorted(glob.glob(os.path.join(ROOT, "examples", "*.yaml"))):
    name = os.path.basename(path)[:-5]
    target = "cluster" if name.startswith("cluster-") else "config"
    add(target, "example-" + name, open(path, encoding="utf-8").read())

cfg_test = read("tests/test_config.cpp")
n = 0
for line in cfg_test.splitlines():
    if "from_yaml_string" not in line and "error_of" not in line:
        continue
    lits = c_strings(line)
    if not lits:
        continue
    yaml = lits[0]
    sets = [s for s in lits[1:] if re.match(r"^[^ =]*=", s)]
    data = yaml.encode()
    if sets:
        data += SEP + "\n".join(sets).encode()
    add("config", "test-config-%02d" % n, data)
    n += 1
add("config", "sets-lora", b"model:\n  arch: llama\n  hidden: 64\n  heads: 4\n" + SEP +
    b"lora.rank=8\nlora.targets=q_proj,v_proj\nlora.base_dtype=nf4\nlora.double_quant=true")
add("config", "sets-sync", b"" + SEP + b"grad_sync.compression=dgc\ngrad_sync.density=0.01\n"
    b"grad_sync.scope=slow-links\ntrain.zero_stage=2\ntrain.shard_ratio=3,1\ntrain.micro_batch=4")
add("config", "list-targets", "lora:\n  rank: 4\n  targets: [c_attn, mlp.*]\noutput:\n  dir: runs/x\n")

# ---------------------------------------------------------------------------------------------
# cluster, ptafm, hetero_config (test_cluster.cpp)

# PTAFM's published file (beside the repository), copied in so the replay needs no ../shared.
shared = os.path.join(ROOT, "..", "shared", "reference", "ptafm-data-center-config.txt")
if os.path.exists(shared):
    add("ptafm", "ptafm-data-center-config", open(shared, encoding="utf-8").read())
for i, s in enumerate(raw_strings("tests/test_cluster.cpp")):
    t = s.strip()
    if t.startswith("NUM_STAGE"):
        add("ptafm", "test-cluster-%02d" % i, s)
    elif '"coordinator"' in t or '"workers"' in t or '"shard_plan"' in t:
        add("hetero_config", "test-cluster-%02d" % i, s)
    else:
        add("cluster", "test-cluster-%02d" % i, s)

add("ptafm", "small", "# two data centres\nNUM_STAGE: 2\nPOWER_SECTION\n1 [1,2]\n2 [0,1]\nend\n"
    "LATENCY_SECTION\n1 1 0.1\n1 2 20\n2 2 0.1\nend\nBANDWIDTH_SECTION\n1 1 200\n1 2 0.5\n2 2 100\nend\n")
add("ptafm", "empty-dc", "NUM_STAGE:1\nPOWER_SECTION\n1 [1,0]\n2 [0,0]\nend\nLATENCY_SECTION\n1 1 0\n1 2 5\n"
    "2 2 0\nend\nBANDWIDTH_SECTION\n1 1 100\n1 2 1e-1\n2 2 1\nend\n")

# ---------------------------------------------------------------------------------------------
# plan (test_plan.cpp and generated)

for i, s in enumerate(raw_strings("tests/test_plan.cpp")):
    add("plan", "test-plan-%02d" % i, s)


def stage(r, b, e, **kw):
    return dict({"ranks": [r], "layers": [b, e]}, **kw)


add("plan", "gen-v1-pipeline", json.dumps({
    "format": "alloy-plan", "version": 1, "global_batch": 8, "schedule": "1f1b",
    "pipelines": [{"micro_batch_size": 2, "num_micro_batches": 4,
                   "stages": [stage(0, 0, 3, device="fast"), stage(1, 3, 4, device="slow")]}],
    "grad_sync": {"bucket_mb": 25, "compression": "none"}}, indent=2))
add("plan", "gen-v2-sharding", json.dumps({
    "format": "alloy-plan", "version": 2, "global_batch": 12, "schedule": "gpipe",
    "pipelines": [{"micro_batch_size": 2, "num_micro_batches": 3, "stages": [stage(0, 0, 2, recompute=True), stage(1, 2, 4)]},
                  {"micro_batch_size": 3, "num_micro_batches": 2, "stages": [stage(2, 0, 2), stage(3, 2, 4)]}],
    "grad_sync": {"bucket_mb": 4, "compression": "dgc", "density": 0.01, "fusion": "saf", "error_feedback": True,
                  "warmup_steps": 10, "dense_steps": 5, "powersgd_rank": 4, "scope": "slow-links",
                  "dgc_momentum": 0.9, "momentum_correction": "auto", "sidco_fit": "gamma", "sidco_stages": 2,
                  "slow_links": [[0, 2], [1, 3]]},
    "sharding": [{"ranks": [0, 2], "stage": 2, "shares": [3, 1]}, {"ranks": [1, 3], "stage": 1}],
    "predicted": {"step_s": 1.5}}))
add("plan", "gen-v5-floating", json.dumps({
    "format": "alloy-plan", "version": 5, "global_batch": 10, "schedule": "1f1b",
    "pipelines": [{"micro_batch_size": 1, "num_micro_batches": 7, "stages": [
        {"ranks": [0], "units": [0, 4], "float_share": 0.43}, {"ranks": [1], "units": [3, 7], "float_share": 0.5},
        {"ranks": [2], "units": [6, 8]}]},
        {"micro_batch_size": 3, "num_micro_batches": 1, "stages": [{"ranks": [3], "layers": [0, 4]}]}]}))
add("plan", "gen-v6-pipeline-schedules", json.dumps({
    "format": "alloy-plan", "version": 6, "global_batch": 10, "schedule": "1f1b",
    "pipelines": [{"micro_batch_size": 1, "num_micro_batches": 4, "schedule": "zb-h1", "stages": [
        {"ranks": [0], "layers": [0, 1]}, {"ranks": [1], "layers": [1, 3]}, {"ranks": [2], "layers": [3, 4]}]},
        {"micro_batch_size": 3, "num_micro_batches": 2, "schedule": "gpipe", "stages": [
            {"ranks": [3], "layers": [0, 2]}, {"ranks": [4], "layers": [2, 4]}]}]}))
add("plan", "gen-dp", json.dumps({"global_batch": 6, "pipelines": [
    {"micro_batch_size": 1, "num_micro_batches": 2, "stages": [stage(0, 0, 4)]},
    {"micro_batch_size": 2, "num_micro_batches": 2, "stages": [stage(1, 0, 4)]}]}))

# ---------------------------------------------------------------------------------------------
# profile (generated: the schema of Profile::to_json)


def cost(fixed, per, points=None):
    c = {"fixed_s": fixed, "per_sample_s": per}
    if points:
        c["points"] = points
    return c


MODEL = {"arch": "gpt2", "layers": 4, "hidden": 128, "heads": 4, "kv_heads": 0, "ffn": 0, "seq_len": 128,
         "vocab_size": 257, "norm_eps": 1e-05, "rope_theta": 10000.0, "init_std": 0.02, "dtype": "float32"}
MEMORY = {"param_bytes_per_block": 790528.0, "param_bytes_embed": 197120.0, "param_bytes_head": 1024.0,
          "act_bytes_per_sample_block": 1.2e6, "act_bytes_per_sample_embed": 65536.0,
          "act_bytes_per_sample_head": 300000.0, "state_bytes_per_param_byte": 4.0}


def device(scale, codecs=False, noise=None):
    d = {k: cost(0.001 * scale, 0.0005 * scale, [[1, 0.0015 * scale], [2, 0.002 * scale], [4, 0.003 * scale]])
         for k in ["block_fwd", "block_bwd"]}
    d.update({k: cost(0.0002 * scale, 0.0001 * scale) for k in ["embed_fwd", "embed_bwd", "head_fwd", "head_bwd"]})
    d["optimizer_s_per_param"] = 2e-9 * scale
    if noise is not None:
        d["step_noise"] = noise
    if codecs:
        d["codecs"] = {"dgc": {"encode_s_per_elem": 3e-9, "decode_s_per_elem": 1e-9},
                       "fp16": {"encode_s_per_elem": 1e-10, "decode_s_per_elem": 1e-10}}
    return d


add("profile", "gen-v5", json.dumps({
    "format": "alloy-profile", "version": 5, "model": MODEL,
    "devices": {"cpu-full": device(1, True, 0.02), "cpu-quarter": device(4)},
    "links": [{"host_a": "h0", "host_b": "h1", "bytes_per_s": 1.25e8, "latency_s": 1e-4, "allreduce_bytes_per_s": 0}],
    "memory": MEMORY, "meta": {"host": "x", "date": "2025-01-01"}}, indent=1))
add("profile", "gen-v5-lora", json.dumps({
    "format": "alloy-profile", "version": 5, "model": dict(MODEL, arch="llama", kv_heads=2),
    "devices": {"T4": device(2)}, "links": [],
    "memory": dict(MEMORY, frozen_bytes_per_block=400000.0, frozen_bytes_embed=0, frozen_bytes_head=0),
    "lora": {"rank": 8, "alpha": 16, "targets": "q_proj,v_proj", "base_dtype": "nf4", "double_quant": True}}))
add("profile", "gen-v9-weight-share-comm-cpu", json.dumps({
    "format": "alloy-profile", "version": 9, "model": MODEL,
    "devices": {"cpu-full": dict(device(1), attn_share_fwd=0.35, attn_share_bwd=0.42, weight_share=0.39,
                                 comm_cpu_s_per_byte=1.04e-9),
                "cpu-half": dict(device(2), weight_share=0.4)},
    "links": [], "memory": MEMORY}, indent=1))
add("profile", "gen-v7-tp-sums", json.dumps({
    "format": "alloy-profile", "version": 7, "model": MODEL,
    "devices": {"cpu-a": device(1), "cpu-b": device(2)},
    "links": [{"host_a": "box", "host_b": "far", "bytes_per_s": 1.2e7, "latency_s": 8e-4, "allreduce_bytes_per_s": 0}],
    "tp_sums": [{"device_a": "a0", "device_b": "a1", "bytes": 98304.0, "seconds": 0.0024},
                {"device_a": "a0", "device_b": "a1", "bytes": 786432.0, "seconds": 0.0043},
                {"device_a": "a0", "device_b": "b", "bytes": 98304.0, "seconds": 0.0052}],
    "memory": MEMORY}, indent=1))
add("profile", "gen-v1", json.dumps({
    "format": "alloy-profile", "version": 1, "model": {"layers": 2, "hidden": 64, "heads": 2},
    "devices": {"cpu": {k: cost(0.001, 0.001) for k in ["block_fwd", "block_bwd", "embed_fwd", "embed_bwd",
                                                        "head_fwd", "head_bwd"]} | {"optimizer_s_per_param": 0}},
    "memory": MEMORY}))

# ---------------------------------------------------------------------------------------------
# synerfuse (test_plan_convert.cpp's argument lists)

conv = read("tests/test_plan_convert.cpp")
n = 0
for m in re.finditer(r'\{\s*("--(?:[^{}]|\n)*?)\}', conv):
    lits = c_strings(m.group(1))
    if lits and lits[0].startswith("--"):
        add("synerfuse", "test-plan-convert-%02d" % n, " ".join(lits))
        n += 1
add("synerfuse", "readme-hetero", "--num-layers 8 --pipeline-model-parallel-size 2 --hetero-pipeline-stages 1 6 1 2 "
    "--global-batch-size 16 --micro-batch-size 2")
add("synerfuse", "per-dp", "--num-layers=4 --pipeline-model-parallel-size=2 --global-batch-size=14 "
    "--micro-batch-size-per-dp 1 2 1 3 --num-micro-batches-per-dp 1 4 1 2 --use-tp-pp-dp-mapping")
add("synerfuse", "world", "--num-layers 6 --pipeline-model-parallel-size 3 --world-size 6 --global-batch-size 8 "
    "--micro-batch-size 2 --tensor-model-parallel-size 1")

# ---------------------------------------------------------------------------------------------
# hetero_config (test_plan_convert.cpp: kConfig and shard_plan variants)

k_config = None
for i, s in enumerate(raw_strings("tests/test_plan_convert.cpp")):
    t = s.strip()
    if t.startswith("{") and '"version": "0.1.0"' in t:
        k_config = s
        add("hetero_config", "test-plan-convert-kconfig", s)
    elif t.startswith("{"):
        add("hetero_config", "test-plan-convert-%02d" % i, s)
    elif t.startswith("[") and k_config:
        try:
            shards = json.loads(s)
        except ValueError:
            continue
        j = json.loads(k_config)
        j["shard_plan"] = shards
        add("hetero_config", "test-plan-convert-%02d" % i, json.dumps(j))
add("hetero_config", "lora", json.dumps({
    "coordinator": {"hostname": "a", "device": "cuda:0", "num_gpus": 2},
    "workers": [{"id": "w", "ip": "10.0.0.9", "device": "cpu"}],
    "shard_plan": [{"id": "local", "start": 0, "end": 2}, {"id": "w", "start": 2, "end": 8, "is_last": True}],
    "training": {"visualize": False, "visualization_format": "mmd"}, "checkpoint_dir": "runs/h", "resume_step": None,
    "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"],
             "load_in_4bit": True, "bnb_4bit_use_double_quant": True}}))

# ---------------------------------------------------------------------------------------------
# mmidx (generated like Megatron's _IndexWriter)

DT = {"u8": (1, "B"), "i8": (2, "b"), "i16": (3, "h"), "i32": (4, "i"), "i64": (5, "q"), "f64": (6, "d"),
      "f32": (7, "f"), "u16": (8, "H")}


def mmidx(code, docs, modes=False):
    """DOCS: list of documents, each a list of sequences of token values."""
    fmt = [f for c, f in DT.values() if c == code][0]
    isz = struct.calcsize(fmt)
    seqs = [s for d in docs for s in d]
    doc_idx = [0]
    for d in docs:
        doc_idx.append(doc_idx[-1] + len(d))
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(seqs), len(doc_idx))
    idx += b"".join(struct.pack("<i", len(s)) for s in seqs)
    ptr = 0
    for s in seqs:
        idx += struct.pack("<q", ptr)
        ptr += len(s) * isz
    idx += b"".join(struct.pack("<q", d) for d in doc_idx)
    if modes:
        idx += bytes(len(seqs))
    bin_ = b"".join(struct.pack("<%d%s" % (len(s), fmt), *s) for s in seqs)
    return idx + SEP + bin_


add("mmidx", "u16", mmidx(8, [[[72, 101, 108, 108, 111, 256]], [[1, 2, 3], [65535, 40000]]]))
add("mmidx", "i32", mmidx(4, [[[50256, 0, -1]], [], [[7] * 5]]))
add("mmidx", "u8-modes", mmidx(1, [[[1, 2], [3]]], modes=True))
add("mmidx", "i64", mmidx(5, [[[1, 2 ** 40]]]))
add("mmidx", "i8-i16", mmidx(2, [[[-5, 5]]]))
add("mmidx", "i16", mmidx(3, [[[-300, 300, 0]]]))
add("mmidx", "f32", mmidx(7, [[[1.5, 2.0]]]))
add("mmidx", "f64", mmidx(6, [[[0.25]]]))
add("mmidx", "empty", mmidx(8, []))

# ---------------------------------------------------------------------------------------------
# safetensors (test_safetensors.cpp's headers and generated files)


def safetensors(header, data=None):
    h = header.encode() if isinstance(header, str) else header
    if data is None:
        ends = [int(x) for x in re.findall(rb'"data_offsets":\s*\[\s*\d+\s*,\s*(\d+)', h)]
        data = bytes(range(256)) * 1
        data = (data * (max(ends + [0]) // 256 + 1))[:max(ends + [0])]
    return struct.pack("<Q", len(h)) + h + data


st_test = read("tests/test_safetensors.cpp")
for i, m in enumerate(re.finditer(r'R"\((\{.*?)\)"', st_test)):
    add("safetensors", "test-safetensors-%02d" % i, safetensors(m.group(1)))


def st_write(tensors, metadata=None):
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return safetensors(h, data)


add("safetensors", "gen-model", st_write([
    ("wte.weight", "F32", [4, 2], struct.pack("<8f", *range(8))),
    ("h.0.ln_1.bias", "BF16", [2], b"\x80\x3f\x00\x40"),
    ("scalar", "I64", [], struct.pack("<q", -1)),
    ("empty", "U8", [0, 3], b""),
    ("flags", "BOOL", [3], b"\x00\x01\x00")], {"format": "pt", "step": "20"}))
add("safetensors", "gen-all-dtypes", st_write([
    (d.lower(), d, [1], bytes(n)) for d, n in [("U8", 1), ("I8", 1), ("F8_E5M2", 1), ("F8_E4M3", 1), ("I16", 2),
                                               ("U16", 2), ("F16", 2), ("I32", 4), ("U32", 4), ("F64", 8),
                                               ("U64", 8)]]))
add("safetensors", "gen-unicode", st_write([("h.0.attn.c_attn.lora_A@0", "F32", [1], b"\0\0\x80?"),
                                            ("\u00e9t\u00e9", "U8", [2], b"ab")], {"k\u00ff": "v\u2603"}))

# ---------------------------------------------------------------------------------------------
# checkpoint_state (what publish_checkpoint writes)

FULL_CONFIG = {
    "model": MODEL,
    "data": {"prefix": "data/fortunes", "valid_prefix": "", "tokenizer": "byte", "vocab_dir": ""},
    "train": {"steps": 20, "global_batch": 8, "micro_batch": 0, "lr": 0.001, "min_lr": 0.0001, "warmup": 5,
              "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-08, "grad_clip": 1.0, "seed": 1234,
              "eval_interval": 10, "eval_batches": 4, "checkpoint_interval": 0, "replan_step": 6, "log_interval": 1,
              "threads": 0, "device": "cpu", "zero_stage": 0, "recompute": False, "shard_ratio": ""},
    "grad_sync": {"bucket_mb": 25.0, "compression": "none", "density": 0.01, "fusion": "saf-adaptive",
                  "error_feedback": True, "warmup_steps": 80, "dense_steps": 20, "powersgd_rank": 4, "scope": "all",
                  "slow_link_gbps": 0.0, "dgc_momentum": 0.9, "momentum_correction": "auto",
                  "sidco_fit": "exponential", "sidco_stages": 2, "allow_lossy": False},
    "lora": {"rank": 0, "alpha": 16.0, "dropout": 0.0, "targets": "", "base_dtype": "fp32", "double_quant": False},
    "output": {"dir": "runs/tiny-gpt2", "tensorboard": True},
}
add("checkpoint_state", "gen-single", json.dumps({
    "format": "alloy-checkpoint", "version": 1, "step": 20, "consumed_samples": 160, "optimizer_steps": 20,
    "world_size": 1, "config": FULL_CONFIG}, indent=2))
add("checkpoint_state", "gen-dist-lora", json.dumps({
    "format": "alloy-checkpoint", "version": 1, "step": 6, "consumed_samples": 48, "optimizer_steps": 6,
    "world_size": 2, "config": {"model": {"layers": 2}, "lora": {"rank": 4, "targets": "attn.c_attn"}},
    "plan": json.loads(seeds["plan"]["gen-dp"]), "base": "runs/base/checkpoints/step_00000020"}))
add("checkpoint_state", "gen-v2-files", json.dumps({
    "format": "alloy-checkpoint", "version": 2, "step": 40, "consumed_samples": 320, "optimizer_steps": 40,
    "world_size": 3, "config": FULL_CONFIG,
    "files": {"model-rank00000.safetensors": {"bytes": 4096, "crc32c": "0a1b2c3d"},
              "optimizer-rank00000.safetensors": {"bytes": 8192, "crc32c": "ffffffff"},
              "state.json": {"bytes": 10, "crc32c": "00000000"}}}))
add("checkpoint_state", "gen-minimal", '{"format":"alloy-checkpoint","version":1,"step":0,"consumed_samples":0,'
    '"optimizer_steps":0,"config":{}}')

# ---------------------------------------------------------------------------------------------
# gpt2_vocab: a tiny vocabulary in GPT-2's byte alphabet (all 256 bytes, a few merges, the EOT)


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


B2U = bytes_to_unicode()


def vocab(merges, extra_eot_first=False):
    """MERGES: (left, right) byte strings, in training order."""
    def sym(bs):
        return "".join(B2U[b] for b in bs)
    enc = {}
    if extra_eot_first:
        enc["<|endoftext|>"] = 0
    for b in range(256):
        enc[sym([b])] = len(enc)
    lines = ["#version: 0.2"]
    for a, b in merges:
        lines.append(sym(a) + " " + sym(b))
        if sym(a + b) not in enc:
            enc[sym(a + b)] = len(enc)
    if "<|endoftext|>" not in enc:
        enc["<|endoftext|>"] = len(enc)
    return json.dumps(enc, ensure_ascii=False).encode(), ("\n".join(lines) + "\n").encode()


TEXTS = ["Hello there, the world's theme: 'll 've 're  \t\n 12345 caf\u00e9 \u00fcber\u00a0x \u4e16\u754c!!".encode(),
         "the the then there\r\n\r\n   <|endoftext|>   ".encode(),
         b"\xff\xfe invalid \xc3( utf8 \xed\xa0\x80 surrogate \xf4\x90\x80\x80 too big"]
m1 = [(b"t", b"h"), (b"th", b"e"), (b" ", b"t"), (b"h", b"e"), (b" t", b"he"), (b"e", b"r"), (b"l", b"l"),
      (b"'", b"s"), (b"\xc3", b"\xa9"), (b" ", b" ")]
enc, bpe = vocab(m1)
for i, text in enumerate(TEXTS):
    add("gpt2_vocab", "tiny-%d" % i, enc + SEP + bpe + SEP + text)
enc2, bpe2 = vocab([(b"a", b"b"), (b"ab", b"c"), (b"c", b"c"), (b"\xc3", b"\xa9"), (b"\xc3\xa9", b"t")],
                   extra_eot_first=True)
add("gpt2_vocab", "eot-first", enc2 + SEP + bpe2.replace(b"\n", b"\r\n") + SEP + "abcabccc ab \u00e9t\u00e9".encode())

# ---------------------------------------------------------------------------------------------
# dictionaries

config_keys = re.findall(r"ALLOY_(?:INT|FLOAT|STR|BOOL)\((\w+), (\w+),", read("src/alloy/core/config.cpp"))
dicts = {
    "config": [s for s, _ in config_keys] + [k for _, k in config_keys] + ["%s.%s=" % k for k in config_keys] +
              ["\n--alloy-fuzz-part--\n", "gpt2", "llama", "float64", "nf4", "int8", "dgc", "powersgd", "slow-links",
               "saf-inter", "true", "nan", "1e308", "&a", "*a", "!!str", "[", "{", "---", "? "],
    "cluster": ["name", "devices", "groups", "links", "default_link", "intra_host_link", "host", "kind", "type",
                "memory_gb", "speed", "flops", "between", "within", "bandwidth_gbps", "latency_ms", "cuda", "rocm",
                "mps", "&a", "*a", ".inf", ".nan"],
    "ptafm": ["NUM_STAGE:", "POWER_SECTION", "LATENCY_SECTION", "BANDWIDTH_SECTION", "end", "[", ",", "]", "#",
              "1e308", "2147483648"],
    "plan": ["format", "alloy-plan", "version", "global_batch", "schedule", "gpipe", "1f1b", "pipelines",
             "micro_batch_size", "num_micro_batches", "stages", "ranks", "layers", "device", "recompute",
             "grad_sync", "bucket_mb", "compression", "density", "fusion", "error_feedback", "warmup_steps",
             "dense_steps", "powersgd_rank", "scope", "dgc_momentum", "momentum_correction", "sidco_fit",
             "sidco_stages", "slow_links", "sharding", "stage", "shares", "predicted", "1e300", "-1",
             "9223372036854775807", "2147483648"],
    "profile": ["format", "alloy-profile", "version", "model", "devices", "links", "memory", "lora", "meta",
                "block_fwd", "block_bwd", "embed_fwd", "embed_bwd", "head_fwd", "head_bwd", "fixed_s",
                "per_sample_s", "points", "optimizer_s_per_param", "step_noise", "codecs", "encode_s_per_elem",
                "decode_s_per_elem", "host_a", "host_b", "bytes_per_s", "latency_s", "allreduce_bytes_per_s",
                "frozen_bytes_per_block", "state_bytes_per_param_byte", "rank", "base_dtype", "tp_sums", "device_a",
                "device_b", "bytes", "seconds", "1e308"] +
               [k for s, k in config_keys if s in ("model", "lora")],
    "synerfuse": ["--num-layers", "--pipeline-model-parallel-size", "--tensor-model-parallel-size",
                  "--global-batch-size", "--micro-batch-size", "--data-parallel-size", "--world-size",
                  "--hetero-pipeline-stages", "--micro-batch-size-per-dp", "--num-micro-batches-per-dp",
                  "--use-tp-pp-dp-mapping", "=", "-1", "9223372036854775807", "2147483647"],
    "hetero_config": ["coordinator", "workers", "shard_plan", "id", "start", "end", "is_last", "hostname", "ip",
                      "device", "num_gpus", "training", "visualize", "visualization_format", "checkpoint_dir",
                      "resume_step", "lora", "r", "lora_alpha", "lora_dropout", "target_modules", "load_in_4bit",
                      "load_in_8bit", "bnb_4bit_use_double_quant", "local", "auto", "cuda:1", "mps", "1e300"],
    "mmidx": ["MMIDIDX\x00\x00", "\x01\x00\x00\x00\x00\x00\x00\x00", "\xff\xff\xff\xff", "\n--alloy-fuzz-part--\n"],
    "safetensors": ["__metadata__", "dtype", "shape", "data_offsets", "F32", "BF16", "F8_E4M3", "BOOL", "U64",
                    "18446744073709551615", "9223372036854775808", "\xff\xff\xff\xff\xff\xff\xff\xff"],
    "checkpoint_state": ["format", "alloy-checkpoint", "version", "step", "consumed_samples", "optimizer_steps",
                         "world_size", "config", "plan", "base", "model", "train", "lora", "output", "1e300",
                         "18446744073709551615", "-1"] + [k for _, k in config_keys],
    "gpt2_vocab": ["<|endoftext|>", "#version: 0.2", "\n--alloy-fuzz-part--\n", "\u0120", "\u010a", "'s", "'ll",
                   "\u00a0", "\u3000"],
}


def dict_line(tok):
    out = ""
    for b in tok.encode("utf-8"):
        c = chr(b)
        out += c if 0x20 <= b < 0x7F and c not in '"\\' else "\\x%02X" % b
    return '"%s"' % out


def main():
    os.makedirs(DICT, exist_ok=True)
    total = 0
    for t in TARGETS:
        d = os.path.join(CORPUS, t)
        os.makedirs(d, exist_ok=True)
        for old in glob.glob(os.path.join(d, "seed-*")):
            os.remove(old)
        for name, data in seeds[t].items():
            with open(os.path.join(d, "seed-" + name), "wb") as f:
                f.write(data)
            total += len(data)
        with open(os.path.join(DICT, t + ".dict"), "w") as f:
            f.write("# libFuzzer dictionary for fuzz_%s (written by fuzz/seed_corpora.py)\n" % t)
            for tok in dict.fromkeys(dicts[t]):
                f.write(dict_line(tok) + "\n")
        print("%-17s %3d seeds" % (t, len(seeds[t])))
    print("total %d bytes" % total)


if __name__ == "__main__":
    sys.exit(main())
