#!/usr/bin/env python3
"""Independent PyTorch reference for Alloy's GPT-2 and Llama models.

Usage:
    python3 reference.py DIR [--rtol 1e-5] [-v] [--threads 1]
    python3 reference.py --self-test

DIR is written by Alloy's C++ dump tool and holds config.json (HuggingFace
config), weights.safetensors (HF names and layouts), tokens.safetensors
("tokens", I64 [B, T+1]) and grads.safetensors (Alloy's gradients under the
weight names, metadata {"loss": "<17 significant digits>"}). This script
recomputes loss and gradients with autograd and compares them with Alloy's.
Exit status: 0 iff everything is within rtol, 1 otherwise.

The models are written from the HuggingFace definitions (GPT2LMHeadModel,
LlamaForCausalLM) without importing transformers, with no dropout, and are
computed entirely in the weights' dtype. Note that HF itself upcasts some
steps (Llama RMSNorm/softmax/RoPE tables) to float32, which for F64 weights
would *lose* precision; here F64 stays F64 so it serves as a tight reference.

The model code (parse_config, param_shapes, init_params, loss_fn) is also
imported by bench/pytorch_train_step.py.
"""

import argparse
import json
import math
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402  (sibling module; path set up above)


# --------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------

class Config:
    """Architecture hyper-parameters, normalised from an HF config dict."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __repr__(self):
        return "Config(%s)" % ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())


def _reject(cond, msg):
    # Options that change the math and that this reference does not model are
    # refused loudly: silently ignoring them would make "parity" meaningless.
    if cond:
        raise ValueError("unsupported config: " + msg)


def parse_config(hf):
    mt = hf.get("model_type")
    if mt == "gpt2":
        H, nh = hf["n_embd"], hf["n_head"]
        _reject(H % nh != 0, f"n_embd {H} not divisible by n_head {nh}")
        act = hf.get("activation_function", "gelu_new")
        # gelu_pytorch_tanh is the same function as gelu_new.
        _reject(act not in ("gelu_new", "gelu_pytorch_tanh"), f"activation_function={act}")
        _reject(hf.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx")
        _reject(not hf.get("scale_attn_weights", True), "scale_attn_weights=false")
        _reject(not hf.get("tie_word_embeddings", True), "untied gpt2 head")
        _reject(hf.get("add_cross_attention", False), "add_cross_attention")
        return Config(arch="gpt2", vocab=hf["vocab_size"], hidden=H, layers=hf["n_layer"],
                      heads=nh, kv_heads=nh, head_dim=H // nh,
                      ffn=hf.get("n_inner") or 4 * H,
                      eps=hf.get("layer_norm_epsilon", 1e-5),
                      max_pos=hf["n_positions"], rope_theta=None)
    if mt in ("llama", "qwen2"):
        # Qwen2: LLaMA's block with biases on q, k and v (HF's Qwen2Attention).
        _reject(mt == "qwen2" and hf.get("use_sliding_window", False), "use_sliding_window")
        H, nh = hf["hidden_size"], hf["num_attention_heads"]
        nkv = hf.get("num_key_value_heads") or nh
        hd = hf.get("head_dim") or H // nh
        _reject(hf.get("head_dim") is None and H % nh != 0, "hidden_size not divisible by heads")
        _reject(nh % nkv != 0, f"num_attention_heads {nh} not a multiple of kv heads {nkv}")
        _reject(hd % 2 != 0, f"odd head_dim {hd}")
        _reject(hf.get("hidden_act", "silu") != "silu", f"hidden_act={hf.get('hidden_act')}")
        _reject(hf.get("attention_bias", False), "attention_bias")
        _reject(hf.get("mlp_bias", False), "mlp_bias")
        _reject(hf.get("tie_word_embeddings", False), "tied llama head")
        _reject(hf.get("rope_scaling") not in (None, {}), f"rope_scaling={hf.get('rope_scaling')}")
        _reject(hf.get("pretraining_tp", 1) != 1, "pretraining_tp != 1")
        return Config(arch="llama", vocab=hf["vocab_size"], hidden=H,
                      layers=hf["num_hidden_layers"], heads=nh, kv_heads=nkv, head_dim=hd,
                      ffn=hf["intermediate_size"], eps=hf.get("rms_norm_eps", 1e-6),
                      max_pos=hf.get("max_position_embeddings"),
                      rope_theta=float(hf.get("rope_theta", 10000.0)), qkv_bias=mt == "qwen2")
    raise ValueError(f"unsupported model_type {mt!r}")


def make_hf_config(arch, layers, hidden, heads, vocab, max_pos, kv_heads=None, ffn=None,
                   eps=None, rope_theta=10000.0):
    """Build an HF-style config dict (used by the self-test and the benchmark)."""
    if arch == "gpt2":
        return {"model_type": "gpt2", "n_layer": layers, "n_head": heads, "n_embd": hidden,
                "n_positions": max_pos, "vocab_size": vocab, "n_inner": ffn,
                "layer_norm_epsilon": 1e-5 if eps is None else eps,
                "activation_function": "gelu_new"}
    if arch == "llama":
        return {"model_type": "llama", "hidden_size": hidden,
                "intermediate_size": ffn or 4 * hidden, "num_hidden_layers": layers,
                "num_attention_heads": heads, "num_key_value_heads": kv_heads or heads,
                "rms_norm_eps": 1e-6 if eps is None else eps, "rope_theta": rope_theta,
                "max_position_embeddings": max_pos, "vocab_size": vocab,
                "hidden_act": "silu", "tie_word_embeddings": False}
    if arch == "qwen2":
        hf = make_hf_config("llama", layers, hidden, heads, vocab, max_pos, kv_heads, ffn, eps, rope_theta)
        hf.update(model_type="qwen2", use_sliding_window=False)
        return hf
    raise ValueError(arch)


def param_shapes(cfg):
    """Every parameter's HF name and shape, in HF module order."""
    V, H, F_, hd = cfg.vocab, cfg.hidden, cfg.ffn, cfg.head_dim
    s = {}
    if cfg.arch == "gpt2":
        s["wte.weight"] = [V, H]
        s["wpe.weight"] = [cfg.max_pos, H]
        for i in range(cfg.layers):
            p = f"h.{i}."
            s[p + "ln_1.weight"] = [H]
            s[p + "ln_1.bias"] = [H]
            # Conv1D stores weights as [in, out] (transposed w.r.t. nn.Linear).
            s[p + "attn.c_attn.weight"] = [H, 3 * H]
            s[p + "attn.c_attn.bias"] = [3 * H]
            s[p + "attn.c_proj.weight"] = [H, H]
            s[p + "attn.c_proj.bias"] = [H]
            s[p + "ln_2.weight"] = [H]
            s[p + "ln_2.bias"] = [H]
            s[p + "mlp.c_fc.weight"] = [H, F_]
            s[p + "mlp.c_fc.bias"] = [F_]
            s[p + "mlp.c_proj.weight"] = [F_, H]
            s[p + "mlp.c_proj.bias"] = [H]
        s["ln_f.weight"] = [H]
        s["ln_f.bias"] = [H]
    else:
        s["model.embed_tokens.weight"] = [V, H]
        for i in range(cfg.layers):
            p = f"model.layers.{i}."
            s[p + "input_layernorm.weight"] = [H]
            # nn.Linear layout: [out, in].
            s[p + "self_attn.q_proj.weight"] = [cfg.heads * hd, H]
            s[p + "self_attn.k_proj.weight"] = [cfg.kv_heads * hd, H]
            s[p + "self_attn.v_proj.weight"] = [cfg.kv_heads * hd, H]
            s[p + "self_attn.o_proj.weight"] = [H, cfg.heads * hd]
            if cfg.qkv_bias:
                s[p + "self_attn.q_proj.bias"] = [cfg.heads * hd]
                s[p + "self_attn.k_proj.bias"] = [cfg.kv_heads * hd]
                s[p + "self_attn.v_proj.bias"] = [cfg.kv_heads * hd]
            s[p + "post_attention_layernorm.weight"] = [H]
            s[p + "mlp.gate_proj.weight"] = [F_, H]
            s[p + "mlp.up_proj.weight"] = [F_, H]
            s[p + "mlp.down_proj.weight"] = [H, F_]
        s["model.norm.weight"] = [H]
        s["lm_head.weight"] = [V, H]
    return s


