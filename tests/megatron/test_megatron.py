#!/usr/bin/python3
"""Megatron-LM checkpoints into Alloy: `alloy import --megatron`, `alloy train --init-from` / `--load`.

    test_megatron.py ALLOY WORKDIR

Each case draws a model's weights in HuggingFace's layout (tests/parity/reference.py, Alloy's own
names), writes them as Megatron-LM would save them (torch.save of {"args": argparse.Namespace,
"model": ..., "optimizer": ..., "rng_state": ...} per tensor-parallel piece and pipeline stage,
fused QKV rows grouped per query group, SwiGLU pieces as [gate; up], vocabulary padded), and
checks:
  1. the files compute what the weights compute: a forward written the way Megatron computes
     (each piece's fused QKV viewed [.., groups, (q + 2) * head_dim] and split, row-parallel outputs
     summed over the pieces, SwiGLU's output chunked) gives the reference model's logits. This
     checks the writer below against Megatron's own arithmetic, not against Alloy;
  2. Alloy reads them back to exactly the original tensors (import, then export as safetensors);
  3. `alloy train` starts from them (--init-from, and Megatron's --load of such a directory);
  4. what it refuses, it names: a missing piece, a padded vocabulary the config disagrees with, the
     pre-1.6 pickle format.
"""
import argparse
import io
import os
import random
import shutil
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "parity"))
sys.path.insert(0, os.path.join(HERE, "..", "dist"))
import reference as ref  # noqa: E402
import st  # noqa: E402
from distlib import Checks, fresh_workdir_with_corpus, sh  # noqa: E402

check = Checks()


# --- Megatron's layouts -------------------------------------------------------------------------

def qkv_rows(q, k, v, groups, hd):
    """[heads*hd, H], [groups*hd, H] x2 -> Megatron's fused rows [groups, heads/groups + 2, hd, H]."""
    per = q.shape[0] // hd // groups
    qg = q.reshape(groups, per, hd, -1)
    return torch.cat([qg, k.reshape(groups, 1, hd, -1), v.reshape(groups, 1, hd, -1)], 1).reshape(groups * (per + 2) * hd, -1)


# Megatron's name for each tensor of a block, per model code: the legacy one, Megatron-Core's with
# its own norms (local), and Megatron-Core's with Transformer Engine's norms fused into the next
# projection (te).
_CORE = dict(qkv_w="self_attention.linear_qkv.weight", qkv_b="self_attention.linear_qkv.bias",
             proj_w="self_attention.linear_proj.weight", proj_b="self_attention.linear_proj.bias",
             fc1_w="mlp.linear_fc1.weight", fc1_b="mlp.linear_fc1.bias", fc2_w="mlp.linear_fc2.weight", fc2_b="mlp.linear_fc2.bias")
NAMES = {
    "legacy": dict(ln1_w="input_layernorm.weight", ln1_b="input_layernorm.bias", qkv_w="self_attention.query_key_value.weight",
                   qkv_b="self_attention.query_key_value.bias", proj_w="self_attention.dense.weight", proj_b="self_attention.dense.bias",
                   ln2_w="post_attention_layernorm.weight", ln2_b="post_attention_layernorm.bias", fc1_w="mlp.dense_h_to_4h.weight",
                   fc1_b="mlp.dense_h_to_4h.bias", fc2_w="mlp.dense_4h_to_h.weight", fc2_b="mlp.dense_4h_to_h.bias"),
    "core-local": dict(_CORE, ln1_w="input_layernorm.weight", ln1_b="input_layernorm.bias", ln2_w="pre_mlp_layernorm.weight",
                       ln2_b="pre_mlp_layernorm.bias"),
    "core-te": dict(_CORE, ln1_w="self_attention.linear_qkv.layer_norm_weight", ln1_b="self_attention.linear_qkv.layer_norm_bias",
                    ln2_w="mlp.linear_fc1.layer_norm_weight", ln2_b="mlp.linear_fc1.layer_norm_bias"),
}


def to_megatron(cfg, p, tp, stages, code, vocab_padded, max_pos, global_numbers=False, version=3.0):
    """HF-named weights -> {(t, s): model state dict} the way Megatron saves them (fp32).
    GLOBAL_NUMBERS: later stages number their layers from the layers before them. VERSION below 2
    keeps each piece's fused QKV rows as checkpoint_version 1 did ([heads, head_dim, 3])."""
    gpt2 = cfg.arch == "gpt2"
    H, hd, heads, groups = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads
    names = NAMES[code]
    wte = p["wte.weight" if gpt2 else "model.embed_tokens.weight"]
    wte = torch.cat([wte, torch.zeros(vocab_padded - wte.shape[0], H)]) if vocab_padded > wte.shape[0] else wte
    out = {}
    for t in range(tp):
        layer0 = 0
        for s, n in enumerate(stages):
            d = OrderedDict()

            def rows(x):
                return x.chunk(tp, 0)[t].clone()

            def cols(x):
                return x.chunk(tp, 1)[t].clone()

            def qkv_piece(x):
                x = rows(x)
                if version < 2:
                    x2 = x.reshape(x.shape[0] // (3 * hd), 3, hd, -1).permute(0, 2, 1, 3)
                    x = x2.reshape(x.shape).contiguous()
                return x
            layer_sd = OrderedDict()
            for local in range(n):
                i = layer0 + local
                num = i if global_numbers else local
                if gpt2:
                    pre = f"h.{i}."
                    w = p[pre + "attn.c_attn.weight"].t()  # [3H, H]: q, k, v blocks
                    b = p[pre + "attn.c_attn.bias"].reshape(-1, 1)
                    e = dict(ln1_w=p[pre + "ln_1.weight"], ln1_b=p[pre + "ln_1.bias"],
                             # a piece holds whole heads: the [heads, 3, hd] rows chunk by heads
                             qkv_w=qkv_piece(qkv_rows(*w.split(H, 0), heads, hd)),
                             qkv_b=qkv_piece(qkv_rows(*b.split(H, 0), heads, hd)).reshape(-1),
                             proj_w=cols(p[pre + "attn.c_proj.weight"].t()), proj_b=p[pre + "attn.c_proj.bias"],
                             ln2_w=p[pre + "ln_2.weight"], ln2_b=p[pre + "ln_2.bias"],
                             fc1_w=rows(p[pre + "mlp.c_fc.weight"].t()), fc1_b=rows(p[pre + "mlp.c_fc.bias"]),
                             fc2_w=cols(p[pre + "mlp.c_proj.weight"].t()), fc2_b=p[pre + "mlp.c_proj.bias"])
                else:
                    pre = f"model.layers.{i}."
                    qkv_w = qkv_rows(p[pre + "self_attn.q_proj.weight"], p[pre + "self_attn.k_proj.weight"],
                                     p[pre + "self_attn.v_proj.weight"], groups, hd)
                    gate, up = p[pre + "mlp.gate_proj.weight"], p[pre + "mlp.up_proj.weight"]
                    e = dict(ln1_w=p[pre + "input_layernorm.weight"], qkv_w=rows(qkv_w), proj_w=cols(p[pre + "self_attn.o_proj.weight"]),
                             ln2_w=p[pre + "post_attention_layernorm.weight"], fc1_w=torch.cat([rows(gate), rows(up)]),
                             fc2_w=cols(p[pre + "mlp.down_proj.weight"]))
                    if cfg.qkv_bias:  # --add-qkv-bias: the fused bias's rows grouped as the weight's
                        e["qkv_b"] = rows(qkv_rows(*(p[pre + f"self_attn.{x}_proj.bias"].reshape(-1, 1) for x in "qkv"),
                                                   groups, hd)).reshape(-1)
                for role, x in e.items():
                    layer_sd[f"layers.{num}.{names[role]}"] = x
                if code == "core-te":  # Transformer Engine's fp8 metadata: not weights
                    layer_sd[f"layers.{num}.{names['qkv_w'][:-len('weight')]}_extra_state"] = io.BytesIO(b"te-fp8-meta")
                    layer_sd[f"layers.{num}.{names['proj_w'][:-len('weight')]}_extra_state"] = None
            last = s + 1 == len(stages)
            pos = torch.cat([p["wpe.weight"], torch.randn(max_pos - p["wpe.weight"].shape[0], H)]) if gpt2 else None
            final = p["ln_f.weight" if gpt2 else "model.norm.weight"]
            if code == "legacy":
                lm = OrderedDict()
                if s == 0:
                    lm["embedding"] = OrderedDict(word_embeddings=OrderedDict(weight=rows(wte)))
                    if gpt2:
                        lm["embedding"]["position_embeddings"] = OrderedDict(weight=pos)
                enc = layer_sd
                if last:
                    enc["final_layernorm.weight"] = final
                    if gpt2:
                        enc["final_layernorm.bias"] = p["ln_f.bias"]
                lm["encoder"] = enc
                d["language_model"] = lm
                if last and s > 0 and gpt2:
                    d["word_embeddings_for_head"] = OrderedDict(weight=rows(wte))
            else:
                if s == 0:
                    d["embedding.word_embeddings.weight"] = rows(wte)
                    if gpt2:
                        d["embedding.position_embeddings.weight"] = pos
                for k, x in layer_sd.items():
                    d["decoder." + k] = x
                if last:
                    d["decoder.final_layernorm.weight"] = final
                    if gpt2:
                        d["decoder.final_layernorm.bias"] = p["ln_f.bias"]
                        if s > 0:  # Megatron-Core's last stage keeps a copy of the tied embedding
                            d["output_layer.weight"] = rows(wte)
                    else:
                        lm_head = p["lm_head.weight"]
                        lm_head = torch.cat([lm_head, torch.zeros(vocab_padded - lm_head.shape[0], H)])
                        d["output_layer.weight"] = rows(lm_head)
                    d["output_layer._extra_state"] = None
            out[(t, s)] = d
            layer0 += n
    return out


def megatron_forward(cfg, shards, tp, stages, code, idx, global_numbers=False):
    """Logits computed from the pieces as Megatron computes them."""
    gpt2 = cfg.arch == "gpt2"
    H, hd, heads, groups = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads
    per = heads // groups
    B, T = idx.shape
    names = NAMES[code]
    legacy = code == "legacy"

    def top(t, s, key):  # a model-wide tensor; KEY as Megatron-Core names it
        if not legacy:
            return shards[(t, s)][key]
        legacy_key = {"embedding.word_embeddings.weight": "embedding/word_embeddings/weight",
                      "embedding.position_embeddings.weight": "embedding/position_embeddings/weight",
                      "decoder.final_layernorm.weight": "encoder/final_layernorm.weight",
                      "decoder.final_layernorm.bias": "encoder/final_layernorm.bias"}[key]
        d = shards[(t, s)]["language_model"]
        for part in legacy_key.split("/"):
            d = d[part]
        return d
    wte = torch.cat([top(t, 0, "embedding.word_embeddings.weight") for t in range(tp)])
    x = wte[idx]
    if gpt2:
        x = x + top(0, 0, "embedding.position_embeddings.weight")[:T]
    cos, sin = (None, None) if gpt2 else ref.rope_cos_sin(T, hd, cfg.rope_theta, torch.float32)
    layer0 = 0
    for s, n in enumerate(stages):
        for local in range(n):
            num = layer0 + local if global_numbers else local

            def L(t, role):
                key = f"layers.{num}.{names[role]}"
                return shards[(t, s)]["language_model"]["encoder"][key] if legacy else shards[(t, s)]["decoder." + key]
            if gpt2:
                h = F.layer_norm(x, (H,), L(0, "ln1_w"), L(0, "ln1_b"), cfg.eps)
            else:
                h = ref._rms_norm(x, L(0, "ln1_w"), cfg.eps)
            attn = 0
            for t in range(tp):
                mixed = h @ L(t, "qkv_w").t() + (L(t, "qkv_b") if gpt2 or cfg.qkv_bias else 0)
                g = mixed.shape[-1] // ((per + 2) * hd)  # this piece's query groups
                mixed = mixed.view(B, T, g, (per + 2) * hd)
                q, k, v = torch.split(mixed, [per * hd, hd, hd], dim=-1)
                q = q.reshape(B, T, g * per, hd).transpose(1, 2)
                k = k.reshape(B, T, g, hd).transpose(1, 2).repeat_interleave(per, dim=1)
                v = v.reshape(B, T, g, hd).transpose(1, 2).repeat_interleave(per, dim=1)
                if not gpt2:
                    q = q * cos + ref._rotate_half(q) * sin
                    k = k * cos + ref._rotate_half(k) * sin
                ctx = ref._causal_attention(q, k, v).transpose(1, 2).reshape(B, T, g * per * hd)
                attn = attn + ctx @ L(t, "proj_w").t()
            x = x + attn + (L(0, "proj_b") if gpt2 else 0)
            if gpt2:
                h = F.layer_norm(x, (H,), L(0, "ln2_w"), L(0, "ln2_b"), cfg.eps)
            else:
                h = ref._rms_norm(x, L(0, "ln2_w"), cfg.eps)
            mlp = 0
            for t in range(tp):
                if gpt2:
                    a = ref._gelu_new(h @ L(t, "fc1_w").t() + L(t, "fc1_b"))
                else:
                    a = torch.chunk(h @ L(t, "fc1_w").t(), 2, dim=-1)
                    a = F.silu(a[0]) * a[1]
                mlp = mlp + a @ L(t, "fc2_w").t()
            x = x + mlp + (L(0, "fc2_b") if gpt2 else 0)
        layer0 += n
    last = len(stages) - 1
    if gpt2:
        x = F.layer_norm(x, (H,), top(0, last, "decoder.final_layernorm.weight"), top(0, last, "decoder.final_layernorm.bias"), cfg.eps)
        return (x @ wte.t())[..., :cfg.vocab]
    x = ref._rms_norm(x, top(0, last, "decoder.final_layernorm.weight"), cfg.eps)
    out = torch.cat([shards[(t, last)]["output_layer.weight"] for t in range(tp)])
    return (x @ out.t())[..., :cfg.vocab]


def write_checkpoint(root, shards, tp, stages, args, iteration, dtype, version=3.0, tracker=True):
    shutil.rmtree(root, ignore_errors=True)
    it_dir = os.path.join(root, "release" if iteration < 0 else f"iter_{iteration:07d}")
    for (t, s), model in shards.items():
        d = os.path.join(it_dir, f"mp_rank_{t:02d}" if len(stages) == 1 else f"mp_rank_{t:02d}_{s:03d}")
        os.makedirs(d, exist_ok=True)
        model = cast(model, dtype)
        state = {"args": args, "checkpoint_version": version, "iteration": max(iteration, 0), "model": model,
                 "optimizer": {"optimizer": {"state": {}, "param_groups": [{"lr": 1e-4, "params": [0, 1]}]}, "fp32_from_fp16_params": []},
                 "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": 800},
                 "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                                "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]}
        torch.save(state, os.path.join(d, "model_optim_rng.pt"))
    if tracker:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("release" if iteration < 0 else str(iteration))