def init_params(cfg, dtype=torch.float32, seed=0, std=0.02, norm_jitter=0.0):
    """Random parameters: N(0, std) matrices/embeddings, norms weight=1 bias=0.

    norm_jitter > 0 perturbs norm weights/biases too, so that tests exercise
    every gradient path (a unit weight / zero bias hides layout mistakes).
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        is_norm = len(shape) == 1 and ("ln_" in name or "norm" in name)
        if is_norm:
            base = 1.0 if name.endswith(".weight") else 0.0
            t = base + norm_jitter * torch.randn(shape, generator=g, dtype=torch.float64)
        elif len(shape) == 1:  # linear biases (GPT-2's, Qwen2's q/k/v)
            t = norm_jitter * torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            t = std * torch.randn(shape, generator=g, dtype=torch.float64)
        out[name] = t.to(dtype)
    return out


# --------------------------------------------------------------------------
# Models (functional: params is a dict of HF-named tensors)
# --------------------------------------------------------------------------

def _causal_attention(q, k, v):
    """q, k, v: [B, nH, T, hd] -> [B, nH, T, hd], causal, scale 1/sqrt(hd)."""
    T, hd = q.shape[-2], q.shape[-1]
    att = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hd)
    # Diagonal is always kept, so no row is fully masked and -inf is safe.
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    att = att.masked_fill(mask, float("-inf"))
    return torch.matmul(torch.softmax(att, dim=-1), v)


def _gelu_new(x):
    # HF NewGELUActivation (tanh approximation), written out explicitly.
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def gpt2_logits(cfg, p, idx):
    B, T = idx.shape
    H, nh, hd = cfg.hidden, cfg.heads, cfg.head_dim
    if T > cfg.max_pos:
        raise ValueError(f"sequence length {T} exceeds n_positions {cfg.max_pos}")
    pos = torch.arange(T, device=idx.device)
    x = p["wte.weight"][idx] + p["wpe.weight"][pos]
    for i in range(cfg.layers):
        pre = f"h.{i}."
        h = F.layer_norm(x, (H,), p[pre + "ln_1.weight"], p[pre + "ln_1.bias"], cfg.eps)
        qkv = h @ p[pre + "attn.c_attn.weight"] + p[pre + "attn.c_attn.bias"]
        q, k, v = qkv.split(H, dim=-1)  # q, k, v in that order
        q, k, v = (t.view(B, T, nh, hd).transpose(1, 2) for t in (q, k, v))
        a = _causal_attention(q, k, v).transpose(1, 2).reshape(B, T, H)
        x = x + (a @ p[pre + "attn.c_proj.weight"] + p[pre + "attn.c_proj.bias"])
        h = F.layer_norm(x, (H,), p[pre + "ln_2.weight"], p[pre + "ln_2.bias"], cfg.eps)
        h = _gelu_new(h @ p[pre + "mlp.c_fc.weight"] + p[pre + "mlp.c_fc.bias"])
        x = x + (h @ p[pre + "mlp.c_proj.weight"] + p[pre + "mlp.c_proj.bias"])
    x = F.layer_norm(x, (H,), p["ln_f.weight"], p["ln_f.bias"], cfg.eps)
    return x @ p["wte.weight"].t()  # tied head


def _rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_cos_sin(T, hd, theta, dtype, device=None):
    """cos, sin of shape [T, hd] (HF rotate_half convention: emb = cat(freqs, freqs))."""
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd)
    freqs = torch.outer(torch.arange(T, dtype=torch.float64, device=device), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    # Tables built in float64, then rounded once to the compute dtype.
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def llama_logits(cfg, p, idx):
    B, T = idx.shape
    H, nh, nkv, hd = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
    rep = nh // nkv
    cos, sin = rope_cos_sin(T, hd, cfg.rope_theta, p["model.norm.weight"].dtype, idx.device)
    x = p["model.embed_tokens.weight"][idx]
    for i in range(cfg.layers):
        pre = f"model.layers.{i}."
        h = _rms_norm(x, p[pre + "input_layernorm.weight"], cfg.eps)
        def lin(name):
            y = h @ p[pre + f"self_attn.{name}.weight"].t()
            return y + p[pre + f"self_attn.{name}.bias"] if cfg.qkv_bias else y
        q = lin("q_proj").view(B, T, nh, hd).transpose(1, 2)
        k = lin("k_proj").view(B, T, nkv, hd).transpose(1, 2)
        v = lin("v_proj").view(B, T, nkv, hd).transpose(1, 2)
        # HF casts the tables to the projections' dtype (bf16 under autocast; a no-op in fp32).
        c, s = cos.to(q.dtype), sin.to(q.dtype)
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        # HF repeat_kv: query head j uses kv head j // rep (interleave, not tile).
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        a = _causal_attention(q, k, v).transpose(1, 2).reshape(B, T, nh * hd)
        x = x + a @ p[pre + "self_attn.o_proj.weight"].t()
        h = _rms_norm(x, p[pre + "post_attention_layernorm.weight"], cfg.eps)
        gate = F.silu(h @ p[pre + "mlp.gate_proj.weight"].t())
        up = h @ p[pre + "mlp.up_proj.weight"].t()
        x = x + (gate * up) @ p[pre + "mlp.down_proj.weight"].t()
    x = _rms_norm(x, p["model.norm.weight"], cfg.eps)
    return x @ p["lm_head.weight"].t()


def logits_fn(cfg, params, idx):
    return (gpt2_logits if cfg.arch == "gpt2" else llama_logits)(cfg, params, idx)


def loss_fn(cfg, params, tokens):
    """tokens [B, T+1] -> mean next-token cross-entropy over all B*T positions."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = logits_fn(cfg, params, inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def reference_loss_and_grads(cfg, weights, tokens):
    params = {n: t.detach().clone().requires_grad_(True) for n, t in weights.items()}
    loss = loss_fn(cfg, params, tokens)
    names = list(params)
    grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
    out = {}
    for n, g in zip(names, grads):
        # allow_unused covers e.g. a parameter whose path is absent; its true
        # gradient is zero, which is what Alloy must report too.
        out[n] = torch.zeros_like(params[n]) if g is None else g.detach()
    return loss.item(), out