def cast(model, dtype):
    if isinstance(model, dict):
        return type(model)((k, cast(v, dtype)) for k, v in model.items())
    return model.to(dtype) if isinstance(model, torch.Tensor) else model


def megatron_args(cfg, tp, pp, seq, max_pos, vocab_padded, dtype):
    gpt2 = cfg.arch == "gpt2"
    return argparse.Namespace(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads, ffn_hidden_size=cfg.ffn,
        seq_length=seq, max_position_embeddings=max_pos, padded_vocab_size=vocab_padded,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, micro_batch_size=2, global_batch_size=8,
        normalization="LayerNorm" if gpt2 else "RMSNorm", position_embedding_type="learned_absolute" if gpt2 else "rope",
        swiglu=not gpt2, group_query_attention=cfg.kv_heads != cfg.heads, num_query_groups=cfg.kv_heads,
        untie_embeddings_and_output_weights=not gpt2, add_bias_linear=gpt2, add_qkv_bias=not gpt2 and cfg.qkv_bias,
        norm_epsilon=cfg.eps, init_method_std=0.02,
        rotary_base=int(cfg.rope_theta or 10000), bias_gelu_fusion=True, openai_gelu=False, apply_residual_connection_post_layernorm=False,
        params_dtype=dtype, data_path=["1.0", "/data/corpus_text_document"], lr=1e-4, load=None, save="/ckpt", fp16=False,
        bf16=dtype == torch.bfloat16, consumed_train_samples=800, hetero_pipeline_stages=None)