# --------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------

def _check_names(kind, got, expected):
    """Return error strings for missing/extra names and wrong shapes."""
    errs = []
    missing = [n for n in expected if n not in got]
    extra = sorted(n for n in got if n not in expected)
    if missing:
        errs.append(f"{kind}: {len(missing)} missing: {', '.join(missing[:8])}"
                    + (" ..." if len(missing) > 8 else ""))
    if extra:
        errs.append(f"{kind}: {len(extra)} unexpected: {', '.join(extra[:8])}"
                    + (" ..." if len(extra) > 8 else ""))
    for n, shape in expected.items():
        if n in got and list(got[n].shape) != list(shape):
            errs.append(f"{kind}: {n} has shape {list(got[n].shape)}, expected {list(shape)}")
    return errs


def rel_error(a, b):
    """||a-b|| / ||b|| in float64; absolute ||a-b|| when the reference b is all zero.

    Returns (rel, max_abs, is_absolute).
    """
    a, b = a.to(torch.float64), b.to(torch.float64)
    diff = a - b
    dn, bn = diff.norm().item(), b.norm().item()
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    if not math.isfinite(dn):  # NaN/inf anywhere in Alloy's tensor is a failure
        return float("inf"), max_abs, False
    if bn == 0.0:
        return dn, max_abs, True
    return dn / bn, max_abs, False


def check_dir(d, rtol=1e-5, verbose=False, out=print):
    """Compare Alloy's dump in directory d against the reference. Returns True iff OK."""
    with open(os.path.join(d, "config.json")) as f:
        hf = json.load(f)
    cfg = parse_config(hf)
    weights, _ = st.load(os.path.join(d, "weights.safetensors"))
    toks, _ = st.load(os.path.join(d, "tokens.safetensors"))
    grads, meta = st.load(os.path.join(d, "grads.safetensors"))

    shapes = param_shapes(cfg)
    errs = _check_names("weights.safetensors", weights, shapes)
    errs += _check_names("grads.safetensors", grads, shapes)
    if "tokens" not in toks:
        errs.append("tokens.safetensors: no tensor named 'tokens'")
    if errs:
        for e in errs:
            out("ERROR " + e)
        out(f"FAIL {cfg.arch}: {len(errs)} structural error(s)")
        return False

    dtypes = {t.dtype for t in weights.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, torch.float64):
        out(f"FAIL {cfg.arch}: weights must all be F32 or all F64, got {sorted(map(str, dtypes))}")
        return False
    dtype = next(iter(dtypes))
    tokens = toks["tokens"]
    if tokens.dim() != 2 or tokens.shape[1] < 2 or tokens.dtype not in (torch.int64, torch.int32):
        out(f"FAIL {cfg.arch}: tokens must be integer [B, T+1] with T>=1, got "
            f"{tokens.dtype} {list(tokens.shape)}")
        return False
    tokens = tokens.long()
    if tokens.min().item() < 0 or tokens.max().item() >= cfg.vocab:
        out(f"FAIL {cfg.arch}: token ids outside [0, {cfg.vocab})")
        return False
    if "loss" not in meta:
        out(f"FAIL {cfg.arch}: grads.safetensors metadata has no 'loss'")
        return False
    alloy_loss = float(meta["loss"])

    ref_loss, ref_grads = reference_loss_and_grads(cfg, weights, tokens)
    if not math.isfinite(ref_loss):
        out(f"FAIL {cfg.arch}: reference loss is {ref_loss}; inputs are degenerate")
        return False

    B, T = tokens.shape[0], tokens.shape[1] - 1
    tag = f"{cfg.arch} {'F64' if dtype == torch.float64 else 'F32'} B={B} T={T}"
    loss_rel = abs(alloy_loss - ref_loss) / abs(ref_loss) if ref_loss != 0 else abs(alloy_loss)
    if not math.isfinite(loss_rel):
        loss_rel = float("inf")
    loss_ok = loss_rel <= rtol

    rows = []  # (rel, name, max_abs, absolute, ref_norm)
    for name in shapes:
        a, b = grads[name], ref_grads[name]
        if a.dtype != dtype:
            out(f"WARN {name}: gradient dtype {a.dtype} differs from weights dtype {dtype}")
        rel, max_abs, absolute = rel_error(a, b)
        rows.append((rel, name, max_abs, absolute, b.to(torch.float64).norm().item()))
    bad = sorted((r for r in rows if not r[0] <= rtol), reverse=True)

    if verbose:
        out(f"{'ok' if loss_ok else 'BAD':4s} loss alloy={alloy_loss:.17g} ref={ref_loss:.17g} "
            f"rel={loss_rel:.3e}")
        for rel, name, max_abs, absolute, bn in rows:
            status = "ok" if rel <= rtol else "BAD"
            kind = "abs" if absolute else "rel"
            out(f"{status:4s} {kind}={rel:.3e} max_abs={max_abs:.3e} |ref|={bn:.3e} "
                f"{name} {list(grads[name].shape)}")

    worst = max(rows)
    ok = loss_ok and not bad
    out(f"{'PASS' if ok else 'FAIL'} {tag}: loss alloy={alloy_loss:.10g} ref={ref_loss:.10g} "
        f"rel={loss_rel:.3e}; grads {len(rows) - len(bad)}/{len(rows)} within rtol={rtol:g}, "
        f"worst {worst[0]:.3e} ({worst[1]}, max_abs={worst[2]:.3e})")
    if not ok:
        if not loss_ok:
            out(f"  loss out of tolerance: rel={loss_rel:.3e}")
        for rel, name, max_abs, absolute, bn in bad[:10]:
            out(f"  {name}: {'abs' if absolute else 'rel'}={rel:.3e} max_abs={max_abs:.3e} "
                f"|ref|={bn:.3e}")
        if len(bad) > 10:
            out(f"  ... and {len(bad) - 10} more")
    return ok