def main():
    alloy, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    fresh_workdir_with_corpus(alloy, work)
    torch.manual_seed(0)
    cases = [
        # name, arch, layers, hidden, heads, kv, ffn, tp, stages, code, vocab_padded, seq, max_pos, dtype, iteration,
        # global layer numbers in later stages, checkpoint_version
        ("gpt2-legacy-tp2-pp2", "gpt2", 4, 32, 4, None, 128, 2, [2, 2], "legacy", 512, 16, 24, torch.float32, 100, False, 3.0),
        ("llama-gqa-core-te-tp2-pp2-bf16", "llama", 3, 32, 4, 2, 48, 2, [2, 1], "core-te", 512, 16, 16, torch.bfloat16, 40, True, 3.0),
        ("gpt2-legacy-one-file-release", "gpt2", 2, 24, 3, None, 96, 1, [2], "legacy", 384, 16, 16, torch.float32, -1, False, 3.0),
        # Megatron-Core's own norms, layers numbered per stage, the tied embedding's copy on the last stage
        ("gpt2-core-local-tp2-pp3", "gpt2", 3, 32, 4, None, 64, 2, [1, 1, 1], "core-local", 512, 16, 16, torch.float32, 7, False, 3.0),
        # checkpoint_version 1 kept each piece's QKV rows as [heads, head_dim, 3]
        ("gpt2-legacy-version1-tp2", "gpt2", 2, 32, 4, None, 64, 2, [2], "legacy", 512, 16, 16, torch.float32, 5, False, 1.0),
        # --add-qkv-bias (Qwen-style): the fused bias is split into q, k and v like the weight
        ("qwen2-core-local-tp2", "qwen2", 2, 32, 4, 2, 48, 2, [2], "core-local", 512, 16, 16, torch.float32, 3, False, 3.0),
    ]
    for name, arch, layers, hidden, heads, kv, ffn, tp, stages, code, vpad, seq, max_pos, dtype, iteration, glob, version in cases:
        hf = ref.make_hf_config(arch, layers, hidden, heads, 300, max_pos if arch == "gpt2" else seq, kv_heads=kv, ffn=ffn)
        cfg = ref.parse_config(hf)
        if cfg.arch == "gpt2":
            cfg.qkv_bias = False
        p = ref.init_params(cfg, seed=len(name), norm_jitter=0.1)
        shards = to_megatron(cfg, p, tp, stages, code, vpad, max_pos, glob, version)
        if version >= 2:  # version 1's rows are what Megatron reorders on load; the arithmetic below is version 2's
            idx = torch.randint(0, cfg.vocab, (2, seq))
            with torch.no_grad():
                want = ref.logits_fn(cfg, p, idx)
                got = megatron_forward(cfg, shards, tp, stages, code, idx, glob)
            err = ((got - want).abs().max() / want.abs().max()).item()
            check(err < 1e-5, f"{name}: Megatron's arithmetic on the written pieces gives the model's logits (rel {err:.1e})")

        ckpt = os.path.join(work, name)
        write_checkpoint(ckpt, shards, tp, stages, megatron_args(cfg, tp, len(stages), seq, max_pos, vpad, dtype), iteration, dtype, version)
        src = ckpt if tp * len(stages) > 1 else os.path.join(ckpt, "release", "mp_rank_00", "model_optim_rng.pt")
        run = os.path.join(work, name + "-run")
        shutil.rmtree(run, ignore_errors=True)
        r = sh([alloy, "import", "--megatron", src, "-o", run])
        # One file says nothing of the directory it sits in: a release file reads as iteration 0.
        label = f"iteration {max(iteration, 0)}" if src.endswith(".pt") else "the release checkpoint" if iteration < 0 else f"iteration {iteration}"
        code_word = "legacy" if code == "legacy" else "core"
        check(label in r.stdout and f"{code_word} Megatron code, {tp} tensor-parallel x {len(stages)} pipeline" in r.stdout,
              f"{name}: import reports {label}, the {code} code and the {tp} x {len(stages)} layout: {r.stdout.strip()[-160:]}")
        out = os.path.join(work, name + ".safetensors")
        sh([alloy, "export", "--checkpoint", run, "-o", out])
        got_w, _ = st.load(out)
        expect = dict(p)
        if arch == "gpt2":
            expect["wte.weight"] = torch.cat([p["wte.weight"], torch.zeros(vpad - cfg.vocab, hidden)])
            expect["wpe.weight"] = p["wpe.weight"][:seq]
        else:
            expect["model.embed_tokens.weight"] = torch.cat([p["model.embed_tokens.weight"], torch.zeros(vpad - cfg.vocab, hidden)])
            expect["lm_head.weight"] = torch.cat([p["lm_head.weight"], torch.zeros(vpad - cfg.vocab, hidden)])
        expect = {k: v.to(dtype).to(torch.float32) for k, v in expect.items()}
        check(set(got_w) == set(expect), f"{name}: the export names every weight of the model ({len(got_w)} of {len(expect)})")
        bad = [k for k in expect if k in got_w and not torch.equal(got_w[k], expect[k])]
        check(not bad, f"{name}: every tensor equals the original bit for bit{' (differ: ' + ', '.join(bad[:4]) + ')' if bad else ''}")

        # Training starts from it: --init-from, and Megatron's own --load of the directory.
        yaml = os.path.join(work, name + ".yaml")
        with open(yaml, "w") as f:
            f.write(f"model: {{arch: {cfg.arch}, layers: {layers}, hidden: {hidden}, heads: {heads}, kv_heads: {kv or 0}, ffn: {ffn}, "
                    f"seq_len: {seq}, vocab_size: {vpad}, norm_eps: {cfg.eps}, qkv_bias: {str(cfg.qkv_bias).lower()}}}\n"
                    f"data: {{prefix: {work}/data/corpus, tokenizer: byte}}\n"
                    "train: {steps: 2, global_batch: 4, eval_interval: 0, threads: 1, checkpoint_interval: 0}\n")
        if name.startswith("gpt2-legacy-tp2"):
            r = sh([alloy, "train", "-c", yaml, "--init-from", ckpt, "--set", f"output.dir={work}/{name}-train"])
            check("initial weights from " + ckpt in r.stdout + r.stderr, f"{name}: alloy train --init-from starts from the checkpoint")
            r = sh([alloy, "train", "-c", yaml, "--load", ckpt, "--set", f"output.dir={work}/{name}-load"])
            log = r.stdout + r.stderr
            check("is a Megatron-LM checkpoint" in log and "initial weights from " + ckpt in log,
                  f"{name}: Megatron's --load of the directory starts from its weights")
            # The config's vocabulary must be the padded one; the message says which.
            r = sh([alloy, "train", "-c", yaml, "--init-from", ckpt, "--set", "model.vocab_size=300",
                    "--set", f"output.dir={work}/{name}-bad"], expect_fail=True)
            check(f"model.vocab_size={vpad}" in r.stdout + r.stderr, f"{name}: a config with the unpadded vocabulary is told the padded size")
            # A missing piece is named.
            piece = os.path.join(ckpt, f"iter_{iteration:07d}", "mp_rank_01_001")
            shutil.move(piece, piece + ".away")
            r = sh([alloy, "import", "--megatron", ckpt, "-o", run + "-missing"], expect_fail=True)
            check("lacks mp_rank_01_001" in r.stdout + r.stderr, f"{name}: a missing piece is named: {(r.stdout + r.stderr).strip()[-200:]}")
            shutil.move(piece + ".away", piece)
        if name.startswith(("llama", "qwen2")):
            r = sh([alloy, "train", "-c", yaml, "--init-from", ckpt, "--set", f"output.dir={work}/{name}-train"])
            check("initial weights from " + ckpt in r.stdout + r.stderr, f"{name}: alloy train --init-from starts from the checkpoint")
        if name.startswith("qwen2"):  # a config without the biases is told which key disagrees
            r = sh([alloy, "train", "-c", yaml, "--init-from", ckpt, "--set", "model.qkv_bias=false",
                    "--set", f"output.dir={work}/{name}-nobias"], expect_fail=True)
            check("args.add_qkv_bias is true, the model's config says model.qkv_bias: false" in r.stdout + r.stderr,
                  f"{name}: a config without model.qkv_bias is refused by that key: {(r.stdout + r.stderr).strip()[-200:]}")

    # The pre-1.6 pickle format is refused with the way out.
    legacy = os.path.join(work, "legacy", "mp_rank_00")
    os.makedirs(legacy, exist_ok=True)
    torch.save({"model": {}}, os.path.join(legacy, "model_optim_rng.pt"), _use_new_zipfile_serialization=False)
    r = sh([alloy, "import", "--megatron", os.path.dirname(legacy), "-o", os.path.join(work, "legacy-run")], expect_fail=True)
    check("legacy format" in r.stdout + r.stderr, "the pre-1.6 torch.save format is refused, saying so")

    check.finish()


if __name__ == "__main__":
    main()