# --------------------------------------------------------------------------
# Self-test
# --------------------------------------------------------------------------

def write_dump(d, hf_config, weights, tokens, grads, loss):
    """Write a directory in the layout Alloy's dump tool produces."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)
    st.save(os.path.join(d, "weights.safetensors"), weights)
    st.save(os.path.join(d, "tokens.safetensors"), {"tokens": tokens})
    st.save(os.path.join(d, "grads.safetensors"), grads, {"loss": repr(float(loss))})


def _model_property_checks(log):
    """Checks of the model code itself against properties HF's models have.

    The dump self-test below only proves the *checker* works; these catch
    mistakes in the reference model where an independent formulation exists.
    """
    torch.manual_seed(0)
    failures = []

    def expect(cond, what):
        log(f"  {'ok  ' if cond else 'FAIL'} {what}")
        if not cond:
            failures.append(what)

    for arch in ("gpt2", "llama"):
        hf = make_hf_config(arch, layers=2, hidden=16, heads=4, vocab=23, max_pos=16,
                            kv_heads=2 if arch == "llama" else None, ffn=24)
        cfg = parse_config(hf)
        p = init_params(cfg, torch.float64, seed=1, std=0.3, norm_jitter=0.2)
        idx = torch.randint(0, cfg.vocab, (2, 10))
        # Causality: changing later tokens must not change earlier logits.
        idx2 = idx.clone()
        idx2[:, 6:] = (idx2[:, 6:] + 5) % cfg.vocab
        l1, l2 = logits_fn(cfg, p, idx), logits_fn(cfg, p, idx2)
        expect(torch.allclose(l1[:, :6], l2[:, :6], rtol=0, atol=1e-12)
               and not torch.allclose(l1[:, 6:], l2[:, 6:]), f"{arch}: causal")
        # Batch independence: each row computed alone equals the batched result.
        expect(torch.allclose(logits_fn(cfg, p, idx[1:]), l1[1:], rtol=0, atol=1e-12),
               f"{arch}: batch rows independent")

    # GQA: kv_heads=2 must equal kv_heads=4 with each kv head's weight rows
    # duplicated for the query heads that share it (HF repeat_kv semantics).
    hf = make_hf_config("llama", layers=1, hidden=16, heads=4, vocab=23, max_pos=16,
                        kv_heads=2, ffn=24)
    cfg = parse_config(hf)
    p = init_params(cfg, torch.float64, seed=2, std=0.3, norm_jitter=0.2)
    cfg_full = parse_config(dict(hf, num_key_value_heads=4))
    pf = dict(p)
    hd = cfg.head_dim
    for n in ("k_proj", "v_proj"):
        w = p[f"model.layers.0.self_attn.{n}.weight"].view(2, hd, 16)
        pf[f"model.layers.0.self_attn.{n}.weight"] = w.repeat_interleave(2, dim=0).reshape(4 * hd, 16)
    idx = torch.randint(0, cfg.vocab, (2, 9))
    expect(torch.allclose(logits_fn(cfg, p, idx), logits_fn(cfg_full, pf, idx), rtol=0, atol=1e-12),
           "llama: GQA equals MHA with repeat_interleaved kv weights")

    # RoPE via complex numbers with the rotate_half pairing (i, i + hd/2):
    # z_i = x_i + j x_{i+hd/2} is multiplied by exp(j * pos * inv_freq_i).
    T, hd, theta = 7, 8, 500.0
    x = torch.randn(T, hd, dtype=torch.float64)
    cos, sin = rope_cos_sin(T, hd, theta, torch.float64)
    rot = x * cos + _rotate_half(x) * sin
    z = torch.complex(x[:, :hd // 2], x[:, hd // 2:])
    ang = torch.outer(torch.arange(T, dtype=torch.float64),
                      torch.tensor([theta ** (-2.0 * i / hd) for i in range(hd // 2)],
                                   dtype=torch.float64))
    zr = z * torch.polar(torch.ones_like(ang), ang)
    expect(torch.allclose(rot, torch.cat((zr.real, zr.imag), -1), rtol=0, atol=1e-12),
           "rope: matches complex-rotation formulation")

    # Built-in equivalents of the hand-written pieces.
    xx = torch.randn(50, dtype=torch.float64) * 3
    expect(torch.allclose(_gelu_new(xx), F.gelu(xx, approximate="tanh"), rtol=0, atol=1e-14),
           "gelu_new equals F.gelu(approximate='tanh')")
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=torch.float64) for _ in range(3))
    slow = torch.zeros_like(q)
    for t in range(5):  # attention for query t over keys 0..t, one position at a time
        w = torch.softmax((q[:, :, t:t + 1] @ k[:, :, :t + 1].transpose(-1, -2)) / 2.0, -1)
        slow[:, :, t] = (w @ v[:, :, :t + 1])[:, :, 0]
    expect(torch.allclose(_causal_attention(q, k, v), slow, rtol=0, atol=1e-12),
           "causal attention matches per-position loop")
    return failures


def self_test():
    failures = []

    def log(s):
        print(s)

    def run_check(d, rtol, expect_ok, what):
        captured = []
        ok = check_dir(d, rtol=rtol, out=captured.append)
        good = ok == expect_ok
        log(f"  {'ok  ' if good else 'FAIL'} {what}: checker said {'PASS' if ok else 'FAIL'}")
        for line in captured:
            log("       | " + line)
        if not good:
            failures.append(what)

    log("model property checks:")
    failures += _model_property_checks(log)

    cases = [
        ("gpt2", torch.float64, dict(layers=2, hidden=16, heads=4, vocab=31, max_pos=12, ffn=None)),
        ("gpt2", torch.float32, dict(layers=2, hidden=16, heads=2, vocab=31, max_pos=12, ffn=40)),
        ("llama", torch.float64, dict(layers=2, hidden=16, heads=4, kv_heads=2, vocab=31,
                                      max_pos=12, ffn=24)),
        ("llama", torch.float32, dict(layers=2, hidden=24, heads=6, kv_heads=1, vocab=31,
                                      max_pos=12, ffn=40)),
        ("qwen2", torch.float64, dict(layers=2, hidden=16, heads=4, kv_heads=2, vocab=31,
                                      max_pos=12, ffn=24)),
    ]
    with tempfile.TemporaryDirectory(prefix="alloy-parity-selftest-") as root:
        for ci, (arch, dtype, kw) in enumerate(cases):
            hf = make_hf_config(arch, **kw)
            cfg = parse_config(hf)
            # Larger-than-usual init and jittered norms: every path carries signal.
            w = init_params(cfg, dtype, seed=10 + ci, std=0.3, norm_jitter=0.2)
            g = torch.Generator().manual_seed(100 + ci)
            tokens = torch.randint(0, cfg.vocab, (2, 10), generator=g)  # B=2, T=9
            loss, grads = reference_loss_and_grads(cfg, w, tokens)
            name = f"{arch} {str(dtype).replace('torch.', '')}"
            log(f"{name}: loss={loss:.6f}, {len(grads)} tensors")
            rtol = 1e-10 if dtype == torch.float64 else 1e-5

            d = os.path.join(root, f"case{ci}")
            write_dump(d, hf, w, tokens, grads, loss)
            # Round-trip through the file format must be lossless.
            w2, _ = st.load(os.path.join(d, "weights.safetensors"))
            rt = all(torch.equal(w[n], w2[n]) and w[n].dtype == w2[n].dtype for n in w)
            log(f"  {'ok  ' if rt else 'FAIL'} safetensors round trip")
            if not rt:
                failures.append(f"{name}: round trip")
            run_check(d, rtol, True, f"{name}: own gradients pass")

            def mutated(what, expect_ok=False, grads_fn=None, loss_val=None):
                gd = dict(grads) if grads_fn is None else grads_fn(dict(grads))
                dm = os.path.join(root, f"case{ci}-mut")
                write_dump(dm, hf, w, tokens, gd, loss if loss_val is None else loss_val)
                run_check(dm, rtol, expect_ok, f"{name}: {what}")

            if dtype == torch.float32:
                # A differently-rounded but correct computation (F64, rounded to
                # F32) must pass at the default rtol: shows 1e-5 is attainable
                # for an independent F32 implementation such as Alloy's.
                loss64, g64 = reference_loss_and_grads(
                    cfg, {n: t.double() for n, t in w.items()}, tokens)
                mutated("F64-computed gradients rounded to F32 pass", expect_ok=True,
                        grads_fn=lambda gd: {n: t.float() for n, t in g64.items()},
                        loss_val=loss64)

            # A 1e-3 relative error on the smallest and on the largest tensor.
            smallest = min(grads, key=lambda n: grads[n].numel())
            largest = max(grads, key=lambda n: grads[n].numel())
            for victim in (smallest, largest):
                def perturb(gd, victim=victim):
                    t = gd[victim].clone()
                    noise = torch.randn(t.shape, generator=torch.Generator().manual_seed(7),
                                        dtype=t.dtype)
                    gd[victim] = t + 1e-3 * noise * t.norm() / noise.norm()
                    return gd
                mutated(f"perturbed {victim} fails", grads_fn=perturb)
            # One element changed in one layer's attention weight gradient.
            attn = "h.1.attn.c_attn.weight" if arch == "gpt2" else "model.layers.1.self_attn.k_proj.weight"

            def one_elem(gd):
                t = gd[attn].clone()
                t.view(-1)[3] += 0.01 * t.norm()
                gd[attn] = t
                return gd
            mutated(f"one element of {attn} fails", grads_fn=one_elem)
            mutated("transposed-layout gradient fails",
                    grads_fn=lambda gd: {**gd, attn: gd[attn].t().contiguous().view(gd[attn].shape)})
            mutated("missing gradient fails", grads_fn=lambda gd: {n: t for n, t in gd.items() if n != largest})
            mutated("extra gradient fails", grads_fn=lambda gd: {**gd, "bogus.weight": gd[smallest]})
            mutated("loss off by 1e-4 relative fails", loss_val=loss * (1 + 1e-4))
            mutated("NaN gradient fails",
                    grads_fn=lambda gd: {**gd, smallest: torch.full_like(gd[smallest], float("nan"))})

        # The CLI path (argument parsing, exit status) on the last clean dump.
        import subprocess
        d = os.path.join(root, "case0")
        r = subprocess.run([sys.executable, os.path.abspath(__file__), d, "--rtol", "1e-10"],
                           capture_output=True, text=True)
        log(f"  {'ok  ' if r.returncode == 0 else 'FAIL'} CLI on clean dump exits {r.returncode}")
        if r.returncode != 0:
            failures.append("CLI clean")
            log(r.stdout + r.stderr)
        r = subprocess.run([sys.executable, os.path.abspath(__file__), os.path.join(root, "case0-mut")],
                           capture_output=True, text=True)
        log(f"  {'ok  ' if r.returncode == 1 else 'FAIL'} CLI on mutated dump exits {r.returncode}")
        if r.returncode != 1:
            failures.append("CLI mutated")
            log(r.stdout + r.stderr)

    if failures:
        print(f"SELF-TEST FAILED: {len(failures)} problem(s): " + "; ".join(failures))
        return 1
    print("SELF-TEST PASSED")
    return 0


# --------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", help="dump directory written by Alloy")
    ap.add_argument("--rtol", type=float, default=1e-5,
                    help="max relative error for the loss and each gradient (norm-relative)")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per tensor")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 keeps results reproducible and the shared box calm)")
    ap.add_argument("--self-test", action="store_true", help="verify the checker itself")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.self_test:
        return self_test()
    if not args.dir:
        ap.error("DIR is required (or --self-test)")
    try:
        return 0 if check_dir(args.dir, rtol=args.rtol, verbose=args.verbose) else 1
    except (OSError, ValueError, KeyError) as e:  # unreadable/malformed dump
        print(f"FAIL {args.dir}: {type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
